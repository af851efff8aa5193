"""The compiled part: restricted-pickle's two walks in C (``serializers/_restricted/_walks_c.c``: the fast
walk of plain data and the full walk).

Optional: where it cannot be built (no compiler), the install goes on and restricted-pickle runs the
same walks in pure Python (``serializers/_restricted/plain.py``, ``_pickle_scan.py``), slower on small
payloads. Everything else is in ``pyproject.toml``.
"""

from setuptools import Extension, setup

WALKS = Extension("serializers._restricted._walks_c", ["serializers/_restricted/_walks_c.c"], optional=True)
setup(ext_modules=[WALKS])
