"""send/recv through the same-host channel (objcomm._samehost.channel_slots): the backend's point-to-point scenarios
give the same results through it; when send/recv may start using it; threads; a killed peer; a failed channel."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable, Dict, List

import pytest
import test_collectives
import test_failures
import test_requests
import test_tags
import torch.distributed as dist
from _child import report_raised, run_group_losing_a_rank
from _ranks import get_pool

import objcomm
from objcomm import _state
from objcomm._samehost import channel_slots as _channel_slots
from objcomm._samehost.p2p_state import SameHost

pytestmark = pytest.mark.timeout(180)


def _state_of(group: Any = None) -> Any:
    return _state.group_facts(group if group is not None else dist.group.WORLD).local.get(False)


def foreground(group: Any) -> Any:
    """``group``, whose channel its first collective opens and whose all_gathers vote send/recv onto it (as on a
    group of more than ``opener.MOST_RANKS`` ranks), where small groups do both in the background (opener)."""
    _state.group_facts(group).local.setdefault(False, SameHost()).background = False
    return group


def through_the_channel(scenario: Callable[..., Any], *args: Any) -> Any:
    """``scenario(*args)`` with ``local`` on, after an all_gather that opened the default group's channel and
    let send/recv in; the channel must still be open (and carrying send/recv) at the end."""
    previous = objcomm.configure(local=True)
    try:
        objcomm.all_gather(None)
        state = _state_of()
        assert state.channel is not None and state.channel.p2p, "send/recv do not go through the channel"
        result = scenario(*args)
        assert state.channel.p2p and not state.channel.closed
        return result
    finally:
        objcomm.restore(previous)


SCENARIOS = [  # (scenario, args, world): every send/recv scenario of the backend's tests
    (test_tags.concurrent_streams, (10, False), 2),
    (test_tags.concurrent_streams, (test_tags.BIG, False), 2),
    (test_tags.concurrent_streams, (test_tags.BIG, True), 2),
    (test_tags.interleaved_streams, (10, False), 2),
    (test_tags.interleaved_streams, (test_tags.BIG, True), 2),
    (test_tags.from_any_rank, (), 2),
    (test_tags.from_any_rank, (), 4),
    (test_tags.bad_tags, (), 2),
    (test_requests.point_to_point, (10,), 2),
    (test_requests.point_to_point, (test_requests.BIG,), 2),
    (test_requests.failures_travel, (), 3),
    (test_failures.sender_fails_point_to_point, (), 3),
    (test_failures.limits_on_both_sides, (), 3),
    (test_failures.original_type_on_the_failing_rank, (), 3),
    (test_collectives.ops_on_subgroup, (), 4),
]


@pytest.mark.parametrize(
    "scenario, args, world", SCENARIOS, ids=[f"{s.__module__}.{s.__name__}-{a}-w{w}" for s, a, w in SCENARIOS]
)
def test_backend_scenarios_give_the_same_through_the_channel(scenario, args, world):
    pool = get_pool(world)
    assert pool.run(through_the_channel, scenario, *args) == pool.run(scenario, *args)


@pytest.mark.parametrize("layout", ["default", "tiny"])
@pytest.mark.parametrize("world", [2, 3])
def test_every_op_with_a_ring_of_send_recv_through_the_channel(world, layout):
    kinds = test_collectives.KINDS_FOR[layout]
    got = get_pool(world).run(
        through_the_channel, test_collectives.run_all_ops, "msgpack", test_collectives.LAYOUTS[layout], kinds
    )
    assert got == [len(kinds)] * world


# -- the channel is really used, and only once it is safe ----------------------------------------------
def sends_before_the_receiver_asks() -> List[Any]:
    """Rank 0 sends three small objects and then joins an all_gather, before rank 1 posts any recv: through
    the channel a send returns once the kernel holds it; gloo's would wait for its receiver (here: forever)."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(local=True)
    comm.all_gather(0)
    if rank == 0:
        done = threading.Event()
        sender = threading.Thread(target=lambda: ([comm.send(i, 1, tag=7) for i in range(3)], done.set()))
        sender.start()
        returned = done.wait(30)
        comm.all_gather(1)
        sender.join(60)
        return [returned]
    comm.all_gather(1)
    return [comm.recv(0, tag=7) for _ in range(3)]


def test_a_send_returns_before_its_receive_is_posted():
    assert get_pool(2).run(sends_before_the_receiver_asks) == [[True], [0, 1, 2]]


