"""Where the ranks come from: the launcher's process group (torchrun), or local ranks started here.

A *task* is a module-level function ``task(arg, send) -> result`` that every rank runs on an
initialised process group; ``send(message)`` reports to the caller (progress), and rank 0's
result is returned. Local ranks come from :mod:`objcomm._tools.launch` and are always reaped: on
success, error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

from objcomm._tools import launch as _launch
from objcomm._tools.launch import LaunchError, OnMessage, Task

__all__ = ["LAUNCHER_VARS", "LaunchError", "launched", "run_in_env", "run_local"]

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")  # what torchrun and other env:// launchers set


def launched() -> bool:
    """Whether a launcher (torchrun, or any env:// set-up) started this process as one rank."""
    return all(name in os.environ for name in LAUNCHER_VARS)


def run_in_env(
    task: Task, arg: Any, *, backend: str, on_message: Optional[OnMessage] = None, timeout_s: float = 600.0
) -> Any:
    """Run ``task`` on the launcher's process group (env://); rank 0 returns its result, others ``None``."""
    import torch
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        send = on_message if on_message is not None and dist.get_rank() == 0 else _ignore
        result = task(arg, send)
        return result if dist.get_rank() == 0 else None
    finally:
        if owned:
            dist.destroy_process_group()


def run_local(
    task: Task,
    arg: Any,
    *,
    world_size: int,
    backend: str = "gloo",
    on_message: Optional[OnMessage] = None,
    timeout_s: float = 600.0,
) -> Any:
    """Start ``world_size`` local ranks, run ``task`` on each, return rank 0's result (CLI hint on timeout)."""
    return _launch.run_local(
        task,
        arg,
        world_size=world_size,
        backend=backend,
        on_message=on_message,
        timeout_s=timeout_s,
        hint=". Use smaller --sizes or fewer --repeat",
    )


def _ignore(message: Any) -> None:
    pass
