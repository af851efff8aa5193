"""Test harness: a pool of live ranks in a real gloo process group on 127.0.0.1.

Starting a process group is slow (every rank imports torch), so one group of
live worker processes runs many scenarios::

    from _ranks import RankPool

    def scenario(x):                      # module level, so it pickles by reference
        import torch.distributed as dist
        return dist.get_rank() * x

    with RankPool(3) as pool:
        assert pool.run(scenario, 10) == [0, 10, 20]

Functions are shipped by pickle reference (module + name); the spawned workers
get the parent's ``sys.path`` so test modules (``test_foo``, imported by pytest's
default "prepend" import mode) and this module are importable there.  Anything
plain pickle refuses (lambdas, closures, local functions) is sent with
cloudpickle instead.

Worker stdout/stderr (including C++ output from torch/gloo) go to a log file per
rank; the part written during a failed call is appended to the exception
message, and ``pool.output(rank)`` returns it.  Set ``RANKPOOL_CAPTURE=0`` or
pass ``capture_output=False`` to let workers write to the inherited terminal.

Spawning, the rank environment (OMP_NUM_THREADS etc., in place from interpreter
start), parent-death signals and reaping come from ``objcomm._launch``; this module
keeps the pool protocol, per-rank log capture and failure reports.
"""

from __future__ import annotations

import atexit
import faulthandler
import fcntl
import itertools
import os
import pickle
import signal
import struct
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from contextlib import suppress
from typing import Any, Callable, Sequence

from objcomm import _launch

__all__ = [
    "RankPool",
    "RankPoolError",
    "RankFailure",
    "RankDied",
    "RankTimeout",
    "PoolBrokenError",
    "PoolStartupError",
    "get_pool",
    "close_all_pools",
    "free_port",
    "rank_info",
    "barrier",
]

_HEADER = struct.Struct("<q")  # call id in front of every request
_CLOSE_REQUEST = b""
_OUTPUT_TAIL_CHARS = 6000
free_port = _launch.free_port  # for tests that launch torchrun


# --------------------------------------------------------------------------- errors


class RankPoolError(AssertionError):
    """Base for errors reported by ranks (an AssertionError so pytest shows the message well)."""


class RankFailure(RankPoolError):
    """One or more ranks raised (or could not return their result).

    Attributes:
        failures: rank -> formatted remote traceback (or explanation).
        exceptions: rank -> the remote exception object if it could be pickled back, else None.
        results: rank -> result for ranks that did succeed.
        pool_killed: True if the pool had to be killed (then it is ``broken``).
    """

    def __init__(self, message: str, *, failures=None, exceptions=None, results=None,
                 pool_killed: bool = False):
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})
        self.exceptions: dict[int, BaseException | None] = dict(exceptions or {})
        self.results: dict[int, Any] = dict(results or {})
        self.pool_killed = pool_killed

    @property
    def ranks(self) -> list[int]:
        return sorted(self.failures)


class RankDied(RankFailure):
    """A worker process exited during a call (crash, os._exit, signal). The pool is broken."""

    def __init__(self, message: str, *, exitcodes=None, **kw):
        super().__init__(message, pool_killed=True, **kw)
        self.exitcodes: dict[int, int | None] = dict(exitcodes or {})


class RankTimeout(RankPoolError):
    """A call did not finish in time; the whole pool was killed and is broken.

    Attributes:
        pending: ranks that had not answered.
        failures / exceptions / results: what the other ranks did answer.
    """

    def __init__(self, message: str, *, pending=(), failures=None, exceptions=None, results=None):
        super().__init__(message)
        self.pending: list[int] = sorted(pending)
        self.failures: dict[int, str] = dict(failures or {})
        self.exceptions: dict[int, BaseException | None] = dict(exceptions or {})
        self.results: dict[int, Any] = dict(results or {})


class PoolBrokenError(RuntimeError):
    """run() on a pool that is closed or broken (after a timeout or a dead worker)."""


