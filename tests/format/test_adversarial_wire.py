"""Senders that lie on the wire: receivers check sizes against their own max_bytes before allocating.

Each attack is a scenario on live gloo ranks where rank 1 drives the transport with a forged
``Outgoing`` (a lying total, a forged tensor table, a nested error report) and rank 0 uses the
public API; decoding that could crash runs in a child process. Peak memory of a rank is its
VmHWM after resetting it (``/proc/self/clear_refs``), so earlier tests in the worker don't count.
"""

from __future__ import annotations

import pickle
import struct
import tracemalloc
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from _child import run_in_child
from _hostile import FUZZ_SCALE
from _ranks import get_pool
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import objcomm
import serializers
from objcomm import ObjcommError, _settings
from objcomm._api import call as _call
from objcomm._format import compression as _compression
from objcomm._format import frame as _frame
from objcomm._format import slot as _slot
from objcomm._format import tensors as _tensors
from objcomm._samehost.segments import SegmentBook
from objcomm._transport import broadcast as _broadcast
from objcomm._transport import call_words
from objcomm._transport import p2p as _p2p
from objcomm._transport import parts as _parts
from objcomm._transport import rounds as _rounds
from objcomm._transport.rounds import Incoming, Outgoing

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
BIG = 64 * MiB
LIMIT = 1 * MiB
FUZZ = settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Lying(Outgoing):
    """An Outgoing whose slot announces ``claimed`` bytes in total, whatever it really moves."""

    __slots__ = ("claimed",)

    def __init__(self, frame: memoryview, claimed: int) -> None:
        super().__init__(frame)
        self.claimed = claimed

    @property
    def total(self) -> int:  # type: ignore[override]
        return self.claimed


def _wire(**kw) -> _rounds.Wire:
    """The transport as objcomm's defaults set it up, without shared memory (rounds 1 and 2 as a Communicator
    moves them below the shared-memory threshold: the peers here use one, and every rank of a group must move
    them the same way)."""
    settings_ = objcomm.Settings()
    fields = dict(slot=settings_.slot_bytes, chunk=settings_.chunk_bytes, max_bytes=settings_.max_bytes)
    fields.update(kw)
    options = _settings.resolve({"shm": False}, {})
    return _rounds.Wire(
        group=dist.group.WORLD,
        ranks=list(range(dist.get_world_size())),
        rank=dist.get_rank(),
        device=torch.device("cpu"),
        slot_medium=_call.slot_medium_for(options),
        rest_media=_call.rest_media_for(options, SegmentBook()),
        **fields,
    )


def _reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS; return the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _big_frame() -> Outgoing:
    return _frame.encode(b"x" * BIG, serializers.get("pickle"), max_bytes=1 << 40)


def _as_honest(op: str, root: Optional[int] = None) -> None:
    """A liar that drives the transport itself first takes the word of the call its honest peer makes (the word every
    channel message of a collective carries, objcomm._transport.call_words), as the object API would set it."""
    call_words.enter(op, root)


def _still_usable() -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 1:
        objcomm.send({"after": 1}, dst=0)
    elif rank == 0:
        assert objcomm.recv(src=1) == {"after": 1}
    return objcomm.all_gather(rank) == list(range(world))


