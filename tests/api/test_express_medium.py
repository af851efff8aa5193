"""The express path of a medium send (objcomm._api.express): a plain frame past the slot that fits one channel message
goes with its slot, byte for byte the general path's message (``ChannelRoute.send_whole``); the receiver reads it as
the general path does, and hands everything else to it with the same outcome; settings that make the general path
ask first (shared memory) keep it there."""

from __future__ import annotations

from typing import Any, List

import pytest
import torch
import torch.distributed as dist
from _builtins import ON_RANKS
from _counting import counting
from _ranks import get_pool

import objcomm
from objcomm import _state
from objcomm._api import express as _express
from objcomm._format import frame as _frame
from objcomm._format import plain_slot as _plain_slot
from objcomm._format.rest import pieces
from objcomm._format.slot import PREFIX, fill_slot, read_slot
from objcomm._format.tensors import TensorLifter
from objcomm._samehost import channel_checks as _channel_checks
from objcomm._samehost import mesh as _mesh
from objcomm._samehost.shm import SharedMemory
from objcomm._transport import p2p as _p2p
from objcomm._transport.base import WHOLE, Wire
from serializers import registry

pytestmark = pytest.mark.timeout(120)

SLOT = 4096
LIMIT = 1 << 40
MOST = _mesh.MAX_PAYLOAD - _channel_checks.whole_size(b"", 0) - SLOT  # the longest frame one message carries
RECORDS = [{"id": i, "label": i % 10, "score": i * 0.001, "text": "sample text"} for i in range(600)]


def _general_message(obj: Any, name: str, limit: int = LIMIT) -> bytes:
    """What ``ChannelRoute.send_whole`` sends for ``obj``: the untrimmed slot, then the frame."""
    out = _frame.encode(obj, registry.guarded(name), max_bytes=limit)
    slot = bytearray(SLOT)
    fill_slot(memoryview(slot), out, limit)
    return _channel_checks.whole_message(slot, pieces(out, read_slot(memoryview(slot)).inline is not None))


def _express_message(obj: Any, name: str, limit: int = LIMIT, most: int = MOST) -> Any:
    payload = registry.guarded(name).dumps(obj, lift=TensorLifter())
    parts = _plain_slot.medium_slot(name.encode("ascii"), payload, SLOT, limit, most)
    return None if parts is None else _channel_checks.whole_message(parts[0], parts[1:])


@pytest.mark.parametrize("name", ON_RANKS)
@pytest.mark.parametrize("size", [5_000, 30_000, 60_000])
def test_the_express_medium_message_is_the_general_paths_byte_for_byte(name, size):
    obj = {"text": "t" * size, "n": [1, 2, 3]}
    assert _express_message(obj, name) == _general_message(obj, name)


def test_medium_frames_go_whole_from_past_the_slot_to_one_channel_message():
    def frame_of(n: int) -> int:
        return len(_frame.encode(b"x" * n, registry.guarded("pickle"), max_bytes=LIMIT).frame)

    fits = max(n for n in range(3900, 4100) if PREFIX.size + frame_of(n) <= SLOT)
    assert _express_message(b"x" * fits, "pickle") is None  # fits its slot: the small path's
    assert _express_message(b"x" * (fits + 1), "pickle") == _general_message(b"x" * (fits + 1), "pickle")
    longest = _longest_bytes()
    assert frame_of(longest) == MOST
    assert _express_message(b"x" * longest, "pickle") is not None  # exactly one message
    assert _express_message(b"x" * (longest + 1), "pickle") is None  # the general path's slot and rest
    assert _channel_checks.whole_size(bytes(SLOT), MOST) == _mesh.MAX_PAYLOAD  # where send_whole stops too
    length = frame_of(10_000)
    assert _express_message(b"x" * 10_000, "pickle", limit=length) is not None
    assert _express_message(b"x" * 10_000, "pickle", limit=length - 1) is None  # encode() says why: TooLargeError


