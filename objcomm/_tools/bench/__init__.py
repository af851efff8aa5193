"""The machinery behind ``objcomm bench`` and ``objcomm demo`` (private; see ``docs/bench.md``).

- ``_config``: the ops, the validated config, user modules (no torch: the CLI parses with it)
- ``_payloads``: built-in and user payloads, size parsing
- ``_roundtrip``: local encode/decode timing and fidelity
- ``_measure``: timing ops on live ranks, objcomm against torch, interleaved (reusable)
- ``_runner``: the program every rank runs
- ``_launch``: local ranks, or the launcher's process group
- ``_results``, ``_report``, ``_plot``, ``_progress``: what comes out
"""
