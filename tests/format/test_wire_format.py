"""docs/wire-format.md holds: golden bytes decode, today's code writes them again, the page states the code's numbers.

The golden files and the values they hold come from tests/golden/make_golden.py (imported here),
so the generator and these tests cannot disagree about what a file should contain.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import pathlib
import pickle
import re
import struct
from typing import Any, Dict, List, Tuple

import msgpack
import numpy as np
import pytest
import torch

import serializers
from objcomm._format import compression as _compression
from objcomm._format import frame as _frame
from objcomm._format import limits as _limits
from objcomm._format import slot as _slot
from objcomm._format import tensors as _tensors
from objcomm._samehost import segments as _segments
from objcomm._transport import rounds as _rounds
from serializers import _msgpack

pytestmark = pytest.mark.timeout(30)

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"
PAGE = pathlib.Path(__file__).parents[2] / "docs" / "wire-format.md"


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("_wire_format_golden", GOLDEN / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _generator()


@pytest.fixture(scope="module", autouse=True)
def _point_codec():
    with gen.codec_registered():  # a name no other test uses; unregistered afterwards
        yield


def same(a: Any, b: Any) -> bool:
    """Equal values of exactly the same types (tensors: dtype, shape, requires_grad and elements)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad) and torch.equal(
            a.detach(), b.detach()
        )
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def golden(name: str) -> bytes:
    return (GOLDEN / name).read_bytes()


def oob_tensors() -> List[torch.Tensor]:
    return [torch.frombuffer(bytearray(golden("v1-tensors.oob0")), dtype=torch.uint8)]


def decode(data: bytes, tensors: List[torch.Tensor] = ()) -> Any:  # type: ignore[assignment]
    return _frame.decode(_frame.Incoming(memoryview(data), list(tensors)), sender=0, accept=None)


def payload(name: str) -> bytes:
    """The payload section of a golden frame, as stored."""
    data = golden(name)
    header = _frame.parse_header(memoryview(data))
    return data[header.payload_offset : header.payload_offset + header.payload_len]


def calls(data: Any) -> List[Tuple[str, tuple]]:
    """The globals a pickle payload calls, with their arguments, in order (golden payloads only: they are ours)."""
    seen: List[Tuple[str, tuple]] = []

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            real = super().find_class(module, name) if module == "serializers._rebuild" else None

            def record(*args: Any) -> Any:
                seen.append((f"{module}.{name}", args))
                return real(*args) if real is not None else ("key", *args)

            return record

    Recorder(io.BytesIO(data)).load()
    return seen


# -- frames ----------------------------------------------------------------------------------------
UNCOMPRESSED = {
    "v1-tensors-msgpack.frame": gen.tensor_object,
    "v1-tensors-restricted-pickle.frame": gen.tensor_object,
    "v1-msgpack-codec.frame": gen.msgpack_codec_object,
    "v1-json-codec.frame": gen.json_codec_object,
}


@pytest.mark.parametrize("name", sorted(UNCOMPRESSED))
def test_golden_frame_decodes_and_is_written_again_byte_for_byte(name):
    data = golden(name)
    header = _frame.parse_header(memoryview(data))
    tensors = oob_tensors() if header.n_tensors else []
    assert same(decode(data, tensors), UNCOMPRESSED[name]())
    out = gen.frames()[name]
    assert bytes(out.frame) == data
    assert [t.numpy().tobytes() for t in out.tensors] == [t.numpy().tobytes() for t in tensors]


@pytest.mark.parametrize("name", ["v1-tensors-msgpack.frame", "v1-tensors-restricted-pickle.frame"])
def test_tensor_table_is_as_documented(name):
    data = golden(name)
    view = memoryview(data)
    header = _frame.parse_header(view)
    assert (header.n_tensors, header.table_len, header.inline_len) == (2, 2 * 24 + 3 * 8, 16)
    assert _frame._table(view, header) == [
        _tensors.Entry(torch.int32, _tensors.INLINE, (4,), 16, 0),
        _tensors.Entry(torch.float32, _tensors.REQUIRES_GRAD, (2, 4), 32, 0),
    ]
    table = data[40 + len(header.serializer) :][: header.table_len]
    assert table[:24] == struct.pack("<BBB5xQQ", 7, 1, 1, 16, 0) and table[24:32] == struct.pack("<q", 4)
    assert data[-16:] == np.arange(4, dtype="<i4").tobytes()  # the inline section ends the frame
    assert golden("v1-tensors.oob0") == np.arange(8, dtype="<f4").tobytes()
    assert _frame.tensor_sizes(view) == [32]
    decoded = decode(data, oob_tensors())
    assert decoded["alias"] is decoded["inline"]  # one key, one tensor