# -- A: an under-reported total --------------------------------------------------------------------
def under_reported(op: str) -> tuple:
    """Rank 1 moves a 64 MiB frame but announces 100 bytes; rank 0 accepts at most 1 MiB."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(shm=False, max_bytes=LIMIT)
    outcome: object = None
    if rank == 1:
        lie = Lying(_big_frame().frame, claimed=100)
        try:
            if op == "send/recv":
                _p2p.send(_wire(), lie, 0)
            elif op == "all_gather":
                _as_honest("all_gather")
                _rounds.all_gather(_wire(), lie, _frame.tensor_sizes)
            elif op == "all_to_all":
                _as_honest("all_to_all")
                _parts.all_to_all(_wire(), [lie, lie], _frame.tensor_sizes)
            else:
                _as_honest("broadcast", 1)
                _broadcast.broadcast(_wire(), lie, _frame.tensor_sizes, 1)
        except ObjcommError as exc:
            outcome = type(exc).__name__
        return outcome, 0, _still_usable()
    before = _reset_peak()
    try:
        if op == "send/recv":
            outcome = comm.recv(src=1)
        elif op == "all_gather":
            outcome = comm.all_gather("small")
        elif op == "all_to_all":
            outcome = comm.all_to_all(["small", "small"])
        else:
            outcome = comm.broadcast(None, src=1)
        outcome = f"returned {type(outcome).__name__}"
    except ObjcommError as exc:
        outcome = (type(exc).__name__, str(exc)[:300])
    growth = _status("VmHWM") - before
    return outcome, growth, _still_usable()


@pytest.mark.parametrize("op", ["send/recv", "all_gather", "broadcast", "all_to_all"])
def test_under_reported_total_is_refused_before_allocating(op):
    results = get_pool(2).run(under_reported, op, timeout=120)
    (outcome, growth, usable), sender = results[0], results[1]
    assert isinstance(outcome, tuple) and outcome[0] == "FrameError", outcome
    assert "announces in total" in outcome[1], outcome  # the lie itself was seen, not just the size
    assert growth < 16 * MiB, f"the receiver's peak RSS grew by {growth:,} bytes"
    assert usable and sender[2]


# -- A: a tensor table announcing 2**40 bytes ------------------------------------------------------
def _forged_table(nbytes: int) -> Outgoing:
    """A frame carrying one 1,000-byte out-of-band tensor whose table entry announces ``nbytes``."""
    out = _frame.encode(
        {"t": torch.ones(1000, dtype=torch.uint8)}, serializers.get("pickle"), max_bytes=1 << 30, inline_tensor_bytes=0
    )
    frame = bytearray(out.frame)
    header = _frame.parse_header(memoryview(frame))
    entry = _frame.HEADER.size + len(header.serializer)
    struct.pack_into("<Q", frame, entry + 8, nbytes)  # nbytes
    struct.pack_into("<q", frame, entry + _tensors.ENTRY.size, nbytes)  # the one dimension, so the entry agrees
    return Outgoing(memoryview(frame), out.tensors)


def _lying_sender(forged: Outgoing) -> list:
    """Rank 1 sends ``forged`` by all_gather and by send, rank 0 receives: each side's outcome per op."""
    rank = dist.get_rank()
    outcomes = []
    for op in ("all_gather", "send/recv"):
        try:
            if rank == 1 and op == "all_gather":
                _as_honest("all_gather")
                _rounds.all_gather(_wire(), forged, _frame.tensor_sizes)
            elif rank == 1:
                _p2p.send(_wire(), forged, 0)
            elif op == "all_gather":
                objcomm.all_gather("small")
            else:
                objcomm.recv(src=1)
            outcomes.append("no error")
        except ObjcommError as exc:
            outcomes.append(type(exc).__name__)
        except Exception as exc:  # the bugs: a raw RuntimeError from torch.empty(2**40), a RecursionError
            outcomes.append(f"raw {type(exc).__name__}")
        assert _still_usable()
    return outcomes


def huge_table_entry() -> list:
    return _lying_sender(_forged_table(1 << 40))


def test_tensor_table_entry_of_2_to_the_40_is_a_clean_frame_error():
    results = get_pool(2).run(huge_table_entry, timeout=90)
    assert results[0] == ["FrameError", "FrameError"]
    assert results[1] == ["FrameError", "no error"]  # a sender learns only where it takes part in round 1


def huge_table_entry_all_to_all() -> str:
    """The same forged frame as rank 1's part for every rank of an all_to_all."""
    forged = _forged_table(1 << 40)
    try:
        if dist.get_rank() == 1:
            _as_honest("all_to_all")
            _parts.all_to_all(_wire(), [forged, forged], _frame.tensor_sizes)
        else:
            objcomm.all_to_all(["small", "small"])
        outcome = "no error"
    except ObjcommError as exc:
        outcome = type(exc).__name__
    except Exception as exc:
        outcome = f"raw {type(exc).__name__}"
    assert _still_usable()
    return outcome


def test_tensor_table_entry_of_2_to_the_40_in_all_to_all_is_refused_by_every_rank():
    assert get_pool(2).run(huge_table_entry_all_to_all, timeout=90) == ["FrameError", "FrameError"]


