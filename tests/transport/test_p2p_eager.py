"""Sends that outlive their call, on real gloo groups (issue 25, items 4 and 5): ``isend`` captures its object when
it is called, and a small blocking ``send`` returns at once on every path, the backend's as the channel's.

Each scenario runs through the same-host channel (``local`` on, after a collective that opened it and let
send/recv in) and through the backend (``local`` off), so that a program behaves the same wherever its
ranks run.
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import time
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _child import run_group_losing_a_rank
from _ranks import get_pool

import objcomm
from objcomm import _state
from objcomm._format import frame as _frame
from objcomm._transport import pending as _pending
from serializers import registry

pytestmark = pytest.mark.timeout(120)

PATHS = ["channel", "backend"]
BIG = 200_000  # above the slot: a second round, whose sender waits for its receiver
OOB = 20_000  # float32 elements: 80 KB, above inline_tensor_bytes, so the tensor travels out of band
SHORT_TIMEOUT = 10  # seconds: the timeout of the scenarios' own groups, so that a hang fails fast


def _on(path: str, group: Any = None) -> None:
    """Route this rank's default-option calls on ``group`` through ``path``; through the channel, after a collective
    has opened it and let send/recv in."""
    objcomm.configure(local=path == "channel")
    if path == "channel":
        objcomm.all_gather(None, group=group)
        state = _state.group_facts(group if group is not None else dist.group.WORLD).local.get(False)
        assert state is not None and state.channel is not None and state.channel.p2p, "send/recv are not on it"


def _on_path(path: str, scenario: Any, *args: Any) -> Any:
    previous = objcomm.configure()
    try:
        _on(path)
        return scenario(*args)
    finally:
        objcomm.restore(previous)


# -- item 4: what isend sends is what obj was when isend was called ----------------------------------------------------
def _message(kind: str, i: int) -> Dict[str, Any]:
    if kind == "dict":
        return {"i": i, "list": [i] * 3, "bytes": bytearray([i]) * 8}
    if kind == "inline_tensor":  # small: copied into the frame, from the tensor's memory
        return {"i": i, "t": torch.full((4,), i)}
    return {"i": i, "t": torch.full((OOB,), float(i))}  # out of band: moved as a tensor, in a second round


def _mutate(buf: Dict[str, Any], kind: str, i: int) -> None:
    buf["i"] = i
    if kind == "dict":
        buf["list"][:] = [i] * 3
        buf["bytes"][:] = bytearray([i]) * 8
    else:
        buf["t"].fill_(i)  # in place: the same tensor object


def _seen(got: Dict[str, Any], kind: str) -> Any:
    if kind == "dict":
        return got["i"], got["list"], bytes(got["bytes"])
    return got["i"], sorted(set(got["t"].tolist()))


def mutate_after_isend(kind: str) -> List[Any]:
    """Rank 0 isends one buffer five times, changing it in place in between and after; rank 1 receives late, so that
    every send is still in progress (behind a large first message) while rank 0 changes the buffer."""
    rank = dist.get_rank()
    if rank == 0:
        first = objcomm.isend({"big": b"b" * BIG}, dst=1, tag=11)  # its lane waits for rank 1's answer
        buf = _message(kind, 250)
        requests = []
        for i in range(5):
            _mutate(buf, kind, i)
            requests.append(objcomm.isend(buf, dst=1, tag=11))
        _mutate(buf, kind, 99)
        for request in [first, *requests]:
            assert request.wait(timeout=60) is None
        return []
    if rank == 1:
        time.sleep(0.5)
        assert objcomm.recv(0, tag=11) == {"big": b"b" * BIG}
        return [_seen(objcomm.recv(0, tag=11), kind) for _ in range(5)]
    return []


@pytest.mark.parametrize("kind", ["dict", "inline_tensor", "oob_tensor"])
@pytest.mark.parametrize("path", PATHS)
def test_isend_sends_the_object_as_it_was_at_the_call(path, kind):
    got = get_pool(2).run(_on_path, path, mutate_after_isend, kind)[1]
    assert got == [_seen(_message(kind, i), kind) for i in range(5)]


def test_captured_owns_every_byte_it_sends():
    """What isend keeps of an encoded object: nothing shares memory with the object any more (its frame's inline
    tensor bytes, its out-of-band tensors and arrays), while the plain encoding still does."""
    t, array, big = torch.zeros(4), np.zeros(OOB), torch.zeros(OOB)
    out = _frame.encode({"t": t, "a": array, "big": big}, registry.guarded("pickle"), max_bytes=1 << 30)
    kept = _pending.captured(out)

    def joined(o: Any) -> bytes:  # the parts as they are now (Outgoing.frame would keep its first join)
        return b"".join(bytes(memoryview(part)) for part in o.parts)

    frame, tensors = joined(kept), [x.clone() for x in kept.tensors]
    assert len(tensors) == 2
    t.fill_(1)
    array.fill(1)
    big.fill_(1)
    assert joined(kept) == frame and all(torch.equal(a, b) for a, b in zip(kept.tensors, tensors))
    assert joined(out) != frame and not any(torch.equal(a, b) for a, b in zip(out.tensors, tensors))


def isend_argument_errors() -> List[str]:
    """A bad dst or tag raise at the isend (as the blocking send does), not at wait(). (dst == this rank is a
    message to oneself, delivered: tests/api/test_self_messages.py.)"""
    rank = dist.get_rank()
    seen = []
    for dst, tag in ((5, 0), ("1", 0), (1 - rank, -1), (1 - rank, 1.5), (1 - rank, True)):
        try:
            request = objcomm.isend("x", dst=dst, tag=tag)
        except (TypeError, ValueError) as exc:
            seen.append(type(exc).__name__)
        else:
            seen.append(f"a handle ({request})")
    for src, tag in ((1 - rank, -1), (1 - rank, 1 << 30)):
        try:
            request = objcomm.irecv(src=src, tag=tag)
        except ValueError as exc:
            seen.append("tag must be" in str(exc) and type(exc).__name__)
        else:
            seen.append(f"a handle ({request})")
    return seen


def test_isend_and_irecv_refuse_bad_arguments_at_the_call():
    for seen in get_pool(2).run(isend_argument_errors):
        assert seen == ["ValueError", "TypeError", "ValueError", "ValueError", "ValueError", "ValueError", "ValueError"]


def isend_encode_failure() -> Any:
    """An object that cannot be encoded: wait() raises the original error, the receiver gets the report."""
    rank = dist.get_rank()

    class Unpicklable:
        def __reduce__(self) -> Any:
            raise RuntimeError("deliberate")

    if rank == 0:
        request = objcomm.isend(Unpicklable(), dst=1, tag=12)
        try:
            request.wait(timeout=60)
        except objcomm.EncodeError as exc:
            return "deliberate" in str(exc) and isinstance(exc, RuntimeError)
        return "no error"
    try:
        objcomm.recv(0, tag=12)
    except objcomm.RemoteError as exc:
        return exc.ranks
    return "no error"


@pytest.mark.parametrize("path", PATHS)
def test_an_isend_that_cannot_encode_fails_as_the_blocking_send_does(path):
    assert get_pool(2).run(_on_path, path, isend_encode_failure) == [True, [0]]


# -- item 5: small blocking sends return at once, on every path ------------------------------------------------------
def in_short_group(path: str, scenario: Any, *args: Any) -> Any:
    """``scenario(group, *args)`` on a group of every rank with a short timeout, so that sends that wait for their
    receivers fail fast instead of hanging; a CommunicationError comes back as a string."""
    group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=SHORT_TIMEOUT))
    previous = objcomm.configure()
    try:
        _on(path, group)
        result = scenario(group, *args)
        dist.barrier(group)
        return result
    except objcomm.CommunicationError as exc:
        return f"failed: {exc}"[:300]
    finally:
        objcomm.restore(previous)
        dist.destroy_process_group(group)


def ring(group: Any, rounds: int) -> List[Any]:
    """Each rank sends to the next, then receives from the previous: what mpi4py programs do."""
    rank, world = dist.get_rank(), dist.get_world_size()
    got = []
    for step in range(rounds):
        objcomm.send({"from": rank, "step": step}, dst=(rank + 1) % world, group=group)
        got.append(objcomm.recv(src=(rank - 1) % world, group=group))
    return got


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", [2, 3])
def test_a_ring_of_small_blocking_sends_completes(world, path):
    got = get_pool(world).run(in_short_group, path, ring, 3, timeout=60)
    for rank, received in enumerate(got):
        assert received == [{"from": (rank - 1) % world, "step": s} for s in range(3)]


def one_tag_waits_while_another_goes_on(group: Any, count: int) -> Any:
    """Rank 0 sends one small message under tag 0, then ``count`` under tag 1; rank 1 receives every tag-1 message
    first. At most one message waits for its receiver at any time, so every send returns: received sends of one tag
    leave the count of pending sends whatever another tag's wait for (objcomm._transport.pending.MOST_SENDS)."""
    if dist.get_rank() == 0:
        objcomm.send("tag 0", dst=1, group=group, tag=0)
        for i in range(count):
            objcomm.send(i, dst=1, group=group, tag=1)
        return None
    got = [objcomm.recv(src=0, group=group, tag=1) for _ in range(count)]
    return got + [objcomm.recv(src=0, group=group, tag=0)]


