"""The express path of small send/recv (objcomm._api.express): the slot it writes is the general path's, byte
for byte; it takes exactly the plain case and hands every other one to the general path with the same
outcome; it notices changed settings, registry and groups; it reads hostile slots as the general path does."""

from __future__ import annotations

import gc
import pickle
import weakref
from typing import Any, List

import pytest
import torch
import torch.distributed as dist
from _builtins import ON_RANKS
from _child import run_in_child
from _counting import counting
from _ranks import get_pool

import objcomm
from objcomm import _state
from objcomm._api import express as _express
from objcomm._api import resolving as _resolving
from objcomm._format import frame as _frame
from objcomm._format import plain_slot as _plain_slot
from objcomm._format.slot import ERROR_BIT, PREFIX, fill_slot, read_slot
from objcomm._format.tensors import TensorLifter
from objcomm._samehost import channel as _channel
from objcomm._samehost import channel_checks as _channel_checks
from objcomm._transport import broadcast as _broadcast
from objcomm._transport import call_words
from objcomm._transport import p2p as _p2p
from objcomm._transport import rounds as _rounds
from serializers import registry

pytestmark = pytest.mark.timeout(120)

SLOT = 4096
LIMIT = 1 << 40
OBJECTS = [None, 7, "text", {"loss": 0.25, "step": 3, "tags": ["a", "b"]}, [0.5] * 100, b"\x00" * 300, {"k": (1, 2)}]


def _general_slot(obj: Any, name: str, slot: int = SLOT, limit: int = LIMIT) -> bytearray:
    raw = bytearray(slot)
    fill_slot(memoryview(raw), _frame.encode(obj, registry.guarded(name), max_bytes=limit), limit)
    return raw


def _express_slot(obj: Any, name: str, slot: int = SLOT, limit: int = LIMIT) -> Any:
    """The express path's slot, trimmed after the frame, and checked to be read as the whole slot."""
    payload = registry.guarded(name).dumps(obj, lift=TensorLifter())
    raw = _plain_slot.small_slot(name.encode("ascii"), payload, slot, limit)
    if raw is None:
        return None
    assert len(raw) == PREFIX.size + PREFIX.unpack_from(raw)[0]  # the prefix and the frame, no zeros after it
    if len(raw) == slot:  # a frame that fills its slot
        return raw
    assert _channel_checks.trimmed(raw, slot)
    whole = bytes(raw) + bytes(slot - len(raw))
    assert read_slot(memoryview(raw)) == read_slot(memoryview(whole))  # what a receiver reads of it
    return whole


@pytest.mark.parametrize("name", ON_RANKS)
@pytest.mark.parametrize("index", range(len(OBJECTS)))
def test_the_express_slot_is_the_general_paths_slot_byte_for_byte(name, index):
    obj = OBJECTS[index]
    if name == "json" and (isinstance(obj, bytes) or index == 6):
        obj = "json carries neither bytes nor tuples"
    assert _express_slot(obj, name) == _general_slot(obj, name)


def test_a_frame_that_fills_the_slot_exactly_is_express_one_byte_more_is_not():
    capacity = SLOT - PREFIX.size
    fixed = len(_frame.encode(b"", registry.guarded("pickle"), max_bytes=LIMIT).frame) - len(
        registry.guarded("pickle").dumps(b"")
    )
    n = 0
    while fixed + len(registry.guarded("pickle").dumps(b"x" * n)) < capacity:
        n += 1
    exact = b"x" * n
    assert len(_frame.encode(exact, registry.guarded("pickle"), max_bytes=LIMIT).frame) == capacity
    assert _express_slot(exact, "pickle") == _general_slot(exact, "pickle")
    assert _express_slot(exact + b"x", "pickle") is None  # the general path sends the frame in a second round
    length = len(_frame.encode(b"abc", registry.guarded("pickle"), max_bytes=LIMIT).frame)
    assert _express_slot(b"abc", "pickle", limit=length) == _general_slot(b"abc", "pickle", limit=length)
    assert _express_slot(b"abc", "pickle", limit=length - 1) is None  # encode() says why: TooLargeError


# -- on live ranks ------------------------------------------------------------------------------------------


GENERAL_SEND_RECV = {"send": [(_p2p, "send")], "recv": [(_p2p, "recv")]}  # the general path's