class PoolStartupError(RuntimeError):
    """The workers could not start or form the process group."""


# --------------------------------------------------------------------------- small helpers


def rank_info() -> dict:
    """Scenario helper: what this rank knows about itself."""
    import torch
    import torch.distributed as dist

    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "num_threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k) for k in (
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")},
    }


def barrier() -> None:
    """Scenario helper: a gloo barrier over the whole group."""
    import torch.distributed as dist

    dist.barrier()


def _tail(text: str, limit: int = _OUTPUT_TAIL_CHARS) -> str:
    return text if len(text) <= limit else f"[... {len(text) - limit} chars cut ...]\n" + text[-limit:]


def _indent(text: str, prefix: str = "    ") -> str:
    return "".join(prefix + line for line in text.rstrip("\n").splitlines(True)) + "\n"


def _describe(fn) -> str:
    mod = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}.{name}"


def _dumps_call(fn, args, kwargs) -> bytes:
    """Pickle (fn, args, kwargs) by reference; fall back to cloudpickle for lambdas/closures."""
    obj = (fn, tuple(args), dict(kwargs))
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as plain_error:  # PicklingError, AttributeError ("local object"), TypeError
        try:
            import cloudpickle
        except ImportError:
            raise TypeError(f"cannot pickle call to {_describe(fn)} ({plain_error!r}) "
                            "and cloudpickle is not installed") from plain_error
        try:
            return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as cp_error:
            raise TypeError(f"cannot send call to {_describe(fn)} to the ranks: pickle failed with "
                            f"{plain_error!r}, cloudpickle failed with {cp_error!r}") from cp_error


def _anonymous_log() -> int:
    """An append-mode fd on an already-unlinked temp file: nothing is left on disk even after SIGKILL."""
    fd, path = tempfile.mkstemp(prefix="rankpool-", suffix=".log")
    os.unlink(path)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    return fd


def _loads_exception(data: bytes | None) -> BaseException | None:
    try:
        return None if data is None else pickle.loads(data)
    except BaseException:
        return None


def _exception_payload(exc: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)  # some exceptions pickle but do not unpickle
        return data
    except Exception:
        return None


# --------------------------------------------------------------------------- worker side


def _worker_main(conn, rank: int, world_size: int, port: int, ppid: int, pdeathsig: bool,
                 pg_timeout: float, store_timeout: float) -> None:
    _launch.die_with_parent(ppid, pdeathsig)
    try:  # the parent sends SIGUSR1 to dump Python stacks of ranks that hang
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    except Exception:
        pass
    try:
        import torch
        import torch.distributed as dist

        try:
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        except ValueError:
            pass
        _launch.join_group(rank, world_size, port, timeout_s=pg_timeout, store_timeout_s=store_timeout)
        dist.barrier()
    except BaseException:
        _launch.flush_stdio()
        with suppress(Exception):
            _launch.send(conn, ("err", -1, traceback.format_exc(), None))
        return
    _launch.send(conn, ("ready", -1, os.getpid()))

    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the parent went away
        if data == _CLOSE_REQUEST:
            break
        (call_id,) = _HEADER.unpack_from(data)
        try:
            fn, args, kwargs = pickle.loads(data[_HEADER.size:])
            result = fn(*args, **kwargs)
        except BaseException as exc:  # includes pytest's Failed/Skipped (BaseException subclasses)
            reply = ("err", call_id, traceback.format_exc(), _exception_payload(exc))
            del exc
        else:
            reply = ("ok", call_id, result)
            del result
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:
            data = pickle.dumps(("err", call_id, (
                f"rank {rank}: the result of {_describe(fn)} could not be pickled to send it back (result "
                f"type {type(reply[2]).__module__}.{type(reply[2]).__qualname__}): {type(exc).__name__}: "
                f"{exc}\nReturn something picklable from scenario functions.\n"), None))
        _launch.flush_stdio()
        try:
            conn.send_bytes(data)
        except (EOFError, OSError):
            break
        del reply, data

    with suppress(BaseException):
        dist.destroy_process_group()
    _launch.exit_now(0)


