"""One rank pool: W live worker processes in a real gloo process group, and calls on them.

The pool starts its workers with ``objcomm._tools.launch`` (spawn, rank environment, parent-death
signal, reaping), waits until every one has joined the group, then sends each call to all of
them and collects one reply per rank. A rank that raises, dies or hangs becomes a
:class:`RankFailure`, :class:`RankDied` or :class:`RankTimeout` whose message quotes the
tracebacks and what the ranks printed; a pool whose ranks may be out of step is killed.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from contextlib import suppress
from typing import Any, Callable, Sequence

from _rank_errors import PoolBrokenError, PoolStartupError, RankDied, RankFailure, RankPoolError, RankTimeout
from _rank_logs import RankLogs
from _rank_worker import CLOSE_REQUEST, HEADER, barrier, describe, dumps_call, loads_exception, loads_reply, worker_main

from objcomm._tools import launch as _launch

__all__ = ["RankPool", "live_pools"]

_LIVE_POOLS: set[RankPool] = set()
_LIVE_LOCK = threading.Lock()


class RankPool:
    """W live worker processes, each a rank in a real gloo process group on 127.0.0.1."""

    _call_ids = itertools.count(1)

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 60.0,
        env: dict[str, str | None] | None = None,
        pg_timeout: float = 60.0,
        startup_timeout: float = 120.0,
        failure_grace: float = 10.0,
        capture_output: bool | None = None,
    ):
        """Start ``world_size`` workers and wait until their process group is up.

        Args:
            timeout: default per-call timeout of run().
            env: extra environment variables for the workers (applied last, so they can
                override RANK/LOCAL_RANK/OMP_NUM_THREADS/...; a value None unsets the variable).
                They are in place from interpreter start, so PYTHONHASHSEED etc. work too.
            pg_timeout: the process group's own timeout (collectives that wait longer fail).
            startup_timeout: how long startup (import torch + init_process_group) may take.
            failure_grace: after one rank raised, how long the others get to answer before the
                pool is killed (they may be stuck in a collective waiting for the failed rank).
            capture_output: send worker stdout/stderr to per-rank log files (default: on,
                unless the environment variable RANKPOOL_CAPTURE=0).
        """
        if int(world_size) < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size!r}")
        self.world_size = int(world_size)
        self.timeout, self.pg_timeout = float(timeout), float(pg_timeout)
        self.startup_timeout, self.failure_grace = float(startup_timeout), float(failure_grace)
        self.env = {str(k): (None if v is None else str(v)) for k, v in (env or {}).items()}
        if capture_output is None:
            capture_output = os.environ.get("RANKPOOL_CAPTURE", "1").strip().lower() not in ("0", "false", "no", "off")
        self.capture_output = bool(capture_output)
        self.broken = self.closed = False
        self.broken_reason: str | None = None
        self.startup_seconds: float | None = None
        self._ranks = _launch.LocalRanks()
        self._store = None
        self._lock = threading.RLock()
        self._logs = RankLogs(self.world_size, self.capture_output)
        with _LIVE_LOCK:
            _LIVE_POOLS.add(self)
        try:
            self._start()
        except BaseException:
            self._ranks.kill()
            self.closed = True
            self._cleanup()
            raise

    @property
    def _procs(self) -> list:
        return self._ranks.procs

    @property
    def pids(self) -> list[int]:
        """Worker process ids, by rank (kept after close)."""
        return list(self._ranks.pids)

    @property
    def alive(self) -> bool:
        """Not closed, not broken and every worker process is running."""
        return not self.closed and not self.broken and self._ranks.running

    def output(self, rank: int) -> str:
        """Everything rank ``rank`` wrote to stdout/stderr so far (empty if not captured)."""
        return self._logs.read(rank)

    # ---------------------------------------------------------------- startup

    def _start(self) -> None:
        t0 = time.monotonic()
        W, store_timeout = self.world_size, max(self.startup_timeout, self.pg_timeout)
        self._store = _launch.master_store(W, store_timeout)
        port = int(self._store.port)
        pdeathsig = threading.current_thread() is threading.main_thread()
        self._ranks.start(
            worker_main,
            [(r, W, port, os.getpid(), pdeathsig, self.pg_timeout, store_timeout) for r in range(W)],
            name=f"rankpool-w{W}-r",
            env=[{**_launch.rank_env(r, W, port), **self.env} for r in range(W)],
            stdout=self._logs.fds,
        )
        ready: set[int] = set()
        errors: dict[int, str] = {}
        deadline = t0 + self.startup_timeout
        while len(ready) + len(errors) < W and not errors:
            waiting = [r for r in range(W) if r not in ready]
            if time.monotonic() >= deadline:
                self._dump_stacks(waiting)
                self._ranks.kill()
                raise PoolStartupError(
                    self._startup_message(
                        f"timed out after {self.startup_timeout:.0f}s; ranks {waiting} never reported "
                        "that the process group was initialised",
                        errors,
                        waiting,
                    )
                )
            for rank, msg in self._wait(waiting, deadline - time.monotonic()):
                if msg is None:
                    errors[rank] = f"worker exited during startup (exitcode {self._ranks.exitcode(rank)})\n"
                elif msg[0] == "ready":
                    ready.add(rank)
                else:
                    errors[rank] = msg[2]
        if errors:  # one rank failed: the others would wait for it until the store/pg timeout
            self._ranks.kill()
            waiting = [r for r in range(W) if r not in ready and r not in errors]
            raise PoolStartupError(self._startup_message("a worker failed to start", errors, waiting))
        self.startup_seconds = time.monotonic() - t0

    def _startup_message(self, what: str, errors: dict[int, str], waiting: list[int]) -> str:
        exitcodes = [self._ranks.exitcode(r) for r in range(self.world_size)]
        return self._logs.startup_report(
            f"RankPool(world_size={self.world_size}) startup failed: {what}", errors, waiting, exitcodes
        )

    # ---------------------------------------------------------------- plumbing

    def _wait(self, ranks: list[int], timeout: float) -> list[tuple[int, Any]]:
        """Replies (unpickled) of ``ranks`` within ``timeout``; None for a rank that is gone."""
        return [
            (rank, None if data is None else loads_reply(rank, data)) for rank, data in self._ranks.wait(ranks, timeout)
        ]

    def _dump_stacks(self, ranks, wait: float = 0.7) -> None:
        """Ask workers to write their Python stacks to their log (faulthandler on SIGUSR1)."""
        if self._ranks.signal(ranks, signal.SIGUSR1) and self.capture_output:
            time.sleep(wait)

    def _kill(self, reason: str) -> None:
        self.broken = True
        self.broken_reason = self.broken_reason or reason
        self._ranks.kill()

    # ---------------------------------------------------------------- calls

    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list:
        """Call fn(*args, **kwargs) on every rank at once; return the results indexed by rank.

        Raises RankFailure if any rank raised (message: every failing rank's traceback),
        RankDied if a worker process exited, RankTimeout (after killing the pool) if not
        every rank answered within ``timeout`` (default: the pool's).
        """
        payload = dumps_call(fn, args, kwargs)
        return self._call([payload] * self.world_size, describe(fn), timeout)

    def run_each(self, calls: Sequence, *, timeout: float | None = None) -> list:
        """Run a different call on each rank: ``calls[r]`` is a callable, ``(fn, args)`` or
        ``(fn, args, kwargs)``. Same error handling as run()."""
        if len(calls) != self.world_size:
            raise ValueError(f"run_each needs {self.world_size} calls, got {len(calls)}")
        payloads, names = [], []
        for call in calls:
            if callable(call):
                fn, args, kwargs = call, (), {}
            elif len(call) == 2:
                (fn, args), kwargs = call, {}
            else:
                fn, args, kwargs = call
            payloads.append(dumps_call(fn, args, kwargs))
            names.append(describe(fn))
        name = names[0] if len(set(names)) == 1 else "run_each(" + ", ".join(names) + ")"
        return self._call(payloads, name, timeout)

    def check(self, timeout: float = 10.0) -> None:
        """Run a barrier on all ranks (raises like run())."""
        self.run(barrier, timeout=timeout)

    def _call(self, payloads: list[bytes], name: str, timeout: float | None) -> list:
        with self._lock:
            if self.closed:
                raise PoolBrokenError(f"{self!r} is closed")
            if self.broken:
                raise PoolBrokenError(
                    f"{self!r} is broken ({self.broken_reason}); make a new one (get_pool() does that for you)"
                )
            try:
                return self._call_locked(payloads, name, timeout)
            except (RankPoolError, PoolBrokenError):
                raise
            except BaseException as exc:  # KeyboardInterrupt etc: state unknown, throw it away
                self._kill(f"interrupted by {type(exc).__name__} during {name}")
                raise

    def _call_locked(self, payloads: list[bytes], name: str, timeout: float | None, check_sync: bool = True) -> list:
        timeout = self.timeout if timeout is None else float(timeout)
        call_id = next(self._call_ids)
        header = HEADER.pack(call_id)
        W = self.world_size
        offsets = [self._logs.size(r) for r in range(W)]
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        exceptions: dict[int, BaseException | None] = {}
        dead: dict[int, int | None] = {}

        start = time.monotonic()
        deadline = start + timeout
        for rank in range(W):
            try:
                self._ranks.conns[rank].send_bytes(header + payloads[rank])
            except (EOFError, OSError):
                dead[rank] = self._ranks.exitcode(rank)

        grace_deadline = None
        while not dead and len(results) + len(failures) < W:
            pending = [r for r in range(W) if r not in results and r not in failures]
            now = time.monotonic()
            if failures and grace_deadline is None:
                grace_deadline = now + self.failure_grace
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            for rank, msg in self._wait(pending, limit - now):
                if msg is None:
                    dead[rank] = self._ranks.exitcode(rank)
                elif msg[1] is not None and msg[1] != call_id:
                    continue  # stale reply (cannot normally happen)
                elif msg[0] == "ok":
                    results[rank] = msg[2]
                else:
                    failures[rank] = msg[2]
                    exceptions[rank] = loads_exception(msg[3])
        elapsed = time.monotonic() - start
        pending = [r for r in range(W) if r not in results and r not in failures and r not in dead]

        if dead:
            # The group is unusable. Collect replies that already arrived, then kill the rest.
            for rank, msg in self._wait(pending, 0):
                if msg is not None:
                    (results if msg[0] == "ok" else failures)[rank] = msg[2]
            pending = [r for r in pending if r not in results and r not in failures]
            self._dump_stacks(pending)
            self._kill(f"rank(s) {sorted(dead)} died during {name}")
            for rank in dead:
                dead[rank] = self._ranks.exitcode(rank)
            all_fail = dict(failures)
            for rank, code in dead.items():
                all_fail[rank] = f"worker process died (exitcode {code})\n"
            msg = self._logs.call_report(
                f"rank(s) {sorted(dead)} of {W} died during {name} "
                f"(exitcodes {dict(sorted(dead.items()))}); the pool was killed",
                all_fail,
                pending,
                offsets,
            )
            raise RankDied(msg, exitcodes=dead, failures=all_fail, exceptions=exceptions, results=results)

        if pending and not failures:
            self._dump_stacks(pending)
            self._kill(f"{name} timed out")
            msg = self._logs.call_report(
                f"{name} did not finish within {timeout:g}s on rank(s) {pending} of {W} (the pool was killed)",
                failures,
                pending,
                offsets,
            )
            raise RankTimeout(msg, pending=pending, failures=failures, exceptions=exceptions, results=results)

        if failures:
            killed = False
            note = ""
            if pending:
                # The failure probably left the others waiting in a collective.
                self._dump_stacks(pending)
                self._kill(f"rank(s) {pending} did not answer after a failure in {name}")
                killed = True
                why = "timeout" if time.monotonic() >= deadline else f"failure_grace={self.failure_grace:g}s"
                note = f"; rank(s) {pending} had not answered {elapsed:.1f}s in ({why}), so the pool was killed"
            else:
                killed = check_sync and not self._still_in_sync()  # not from the barrier itself
                if killed:
                    note = "; afterwards the group failed a barrier (ranks out of step), so the pool was killed"
            msg = self._logs.call_report(
                f"{len(failures)} of {W} rank(s) failed in {name}{note}", failures, pending, offsets
            )
            raise RankFailure(msg, failures=failures, exceptions=exceptions, results=results, pool_killed=killed)

        return [results[r] for r in range(W)]

    def _still_in_sync(self) -> bool:
        """After a failure, check that a barrier still works, else kill the pool."""
        try:
            self._call_locked(
                [dumps_call(barrier, (), {})] * self.world_size, "barrier", min(10.0, self.pg_timeout), check_sync=False
            )
            return True
        except RankPoolError:
            if not self.broken:
                self._kill("barrier failed after a failed call")
            return False

    # ---------------------------------------------------------------- shutdown

    def close(self, timeout: float = 5.0) -> None:
        """Stop and reap all workers: ask politely, then SIGTERM, then SIGKILL. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                if not self.broken:
                    for conn in self._ranks.conns:
                        with suppress(Exception):
                            conn.send_bytes(CLOSE_REQUEST)
                    self._ranks.close(grace_s=timeout)
                self._ranks.kill()  # whatever is still there; also reaps
            finally:
                self._cleanup()

    def _cleanup(self) -> None:
        with suppress(Exception):
            self._ranks.release()
        self._store = None  # the master store lives exactly as long as the pool
        self._logs.close()
        with _LIVE_LOCK:
            _LIVE_POOLS.discard(self)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "broken" if self.broken else "live"
        return f"<RankPool world_size={self.world_size} {state}>"


def live_pools() -> list[RankPool]:
    """Every pool of this process that is not closed yet."""
    with _LIVE_LOCK:
        return list(_LIVE_POOLS)