@pytest.mark.parametrize("path", PATHS)
def test_a_send_waiting_under_one_tag_holds_up_no_other_tag(path):
    count = 3 * _pending.MOST_SENDS
    got = get_pool(2).run(in_short_group, path, one_tag_waits_while_another_goes_on, count, timeout=60)
    assert got[1] == list(range(count)) + ["tag 0"], str(got[1])[:300]


def progress_then_result(group: Any, count: int) -> Any:
    """A worker (rank 1) sends ``count`` small progress messages under tag 1, then its result under tag 2; its master
    (rank 0) waits for the result first, then takes the progress messages: what MPI's eager buffering lets a port
    do, within the bound (pending.MOST_SENDS through the backend; what the channel holds, 8 MiB, through it)."""
    if dist.get_rank() == 1:
        for i in range(count):
            objcomm.send({"progress": i}, dst=0, group=group, tag=1)
        objcomm.send("result", dst=0, group=group, tag=2)
        return None
    result = objcomm.recv(src=1, group=group, tag=2)
    return [result] + [objcomm.recv(src=1, group=group, tag=1)["progress"] for _ in range(count)]


@pytest.mark.parametrize("path", PATHS)
def test_a_worker_s_progress_messages_wait_while_its_master_takes_the_result_first(path):
    """A port's find: 500 progress messages before the result waited until the group's timeout through the backend
    (the bound was 64 sends), where the channel took them; both paths take them now."""
    count = 500
    assert count < _pending.MOST_SENDS
    got = get_pool(2).run(in_short_group, path, progress_then_result, count, timeout=60)
    assert got[0] == ["result"] + list(range(count)), str(got[0])[:300]


