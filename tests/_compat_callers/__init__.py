"""Library-style callers of torch's object collectives, one module per way libraries write the call.

Each module offers the same six small functions (``all_gather``, ``gather``, ``broadcast``,
``scatter``, ``send``, ``recv``), written as library code writes them, so that
``tests/api/test_compat_patch.py`` can run one scenario through each and see which of them
``objcomm.compat.patch()`` reaches.
"""
