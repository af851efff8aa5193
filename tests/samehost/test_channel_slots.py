"""Decisions of objcomm._samehost.channel_slots that every rank must see alike, on real 2-rank gloo groups: the control
group the channel's votes go through, and send/recv on a channel closed without a failure."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, List

import pytest
import torch.distributed as dist
from _ranks import get_pool
from test_first_round_p2p import foreground

import objcomm
from objcomm import _state
from objcomm._transport import groups as _groups

pytestmark = pytest.mark.timeout(120)


def _state_of(group: Any) -> Any:
    return _state.group_facts(group).local.get(False)


def control_group_fails_on_one_rank(background: bool) -> List[Any]:
    """Rank 1's control group fails once made (on rank 0 it works): every rank does without it, so that the send/recv
    votes go through one group on both (before: rank 0 voted through its control group and rank 1 through the group
    itself, each waiting for the other until the timeout). A rank that fails before the ranks meet to make it makes
    the others fail too (they wait for it until the timeout): they agree, if late. Where the channel opens in the
    background (``background``), through a control group of its own, that opening fails on both ranks (rank 0's
    through a control group whose peer is gone), and at the first collective every rank opens the channel through
    the group instead, as above."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=timedelta(seconds=20))
    if not background:
        foreground(group)
    made = _groups.sibling
    if rank == 1:

        def refuse(*args: Any, **kwargs: Any) -> Any:
            _groups.forget(made(*args, **kwargs))
            raise RuntimeError("the sibling group failed once made")

        _groups.sibling = refuse
    try:
        comm = objcomm.Communicator(group, local=True)
        gathered = [comm.all_gather(rank) for _ in range(3)]  # opens the channel, then votes send/recv onto it
        state = _state_of(group)
        seen: List[Any] = [gathered, state.control is None, state.channel.p2p, state.background]
        if rank == 0:
            comm.send({"after": "votes"}, 1)
        else:
            seen.append(comm.recv(0))
        return seen
    finally:
        _groups.sibling = made
        dist.destroy_process_group(group)


@pytest.mark.parametrize("background", [False, True])
def test_a_control_group_that_one_rank_cannot_make_is_used_by_none(background):
    results = get_pool(2).run(control_group_fails_on_one_rank, background)
    assert results[0] == [[[0, 1]] * 3, True, True, False]
    assert results[1] == [[[0, 1]] * 3, True, True, False, {"after": "votes"}]


def send_on_a_channel_closed_without_failure() -> List[Any]:
    """Rank 0's channel closes without a failure (what happens at exit) while send/recv go through it: a send then
    raises, as a collective does, where before it went through the backend and returned while rank 1 would wait
    for it on the channel (a message lost, its sender told it was sent)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    comm = objcomm.Communicator(group, local=True)
    for _ in range(3):
        comm.all_gather(rank)  # opens the channel and votes send/recv onto it
    channel = _state_of(group).channel
    seen: List[Any] = [channel.p2p]
    dist.barrier()
    if rank == 0:
        channel.close("closed at exit")
        for call in (lambda: comm.send("lost?", 1), lambda: comm.all_gather(rank)):
            try:
                call()
                seen.append("returned")
            except objcomm.CommunicationError as exc:
                seen.append("closed" in str(exc))
    dist.barrier()
    dist.destroy_process_group(group)
    return seen


def test_send_on_a_channel_closed_without_a_failure_raises_like_a_collective():
    assert get_pool(2).run(send_on_a_channel_closed_without_failure) == [[True, True, True], [True]]
