"""Optional compression: recorded in the frame, so receivers need no setting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist
from _child import run_in_child

import objcomm
import serializers
from objcomm._format import compression as _compression
from objcomm._format import frame as _frame

pytestmark = pytest.mark.timeout(120)

COMPRESSIBLE = {"text": "the same words again " * 5000, "ids": list(range(2000))}


def _header(obj, compression):
    out = _frame.encode(obj, serializers.get("pickle"), max_bytes=1 << 30, compression=compression)
    return out, _frame.parse_header(out.frame)


@pytest.mark.parametrize("compression, code", [("zstd", 1), ("lz4", 2), ("auto", 2), (None, 0)])
def test_compression_is_recorded_and_round_trips(compression, code):
    out, header = _header(COMPRESSIBLE, compression)
    assert header.compression == code
    if code:
        assert header.payload_len < header.raw_len / 5
    assert _frame.decode(_frame.Incoming(out.frame), sender=0, accept=None) == COMPRESSIBLE


def test_auto_leaves_incompressible_and_small_payloads_alone():
    assert _header(os.urandom(200_000), "auto")[1].compression == 0
    assert _header({"tiny": 1}, "auto")[1].compression == 0


def test_bad_setting_and_decompression_bomb_are_refused():
    with pytest.raises(ValueError, match="compression must be one of"):
        objcomm.Communicator(compression="gzip")
    out, header = _header(COMPRESSIBLE, "zstd")
    with pytest.raises(objcomm.TooLargeError, match="expands to"):
        _frame.decode(_frame.Incoming(out.frame), sender=0, accept=None, max_bytes=1000)


def _expand_lying_frame(declared: int) -> str:
    """In a child: a zstd frame of a few bytes that declares ``declared`` bytes, decoded; what it raised."""
    import zstandard

    data = zstandard.ZstdCompressor().compress(b"x")
    try:
        _compression.decompress(_compression.ZSTD, memoryview(data), declared, max_bytes=1 << 40)
    except MemoryError:
        return "MemoryError"
    except objcomm.ObjcommError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "decompressed"


def test_a_frame_that_declares_gigabytes_costs_what_it_expands_to():
    """An attacker's find: a 57-byte zstd frame declaring 2 GiB had a 2 GiB buffer zeroed before anything was
    decompressed (within max_bytes, which defaults to 8 GiB). The buffer grows with the output now: under a 64 MiB
    memory cap the frame is refused as short, with no MemoryError."""
    got = run_in_child(_expand_lying_frame, 2 << 30, memory_budget=64 << 20)
    assert got == "DecodeError: zstd payload expanded to 1 bytes, the frame declared 2,147,483,648", got


def test_missing_library_is_a_clear_error():
    code = (
        "import sys; sys.modules['zstandard'] = None\n"
        "import objcomm\n"
        "try:\n"
        "    objcomm.Communicator(compression='zstd')\n"
        "except objcomm.MissingDependencyError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "pip install zstandard" in out.stdout


def mixed_compression() -> list:
    rank = dist.get_rank()
    setting = [None, "zstd", "lz4", "auto"][rank % 4]
    return objcomm.all_gather({"rank": rank, **COMPRESSIBLE}, compression=setting, serializer="msgpack")


def test_ranks_may_compress_differently(ranks4):
    expected = [{"rank": r, **COMPRESSIBLE} for r in range(4)]
    assert ranks4.run(mixed_compression) == [expected] * 4


def test_codes_are_stable():
    assert _compression.CODES == {"zstd": 1, "lz4": 2}