# -- C: a refusing receiver never allocates up to chunk_bytes ---------------------------------------
def refuse_large(op: str, chunk: int) -> tuple:
    """Rank 1 honestly sends 100 MB; rank 0 (limit 1 MiB, no shared memory) refuses."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(shm=False, max_bytes=LIMIT if rank == 0 else None, chunk_bytes=chunk)
    payload = b"y" * (100 * 1000 * 1000) if rank == 1 else None
    before = _reset_peak()
    try:
        if op == "send/recv":
            comm.send(payload, dst=0) if rank == 1 else comm.recv(src=1)
        else:
            comm.broadcast(payload, src=1)
        outcome = "ok"
    except objcomm.TooLargeError:
        outcome = "TooLargeError"
    growth = _status("VmHWM") - before
    return outcome, growth, _still_usable()


@pytest.mark.parametrize("chunk", [256 * MiB, MiB], ids=["default-chunk", "1MiB-chunk"])
@pytest.mark.parametrize("op", ["send/recv", "broadcast"])
def test_refusing_receiver_drains_through_a_small_scratch(op, chunk):
    results = get_pool(2).run(refuse_large, op, chunk, timeout=120)
    outcome, growth, usable = results[0]
    assert outcome == "TooLargeError"
    assert growth < 16 * MiB, f"the refusing rank's peak RSS grew by {growth:,} bytes"
    assert usable and results[1][2]


# -- D: a deeply nested error report ---------------------------------------------------------------
def _nested_error(depth: int) -> Outgoing:
    return Outgoing(_frame._assemble("", b"[" * depth, flags=_frame.FLAG_ERROR), error=True)


def nested_error_report() -> list:
    return _lying_sender(_nested_error(4000))


def test_nested_error_report_is_a_frame_error():
    assert get_pool(2).run(nested_error_report, timeout=60)[0] == ["FrameError", "FrameError"]


def _read_error_report(payload: bytes) -> str:
    view = _frame._assemble("", payload, flags=_frame.FLAG_ERROR)
    try:
        return str(_frame.read_error(view, _frame.parse_header(view)))
    except ObjcommError as exc:
        return type(exc).__name__


@pytest.mark.parametrize(
    "payload",
    [
        b"[" * 100_000,
        b"{" * 50_000,
        b'{"type": "A", "message": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
        b'{"type": 1, "message": "m"}',
        b'["type", "message"]',
        b"\xff\xfe",
        b'{"type": "A"}',
    ],
    ids=["list", "dict", "nested-message", "not-a-string", "not-a-dict", "not-utf8", "missing"],
)
def test_malformed_error_reports_in_a_child(payload):
    assert run_in_child(_read_error_report, payload, memory_budget=64 << 20) == "FrameError"


def _under_a_raised_recursion_limit(fn, *args):
    """In the child: ``fn(*args)`` where the program raised Python's recursion limit, as ML code often does."""
    import sys

    sys.setrecursionlimit(1_000_000)
    return fn(*args)


def _decode_outcome(frame: bytes) -> str:
    try:
        _frame.decode(Incoming(memoryview(frame)), sender=1, accept=["msgspec", "msgpack", "json", "restricted-pickle"])
        return "decoded"
    except ObjcommError as exc:
        return type(exc).__name__


def test_deep_input_under_a_raised_recursion_limit_is_refused_not_a_segfault():
    """An attacker's finds: json's and msgspec's C decoders bound nesting by Python's recursion limit, not by their C
    stack; under a limit of 1,000,000 a 200 KB error report of brackets, and a 40 KB msgspec frame of 40,000 nested
    arrays (accepted by a rank that takes only safe serializers), crashed the interpreter. Past a limit of 5,000 the
    nesting is counted first: the report is a FrameError, the payload a DecodeError."""
    pytest.importorskip("msgspec")
    utf16 = ('["\u2241",' + "[" * 200_000).encode("utf-16-le")  # (a reviewer's find: json.loads takes UTF-16 too)
    for text in (b"[" * 200_000, b'["\\n", ' + b"[" * 200_000, utf16):  # (a backslash escapes the byte after it)
        report = run_in_child(_under_a_raised_recursion_limit, _read_error_report, text, memory_budget=64 << 20)
        assert report == "FrameError", text[:10]
    deep = bytes(_frame._assemble("msgspec", b"\x91" * 40_000 + b"\x00"))
    assert (
        run_in_child(_under_a_raised_recursion_limit, _decode_outcome, deep, memory_budget=256 << 20) == "DecodeError"
    )
    shallow = bytes(_frame._assemble("msgspec", b"\x91" * 1000 + b"\x00"))
    assert run_in_child(_under_a_raised_recursion_limit, _decode_outcome, shallow, memory_budget=256 << 20) == "decoded"