def test_a_wire_whose_shared_memory_may_take_a_medium_rest_sends_none_whole():
    wire = Wire(None, [0, 1], 0, torch.device("cpu"), SLOT, 1 << 26, LIMIT)
    assert _express._whole_frames(wire, cpu=True) == MOST
    assert _express._whole_frames(wire, cpu=False) == 0
    assert _express._whole_frames(wire._replace(rest_media=SharedMemory(threshold=8 << 10)), cpu=True) == 0
    assert _express._whole_frames(wire._replace(rest_media=SharedMemory(threshold=MOST + 1)), cpu=True) == MOST
    assert _express._whole_frames(wire._replace(slot=_mesh.MAX_PAYLOAD), cpu=True) == 0


def _longest_bytes() -> int:
    """The longest ``bytes`` whose pickle frame one message carries with its slot."""

    def frame_of(n: int) -> int:
        return len(_frame.encode(b"x" * n, registry.guarded("pickle"), max_bytes=LIMIT).frame)

    return max(n for n in range(MOST - 100, MOST) if frame_of(n) <= MOST)


def _mutations(message: bytes) -> List[bytes]:
    """``message`` (a whole one, less its first word) with bytes of the slot's prefix and count, and of the frame's
    header and name, set to values that matter."""
    out = []
    frame_at = SLOT
    spots = list(range(PREFIX.size + 4)) + list(range(frame_at, frame_at + _frame.HEADER.size + 8))
    for at in spots:
        for value in (0, 1, 0x7F, 0xFF, message[at] ^ 1):
            changed = bytearray(message)
            changed[at] = value
            out.append(bytes(changed))
    return out


@pytest.mark.parametrize("name", ["pickle", "msgpack", "json"])
def test_the_receivers_shortcut_takes_exactly_the_plain_frames_after_their_slot(name):
    taken = 0
    for sender in ("pickle", "msgpack", "json"):
        whole = _general_message({"text": "t" * 9000}, sender)
        for changed in [whole[4:], *_mutations(whole[4:])]:
            slot, rest = changed[:SLOT], changed[SLOT:]
            plain = _plain_slot.plain_rest(slot, rest)
            if plain is None:
                continue
            frame, header = plain
            info = read_slot(memoryview(slot))  # what the general path reads of them
            assert info.inline is None and info.sizes == [] and not info.error and info.total == len(rest)
            general = _frame.parse_header(memoryview(rest))
            assert general == header and bytes(frame) == rest and header.n_tensors == header.flags == 0
            taken += header.serializer == name
    assert taken >= 1


# -- on live ranks ------------------------------------------------------------------------------------------


