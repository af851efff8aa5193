"""Local ranks: the process mechanics behind ``objcomm bench``, ``benchmarks/`` and the test harness.

One place owns how ranks on 127.0.0.1 are started and stopped:

- the master :func:`master_store` listens on port 0, so the OS picks a free port with no race
  (:func:`free_port` is only for launching ``torchrun``, which needs a number up front);
- :class:`LocalRanks` spawns W processes, each with one pipe to the parent, with an environment
  applied from interpreter start (OMP_NUM_THREADS etc. must be in place before torch loads) and
  optionally its stdout/stderr on a file descriptor; it waits for messages or deaths, and reaps:
  SIGTERM, then SIGKILL of the ranks and anything they started, then join;
- on the rank side (:mod:`objcomm._tools.rank_side`), :func:`die_with_parent` (PR_SET_PDEATHSIG and
  a watcher thread) ends a rank whose parent died even by SIGKILL, :func:`join_group` joins the
  process group over the store, and :func:`exit_now` leaves without torch's slow interpreter teardown;
- :func:`run_local` runs one task on W fresh ranks and returns rank 0's result.

Why not torch's own engine (``torch.distributed.launcher.api.elastic_launch``, what torchrun
runs)? Measured on 2 busy CPU cores, torch 2.13, 2 gloo ranks doing one all_gather, 3 runs
each, three rounds: elastic_launch 1.9-3.5 s, :func:`run_local` 1.5-2.8 s (noisy; no gain
from the engine). When one rank raises while the other waits in a collective, run_local
raises ``LaunchError`` with that rank's traceback after 1.5-2.9 s; elastic_launch raises
``ChildFailedError`` after 3.4-4.3 s and logs a page of tracebacks to stderr. Both reap their
ranks when the parent is killed by SIGTERM or SIGKILL (torch's spawn sets a parent-death
signal too). The engine has no channel for progress messages from rank 0 (the CLI's bar),
and cannot keep a pool of live ranks for the tests; so objcomm keeps this small launcher.
``torchrun`` stays the supported way to run on several nodes (``objcomm bench`` uses its group).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from objcomm._errors import ObjcommError
from objcomm._tools.rank_side import HOST, die_with_parent, flush_stdio, join_group, send

Env = Mapping[str, Optional[str]]  # a value None unsets the variable
Task = Callable[[Any, Callable[[Any], None]], Any]
OnMessage = Callable[[Any], None]

_START_LOCK = threading.Lock()  # starting a rank swaps os.environ and fds 1/2 for a moment


class LaunchError(ObjcommError, RuntimeError):
    """A local rank failed, died or timed out; the message says which and why."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for launching ``torchrun``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def master_store(world_size: int, timeout_s: float) -> Any:
    """The rendezvous ``TCPStore`` on port 0 (the OS picks a free port; read it from ``.port``)."""
    import torch.distributed as dist

    # torch.distributed imports TCPStore from torch._C without re-exporting it, so its stubs hide it
    store = dist.TCPStore(  # type: ignore[attr-defined]
        HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    if int(store.port) <= 0:
        raise LaunchError(f"TCPStore on port 0 reported port {store.port}")
    return store


def rank_env(rank: int, world_size: int, port: int) -> Dict[str, Optional[str]]:
    """What an env:// launcher sets for one local rank, with one thread per rank."""
    return {
        "MASTER_ADDR": HOST,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }


class LocalRanks:
    """W spawned rank processes with one duplex pipe each; :meth:`close` always reaps them."""

    def __init__(self) -> None:
        self.procs: List[Any] = []
        self.conns: List[Any] = []
        self.pids: List[int] = []  # kept after release()

    def start(
        self,
        target: Callable[..., None],
        args: Sequence[Tuple[Any, ...]],
        *,
        name: str,
        env: Optional[Sequence[Env]] = None,
        stdout: Optional[Sequence[Optional[int]]] = None,
    ) -> None:
        """Start ``target(conn, *args[rank])`` per rank, ``env[rank]`` applied, output to ``stdout[rank]``."""
        ctx = multiprocessing.get_context("spawn")
        with _START_LOCK:
            for rank, rank_args in enumerate(args):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=target, args=(child, *rank_args), name=f"{name}{rank}", daemon=True)
                self.procs.append(proc)
                self.conns.append(parent)
                with _stdio_to(stdout[rank] if stdout else None), _environ(env[rank] if env else {}):
                    proc.start()
                self.pids.append(int(proc.pid or 0))
                child.close()  # a dead rank then shows as EOF here

    def wait(self, ranks: Sequence[int], timeout_s: float) -> List[Tuple[int, Optional[bytes]]]:
        """Messages from ``ranks`` that arrive within ``timeout_s``; ``(rank, None)`` for a rank that died."""
        waitables = [self.conns[r] for r in ranks] + [self.procs[r].sentinel for r in ranks]
        events: Dict[int, Optional[bytes]] = {}
        for ready in multiprocessing.connection.wait(waitables, timeout=max(0.0, timeout_s)):
            rank = next(r for r in ranks if ready is self.conns[r] or ready == self.procs[r].sentinel)
            if rank not in events:
                events[rank] = self.receive(rank)
        return list(events.items())

    def receive(self, rank: int) -> Optional[bytes]:
        """The next message of ``rank``, or ``None`` once it is gone (a just-sent message is still read)."""
        conn = self.conns[rank]
        try:
            if not conn.poll(0):
                self.procs[rank].join(0.2)  # only the sentinel fired: give a last message time to land
                if not conn.poll(0):
                    return None
            return conn.recv_bytes()  # type: ignore[no-any-return]  # self.conns holds its Connections as Any
        except (EOFError, OSError):
            return None

    def exitcode(self, rank: int) -> Optional[int]:
        """The rank's exit code, ``None`` while it runs."""
        proc = self.procs[rank]
        if proc.exitcode is None:
            proc.join(0)
        return proc.exitcode  # type: ignore[no-any-return]  # self.procs holds its Processes as Any

    def signal(self, ranks: Sequence[int], signum: int) -> bool:
        """Send ``signum`` to the running ones of ``ranks``; whether any got it."""
        sent = False
        for rank in ranks:
            proc = self.procs[rank] if rank < len(self.procs) else None
            if proc is not None and proc.pid and proc.exitcode is None:
                try:
                    os.kill(proc.pid, signum)
                    sent = True
                except OSError:
                    pass
        return sent

    @property
    def running(self) -> bool:
        """Every rank process is alive."""
        return bool(self.procs) and all(proc.is_alive() for proc in self.procs)

    def close(self, grace_s: float = 0.0, term_s: float = 2.0) -> None:
        """Reap every rank: wait ``grace_s``, SIGTERM, wait ``term_s``, SIGKILL them and their children."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
        alive = [proc for proc in self.procs if proc.pid is not None and proc.exitcode is None]
        if alive and term_s > 0:
            for proc in alive:
                proc.terminate()
            deadline = time.monotonic() + term_s
            for proc in alive:
                proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """SIGKILL every rank and anything it started, and join them."""
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil is a test dependency only
            psutil = None
        victims: List[Any] = []
        for proc in self.procs:
            if proc.pid is None or proc.exitcode is not None:
                continue
            if psutil is not None:
                try:
                    victims.extend(psutil.Process(proc.pid).children(recursive=True))
                except Exception:
                    pass
            proc.kill()
        for child in victims:
            try:
                child.kill()
            except Exception:
                pass
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(10)
        if psutil is not None and victims:
            psutil.wait_procs(victims, timeout=5)

    def release(self) -> None:
        """Close the pipes and the process handles of ranks that have exited."""
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            if proc.exitcode is not None:
                proc.close()


@contextmanager
def _environ(updates: Env) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in updates}
    _apply(updates)
    try:
        yield
    finally:
        _apply(saved)


def _apply(updates: Env) -> None:
    for key, value in updates.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextmanager
def _stdio_to(fd: Optional[int]) -> Iterator[None]:
    """While active, fds 1 and 2 are ``fd``, so a rank started now writes there."""
    if fd is None:
        yield
        return
    flush_stdio()
    try:
        saved = (os.dup(1), os.dup(2))
    except OSError:  # no stdio at all: nothing to swap
        yield
        return
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for saved_fd in saved:
            os.close(saved_fd)


@contextmanager
def terminate_raises() -> Iterator[None]:
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


# -- one task on fresh ranks ------------------------------------------------------------------
def run_local(
    task: Task,
    arg: Any,
    *,
    world_size: int,
    backend: str = "gloo",
    on_message: Optional[OnMessage] = None,
    timeout_s: float = 600.0,
    hint: str = "",
) -> Any:
    """Start ``world_size`` ranks on 127.0.0.1, run ``task(arg, send)`` on each, return rank 0's result.

    Raises :class:`LaunchError` if a rank raises, dies or the whole run exceeds ``timeout_s``
    (every rank is killed then; ``hint`` ends that message). The ranks' process-group timeout
    is ``timeout_s`` too. Ranks are started with ``spawn``: a script calling this needs
    ``if __name__ == "__main__":``.
    """
    store = master_store(world_size, timeout_s)
    ranks = LocalRanks()
    with terminate_raises():
        try:
            pdeathsig = threading.current_thread() is threading.main_thread()
            args = [
                (task, arg, rank, world_size, int(store.port), backend, os.getpid(), pdeathsig, timeout_s)
                for rank in range(world_size)
            ]
            ranks.start(_task_main, args, name="objcomm-rank")
            return _collect(ranks, on_message, timeout_s, hint)
        except BaseException:
            ranks.kill()
            raise
        finally:
            ranks.close(grace_s=5.0)
            ranks.release()
            del store  # kept alive until every rank has joined and left


def _collect(ranks: LocalRanks, on_message: Optional[OnMessage], timeout_s: float, hint: str) -> Any:
    """Read the ranks' messages until each has said ``done``; raise on the first failure."""
    deadline = time.monotonic() + timeout_s
    pending = list(range(len(ranks.procs)))
    result = None
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LaunchError(
                f"the ranks did not finish within {timeout_s:.0f}s (ranks {pending} still "
                f"running); they were stopped{hint}"
            )
        for rank, data in ranks.wait(pending, min(remaining, 1.0)):
            if data is None:
                raise LaunchError(f"rank {rank} exited unexpectedly (exit code {ranks.exitcode(rank)})")
            kind, payload = pickle.loads(data)
            if kind == "message":
                if on_message is not None:
                    on_message(payload)
            elif kind == "error":
                headline = payload.strip().splitlines()[-1] if payload.strip() else "unknown error"
                raise LaunchError(f"rank {rank} failed: {headline}\n\n{payload}")
            else:
                pending.remove(rank)
                if rank == 0:
                    result = payload
    return result


def _task_main(
    conn: Any,
    task: Task,
    arg: Any,
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    parent_pid: int,
    pdeathsig: bool,
    timeout_s: float,
) -> None:
    """One rank of :func:`run_local`: join the group, run the task, report, leave."""
    die_with_parent(parent_pid, pdeathsig)
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        join_group(rank, world_size, port, backend=backend, timeout_s=timeout_s)
        result = task(arg, lambda message: send(conn, ("message", message)))
        send(conn, ("done", result if rank == 0 else None))
    except BaseException:
        try:
            send(conn, ("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        flush_stdio()
        os._exit(0)