# --------------------------------------------------------------------------- parent side


_LIVE_POOLS: set[RankPool] = set()
_LIVE_LOCK = threading.Lock()


class RankPool:
    """W live worker processes, each a rank in a real gloo process group on 127.0.0.1."""

    _call_ids = itertools.count(1)

    def __init__(self, world_size: int, *, timeout: float = 60.0,
                 env: dict[str, str | None] | None = None,
                 pg_timeout: float = 60.0, startup_timeout: float = 120.0,
                 failure_grace: float = 10.0, capture_output: bool | None = None):
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
            capture_output = os.environ.get("RANKPOOL_CAPTURE", "1").strip().lower() not in (
                "0", "false", "no", "off")
        self.capture_output = bool(capture_output)
        self.broken = self.closed = False
        self.broken_reason: str | None = None
        self.startup_seconds: float | None = None
        self._ranks = _launch.LocalRanks()
        self._store = None
        self._lock = threading.RLock()
        # Per-rank output logs, read with pread (the file offset is shared with the worker).
        self._logs: list[int | None] = [_anonymous_log() if self.capture_output else None
                                        for _ in range(self.world_size)]
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
        return self._read_log(rank, 0)

    # ---------------------------------------------------------------- startup

    def _start(self) -> None:
        t0 = time.monotonic()
        W, store_timeout = self.world_size, max(self.startup_timeout, self.pg_timeout)
        self._store = _launch.master_store(W, store_timeout)
        port = int(self._store.port)
        pdeathsig = threading.current_thread() is threading.main_thread()
        self._ranks.start(
            _worker_main, [(r, W, port, os.getpid(), pdeathsig, self.pg_timeout, store_timeout) for r in range(W)],
            name=f"rankpool-w{W}-r", env=[{**_launch.rank_env(r, W, port), **self.env} for r in range(W)],
            stdout=self._logs)
        ready: set[int] = set()
        errors: dict[int, str] = {}
        deadline = t0 + self.startup_timeout
        while len(ready) + len(errors) < W and not errors:
            waiting = [r for r in range(W) if r not in ready]
            if time.monotonic() >= deadline:
                self._dump_stacks(waiting)
                self._ranks.kill()
                raise PoolStartupError(self._startup_message(
                    f"timed out after {self.startup_timeout:.0f}s; ranks {waiting} never reported "
                    "that the process group was initialised", errors, waiting))
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
        lines = [f"RankPool(world_size={self.world_size}) startup failed: {what}"]
        for rank in range(self.world_size):
            parts = []
            if rank in errors:
                parts.append(f"--- rank {rank} error ---\n" + _indent(errors[rank]))
            out = self._read_log(rank, 0)
            if out.strip() and (rank in errors or rank in waiting):
                parts.append(f"--- rank {rank} output ---\n" + _indent(_tail(out)))
            exitcode = self._ranks.exitcode(rank)
            if parts or exitcode not in (None, -signal.SIGKILL):
                lines.append(f"rank {rank}: exitcode {exitcode}")
                lines.extend(parts)
        return "\n".join(lines)

    # ---------------------------------------------------------------- plumbing

    def _wait(self, ranks: list[int], timeout: float) -> list[tuple[int, Any]]:
        """Replies (unpickled) of ``ranks`` within ``timeout``; None for a rank that is gone."""
        return [(rank, None if data is None else self._loads(rank, data))
                for rank, data in self._ranks.wait(ranks, timeout)]

    @staticmethod
    def _loads(rank: int, data: bytes) -> Any:
        try:
            return pickle.loads(data)
        except BaseException as exc:
            return ("err", None, f"rank {rank}: its reply could not be unpickled in the test process: "
                    f"{type(exc).__name__}: {exc}\n", None)

    def _log_size(self, rank: int) -> int:
        fd = self._logs[rank]
        try:
            return os.fstat(fd).st_size if fd is not None else 0
        except OSError:
            return 0

    def _read_log(self, rank: int, offset: int) -> str:
        fd = self._logs[rank] if rank < len(self._logs) else None
        chunks = []
        with suppress(OSError):
            while fd is not None and (chunk := os.pread(fd, 1 << 20, offset)):
                chunks.append(chunk)
                offset += len(chunk)
        return b"".join(chunks).decode("utf-8", "replace")

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
        payload = _dumps_call(fn, args, kwargs)
        return self._call([payload] * self.world_size, _describe(fn), timeout)

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
            payloads.append(_dumps_call(fn, args, kwargs))
            names.append(_describe(fn))
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
                raise PoolBrokenError(f"{self!r} is broken ({self.broken_reason}); make a new one "
                                      "(get_pool() does that for you)")
            try:
                return self._call_locked(payloads, name, timeout)
            except (RankPoolError, PoolBrokenError):
                raise
            except BaseException as exc:  # KeyboardInterrupt etc: state unknown, throw it away
                self._kill(f"interrupted by {type(exc).__name__} during {name}")
                raise

    def _call_locked(self, payloads: list[bytes], name: str, timeout: float | None,
                     check_sync: bool = True) -> list:
        timeout = self.timeout if timeout is None else float(timeout)
        call_id = next(self._call_ids)
        header = _HEADER.pack(call_id)
        W = self.world_size
        offsets = [self._log_size(r) for r in range(W)]
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
                    exceptions[rank] = _loads_exception(msg[3] if len(msg) > 3 else None)
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
            msg = self._report(
                f"rank(s) {sorted(dead)} of {W} died during {name} "
                f"(exitcodes {dict(sorted(dead.items()))}); the pool was killed",
                name, all_fail, pending, offsets, call_id)
            raise RankDied(msg, exitcodes=dead, failures=all_fail, exceptions=exceptions,
                           results=results)

        if pending and not failures:
            self._dump_stacks(pending)
            self._kill(f"{name} timed out")
            msg = self._report(
                f"{name} did not finish within {timeout:g}s on rank(s) {pending} of {W} "
                "(the pool was killed)", name, failures, pending, offsets, call_id)
            raise RankTimeout(msg, pending=pending, failures=failures, exceptions=exceptions,
                              results=results)

        if failures:
            killed = False
            note = ""
            if pending:
                # The failure probably left the others waiting in a collective.
                self._dump_stacks(pending)
                self._kill(f"rank(s) {pending} did not answer after a failure in {name}")
                killed = True
                why = ("timeout" if time.monotonic() >= deadline
                       else f"failure_grace={self.failure_grace:g}s")
                note = (f"; rank(s) {pending} had not answered {elapsed:.1f}s in ({why}), "
                        "so the pool was killed")
            else:
                killed = check_sync and not self._still_in_sync()  # not from the barrier itself
                if killed:
                    note = ("; afterwards the group failed a barrier (ranks out of step), "
                            "so the pool was killed")
            msg = self._report(f"{len(failures)} of {W} rank(s) failed in {name}{note}",
                               name, failures, pending, offsets, call_id)
            raise RankFailure(msg, failures=failures, exceptions=exceptions, results=results,
                              pool_killed=killed)

        return [results[r] for r in range(W)]

    def _still_in_sync(self) -> bool:
        """After a failure, check that a barrier still works, else kill the pool."""
        try:
            self._call_locked([_dumps_call(barrier, (), {})] * self.world_size, "barrier",
                              min(10.0, self.pg_timeout), check_sync=False)
            return True
        except RankPoolError:
            if not self.broken:
                self._kill("barrier failed after a failed call")
            return False

    def _report(self, headline: str, name: str, failures: dict[int, str], pending: list[int],
                offsets: list[int], call_id: int) -> str:
        lines = [headline, ""]
        # Root causes (ranks that raised) first, then the ranks that never answered.
        for rank in sorted(range(self.world_size), key=lambda r: (r not in failures, r)):
            if rank in failures:
                lines.append(f"--- rank {rank} ---")
                lines.append(_indent(failures[rank]).rstrip("\n"))
            elif rank in pending:
                lines.append(f"--- rank {rank}: no answer ---")
            else:
                continue
            out = self._read_log(rank, offsets[rank])
            if out.strip():
                lines.append(f"--- rank {rank} output during this call "
                             "(includes its stack dump if it hung) ---")
                lines.append(_indent(_tail(out)).rstrip("\n"))
            lines.append("")
        return "\n".join(lines)

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
                            conn.send_bytes(_CLOSE_REQUEST)
                    self._ranks.close(grace_s=timeout)
                self._ranks.kill()  # whatever is still there; also reaps
            finally:
                self._cleanup()

    def _cleanup(self) -> None:
        with suppress(Exception):
            self._ranks.release()
        self._store = None  # the master store lives exactly as long as the pool
        logs, self._logs = self._logs, [None] * len(self._logs)
        for fd in logs:
            if fd is not None:
                with suppress(OSError):
                    os.close(fd)
        with _LIVE_LOCK:
            _LIVE_POOLS.discard(self)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "broken" if self.broken else "live"
        return f"<RankPool world_size={self.world_size} {state}>"