def waits_under_another_tag(path: str) -> Any:
    """Rank 1 waits for rank 0 under tag 2, which sends nothing under it: its error (at the group's timeout, 2 s
    here) says whom and which tag it waited for; through the channel, which stays open, a message under tag 1 then
    arrives (gloo closes the pair after a timeout)."""
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    previous = objcomm.configure()
    try:
        _on(path, group)
        if dist.get_rank() == 0:
            dist.barrier()  # (the pool's group: rank 1's wait is over)
            if path == "channel":
                objcomm.send("tag 1", dst=1, group=group, tag=1)
            return None
        try:
            objcomm.recv(src=0, group=group, tag=2)
            said = "returned"
        except objcomm.CommunicationError as exc:
            said = str(exc)
        dist.barrier()
        return said, objcomm.recv(src=0, group=group, tag=1) if path == "channel" else None
    finally:
        objcomm.restore(previous)
        dist.destroy_process_group(group)


@pytest.mark.parametrize("path", PATHS)
def test_a_receive_that_times_out_names_the_tag_it_waited_under(path):
    said, then = get_pool(2).run(waits_under_another_tag, path, timeout=60)[1]
    assert "under tag 2 (no other tag matches it)" in said and ("rank 0" in said or "rank(s) [0]" in said), said
    assert then == ("tag 1" if path == "channel" else None)


def mutate_after_send() -> Any:
    """A blocking send that returns before its receiver takes it sent the object as it was: changing it after the
    send returned changes nothing on the receiver."""
    rank = dist.get_rank()
    if rank == 0:
        buf = {"i": 0, "t": torch.zeros(4)}
        for i in range(5):
            buf["i"] = i
            buf["t"].fill_(i)
            objcomm.send(buf, 1, tag=15)
        buf["t"].fill_(99)
        return None
    time.sleep(0.3)
    return [(got["i"], got["t"].tolist()) for got in (objcomm.recv(0, tag=15) for _ in range(5))]


@pytest.mark.parametrize("path", PATHS)
def test_an_eager_send_sent_the_object_as_it_was(path):
    assert get_pool(2).run(_on_path, path, mutate_after_send)[1] == [(i, [float(i)] * 4) for i in range(5)]


def _big(i: int) -> Dict[str, Any]:
    return {"i": i, "pad": b"p" * BIG, "t": torch.arange(OOB) + i}


def eager_order(count: int) -> Any:
    """Rank 0 sends ``count`` small messages, a large one (a second round under the same tag), then more small ones,
    while rank 1 starts receiving only after a while: they arrive in order. The first small ones return at once."""
    rank = dist.get_rank()
    if rank == 0:
        start = time.monotonic()
        for i in range(32):  # within the bound: none waits for rank 1
            objcomm.send(i, 1, tag=13)
        quick = time.monotonic() - start
        for i in range(32, count):  # past it: the oldest wait until rank 1 takes them
            objcomm.send(i, 1, tag=13)
        objcomm.send(_big(count), 1, tag=13)
        for i in range(count + 1, count + 11):
            objcomm.send(i, 1, tag=13)
        objcomm.send(_big(count + 11), 1, tag=13)
        return quick
    if rank == 1:
        time.sleep(1.0)
        got = [objcomm.recv(0, tag=13) for _ in range(count)]
        big = objcomm.recv(0, tag=13)
        got.append(big["i"] if big["pad"] == b"p" * BIG and torch.equal(big["t"], torch.arange(OOB) + count) else big)
        got += [objcomm.recv(0, tag=13) for _ in range(10)]
        big = objcomm.recv(0, tag=13)
        got.append(big["i"] if torch.equal(big["t"], torch.arange(OOB) + count + 11) else big)
        return got
    return None


@pytest.mark.parametrize("path", PATHS)
def test_eager_sends_and_a_large_send_under_one_tag_arrive_in_order(path):
    quick, got = get_pool(2).run(_on_path, path, eager_order, 100)
    assert got == list(range(112))
    assert quick < 0.5, f"32 small sends took {quick:.2f} s while their receiver slept 1 s: they waited for it"