def test_msgpack_tensor_keys_are_ext_12_and_pickle_keys_call_external_ref():
    keys = msgpack.unpackb(payload("v1-tensors-msgpack.frame"), ext_hook=lambda code, raw: (code, raw))
    assert keys == {"inline": (12, b"\x00"), "out_of_band": (12, b"\x01"), "alias": (12, b"\x00")}
    found = calls(payload("v1-tensors-restricted-pickle.frame"))
    assert found == [("serializers._pickle.external_ref", (0,)), ("serializers._pickle.external_ref", (1,))]
    assert serializers._pickle.EXTERNAL == ("serializers._pickle", "external_ref")


def test_codec_payloads_use_ext_13_and_the_json_tag():
    exts = msgpack.unpackb(payload("v1-msgpack-codec.frame"), ext_hook=lambda code, body: (code, body))
    assert {k: v[0] for k, v in exts.items()} == {"point": 13, "pair": 1, "set": 2, "array": 8}
    assert msgpack.unpackb(exts["point"][1]) == [gen.CODEC_NAME, [1, 2]]
    assert msgpack.unpackb(exts["array"][1]) == [">i4", [2, 3], np.arange(6, dtype=">i4").tobytes()]
    tagged = b'{"point":{"__objcomm_type__":"wire-format-golden.Point","value":[1,2]},"ids":[1,2,3]}'
    assert payload("v1-json-codec.frame") == tagged


def test_error_report_frame_is_as_documented():
    data = golden("v1-error.frame")
    header = _frame.parse_header(memoryview(data))
    assert (header.flags, header.serializer, header.compression, header.table_len) == (_frame.FLAG_ERROR, "", 0, 0)
    assert data[40:] == b'{"type": "ValueError", "message": "boom on rank 3"}'


# -- compression -----------------------------------------------------------------------------------
def _library_version(name: str) -> Any:
    if name == "zstd":
        return importlib.import_module("zstandard").ZSTD_VERSION
    return importlib.import_module("lz4").library_version_string()


WRITTEN_WITH = {"zstd": (1, 5, 7), "lz4": "1.9.4"}  # the libraries that wrote the golden compressed frames


@pytest.mark.parametrize("name", ["zstd", "lz4"])
def test_compressed_golden_frame_decodes_to_todays_payload(name):
    data = golden(f"v1-{name}.frame")
    header = _frame.parse_header(memoryview(data))
    plain = bytes(serializers.get("msgpack").dumps(gen.compressible_object()))
    assert header.compression == _compression.CODES[name] and header.raw_len == len(plain) == 560
    stored = memoryview(data)[header.payload_offset : header.payload_offset + header.payload_len]
    assert bytes(_compression.decompress(header.compression, stored, header.raw_len, 1 << 20)) == plain
    assert same(decode(data), gen.compressible_object())
    again = bytes(gen.frames()[f"v1-{name}.frame"].frame)  # whatever today's library writes must decode alike
    assert same(decode(again), gen.compressible_object())
    assert _frame.parse_header(memoryview(again))._replace(payload_len=0) == header._replace(payload_len=0)


@pytest.mark.parametrize("name", ["zstd", "lz4"])
def test_compressed_golden_frame_is_written_again_by_the_same_library(name):
    if _library_version(name) != WRITTEN_WITH[name]:
        pytest.skip(f"{name} {_library_version(name)} is not the {WRITTEN_WITH[name]} that wrote the golden frame")
    assert bytes(gen.frames()[f"v1-{name}.frame"].frame) == golden(f"v1-{name}.frame")