def in_flight_at_the_first_collective(anyone: bool) -> List[Any]:
    """An irecv outstanding through the group at the collective that opens the channel (and votes: an all_gather).
    From any rank (``anyone``) it keeps send/recv on the group (any sender may have decided before); the first
    all_gather with nothing in flight anywhere lets them in. From a given rank it does not: the vote counts it, and
    its sender sends that one message through the group, the next through the channel."""
    rank = dist.get_rank()
    group = foreground(dist.new_group(list(range(dist.get_world_size()))))  # nothing opened on it yet
    comm = objcomm.Communicator(group, local=True)
    seen: List[Any] = []
    pending = comm.irecv(None if anyone else 1, tag=2) if rank == 0 else None
    time.sleep(0.2)  # the irecv is posted when the all_gather votes
    comm.all_gather(0)
    seen.append(_state_of(group).channel.p2p)
    if rank == 1:
        seen.append(dict(_state_of(group).owed))
        comm.send("early", 0, tag=2)  # through the group, as rank 0's irecv
    else:
        seen.append(pending.wait(60))
    comm.broadcast(1)  # no vote in a broadcast
    seen.append(_state_of(group).channel.p2p)
    comm.all_gather(2)  # nothing in flight now
    seen.append(_state_of(group).channel.p2p)
    if rank == 1:
        comm.send("late", 0, tag=2)
    else:
        seen.append(comm.recv(1, tag=2))
    sent, took = _state_of(group).sent, _state_of(group).took  # what went through the group
    return seen + [sent.get((0, 2), 0) if rank else took.get((1, 2), 0)]


def test_send_recv_move_to_the_channel_only_when_no_send_is_in_flight():
    assert get_pool(2).run(in_flight_at_the_first_collective, True) == [
        [False, "early", False, True, "late", 1],
        [False, {}, False, True, 1],
    ]
    assert get_pool(2).run(in_flight_at_the_first_collective, False) == [
        [True, "early", True, True, "late", 1],
        [True, {(0, 2): 1}, True, True, 1],
    ]


def starts_during_a_vote() -> List[Any]:
    """A send that another thread starts while this rank's yes-vote is out waits for the outcome, then takes
    the channel like its receiver (through the group it would wait for a receiver that never posts there)."""
    rank = dist.get_rank()
    group = foreground(dist.new_group(list(range(dist.get_world_size()))))
    comm = objcomm.Communicator(group, local=True)
    pending = comm.irecv(1, tag=1) if rank == 0 else None
    comm.broadcast(0)  # opens the channel; rank 0's irecv is in flight: send/recv stay on the group
    if rank == 0:
        seen: List[Any] = [pending.wait(60), _state_of(group).channel.p2p]
        sender = threading.Thread(target=lambda: (time.sleep(0.2), comm.send("b", 1, tag=2)))
        sender.start()
        comm.all_gather(0)  # rank 1 comes 0.6 s late: the thread starts its send while the vote is out
        sender.join(60)
        return seen + [not sender.is_alive(), _state_of(group).channel.p2p]
    comm.send("a", 0, tag=1)
    time.sleep(0.6)
    comm.all_gather(1)
    return [comm.recv(0, tag=2), _state_of(group).channel.p2p]


def test_a_send_started_during_the_vote_waits_for_its_outcome():
    assert get_pool(2).run(starts_during_a_vote) == [["a", False, True, True], ["b", True]]