def _outcome(fn: Any, message: bool = False) -> Any:
    try:
        return ("ok", fn())
    except Exception as exc:  # the outcome of a case is what it raised, by type (and message)
        return ("raised", type(exc).__name__, str(exc)) if message else ("raised", type(exc).__name__)


def routes_and_outcomes() -> List[Any]:
    """Rank 0 sends to rank 1 case after case; each side reports the outcome and the route it took."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(local=True)
    comm.all_gather(None)  # opens the channel and lets send/recv in
    channel = _state.group_facts(dist.group.WORLD).local[False].channel
    assert channel is not None and channel.p2p
    cases = [  # (label, send, recv)
        ("small dict", lambda: comm.send({"a": 1}, 1), lambda: comm.recv(0)),
        ("tag 5", lambda: comm.send("five", 1, tag=5), lambda: comm.recv(0, tag=5)),
        ("any source", lambda: comm.send([1, 2], 1), lambda: comm.recv(None, return_sender=True)),
        ("a tensor", lambda: comm.send({"t": torch.arange(3)}, 1), lambda: comm.recv(0)["t"].tolist()),
        ("past one message", lambda: comm.send(b"y" * 70_000, 1), lambda: len(comm.recv(0))),
        ("encode fails", lambda: comm.send(lambda: 0, 1), lambda: comm.recv(0)),
        ("per-call serializer", lambda: comm.send({"m": 1}, 1, serializer="msgpack"), lambda: comm.recv(0)),
        ("per-call recv option", lambda: comm.send({"b": 2}, 1), lambda: comm.recv(0, max_bytes=1 << 20)),
        (
            "refused by accept",
            lambda: comm.send({"c": 3}, 1),
            lambda: objcomm.Communicator(accept=["msgpack"], local=True).recv(0),
        ),
        ("after the refusal", lambda: comm.send("still fine", 1), lambda: comm.recv(0)),
    ]
    got = []
    for label, send, recv in cases:
        with counting(GENERAL_SEND_RECV) as counts:
            outcome = _outcome(send if rank == 0 else recv)
        got.append((label, outcome, counts["send"] + counts["recv"]))
    # bad arguments: the general path's errors, on the calling rank alone
    for label, call in [
        ("dst True", lambda: comm.send(1, True)),
        ("dst outside", lambda: comm.send(1, 99)),
        ("dst self", lambda: comm.send(1, rank)),
        ("tag -1", lambda: comm.send(1, 1 - rank, tag=-1)),
        ("tag True", lambda: comm.recv(1 - rank, tag=True)),
        ("src self", lambda: comm.recv(rank)),
    ]:
        got.append((label, _outcome(call)))
    assert channel.p2p and not channel.closed
    return got


class Counted:
    """Counts how often it is serialized (in this process)."""

    reductions = 0

    def __reduce__(self) -> Any:
        Counted.reductions += 1
        return (Counted, ())


def serialized_once_and_failures_reported() -> List[Any]:
    """What the express path cannot send goes to the general path with what serializing it gave: serialized
    once; a serializer whose output is no buffer is reported to the receiver, not left waiting for."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(local=True)
    comm.all_gather(None)
    got: List[Any] = []
    for obj in ({"c": Counted(), "t": torch.zeros(2)}, {"c": Counted(), "big": b"b" * 10_000}, {"c": Counted()}):
        Counted.reductions = 0
        if rank == 0:
            comm.send(obj, 1)
            got.append(Counted.reductions)
        else:
            got.append(type(comm.recv(0)["c"]).__name__)
    registry.register("no-buffer", lambda o: "not bytes", lambda b: None, replace=True)
    try:
        on_it = objcomm.Communicator(serializer="no-buffer", local=True)
        got.append(_outcome(lambda: on_it.send("x", 1) if rank == 0 else comm.recv(0)))
        got.append(_outcome(lambda: comm.send("next", 1) if rank == 0 else comm.recv(0)))
    finally:
        registry.unregister("no-buffer")
    return got


def test_what_the_express_path_hands_over_is_serialized_once_and_failures_reach_the_receiver():
    sender, receiver = get_pool(2).run(serialized_once_and_failures_reported)
    assert sender[:3] == [1, 1, 1] and receiver[:3] == ["Counted"] * 3
    assert sender[3][0] == "raised" and receiver[3] == ("raised", "RemoteError")  # not left waiting
    assert receiver[4] == ("ok", "next")  # and the next message is the next one


