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

Tests import everything from here. Spawning, the rank environment (OMP_NUM_THREADS
etc., in place from interpreter start) and reaping come from ``objcomm._tools.launch``,
parent-death signals and joining the group from ``objcomm._tools.rank_side``; the harness
itself is one concern per module:

- ``_ranks`` (this module): the shared pool cache (:func:`get_pool`) and scenario helpers;
- ``_rank_pool``: :class:`RankPool`, one pool's startup, calls, failure handling and shutdown;
- ``_rank_worker``: the worker processes' main loop and what crosses their pipes;
- ``_rank_logs``: per-rank output capture and the failure reports that quote it;
- ``_rank_errors``: the exceptions.
"""

from __future__ import annotations

import atexit
import inspect
import os
import threading
from collections import OrderedDict

from _rank_errors import PoolBrokenError, PoolStartupError, RankDied, RankFailure, RankPoolError, RankTimeout
from _rank_pool import RankPool, live_pools
from _rank_worker import barrier

from objcomm._tools import launch as _launch

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

free_port = _launch.free_port  # for tests that launch torchrun


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
        "env": {
            k: os.environ.get(k)
            for k in (
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "OMP_NUM_THREADS",
            )
        },
    }


# --------------------------------------------------------------------------- pool cache

# RankPool's own keyword defaults: a pool asked for with exactly these is cached and shared.
_DEFAULT_KW = {
    name: param.default
    for name, param in inspect.signature(RankPool).parameters.items()
    if param.kind is param.KEYWORD_ONLY
}
_CACHE: OrderedDict[int, RankPool] = OrderedDict()
_CACHE_LOCK = threading.RLock()
# Each idle worker holds ~230 MB (torch): 24 (~5.5 GB) keep the pool of 8 alive beside the smaller ones between
# modules (16 restarted it four times a run, ~9 s each on two cores), and not sizes 1..10 at once.
MAX_CACHED_WORKERS = int(os.environ.get("RANKPOOL_MAX_CACHED_WORKERS", "24"))


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
    pools += [p for p in live_pools() if p not in pools]
    for pool in pools:
        try:
            pool.close()
        except Exception:
            pass


atexit.register(close_all_pools)