def many_eager_peers(group: Any) -> Any:
    """Every rank sends small messages to every other before receiving any: nobody waits for anybody."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for i in range(5):
        for peer in range(world):
            if peer != rank:
                objcomm.send((rank, i), peer, tag=14, group=group)
    return [[objcomm.recv(peer, tag=14, group=group) for _ in range(5)] for peer in range(world) if peer != rank]


@pytest.mark.parametrize("path", PATHS)
def test_every_rank_sends_to_every_other_before_receiving(path):
    got = get_pool(3).run(in_short_group, path, many_eager_peers, timeout=60)
    for rank, received in enumerate(got):
        assert received == [[(peer, i) for i in range(5)] for peer in range(3) if peer != rank]


# -- medium sends through the backend: the slot and its rest in one message ------------------------------------------
MEDIUM = 16_000  # bytes of a frame past the slot, well within routes.BACKEND_WHOLE_BYTES


def _medium(i: int, oob: bool) -> Dict[str, Any]:
    """A message whose rest (a frame past the slot; with ``oob`` a 16 KB tensor out of band, its frame in the slot)
    goes with its slot in one message of a CPU group's backend."""
    return {"i": i, "t": torch.full((4_000,), float(i))} if oob else {"i": i, "pad": bytes([i % 256]) * MEDIUM}


def _medium_seen(got: Dict[str, Any], oob: bool) -> Any:
    return (got["i"], sorted(set(got["t"].tolist()))) if oob else (got["i"], set(got["pad"]))


def medium_ring(group: Any, oob: bool) -> Any:
    """Each rank sends a medium message to the next, then receives from the previous; rank 0 counts its backend calls
    per send, and changes its object after each send returned."""
    rank, world = dist.get_rank(), dist.get_world_size()
    calls: Dict[str, int] = {"send": 0, "isend": 0}
    wrapped = {name: getattr(dist, name) for name in calls}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return wrapped[name](*args, **kwargs)

        return call

    previous = objcomm.configure(inline_tensor_bytes=1024)  # the 16 KB tensor travels out of band
    for name in calls:
        setattr(dist, name, counting(name))
    try:
        got = []
        buf = _medium(rank, oob)
        for _ in range(3):
            objcomm.send(buf, dst=(rank + 1) % world, group=group)
            if oob:
                buf["t"].fill_(-1.0)  # after the send returned: the receiver must not see it
            buf["i"] = -1
            got.append(_medium_seen(objcomm.recv(src=(rank - 1) % world, group=group), oob))
            buf = _medium(rank, oob)
        return got, dict(calls)
    finally:
        for name, real in wrapped.items():
            setattr(dist, name, real)
        objcomm.restore(previous)


@pytest.mark.parametrize("oob", [False, True], ids=["frame", "tensor"])
@pytest.mark.parametrize("path", PATHS)
def test_a_ring_of_medium_blocking_sends_completes(path, oob):
    """A medium send returns before its receiver posts the receive on both paths (before, through the backend its
    slot waited for the receiver, and the ring hung until the timeout); on the backend it is one message."""
    got = get_pool(3).run(in_short_group, path, medium_ring, oob, timeout=60)
    for rank, result in enumerate(got):
        assert not isinstance(result, str), result
        received, calls = result
        src = (rank - 1) % 3
        expected = (src, [float(src)]) if oob else (src, {src})
        assert received == [expected] * 3
        if path == "backend":
            assert calls == {"send": 0, "isend": 3}, calls  # slot and rest in one posted message a send


def _refused_then_next(tag: int, error: type, **first: Any) -> Any:
    """Rank 1's side: what its first receive from rank 0 under ``tag`` (with ``first``'s options) raised, as text
    ("received" if it raised no ``error``), then the next message (:func:`_medium_seen`)."""
    try:
        objcomm.recv(0, tag=tag, **first)
        said = "received"
    except error as exc:
        said = str(exc)
    return said, _medium_seen(objcomm.recv(0, tag=tag), False)


def medium_refused_then_next() -> Any:
    """Rank 1, over its max_bytes for the first medium message (which came whole with its slot), raises alone and
    then receives the next one: the stream stays in step."""
    if dist.get_rank() == 0:
        objcomm.send(_medium(1, False), 1, tag=16)
        objcomm.send(_medium(2, False), 1, tag=16)
        return None
    return _refused_then_next(16, objcomm.TooLargeError, max_bytes=1000)


def test_a_medium_message_over_the_receivers_limit_is_dropped_and_the_next_arrives():
    first, second = get_pool(2).run(_on_path, "backend", medium_refused_then_next)[1]
    assert "max_bytes" in first and "rank 0" in first, first
    assert second == (2, {2})


def short_medium_then_next() -> Any:
    """Rank 0's first medium message is one byte short of what its slot announces (a lying or broken sender): rank 1
    refuses it (its envelope says how many bytes follow the slot), then receives the next message whole. Only the
    liar's own message to this receiver is lost."""
    from objcomm._transport import p2p

    if dist.get_rank() == 0:
        real = p2p.pieces
        p2p.pieces = lambda out, inline: [memoryview(b"".join(real(out, inline))[:-1])]  # type: ignore
        try:
            objcomm.send(b"x" * MEDIUM, 1, tag=17, serializer="pickle")
        finally:
            p2p.pieces = real  # type: ignore
        objcomm.send(_medium(3, False), 1, tag=17)
        return None
    return _refused_then_next(17, objcomm.FrameError)