def test_the_express_path_takes_the_plain_cases_and_the_general_path_the_rest():
    got = get_pool(2).run(routes_and_outcomes)
    sender = {label: (outcome, general) for label, outcome, general in got[0][:10]}
    receiver = {label: (outcome, general) for label, outcome, general in got[1][:10]}
    # plain cases: no call of the general path on either side
    assert sender["small dict"] == (("ok", None), 0) and receiver["small dict"] == (("ok", {"a": 1}), 0)
    assert sender["tag 5"][1] == 0 and receiver["tag 5"] == (("ok", "five"), 0)
    assert receiver["any source"] == (("ok", (0, [1, 2])), 0)
    assert receiver["refused by accept"] == (("raised", "ContentRefusedError"), 0)  # the same check, in decode
    assert sender["after the refusal"][1] == 0 and receiver["after the refusal"] == (("ok", "still fine"), 0)
    # the rest: the general path, with its outcomes
    assert sender["a tensor"][1] == 1 and receiver["a tensor"] == (("ok", [0, 1, 2]), 0)  # the slot said: more follows
    # (past the slot, within one channel message: tests/api/test_express_medium.py)
    assert sender["past one message"][1] == 1 and receiver["past one message"] == (("ok", 70_000), 0)
    assert sender["encode fails"][0][0] == "raised" and sender["encode fails"][1] == 1
    assert receiver["encode fails"] == (("raised", "RemoteError"), 0)
    assert sender["per-call serializer"][1] == 1 and receiver["per-call serializer"] == (("ok", {"m": 1}), 0)
    assert sender["per-call recv option"][1] == 0 and receiver["per-call recv option"] == (("ok", {"b": 2}), 1)
    for rank_got in got:
        errors = dict(rank_got[10:])
        assert errors["dst True"] == ("raised", "TypeError")
        assert errors["dst outside"] == errors["tag -1"] == errors["tag True"] == ("raised", "ValueError")
        assert errors["dst self"] == ("ok", None) and errors["src self"] == ("ok", 1)  # to oneself (issue 28)


def changes_between_calls() -> List[Any]:
    """The express path of a communicator follows configure(), the registry and the group."""
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    comm = objcomm.Communicator(local=True)
    comm.all_gather(None)

    def exchange(obj: Any, sender: Any = comm, receiver: Any = comm) -> Any:
        return _outcome(lambda: sender.send(obj, peer) if rank == 0 else receiver.recv(peer))

    got: List[Any] = [exchange("warm")]
    held = comm._express()
    assert held is not None and comm._express() is held
    previous = objcomm.configure(max_bytes=100)
    try:
        got.append(exchange("z" * 200))  # the sender refuses it now: TooLargeError, and the receiver hears of it
    finally:
        objcomm.restore(previous)
    got.append(exchange("back to normal"))
    assert comm._express() is not held  # worked out again after configure() and restore()

    def marked(mark: bytes) -> Any:  # a serializer whose payloads say which one wrote them, and results which read
        return registry.register(
            "marked",
            lambda o: mark + pickle.dumps(o),
            lambda b: (bytes(b[:1]), mark, pickle.loads(b[1:])),
            replace=True,
        )

    marked(b"1")
    try:
        on_marked = objcomm.Communicator(serializer="marked", local=True)
        got.append(exchange("first", on_marked))
        got.append(exchange("first, both on it", on_marked, on_marked))
        marked(b"2")  # replaced: the next send must use the new one, and a receiver on it the new loads
        got.append(exchange("second", on_marked))
        got.append(exchange("second, both on it", on_marked, on_marked))
    finally:
        registry.unregister("marked")

    sub = dist.new_group([0, 1])
    on_sub = objcomm.Communicator(sub, local=True)
    on_sub.all_gather(None)
    got.append(_outcome(lambda c=on_sub: c.send("on a subgroup", peer) if rank == 0 else c.recv(peer)))
    assert on_sub._express() is not None
    kept = weakref.ref(sub)
    dist.destroy_process_group(sub)
    del sub, on_sub
    gc.collect()
    got.append(kept() is None)  # the express path kept no reference to the group
    return got


def test_the_express_path_follows_settings_registry_and_groups():
    sender, receiver = get_pool(2).run(changes_between_calls)
    assert sender[1] == ("raised", "TooLargeError") and receiver[1] == ("raised", "RemoteError")
    assert receiver[2] == ("ok", "back to normal")
    assert receiver[3] == ("ok", (b"1", b"1", "first")) and receiver[4] == ("ok", (b"1", b"1", "first, both on it"))
    assert receiver[5] == ("ok", (b"2", b"2", "second")) and receiver[6] == ("ok", (b"2", b"2", "second, both on it"))
    assert receiver[7] == ("ok", "on a subgroup")
    assert sender[8] is True and receiver[8] is True


