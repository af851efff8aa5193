"""The first async collective on a group never traps its caller (issue 28 item 6).

Async collectives run on the group's shadow, a second process group that each member sets up in the background
at its first async collective on the group. These scenarios have ranks reach that point at different places of
their blocking calls and group creation; each must finish with correct results well inside the group's timeout
(``PG_TIMEOUT``, short, so that waiting for it fails fast). Before the change, when the caller's thread set the
shadow up, each of them failed: most waited until the timeout, the ``dist.new_group`` one crossed two groups'
wires and got wrong results, a subgroup one mixed a set-up collective with a broadcast. Every scenario makes the
groups it uses (the default group's is the only one on it), so each is a first async collective there.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from _ranks import RankPool

import objcomm
from objcomm import _state

pytestmark = pytest.mark.timeout(120)

PG_TIMEOUT = 15.0  # seconds: every group's timeout here; a scenario that waits for it has failed
FAST = PG_TIMEOUT / 2  # what a scenario may take at most


@pytest.fixture(scope="module")
def pool():
    """Three ranks of their own, whose default group has no shadow yet."""
    with RankPool(3, pg_timeout=PG_TIMEOUT, timeout=60) as ranks:
        yield ranks


def _group(ranks: List[int]) -> Any:
    return dist.new_group(ranks, timeout=datetime.timedelta(seconds=PG_TIMEOUT))


def _timed(scenario, pool: RankPool, *args: Any) -> List[Any]:
    start = time.monotonic()
    results = pool.run(scenario, *args)
    took = time.monotonic() - start
    assert took < FAST, f"{scenario.__name__} took {took:.1f} s: something waited for a timeout"
    return results


def counted_names_after_wait() -> Any:
    """The documented rule for groups torch names by count (use_local_synchronization): made after wait() on the
    first handle, they are named alike on every rank, however late each rank issued its first async collective."""
    rank = dist.get_rank()
    if len(set(objcomm.all_gather(len(dist.distributed_c10d._world.pg_names)))) > 1:
        return None  # torch would name the group differently anyway: the ranks already know different groups
    group = _group([0, 1, 2])
    if rank:
        time.sleep(0.3 * rank)
    got = objcomm.all_gather(rank, group=group, async_op=True).wait(timeout=PG_TIMEOUT)
    local = dist.new_group([0, 1, 2], use_local_synchronization=True, timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    return got, objcomm.all_gather(rank, group=local)


def test_groups_named_by_count_after_the_first_wait(pool):  # first here: later scenarios make subgroups
    results = _timed(counted_names_after_wait, pool)
    if results[0] is None:
        pytest.skip("the pool's ranks know different numbers of groups (run this test first)")
    assert results == [([0, 1, 2], [0, 1, 2])] * 3


def blocking_first_on_some_ranks(group_ranks: Any) -> Dict[str, Any]:
    """Rank 0 issues its first async collective on the group, then a blocking broadcast; the others broadcast
    first, then issue theirs (the trap: rank 0 used to set the shadow up in its own thread, waiting for the others,
    which waited in the broadcast for rank 0)."""
    rank = dist.get_rank()
    group = None if group_ranks is None else _group(group_ranks)
    if group is not None and rank not in group_ranks:
        return {}
    me, world = dist.get_rank(group), dist.get_world_size(group)
    start = time.monotonic()
    if me == 0:
        pending = objcomm.all_gather({"rank": rank}, group=group, async_op=True)
        issued = time.monotonic() - start
        told = objcomm.broadcast("from group rank 0", src=dist.get_global_rank(group, 0) if group else 0, group=group)
    else:
        told = objcomm.broadcast(None, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        pending = objcomm.all_gather({"rank": rank}, group=group, async_op=True)
        issued = 0.0
    everyone = pending.wait(timeout=PG_TIMEOUT)
    assert told == "from group rank 0"
    assert everyone == [{"rank": r} for r in (dist.get_process_group_ranks(group) if group else range(world))]
    assert objcomm.all_gather(me, group=group) == list(range(world))  # the group itself is still in step
    return {"issued": issued}


def test_default_group_first_async_before_a_blocking_call_on_one_rank_only(pool):
    results = _timed(blocking_first_on_some_ranks, pool, None)
    assert results[0]["issued"] < 1.0, "issuing the first async collective blocked its caller"


@pytest.mark.parametrize("group_ranks", [[0, 1, 2], [1, 2], [0, 2]], ids=["every-rank", "subgroup", "subgroup2"])
def test_new_group_first_async_before_a_blocking_call_on_one_rank_only(pool, group_ranks):
    _timed(blocking_first_on_some_ranks, pool, group_ranks)


def new_group_in_between() -> List[Any]:
    """Rank 0 issues its first async collective on a group, then creates a group with every rank (a collective
    dist.new_group); the others create that group first. Both groups then work, and so does the async one."""
    rank = dist.get_rank()
    group = _group([0, 1, 2])
    if rank == 0:
        pending = objcomm.all_gather(rank, group=group, async_op=True)
        time.sleep(0.5)  # its shadow's set-up now waits for the others, in the store new_group uses too
        other = _group([0, 1, 2])
    else:
        other = _group([0, 1, 2])
        pending = objcomm.all_gather(rank, group=group, async_op=True)
    later = objcomm.all_gather(-rank, group=other, async_op=True)
    assert objcomm.all_gather(rank * 10, group=other) == [0, 10, 20]
    assert objcomm.all_gather(rank * 100, group=group) == [0, 100, 200]
    return [pending.wait(timeout=PG_TIMEOUT), later.wait(timeout=PG_TIMEOUT)]


def test_dist_new_group_between_on_one_side(pool):
    assert _timed(new_group_in_between, pool) == [[[0, 1, 2], [0, -1, -2]]] * 3


def same_ranks_opposite_order() -> Dict[str, Any]:
    """Two groups with the same ranks each get a shadow of their own, although the ranks issue their first async
    collectives on them in opposite orders, between blocking calls on both groups."""
    rank = dist.get_rank()
    first, second = _group([0, 1, 2]), _group([0, 1, 2])
    pending = {}

    def issue(group: Any) -> None:
        pending[group] = objcomm.all_gather((rank, "first" if group is first else "second"), group=group, async_op=True)

    if rank % 2 == 0:
        issue(first)
    objcomm.all_gather(None, group=first)
    issue(second)
    objcomm.all_gather(None, group=second)
    if rank % 2:
        issue(first)
    got = [pending[group].wait(timeout=PG_TIMEOUT) for group in (first, second)]
    shadows = [_state.group_facts(group).requests.shadow for group in (first, second)]
    names = [dist.distributed_c10d._world.pg_names[shadow] for shadow in shadows]
    assert shadows[0] is not shadows[1] and names[0] != names[1], names
    return {"got": got, "shadow ranks": [dist.get_process_group_ranks(shadow) for shadow in shadows]}


def test_two_groups_with_the_same_ranks_get_two_shadows(pool):
    for result in _timed(same_ranks_opposite_order, pool):
        assert result["got"] == [[(r, "first") for r in range(3)], [(r, "second") for r in range(3)]]
        assert result["shadow ranks"] == [[0, 1, 2], [0, 1, 2]]


SHORT = 2.0  # the timeout of the group a member never uses


def a_member_never_issues() -> Any:
    """Rank 2 never issues the async collective: the others' wait() raises CommunicationError once the group's
    timeout has passed (no longer hang), and so does every later async collective on the group."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1, 2], timeout=datetime.timedelta(seconds=SHORT))
    dist.barrier()
    if rank == 2:
        return None
    start = time.monotonic()
    pending = objcomm.all_gather(rank, group=group, async_op=True)
    issued = time.monotonic() - start
    errors = []
    for request in (pending, objcomm.broadcast(rank, src=0, group=group, async_op=True)):
        try:
            request.wait(timeout=PG_TIMEOUT)
        except objcomm.CommunicationError as exc:
            errors.append(type(exc.__cause__).__name__)
    return issued, time.monotonic() - start, errors


