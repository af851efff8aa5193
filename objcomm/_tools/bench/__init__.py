"""The machinery behind ``objcomm bench`` and ``objcomm demo`` (private; see ``docs/bench.md``).

- ``config``: the ops, the validated config, user modules (no torch: the CLI parses with it)
- ``payloads``: built-in and user payloads, size parsing
- ``roundtrip``: local encode/decode timing and fidelity
- ``measure``: timing ops on live ranks, objcomm against torch, interleaved (reusable)
- ``runner``: the program every rank runs
- ``launch``: local ranks, or the launcher's process group
- ``results``, ``report``, ``plot``, ``progress``: what comes out
"""