def test_an_empty_tensor_whose_other_sizes_overflow_is_refused():
    """A helper's find: an entry of shape (0, 2**61, 2**61) and 0 bytes passed the table's checks (its product is 0),
    and torch built it (numpy refuses such a shape; bfloat16 does not go through numpy); a later reduction over the
    first dimension asked for the product of the others."""
    out = _frame.encode(
        {"t": torch.empty((0, 4, 4), dtype=torch.bfloat16)}, serializers.get("pickle"), max_bytes=1 << 30
    )
    frame = bytearray(out.frame)
    entry = _frame.HEADER.size + len(_frame.parse_header(memoryview(frame)).serializer)
    struct.pack_into("<3q", frame, entry + _tensors.ENTRY.size, 0, 1 << 61, 1 << 61)
    with pytest.raises(objcomm.FrameError, match=r"tensor table entry: shape \(0, 2305843009213693952"):
        _frame.decode(Incoming(memoryview(frame), list(out.tensors)), sender=1, accept=None)


# -- B: decompression capped at raw_len ------------------------------------------------------------
def _compressed_frame(code: int, stored: bytes, raw_len: int) -> bytes:
    return bytes(_frame._assemble("pickle", stored, compression=code, raw_len=raw_len))


def _decode_measured(frame: bytes) -> tuple:
    """Decode in this (child) process; ``(outcome, cause type, traced peak bytes)``."""
    tracemalloc.start()
    cause = None
    try:
        outcome = repr(_frame.decode(Incoming(memoryview(frame)), sender=1, accept=None, max_bytes=LIMIT))
    except ObjcommError as exc:
        outcome, cause = type(exc).__name__, type(exc.__cause__).__name__
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return outcome, cause, peak


def test_zstd_content_size_cannot_override_raw_len():
    zstandard = pytest.importorskip("zstandard")
    stored = zstandard.ZstdCompressor(level=1).compress(b"\0" * (200 << 20))  # states its 200 MB content size
    assert len(stored) < 16 << 10
    outcome, cause, peak = run_in_child(
        _decode_measured, _compressed_frame(_compression.ZSTD, stored, 6000), memory_budget=64 << 20
    )
    assert outcome == "DecodeError" and cause != "MemoryError"
    assert peak < 1 * MiB


def test_zstd_without_content_size_stops_at_raw_len():
    zstandard = pytest.importorskip("zstandard")
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=10, write_content_size=False)
    stored = zstandard.ZstdCompressor(compression_params=params).compress(b"\0" * (50 << 20))
    outcome, cause, peak = run_in_child(
        _decode_measured, _compressed_frame(_compression.ZSTD, stored, 6000), memory_budget=64 << 20
    )
    assert outcome == "DecodeError" and peak < 1 * MiB


@pytest.mark.parametrize("extra", [+1, 200 << 20, -1], ids=["one-longer", "200MB-longer", "shorter"])
def test_lz4_output_must_be_exactly_raw_len(extra):
    lz4_frame = pytest.importorskip("lz4.frame")
    valid = pickle.dumps("hello")
    raw = valid + b"\0" * extra if extra > 0 else valid
    stored = lz4_frame.compress(raw, store_size=True)
    raw_len = len(valid) if extra > 0 else len(valid) + 1  # longer: old code cut it and decoded "hello"
    outcome, cause, peak = run_in_child(
        _decode_measured, _compressed_frame(_compression.LZ4, stored, raw_len), memory_budget=64 << 20
    )
    assert outcome == "DecodeError", outcome
    assert peak < 1 * MiB + 4 * len(stored)  # proportional to the input, never to the 200 MB


# -- fuzz: frames and slots with lying fields ------------------------------------------------------
def _bounded(call, size: int) -> None:
    tracemalloc.start()
    try:
        call()
    except ObjcommError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < (1 << 20) + 64 * size, f"{peak:,} bytes allocated for {size} input bytes"