def many_threads(rounds: int) -> Dict[str, Any]:
    """Per rank: a thread per (peer, tag) sending, one receiving from any rank on its own tag, isend/irecv
    lanes, and collectives on the main thread, all at once on one channel; nothing is lost or mixed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator(local=True, slot_bytes=256)
    comm.all_gather(0)
    peers = [r for r in range(world) if r != rank]
    got: Dict[str, List[Any]] = {}
    errors: List[BaseException] = []

    def guard(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: B036 - reported below
                errors.append(exc)

        return run

    def sender(peer: int, tag: int) -> None:
        for i in range(rounds):
            comm.send((rank, tag, i, "x" * (i % 3 * 200)), peer, tag=tag)  # some overflow the slot

    def receiver(peer: int, tag: int) -> None:
        got[f"{peer}/{tag}"] = [comm.recv(peer, tag=tag) for _ in range(rounds)]

    def from_anyone() -> None:
        got["any"] = sorted(comm.recv(tag=9, return_sender=True)[0] for _ in range(len(peers) * rounds))

    threads = [threading.Thread(target=guard(lambda p=p, t=t: sender(p, t))) for p in peers for t in (1, 2)]
    threads += [threading.Thread(target=guard(lambda p=p, t=t: receiver(p, t))) for p in peers for t in (1, 2)]
    threads.append(threading.Thread(target=guard(from_anyone)))
    for thread in threads:
        thread.start()
    asynchronous = [comm.isend(rank, p, tag=9) for p in peers for _ in range(rounds)]
    gathered = [comm.all_gather((rank, i)) for i in range(rounds)]
    for request in asynchronous:
        request.wait(60)
    for thread in threads:
        thread.join(120)
    return {
        "errors": [repr(e) for e in errors],
        "gathered": gathered == [[(r, i) for r in range(world)] for i in range(rounds)],
        "streams": all(
            got[f"{p}/{t}"] == [(p, t, i, "x" * (i % 3 * 200)) for i in range(rounds)] for p in peers for t in (1, 2)
        ),
        "any": got.get("any") == sorted(p for p in peers for _ in range(rounds)),
        "p2p": _state_of().channel.p2p,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_threads_on_different_tags_and_peers_and_collectives_share_the_channel(world):
    for result in get_pool(world).run(many_threads, 20):
        assert result == {"errors": [], "gathered": True, "streams": True, "any": True, "p2p": True}


# -- failures ------------------------------------------------------------------------------------
def _killed_mid_recv_rank(rank: int, world: int, store: str, victim: int, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    objcomm.configure(local=True)  # a process of its own: nothing to restore
    objcomm.all_gather(rank)  # opens the channel; send/recv through it from now on
    assert _state_of().channel.p2p
    if rank == victim:
        time.sleep(0.5)  # the others wait in their recv by now
        os.kill(os.getpid(), signal.SIGKILL)
    report_raised(results, rank, lambda: objcomm.recv(victim, tag=3) if rank == 0 else objcomm.recv(tag=3))  # any rank


def test_a_peer_killed_mid_recv_makes_the_receiver_raise_within_seconds():
    got, victim_exit = run_group_losing_a_rank(_killed_mid_recv_rank, 3, 2)
    assert victim_exit == -signal.SIGKILL
    for rank, (message, elapsed) in got.items():
        assert "local channel failed" in message, (rank, message)
        assert elapsed < 5.0, (rank, elapsed)
    assert "closed its connection" in got[0][0] or "reset its connection" in got[0][0]


def slot_bytes_disagree() -> List[Any]:
    """A call whose ranks disagree on slot_bytes fails the channel on every rank (a frame that fits one slot
    and not the other; one that fits both travels trimmed and reads the same); the next call opens a new
    one (every rank failed at the same call, so they agree), and send/recv go through it again."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    comm = objcomm.Communicator(group, local=True)
    seen: List[Any] = [comm.all_gather(rank)]
    first = _state_of(group).channel
    try:
        objcomm.Communicator(group, local=True, slot_bytes=512 if rank == 1 else 256).all_gather("x" * 300)
        seen.append("returned")
    except objcomm.CommunicationError as exc:
        seen.append("slot_bytes" in str(exc) or "closed its connection" in str(exc))
    if rank == 0:
        try:
            comm.send("x", 1)
        except objcomm.CommunicationError as exc:
            seen.append("until a collective" in str(exc))
    seen.append(comm.all_gather(rank))  # reopens
    second = _state_of(group).channel
    seen.append((first.closed, second is not first, second.generation, second.p2p))
    if rank == 0:
        comm.send("after", 1)
    elif rank == 1:
        seen.append(comm.recv(0))
    return seen


def test_the_group_is_usable_after_a_failed_channel_call():
    everyone = [0, 1, 2]
    results = get_pool(3).run(slot_bytes_disagree)
    assert results[0] == [everyone, True, True, everyone, (True, True, 2, True)]
    assert results[1] == [everyone, True, everyone, (True, True, 2, True), "after"]
    assert results[2] == [everyone, True, everyone, (True, True, 2, True)]


class _Deaf(dict):  # type: ignore[type-arg]
    """A channel's record of its peers' failure notices that keeps none: as if a notice was lost."""

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return default