# -- restricted-pickle -----------------------------------------------------------------------------
def test_restricted_pickle_payload_names_only_rebuild_calls_with_documented_arguments():
    data = golden("restricted-pickle.payload")
    restricted = serializers.get("restricted-pickle")
    assert same(restricted.loads(data), gen.restricted_object())
    assert bytes(restricted.dumps(gen.restricted_object())) == data
    found = calls(data)
    assert [name.rpartition(".")[2] for name, _ in found] == [
        "ndarray",
        "tensor",
        "numpy_scalar",
        "numpy_dtype",
        "tensor",
        "parameter",
        "uuid",
    ]
    assert {name.rpartition(".")[0] for name, _ in found} == {"serializers._rebuild"}
    args = [a for _, a in found]
    assert same(args[0], ("<i4", (2, 3), "C", bytearray(np.arange(6, dtype="<i4").tobytes())))
    assert same(args[1], ("float32", (1, 2), bytearray(np.array([1.5, 2.5], dtype="<f4").tobytes()), False))
    assert same(args[2], ("<f8", np.float64(0.5).tobytes()))
    assert same(args[3], ("<f4",))
    assert same(args[4], ("float32", (2,), bytearray(np.ones(2, dtype="<f4").tobytes()), False))
    assert type(args[5][0]) is torch.Tensor and args[5][1] is True
    assert args[6] == (42,)


# -- slots -----------------------------------------------------------------------------------------
# shape -> (frame inline?, listed sizes, LISTED_BIT?)
SHAPES: Dict[str, Tuple[bool, Any, bool]] = {
    "inline": (True, None, False),
    "inline-listed": (True, [4], True),
    "inline-unlisted": (True, None, False),
    "outside-listed": (False, [4, 4], False),
    "outside-no-tensors": (False, [], False),
    "outside-unlisted": (False, None, False),
    "error": (True, None, False),
    "round2": (True, None, False),
}


def test_every_slot_shape_has_a_golden_file():
    assert set(gen.slot_outgoing()) == set(SHAPES)
    assert {p.name for p in GOLDEN.glob("slot-*.slot")} == {f"slot-{s}.slot" for s in SHAPES}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_golden_slot_parses_and_is_filled_again_byte_for_byte(shape):
    data = golden(f"slot-{shape}.slot")
    out = gen.slot_outgoing()[shape]
    assert len(data) == gen.SLOT_BYTES
    assert gen.fill(shape, out) == data
    if shape != "round2":  # scatter writes round-2 slots; everything else builds them with _slot
        wire = _rounds.Wire(None, [0], 0, torch.device("cpu"), gen.SLOT_BYTES, _slot.DEFAULT_PIECE, gen.SLOT_LIMIT)
        assert bytes(_rounds._slot(wire, out)) == data
        # a sender with other pieces (chunk_bytes) announces them in bits 56-60 of the word, and nothing else changes
        other = bytearray(_rounds._slot(wire._replace(chunk=1 << 20), out))
        word = int.from_bytes(other[:8], "little")
        assert word >> _slot.PIECE_SHIFT & _slot.PIECE_MASK == 20 ^ _slot.DEFAULT_PIECE_LOG2
        assert _slot.read_slot(memoryview(other)).piece == 1 << 20
        other[:8] = (word & ~(_slot.PIECE_MASK << _slot.PIECE_SHIFT)).to_bytes(8, "little")
        assert bytes(other) == data

    inline, sizes, listed_bit = SHAPES[shape]
    info = _slot.read_slot(memoryview(data))
    assert (info.length, info.error, info.round2, info.limit, info.total) == (
        out.frame.nbytes,
        shape == "error",
        shape == "round2",
        gen.SLOT_LIMIT,
        out.total,
    )
    assert (bytes(info.inline) if info.inline is not None else None) == (bytes(out.frame) if inline else None)
    assert info.sizes == sizes
    word, limit, total = struct.unpack_from("<QQQ", data)  # the documented layout, read by hand
    assert word & ((1 << 61) - 1) == out.frame.nbytes and (limit, total) == (gen.SLOT_LIMIT, out.total)
    assert bool(word & (1 << 61)) == listed_bit and bool(word & (1 << 63)) == (shape == "error")
    assert bool(word & (1 << 62)) == (shape == "round2")
    count_at = 24 + (out.frame.nbytes if inline else 0)
    if sizes is not None:
        assert struct.unpack_from(f"<I{len(sizes)}Q", data, count_at) == (len(sizes), *sizes)
    elif not inline:
        assert struct.unpack_from("<I", data, 24) == (0xFFFFFFFF,)
    used = count_at + (4 + 8 * len(sizes) if sizes is not None else 4 if not inline else 0)
    assert not any(data[used:]), "unused slot bytes are zero"
    # and the receiver's checks accept it, learning every tensor size from slot or frame
    assert _limits.slot_problem_of(info) is None
    planned, problem = _limits.plan(info, _frame.tensor_sizes)
    assert problem is None
    if inline and not info.error:
        assert (planned or []) == [t.numel() for t in out.tensors]


