"""Medium second rounds through the same-host channel (objcomm._samehost.channel_rests): all_gather and broadcast of
objects past their slots move no byte through the backend below shm_threshold, with the backend's results;
the other operations, larger objects and groups without a channel keep their routes; a sender out of step
fails the channel, a second round that disagrees with its frame is refused on the receiver alone, and a rank
killed mid-round makes the others raise."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any, Callable, List, Tuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _child import report_raised, run_group_losing_a_rank
from _counting import counting
from _hostile import tensor_tables_that_lie
from _ranks import get_pool

import objcomm
from objcomm import _state
from objcomm._errors import FrameError
from objcomm._format import limits as _limits
from objcomm._format.slot import SlotInfo
from objcomm._samehost import channel_rests as _channel_rests
from objcomm._samehost import shm as _shm
from objcomm._samehost.channel_rests import CHUNK, chunks, incoming, place
from objcomm._transport import broadcast as _broadcast
from objcomm._transport import bytes as _bytes
from objcomm._transport import parts as _parts
from objcomm._transport import rounds as _rounds
from objcomm._transport import routes
from objcomm._transport.routes import cutoffs as _cutoffs

pytestmark = pytest.mark.timeout(180)

SIZES = [0, 100, 5_000, CHUNK - 40, CHUNK, CHUNK + 1, 3 * CHUNK + 7]  # bytes of a payload's bulk


def _payload(rank: int, size: int) -> Any:
    """Frames past the slot (a str), whole bytes out of band, a tensor and a numpy array: every kind of piece."""
    return {
        "rank": rank,
        "text": "t" * size,
        "blob": bytes([rank % 256]) * size,
        "tensor": torch.arange(size // 8 + rank, dtype=torch.float64),
        "array": np.full(size // 16, rank),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return bool(a == b)


ROUTES = {
    "backend": [
        (_rounds, "all_gather_rests"),
        (_broadcast, "broadcast_bytes"),  # round 2's moves
        (_bytes.Batch, "send"),
        (_bytes.Batch, "recv"),
        (_parts, "all_to_all_bytes"),
    ],
    "shm": [(_shm.SharedMemory, "_collective")],
}


def _every_medium_collective(comm: objcomm.Communicator, mine: Any, parts: List[Any]) -> List[Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    return [
        comm.all_gather(mine),
        *(comm.broadcast(mine if rank == root else None, src=root) for root in range(world)),
        *(comm.gather(mine, dst=root) for root in range(world)),
        comm.all_to_all(parts),
        *(comm.scatter(parts if rank == root else None, src=root) for root in range(world)),
    ]


def medium_collectives(sizes: List[int]) -> List[Any]:
    """For each mix of sizes (rank r takes sizes[(i + r) % len]; its all_to_all and scatter part for rank j
    sizes[(i + r + j) % len]), all_gather, all_to_all, and broadcast, gather and scatter with every root, through the
    channel and through the backend (local=False): whether the results agree, and where round 2 went."""
    rank, world = dist.get_rank(), dist.get_world_size()
    channel, backend = objcomm.Communicator(local=True), objcomm.Communicator(local=False)
    channel.all_gather(None)
    report = []
    for i in range(len(sizes)):
        mine = _payload(rank, sizes[(i + rank) % len(sizes)])
        parts = [_payload(rank * world + j, sizes[(i + rank + j) % len(sizes)]) for j in range(world)]
        with counting(ROUTES) as counts:
            got = _every_medium_collective(channel, mine, parts)
        expected = _every_medium_collective(backend, mine, parts)
        report.append((all(_same(a, b) for a, b in zip(got, expected)), counts["backend"], counts["shm"]))
        owns = [got[0][rank]["tensor"], got[1 + world + rank][rank]["tensor"]]  # all_gather's, gather's
        parted = [got[1 + 2 * world][rank]["tensor"], got[2 + 2 * world + rank]["tensor"]]  # all_to_all's, scatter's
        for own in owns + parted:
            own.add_(1)  # an own result never aliases the input (nor each other)
        report[-1] += (
            all(torch.equal(own, mine["tensor"] + 1) for own in owns)
            and all(torch.equal(own, parts[rank]["tensor"] + 1) for own in parted),
        )
    return report


@pytest.mark.parametrize("world", [2, 3])
def test_medium_collectives_move_round_two_through_the_channel_with_the_backends_results(world):
    for rank_report in get_pool(world).run(medium_collectives, SIZES):
        assert rank_report == [(True, 0, 0, True)] * len(SIZES)


def routes_kept() -> List[Any]:
    """What the channel does not take keeps its route: sizes at shm_threshold go to shared memory; without shared
    memory the channel takes them (send/recv: tests/samehost/test_channel_rests_p2p.py)."""
    rank = dist.get_rank()
    small_threshold = objcomm.Communicator(local=True, shm_threshold=3 * CHUNK)
    small_threshold.all_gather(None)
    big = _payload(rank, 4 * CHUNK)  # past the threshold
    got = []
    for label, call in [
        ("at the threshold", lambda: small_threshold.all_gather(big)),
        (
            "below, without shared memory",
            lambda: objcomm.Communicator(local=True, shm=False).all_gather(_payload(rank, CHUNK)),
        ),
    ]:
        with counting(ROUTES) as counts:
            call()
        got.append((label, dict(counts)))
    return got


def test_what_the_channel_does_not_take_keeps_its_route():
    receiver = dict(get_pool(2).run(routes_kept)[1])
    assert receiver["at the threshold"] == {"backend": 0, "shm": 1}
    assert receiver["below, without shared memory"] == {"backend": 0, "shm": 0}


def rest_media_against_the_plan() -> List[Any]:
    """For all_gather, gather and broadcast, sizes on every side of the cut-offs (the channel below shm_threshold,
    shared memory from it, the backend past it with shared memory off): the medium that moved the rest, and the one
    ``routes.plan`` gives the same call on one host (its last step), as ``(op, sizes, shm, moved, planned)``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    threshold, kb = 256 << 10, 1 << 10
    media = {routes.CHANNEL: "channel", routes.SHARED_MEMORY: "shm", routes.BACKEND: "backend"}
    got = []
    for shm in (True, False):
        comm = objcomm.Communicator(local=True, shm=shm, shm_threshold=threshold)
        comm.all_gather(None)
        one_host = routes.Topology(world, ranks_per_host=world, channel_open=True)
        knobs = routes.Knobs(shm=shm, shm_threshold=threshold)
        for sizes in ([20 * kb] * world, [1024 * kb] * world, [20 * kb, 1024 * kb, 20 * kb], [200 * kb] * world):
            blob = bytes(sizes[rank])  # past the slot: its frame is the rest (a few bytes more than the blob)
            for op in ("all_gather", "gather", "broadcast"):
                with counting(ROUTES) as counts:
                    _one(comm, op, blob, rank)
                moved = "shm" if counts["shm"] else "backend" if counts["backend"] else "channel"
                steps = routes.plan(op, one_host, rests=[n + 64 for n in sizes], knobs=knobs).steps
                got.append((op, sizes, shm, moved, media[steps[-1].medium] if len(steps) > 1 else None))
    return got


