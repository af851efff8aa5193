"""The msgspec backend: typed decoding validates while it decodes; arrays and tensors go out of band; hostile
payloads are refused within bounds. The suite every built-in runs (round trips, garbage, fuzzing, fidelity) takes
it too: tests/serializing/test_serializers.py, tests/test_fuzz.py, tests/serializing/test_fidelity.py."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import List, TypedDict

import msgspec
import numpy as np
import pytest
import torch
import torch.distributed as dist

import objcomm
import serializers
from objcomm._format import frame as _frame
from objcomm._format.message import Incoming
from serializers import DecodeError, EncodeError, MsgspecSerializer, UnknownSerializerError
from tests._child import run_in_child

pytestmark = pytest.mark.timeout(120)

BIG = 100_000


class Record(msgspec.Struct):
    id: int
    score: float
    tags: tuple


@dataclasses.dataclass
class Point:
    x: int
    y: int


class Row(TypedDict):
    name: str
    value: float


def test_typed_decoding_gives_the_type_back_and_validates_while_it_decodes():
    records = MsgspecSerializer(List[Record], name="records")
    sent = [Record(1, 0.5, ("a", "b")), Record(2, 1.5, ())]
    assert records.loads(records.dumps(sent)) == sent  # tuples come back as the type says
    untyped = serializers.get("msgspec")
    with pytest.raises(
        DecodeError,
        match=r"records could not decode the payload: Expected `int`, got `str` - at "
        r"`\$\[1\]\.id`",
    ):
        records.loads(untyped.dumps([{"id": 1, "score": 0.5, "tags": []}, {"id": "2", "score": 1.0, "tags": []}]))
    points = MsgspecSerializer(List[Point], name="points")
    assert points.loads(points.dumps([Point(1, 2)])) == [Point(1, 2)]
    rows = MsgspecSerializer(List[Row], name="rows")
    assert rows.loads(rows.dumps([{"name": "a", "value": 1.0}])) == [{"name": "a", "value": 1.0}]
    with pytest.raises(DecodeError, match="missing required field `value`"):
        rows.loads(untyped.dumps([{"name": "a"}]))


def test_untyped_conversions_are_what_the_docs_say():
    s = serializers.get("msgspec")
    back = s.loads(
        s.dumps(
            {
                "t": (1, 2),
                "s": {3},
                "d": dt.date(2024, 1, 2),
                "c": 1 - 2j,
                "k": {(1, 2): 3},
                "np": np.float32(1.5),
                "a": np.arange(3, dtype=np.int16),
            }
        )
    )
    assert back["t"] == [1, 2] and back["s"] == [3] and back["d"] == "2024-01-02" and back["c"] == 1 - 2j
    assert back["k"] == {(1, 2): 3}
    assert type(back["np"]) is np.float32 and back["a"].dtype == np.int16 and back["a"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("name", ["msgspec", "msgpack"])
def test_structured_arrays_are_refused_not_sent_without_their_field_names(name):
    """``dtype.str`` of a structured dtype is ``|V12``: written that way, the receiver would get bare bytes where
    the sender had records (found when ``auto`` began to send arrays through msgspec). Both MessagePack backends
    refuse them, small and large, and say what to use."""
    s = serializers.registry.guarded(name)
    records = np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")])
    for value in (records, records[0], np.zeros(10_000, dtype=records.dtype)):
        with pytest.raises(EncodeError, match="structured numpy .* field names would be lost; use pickle"):
            _frame.encode({"x": value}, s, max_bytes=1 << 30)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("name", ["msgspec", "msgpack"])
def test_ndarray_subclasses_are_refused_but_a_memmaps_data_travels(name, tmp_path):
    """A compat review's find: np.matrix arrived as a plain ndarray (whose ``*`` is no longer a matrix product),
    small or large. A memmap, and its slices, arrive as arrays of their data."""
    s = serializers.registry.guarded(name)
    for value in (np.matrix([[1, 2]]), np.matrix(np.ones((100, 1000)))):
        with pytest.raises(EncodeError, match="numpy.matrix, a subclass of ndarray: .* send np.asarray"):
            _frame.encode({"x": value}, s, max_bytes=1 << 30)
    mapped = np.memmap(tmp_path / "m", dtype="<f4", mode="w+", shape=(8,))
    mapped[:] = np.arange(8)
    back = s.loads(s.dumps({"m": mapped[2:5]}))
    assert type(back["m"]) is np.ndarray and back["m"].tolist() == [2.0, 3.0, 4.0]


def test_codecs_and_their_errors():
    s = serializers.get("msgspec")
    codec = serializers.register_type(
        dt.timezone,
        lambda z: z.utcoffset(None).total_seconds(),
        lambda x: dt.timezone(dt.timedelta(seconds=x)),
        validate=float,
    )
    try:
        assert s.loads(s.dumps({"z": [dt.timezone.utc]})) == {"z": [dt.timezone.utc]}
    finally:
        serializers.unregister_type(dt.timezone)
    with pytest.raises(DecodeError, match=f"registered type {codec.name!r}, but no codec of that name"):
        s.loads(msgspec.msgpack.encode(msgspec.msgpack.Ext(13, msgspec.msgpack.encode([codec.name, 0.0]))))
    with pytest.raises(EncodeError, match=r"msgspec cannot encode object at \$\['x'\]\[0\]"):
        s.dumps({"x": [object()]})
    with pytest.raises(EncodeError, match=r"msgspec cannot encode int at \$\[1\]"):
        s.dumps([1, 2**70])


def test_an_uninstalled_optional_serializer_says_how_to_install_it():
    registry = serializers.SerializerRegistry()
    with pytest.raises(UnknownSerializerError, match=r"pip install msgspec"):
        registry.get("msgspec")


def test_large_arrays_and_tensors_leave_the_byte_stream():
    chosen = serializers.registry.guarded("msgspec")
    sent = {"big": np.arange(BIG, dtype=np.float64), "t": torch.arange(BIG), "small": np.arange(4), "n": [1, "x"]}
    out = _frame.encode(sent, chosen, max_bytes=1 << 30)
    assert sorted(t.numel() for t in out.tensors) == sorted([BIG * 8, BIG * 8])  # the small one stays in band
    assert out.frame.nbytes < 1000
    got = _frame.decode(Incoming(out.frame, list(out.tensors)), sender=0, accept=frozenset({"msgspec"}))
    assert np.array_equal(got["big"], sent["big"]) and torch.equal(got["t"], sent["t"])
    assert got["small"].tolist() == [0, 1, 2, 3] and got["n"] == [1, "x"]


def through_a_group() -> list:
    rank = dist.get_rank()
    serializers.register(MsgspecSerializer(List[Record], name="records"), replace=True)
    mine = [Record(rank, rank / 2, ("r", str(rank)))]
    got = objcomm.all_gather(mine, serializer="records", accept=["records"])
    tensors = objcomm.broadcast(
        {"w": torch.full((BIG,), 7.0), "meta": {"step": 3}} if rank == 0 else None,
        src=0,
        serializer="msgspec",
        accept=["msgspec"],
    )
    try:  # a receiver decoding "records" refuses a payload that is not a list of records, before building it
        objcomm.broadcast([{"id": "zero"}] if rank == 0 else None, src=0, serializer="records")
        refused = "no error"
    except objcomm.ObjcommError as exc:
        refused = f"{type(exc).__name__}: {exc}"
    return [[r[0].tags for r in got], tensors["w"].sum().item(), tensors["meta"], refused]


def test_msgspec_through_a_real_group(ranks):
    results = ranks.run(through_a_group)
    world = len(results)
    for rank_result in results:
        assert rank_result[:3] == [[("r", str(r)) for r in range(world)], 7.0 * BIG, {"step": 3}]
    for rank_result in results:  # every rank raises alike (the root decodes its own copy under the same rules)
        assert rank_result[3] == (
            "DecodeError: could not decode the 'records' payload from rank 0: records could not "
            "decode the payload: Expected `int`, got `str` - at `$[0].id`"
        )


def _decode_all(payloads: dict) -> dict:
    """In a child: each hostile payload's outcome through the untyped and a typed msgspec serializer."""
    import serializers
    from serializers import MsgspecSerializer

    outcomes = {}
    for s in (serializers.get("msgspec"), MsgspecSerializer(List[Record], name="records")):
        for label, data in payloads.items():
            try:
                s.loads(data)
                outcomes[f"{s.name}: {label}"] = "decoded"
            except serializers.ObjcommError as exc:
                outcomes[f"{s.name}: {label}"] = type(exc).__name__
    return outcomes


