"""Regenerate the golden files of docs/wire-format.md: ``python tests/golden/make_golden.py``.

Every value and every slot is built here from fixed content, so the files are deterministic;
tests/format/test_wire_format.py imports this module to rebuild the same values and compare byte for
byte. Regenerate only for a deliberate format change (and bump the version it concerns): a golden
file that changes is a wire format that changed. The v1-{pickle,msgpack,json,error}.frame files
are tests/format/test_framing.py's and are not written here.
"""

from __future__ import annotations

import contextlib
import pathlib
import sys
import uuid
from typing import Any, Dict, Iterator

import numpy as np
import torch

import serializers
from objcomm._format import frame as _frame
from objcomm._format import slot as _slot
from objcomm._transport import rounds as _rounds

HERE = pathlib.Path(__file__).parent

SLOT_BYTES = 128  # the smallest slot objcomm allows: every slot shape is reachable with tiny frames
SLOT_LIMIT = 1 << 30  # the max_bytes written into every golden slot
CODEC_NAME = "wire-format-golden.Point"


class Point:
    """A type neither msgpack nor JSON carries: it travels through a registered codec."""

    __slots__ = ("x", "y")

    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: Any) -> bool:
        return type(other) is Point and (self.x, self.y) == (other.x, other.y)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Point({self.x}, {self.y})"


def _check_point(value: Any) -> None:
    if not (type(value) is list and len(value) == 2 and all(type(v) is int for v in value)):
        raise ValueError("expected [x, y]")


@contextlib.contextmanager
def codec_registered() -> Iterator[None]:
    """``Point``'s codec, registered under a name no other test uses, and removed afterwards."""
    serializers.register_type(
        Point, encode=lambda p: [p.x, p.y], decode=lambda v: Point(*v), name=CODEC_NAME, validate=_check_point
    )
    try:
        yield
    finally:
        serializers.unregister_type(CODEC_NAME)


# -- the values ---------------------------------------------------------------------------------
def tensor_object() -> Dict[str, Any]:
    """One tensor small enough to ride inline (16 bytes), one sent out of band (32 bytes), one alias."""
    small = torch.arange(4, dtype=torch.int32)
    big = torch.arange(8, dtype=torch.float32).reshape(2, 4).requires_grad_(True)
    return {"inline": small, "out_of_band": big, "alias": small}


TENSOR_INLINE_BYTES = 16  # inline_tensor_bytes for the tensor frames: 16 bytes inline, 32 out of band


def compressible_object() -> Dict[str, Any]:
    return {"text": "objcomm " * 64, "ids": list(range(32))}


def msgpack_codec_object() -> Dict[str, Any]:
    # a set of small ints iterates in a fixed order (a set of str would not: hash randomization)
    return {
        "point": Point(1, 2),
        "pair": (1, "a"),
        "set": {3, 1, 2},
        # big-endian: torch has no such dtype, so the frame keeps it in the payload (ext 8); a
        # little-endian one would be lifted into the tensor table
        "array": np.arange(6, dtype=">i4").reshape(2, 3),
    }


def json_codec_object() -> Dict[str, Any]:
    return {"point": Point(1, 2), "ids": [1, 2, 3]}


def restricted_object() -> Dict[str, Any]:
    """What restricted-pickle writes as calls to serializers._rebuild (no lift: tensors stay in band)."""
    return {
        "array": np.arange(6, dtype="<i4").reshape(2, 3),
        "tensor": torch.tensor([[1.5, 2.5]], dtype=torch.float32),
        "scalar": np.float64(0.5),
        "dtype": np.dtype("<f4"),
        "parameter": torch.nn.Parameter(torch.ones(2)),
        "id": uuid.UUID(int=42),
    }


# -- frames, payloads and slots --------------------------------------------------------------------
def encode(obj: Any, name: str, **options: Any) -> _rounds.Outgoing:
    return _frame.encode(obj, serializers.get(name), max_bytes=1 << 30, **options)


def frames() -> Dict[str, _rounds.Outgoing]:
    """File name -> what objcomm sends for it (codecs must be registered)."""
    return {
        "v1-tensors-msgpack.frame": encode(tensor_object(), "msgpack", inline_tensor_bytes=TENSOR_INLINE_BYTES),
        "v1-tensors-restricted-pickle.frame": encode(
            tensor_object(), "restricted-pickle", inline_tensor_bytes=TENSOR_INLINE_BYTES
        ),
        "v1-zstd.frame": encode(compressible_object(), "msgpack", compression="zstd"),
        "v1-lz4.frame": encode(compressible_object(), "msgpack", compression="lz4"),
        "v1-msgpack-codec.frame": encode(msgpack_codec_object(), "msgpack"),
        "v1-json-codec.frame": encode(json_codec_object(), "json"),
    }


def payloads() -> Dict[str, bytes]:
    """File name -> a serializer's bare output (no frame)."""
    return {"restricted-pickle.payload": bytes(serializers.get("restricted-pickle").dumps(restricted_object()))}


def _frame_with_oob(obj: Any) -> _rounds.Outgoing:
    return encode(obj, "msgpack", inline_tensor_bytes=0)


def slot_outgoing() -> Dict[str, _rounds.Outgoing]:
    """Shape -> the Outgoing whose slot shows it (frame lengths noted for SLOT_BYTES = 128: 104 inline)."""
    plain = (HERE / "v1-msgpack.frame").read_bytes()  # 91 bytes, no tensors
    error = (HERE / "v1-error.frame").read_bytes()  # 91 bytes
    overflowing = (HERE / "v1-pickle.frame").read_bytes()  # 123 bytes, no tensors
    one = torch.arange(4, dtype=torch.int8)
    return {
        "inline": _rounds.Outgoing(memoryview(bytearray(plain))),
        # 85-byte frame + count + 1 size: 24 + 85 + 12 <= 128
        "inline-listed": _frame_with_oob({"t": one}),
        # 100-byte frame: 24 + 100 + 12 > 128, so its one size is not listed (only the frame tells)
        "inline-unlisted": _frame_with_oob({"t" * 16: one}),
        "outside-listed": _frame_with_oob({"a": one, "b": one.clone(), "note": "x" * 20}),
        "outside-no-tensors": _rounds.Outgoing(memoryview(bytearray(overflowing))),
        # 13 sizes: 24 + 4 + 13 * 8 > 128
        "outside-unlisted": _frame_with_oob([torch.full((i + 1,), i, dtype=torch.int8) for i in range(13)]),
        "error": _rounds.Outgoing(memoryview(bytearray(error)), error=True),
        "round2": _rounds.Outgoing(memoryview(bytearray(plain))),
    }


def fill(shape: str, out: _rounds.Outgoing) -> bytes:
    slot = bytearray(SLOT_BYTES)
    _slot.fill_slot(memoryview(slot), out, SLOT_LIMIT, round2=shape == "round2")
    return bytes(slot)


def slots() -> Dict[str, bytes]:
    return {f"slot-{shape}.slot": fill(shape, out) for shape, out in slot_outgoing().items()}


def main() -> None:
    with codec_registered():
        files = {name: bytes(out.frame) for name, out in frames().items()}
        oob = frames()["v1-tensors-msgpack.frame"].tensors
    assert len(oob) == 1
    files["v1-tensors.oob0"] = oob[0].numpy().tobytes()
    files.update(payloads())
    files.update(slots())
    for name, data in files.items():
        (HERE / name).write_bytes(data)
        print(f"{name}: {len(data)} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