def _valid_frames() -> list:
    """Frames of the safe serializers, whose decoding is bounded for any input (docs/security.md), and one of
    plain pickle, which runs what its payload says: ``_decode_frame`` refuses it before its payload is read."""
    restricted = serializers.get("restricted-pickle")
    tensors = {"a": torch.arange(6).reshape(2, 3), "b": torch.ones(40, dtype=torch.float16)}
    frames = [
        _frame.encode({"x": [1, 2]}, serializers.get("msgpack"), max_bytes=1 << 20),
        _frame.encode(tensors, restricted, max_bytes=1 << 20),  # inline tensors
        _frame.encode(tensors, restricted, max_bytes=1 << 20, inline_tensor_bytes=0),  # out of band
        _frame.encode(b"z" * 3000, restricted, max_bytes=1 << 20, compression="zstd"),
        _frame.encode(b"z" * 3000, restricted, max_bytes=1 << 20, compression="lz4"),
        _frame.encode(tensors, serializers.get("pickle"), max_bytes=1 << 20, inline_tensor_bytes=0),
    ]
    return [(bytes(f.frame), [t.clone() for t in f.tensors]) for f in frames]


FRAMES = _valid_frames()
SAFE = serializers.available(safe=True)
HUGE = st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**40, 2**62, 2**63 - 1, 2**64 - 1])


@st.composite
def lying_frame(draw) -> tuple:
    """A valid frame with header fields, table fields or bytes replaced by lies."""
    base, tensors = draw(st.sampled_from(FRAMES))
    data = bytearray(base)
    name_len = data[7]
    for _ in range(draw(st.integers(1, 3))):
        field = draw(
            st.sampled_from(
                [
                    "table_len",
                    "n_tensors",
                    "payload_len",
                    "raw_len",
                    "inline_len",
                    "entry_nbytes",
                    "entry_offset",
                    "entry_dim",
                    "entry_ndim",
                    "byte",
                ]
            )
        )
        value = draw(st.one_of(HUGE, st.integers(0, 2**16)))
        table = _frame.HEADER.size + name_len
        if field in ("table_len", "n_tensors"):
            struct.pack_into("<I", data, 8 if field == "table_len" else 12, value & 0xFFFFFFFF)
        elif field in ("payload_len", "raw_len", "inline_len"):
            struct.pack_into("<Q", data, {"payload_len": 16, "raw_len": 24, "inline_len": 32}[field], value % 2**64)
        elif field.startswith("entry") and len(data) >= table + 32:
            at = {"entry_nbytes": 8, "entry_offset": 16, "entry_dim": 24, "entry_ndim": 2}[field]
            if field == "entry_ndim":
                data[table + at] = value & 0xFF
            else:
                struct.pack_into("<Q", data, table + at, value % 2**64)
        elif data:
            data[draw(st.integers(0, len(data) - 1))] = value & 0xFF
    return bytes(data), tensors


def _decode_frame(data: bytes, tensors: list) -> None:
    view = memoryview(data)
    sizes = _frame.tensor_sizes(view)
    header = _frame.parse_header(view)
    if header.is_error:
        _frame.read_error(view, header)
        return
    assert sum(sizes) <= 2**62
    # plain pickle's payload may allocate what it likes (a flipped byte once made BINBYTES ask for 16 MB): the
    # bound holds for the safe serializers only, so the receiver accepts those alone, as docs/security.md advises
    _frame.decode(Incoming(view, list(tensors)), sender=1, accept=SAFE, max_bytes=1 << 20)


@settings(FUZZ, max_examples=2000 * FUZZ_SCALE)
@given(case=lying_frame())
def test_fuzz_frames_with_lying_fields(case):
    data, tensors = case
    _bounded(lambda: _decode_frame(data, tensors), len(data))


@st.composite
def lying_slot(draw) -> bytes:
    """A slot as a sender fills it, then with its length, flags, total, count or sizes replaced by lies."""
    base, tensors = draw(st.sampled_from(FRAMES))
    slot_size = draw(st.sampled_from([128, 256, 4096]))
    slot = bytearray(slot_size)
    _slot.fill_slot(memoryview(slot), Outgoing(memoryview(base), tensors), 1 << 20)
    prefix = _slot.PREFIX.size
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(["length", "flags", "total", "count", "size", "byte"]))
        value = draw(st.one_of(HUGE, st.integers(0, 2**16)))
        word, limit, total = _slot.PREFIX.unpack_from(slot, 0)
        if field == "length":
            word = (word & ~_slot.LENGTH_MASK) | (value & _slot.LENGTH_MASK)
        elif field == "flags":
            listed = getattr(_rounds, "LISTED_BIT", 1 << 61)
            word ^= draw(st.sampled_from([_slot.ERROR_BIT, _slot.ROUND2_BIT, listed]))
        elif field == "total":
            total = value % 2**64
        elif field in ("count", "size"):
            at = draw(st.integers(prefix, slot_size - 12))
            fmt, modulus = ("<I", 2**32) if field == "count" else ("<Q", 2**64)
            struct.pack_into(fmt, slot, at, value % modulus)
        else:
            slot[draw(st.integers(0, slot_size - 1))] = value & 0xFF
        _slot.PREFIX.pack_into(slot, 0, word, limit, total)
    return bytes(slot)