def test_a_medium_message_cut_short_costs_only_itself():
    first, second = get_pool(2).run(_on_path, "backend", short_medium_then_next)[1]
    assert "rank 0 sent" in first and "the slot announces a rest of" in first, first
    assert second == (3, {3})


def lying_envelope(lie: str) -> Any:
    """Rank 0's first message has an envelope that lies (``lie``); rank 1 refuses it (FrameError) and receives the
    next one whole."""
    from objcomm._transport import p2p

    if dist.get_rank() == 0:
        real = p2p._enveloped

        def lying(slot: bytearray, rest: Any, asks: bool = False) -> bytearray:
            if lie == "past the cut-off":  # more than the receiver's room after the slot
                return bytearray(p2p.ENVELOPE.pack(len(slot), 70_000)) + slot + b"".join(rest)
            if lie == "negative":
                return bytearray(p2p.ENVELOPE.pack(len(slot), -5)) + slot
            return real(slot, [memoryview(b"junk")])  # bytes after a slot that carries the whole message

        p2p._enveloped = lying  # type: ignore[assignment]
        try:
            objcomm.send(_medium(5, False) if lie != "after a whole slot" else "small", 1, tag=23)
        finally:
            p2p._enveloped = real  # type: ignore[assignment]
        objcomm.send(_medium(6, False), 1, tag=23)
        return None
    return _refused_then_next(23, objcomm.FrameError)


@pytest.mark.parametrize(
    "lie, said",
    [
        ("past the cut-off", "announces 70,000 bytes after its slot"),
        ("negative", "announces -5 bytes after its slot"),
        ("after a whole slot", "after a slot that nothing follows"),
    ],
)
def test_a_lying_envelope_is_refused_and_the_next_message_arrives(lie, said):
    first, second = get_pool(2).run(_on_path, "backend", lying_envelope, lie)[1]
    assert said in first, first
    assert second == (6, {6})


def a_gpu_tree_message_with_tensors_in_it() -> Any:
    """With a GPU group's rules (``p2p.GPU_RULES_ON_CPU``), rank 0 sends a tree's message with an out-of-band
    tensor's bytes in its padded message (an honest GPU sender sends them on their own: they stay on the GPU); rank 1
    refuses it and takes the next message, whose 20 KB frame came in its padded message, whole. First, a frame that
    lists an out-of-band tensor of 0 bytes (a relay passes on what its parent sent): sender and receiver read from
    the slot alike that it moves nothing but the frame (a helper's find: the sender read ``out.tensors``, sent the
    frame on its own, and its receiver refused the message, then read the frame as the next)."""
    from objcomm._transport import p2p, routes
    from objcomm._transport.base import Wire

    rank, pickle = dist.get_rank(), registry.guarded("pickle")
    wire = Wire(dist.group.WORLD, [0, 1], rank, torch.device("cpu"), 4096, 1 << 20, 1 << 30)
    lie = _frame.encode({"t": torch.arange(100)}, pickle, max_bytes=1 << 30, inline_tensor_bytes=0)
    honest = _frame.encode("h" * 20_000, pickle, max_bytes=1 << 30)
    empty = _frame.encode({"t": torch.empty(0), "s": "z" * 10_000}, pickle, max_bytes=1 << 30, inline_tensor_bytes=-1)
    p2p.GPU_RULES_ON_CPU = True
    try:
        if rank == 0:
            assert len(empty.tensors) == 1 and empty.tensors[0].numel() == 0
            p2p.tree_send(wire, empty, 1)
            real = routes.backend_whole
            routes.backend_whole = lambda rest, **_: 0 < rest <= routes.BACKEND_WHOLE_BYTES  # type: ignore[assignment]
            try:
                p2p.tree_send(wire, lie, 1)
            finally:
                routes.backend_whole = real  # type: ignore[assignment]
            p2p.tree_send(wire, honest, 1)
            return None
        _, zero, _ = p2p.recv(wire, 0, _frame.tensor_sizes, tree=True)
        if bytes(zero.frame) != bytes(empty.frame):
            return "the frame with a tensor of 0 bytes came wrong", False
        try:
            p2p.recv(wire, 0, _frame.tensor_sizes, tree=True)
            first = "taken"
        except objcomm.FrameError as exc:
            first = str(exc)
        _, got, _ = p2p.recv(wire, 0, _frame.tensor_sizes, tree=True)
        return first, bytes(got.frame) == bytes(honest.frame)
    finally:
        p2p.GPU_RULES_ON_CPU = False


def test_a_gpu_tree_message_with_tensors_in_it_is_refused_and_the_next_arrives():
    first, second = get_pool(2).run(a_gpu_tree_message_with_tensors_in_it)[1]
    assert "rest with its slot where tensors must follow it on their own" in first, first
    assert second


def mismatched(setting: Dict[str, Any], on: int) -> Any:
    """Rank ``on`` alone uses ``setting`` for one medium send from rank 0 to rank 1 (a group's ranks must agree on
    it); then both use the defaults for a second one. What each rank saw of the first, and the second."""
    rank = dist.get_rank()
    previous = objcomm.configure(**setting) if rank == on else objcomm.configure()
    try:
        if rank == 0:
            objcomm.send({"t": torch.arange(4_000, dtype=torch.float32)}, 1, tag=18)
            return "sent"
        got = objcomm.recv(0, tag=18)["t"]
        return "intact" if torch.equal(got, torch.arange(4_000, dtype=torch.float32)) else "wrong data"
    except objcomm.CommunicationError as exc:
        return f"raised: {exc}"
    finally:
        objcomm.restore(previous)