def medium_routes_and_outcomes() -> List[Any]:
    """Rank 0 sends to rank 1 case after case; each side reports the outcome and whether the general path sent."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(local=True)
    comm.all_gather(None)
    shm = objcomm.Communicator(local=True, shm_threshold=8 << 10)
    shm.all_gather(None)
    small_limit = objcomm.Communicator(local=True, max_bytes=10_000)
    only_msgpack = objcomm.Communicator(local=True, accept=["msgpack"])
    auto = objcomm.Communicator(local=True, serializer="auto")
    auto.all_gather(None)
    biggest = b"x" * _longest_bytes()
    cases = [  # (label, send, recv)
        ("records", lambda: comm.send(RECORDS, 1), lambda: comm.recv(0) == RECORDS),
        ("tag 3", lambda: comm.send(b"y" * 20_000, 1, tag=3), lambda: len(comm.recv(0, tag=3))),
        ("any source", lambda: comm.send("z" * 9000, 1), lambda: comm.recv(None, return_sender=True)[0]),
        ("the longest", lambda: comm.send(biggest, 1), lambda: comm.recv(0) == biggest),
        ("one byte longer", lambda: comm.send(biggest + b"x", 1), lambda: comm.recv(0) == biggest + b"x"),
        ("shared memory may take it", lambda: shm.send(RECORDS, 1), lambda: shm.recv(0) == RECORDS),
        ("auto", lambda: auto.send(RECORDS, 1), lambda: auto.recv(0) == RECORDS),
        ("receiver's max_bytes", lambda: comm.send(RECORDS, 1), lambda: small_limit.recv(0)),
        (
            "receiver's max_bytes, general",
            lambda: comm.send(RECORDS, 1, serializer="pickle"),
            lambda: small_limit.recv(0),
        ),
        ("refused by accept", lambda: comm.send(RECORDS, 1), lambda: only_msgpack.recv(0)),
        ("refused by accept, general", lambda: comm.send(RECORDS, 1, max_bytes=1 << 30), lambda: only_msgpack.recv(0)),
        ("after the refusals", lambda: comm.send(RECORDS, 1), lambda: comm.recv(0) == RECORDS),
    ]
    got = []
    for label, send, recv in cases:
        with counting({"general": [(_p2p, "send"), (_p2p, "recv"), (_express, "received")]}) as counts:
            outcome = _outcome(send if rank == 0 else recv)
        got.append((label, outcome, counts["general"]))
    channel = _state.group_facts(dist.group.WORLD).local[False].channel
    assert channel.p2p and not channel.closed
    return got


def _outcome(fn: Any) -> Any:
    try:
        return ("ok", fn())
    except Exception as exc:  # the outcome of a case is what it raised, by type and message
        return ("raised", type(exc).__name__, str(exc))


def test_medium_sends_take_the_express_path_and_the_general_path_the_rest():
    got = get_pool(2).run(medium_routes_and_outcomes)
    sender = {label: (outcome, general) for label, outcome, general in got[0]}
    receiver = {label: (outcome, general) for label, outcome, general in got[1]}
    for label in ("records", "tag 3", "any source", "the longest", "auto", "after the refusals"):
        assert sender[label] == (("ok", None), 0), label  # no call of the general path on either side
        assert receiver[label][1] == 0, label
    assert receiver["records"][0] == receiver["the longest"][0] == receiver["auto"][0] == ("ok", True)
    assert receiver["tag 3"][0] == ("ok", 20_000) and receiver["any source"][0] == ("ok", 0)
    assert sender["one byte longer"][1] == 1 and receiver["one byte longer"][0] == ("ok", True)
    assert sender["shared memory may take it"][1] == 1 and receiver["shared memory may take it"] == (("ok", True), 1)
    # refusals: the general path's outcome, word for word, and the next message arrives
    assert sender["receiver's max_bytes"][1] == 0 and sender["receiver's max_bytes, general"][1] == 1
    refused = receiver["receiver's max_bytes"][0]
    assert refused[1] == "TooLargeError" and refused == receiver["receiver's max_bytes, general"][0]
    assert sender["refused by accept"][1] == 0 and sender["refused by accept, general"][1] == 1
    refused = receiver["refused by accept"]
    assert refused[0][1] == "ContentRefusedError" and refused == receiver["refused by accept, general"]
    assert refused[1] == 0  # decoded on the express path, where accept refuses it as on the general path
    assert receiver["after the refusals"][0] == ("ok", True)


def hostile_whole_messages() -> List[Any]:
    """Rank 1 writes whole messages (a slot and its frame) straight into a subgroup's channel, each twice; rank 0
    receives one through the express path and one through the general path (an option given per call)."""
    rank = dist.get_rank()
    good = _general_message({"text": "t" * 9000}, "pickle")
    frame_at = 4 + SLOT
    unknown = bytearray(good)
    unknown[frame_at + _frame.HEADER.size : frame_at + _frame.HEADER.size + 6] = b"pickl?"
    flagged = bytearray(good)
    flagged[frame_at + 5] = 1  # the frame's flags: an error report, in a slot that says it is none
    tensors = bytearray(good)
    PREFIX.pack_into(tensors, 4, *PREFIX.unpack_from(good, 4)[:2], PREFIX.unpack_from(good, 4)[2] + 8)
    garbage = bytearray(good)
    garbage[-200:] = b"\xff" * 200
    cases = {
        "good": bytes(good),
        "bad magic": bytes(good[:frame_at]) + b"XXXX" + bytes(good[frame_at + 4 :]),
        "unknown serializer": bytes(unknown),
        "frame flags": bytes(flagged),
        "the slot announces more": bytes(tensors),
        "garbage payload": bytes(garbage),
    }
    sub = dist.new_group([0, 1])
    comm = objcomm.Communicator(sub, local=True)
    comm.all_gather(None)
    channel = _state.group_facts(sub).local[False].channel
    assert channel.p2p and comm._express() is not None
    limit = comm._call({}).options.max_bytes
    got: List[Any] = []
    for label, raw in cases.items():
        if rank == 1:
            for _ in range(2):
                channel.send(raw, 0, 7, channel.new_message() | WHOLE)
        else:
            got.append((label, _outcome(lambda: comm.recv(1, tag=7))))
            got.append((label + ": general path", _outcome(lambda: comm.recv(1, tag=7, max_bytes=limit))))
    got.append(("next", _outcome(lambda: comm.send("next", 1) if rank == 0 else comm.recv(0))))
    dist.destroy_process_group(sub)
    return got


def test_hostile_whole_messages_through_the_express_path_raise_as_on_the_general_path():
    receiver, sender = get_pool(2).run(hostile_whole_messages)
    got = dict(receiver)
    assert got["good"] == ("ok", {"text": "t" * 9000})
    for label in (
        "good",
        "bad magic",
        "unknown serializer",
        "frame flags",
        "the slot announces more",
        "garbage payload",
    ):
        assert got[label] == got[label + ": general path"], label
    assert got["bad magic"][1] == "FrameError" and got["unknown serializer"][1] == "UnknownSerializerError"
    assert got["garbage payload"][1] == "DecodeError"
    assert got["the slot announces more"][1] == "FrameError"
    assert got["next"] == ("ok", None) and dict(sender)["next"] == ("ok", "next")  # rank 0 sends it: still in step


def writable_rests() -> List[Any]:
    """Rank 1 sends a medium message in a serializer whose objects are views of what it decodes; rank 0 takes one
    through the express path and one through the general path: (writable, value) of each."""
    import numpy as np

    registry.register("view-of-bytes", bytes, lambda data: np.frombuffer(data, dtype=np.uint8), replace=True)
    try:
        rank = dist.get_rank()
        comm = objcomm.Communicator(local=True)
        comm.all_gather(None)
        sender = objcomm.Communicator(local=True, serializer="view-of-bytes")
        got: List[Any] = []
        if rank == 1:
            for _ in range(2):
                sender.send(b"\x01" * 9000, 0)
        else:
            limit = comm._call({}).options.max_bytes
            for array in (comm.recv(1), comm.recv(1, max_bytes=limit)):
                got.append((array.flags.writeable, int(array.sum())))
        return got
    finally:
        registry.unregister("view-of-bytes")


def test_a_medium_rest_reaches_the_decoder_writable_on_both_paths():
    receiver, _ = get_pool(2).run(writable_rests)
    assert receiver == [(True, 9000), (True, 9000)]  # a view of it may be written to, as on the general path


class _Refusing:
    """A channel that records why it failed (the channel's own ``fail`` raises CommunicationError)."""

    def __init__(self) -> None:
        self.why: List[str] = []

    def fail(self, op: str, why: str) -> None:
        self.why.append(why)
        raise objcomm.CommunicationError(why)


def test_a_slot_with_its_rest_on_a_gpu_groups_channel_fails_it():
    whole = _general_message({"text": "t" * 9000}, "pickle")
    slot, rest = _channel_checks.cut_whole(_Refusing(), whole, SLOT, 1, "recv")
    assert len(slot) == SLOT and isinstance(rest, bytearray) and bytes(rest) == whole[4 + SLOT :]
    channel = _Refusing()
    with pytest.raises(objcomm.CommunicationError, match="GPU group"):
        _channel_checks.cut_whole(channel, whole, SLOT, 1, "recv", cpu=False)  # an NCCL group's rests: the backend
    assert channel.why and "a protocol error" in channel.why[0]