def _check_slot(data: bytes) -> None:
    from objcomm._format import (
        limits as _limits,  # the receiver's checks (imported here so the module loads on older trees)
    )

    info = _slot.read_slot(memoryview(data))
    sizes, problem = _limits.plan(info, _frame.tensor_sizes)
    if problem is None and sizes is not None and not info.error:
        # what a receiver will allocate is exactly what the sender announced (and checked against limits)
        assert info.length + sum(sizes) == info.total
    if problem is None and info.error:
        assert info.inline is not None
        header = _frame.parse_header(info.inline)
        _frame.read_error(info.inline, header)


@settings(FUZZ, max_examples=1600 * FUZZ_SCALE)
@given(slot=lying_slot())
def test_fuzz_slots_with_lying_fields(slot):
    _bounded(lambda: _check_slot(slot), len(slot))


@settings(FUZZ, max_examples=500 * FUZZ_SCALE)
@given(
    payload=st.one_of(
        st.binary(max_size=512),
        st.text(alphabet='[]{}"\\:,ab1 ', max_size=2000).map(str.encode),
        st.tuples(st.sampled_from(["[", '{"a":', '{"type": "T", "message": [']), st.integers(500, 5000)).map(
            lambda opener: (opener[0] * opener[1]).encode()
        ),
    )
)
def test_fuzz_error_reports(payload):
    view = _frame._assemble("", payload, flags=_frame.FLAG_ERROR)
    _bounded(lambda: _frame.read_error(view, _frame.parse_header(view)), len(payload))


# -- found by attacking the fixes ---------------------------------------------------------------


def _many_references(refs: int) -> bytes:
    """A msgpack frame whose one 1 MiB inline tensor the payload names ``refs`` times."""
    out = _frame.encode(
        {"t": torch.zeros(1 << 20, dtype=torch.uint8)},
        serializers.get("msgpack"),
        max_bytes=1 << 30,
        inline_tensor_bytes=2 << 20,
    )
    view = memoryview(out.frame)
    header = _frame.parse_header(view)
    start = header.payload_offset
    payload = b"\xdd" + struct.pack(">I", refs) + b"\xd4\x0c\x00" * refs  # [ext 12 (tensor #0)] * refs
    name = bytes(view[_frame.HEADER.size : _frame.HEADER.size + len(header.serializer)])
    table = bytes(view[_frame.HEADER.size + len(name) : start])
    inline = bytes(view[start + header.payload_len :])
    fields = (
        _frame.MAGIC,
        _frame.VERSION,
        0,
        0,
        len(name),
        header.table_len,
        header.n_tensors,
        len(payload),
        len(payload),
        len(inline),
    )
    return _frame.HEADER.pack(*fields) + name + table + payload + inline


def _decode_and_measure(frame: bytes) -> tuple:
    tensors = _frame.decode(Incoming(memoryview(frame)), sender=1, accept=None, max_bytes=8 << 20)
    distinct = {t.untyped_storage().data_ptr() for t in tensors}
    return len(tensors), len(distinct)


def test_a_tensor_named_many_times_is_restored_once():
    frame = _many_references(2000)  # 1 MiB of tensor, 2,000 mentions: 2 GB if each were a copy
    count, distinct = run_in_child(_decode_and_measure, frame, memory_budget=256 << 20, preload=("numpy", "torch"))
    assert (count, distinct) == (2000, 1)


def _overlapping_inline_entries() -> bytes:
    out = _frame.encode(
        [torch.zeros(1000, dtype=torch.uint8), torch.ones(1000, dtype=torch.uint8)],
        serializers.get("pickle"),
        max_bytes=1 << 30,
        inline_tensor_bytes=1 << 20,
    )
    frame = bytearray(out.frame)
    header = _frame.parse_header(memoryview(frame))
    second = _frame.HEADER.size + len(header.serializer) + _tensors.ENTRY.size + 8  # entry 2 (1 dim each)
    struct.pack_into("<Q", frame, second + 16, 0)  # its inline offset: the first tensor's bytes again
    return bytes(frame)


