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

Each child is forked from one *zygote*: a process spawned once per test session that imports numpy, torch,
pytest, objcomm and the test harness (:data:`ZYGOTE_PRELOAD`) and runs nothing, then forks a fresh child per call
(a spawned child importing them took ~3 s a call; a fork takes milliseconds). The child starts from the zygote's
clean state, takes the caller's ``sys.path``, then imports what the function needs, as a spawned one did.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import pickle
import queue
import resource
import signal
import sys
import tempfile
import threading
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


def _child_main(request: bytes, answer: int) -> None:
    """In a child forked from the zygote: run the call ``request`` holds, its outcome pickled to fd ``answer``."""
    try:
        path, call = pickle.loads(request)
        sys.path[:] = path
        fn, args, kwargs, memory_budget, preload = pickle.loads(call)  # (imports the function's module)
        for module in preload:
            importlib.import_module(module)
        if memory_budget is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (_mapped_bytes() + memory_budget, hard))
        outcome = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # noqa: B036 - everything must reach the parent
        outcome = ("raised", (type(exc).__name__, str(exc)[:4000], traceback.format_exc()[-8000:]))
    data = pickle.dumps(outcome)
    with open(answer, "wb", closefd=True) as out:
        out.write(data)


def _zygote_main(conn: Any, preload: tuple) -> None:
    """The zygote: import ``preload``, then for each request fork a child that runs it, and report the child's pid,
    then its answer and exit status."""
    for module in preload:
        with contextlib.suppress(ImportError):  # (a child that needs it then raises the ImportError itself)
            importlib.import_module(module)
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        readable, writable = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            try:
                os.close(readable)
                conn.close()
                _child_main(request, writable)
            finally:
                os._exit(0)
        os.close(writable)
        conn.send(("pid", pid))
        chunks = []
        with open(readable, "rb", closefd=True) as answer:
            while True:
                chunk = answer.read(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
        conn.send(("done", b"".join(chunks), status))


# what the zygote imports once, for every child: what nearly every hostile-input test needs (no test asks for a child
# without them: the tests that check what an import pulls in run their own interpreters)
ZYGOTE_PRELOAD = (
    "numpy",
    "torch",
    "pytest",
    "hypothesis",
    "serializers",
    "objcomm",
    "objcomm._api.functions",
    "objcomm._api.p2p_functions",
    "_ranks",
)
_ZYGOTE_LOCK = threading.Lock()
_zygote: Optional[Tuple[Any, Any]] = None  # (process, connection)


def _zygote_connection() -> Any:
    """The zygote's end of the pipe, starting it (again, where it died) first."""
    global _zygote
    if _zygote is None or not _zygote[0].is_alive():
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_zygote_main, args=(theirs, ZYGOTE_PRELOAD), daemon=True)
        proc.start()
        theirs.close()
        _zygote = (proc, ours)
    return _zygote[1]


def _stop_zygote() -> None:
    global _zygote
    if _zygote is not None:
        proc, conn = _zygote
        _zygote = None
        conn.close()
        proc.kill()
        proc.join(10)


def run_in_child(
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 90.0,
    memory_budget: Optional[int] = None,
    preload: tuple = ("numpy",),
    **kwargs: Any,
) -> Any:
    """Call ``fn(*args, **kwargs)`` in a fresh child and return its result (or raise ``ChildRaised``)."""
    name = getattr(fn, "__name__", fn)
    request = pickle.dumps((list(sys.path), pickle.dumps((fn, args, kwargs, memory_budget, preload))))
    with _ZYGOTE_LOCK:
        conn, pid = _zygote_connection(), None
        try:
            conn.send_bytes(request)
            if not conn.poll(120):
                raise ChildCrashed(f"{name}: the zygote that forks children did not answer")
            _, pid = conn.recv()
            timed_out = not conn.poll(timeout)
            if timed_out:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                if not conn.poll(30):
                    raise ChildCrashed(f"{name}: the zygote did not reap its killed child")
            _, data, status = conn.recv()
        except (EOFError, OSError) as exc:
            _stop_zygote()
            raise ChildCrashed(f"{name}: the zygote that forks children died ({exc!r}); it starts again") from exc
        except BaseException:  # (pytest-timeout's interruption too): no child left running, no answer left unread
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _stop_zygote()
            raise
    if timed_out:
        raise ChildTimeout(f"{name} still running after {timeout:.0f} s; killed")
    if not data:
        if os.WIFSIGNALED(status):
            how = f"signal {signal.Signals(os.WTERMSIG(status)).name}"
        else:
            how = f"exit code {os.WEXITSTATUS(status)}"
        raise ChildCrashed(f"{name} crashed the child process ({how})")
    kind, value = pickle.loads(data)
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
    target: Callable[..., None], world: int, victim: int, timeout: float = 120.0, exits: bool = False
) -> Tuple[Dict[int, tuple], Optional[int]]:
    """Run ``target(rank, world, store, victim, results)`` in ``world`` ranks of a group of their own
    (the test pool would kill every rank when one dies), the victim killing itself; return what each
    survivor put on ``results`` as ``(rank, *report)`` -> ``{rank: report}``, and the victim's exit code.
    Every rank is reaped. The ranks are forked by multiprocessing's fork server, which imported
    :data:`ZYGOTE_PRELOAD` once (a spawned rank took ~3 s to import torch); ``exits``: spawned instead, for a test
    of what happens as a rank's interpreter exits (a forked rank ends in ``os._exit``: no ``atexit`` handlers)."""
    if exits:
        context = multiprocessing.get_context("spawn")
    else:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(ZYGOTE_PRELOAD))  # (read when the server starts: the first call)
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