def then_next() -> Any:
    if dist.get_rank() == 0:
        objcomm.send(_medium(4, False), 1, tag=18)
        return None
    return _medium_seen(objcomm.recv(0, tag=18), False)


def in_backend_with(setting: Dict[str, Any], on: int) -> Any:
    objcomm.configure(local=False, inline_tensor_bytes=1024)  # (restored by _on_path's caller below)
    return mismatched(setting, on), then_next()


@pytest.mark.parametrize("on", [0, 1], ids=["sender", "receiver"])
def test_ranks_whose_slot_bytes_differ_get_an_error_never_shifted_tensors(on):
    """The envelope names the sender's slot size: a receiver of another raises (before, its tensors came back
    shifted by the difference, silently), and the next message arrives whole."""
    got = get_pool(2).run(_on_path, "backend", in_backend_with, {"slot_bytes": 8192}, on)
    (sender, _), (receiver, after) = got
    assert sender == "sent"
    assert receiver.startswith("raised:") and "slot_bytes" in receiver, receiver
    assert after == (4, {4})


def test_a_receiver_that_would_answer_first_takes_a_rest_that_came_with_its_slot():
    """A receiver whose shm_threshold (below the rest) says it must answer first follows the sender, which sent the
    rest with its slot: the data arrive intact (before, the receiver read zeros where the rest was)."""
    got = get_pool(2).run(_on_path, "backend", in_backend_with, {"shm_threshold": 8 << 10}, 1)
    assert got[0][0] == "sent" and got[1] == ("intact", (4, {4}))


def sender_waits_for_an_answer(group: Any) -> Any:
    objcomm.configure(inline_tensor_bytes=1024)
    previous = objcomm.configure(shm_threshold=8 << 10) if dist.get_rank() == 0 else objcomm.configure()
    try:
        if dist.get_rank() == 0:
            objcomm.send({"t": torch.arange(4_000, dtype=torch.float32)}, 1, tag=19, group=group)
            return "sent"
        got = objcomm.recv(0, tag=19, group=group)
        return "intact" if torch.equal(got["t"], torch.arange(4_000, dtype=torch.float32)) else f"wrong: {got}"
    finally:
        objcomm.restore(previous)


def test_a_sender_that_waits_for_an_answer_is_answered_whatever_the_receivers_settings():
    """The sender's shm_threshold says it waits for an answer (its shared memory may take the 16 KB rest); the
    receiver's says it need not give one. The sender says so in its message, the receiver answers, the rest comes
    the normal way (before: the receiver raised, naming the settings, and the sender waited for the timeout)."""
    sender, receiver = get_pool(2).run(in_short_group, "backend", sender_waits_for_an_answer, timeout=60)
    assert (sender, receiver) == ("sent", "intact")


def shared_memory_on_one_side(group: Any, on: int, threshold: int, elements: int) -> Any:
    """Rank ``on`` alone lowers shm_threshold to ``threshold``, below a tensor of ``elements`` float32, so the two
    ranks' settings disagree on whether shared memory takes its rest; two messages, the second after the first."""
    previous = objcomm.configure(shm_threshold=threshold) if dist.get_rank() == on else objcomm.configure()
    try:
        got = []
        for i in range(2):
            if dist.get_rank() == 0:
                objcomm.send(torch.arange(elements, dtype=torch.float32) + i, 1, tag=20, group=group)
                got.append("sent")
            else:
                taken = objcomm.recv(0, tag=20, group=group)
                got.append("intact" if torch.equal(taken, torch.arange(elements, dtype=torch.float32) + i) else "wrong")
        return got
    finally:
        objcomm.restore(previous)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "threshold, elements",
    [(1 << 20, 393_216), (100_000, 100_000)],
    ids=["1.5 MiB, asked either way", "400 KB, asked only by the lower threshold"],
)
@pytest.mark.parametrize("on", [0, 1], ids=["sender", "receiver"])
def test_ranks_that_disagree_on_shared_memory_move_the_rest_the_normal_way(on, threshold, elements, path):
    """Shared memory takes a send's rest only where the sender's and the receiver's settings both say so: the
    receiver's answer says whether its own do (``TAKES``), a sender whose own do not declines in shared memory's
    words, and both move the rest the normal way. Before: a 1.5 MiB rest (an answer either way) made the sender
    raise and the receiver wait for the timeout; a 400 KB one (an answer where one rank's threshold of 100 KB says
    shared memory may take it: only that rank expected one) left both waiting for the timeout through the backend,
    and failed the channel (a rest read as shared memory's words) or timed out through the channel."""
    sender, receiver = get_pool(2).run(
        in_short_group, path, shared_memory_on_one_side, on, threshold, elements, timeout=60
    )
    assert (sender, receiver) == (["sent"] * 2, ["intact"] * 2)