def test_a_member_that_never_issues_gives_the_groups_timeout_error(pool):
    for result in pool.run(a_member_never_issues)[:2]:
        issued, took, errors = result
        assert issued < 1.0 and SHORT <= took < SHORT + FAST, result
        assert len(errors) == 2, result
    pool.check()  # the pool is still in step


def shadows_outlive_nothing() -> Dict[str, int]:
    """Groups made, used for one async collective and destroyed, again and again: their shadows go with them."""
    import gc

    world = dist.distributed_c10d._world
    before = len(world.pg_map)
    for _ in range(5):
        group = dist.new_group(list(range(dist.get_world_size())))
        objcomm.all_gather(dist.get_rank(), group=group, async_op=True).wait(30)
        dist.destroy_process_group(group)
        del group
        gc.collect()
    return {"before": before, "after": len(world.pg_map)}


def test_a_destroyed_groups_shadow_is_destroyed_too(pool):
    for counts in pool.run(shadows_outlive_nothing, timeout=120):
        assert counts["after"] == counts["before"], counts


def members_know_different_groups() -> Any:
    """A subgroup whose members know different numbers of process groups (rank 0 and 1 made one with
    use_local_synchronization that rank 2 is not in): its shadow is named after the group, not after counts.
    torch names groups by counts that differ across versions, so the two groups come in the order each torch
    allows: up to torch 2.13 a group made with use_local_synchronization is named after the groups its members
    know (so it comes first, while ranks 0 and 1 know the same ones); from torch 2.14 it advances the count that
    ``dist.new_group`` names every group by (so the subgroup comes first, and no rank may make a group with the
    others afterwards: this test runs last in its module)."""
    rank = dist.get_rank()
    subgroup_first = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 14)
    group = _group([1, 2]) if subgroup_first else None
    if rank in (0, 1):
        dist.new_group([0, 1], use_local_synchronization=True, timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    if group is None:
        group = _group([1, 2])
    if rank == 0:
        return None
    pending = objcomm.all_gather(rank, group=group, async_op=True)
    torch_sum = torch.tensor([rank])
    dist.all_reduce(torch_sum, group=group)  # a tensor collective on the group meanwhile
    return pending.wait(timeout=PG_TIMEOUT), int(torch_sum.item())


def test_a_subgroup_whose_members_know_different_numbers_of_groups(pool):  # last: see members_know_different_groups
    assert _timed(members_know_different_groups, pool) == [None, ([1, 2], 3), ([1, 2], 3)]
