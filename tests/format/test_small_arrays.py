"""Many small numpy arrays (and tensors) inside objects: exact, and cheap.

Below a serializer's ``in_band_array_bytes`` (pickle, cloudpickle, msgpack) numpy arrays stay in its payload;
above it, and for restricted-pickle always, they are lifted into the tensor table as before. Either way they come
back exact: dtype (byte order included), shape (0-d and empty too), values, and writable.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch
from _ranks import get_pool

import objcomm
import serializers
from objcomm._format import frame as _frame
from objcomm._format import tensors as _tensors
from objcomm._format.message import Incoming
from objcomm._tools.bench.payloads import ARRAY_LENGTH, BUILTIN, parse_size, reference_size
from objcomm._tools.bench.report import format_recommendations, format_table, to_json
from objcomm._tools.bench.results import Result, Row

pytestmark = pytest.mark.timeout(180)

CARRIERS = ["pickle", "cloudpickle", "restricted-pickle", "msgpack"]  # the serializers that carry numpy arrays
IN_BAND = {"pickle": 4096, "cloudpickle": 4096, "msgpack": 4096, "restricted-pickle": -1}


def arrays(n: int) -> dict:
    """Arrays of about ``n`` elements, of every kind objcomm has carried so far."""
    gen = np.random.default_rng(n)
    values = gen.standard_normal(n)
    out = {
        str(dtype): values.astype(dtype)
        for dtype in (
            "float64",
            "float32",
            "float16",
            "int8",
            "int16",
            "int32",
            "int64",
            "uint8",
            "uint16",
            "uint32",
            "uint64",
            "bool",
            "complex64",
            "complex128",
        )
    }
    out.update(
        {
            "big-endian f8": values.astype(">f8"),  # non-native byte order: torch has none, the serializer carries it
            "big-endian i4": (values * 100).astype(">i4"),
            "0-d": np.array(values[0]),
            "0-d int": np.array(7, dtype=np.int32),
            "empty": np.zeros(0),
            "empty 2-d": np.zeros((0, 3), dtype=np.float32),
            "strided": np.arange(2 * n, dtype=np.int64)[::2],
            "transposed": values[: (n // 4) * 4].reshape(4, -1).T,  # Fortran order
            "2-d": values[: (n // 4) * 4].reshape(4, -1).copy(),
            "read-only": np.frombuffer(values.tobytes(), dtype=np.float64),
            "nan": np.array([math.nan, math.inf, -0.0] * max(1, n // 3)),
            "bytes": np.array([b"ab", b"c"] * max(1, n // 2)),
            "unicode": np.array(["ab", "ç"] * max(1, n // 2)),
        }
    )
    return out


def round_trip(obj, name: str, **options):
    chosen = serializers.registry.guarded(name)
    out = _frame.encode(obj, chosen, max_bytes=1 << 30, **options)
    header = _frame.parse_header(out.frame)
    got = _frame.decode(Incoming(out.frame, list(out.tensors)), sender=0, accept=None, own=True)
    return got, header, out


def assert_exact(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        value = got[key]
        assert type(value) is np.ndarray, key
        assert value.dtype == want.dtype and value.dtype.str == want.dtype.str, key  # byte order too
        assert value.shape == want.shape, key
        assert np.array_equal(value, want, equal_nan=want.dtype.kind in "fc"), key
        assert value.flags.writeable, key  # as every array arrived before: writable, its own memory
        assert not np.shares_memory(value, want), key


@pytest.mark.parametrize("name", CARRIERS)
@pytest.mark.parametrize("n", [1, 10, 100, 2_000, 20_000], ids=lambda n: f"{n}-elements")
def test_arrays_round_trip_exactly_below_and_above_the_thresholds(name, n):
    expected = arrays(n)
    got, _, _ = round_trip(expected, name)
    assert_exact(got, expected)


@pytest.mark.parametrize("name", CARRIERS)
def test_arrays_round_trip_exactly_all_out_of_band(name):
    expected = arrays(100)
    got, header, out = round_trip(expected, name, inline_tensor_bytes=0)
    assert_exact(got, expected)
    assert out.tensors and header.version == 2  # the lifted ones travelled as tensors


@pytest.mark.parametrize("name", CARRIERS)
def test_small_arrays_stay_in_the_payload_where_the_serializer_says_so(name):
    small = {f"a{i}": np.full(100, i, dtype=np.float64) for i in range(50)}  # 800 bytes each
    got, header, out = round_trip(small, name)
    assert_exact(got, small)
    in_band = IN_BAND[name] >= 800
    assert header.n_tensors == (0 if in_band else 50)
    assert not out.tensors  # below inline_tensor_bytes: inside the frame either way
    assert getattr(serializers.registry.guarded(name), "in_band_array_bytes", -1) == IN_BAND[name]
    # above the serializer's threshold (and below inline_tensor_bytes): lifted, copied into the frame
    larger = {f"a{i}": np.full(1000, i, dtype=np.float64) for i in range(5)}  # 8000 bytes each
    got, header, out = round_trip(larger, name)
    assert_exact(got, larger)
    assert header.n_tensors == 5 and header.inline_len == 5 * 8000 and not out.tensors
    # never above inline_tensor_bytes
    got, header, out = round_trip(small, name, inline_tensor_bytes=100)
    assert_exact(got, small)
    assert header.n_tensors == 50 and len(out.tensors) == 50


def test_a_read_only_array_is_lifted_so_that_it_arrives_writable():
    read_only = {"r": np.frombuffer(bytes(range(64)), dtype=np.uint8)}
    got, header, _ = round_trip(read_only, "pickle")  # pickled in place, it would come back read-only
    assert header.n_tensors == 1 and got["r"].flags.writeable


def test_zero_d_arrays_keep_their_shape():
    """np.ascontiguousarray() makes a 0-d array 1-d: lifted ones and msgpack's came back with shape (1,)."""
    for name in CARRIERS:
        for options in ({}, {"inline_tensor_bytes": 0}):
            got, _, _ = round_trip({"x": np.array(2.5), "y": np.array(3, dtype=">i2")}, name, **options)
            assert got["x"].shape == () and got["y"].shape == () and got["y"].dtype.str == ">i2", (name, options)