def does_not_ask(group: Any) -> Any:
    """Rank 0 sends a 1.5 MiB tensor (a piece past 1 MiB: its slot requires the receiver's answer) without asking
    for one, its rest at once through the channel, as a lying or broken sender would."""
    from objcomm._transport import p2p

    if dist.get_rank() == 0:
        real = p2p._agreement_needed
        p2p._agreement_needed = lambda *args, **kwargs: False  # type: ignore[assignment]
        try:
            objcomm.send(torch.ones(393_216), 1, tag=21, group=group)
        finally:
            p2p._agreement_needed = real  # type: ignore[assignment]
        return "sent"
    try:
        objcomm.recv(0, tag=21, group=group)
        return "returned"
    except objcomm.FrameError as exc:
        return f"refused: {exc}"


def in_own_group(scenario: Any) -> Any:
    """``scenario(group)`` on a group of every rank with a short timeout, through the channel, with no barrier after
    it (a liar's partner does not wait for the liar); a CommunicationError comes back as a string."""
    group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=SHORT_TIMEOUT))
    previous = objcomm.configure()
    try:
        _on("channel", group)
        return scenario(group)
    except objcomm.CommunicationError as exc:
        return f"failed: {exc}"[:300]
    finally:
        objcomm.restore(previous)
        dist.destroy_process_group(group)


def test_a_slot_that_requires_an_answer_from_a_sender_that_did_not_ask_is_refused():
    _, receiver = get_pool(2).run(in_own_group, does_not_ask, timeout=60)  # (the liar: sent, or met a closed channel)
    assert receiver.startswith("refused:") and "without waiting for this rank's answer" in receiver, receiver