# --------------------------------------------------------------------------- pool cache

_DEFAULT_KW = {"timeout": 60.0, "env": None, "pg_timeout": 60.0, "startup_timeout": 120.0,
               "failure_grace": 10.0, "capture_output": None}
_CACHE: OrderedDict[int, RankPool] = OrderedDict()
_CACHE_LOCK = threading.RLock()
# Each idle worker holds ~230 MB (torch); keep the cache from holding sizes 1..10 at once.
MAX_CACHED_WORKERS = int(os.environ.get("RANKPOOL_MAX_CACHED_WORKERS", "16"))


def get_pool(world_size: int, **kw) -> RankPool:
    """A live pool of ``world_size`` ranks, shared between callers.

    A cached pool that is broken, closed or has a dead worker is replaced. Pools asked for
    with non-default keyword arguments are new and not cached (the caller closes them; atexit
    closes them otherwise). Least recently used cached pools are closed when the cached pools
    would hold more than MAX_CACHED_WORKERS workers.
    """
    unknown = set(kw) - set(_DEFAULT_KW)
    if unknown:
        raise TypeError(f"get_pool() got unexpected keyword arguments {sorted(unknown)}")
    if any(kw[k] != _DEFAULT_KW[k] for k in kw):
        return RankPool(world_size, **kw)
    with _CACHE_LOCK:
        pool = _CACHE.get(world_size)
        if pool is not None and not pool.alive:
            _CACHE.pop(world_size, None)
            pool.close()
            pool = None
        if pool is None:
            total = sum(p.world_size for p in _CACHE.values())
            for size in list(_CACHE):
                if total + world_size <= MAX_CACHED_WORKERS:
                    break
                old = _CACHE.pop(size)
                total -= old.world_size
                old.close()
            pool = RankPool(world_size)
            _CACHE[world_size] = pool
        _CACHE.move_to_end(world_size)
        return pool


def close_all_pools() -> None:
    """Close every cached pool (and any other pool still open in this process)."""
    with _CACHE_LOCK:
        pools = list(_CACHE.values())
        _CACHE.clear()
    with _LIVE_LOCK:
        pools += [p for p in _LIVE_POOLS if p not in pools]
    for pool in pools:
        try:
            pool.close()
        except Exception:
            pass


atexit.register(close_all_pools)
