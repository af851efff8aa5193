"""Tests of the rank-pool harness in tests/_ranks.py."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time

import _ranks
import psutil
import pytest
from _ranks import (
    PoolBrokenError,
    PoolStartupError,
    RankDied,
    RankFailure,
    RankPool,
    RankTimeout,
    close_all_pools,
    free_port,
    get_pool,
)

_ORIGINAL_ENV = dict(os.environ)


# ----------------------------------------------------------------- scenarios (run on the ranks)


def rank_and_size():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def echo(*args, **kwargs):
    import torch.distributed as dist

    return dist.get_rank(), args, kwargs


def all_reduce_sum():
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": dist.get_rank()})
    return t.item(), gathered


def fail_on_rank(bad_rank, message):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise ValueError(message)
    return "fine"


def sleep_on_rank(slow_rank, seconds):
    import torch.distributed as dist

    if dist.get_rank() == slow_rank:
        time.sleep(seconds)
    return dist.get_rank()


def fail_then_wait_in_barrier(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise RuntimeError(f"rank {bad_rank} gives up before the barrier")
    dist.barrier()  # the others wait here for the rank that failed
    return "unreachable"


def exit_on_rank(bad_rank, code):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        os._exit(code)
    dist.barrier()
    return "unreachable"


def read_env(*names):
    return tuple(os.environ.get(n) for n in names)


def print_then_fail(bad_rank):
    import sys

    import torch.distributed as dist

    print(f"stdout line from rank {dist.get_rank()}")
    print(f"stderr line from rank {dist.get_rank()}", file=sys.stderr)
    if dist.get_rank() == bad_rank:
        raise KeyError("after printing")
    return "ok"


def unpicklable_result():
    return lambda: None


def _gone(pid):
    """True if no process with this pid exists any more (a zombie counts as not gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_DEAD
    except psutil.NoSuchProcess:
        return True


def assert_reaped(pool):
    assert len(pool.pids) == pool.world_size
    for pid in pool.pids:
        assert _gone(pid), f"worker pid {pid} still exists"
    ours = {p.pid for p in multiprocessing.active_children()}
    assert not ours & set(pool.pids)


# ----------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pool3():
    return get_pool(3)


# ----------------------------------------------------------------- tests


@pytest.mark.timeout(120)
def test_world_size_1_results(pool3):
    pool = get_pool(1)
    assert pool.world_size == 1
    assert pool.run(rank_and_size) == [(0, 1)]
    info = pool.run(_ranks.rank_info)[0]  # a function from _ranks itself
    assert info["rank"] == 0 and info["world_size"] == 1 and info["backend"] == "gloo"


@pytest.mark.timeout(120)
def test_world_size_3_results_in_rank_order(pool3):
    assert pool3.run(rank_and_size) == [(0, 3), (1, 3), (2, 3)]
    assert pool3.run(echo, 1, "two", key=[3]) == [(r, (1, "two"), {"key": [3]}) for r in range(3)]


@pytest.mark.timeout(60)
def test_worker_environment(pool3):
    infos = pool3.run(_ranks.rank_info)
    assert len({i["pid"] for i in infos}) == 3
    for rank, info in enumerate(infos):
        env = info["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["OMP_NUM_THREADS"] == "1" and info["num_threads"] == 1
        assert info["ppid"] == os.getpid()
    # The parent's own environment was not changed by starting workers.
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "OMP_NUM_THREADS"):
        assert os.environ.get(key) == _ORIGINAL_ENV.get(key)


@pytest.mark.timeout(60)
def test_all_reduce_across_ranks(pool3):
    results = pool3.run(all_reduce_sum)
    for total, gathered in results:
        assert total == 6.0
        assert gathered == [{"rank": 0}, {"rank": 1}, {"rank": 2}]


@pytest.mark.timeout(60)
def test_lambdas_and_closures_go_by_cloudpickle(pool3):
    offset = 40

    def closure(x):
        import torch.distributed as dist

        return dist.get_rank() + x + offset

    assert pool3.run(closure, 2) == [42, 43, 44]
    assert pool3.run(lambda: "lam") == ["lam"] * 3


@pytest.mark.timeout(60)
def test_run_each(pool3):
    out = pool3.run_each([rank_and_size, (echo, (1,)), (echo, (), {"k": 2})])
    assert out == [(0, 3), (1, (1,), {}), (2, (), {"k": 2})]
    with pytest.raises(ValueError):
        pool3.run_each([rank_and_size])


@pytest.mark.timeout(60)
def test_exception_on_one_rank_is_rank_failure_and_pool_survives(pool3):
    with pytest.raises(RankFailure) as info:
        pool3.run(fail_on_rank, 1, "boom from the middle rank")
    exc = info.value
    assert isinstance(exc, AssertionError)
    assert not isinstance(exc, (RankTimeout, RankDied))
    assert exc.ranks == [1]
    assert exc.results == {0: "fine", 2: "fine"}
    assert isinstance(exc.exceptions[1], ValueError)
    text = str(exc)
    assert "rank 1" in text and "rank 0 ---" not in text and "rank 2 ---" not in text
    assert "Traceback (most recent call last)" in text
    assert "in fail_on_rank" in text  # the remote frame
    assert "ValueError: boom from the middle rank" in text
    assert not exc.pool_killed

    # Still usable, collectives still line up.
    assert not pool3.broken
    assert pool3.run(rank_and_size) == [(0, 3), (1, 3), (2, 3)]
    assert [r[0] for r in pool3.run(all_reduce_sum)] == [6.0] * 3


@pytest.mark.timeout(60)
def test_worker_output_is_captured_and_shown_on_failure(pool3):
    with pytest.raises(RankFailure) as info:
        pool3.run(print_then_fail, 2)
    text = str(info.value)
    assert "stdout line from rank 2" in text and "stderr line from rank 2" in text
    assert "from rank 0" not in text  # only failing ranks are shown
    assert "stdout line from rank 0" in pool3.output(0)
    assert pool3.run(print_then_fail, -1) == ["ok"] * 3


@pytest.mark.timeout(60)
def test_unpicklable_result_is_reported(pool3):
    with pytest.raises(RankFailure, match="could not be pickled"):
        pool3.run(unpicklable_result)
    assert pool3.run(rank_and_size)[2] == (2, 3)


@pytest.mark.timeout(120)
def test_hang_raises_rank_timeout_and_kills_pool():
    pool = RankPool(2)
    try:
        assert pool.run(rank_and_size) == [(0, 2), (1, 2)]
        start = time.monotonic()
        with pytest.raises(RankTimeout) as info:
            pool.run(sleep_on_rank, 1, 100, timeout=3)
        elapsed = time.monotonic() - start
        assert 3 <= elapsed < 15, elapsed
        exc = info.value
        assert exc.pending == [1]
        assert exc.results == {0: 0}
        text = str(exc)
        assert "[1]" in text and "3s" in text
        assert "sleep_on_rank" in text  # the stack dump of the hung rank
        assert pool.broken
        assert all(p.exitcode is not None for p in pool._procs)
        assert_reaped(pool)
        with pytest.raises(PoolBrokenError):
            pool.run(rank_and_size)
    finally:
        pool.close()
        pool.close()
    assert_reaped(pool)


@pytest.mark.timeout(120)
def test_failure_while_others_wait_in_collective_and_dead_worker():
    pool = RankPool(2, failure_grace=1.0)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        pool.run(fail_then_wait_in_barrier, 1)
    assert time.monotonic() - start < 10
    exc = info.value
    assert not isinstance(exc, RankTimeout)
    assert exc.ranks == [1] and exc.pool_killed
    assert "gives up before the barrier" in str(exc)
    assert "no answer" in str(exc)  # rank 0 is reported as stuck
    assert pool.broken
    assert_reaped(pool)
    pool.close()

    with RankPool(2) as pool:
        start = time.monotonic()
        with pytest.raises(RankDied) as info:
            pool.run(exit_on_rank, 1, 3)
        assert time.monotonic() - start < 10
        assert isinstance(info.value, RankFailure)
        assert info.value.exitcodes[1] == 3
        assert "exitcode 3" in str(info.value)
        assert pool.broken
        assert_reaped(pool)
    assert pool.closed


@pytest.mark.timeout(120)
def test_startup_failure_is_reported_with_worker_traceback():
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(PoolStartupError) as info:
        RankPool(1, env={"GLOO_SOCKET_IFNAME": "no_such_if0"}, startup_timeout=60)
    text = str(info.value)
    assert "rank 0" in text and "init_process_group" in text and "no_such_if0" in text
    assert not {p.pid for p in multiprocessing.active_children()} - before


@pytest.mark.timeout(60)
def test_pickling_error_in_parent_does_not_break_pool(pool3):
    with pytest.raises(TypeError):
        pool3.run(rank_and_size, socket.socket())  # cloudpickle cannot send a socket either
    assert pool3.alive


@pytest.mark.timeout(30)
def test_free_port():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.timeout(120)
def test_get_pool_cache_and_close_is_idempotent(pool3):
    one = get_pool(1)
    assert get_pool(1) is one and get_pool(3) is pool3
    custom = get_pool(1, timeout=5.0, env={"HARNESS_FLAG": "on", "LOCAL_RANK": "7"})
    try:
        assert custom is not one and get_pool(1) is one
        assert custom.run(read_env, "HARNESS_FLAG", "LOCAL_RANK", "RANK") == [("on", "7", "0")]
        assert one.run(read_env, "HARNESS_FLAG") == [(None,)]
    finally:
        custom.close()
    assert_reaped(custom)

    pools = [one, pool3]
    close_all_pools()
    for pool in pools:
        assert pool.closed
        assert_reaped(pool)
        pool.close()  # idempotent
        with pytest.raises(PoolBrokenError):
            pool.run(rank_and_size)
    close_all_pools()
    assert not any(p.pid in {pid for pool in pools for pid in pool.pids} for p in multiprocessing.active_children())