# -- several threads sending and receiving under one tag -----------------------------------------------------------
def threads_on_one_tag(any_source: bool) -> Any:
    """Three threads of rank 0 each send 8 messages to rank 1 under one tag (large ones: a slot, then a rest; and
    medium ones), while three threads of rank 1 receive them (all from rank 0, or all from any rank): every message
    arrives, whole. (Which receiving thread takes which message is not fixed, nor the order in which they finish
    decoding.)"""
    import threading

    rank, threads, count = dist.get_rank(), 3, 8
    got: List[Any] = []
    errors: List[str] = []

    def sending(t: int) -> None:
        try:
            for i in range(count):
                size = 150_000 if i % 2 else MEDIUM  # a rest past the backend's one-message cut-off, or within it
                objcomm.send({"t": t, "i": i, "pad": bytes([t]) * (size + t)}, 1, tag=21)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(repr(exc)[:200])

    def receiving() -> None:
        try:
            for _ in range(count):
                m = objcomm.recv(None if any_source else 0, tag=21)
                size = 150_000 if m["i"] % 2 else MEDIUM
                got.append((m["t"], m["i"], m["pad"] == bytes([m["t"]]) * (size + m["t"])))
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc)[:200])

    workers = [
        threading.Thread(target=sending, args=(t,)) if rank == 0 else threading.Thread(target=receiving)
        for t in range(threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    if rank == 0:
        return errors
    return errors, sorted((t, i) for t, i, _ in got), all(whole for _, _, whole in got)


@pytest.mark.parametrize("any_source", [False, True], ids=["from rank 0", "from any rank"])
@pytest.mark.parametrize("path", PATHS)
def test_threads_sending_and_receiving_under_one_tag_keep_each_message_whole(path, any_source):
    """Before, through the backend, one thread's slot receive met another's rest and gloo aborted the process."""
    sender, receiver = get_pool(2).run(_on_path, path, threads_on_one_tag, any_source, timeout=120)
    assert sender == []
    assert receiver == ([], [(t, i) for t in range(3) for i in range(8)], True)


def any_and_given_at_once() -> Any:
    """Rank 1 receives from rank 0 in one thread and from any rank in another, under one tag, through the backend:
    the second is refused at once, and the first gets its message."""
    import threading

    if dist.get_rank() == 0:
        time.sleep(0.5)  # (both of rank 1's receives are posted by then)
        objcomm.send({"pad": b"g" * 150_000}, 1, tag=22)
        return None
    got: List[Any] = []
    given = threading.Thread(target=lambda: got.append(len(objcomm.recv(0, tag=22)["pad"])))
    given.start()
    time.sleep(0.2)
    try:
        objcomm.recv(None, tag=22)
        refused = "received"
    except objcomm.ObjcommError as exc:
        refused = str(exc)
    given.join(30)
    return refused, got


def test_a_receive_from_any_rank_beside_one_from_a_given_rank_is_refused_on_the_backend():
    refused, got = get_pool(2).run(_on_path, "backend", any_and_given_at_once, timeout=60)[1]
    assert "from any rank under tag 22 while another thread" in refused, refused
    assert got == [150_000]


# -- a pending send that fails is reported, not dropped --------------------------------------------------------------
def _receiver_killed(rank: int, world: int, store: str, victim: int, results: Any) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    objcomm.configure(local=False)  # a process of its own: nothing to restore
    dist.barrier()
    if rank == victim:
        time.sleep(1.0)  # never receives
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for i in range(3):
            objcomm.send(i, victim)
        sent = time.monotonic() - start
        time.sleep(3.0)  # the victim dies meanwhile
        objcomm.send(3, victim)
        results.put((rank, "no error", sent))
    except objcomm.CommunicationError as exc:
        results.put((rank, str(exc), time.monotonic() - start))


def test_a_pending_send_whose_receiver_died_is_reported_by_the_next_call():
    got, victim_exit = run_group_losing_a_rank(_receiver_killed, 2, 1, timeout=60)
    assert victim_exit == -signal.SIGKILL
    message, elapsed = got[0]
    assert "an earlier send of this rank to rank 1" in message, message
    assert "was not received" in message, message


def _sender_ends(rank: int, world: int, store: str, victim: int, results: Any, destroy: bool) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    objcomm.configure(local=False)
    dist.barrier()
    if rank == victim:  # sends and ends at once, before its receiver asks: delivered all the same
        with open(f"{store}.sender", "w") as handle:
            handle.write(str(os.getpid()))
        atexit.unregister(_pending.drain)  # objcomm's drain at exit, then a mark that it returned (see the test)
        atexit.register(_drain_then_mark, f"{store}.drained")
        for i in range(3):
            objcomm.send(i, 0)
        if destroy:
            dist.destroy_process_group()
        return
    time.sleep(1.0)
    try:
        got: Any = [objcomm.recv(victim) for _ in range(3)]
    except objcomm.CommunicationError as exc:
        got = str(exc)
    _outlive(int(open(f"{store}.sender").read()))
    results.put((rank, got, os.path.exists(f"{store}.drained")))


def _drain_then_mark(path: str) -> None:
    _pending.drain()
    with open(path, "w"):
        pass


def _outlive(pid: int, within: float = 30.0) -> None:
    """Return once process ``pid`` has ended (gone, or a zombie its parent has not reaped yet), ``within`` s at most:
    the receiver stays up until its sender is done, so that the sender's exit never races the receiver's own (gloo
    aborts a process whose peer closes the connection in the middle of its teardown; not what is tested here)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                if handle.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.05)


def _sender_exits(rank: int, world: int, store: str, victim: int, results: Any) -> None:
    _sender_ends(rank, world, store, victim, results, destroy=False)


def _sender_destroys_and_exits(rank: int, world: int, store: str, victim: int, results: Any) -> None:
    _sender_ends(rank, world, store, victim, results, destroy=True)


def test_pending_sends_are_delivered_when_their_sender_ends():
    got, sender_exit = run_group_losing_a_rank(_sender_exits, 2, 1, timeout=60, exits=True)
    assert got[0] == ([0, 1, 2], True)  # delivered, and objcomm's drain at exit returned
    # After that drain, torch's own teardown of the gloo group at interpreter exit now and then aborts the process
    # (std::terminate: "terminate called without an active exception"; about one full run in five on a loaded 2-core
    # machine, and with destroy_process_group() first as well): torch's exit, not objcomm's, and only after the mark
    assert sender_exit in (0, -signal.SIGABRT)
    got, _ = run_group_losing_a_rank(_sender_destroys_and_exits, 2, 1, timeout=60, exits=True)
    assert got[0] == ([0, 1, 2], True)


def test_a_send_not_received_is_reported_without_gloos_guess_that_a_peer_crashed():
    """A peer that exited with its receives done closes the connection too: the warning at exit quoted gloo's
    "typically caused by a remote worker crashing ... GLHF!" (a helper's find). What gloo said first is kept."""
    said = _pending._said(
        RuntimeError(
            "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:19637. This is typically caused by a remote worker crashing. Check the logs of the remote "
            "worker before reporting an error. GLHF!"
        )
    )
    assert said == "Connection closed by peer [127.0.0.1]:19637"
    assert _pending._said(RuntimeError("Timed out waiting 100ms")) == "Timed out waiting 100ms"


def past_the_bound_before_the_result() -> Any:
    """Through the backend, on a group with a 3 s timeout: rank 1 sends MOST_SENDS + 10 progress messages under tag
    1, then its result under tag 2; rank 0 waits for the result first. What each raises."""
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    previous = objcomm.configure()
    try:
        _on("backend", group)
        try:
            if dist.get_rank() == 1:
                for i in range(_pending.MOST_SENDS + 10):
                    objcomm.send(i, dst=0, group=group, tag=1)
                objcomm.send("result", dst=0, group=group, tag=2)
            else:
                objcomm.recv(src=1, group=group, tag=2)
            return "returned"
        except objcomm.CommunicationError as exc:
            return str(exc)
    finally:
        objcomm.restore(previous)
        dist.destroy_process_group(group)


def test_a_sender_held_at_the_bound_says_so():
    """A worker whose progress messages outnumber what this rank keeps waiting for receivers (MOST_SENDS) while its
    master first waits for a result under another tag: both wait until the timeout, as under MPI past its eager
    buffers, and the sender's error says it was the bound and what to do (a porter's find: it said only that a send
    was not received, and the master's pointed at settings)."""
    sender = get_pool(2).run(past_the_bound_before_the_result, timeout=60)[1]
    assert "the most it keeps: 1024" in sender or "at most 1024" in sender, sender
    assert "receive in between, or irecv first" in sender or "Does every rank receive" in sender, sender