def fails_between_calls_on_one_rank(notice_lost: bool, in_flight: bool = False) -> List[Any]:
    """Only rank 0's channel fails (between calls, as when a send it received broke it after its sender returned);
    the others learn of it at their next call. Told where it failed (the failure notice), they open a new channel
    there with it; where the notice was lost they cannot agree where it failed, so no rank reopens: every rank
    raises, at once, at each later call. ``in_flight``: rank 1 sent rank 2 a message first, which rank 2 had not
    received: it would be lost with the channel, so no rank reopens either (rank 2 then receives "second" from
    rank 1, sent after the failure: it must raise, never take it in the first one's place)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1, 2])
    comm = objcomm.Communicator(group, local=True)
    comm.all_gather(rank)
    first = _state_of(group).channel
    if notice_lost and rank > 0:
        first._inbox.failed = _Deaf()
    if in_flight and rank == 1:
        comm.send("first", 2)
    dist.barrier()
    if rank == 0:
        try:
            first.fail("test", "failed on purpose")
        except objcomm.CommunicationError:
            pass
    dist.barrier()
    seen: List[Any] = []
    for _ in range(3):
        start = time.monotonic()
        try:
            seen.append(comm.all_gather(rank))
        except objcomm.CommunicationError as exc:
            text = str(exc)
            seen.append("out of step" if "out of step" in text else "failed" if "failed" in text else text)
        assert time.monotonic() - start < 30
    seen.append(_state_of(group).channel.generation)
    if in_flight and rank > 0:
        try:
            seen.append(comm.send("second", 2) if rank == 1 else comm.recv(1))
        except objcomm.CommunicationError as exc:
            seen.append("out of step" if "out of step" in str(exc) else str(exc))
    dist.destroy_process_group(group)
    return seen


def test_a_channel_failed_between_calls_reopens_where_its_peers_are_told_so():
    assert get_pool(3).run(fails_between_calls_on_one_rank, False) == [[[0, 1, 2]] * 3 + [2]] * 3


def test_a_channel_that_failed_with_a_message_unreceived_does_not_reopen():
    results = get_pool(3).run(fails_between_calls_on_one_rank, False, True)
    assert results[0] == ["out of step"] * 3 + [1], results
    assert results[1] == results[2] == ["out of step"] * 3 + [1, "out of step"], results


def test_ranks_that_failed_at_different_calls_do_not_reopen():
    results = get_pool(3).run(fails_between_calls_on_one_rank, True)
    assert results[0] == ["out of step"] * 3 + [1]
    assert results[1] == results[2] == ["failed", "out of step", "out of step", 1]


class _SlowToPickle:
    """An object whose pickling takes half a second (a large or custom object); no tensors: the express path."""

    def __reduce__(self) -> Any:
        time.sleep(0.5)
        return (str, ("slow",))


def fails_in_another_thread_while_a_call_serializes() -> List[Any]:
    """Rank 1's receiving thread fails the channel (a slot of another ``slot_bytes`` from rank 0, a failure the group
    recovers from) while rank 1's main thread is in an all_gather that found the channel open and is still pickling
    its object. Both ranks reopen in that very call (rank 0 learns of it by the failure notice in its collective;
    before the fix rank 1 raised out of the call and reopened one call later: out of step for good)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    comm = objcomm.Communicator(group, local=True)
    comm.all_gather(rank)
    assert _state_of(group).channel.p2p
    dist.barrier(group)
    receiver = None
    if rank == 0:
        time.sleep(0.1)  # rank 1 is pickling by now
        objcomm.Communicator(group, local=True, slot_bytes=256).send("x" * 300, 1, tag=5)
    else:
        receiver = threading.Thread(target=lambda: report_of(lambda: comm.recv(0, tag=5)))
        receiver.start()
    seen: List[Any] = []
    for i in range(3):
        try:
            seen.append(comm.all_gather(_SlowToPickle() if i == 0 and rank == 1 else rank))
        except objcomm.CommunicationError as exc:
            seen.append("out of step" if "out of step" in str(exc) else str(exc))
    if receiver is not None:
        receiver.join(60)
    seen.append(_state_of(group).channel.generation)
    dist.destroy_process_group(group)
    return seen