def hostile_slots() -> List[Any]:
    """Rank 1 writes slots straight into a subgroup's channel; rank 0 receives each through the express path
    (subgroups: the cases that fail a channel must not touch the pool's default group; one channel each)."""
    rank = dist.get_rank()
    good = bytes(_general_slot({"ok": 1}, "pickle"))
    length = PREFIX.unpack_from(good, 0)[0]
    unknown = bytearray(good)
    at = PREFIX.size + _frame.HEADER.size
    unknown[at : at + len(b"pickle")] = b"pickl?"
    survived = {
        "good": good,
        "bad magic": good[: PREFIX.size] + b"XXXX" + good[PREFIX.size + 4 :],
        "frame shorter than its header says": PREFIX.pack(length - 3, LIMIT, length - 3) + good[PREFIX.size :],
        "unknown serializer": bytes(unknown),
        "error report that is not one": PREFIX.pack(length | ERROR_BIT, LIMIT, length) + good[PREFIX.size :],
        "trimmed, shorter than a header": PREFIX.pack(10, LIMIT, 10) + b"x" * 10,  # read as a whole slot
        "garbage pickle payload": _plain_slot.small_slot(b"pickle", b"\x80\x05garbage", SLOT, LIMIT),
        "empty pickle payload": _plain_slot.small_slot(b"pickle", b"", SLOT, LIMIT),
        "a msgpack frame": _plain_slot.small_slot(b"msgpack", registry.guarded("msgpack").dumps({"m": 1}), SLOT, LIMIT),
    }
    fatal = {  # neither a slot nor a trimmed one: the channel fails, as on the general path
        "trimmed with flag bits": _trimmed(PREFIX.pack(length | ERROR_BIT, LIMIT, length) + good[PREFIX.size :]),
        "short slot": good[:100],
        "trimmed, then more bytes": _trimmed(good) + b"\0" * 5,  # a plain frame, but not where a trimmed slot ends
        "longer than a slot": _plain_slot.small_slot(b"pickle", pickle.dumps(b"x" * SLOT), 2 * SLOT, LIMIT),
    }
    got: List[Any] = []
    for cases in [survived, *({label: raw} for label, raw in fatal.items())]:
        sub = dist.new_group([0, 1])
        comm = objcomm.Communicator(sub, local=True)
        comm.all_gather(None)
        channel: _channel.LocalChannel = _state.group_facts(sub).local[False].channel
        assert channel.p2p and comm._express() is not None
        limit = comm._call({}).options.max_bytes  # given per call: the general path, with the same limit
        for label, raw in cases.items():
            if rank == 1:
                channel.send(raw, 0, tag=7)
                if cases is survived:
                    channel.send(raw, 0, tag=7)
            else:
                with counting({"calls": [(_frame, "decode_parsed")]}) as decoded:
                    got.append((label, _outcome(lambda c=comm: c.recv(1, tag=7), message=True)))
                got.append((label + ": decode_parsed calls", decoded["calls"]))
                if cases is survived:
                    got.append(
                        (
                            label + ": general path",
                            _outcome(lambda c=comm, m=limit: c.recv(1, tag=7, max_bytes=m), message=True),
                        )
                    )
        if rank == 1 and cases is not survived:
            got.append(("peer", _outcome(lambda c=comm: c.recv(0, tag=9))))  # rank 0's channel closed: EOF here
        dist.destroy_process_group(sub)
    return got


def _trimmed(slot: bytes) -> bytes:
    return slot[: PREFIX.size + (PREFIX.unpack_from(slot)[0] & ((1 << 61) - 1))]


