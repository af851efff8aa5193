"""serializer="auto": the fastest candidate that carries the object exactly, judged, cached per type signature."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import zoneinfo
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.distributed as dist

import objcomm
import serializers
from objcomm._format import frame as _frame
from objcomm._format.message import Incoming
from serializers import AutoSerializer, EncodeError
from serializers._auto import signature
from serializers._exact_tree import carried_exactly
from serializers._fidelity import PROBES, judge

pytestmark = pytest.mark.timeout(120)


@dataclasses.dataclass
class Point:
    x: int
    y: int


class Opaque:
    """No codec, no allow-list entry: only the unsafe pickles carry it."""


def _frame_name(obj, chooser):
    out = _frame.encode(obj, chooser, max_bytes=1 << 30)
    return _frame.parse_header(out.frame).serializer, out


@pytest.mark.parametrize("label, make", PROBES, ids=[label for label, _ in PROBES])
def test_auto_never_changes_a_probe_value(label, make):
    for chooser in (serializers.registry.guarded("auto"), AutoSerializer(safe=True)):
        value = make()
        try:
            name, out = _frame_name(value, chooser)
        except EncodeError:
            assert chooser.safe and label in ("lambda", "class instance"), label  # none safe carries these exactly
            continue
        got = _frame.decode(Incoming(out.frame, list(out.tensors)), sender=0, accept=None)
        assert judge(value, got)[0] == "exact", (label, name)


def test_the_choice_is_the_fastest_exact_candidate_and_the_frame_names_it():
    auto = AutoSerializer()
    assert auto.choose({"loss": 0.25, "ids": [1, 2]}) == "msgspec"  # JSON-like: msgspec, exact for it
    assert auto.choose({"loss": 0.25, "ids": (1, 2)}) == "pickle"  # msgspec would send the tuple as a list
    assert auto.choose({"f": lambda x: x}) == "cloudpickle"  # pickle refuses a lambda
    safe = AutoSerializer(safe=True)
    assert safe.choose({"loss": 0.25, (1, 2): {3}}) == "restricted-pickle"
    name, _ = _frame_name({"f": lambda x: x}, serializers.registry.guarded("auto"))
    assert name == "cloudpickle"


needs_exact_tree = pytest.mark.skipif(carried_exactly is None, reason="serializers._exact_tree_c was not built here")


@needs_exact_tree
def test_msgspec_leads_where_the_object_holds_only_what_it_carries_exactly():
    """``exact_leader``: JSON-like data, tensors and arrays past 4 KiB go to msgspec unjudged; anything msgspec
    would change (a tuple, a structured array, a container met twice, a subclass) to pickle; a string msgspec
    refuses to encode (a lone surrogate) falls through to pickle as well. Each payload decodes back exactly."""
    auto, safe = serializers.registry.guarded("auto"), AutoSerializer(safe=True)
    rows = [{"id": i, "score": i / 3, "tags": ["a", "b"], "blob": b"x"} for i in range(50)]
    shared = [1, 2]
    cases = [
        ({"rows": rows, "step": 3, -1: None}, "msgspec", "msgspec"),
        ({"embeddings": np.ones((300, 4), np.float32), "t": torch.arange(70_000), "step": 1}, "msgspec", "msgspec"),
        ({"small": np.ones(3)}, "pickle", "restricted-pickle"),  # msgspec reads small arrays slower than pickle
        ({"kernel": (3, 3)}, "pickle", "restricted-pickle"),
        ({"records": np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")])}, "pickle", "restricted-pickle"),
        ({"a": shared, "b": shared}, "pickle", "restricted-pickle"),
        ({"level": Color.RED}, "pickle", None),  # restricted-pickle allows no enum; msgspec would send an int
        (["ok", "lone \udc80 surrogate"], "pickle", "restricted-pickle"),
    ]
    for obj, unsafe_name, safe_name in cases:
        for chooser, expected in ((auto, unsafe_name), (safe, safe_name)):
            if expected is None:
                with pytest.raises(EncodeError, match="found no serializer that carries"):
                    _frame_name(obj, chooser)
                continue
            name, out = _frame_name(obj, chooser)
            assert name == expected, (obj, chooser.safe, name)
            got = _frame.decode(Incoming(out.frame, list(out.tensors)), sender=0, accept=None)
            assert judge(obj, got)[0] == "exact", (obj, name)
    got = _frame.decode(Incoming(*_encoded({"a": shared, "b": shared}, auto)), sender=0, accept=None)
    assert got["a"] is got["b"]  # one list, as sent
    only_json = AutoSerializer(accept=frozenset({"json"}))
    assert only_json.choose({"rows": [{"id": 1, "tags": ["a"]}]}) == "json"  # msgspec leads only where it may be used
    builtin = serializers.get("msgspec")
    serializers.register(serializers.MsgspecSerializer(list[int], name="msgspec"), replace=True)
    try:  # a "msgspec" that decodes into a type would refuse what the lane sends: not the lane
        assert AutoSerializer().choose({"rows": [1]}) == "pickle"
    finally:
        serializers.register(builtin, replace=True)
    assert AutoSerializer().choose({"rows": [1]}) == "msgspec"


@needs_exact_tree
def test_what_msgspec_would_write_twice_or_read_differently_goes_to_pickle():
    """An attacker round on the msgspec lane: a long string met twice, arrays objcomm does not lift (written in
    msgspec's payload each time they are met, and '<U1' data msgspec's reader refuses) go to pickle, which keeps
    them once; a refusal by msgspec costs no walk to say where (pickle follows)."""
    from serializers import _path

    auto = serializers.registry.guarded("auto")
    text = "x" * 100_000
    name, out = _frame_name([text] * 1000, auto)
    assert name == "pickle" and out.total < 200_000  # msgspec wrote 100 MB
    same = np.zeros(2000, dtype="<U5")
    code_points = np.full(2000, 0x110000, dtype="<u4").view("<U1")  # past U+10FFFF: msgspec's reader refuses it
    for obj in ([same, same], [np.zeros(10_000, ">f8")] * 3, {"x": code_points}):
        name, out = _frame_name(obj, auto)
        got = _frame.decode(Incoming(out.frame, list(out.tensors)), sender=0, accept=None)
        assert name == "pickle" and judge(obj, got)[0] == "exact", obj
    walks = []
    original = _path.locate  # (what a refusal's message walks the object with)
    _path.locate = lambda *a, **k: walks.append(1) or original(*a, **k)
    try:
        lone = b"/data/caf\xe9.txt".decode("utf-8", "surrogateescape")  # what os.fsdecode gives
        assert _frame_name({"paths": ["/data/a.txt"] * 10 + [lone]}, auto)[0] == "pickle"
        assert walks == []
        with pytest.raises(EncodeError, match=r"at \$\['paths'\]\[10\]"):  # named, it still says where
            _frame.encode(
                {"paths": ["/data/a.txt"] * 10 + [lone]}, serializers.registry.guarded("msgspec"), max_bytes=1 << 30
            )
    finally:
        _path.locate = original


def _encoded(obj, chooser):
    out = _frame.encode(obj, chooser, max_bytes=1 << 30)
    return out.frame, list(out.tensors)


def test_a_converting_candidate_is_used_only_when_the_judge_finds_the_object_exact():
    only_json = AutoSerializer(accept=frozenset({"json", "msgpack"}))
    assert only_json.choose({"a": [1, "x"]}) == "json"
    assert only_json.choose({"a": (1, "x")}) == "msgpack"  # json turns the tuple into a list
    with pytest.raises(
        EncodeError,
        match=r"'auto' found no serializer that carries this dict exactly among those it "
        r"may use \(json, msgpack\)",
    ):
        only_json.choose({"a": bytearray(b"x")})  # msgpack gives bytes back; json refuses
    hidden = {"rows": [{"i": i} for i in range(1000)] + [{"i": OrderedDict(a=bytearray(b"x"))}]}
    with pytest.raises(EncodeError):  # deep past the sample: still judged, never converted
        only_json.choose(hidden)


def test_restricted_pickle_is_judged_on_the_first_object_of_each_signature():
    safe = AutoSerializer(safe=True)
    serializers.register_type(Point, dataclasses.astuple, lambda xy: Point(*xy), validate=lambda v: v)
    try:
        # restricted-pickle does not allow Point; msgspec turns the dataclass into a dict; json carries the codec
        assert safe.choose({"p": Point(1, 2)}) == "json"
        assert safe.choose({"p": Point(3, 4)}) == "json"
        assert "restricted-pickle" in safe._refused[signature({"p": Point(3, 4)})]
    finally:
        serializers.unregister_type(Point)
    with pytest.raises(EncodeError, match="'auto' found no serializer"):
        safe.choose({"o": Opaque()})


def test_refusals_are_remembered_per_signature_not_per_value():
    auto = AutoSerializer()
    calls = []
    pickle = serializers.registry.guarded("pickle")
    original = pickle.dumps

    def counting(obj, /, *, lift=None):
        calls.append(1)
        return original(obj, lift=lift)

    pickle.dumps = counting
    try:
        for k in range(5):
            assert auto.choose({"f": lambda x, k=k: x + k}) == "cloudpickle"
    finally:
        del pickle.dumps
    assert len(calls) == 1  # pickle was tried on the first lambda of that signature only


def test_a_dict_the_leader_refused_costs_no_later_dict_its_serializer():
    """Once pickle refused one dict (a lambda in it: cloudpickle took it), later dicts skip it as the leader and go
    through the candidates, where pickle was judged on its signature's first object; the judge cannot compare nested
    tensors, so ``{"v": nested}`` found no serializer at all (seen as a test that failed after another). A leader,
    exact whatever it takes, is never judged."""
    import warnings

    auto = serializers.registry.guarded(AutoSerializer())
    assert _frame.parse_header(_frame.encode({"f": lambda x: x}, auto, max_bytes=1 << 30).frame).serializer == (
        "cloudpickle"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)])
    out = _frame.encode({"v": nested}, auto, max_bytes=1 << 30)
    assert _frame.parse_header(out.frame).serializer == "pickle"
    got = _frame.decode(Incoming(out.frame, list(out.tensors)), sender=0, accept=None)["v"]
    assert all(torch.equal(a, b) for a, b in zip(got.unbind(), nested.unbind()))


def test_signature_reads_a_bounded_sample():
    big = list(range(100_000))
    assert signature(big) == (list, frozenset({list, int}))
    # the values of a dict with str keys only (CPython does not visit such keys; they say nothing anyway)
    assert signature({"a": (1, dt.date(2024, 1, 1))}) == (dict, frozenset({dict, tuple, int, dt.date}))


def test_auto_outside_objcomm_says_what_to_do():
    auto = serializers.get("auto")
    with pytest.raises(EncodeError, match=r"choose\(obj\)"):
        auto.dumps({"a": 1})


def auto_through_a_group() -> list:
    rank = dist.get_rank()
    mine = {"rank": rank, "arr": np.arange(3) + rank, "t": torch.full((70_000,), float(rank)), "span": (rank, 2)}
    got = objcomm.all_gather(mine, serializer="auto")
    fn = objcomm.broadcast((lambda x: x * 10) if rank == 0 else None, src=0, serializer="auto")
    safe = objcomm.all_gather(
        {"r": rank, "tags": {"a", "b"}}, serializer="auto", accept=["msgpack", "restricted-pickle"]
    )
    try:  # a receiver's accept= still rules what it decodes
        objcomm.broadcast(
            {"f": (lambda: 1)} if rank == 0 else None,
            src=0,
            serializer="auto",
            accept=None if rank == 0 else ["msgpack"],
        )
        refused = "no error"
    except objcomm.ObjcommError as exc:
        refused = f"{type(exc).__name__}: {exc}"
    return [
        [g["rank"] for g in got],
        [g["arr"].tolist() for g in got],
        [g["t"][0].item() for g in got],
        [g["span"] for g in got],
        fn(2),
        safe,
        refused,
    ]


def auto_on_the_express_path() -> list:
    """Small objects with a communicator's defaults take the express path (objcomm._api.express): under "auto" too,
    each frame naming the serializer chosen for its object."""
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator(serializer="auto")
    got = [comm.all_gather({"r": rank}) for _ in range(3)]  # the express path is built by the second collective
    comm.send((lambda x, r=rank: x + r) if rank % 2 else {"r": rank}, dst=(rank + 1) % world)
    received = comm.recv(src=(rank - 1) % world)
    express = comm._express()
    return [
        got[-1],
        received(10) if callable(received) else received,
        express is not None,
        sorted(express.decoders) if express is not None else None,
    ]


def test_auto_on_the_express_path(ranks):
    results = ranks.run(auto_on_the_express_path)
    world = len(results)
    for rank, (gathered, received, express, decoders) in enumerate(results):
        sender = (rank - 1) % world
        assert gathered == [{"r": r} for r in range(world)]
        assert received == (10 + sender if sender % 2 else {"r": sender})  # cloudpickle for the lambda
        assert express == (world > 1)
        if express:  # frames of any serializer auto may choose are read as they are, without the general decode
            assert {b"msgspec", b"pickle", b"cloudpickle"} <= set(decoders), decoders


def test_auto_through_a_real_group(ranks):
    results = ranks.run(auto_through_a_group)
    world = len(results)
    for rank, result in enumerate(results):
        assert result[:6] == [
            list(range(world)),
            [[r, r + 1, r + 2] for r in range(world)],
            [float(r) for r in range(world)],
            [(r, 2) for r in range(world)],
            20,
            [{"r": r, "tags": {"a", "b"}} for r in range(world)],
        ]
        refused = (
            "ContentRefusedError: rank 0 sent a 'cloudpickle' payload, but this rank accepts only ['msgpack']; "
            "add it to accept= if you trust the sender, or send with an accepted serializer"
        )
        assert result[6] == ("no error" if world == 1 or rank == 0 else refused), result[6]


# -- what an attacker found (issue 25/28, second round): the judge checks key types, member types and time zones; it
# costs O(n) whatever the keys; an object whose type cannot be hashed gets an EncodeError --------------------------
class Color(enum.IntEnum):
    RED = 1


class Mode(str, enum.Enum):
    TRAIN = "train"


def test_a_converting_candidate_is_judged_on_key_types_members_and_time_zones():
    only_safe = AutoSerializer(accept=frozenset({"msgspec", "msgpack", "json"}))
    tokyo = dt.datetime(2024, 1, 1, 12, tzinfo=zoneinfo.ZoneInfo("Asia/Tokyo"))
    for obj in ({Color.RED: "x"}, {Mode.TRAIN: 1}, {"when": tokyo}, {"s": {True, 2.5}}):
        try:
            name, out = _frame_name(obj, only_safe)
        except EncodeError:
            continue  # nothing safe carries it exactly: refused, never changed
        got = _frame.decode(Incoming(out.frame, list(out.tensors)), sender=0, accept=None)
        assert judge(obj, got)[0] == "exact" and [type(k) for k in got] == [type(k) for k in obj], (obj, name, got)
        if "when" in obj:
            assert got["when"].tzinfo == tokyo.tzinfo and got["when"].hour == 12, got


def test_judging_costs_what_the_object_holds_not_keys_times_depth():
    key = "k" * (1 << 20)
    deep: dict = {}
    level = deep
    for _ in range(100):  # one 1 MB key, 100 levels deep: paths built at every level once cost 5 GB and 12 s
        level[key] = {}
        level = level[key]
    assert judge(deep, deep) == ("exact", "")
    assert AutoSerializer(accept=frozenset({"msgpack"})).choose(deep) == "msgpack"


class Unhashable(type):
    __eq__ = type.__eq__  # defining __eq__ alone makes the metaclass's instances (classes) unhashable
    __hash__ = None  # type: ignore[assignment]


class Odd(metaclass=Unhashable):
    pass


def test_an_object_auto_cannot_look_at_is_an_encode_error():
    for chooser in (serializers.registry.guarded("auto"), AutoSerializer(safe=True)):
        with pytest.raises(EncodeError):
            _frame_name({"odd": Odd()}, chooser)


def test_a_converting_candidate_must_keep_what_is_shared_and_a_times_fold_and_zone_name():
    """A helper's finds: once step 1 declined an object (a tuple, a codec type), msgspec, msgpack and json were judged
    by value alone, so a list held twice came back as two lists; and the judge's datetime check ignored fold and a
    fixed zone's name, which msgpack drops. Each is now no match for them: another candidate takes the object
    exactly, or none does and the call says so."""
    rows = [1, 2]
    shared = {"a": rows, "b": rows, "t": (1,)}
    for accept in ({"msgspec", "msgpack"}, {"json"}, {"msgpack", "restricted-pickle"}):
        chooser = AutoSerializer(accept=frozenset(accept))
        try:
            name, out = _frame_name(shared, chooser)
        except EncodeError:
            assert "restricted-pickle" not in accept, accept  # nothing listed keeps the list shared: refused
            continue
        got = _frame.decode(Incoming(out.frame, list(out.tensors)), sender=0, accept=None)
        assert name == "restricted-pickle" and got["a"] is got["b"], (accept, name)
    array = np.arange(4)
    with pytest.raises(EncodeError):
        AutoSerializer(accept=frozenset({"msgspec", "msgpack"})).choose({"a": array, "b": array, "t": (1,)})
    folded = dt.datetime(2024, 11, 3, 1, 30, fold=1)
    named = dt.datetime(2024, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=2), "CEST"))
    assert judge(folded, folded.replace(fold=0))[0] != "exact"
    assert judge(named, named.replace(tzinfo=dt.timezone(dt.timedelta(hours=2))))[0] != "exact"
    for value in ((folded,), (named,)):
        with pytest.raises(EncodeError):
            AutoSerializer(accept=frozenset({"msgpack"})).choose(value)
        assert AutoSerializer(accept=frozenset({"msgpack", "restricted-pickle"})).choose(value) == "restricted-pickle"