@pytest.mark.parametrize("name", ["pickle", "cloudpickle", "restricted-pickle"])
def test_an_array_named_twice_arrives_as_one(name):
    shared = np.arange(10.0)
    got, _, _ = round_trip({"a": shared, "b": shared, "c": [shared]}, name)
    assert got["a"] is got["b"] is got["c"][0]


def test_a_subclass_of_pickle_lifts_arrays_unless_it_says_otherwise():
    class Mine(serializers._pickle.PickleSerializer):
        name = "test-small-arrays-mine"

    class Says(serializers._pickle.PickleSerializer):
        name = "test-small-arrays-says"
        in_band_array_bytes = 1024

    small = {"a": np.arange(10.0)}
    for cls, lifted in ((Mine, 1), (Says, 0)):
        out = _frame.encode(small, cls(), max_bytes=1 << 30)
        assert _frame.parse_header(out.frame).n_tensors == lifted


def tensors(n: int) -> dict:
    gen = torch.Generator().manual_seed(n)
    values = torch.randn(n, generator=gen, dtype=torch.float64)
    out = {
        str(d): values.to(d)
        for d in (
            torch.float64,
            torch.float32,
            torch.float16,
            torch.bfloat16,
            torch.int8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.uint8,
            torch.bool,
            torch.complex64,
            torch.complex128,
        )
    }
    out.update(
        {
            "0-d": torch.tensor(1.5),
            "empty": torch.zeros(0, 5),
            "strided": torch.arange(2.0 * n)[::2],
            "transposed": values[: (n // 2) * 2].reshape(2, -1).T,
            "conj": torch.ones(n, dtype=torch.complex64).conj(),
            "neg": torch._neg_view(torch.ones(n)),
            "grad": torch.ones(n, requires_grad=True),
            "param": torch.nn.Parameter(torch.zeros(n)),
        }
    )
    return out


@pytest.mark.parametrize("name", CARRIERS)
@pytest.mark.parametrize("n", [1, 100, 20_000], ids=lambda n: f"{n}-elements")
def test_small_tensors_stay_lifted_and_round_trip_exactly(name, n):
    expected = tensors(n)
    got, header, _ = round_trip(expected, name)
    assert header.n_tensors == len(expected)  # tensors are always lifted: they arrive on the receiver's device
    for key, want in expected.items():
        value = got[key]
        assert type(value) is type(want) and value.dtype == want.dtype and value.shape == want.shape, key
        assert torch.equal(value.detach().resolve_conj().resolve_neg(), want.detach().resolve_conj().resolve_neg())
        assert value.requires_grad == want.requires_grad and not value.is_conj() and not value.is_neg(), key
        assert value.numel() == 0 or value.data_ptr() != want.data_ptr(), key


def test_a_numpy_entry_of_a_dtype_numpy_lacks_is_a_frame_error():
    entry = _tensors.ENTRY.pack(_tensors.DTYPES.index("bfloat16"), _tensors.NUMPY | _tensors.INLINE, 1, 4, 0)
    with pytest.raises(objcomm.FrameError, match="numpy"):
        _tensors.parse_table(memoryview(entry + _tensors.DIM.pack(2)), 1, 4)


def test_hostile_msgpack_array_extensions_are_refused_as_before():
    ext = msgpack.ExtType
    s = serializers.get("msgpack")
    bad = {
        "nested shape": ["<f8", [[1]], b"x" * 8],
        "long shape": ["<f8", [1] * 40, b"x" * 8],
        "short data": ["<f8", [4], b"x" * 8],
        "negative size": ["<f8", [-1], b""],
        "object dtype": ["|O", [1], b"x" * 8],
        "extension inside": ["<f8", [1], ext(1, msgpack.packb([1]))],
        "map inside": ["<f8", {"a": 1}, b"x" * 8],
        "bad code points": ["<U1", [1], b"\xff\xff\xff\xff"],
    }
    for what, fields in bad.items():
        with pytest.raises(serializers.DecodeError):
            s.loads(msgpack.packb(ext(8, msgpack.packb(fields))))
        assert what
    assert s.loads(msgpack.packb(ext(8, msgpack.packb(["<f8", [], b"\x00" * 8])))).shape == ()
    for raw in (b"\xdc\x00\x20" * 1000, b"\x93\xa3<f8\xdd\xff\xff\xff\xff", b"\x93\xa3<f8\x91\x01"):
        with pytest.raises(serializers.DecodeError):  # truncated headers, nested or huge: refused, not allocated
            s.loads(msgpack.packb(ext(8, raw)))


def test_the_arrays_bench_payload_is_many_small_arrays():
    payload = BUILTIN["arrays"]
    assert payload.scalable
    one = payload.make(0, parse_size("1KB"))
    hundred = payload.make(0, parse_size("80KB"))
    assert len(one) == 1 and 90 <= len(hundred) <= 110
    assert all(type(a) is np.ndarray and a.shape == (ARRAY_LENGTH,) and a.dtype == np.float64 for a in hundred.values())
    assert 0.8 * 80 * 1024 <= reference_size(hundred) <= 1.25 * 80 * 1024
    assert not np.array_equal(payload.make(1, 1024)["layer0000.stats"], one["layer0000.stats"])


def _row(
    payload: str, serializer: str, safe: bool, ratio: float, op: str = "all_gather", fidelity: str = "exact"
) -> Row:
    return Row(
        payload=payload,
        size=1024,
        nbytes=1024,
        serializer=serializer,
        safe=safe,
        op=op,
        fidelity=fidelity,
        note="",
        encoded_bytes=1024,
        encode_s=1e-5,
        decode_s=1e-5,
        latency_s=ratio * 1e-3,
        torch_latency_s=1e-3,
        ratio=ratio,
        throughput_Bps=1024 / (ratio * 1e-3),
        repeats=5,
    )


def _result(rows: list, ops=("all_gather",)) -> Result:
    meta = {
        "ops": list(ops),
        "world_size": 2,
        "backend": "gloo",
        "objcomm": "0",
        "torch": "0",
        "python": "3",
        "repeat": 5,
    }
    return Result(meta, rows)


def test_the_recommendation_says_when_torch_is_faster():
    result = _result(
        [
            _row("arrays", "pickle", False, 1.30),
            _row("arrays", "msgpack", True, 1.45),
            _row("metrics", "pickle", False, 0.50),
            _row("metrics", "msgpack", True, 0.60),
        ]
    )
    lines = format_recommendations(result.recommendations(), ["all_gather"])
    arrays_line = next(line for line in lines if line.strip().startswith("arrays"))
    metrics_line = next(line for line in lines if line.strip().startswith("metrics"))
    faster = "torch.distributed is faster here (fastest exact: pickle (1.30× torch)): keep all_gather_object"
    assert faster in arrays_line
    assert "fastest safe: msgpack (exact, 1.45× torch), slower than torch, whose pickle is not safe" in arrays_line
    assert "fastest exact: pickle (0.50× torch)" in metrics_line and "faster here" not in metrics_line
    assert "fastest safe: msgpack (exact, 0.60× torch)" in metrics_line and "slower" not in metrics_line
    recommendations = {r["payload"]: r for r in to_json(result)["recommendations"]}
    assert recommendations["arrays"]["torch_faster"] and not recommendations["metrics"]["torch_faster"]
    assert "keep all_gather_object for this payload" in format_table(result)


def test_the_recommendation_never_calls_a_slower_serializer_the_fastest_choice():
    # a geometric mean over ops: 0.8 and 1.5 give 1.10, slower than torch overall
    rows = [
        _row("arrays", "pickle", False, 0.8, "all_gather"),
        _row("arrays", "pickle", False, 1.5, "broadcast"),
        _row("arrays", "restricted-pickle", True, 0.9, "all_gather"),
        _row("arrays", "restricted-pickle", True, 0.95, "broadcast"),
    ]
    lines = format_recommendations(_result(rows).recommendations(), ["all_gather", "broadcast"])
    assert "torch.distributed is faster here (fastest exact: restricted-pickle (0.92× torch))" not in lines[1]
    assert "fastest exact: restricted-pickle (0.92× torch)" in lines[1]
    rows = [_row("arrays", "pickle", False, 1.2, "all_gather"), _row("arrays", "pickle", False, 1.5, "broadcast")]
    lines = format_recommendations(_result(rows).recommendations(), ["all_gather", "broadcast"])
    assert "torch.distributed is faster here" in lines[1] and "keep its object collectives" in lines[1]
    assert "no safe serializer carries it" in lines[1]


def test_a_converted_serializer_faster_than_torch_does_not_hide_that_torch_beats_the_exact_ones():
    rows = [_row("config", "pickle", False, 1.1), _row("config", "json", True, 0.7, fidelity="converted")]
    rec = _result(rows).recommendations()[0]
    line = format_recommendations([rec], ["all_gather"])[1]
    assert "torch.distributed is faster here (fastest exact: pickle (1.10× torch))" in line
    assert "fastest safe: json (converted, 0.70× torch)" in line and not rec.torch_faster


def gather_small_arrays(name: str) -> bool:
    rank = torch.distributed.get_rank()
    mine = {f"layer{i:03d}": np.full(100, rank * 1000 + i, dtype=np.float64) for i in range(100)}
    mine["0-d"], mine["big-endian"] = np.array(rank), (np.arange(5) + rank).astype(">i4")
    got = objcomm.all_gather(mine, serializer=name)
    for r, theirs in enumerate(got):
        assert theirs["layer042"].dtype == np.float64 and theirs["layer042"][0] == r * 1000 + 42
        assert theirs["0-d"].shape == () and theirs["big-endian"].dtype.str == ">i4"
        assert theirs["layer000"].flags.writeable
    return True


@pytest.mark.parametrize("name", CARRIERS)
def test_all_gather_of_many_small_arrays_on_two_ranks(name):
    assert all(get_pool(2).run(gather_small_arrays, name))
