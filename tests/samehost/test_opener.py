"""The same-host channel opened in the background (objcomm._samehost.opener), on real gloo groups: a program whose
calls are only send/recv gets it; receives waiting through the group when send/recv move onto it get their messages
there (objcomm._samehost.p2p_state); a rank that stops voting stops every rank; the threads end with the group."""

from __future__ import annotations

import gc
import time
from typing import Any, Dict, List, Tuple

import pytest
import torch.distributed as dist
from _ranks import get_pool

import objcomm
from objcomm import _state
from objcomm._samehost import opener as _opener
from objcomm._samehost.p2p_state import SameHost

pytestmark = pytest.mark.timeout(180)

PAYLOADS = [b"", b"x" * 20_000, b"y" * 300_000]  # in the slot; one channel message past it; a second round


def _state_of(group: Any) -> Any:
    return _state.group_facts(group).local.get(False)


def _through_group(state: Any) -> int:
    """Slots this rank sent and took through the group's backend so far."""
    return sum(state.sent.values()) + sum(state.took.values())


def _on_channel(group: Any) -> bool:
    state = _state_of(group)
    return bool(state is not None and state.channel is not None and state.channel.p2p)


def _token_ring(comm: objcomm.Communicator, go: bool, at: int) -> Tuple[bool, bool]:
    """One round of a token around the ring 0 -> 1 -> ... -> 0, carrying whether every rank so far has send/recv on
    the channel, rank 0's word ``go`` and a payload; every rank checks what it got. ``(go, all on the channel)``."""
    rank, world = dist.get_rank(comm.group), dist.get_world_size(comm.group)
    mine = _on_channel(comm.group)
    payload = PAYLOADS[at % len(PAYLOADS)]
    if rank == 0:
        comm.send((go, mine, at, payload), 1, tag=at % 2)
        got = comm.recv(world - 1, tag=at % 2)
    else:
        got = comm.recv(rank - 1, tag=at % 2)
        comm.send((got[0], got[1] and mine, at, payload), (rank + 1) % world, tag=at % 2)
    assert got[2:] == (at, payload), (rank, got[2], at)
    return got[0], got[1]


def send_recv_only() -> Dict[str, Any]:
    """Only send/recv on a new group, never a collective nor connect(): the token goes round until every rank has
    send/recv on the channel (rank 0 decides, and says so in the token), then 30 rounds more, which must not touch the
    group's backend."""
    group = dist.new_group(list(range(dist.get_world_size())))
    comm = objcomm.Communicator(group)
    deadline, go, at = time.monotonic() + 60, True, 0
    while go:
        if dist.get_rank(group) == 0:
            go = not _token_ring(comm, go, at)[1] and time.monotonic() < deadline
            _token_ring(comm, go, at + 1)  # tells the others
        else:
            go = _token_ring(comm, go, at)[0]
            go = _token_ring(comm, go, at + 1)[0]
        at += 2
    state = _state_of(group)
    before = _through_group(state)
    for i in range(30):
        _token_ring(comm, True, at + i)
    report = {"p2p": state.channel.p2p, "after": _through_group(state) - before, "rounds": at > 0}
    dist.destroy_process_group(group)
    return report


@pytest.mark.parametrize("world", [2, 3])
def test_a_program_of_only_send_recv_gets_the_channel(world):
    assert get_pool(world).run(send_recv_only) == [{"p2p": True, "after": 0, "rounds": True}] * world


def receives_waiting_at_the_switch() -> Dict[str, Any]:
    """W=3: rank 0 has receives from given ranks waiting through the group (three (peer, tag): what a vote carries;
    the second irecv from rank 1 under tag 1 waits in its lane, not yet routed) when the ranks vote send/recv onto the
    channel; the others, once on it, send those messages (the routed ones through the group: they owe them), then
    more (through the channel). Each receive gets its own message, in order."""
    group = dist.new_group([0, 1, 2])
    comm = objcomm.Communicator(group)
    rank = dist.get_rank(group)
    if rank == 0:
        waiting = [comm.irecv(1, tag=1), comm.irecv(1, tag=1), comm.irecv(1, tag=2), comm.irecv(2, tag=1)]
        time.sleep(0.3)  # routed through the group (the channel is not open), waiting there
        hello = [comm.recv(src, tag=5) for src in (1, 2)]  # no vote passes while these sends are not received
    else:
        comm.send("hello", 0, tag=5)  # starts this rank's opener
    deadline = time.monotonic() + 30
    while not _on_channel(group) and time.monotonic() < deadline:
        time.sleep(0.01)
    state = _state_of(group)
    seen: Dict[str, Any] = {"p2p": _on_channel(group)}
    if rank == 0:
        seen["hello"] = hello
        seen["waiting"] = [request.wait(30) for request in waiting]
        seen["later"] = [comm.recv(1, tag=1), comm.recv(2, tag=1)]
    else:
        seen["owed"] = dict(state.owed)
        sends = [("first", 1), ("second", 1), ("third", 2)] if rank == 1 else [("fourth", 1)]
        for text, tag in sends + [(f"later from {rank}", 1)]:
            comm.send(text, 0, tag=tag)
        seen["left"] = dict(state.owed)
    dist.destroy_process_group(group)
    return seen