def test_hostile_slots_through_the_express_path_raise_as_on_the_general_path():
    receiver, peer = get_pool(2).run(hostile_slots)
    everything = dict(receiver)
    got = {label: outcome[:2] for label, outcome in receiver if isinstance(outcome, tuple)}
    assert got["good"] == ("ok", {"ok": 1}) and got["a msgpack frame"] == ("ok", {"m": 1})
    assert got["garbage pickle payload"] == got["empty pickle payload"] == ("raised", "DecodeError")
    for label in ("good", "garbage pickle payload", "empty pickle payload"):  # this rank's serializer: decoded as is
        assert everything[label + ": decode_parsed calls"] == 0
    assert everything["a msgpack frame: decode_parsed calls"] == 1  # another one: found in the registry
    for label in (
        "good",
        "bad magic",
        "frame shorter than its header says",
        "unknown serializer",
        "error report that is not one",
        "trimmed, shorter than a header",
        "garbage pickle payload",
        "empty pickle payload",
        "a msgpack frame",
    ):  # type and message, as on the general path
        assert everything[label] == everything[label + ": general path"], label
    assert got["bad magic"] == ("raised", "FrameError")
    assert got["frame shorter than its header says"] == ("raised", "FrameError")
    assert got["unknown serializer"] == ("raised", "UnknownSerializerError")
    assert got["error report that is not one"] == ("raised", "FrameError")
    assert got["trimmed, shorter than a header"] == ("raised", "FrameError")  # a truncated frame
    for label in ("trimmed with flag bits", "short slot", "trimmed, then more bytes", "longer than a slot"):
        kind, name, message = dict(receiver)[label]
        assert name == "CommunicationError" and "every rank of a group must use the same slot_bytes" in message
    assert [outcome for label, outcome in peer] == [("raised", "CommunicationError")] * 4


def calls_after_the_group_is_gone() -> List[Any]:
    """A communicator that kept what its calls use on the default group, after that group is destroyed and
    collected: calls see no group (a group of one), as they did before anything was kept."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    comm = objcomm.Communicator()
    got = [comm.all_gather(1), comm._express()]  # a group of one: no express path
    assert comm._held is not None
    dist.destroy_process_group()
    gc.collect()
    got += [comm.all_gather(2), comm.broadcast(3)]
    return got


def test_what_a_communicator_keeps_goes_with_its_group():
    assert run_in_child(calls_after_the_group_is_gone, timeout=60, preload=("torch",)) == [[1], None, [2], 3]


def fresh_communicators_per_call() -> List[Any]:
    """objcomm.send(..., group=G) makes a Communicator per call: communicators made alike share what the group's
    calls without per-call options worked out (Resolving._hold), their express path among it, and with it the group's
    own map of global ranks (once two dicts of W entries a call: ~1 ms a send at 8192 ranks)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    objcomm.Communicator(group).connect()
    first, second = (objcomm.Communicator(group)._express() for _ in range(2))
    shared = first is second and first.index == {0: 0, 1: 1}
    got = []
    for i in range(3):
        if rank == 0:
            objcomm.send(("x", i), 1, group=group)
            objcomm.send(("self", i), 0, group=group)  # its own rank: the general path (a message to itself)
            got.append(objcomm.recv(0, group=group))
        else:
            got.append(objcomm.recv(0, group=group))
    return [shared, got]


def test_a_communicator_made_per_call_shares_its_groups_map_of_ranks():
    sender, receiver = get_pool(2).run(fresh_communicators_per_call)
    assert sender == [True, [("self", 0), ("self", 1), ("self", 2)]]
    assert receiver == [True, [("x", 0), ("x", 1), ("x", 2)]]


