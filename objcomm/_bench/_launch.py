"""Where the ranks come from: the launcher's process group (torchrun), or local ranks started here.

A *task* is a module-level function ``task(arg, send) -> result`` that every rank runs on an
initialised process group; ``send(message)`` reports to the caller (progress), and rank 0's
result is returned. Local ranks are always reaped: on success, error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

HOST = "127.0.0.1"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")  # what torchrun and other env:// launchers set
_EXIT_GRACE_S = 5.0

Task = Callable[[Any, Callable[[Any], None]], Any]
OnMessage = Callable[[Any], None]


class LaunchError(RuntimeError):
    """A rank failed, died or timed out; the message says which and why."""


def launched() -> bool:
    """Whether a launcher (torchrun, or any env:// set-up) started this process as one rank."""
    return all(name in os.environ for name in LAUNCHER_VARS)


def run_in_env(task: Task, arg: Any, *, backend: str, on_message: Optional[OnMessage] = None,
               timeout_s: float = 600.0) -> Any:
    """Run ``task`` on the launcher's process group (env://); rank 0 returns its result, others ``None``."""
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


def run_local(task: Task, arg: Any, *, world_size: int, backend: str = "gloo",
              on_message: Optional[OnMessage] = None, timeout_s: float = 600.0) -> Any:
    """Start ``world_size`` ranks on 127.0.0.1, run ``task`` on each, return rank 0's result.

    Raises :class:`LaunchError` if a rank raises, dies or the whole run exceeds ``timeout_s``
    (every rank is killed then). The ranks' process-group timeout is ``timeout_s`` too.
    Ranks are started with ``spawn``: a script calling this needs ``if __name__ == "__main__":``.
    """
    # Port 0: the OS picks a free port inside the store itself, so there is no race.
    store = dist.TCPStore(HOST, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    ctx = multiprocessing.get_context("spawn")
    procs: List[Any] = []
    conns: List[Any] = []
    with _terminate_raises():
        try:
            for rank in range(world_size):
                parent, child = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_rank_main, name=f"objcomm-rank{rank}", daemon=True,
                    args=(task, arg, rank, world_size, int(store.port), backend, child, os.getpid(), timeout_s),
                )
                proc.start()
                child.close()  # a dead rank then shows as EOF here
                procs.append(proc)
                conns.append(parent)
            return _collect(procs, conns, on_message, time.monotonic() + timeout_s, timeout_s)
        except BaseException:
            _reap(procs, grace_s=0.0)
            raise
        finally:
            _reap(procs, grace_s=_EXIT_GRACE_S)
            for conn in conns:
                conn.close()
            del store  # kept alive until every rank has joined and left


def _collect(procs: List[Any], conns: List[Any], on_message: Optional[OnMessage], deadline: float,
             timeout_s: float) -> Any:
    """Read the ranks' messages until each has said ``done``; raise on the first failure."""
    pending: Dict[int, Any] = dict(enumerate(conns))
    result = None
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LaunchError(f"the ranks did not finish within {timeout_s:.0f}s (ranks {sorted(pending)} still "
                              "running); they were stopped. Use smaller --sizes or fewer --repeat")
        waitables = list(pending.values()) + [procs[r].sentinel for r in pending]
        for ready in multiprocessing.connection.wait(waitables, timeout=min(remaining, 1.0)):
            rank = next((r for r, c in pending.items() if ready is c or ready == procs[r].sentinel), None)
            if rank is None:
                continue
            message = _receive(pending[rank], procs[rank])
            if message is None:
                raise LaunchError(f"rank {rank} exited unexpectedly (exit code {procs[rank].exitcode})")
            kind, payload = message
            if kind == "message":
                if on_message is not None:
                    on_message(payload)
            elif kind == "error":
                headline = payload.strip().splitlines()[-1] if payload.strip() else "unknown error"
                raise LaunchError(f"rank {rank} failed: {headline}\n\n{payload}")
            else:
                pending.pop(rank)
                if rank == 0:
                    result = payload
    return result


def _receive(conn: Any, proc: Any) -> Optional[tuple]:
    """The next message, or ``None`` once the rank is gone (a just-sent message is still read)."""
    try:
        if not conn.poll(0):
            proc.join(0.2)
            if not conn.poll(0):
                return None
        return conn.recv()  # type: ignore[no-any-return]
    except (EOFError, OSError):
        return None


def _reap(procs: List[Any], grace_s: float) -> None:
    """Wait up to ``grace_s`` for the ranks to exit, then kill and join whatever is left."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
    for proc in procs:
        proc.join()


@contextmanager
def _terminate_raises() -> Iterator[None]:
    """SIGTERM raises ``SystemExit`` while ranks run, so the ``finally`` that reaps them runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _ignore(message: Any) -> None:
    pass


# -- rank side -------------------------------------------------------------------------------
def _rank_main(task: Task, arg: Any, rank: int, world_size: int, port: int, backend: str, conn: Any,
               parent_pid: int, timeout_s: float) -> None:
    """One local rank: join the group, run the task, report, and leave without torch's slow teardown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it reaps us
    _die_with(parent_pid)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        result = task(arg, lambda message: conn.send(("message", message)))
        conn.send(("done", result if rank == 0 else None))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(0)


def _die_with(parent_pid: int) -> None:
    """Exit when the parent dies, even by SIGKILL: the kernel's death signal, and a watcher thread."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(70)

    if os.getppid() != parent_pid:
        os._exit(70)
    threading.Thread(target=watch, name="objcomm-watch-parent", daemon=True).start()