def test_receives_waiting_through_the_group_at_the_switch_get_their_messages_there():
    zero, one, two = get_pool(3).run(receives_waiting_at_the_switch)
    assert zero == {
        "p2p": True,
        "hello": ["hello", "hello"],
        "waiting": ["first", "second", "third", "fourth"],
        "later": ["later from 1", "later from 2"],
    }
    assert one == {"p2p": True, "owed": {(0, 1): 1, (0, 2): 1}, "left": {}}
    assert two == {"p2p": True, "owed": {(0, 1): 1}, "left": {}}


def one_rank_stops_voting() -> List[Any]:
    """W=3: rank 0 receives from any rank (so no vote passes); rank 2 stops voting (what it does at exit): every rank's
    thread ends, send/recv stay on the group, and go on working there."""
    group = dist.new_group([0, 1, 2])
    comm = objcomm.Communicator(group)
    rank = dist.get_rank(group)
    anyone = comm.irecv(tag=9) if rank == 0 else None
    comm.all_gather(rank)  # opens the channel: every rank's thread votes now
    time.sleep(0.3)
    if rank == 2:
        _opener._stop_all()
    dist.barrier(group)
    deadline = time.monotonic() + 10
    while _state_of(group).opener.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    seen: List[Any] = [_state_of(group).opener.thread.is_alive(), _state_of(group).channel.p2p]
    if rank == 1:
        comm.send("to any", 0, tag=9)
        comm.send("after", 2, tag=1)
    elif rank == 2:
        seen.append(comm.recv(1, tag=1))
    else:
        assert anyone is not None
        seen.append(anyone.wait(30))
    seen.append(comm.all_gather(rank))
    dist.destroy_process_group(group)
    return seen


def test_a_rank_that_stops_voting_stops_every_rank():
    assert get_pool(3).run(one_rank_stops_voting) == [
        [False, False, "to any", [0, 1, 2]],
        [False, False, [0, 1, 2]],
        [False, False, "after", [0, 1, 2]],
    ]


def group_goes_while_voting() -> List[bool]:
    """Rank 0 always votes no; the group is destroyed and collected: every rank's voting thread ends."""
    group = dist.new_group([0, 1])
    comm = objcomm.Communicator(group)
    real = SameHost.begin_vote
    if dist.get_rank(group) == 0:
        SameHost.begin_vote = lambda self, group, settle=0.0: None  # type: ignore[method-assign]
    try:
        comm.all_gather(0)
        time.sleep(0.3)
        thread = _state_of(group).opener.thread
        seen = [thread.is_alive()]
        dist.destroy_process_group(group)
        del comm, group
        gc.collect()
        thread.join(10)
        return seen + [thread.is_alive()]
    finally:
        SameHost.begin_vote = real  # type: ignore[method-assign]


def test_the_voting_threads_end_with_their_group():
    assert get_pool(2).run(group_goes_while_voting) == [[True, False], [True, False]]


def first_calls_differ() -> List[Any]:
    """Rank 0's first call on a new group is a send, rank 1's a collective: the collective waits for the opening in
    the background, and both go on alike (the send, in flight at the opening, keeps send/recv on the group until a
    later vote)."""
    group = dist.new_group([0, 1])
    comm = objcomm.Communicator(group)
    if dist.get_rank(group) == 0:
        comm.send({"first": True}, 1)
        got = comm.all_gather(0)
    else:
        got = comm.all_gather(1)
        got = [got, comm.recv(0)]
    dist.destroy_process_group(group)
    return got


def test_a_collective_waits_for_the_opening_a_send_started():
    assert get_pool(2).run(first_calls_differ) == [[0, 1], [[0, 1], {"first": True}]]


def connect_settles(outstanding: bool) -> List[Any]:
    """connect() after a first send on each rank (the background votes run): its answer is the same on every rank.
    With rank 0 receiving from any rank (``outstanding``), no vote passes: False on both; once that receive ends the
    background votes on, and send/recv move onto the channel."""
    group = dist.new_group([0, 1])
    comm = objcomm.Communicator(group)
    rank = dist.get_rank(group)
    anyone = comm.irecv(tag=9) if rank == 0 and outstanding else None
    comm.send(rank, 1 - rank, tag=1)
    got = comm.recv(1 - rank, tag=1)
    time.sleep(0.2)
    seen: List[Any] = [got, comm.connect()]
    if outstanding:
        if rank == 1:
            comm.send("late", 0, tag=9)
        else:
            assert anyone is not None
            seen.append(anyone.wait(30))
        deadline = time.monotonic() + 30
        while not _on_channel(group) and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(_on_channel(group))
    dist.destroy_process_group(group)
    return seen