# -- the page against the code ---------------------------------------------------------------------
def _cells(line: str) -> List[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables() -> List[Tuple[str, List[str], List[List[str]]]]:
    """``(the line before it, header cells, rows)`` for every table of the page."""
    lines = PAGE.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|[-| ]+\|", lines[i + 1].strip()):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            before = next((line for line in reversed(lines[:i]) if line.strip()), "")
            found.append((before, _cells(lines[i]), [_cells(line) for line in lines[i + 2 : j]]))
            i = j
        else:
            i += 1
    return found


def resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for depth in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:depth]))
        except ImportError:
            continue
        for attr in parts[depth:]:
            target = getattr(target, attr)
        return target
    raise ImportError(dotted)


def _code(cell: str) -> str:
    return cell.strip().strip("`")


def stated_constants() -> Dict[str, Any]:
    """Every ``constant | value`` row of the page: dotted name -> the value the page states."""
    stated = {}
    for _, header, rows in tables():
        if "constant" in header and "value" in header:
            name_at, value_at = header.index("constant"), header.index("value")
            for row in rows:
                stated[_code(row[name_at])] = eval(_code(row[value_at]), {"__builtins__": {}})  # our own page
    return stated


EXT_NAMES = [
    "TUPLE",
    "SET",
    "FROZENSET",
    "BIGINT",
    "DATETIME",
    "DATE",
    "TIMEDELTA",
    "NDARRAY",
    "NPSCALAR",
    "COMPLEX",
    "ODICT",
    "EXTERNAL",
    "CODEC",
]
MUST_STATE = {
    *(f"objcomm._format.frame.{n}" for n in ("MAGIC", "VERSION", "VERSIONS", "FLAG_ERROR", "MAX_ERROR_REPORT")),
    *(f"objcomm._format.compression.{n}" for n in ("NONE", "ZSTD", "LZ4", "CODES")),
    *(
        f"objcomm._format.tensors.{n}"
        for n in ("INLINE", "REQUIRES_GRAD", "PARAMETER", "NUMPY", "BYTES", "BYTEARRAY", "MAX_NDIM")
    ),
    *(f"serializers._msgpack.{n}" for n in EXT_NAMES),
    "serializers._json.TAG",
    "serializers._pickle.PROTOCOL",
    "serializers._pickle.EXTERNAL",
    *(f"objcomm._format.slot.{n}" for n in ("ERROR_BIT", "ROUND2_BIT", "LISTED_BIT", "LENGTH_MASK", "SIZES_UNLISTED")),
    *(f"objcomm._transport.rounds.{n}" for n in ("REFUSE_LIMIT", "REFUSE_MALFORMED")),
    "objcomm._samehost.hosts._WORDS",
    "objcomm._samehost.segments.PREFIX",
    "objcomm._api.call.MAX_TAG",
    "objcomm._transport.base.INTERNAL_TAG",
    "objcomm._transport.base.WHOLE",
    "objcomm._transport.base.ASKS",
    "objcomm._transport.routes.BACKEND_WHOLE_BYTES",
    *(f"objcomm._transport.p2p.{n}" for n in ("TAKES", "ASKED", "SHARED_WORDS")),
    *(f"objcomm._samehost.shm.{n}" for n in ("_READ", "_FELL_BACK", "_REFUSED")),
    *(f"objcomm._samehost.shm_p2p.{n}" for n in ("_P2P", "_SENT", "_OTHER_HOST", "_RESEND", "_REFUSED_P2P")),
    *(f"objcomm._samehost.inbox.{n}" for n in ("ALL_GATHER", "BROADCAST", "SCATTER", "ALL_TO_ALL", "P2P", "CREDIT")),
    "objcomm._samehost.mesh.MAX_PAYLOAD",
    "objcomm._samehost.channel._WORDS",
}