def test_inline_tensors_may_not_share_bytes():
    frame = _overlapping_inline_entries()
    with pytest.raises(objcomm.FrameError, match="share"):
        _frame.decode(Incoming(memoryview(frame)), sender=1, accept=None)


def _read_escaped_quotes(size: int) -> tuple:
    payload = b'"' + b'\\"' * ((size - 2) // 2)  # an unterminated string of escaped quotes
    frame = (
        _frame.HEADER.pack(_frame.MAGIC, _frame.VERSION, _frame.FLAG_ERROR, 0, 0, 0, 0, len(payload), len(payload), 0)
        + payload
    )
    import time

    start = time.perf_counter()
    try:
        _frame.read_error(memoryview(frame), _frame.parse_header(memoryview(frame)))
        result = "read"
    except ObjcommError as exc:
        result = type(exc).__name__
    return result, time.perf_counter() - start


def test_an_error_report_is_parsed_in_linear_time():
    result, seconds = run_in_child(_read_escaped_quotes, 512 << 10)  # quadratic parsing took ~15 min here
    assert result == "FrameError" and seconds < 10


# -- A: an inflated vote on the length of all_to_all's second round ---------------------------------
def inflated_rounds(inflated: int = 1 << 50) -> tuple:
    """Rank 1 votes ``inflated`` bytes for its longest stream (it sends 2 MiB): without a bound every rank would
    run 2**30 empty rounds (2**50 in pieces of 1 MiB), each completing, so the group's timeout (3 s here) would never
    fire. Past MOST_PIECES pieces every rank refuses the vote at once; at that many, the rounds' bound ends them."""
    import datetime
    import time

    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    parts = [b"z" * (2 * MiB), b"z" * (2 * MiB)]
    started = time.monotonic()
    try:
        if rank == 1:
            real = _parts.outgoing_second_round_bytes
            _parts.outgoing_second_round_bytes = lambda out, capacity: inflated  # type: ignore[assignment]
            try:
                wire = _wire(chunk=MiB)._replace(group=group, ranks=[0, 1])
                outs = [_frame.encode(p, serializers.get("pickle"), max_bytes=1 << 30) for p in parts]
                # the group's first call: votes on round 1's settings as rank 0's communicator does (Operations._route)
                honest = objcomm.Communicator(group, shm=False, chunk_bytes=MiB)._call({}).wire
                _rounds.agree_on_round_one(honest, "all_to_all")
                _as_honest("all_to_all")
                _parts.all_to_all(wire, outs, _frame.tensor_sizes)
            finally:
                _parts.outgoing_second_round_bytes = real  # type: ignore[assignment]
        else:
            objcomm.Communicator(group, shm=False, chunk_bytes=MiB).all_to_all(parts)
        outcome: object = "no error"
    except ObjcommError as exc:
        outcome = (type(exc).__name__, str(exc)[:400])
    return outcome, time.monotonic() - started, _still_usable()


def test_an_inflated_all_to_all_vote_ends_at_the_group_timeout():
    # 2**50 bytes in pieces of 1 MiB: past MOST_PIECES, refused by every rank alike before a round runs
    (honest, _, usable), (liar, _, liar_usable) = get_pool(2).run(inflated_rounds, timeout=120)
    assert honest[0] == liar[0] == "FrameError" and "262,144 pieces" in honest[1], (honest, liar)
    assert usable and liar_usable
    # MOST_PIECES pieces of 1 MiB exactly: allowed, 262,144 empty rounds, which the group's timeout ends
    (honest, honest_took, usable), (liar, _, liar_usable) = get_pool(2).run(inflated_rounds, 1 << 38, timeout=120)
    assert honest[0] == liar[0] == "CommunicationError", (honest, liar)
    assert honest_took < 60  # a bound on a hang, not a speed figure: unbounded, this took 2**30 rounds
    # The rounds' limit ended it on at least one rank; a rank still inside a round when the other stopped
    # raises the group's own timeout error there.
    assert any("was not done after the group's timeout of 3 s" in r[1] for r in (honest, liar)), (honest, liar)
    assert usable and liar_usable  # the world group was not involved