def report_of(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except objcomm.CommunicationError as exc:
        return exc


def test_a_channel_failed_by_another_thread_during_a_call_reopens_in_that_call():
    assert get_pool(2).run(fails_in_another_thread_while_a_call_serializes) == [
        [[0, "slow"], [0, 1], [0, 1], 2],
        [[0, "slow"], [0, 1], [0, 1], 2],
    ]


def a_vote_fails_on_one_rank() -> List[Any]:
    """The send/recv vote of an all_gather raises on rank 0 only, after the vote's collective went through (as when
    it fails on its way back): rank 0's channel fails, and both ranks settle on one route at the next call (before:
    rank 0 kept send/recv off the channel, rank 1 on it; a send from 0 went through the backend and "returned",
    rank 1 waited for it on the channel until its timeout)."""
    from objcomm._samehost import channel as _channel

    rank = dist.get_rank()
    group = foreground(dist.new_group([0, 1]))
    comm = objcomm.Communicator(group, local=True)
    pending = comm.irecv(None, tag=2) if rank == 0 else None
    time.sleep(0.2)  # the irecv is posted when the all_gather votes
    comm.all_gather(0)  # opens the channel; rank 0's irecv from any rank: send/recv stay off it, a vote is due later
    if rank == 1:
        comm.send("early", 0, tag=2)
    else:
        assert pending is not None
        pending.wait(30)
    real = _channel.LocalChannel.vote
    if rank == 0:

        def vote(self: Any, *args: Any, **kwargs: Any) -> Any:
            real(self, *args, **kwargs)
            raise objcomm.CommunicationError("injected: the vote failed on its way back")

        _channel.LocalChannel.vote = vote  # type: ignore[method-assign]
    seen: List[Any] = []
    try:
        seen.append(comm.all_gather(rank))
    except objcomm.CommunicationError as exc:
        seen.append("vote failed" if "vote" in str(exc) else str(exc))
    finally:
        _channel.LocalChannel.vote = real  # type: ignore[method-assign]
    seen.append(comm.all_gather(rank))
    if rank == 0:
        comm.send("after", 1, tag=3)
    else:
        seen.append(comm.recv(0, tag=3))
    dist.destroy_process_group(group)
    return seen


def test_a_vote_that_fails_on_one_rank_leaves_no_rank_on_another_route():
    zero, one = get_pool(2).run(a_vote_fails_on_one_rank)
    assert zero == ["vote failed", [0, 1]], zero
    assert one == [[0, 1], [0, 1], "after"], one  # its vote went through: it learns of the failure at the next call


def tagged_message_ahead_of_a_collective(tag: int) -> List[Any]:
    """W=3: rank 1's tagged send reaches rank 2's socket before rank 1's all_gather message, and rank 2's collective
    reads it first (its lean path, one thread): it is filed for the recv, not taken for a later collective."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1, 2])
    comm = objcomm.Communicator(group)
    comm.all_gather(rank)  # opens the channel; nothing in flight: send/recv take it from now on
    if rank == 1:
        comm.send("hello", 2, tag=tag)
    got: List[Any] = [comm.all_gather(rank)]
    if rank == 2:
        got.append(comm.recv(1, tag=tag))
    dist.destroy_process_group(group)
    return got


@pytest.mark.parametrize("tag", [0, 1000])
def test_a_tagged_message_read_by_a_collective_waits_for_its_recv(tag):
    assert get_pool(3).run(tagged_message_ahead_of_a_collective, tag) == [
        [[0, 1, 2]],
        [[0, 1, 2]],
        [[0, 1, 2], "hello"],
    ]


def send_started_during_the_opening_vote() -> Any:
    """Rank 0 starts a send in a thread while the collective that opens the channel has its vote out, and that
    collective's thread is descheduled right after the vote ends (a pause there): the send must still see the new
    channel, where rank 1 receives (the opening collective voted send/recv onto it)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    comm = objcomm.Communicator(group, local=True)
    if rank == 1:
        time.sleep(0.6)  # rank 0's vote is out meanwhile
        comm.all_gather(1)
        try:
            got = comm.irecv(0, tag=4).wait(10)
        except objcomm.WaitTimeoutError:
            got = "timed out: the send took the group, the recv the channel"
        dist.destroy_process_group(group)
        return got
    real = _channel_slots.SameHost.end_vote

    def end_vote(state: Any) -> None:
        real(state)
        time.sleep(0.3)  # the opening collective's thread, descheduled right after the vote ended

    _channel_slots.SameHost.end_vote = end_vote  # type: ignore[method-assign]
    try:
        sender = threading.Thread(target=lambda: (time.sleep(0.2), comm.send("hello", 1, tag=4)))
        sender.start()
        comm.all_gather(0)  # opens the channel; nothing in flight when it votes
        sender.join(20)
    finally:
        _channel_slots.SameHost.end_vote = real  # type: ignore[method-assign]
    dist.destroy_process_group(group)
    return "sent"


def test_a_send_started_while_the_channel_opens_takes_the_channel():
    assert get_pool(2).run(send_started_during_the_opening_vote) == ["sent", "hello"]