def test_every_constant_the_page_states_is_the_codes():
    stated = stated_constants()
    assert MUST_STATE <= set(stated), f"the page no longer states {sorted(MUST_STATE - set(stated))}"
    for name, value in stated.items():
        actual = resolve(name)
        assert type(actual) is type(value) and actual == value, f"the page says {name} = {value!r}, it is {actual!r}"


def test_the_page_lists_every_compression_code_and_msgpack_extension():
    stated = stated_constants()
    codes = {v for k, v in stated.items() if k.startswith("objcomm._format.compression.") and isinstance(v, int)}
    assert codes == {_compression.NONE, *_compression.NAMES}
    exts = {v for k, v in stated.items() if k.startswith("serializers._msgpack.") and not k.endswith("MAX_EXT_DEPTH")}
    documented_in_module = {int(c) for c in re.findall(r"^(\d+)\s{2,}\S", _msgpack.__doc__ or "", re.M)}
    assert exts == documented_in_module == set(range(1, 14))


_TYPES = {"u8": "B", "u32": "I", "i32": "i", "u64": "Q", "i64": "q"}


def _format(kind: str) -> str:
    found = re.fullmatch(r"(char|pad)\[(\d+)\]", kind)
    if found:
        return found[2] + ("s" if found[1] == "char" else "x")
    return _TYPES[kind]


def test_byte_layouts_on_the_page_are_the_structs():
    checked = set()
    for before, header, rows in tables():
        found = re.fullmatch(r"Layout of `([\w.]+)` \((\d+) bytes\):", before)
        if not found:
            continue
        assert header[:4] == ["offset", "size", "type", "field"]
        layout = resolve(found[1])
        at, formats = 0, []
        for row in rows:
            offset, size, kind = int(row[0]), int(row[1]), _code(row[2])
            assert offset == at and struct.calcsize("<" + _format(kind)) == size, f"{found[1]}: row {row}"
            formats.append(_format(kind))
            at += size
        assert "<" + "".join(formats) == layout.format and at == layout.size == int(found[2])
        checked.add(found[1])
    assert checked == {
        "objcomm._format.frame.HEADER",
        "objcomm._format.tensors.ENTRY",
        "objcomm._format.tensors.DIM",
        "objcomm._format.slot.PREFIX",
        "objcomm._format.slot.COUNT",
        "objcomm._samehost.inbox.HEADER",
        "objcomm._transport.p2p.ENVELOPE",
    }
    assert _frame.HEADER.size == 40


def test_dtype_codes_on_the_page_are_the_tables():
    [rows] = [rows for _, header, rows in tables() if header == ["code", "dtype"]]
    assert [(int(code), dtype) for code, dtype in rows] == list(enumerate(_tensors.DTYPES))


def test_slot_shape_table_names_every_golden_slot():
    [rows] = [rows for _, header, rows in tables() if header[0] == "shape"]
    named = {re.search(r"tests/golden/(slot-[\w-]+\.slot)", row[3])[1] for row in rows}  # type: ignore[index]
    assert named == {p.name for p in GOLDEN.glob("slot-*.slot")}


def test_segment_name_example_is_what_the_code_writes():
    writer = _segments._Writer(0x1F2E3D4C5B6A7988, 4026531836, 0x0123456789ABCDEF, 4242)
    name = _segments._name("", writer, 7, 0)
    assert f"`{name}`" in PAGE.read_text()
    assert _segments._parse(name) == writer


def test_golden_directory_holds_only_documented_files():
    expected = {
        "make_golden.py",
        "v1-tensors.oob0",
        "v1-pickle.frame",
        "v1-msgpack.frame",
        "v1-json.frame",
        "v1-error.frame",
        *gen.frames(),
        *gen.payloads(),
        *(f"slot-{s}.slot" for s in SHAPES),
    }
    present = {p.name for p in GOLDEN.iterdir() if p.is_file()}
    assert present == expected
    text = PAGE.read_text()
    assert all(name in text for name in expected - {"make_golden.py"}), "every golden file is named on the page"
