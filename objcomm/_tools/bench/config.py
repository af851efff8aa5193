"""What a benchmark run is asked to do: the ops, the validated config, the user's modules.

Needs no torch, so ``objcomm --help`` and the CLI's argument checks start without it. User modules
(``--payload``, ``--import``) are found as ``python -m`` finds them: the current directory first
(:func:`cwd_first`), then ``PYTHONPATH``; local ranks are spawned with the parent's ``sys.path``.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Sequence, Tuple

DEFAULT_OPS = ("all_gather", "gather", "broadcast", "scatter", "send/recv")
# torch has no object all-to-all, reduction or non-blocking object collective: these are compared
# with what users write instead (see objcomm._tools.bench.measure.TORCH_EQUIVALENT)
OPS = DEFAULT_OPS + ("all_to_all", "all_reduce", "iall_gather")


@dataclass(frozen=True)
class BenchConfig:
    """What to run; validated by the CLI, shipped to every rank.

    ``payloads`` holds built-in names and ``module:function`` specs; ``adaptive`` (when the user
    gave no ``--repeat``) lets slow cells use fewer repeats, at least 3, to fit ``cell_budget_s``;
    fast calls are timed several back to back, so that a sample lasts at least ``min_sample_s`` (0: one call a
    sample, as ``--quick`` runs).
    """

    payloads: Tuple[str, ...]
    sizes: Tuple[int, ...]
    serializers: Tuple[str, ...]
    ops: Tuple[str, ...]
    repeat: int
    adaptive: bool = True
    imports: Tuple[str, ...] = ()
    cell_budget_s: float = 0.4
    min_sample_s: float = 0.002


def cwd_first() -> None:
    """Put the current directory first on ``sys.path``, as ``python -m`` does: for the ``objcomm`` script
    Python put the script's own folder there, so ``--payload``/``--import`` modules in the current
    directory were not found. Spawned local ranks inherit ``sys.path``."""
    cwd = os.getcwd()
    if not sys.path or sys.path[0] not in (cwd, ""):  # "": python -c and the REPL already search it
        sys.path.insert(0, cwd)


def import_modules(names: Sequence[str]) -> None:
    """Import user modules (which register serializers as a side effect); raise ``ValueError`` if one fails."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise ValueError(f"--import {name}: {type(exc).__name__}: {exc}") from exc