def _one(comm: objcomm.Communicator, op: str, blob: bytes, rank: int) -> Any:
    if op == "gather":
        return comm.gather(blob, dst=0)
    return comm.all_gather(blob) if op == "all_gather" else comm.broadcast(blob if rank == 0 else None, src=0)


def test_the_rest_takes_the_medium_the_routes_plan_gives():
    cases = get_pool(3).run(rest_media_against_the_plan)[0]
    for op, sizes, shm, moved, planned in cases:
        assert moved == planned, (op, sizes, shm)
    assert {moved for *_, moved, _ in cases} == {"channel", "shm", "backend"}  # every medium is asked


def on_a_pair() -> Tuple[int, Any, objcomm.Communicator]:
    """This rank, a group of ranks 0 and 1 of their own (whose channel a test may break: destroy it after), and a
    Communicator on it whose channel is open."""
    sub = dist.new_group([0, 1])
    comm = objcomm.Communicator(sub, local=True)
    comm.all_gather(None)
    return dist.get_rank(), sub, comm


def gather_past_most() -> List[Any]:
    """With MOST lowered to 3 messages on every rank, a gather whose senders move 2 messages each at W=3 (4 in all)
    goes through the backend, one whose senders move 1 each through the channel: the destination never stashes
    more than MOST of one gather while it waits for a slow sender (found by review at W=7, 16 MiB each)."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(local=True)
    comm.all_gather(None)
    real, _channel_rests.MOST = _channel_rests.MOST, 3 * CHUNK  # the channel's pacing
    _cutoffs.CHANNEL_MOST = 3 * CHUNK  # and the route's cap (objcomm._transport.routes.rest_medium)
    got = []
    try:
        for size in (2 * CHUNK - 100, CHUNK - 100):
            obj = {"rank": rank, "blob": bytes([rank]) * size}
            with counting(ROUTES) as counts:
                result = comm.gather(obj, dst=0)
            whole = result is None or [r["blob"][:1] for r in result] == [b"\0", b"\1", b"\2"]
            got.append((counts["backend"] > 0, whole))
    finally:
        _channel_rests.MOST = _cutoffs.CHANNEL_MOST = real
    return got


def test_a_gather_past_most_in_all_keeps_the_backend():
    for rank_got in get_pool(3).run(gather_past_most):
        assert rank_got == [(True, True), (False, True)]


def closed_between_rounds(op: str) -> Any:
    """Rank 0's channel closes between round 1 and round 2 of ``op`` (another thread's call failed it): rank 0
    raises at round 2 instead of moving on through the group (where it would wait for rank 1 until the group's
    timeout, rank 1 having sent through the channel), and so does rank 1 where it waits for rank 0, within
    seconds (a gather's sender and a broadcast's root, rank 1, may have sent everything before the channel closed:
    they return)."""
    rank, sub, comm = on_a_pair()
    real = _limits.checked_sizes
    if rank == 0:

        def failing(*args: Any) -> Any:
            channel = _state.group_facts(sub).local[False].channel
            with pytest.raises(objcomm.CommunicationError):
                channel.fail(op, "failed by another thread (a test)")
            return real(*args)

        _limits.checked_sizes = failing  # type: ignore[assignment]
    payload = {"blob": b"b" * 200_000}
    start = time.monotonic()
    try:
        try:
            if op == "gather":
                comm.gather(payload, dst=0)
            elif op == "all_gather":
                comm.all_gather(payload)
            else:
                comm.broadcast(payload if rank == 1 else None, src=1)
            outcome = "ok"
        except objcomm.CommunicationError as exc:
            outcome = "raised" if "failed by another thread" in str(exc) or "closed" in str(exc) else str(exc)
    finally:
        _limits.checked_sizes = real  # type: ignore[assignment]
    elapsed = time.monotonic() - start
    dist.destroy_process_group(sub)
    return [outcome, elapsed < 10]


@pytest.mark.parametrize("op", ["gather", "all_gather", "broadcast"])
def test_a_channel_closed_between_the_rounds_raises_on_every_rank(op):
    closed, other = get_pool(2).run(closed_between_rounds, op, timeout=120)
    assert closed == ["raised", True]
    assert other == ["raised", True] or (op != "all_gather" and other == ["ok", True]), other


def out_of_step_sender() -> List[Any]:
    """Rank 1 sends one byte too few in each message of its second round: the channel fails on both ranks (rank 1
    learns where rank 0 failed it from its failure notice), and the next call opens a new one on both."""
    rank, sub, comm = on_a_pair()
    real = _channel_rests.chunks
    if rank == 1:
        _channel_rests.chunks = lambda pieces: (bytes(c)[:-1] for c in real(pieces))  # type: ignore[assignment]
    try:
        outcome = outcome_of(lambda: comm.all_gather(_payload(rank, 2 * CHUNK)) and None)
    finally:
        _channel_rests.chunks = real  # type: ignore[assignment]
    after = outcome_of(lambda: comm.all_gather(rank))
    dist.destroy_process_group(sub)
    return [outcome, after]


def outcome_of(call: Callable[[], Any]) -> Tuple[str, Any]:
    """``("ok", what call() returned)``, or ``("raised", its CommunicationError's message)``."""
    try:
        return "ok", call()
    except objcomm.CommunicationError as exc:
        return "raised", str(exc)


def test_a_sender_out_of_step_fails_the_channel_on_every_rank():
    receiver, sender = get_pool(2).run(out_of_step_sender)
    assert receiver[0][0] == "raised" and "message #0 where" in receiver[0][1] and "rank 1" in receiver[0][1]
    assert sender[0][0] == "raised"  # the channel closed under it: it raises too, instead of waiting
    assert receiver[1] == sender[1] == ("ok", [0, 1])


DRIP_S = 1.2  # seconds before each of a sender's messages, within the 2 s timeout of drips_its_messages's group


def drips_its_messages(op: str) -> List[Any]:
    """Rank 1 sends rank 0 five channel messages of rest (a broadcast's, or a send's), waiting DRIP_S before each, on
    a group of their own with a 2 s timeout: rank 0's outcome and how long it took, then the next call's."""
    sub = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    comm = objcomm.Communicator(sub, local=True, shm=False)
    rank = dist.get_rank()
    comm.all_gather(rank)  # the channel open
    real = _channel_rests.chunks

    def slowly(pieces: Any) -> Any:
        for chunk in real(pieces):
            time.sleep(DRIP_S)
            yield chunk

    if rank == 1:
        _channel_rests.chunks = slowly  # type: ignore[assignment]
    blob = b"d" * (5 * CHUNK)
    start = time.monotonic()
    try:
        if op == "broadcast":
            outcome = outcome_of(lambda: comm.broadcast(blob if rank == 1 else None, src=1) == blob)
        else:
            outcome = outcome_of(lambda: comm.send(blob, dst=0) if rank == 1 else comm.recv(src=1) == blob)
    finally:
        _channel_rests.chunks = real  # type: ignore[assignment]
    took = time.monotonic() - start
    after = outcome_of(lambda: comm.all_gather(rank))
    dist.destroy_process_group(sub)
    return [*outcome, took, after]


@pytest.mark.parametrize("op", ["broadcast", "send/recv"])
def test_a_sender_that_drips_its_messages_is_bounded_by_the_group_timeout(op):
    """Each channel message waits the group's timeout at most, and a stream of them twice it in all: a sender that
    sends each message just within the timeout fails the channel (a message each would have held rank 0 for 6 s).
    A collective's steps after its round 1 share one timeout (objcomm/_transport/call_clock.py): there the receiver
    raises once the timeout has passed since the slot came."""
    receiver, _ = get_pool(2).run(drips_its_messages, op, timeout=120)
    if op == "broadcast":
        assert receiver[0] == "raised" and "counted for the call as a whole" in receiver[1]
        assert receiver[2] < 2 + 1.0, receiver
    else:
        assert receiver[0] == "raised" and "was not done after the group's timeout of 2 s" in receiver[1], receiver
        assert receiver[2] < 2 * 2 + 1.5, receiver
    assert receiver[3] == ("ok", [0, 1]), receiver  # the next call opens a new channel


def understated_vote(op: str) -> List[Any]:
    """Rank 1 votes a longest part of 0 before the rest of a scatter (its root) or all_to_all while its slot to rank 0
    announces 3 messages and rank 0's own vote says one at most: rank 0 must refuse (it fails the channel), never
    read one message and take zeros for the other two; the next call opens a new channel on both."""
    rank, sub, comm = on_a_pair()
    small, big = _payload(rank, CHUNK // 2), _payload(rank, 3 * CHUNK)  # each part past its slot
    real = _parts.largest_of  # (scatter's vote: rounds._vote_refusals; all_to_all's: its own)

    def understated(wire: Any, values: List[int], op: str, *rest: Any, **named: Any) -> Any:
        return real(wire, [values[0], 0, *values[2:]], op, *rest, **named)

    if rank == 1:
        _parts.largest_of = _rounds.largest_of = understated  # type: ignore[assignment]
    try:
        if op == "scatter":
            outcome = outcome_of(lambda: comm.scatter([big, small] if rank == 1 else None, src=1) and None)
        else:
            outcome = outcome_of(lambda: comm.all_to_all([small, small] if rank == 0 else [big, small]) and None)
    finally:
        _parts.largest_of = _rounds.largest_of = real  # type: ignore[assignment]
    after = outcome_of(lambda: comm.all_gather(rank))
    dist.destroy_process_group(sub)
    return [outcome, after]


@pytest.mark.parametrize("op", ["scatter", "all_to_all"])
def test_a_part_longer_than_the_vote_fails_the_channel(op):
    receiver, liar = get_pool(2).run(understated_vote, op)
    assert receiver[0][0] == "raised" and "rank 1's slot announces a" in receiver[0][1], receiver
    if op == "all_to_all":  # it waits on the receiver's messages when the channel closes under it (a scatter's root
        assert liar[0][0] == "raised"  # sent its no messages and may be done: it learns at its next call, below)
    assert receiver[1] == liar[1] == ("ok", [0, 1])


class _Channel:
    def fail(self, op: str, why: str) -> None:
        raise objcomm.CommunicationError(f"{op}: {why}")


def _info(length: int, total: int, inline: Any = None) -> SlotInfo:
    return SlotInfo(length=length, error=False, round2=False, limit=1 << 40, total=total, inline=inline)


def test_message_lengths_and_second_rounds_are_checked():
    into = bytearray(CHUNK + 5)
    place(_Channel(), into, b"a" * CHUNK, 0, 1, "all_gather")
    place(_Channel(), into, b"b" * 5, 1, 1, "all_gather")
    assert into == b"a" * CHUNK + b"b" * 5
    for index, chunk in [(0, b"a" * (CHUNK - 1)), (1, b"b" * 6), (2, b"c")]:
        with pytest.raises(objcomm.CommunicationError, match=f"message #{index} where"):
            place(_Channel(), into, chunk, index, 1, "all_gather")
    frame = memoryview(b"f" * 10)
    assert [
        bytes(t.numpy())
        for t in incoming(bytearray(b"f" * 10 + b"xyz"), _info(10, 13), lambda f: [1, 2], 1, "op").tensors
    ] == [b"x", b"yz"]
    with pytest.raises(FrameError, match="make 14 bytes, but it announces 13 in total"):
        incoming(bytearray(b"f" * 10 + b"xyz"), _info(10, 13), lambda f: [4], 1, "op")
    with pytest.raises(FrameError, match="20-byte frame"):
        incoming(bytearray(13), _info(20, 13), lambda f: [], 1, "op")
    assert incoming(bytearray(b"xyz"), _info(10, 13, inline=frame), lambda f: [3], 1, "op").frame is frame


def test_pieces_travel_back_to_back_in_whole_messages():
    pieces = [memoryview(bytes([i]) * n) for i, n in enumerate([10, CHUNK - 10, 1, CHUNK + 3, 0, 2])]
    messages = [bytes(c) for c in chunks([p for p in pieces if p.nbytes])]
    assert [len(c) for c in messages] == [CHUNK, CHUNK, 6]
    assert b"".join(messages) == b"".join(bytes(p) for p in pieces)
    assert list(chunks([])) == []


# -- a SIGKILLed rank mid-round: a group of our own, so that the survivors can report -----------------------------
def die_after_one_message() -> None:
    """From now on, this process SIGKILLs itself 0.3 s after the first message of its next second round on the
    channel (the others wait for message #1 by then)."""
    real = _channel_rests.chunks

    def dying(pieces: Any) -> Any:
        chunks = real(pieces)
        yield next(chunks)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)

    _channel_rests.chunks = dying  # type: ignore[assignment]


def _killed_in_round_two(rank: int, world: int, store: str, victim: int, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    objcomm.configure(local=True)  # a process of its own: nothing to restore
    assert objcomm.all_gather(rank) == list(range(world))  # opens the channel
    if rank == victim:
        die_after_one_message()
    report_raised(results, rank, lambda: objcomm.all_gather(_payload(rank, 5 * CHUNK)))


def test_a_rank_killed_in_round_two_makes_the_others_raise_within_seconds():
    got, victim_exit = run_group_losing_a_rank(_killed_in_round_two, 3, 2)
    assert victim_exit == -signal.SIGKILL
    for rank, (message, elapsed) in got.items():
        assert "local channel failed" in message and "closed its connection" in message, (rank, message)
        assert elapsed < 5.0, (rank, elapsed)


def tensors_split_against_their_table(local: bool, op: str) -> List[Any]:
    """Rank 1 sends tensors split otherwise than its frame's table says (the same total): what every rank raises,
    and whether the group works on."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(local=local)
    comm.all_gather(None)
    payload = {
        "a": torch.ones(100_000, dtype=torch.uint8),
        "b": torch.ones(100_000, dtype=torch.uint8),
        "s": "x" * 9000,
    }  # the frame past the slot, and its tensors out of band
    try:
        with tensor_tables_that_lie(rank == 1):
            if op == "gather":
                comm.gather(payload, dst=0)
            elif op == "all_gather":
                comm.all_gather(payload)
            elif op == "all_to_all":
                comm.all_to_all([payload, payload])
            elif op == "scatter":
                comm.scatter([payload, payload] if rank == 1 else None, src=1)
            else:
                comm.broadcast(payload if rank == 1 else None, src=1)
        outcome = "ok"
    except objcomm.ObjcommError as exc:
        outcome = type(exc).__name__
    return [outcome, comm.all_gather(rank)]


@pytest.mark.parametrize("op", ["all_gather", "broadcast", "gather", "all_to_all", "scatter"])
def test_tensors_split_against_their_table_are_refused_as_on_the_backend(op):
    pool = get_pool(2)
    channel, backend = (
        pool.run(tensors_split_against_their_table, True, op),
        pool.run(tensors_split_against_their_table, False, op),
    )
    assert channel == backend
    refused = ["FrameError", "ok"] if op == "gather" else ["FrameError", "FrameError"]  # a root's own frame too
    assert [rank_got[0] for rank_got in channel] == refused  # (a gather's sender does not decode)
    assert [rank_got[1] for rank_got in channel] == [[0, 1], [0, 1]]  # and the group works on


def root_ahead_of_a_busy_receiver() -> List[Any]:
    """Rank 1 has an irecv outstanding (a thread reading its socket) and joins 40 broadcasts of 1.8 MB (72 MB) 3 s
    late: the root waits for it every 16 MiB of broadcasts, so the receiver's stash never holds much more."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(local=True)
    comm.all_gather(None)
    payload = {"a": torch.ones(450_000, dtype=torch.float16), "b": torch.ones(450_000, dtype=torch.float16)}
    request = comm.irecv(0, tag=9) if rank == 1 else None
    if rank == 1:
        time.sleep(3)
    got = [comm.broadcast(payload if rank == 0 else None, src=0)["a"].shape[0] for _ in range(40)]
    if rank == 0:
        comm.send("done", 1, tag=9)
        return [got[0], len(got), "sent"]
    assert request is not None
    return [got[0], len(got), request.wait(30)]


def test_a_broadcast_root_does_not_run_ahead_of_its_receivers():
    assert get_pool(2).run(root_ahead_of_a_busy_receiver) == [[450_000, 40, "sent"], [450_000, 40, "done"]]