def module_calls_on_a_group() -> List[Any]:
    """objcomm.all_gather(..., group=G) and objcomm.broadcast(..., group=G), a Communicator made for each call: after
    the group's first two collectives every call takes the express path (it took the general one every call, ~75 µs a
    small all_gather where a kept communicator took ~25); configure() still applies to the next call; a communicator
    given its own settings shares nothing with them; and the group goes when the program drops it."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    got: List[Any] = []
    for i in range(2):  # the group's first collectives: the channel opens, then the express path is built
        got.append(objcomm.all_gather((rank, i), group=group))
    with counting(COLLECTIVE_ROUTES) as counts:
        for i in range(3):
            got.append(objcomm.all_gather((rank, i), group=group))
            got.append(objcomm.broadcast((rank, i), src=1, group=group))
    with counting(COLLECTIVE_ROUTES) as device_given:  # a device equal each call, never the same object
        for i in range(3):
            box = [("b", i) if rank == 0 else None]
            objcomm.compat.broadcast_object_list(box, src=0, group=group, device=torch.device("cpu"))
            got.append(box[0])
    got.append(counts)
    got.append(device_given)
    previous = objcomm.configure(serializer="json")  # a tuple comes back a list: the next call used it
    try:
        got.append(objcomm.all_gather((rank,), group=group))
    finally:
        objcomm.restore(previous)
    got.append(objcomm.all_gather((rank,), group=group))
    own = objcomm.Communicator(group, serializer="json")  # given settings of its own: nothing shared with the others
    got.append((own.all_gather((rank,)), own._held is not objcomm.Communicator(group)._held))
    kept = weakref.ref(group)
    dist.destroy_process_group(group)
    del group, own
    gc.collect()
    got.append(kept() is None)  # what the communicators made alike share keeps no reference to it
    return got


def test_module_level_calls_on_a_group_share_its_express_path():
    for rank, got in enumerate(get_pool(2).run(module_calls_on_a_group)):
        assert got[:8] == [
            [(0, 0), (1, 0)],
            [(0, 1), (1, 1)],
            [(0, 0), (1, 0)],
            (1, 0),
            [(0, 1), (1, 1)],
            (1, 1),
            [(0, 2), (1, 2)],
            (1, 2),
        ], rank
        assert got[8:11] == [("b", 0), ("b", 1), ("b", 2)], rank
        assert got[11] == {"general": 0, "rest": 0}, rank  # the express path, every call
        assert got[12]["general"] <= 1, rank  # (the first call with that device on the group may build it)
        assert got[13:] == [[[0], [1]], [(0,), (1,)], ([[0], [1]], True), True], rank


# -- all_gather and broadcast --------------------------------------------------------------------------------


COLLECTIVE_ROUTES = {  # the general path's collectives, and its steps after slots the express path moved
    "general": [(_rounds, "all_gather"), (_broadcast, "broadcast")],
    "rest": [(_express, "all_gather_rest"), (_express, "broadcast_rest")],
}


def _summary(value: Any) -> Any:
    """What a case's result is compared by: lengths of bytes, tensors as lists."""
    if isinstance(value, list):
        return [_summary(v) for v in value]
    if isinstance(value, dict):
        return {k: _summary(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return ("bytes", len(value))
    return value.tolist() if isinstance(value, torch.Tensor) else value


def collective_routes_and_outcomes() -> List[Any]:
    """Each case twice: with the communicator's defaults (the express path where it applies) and with a
    per-call option (the general path); per rank, ``(label, express outcome, counts, general outcome)``."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(local=True)
    comm.all_gather(None)  # opens the channel and lets send/recv in
    assert comm._held is not None
    got: List[Any] = [comm._held.express is _resolving._NEXT]  # one collective: the express path is not built yet
    big, limit = b"y" * 10_000, comm._call({}).options.max_bytes
    refusing, packing = (
        objcomm.Communicator(accept=["msgpack"], local=True),
        objcomm.Communicator(serializer="msgpack", local=True),
    )
    for other in (refusing, packing):
        _outcome(lambda c=other: c.all_gather(None))  # their first collective: the next builds the express path
    cases = [  # (label, what a call does with the options it is given)
        ("small", lambda **o: comm.all_gather({"r": rank}, **o)),
        ("one past the slot", lambda **o: comm.all_gather(big if rank == 1 else rank, **o)),
        ("one with a tensor", lambda **o: comm.all_gather({"t": torch.arange(rank + 1)} if rank == 2 else rank, **o)),
        ("one fails to encode", lambda **o: comm.all_gather((lambda: 0) if rank == 0 else rank, **o)),
        ("refused by accept", lambda **o: refusing.all_gather(rank, **o)),
        ("msgpack", lambda **o: packing.all_gather([rank], **o)),
        ("broadcast small", lambda **o: comm.broadcast({"from": rank}, src=1, **o)),
        ("broadcast past the slot", lambda **o: comm.broadcast(big, src=1, **o)),
        ("broadcast a tensor", lambda **o: comm.broadcast({"t": torch.arange(rank + 2)}, src=2, **o)),
        ("broadcast fails to encode", lambda **o: comm.broadcast(lambda: 0, src=0, **o)),
        ("broadcast refused by accept", lambda **o: refusing.broadcast(rank, src=0, **o)),
        ("src outside", lambda **o: comm.broadcast(1, src=99, **o)),
        ("src True", lambda **o: comm.broadcast(1, src=True, **o)),
        ("after them", lambda **o: comm.all_gather(f"r{rank}", **o)),
    ]
    for label, call in cases:
        with counting(COLLECTIVE_ROUTES) as counts:
            express = _outcome(lambda c=call: _summary(c()))
        got.append((label, express, counts, _outcome(lambda c=call: _summary(c(max_bytes=limit)))))
    return got


def test_all_gather_and_broadcast_take_the_express_path_with_the_general_paths_outcomes():
    per_rank = get_pool(3).run(collective_routes_and_outcomes)
    for rank, got in enumerate(per_rank):
        assert got[0] is True
        cases = {label: (express, counts) for label, express, counts, general in got[1:]}
        for label, express, _, general in got[1:]:
            assert express == general, (rank, label)  # the same outcome as the general path's
        none, general_only = {"general": 0, "rest": 0}, {"general": 1, "rest": 0}
        mine_general = {"general": 1, "rest": 0}
        assert cases["small"] == (("ok", [{"r": 0}, {"r": 1}, {"r": 2}]), none)
        assert cases["one past the slot"][0] == ("ok", [0, ("bytes", 10_000), 2])
        assert cases["one past the slot"][1] == (mine_general if rank == 1 else {"general": 0, "rest": 1})
        assert cases["one with a tensor"][0] == ("ok", [0, 1, {"t": [0, 1, 2]}])
        assert cases["one with a tensor"][1] == (mine_general if rank == 2 else {"general": 0, "rest": 1})
        assert cases["one fails to encode"][0][0] == "raised"
        assert cases["one fails to encode"][1] == (mine_general if rank == 0 else {"general": 0, "rest": 1})
        assert cases["refused by accept"] == (("raised", "ContentRefusedError"), none)
        assert cases["msgpack"] == (("ok", [[0], [1], [2]]), none)
        assert cases["broadcast small"] == (("ok", {"from": 1}), none)
        assert cases["broadcast past the slot"][0] == ("ok", ("bytes", 10_000))
        assert cases["broadcast past the slot"][1] == (general_only if rank == 1 else {"general": 0, "rest": 1})
        assert cases["broadcast a tensor"][0] == ("ok", {"t": [0, 1, 2, 3]})
        assert cases["broadcast a tensor"][1] == (general_only if rank == 2 else {"general": 0, "rest": 1})
        assert cases["broadcast fails to encode"][0] == ("raised", "RemoteError")  # on every rank, the root too
        assert cases["broadcast refused by accept"] == (("raised", "ContentRefusedError"), none)
        assert cases["src outside"] == (("raised", "ValueError"), none)
        assert cases["src True"] == (("raised", "TypeError"), none)
        assert cases["after them"] == (("ok", ["r0", "r1", "r2"]), none)


def hostile_collective_slots() -> List[Any]:
    """Rank 1 writes slots straight into a subgroup's channel, as a broadcast's root and as its part of an
    all_gather; rank 0 takes each through the express path and through the general path."""
    rank = dist.get_rank()
    good = bytes(_general_slot({"ok": 1}, "pickle"))
    length = PREFIX.unpack_from(good, 0)[0]
    cases = {
        "good": good,
        "bad magic": good[: PREFIX.size] + b"XXXX" + good[PREFIX.size + 4 :],
        "frame shorter than its header says": PREFIX.pack(length - 3, LIMIT, length - 3) + good[PREFIX.size :],
        "error report that is not one": PREFIX.pack(length | ERROR_BIT, LIMIT, length) + good[PREFIX.size :],
        "trimmed, shorter than a header": PREFIX.pack(10, LIMIT, 10) + b"x" * 10,
        "short slot": good[:100],  # neither a slot nor a trimmed one: the channel fails
    }
    got: List[Any] = []
    for label, raw in cases.items():
        for op in ("broadcast", "all_gather"):
            outcomes = []
            for options in ({}, {"max_bytes": LIMIT}):  # the express path, then the general path
                sub = dist.new_group([0, 1])
                comm = objcomm.Communicator(sub, local=True)
                comm.all_gather(None)
                comm.all_gather(None)  # the second collective: the express path is built from now on
                channel: _channel.LocalChannel = _state.group_facts(sub).local[False].channel
                assert channel.p2p and comm._express(now=False) is not None
                if rank == 1:  # (its messages carry the word of the call rank 0 makes, as an honest peer's do)
                    call_words.enter(op, 1 if op == "broadcast" else None)
                    _outcome(lambda c=channel, r=raw, o=op: c.broadcast(r, 1) if o == "broadcast" else c.all_gather(r))
                elif op == "broadcast":
                    outcomes.append(_outcome(lambda c=comm, o=options: c.broadcast(None, src=1, **o), message=True))
                else:
                    outcomes.append(_outcome(lambda c=comm, o=options: c.all_gather("mine", **o), message=True))
                dist.destroy_process_group(sub)
            got.append((label, op, *outcomes))
    return got


def test_hostile_slots_through_the_express_collectives_raise_as_on_the_general_path():
    receiver, _ = get_pool(2).run(hostile_collective_slots)
    got = {(label, op): (express, general) for label, op, express, general in receiver}
    for (label, op), (express, general) in got.items():
        assert express[:2] == general[:2], (label, op)
    assert got["good", "broadcast"][0] == ("ok", {"ok": 1})
    assert got["good", "all_gather"][0] == ("ok", ["mine", {"ok": 1}])
    assert got["bad magic", "broadcast"][0][:2] == ("raised", "FrameError")
    assert got["short slot", "all_gather"][0][1] == "CommunicationError"


# -- the receiver's shortcut for its own serializer's plain frames ----------------------------------------------


def _mutations(slot: bytes) -> List[bytes]:
    """``slot`` with each byte of its prefix, header and name set to values that matter, and cut short."""
    out = [slot]
    head = _plain_slot._SLOT_HEADER.size + 8
    for at in range(min(head, len(slot))):
        for value in (0, 1, 2, 0x7F, 0xFF, slot[at] ^ 1):
            changed = bytearray(slot)
            changed[at] = value
            out.append(bytes(changed))
    out += [
        slot[:n]
        for n in (0, 1, PREFIX.size, _plain_slot._SLOT_HEADER.size - 1, _plain_slot._SLOT_HEADER.size, len(slot) - 1)
    ]
    return out


def test_the_payload_shortcut_given_the_slot_size_takes_exactly_the_slots_the_channel_takes():
    """``plain_named(raw, size)``: a plain frame in a slot of ``size`` bytes or in one trimmed after its frame (as
    the channel's check, ``trimmed``, takes them), never in a message shorter or longer than that."""
    slots = []
    for obj in OBJECTS[:5]:
        raw = bytes(_express_slot(obj, "pickle"))
        cut = raw[: PREFIX.size + PREFIX.unpack_from(raw)[0]]
        slots += [raw, raw + b"\0", raw[:-1], cut + b"\0" * 3, *_mutations(cut)]
    slots.append(_plain_slot.small_slot(b"pickle", pickle.dumps(b"x" * SLOT), 2 * SLOT, LIMIT))  # a frame past SLOT
    taken = {True: 0, False: 0}
    for raw in slots:
        size = SLOT
        slot_or_trimmed = len(raw) == size or _channel_checks.trimmed(raw, size)
        expected = _plain_slot.plain_named(raw) if slot_or_trimmed else None
        assert _plain_slot.plain_named(raw, size) == expected, raw[:80]
        taken[len(raw) == size] += expected is not None
    assert taken[True] >= 5 and taken[False] >= 5  # whole slots and trimmed ones


@pytest.mark.parametrize("name", ["pickle", "msgpack", "restricted-pickle"])
def test_the_payload_shortcut_accepts_exactly_the_plain_frames_of_its_serializer(name):
    slots = []
    for sender in ("pickle", "msgpack", "json", "restricted-pickle"):
        for obj in OBJECTS[:5]:
            raw = _express_slot(obj, sender) if sender != "json" or not isinstance(obj, bytes) else None
            if raw is not None:
                slots += _mutations(bytes(raw[: PREFIX.size + PREFIX.unpack_from(raw)[0]]))  # trimmed, as sent
                slots.append(bytes(raw))  # and whole
    taken = 0
    for raw in slots:
        named = _plain_slot.plain_named(raw)
        payload = named[1] if named is not None and named[0] == name.encode("ascii") else None
        plain = _plain_slot.plain_in_slot(raw)
        assert (payload is not None) == (plain is not None and plain[1].serializer == name), raw[:80]
        if payload is None:
            continue
        taken += 1
        frame, header = plain
        assert bytes(payload) == bytes(frame[header.payload_offset : header.payload_offset + header.payload_len])
        general = _frame.parse_header(read_slot(memoryview(raw)).inline)  # what the general path reads of it
        assert (general.serializer, general.payload_len, general.n_tensors, general.flags) == (name, len(payload), 0, 0)
    assert taken >= 5
