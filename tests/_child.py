"""Run a function in a fresh child process, so a crash fails one test instead of killing pytest.

Hostile-input tests decode in a child: a segfault, a stack overflow or an allocation past the
budget shows up as a :class:`ChildCrashed` (with the signal) or as the ``MemoryError`` the child
raised, never as a dead pytest::

    from _child import run_in_child

    def decode(payload):                   # module level, so it pickles by reference
        return serializers.get("msgpack").loads(payload)

    run_in_child(decode, payload, memory_budget=64 << 20)

``memory_budget`` caps the child's address space at what it had mapped when the call started
plus that many bytes (``RLIMIT_AS``), so an allocation beyond it fails with ``MemoryError``
even if the pages were never touched. The modules in ``preload`` (numpy by default: OpenBLAS
reserves its buffers at import) are imported before the cap. The child is always reaped; a child that outlives
``timeout`` is killed and :class:`ChildTimeout` raised.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import queue
import resource
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = ["ChildCrashed", "ChildTimeout", "ChildRaised", "run_in_child"]


class ChildCrashed(AssertionError):
    """The child died (a signal or a non-zero exit) without answering."""


class ChildTimeout(AssertionError):
    """The child was still running at the timeout and was killed."""


class ChildRaised(Exception):
    """The function raised in the child; ``type_name``, ``message`` and the child's traceback."""

    def __init__(self, type_name: str, message: str, trace: str) -> None:
        super().__init__(f"{type_name}: {message}\n--- child traceback ---\n{trace}")
        self.type_name = type_name
        self.message = message


def _mapped_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _child_main(
    conn: Any, fn: Callable[..., Any], args: tuple, kwargs: dict, memory_budget: Optional[int], preload: tuple
) -> None:
    try:
        for module in preload:
            importlib.import_module(module)
        if memory_budget is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (_mapped_bytes() + memory_budget, hard))
        result = fn(*args, **kwargs)
        conn.send(("ok", result))
    except BaseException as exc:  # noqa: B036 - everything must reach the parent
        conn.send(("raised", (type(exc).__name__, str(exc)[:4000], traceback.format_exc()[-8000:])))
    finally:
        conn.close()


def run_in_child(
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 90.0,
    memory_budget: Optional[int] = None,
    preload: tuple = ("numpy",),
    **kwargs: Any,
) -> Any:
    """Call ``fn(*args, **kwargs)`` in a spawned child and return its result (or raise ``ChildRaised``)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(child, fn, args, kwargs, memory_budget, preload), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise ChildTimeout(f"{getattr(fn, '__name__', fn)} still running after {timeout:.0f} s; killed")
        try:
            kind, value = parent.recv()
        except EOFError:
            proc.join(5)
            code = proc.exitcode
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            raise ChildCrashed(f"{getattr(fn, '__name__', fn)} crashed the child process ({how})") from None
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        parent.close()
    if kind == "raised":
        raise ChildRaised(*value)
    return value


def report_raised(results: Any, rank: int, call: Callable[[], Any]) -> None:
    """A survivor's report for :func:`run_group_losing_a_rank`: ``(rank, message, seconds)`` of the
    ``CommunicationError`` that ``call()`` raised, or ``(rank, "no error", 0.0)``."""
    from objcomm import CommunicationError

    start = time.monotonic()
    try:
        call()
        results.put((rank, "no error", 0.0))
    except CommunicationError as exc:
        results.put((rank, str(exc), time.monotonic() - start))


def run_group_losing_a_rank(
    target: Callable[..., None], world: int, victim: int, timeout: float = 120.0
) -> Tuple[Dict[int, tuple], Optional[int]]:
    """Run ``target(rank, world, store, victim, results)`` in ``world`` spawned ranks of a group of their own
    (the test pool would kill every rank when one dies), the victim killing itself; return what each
    survivor put on ``results`` as ``(rank, *report)`` -> ``{rank: report}``, and the victim's exit code.
    Every rank is reaped."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    got: Dict[int, tuple] = {}
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            context.Process(target=target, args=(r, world, os.path.join(tmp, "store"), victim, results))
            for r in range(world)
        ]
        for proc in procs:
            proc.start()
        try:
            for _ in range(world - 1):
                rank, *report = results.get(timeout=timeout)
                got[rank] = tuple(report)
        except queue.Empty:
            raise ChildTimeout(f"the survivors did not report within {timeout:.0f} s; got {got}") from None
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
    return got, procs[victim].exitcode