@pytest.mark.parametrize("outstanding", [False, True])
def test_connect_settles_send_recv_alike_on_every_rank(outstanding):
    got = get_pool(2).run(connect_settles, outstanding)
    assert got == ([[1, False, "late", True], [0, False, True]] if outstanding else [[1, True], [0, True]])


def owed_send_fails_before_posting() -> List[Any]:
    """Rank 1 owes rank 0 one send through the group (rank 0's irecv waited there at the vote); its first try raises
    before it posts anything: the send is owed still, and the next one goes through the group to that receive."""
    from objcomm._transport import pending as _pending

    group = dist.new_group([0, 1])
    comm = objcomm.Communicator(group)
    rank = dist.get_rank(group)
    if rank == 0:
        waiting = comm.irecv(1, tag=1)
        time.sleep(0.3)
        comm.send("go", 1, tag=2)
        seen: List[Any] = [waiting.wait(30), comm.recv(1, tag=1)]
    else:
        comm.recv(0, tag=2)
        deadline = time.monotonic() + 30
        while not _on_channel(group) and time.monotonic() < deadline:
            time.sleep(0.01)
        seen = [dict(_state_of(group).owed)]
        real = _pending.post

        def fails(*args: Any, **kwargs: Any) -> None:
            _pending.post = real
            raise objcomm.CommunicationError("injected: the send failed before it was posted")

        _pending.post = fails
        try:
            comm.send("lost?", 0, tag=1)
        except objcomm.CommunicationError as exc:
            seen.append("injected" in str(exc))
        finally:
            _pending.post = real
        seen.append(dict(_state_of(group).owed))
        comm.send("first", 0, tag=1)
        comm.send("second", 0, tag=1)
        seen.append(dict(_state_of(group).owed))
    dist.destroy_process_group(group)
    return seen


def test_an_owed_send_that_fails_before_it_is_posted_is_owed_still():
    assert get_pool(2).run(owed_send_fails_before_posting) == [
        ["first", "second"],
        [{(0, 1): 1}, True, {(0, 1): 1}, {}],
    ]


def votes_with_a_balance() -> List[Any]:
    """The vote of an NCCL group (``balance``: slots posted less taken through the group, per rank), called here on a
    gloo group's open channel: it passes only where the sum is 0 and no rank has a receive waiting."""
    group = dist.new_group([0, 1])
    comm = objcomm.Communicator(group)
    comm.connect()
    channel = _state_of(group).channel
    wire = channel_wire(comm)
    rank = dist.get_rank(group)
    outcomes = [
        channel.vote(wire, [], "test", balance=0),
        channel.vote(wire, [], "test", balance=1 if rank == 0 else 0),  # a message sent there, not taken
        channel.vote(wire, [], "test", balance=1 if rank == 0 else -1),  # sent and taken
        channel.vote(wire, [1 - rank, 3, 1] if rank == 1 else [], "test", balance=0),  # a receive waiting there
        channel.vote(wire, [1 - rank, 3, 1] if rank == 1 else [], "test"),  # the same on gloo: counted, passes
    ]
    dist.destroy_process_group(group)
    return [outcome is not None for outcome in outcomes]


def channel_wire(comm: objcomm.Communicator) -> Any:
    return comm._resolved({}).wire


def test_an_nccl_groups_vote_needs_every_message_sent_through_the_group_taken_there():
    assert get_pool(2).run(votes_with_a_balance) == [[True, False, True, False, True]] * 2


def opening_slower_than_a_collective_waits() -> List[Any]:
    """Rank 1's opening takes longer than a collective waits for it (half the group's timeout): that collective goes
    through the group on every rank; the next, once both have opened, through the channel."""
    from datetime import timedelta

    from objcomm._transport import groups as _groups

    group = dist.new_group([0, 1], timeout=timedelta(seconds=12))  # a collective waits 6 s for the opening
    rank = dist.get_rank(group)
    made = _groups.sibling
    if rank == 1:  # (rank 0 waits for it in the control group's rendezvous, up to the 12 s)
        _groups.sibling = lambda *args, **kwargs: (time.sleep(7), made(*args, **kwargs))[1]
    try:
        comm = objcomm.Communicator(group)
        seen: List[Any] = [comm.all_gather(rank), _state_of(group).agreed]
        seen += [comm.all_gather(rank), _state_of(group).agreed, _state_of(group).channel.rounds]
    finally:
        _groups.sibling = made
    dist.destroy_process_group(group)
    return seen


def test_a_collective_goes_through_the_group_until_every_rank_has_opened():
    assert get_pool(2).run(opening_slower_than_a_collective_waits) == [[[0, 1], False, [0, 1], True, 1]] * 2
