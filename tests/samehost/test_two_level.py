"""Two levels (objcomm/_samehost/two_level.py) when a host's leader dies mid-call: every other rank raises; when a
host's channel does not open at the set-up: every rank stays on the flat path.

The healthy paths, the call counts and bad input on two levels are in tests/transport/test_many_ranks.py (one pool
of eight ranks); this one needs a group of its own, since a SIGKILLed rank ends the pool's group.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from typing import Any

import pytest
import torch.distributed as dist
from _child import report_raised, run_group_losing_a_rank

import objcomm
from objcomm import _state

TIMEOUT_S = 15  # the group's timeout: what bounds the wait of a rank on another host


def _leader_killed(rank: int, world: int, store: str, victim: int, results: Any, reducing: bool = False) -> None:
    os.environ["OBJCOMM_TEST_RANKS_PER_HOST"] = "2"  # hosts {0, 1} and {2, 3}; their leaders: ranks 0 and 2
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    objcomm.configure()  # a process of its own: reads the variable, nothing to restore
    assert objcomm.all_gather(rank) == list(range(world))  # sets up two levels
    levels = _state.group_facts(dist.group.WORLD).levels  # by the host setting: here 2
    assert levels.get(2) is not None, f"two levels were not set up: {levels}"
    if rank == victim:
        time.sleep(0.5)  # the others are waiting in the all_gather below by now
        os.kill(os.getpid(), signal.SIGKILL)
    if reducing:  # the reduce tree on two levels: ranks 1 and 3 hand their values over, then wait for the result
        report_raised(results, rank, lambda: objcomm.all_reduce([rank], "sum"))
    else:
        report_raised(results, rank, lambda: objcomm.all_gather({"after": rank}))


def _leader_killed_in_a_reduction(rank: int, world: int, store: str, victim: int, results: Any) -> None:
    _leader_killed(rank, world, store, victim, results, reducing=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", [_leader_killed, _leader_killed_in_a_reduction])
def test_a_leader_killed_mid_call_makes_every_other_rank_raise(target):
    """In an all_gather, and in an all_reduce whose tree climbs two levels: the dead leader's host member raises at
    once (its channel closed), the other leader when gloo sees the connection close, and that leader's host member
    with it (the leader's failure fails its host's channel), never after the group's timeout."""
    got, victim_exit = run_group_losing_a_rank(target, 4, 2, timeout=90)
    assert victim_exit == -signal.SIGKILL
    assert sorted(got) == [0, 1, 3]
    for rank, (message, elapsed) in got.items():
        assert message != "no error", rank
        assert elapsed < TIMEOUT_S + 10, (rank, elapsed, message)  # never a hang: the group's timeout at most
    # the live leader's host member: its leader failed the host's channel at once (as_leader: TreeLevels.lead in a
    # reduction), so the member raises rather than wait on the channel; a leader that went on would otherwise leave it
    # there until the group's timeout (here the leader's process ends just after, which closes the channel too)
    assert got[1][1] < TIMEOUT_S - 5 and "failed the channel" in got[1][0], got[1]
    member_message, member_elapsed = got[3]  # its leader's socket closed: the dead leader's host knows at once
    assert "closed its connection" in member_message or "reset its connection" in member_message, member_message


def a_host_whose_channel_fails() -> Any:
    """Hosts of four on a new group of the pool's 8 ranks; the second host's channel does not open (as its set-up's
    own vote would leave every rank of that host): what each rank's first all_gather returns, whether the group kept
    two levels, and how many all_reduces the set-up ran on the whole group (none: the channel's and the levels'
    agreements are votes by recursive doubling, 2 log2 W steps, where an all_reduce is gloo's ring), and how often
    the hosts were discovered apart from the channel's set-up."""
    from _counting import counting
    from test_many_ranks import ranks_per_host

    from objcomm._samehost import hosts as _hosts
    from objcomm._samehost.channel_slots import ChannelSlots

    rank = dist.get_rank()
    real_channel, real_all_reduce, whole_group = ChannelSlots.channel, dist.all_reduce, []
    with ranks_per_host(4):
        sub = dist.new_group(list(range(8)))

        def counted(*args: Any, **kwargs: Any) -> Any:
            whole_group.append(kwargs.get("group") is sub)
            return real_all_reduce(*args, **kwargs)

        def fails(slots: Any, wire: Any, op: str, foreground: bool = False) -> Any:
            if "opening this host's channel" in op:  # (only there: the whole group's channel is asked first)
                return None
            return real_channel(slots, wire, op, foreground)

        if rank >= 4:
            ChannelSlots.channel = fails  # type: ignore[method-assign]
        dist.all_reduce = counted
        try:
            with counting({"discover": [(_hosts, "discover")]}) as discovered:
                got = objcomm.Communicator(sub).all_gather({"rank": rank})
        finally:
            ChannelSlots.channel, dist.all_reduce = real_channel, real_all_reduce  # type: ignore[method-assign]
        facts = _state.group_facts(sub)
        kept = [levels is not None for levels in facts.levels.values()]
        keys = [[len({*hosts.keys[:4]}), len({*hosts.keys[4:]}), len({*hosts.keys})] for hosts in facts.hosts.values()]
        again = objcomm.Communicator(sub).all_gather(rank)
        dist.destroy_process_group(sub)
    return [got, kept, sum(whole_group), again, discovered["discover"], keys]


@pytest.mark.timeout(120)
def test_a_host_whose_channel_does_not_open_leaves_every_rank_on_the_flat_path():
    from _ranks import get_pool

    every = get_pool(8).run(a_host_whose_channel_fails, timeout=90)
    for got, kept, whole_group_all_reduces, again, discovered, keys in every:
        assert got == [{"rank": r} for r in range(8)]
        assert kept == [False]  # no rank kept two levels
        assert whole_group_all_reduces == 0
        assert again == list(range(8))
        # the hosts came with the group's channel set-up, which every rank tried first: no all_gather of their own
        assert discovered == 0 and keys == [[1, 1, 2]]