def test_hostile_payloads_are_refused_within_memory_bounds():
    ext, enc = msgspec.msgpack.Ext, msgspec.msgpack.encode
    nest = enc([1])
    for _ in range(40):
        nest = enc(ext(13, enc(["x", ext(13, nest)])))
    payloads = {
        "array header of 2**32-1 items": b"\xdd\xff\xff\xff\xff",
        "map header of 2**32-1 pairs": b"\xdf\xff\xff\xff\xff",
        "nested headers": b"\xdd\x00\x10\x00\x00" * 1000,
        "200k nested arrays": b"\x91" * 200_000 + b"\x00",
        "unknown extension": enc(ext(99, b"")),
        "object dtype": enc(ext(8, enc(["|O", [1], b"\x41" * 8]))),
        "huge shape": enc(ext(8, enc(["<f8", [2**40], b""]))),
        "short data": enc(ext(8, enc(["<f8", [4], b"x" * 8]))),
        "fields of the wrong type": enc(ext(8, enc([1, "x", b""]))),
        "scalar object dtype": enc(ext(9, enc(["|O", b"\x41" * 8]))),
        "out-of-band key without a table": enc(ext(12, enc(0))),
        "codecs nested 40 deep": nest,
        "truncated": enc({"a": list(range(100))})[:-5],
    }
    outcomes = run_in_child(_decode_all, payloads, memory_budget=64 << 20)
    assert set(outcomes.values()) == {"DecodeError"}, outcomes


def _bytes_per_input_byte(decoder: str, payload: bytes) -> float:
    """In a child: the peak memory tracemalloc sees while ``decoder`` decodes ``payload``, per input byte."""
    import tracemalloc
    from typing import List

    import msgspec

    class WithDefaults(msgspec.Struct):
        a: List[int] = []
        b: List[int] = []
        c: List[int] = []
        d: List[int] = []
        e: List[int] = []
        f: List[int] = []
        g: List[int] = []
        h: List[int] = []

    s = serializers.get("msgspec") if decoder == "untyped" else MsgspecSerializer(List[WithDefaults], name="typed")
    tracemalloc.start()
    s.loads(payload)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / len(payload)


def test_untyped_decoding_stays_within_the_documented_bound_and_a_typed_one_is_what_its_type_makes_it():
    count = 1 << 17
    empty_maps = b"\xdd" + count.to_bytes(4, "big") + b"\x80" * count  # a list of 131,072 empty maps: 1 byte each
    untyped = run_in_child(_bytes_per_input_byte, "untyped", empty_maps, memory_budget=512 << 20)
    typed = run_in_child(_bytes_per_input_byte, "typed", empty_maps, memory_budget=512 << 20)
    assert untyped <= 256, untyped  # docs/security.md: at most about 256 bytes per input byte (measured ~73)
    assert typed > 256, typed  # the exception docs/security.md states: eight list defaults built per instance
