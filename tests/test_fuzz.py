"""Property-based: random and mutated bytes into the frame decoder and every serializer's loads.

Only documented exceptions come out and nothing hangs. No allocation follows a declared length
(peak traced memory stays proportional to the input) in the frame decoder and the safe
serializers; plain pickle and cloudpickle allocate whatever a length opcode declares (stdlib
behaviour), one more reason they are for trusted senders only. 11,000 cases in total.
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from _builtins import BUILTINS
from _hostile import FUZZ_SCALE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import serializers
from objcomm import ObjcommError
from objcomm._format import frame as frame_format

pytestmark = pytest.mark.timeout(300)

SAMPLE = {"ids": [1, 2, 3], "t": (1.5, "x"), "b": b"\x00\x01", "n": None, 7: {"deep": [[{}]]}}
FUZZ = settings(
    max_examples=1000,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _valid(name: str) -> bytes:
    s = serializers.get(name)
    plain = {"ids": [1, 2, 3], "s": "x", "n": None}
    return bytes(s.dumps({"json": plain, "msgspec": {**plain, "b": b"\x00", "t": (1.5, "x")}}.get(name, SAMPLE)))


@st.composite
def mutated(draw, base: bytes) -> bytes:
    """A valid payload with bytes flipped, cut, duplicated or spliced in."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "set-int"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[at : at + draw(st.integers(1, 16))]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "set-int" and len(data) >= at + 8:  # plant a huge length field
            data[at : at + 8] = draw(st.sampled_from([b"\xff" * 8, b"\x7f\xff\xff\xff\xff\xff\xff\xff"]))
    return bytes(data)


def _bounded(call, data: bytes, check_memory: bool = True) -> None:
    """Run call(data); allow only objcomm errors; check peak allocation stays proportional to the input."""
    tracemalloc.start()  # only around the call: tracing hypothesis itself would dominate the run time
    try:
        call(data)
    except ObjcommError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert not check_memory or peak < (1 << 20) + 64 * len(data), (
        f"{peak:,} bytes allocated for {len(data)} input bytes"
    )


@pytest.mark.parametrize("name", BUILTINS)
@FUZZ
@given(data=st.data())
def test_loads_random_and_mutated(name, data):
    """1,000 cases per serializer: half random bytes, half mutated valid payloads."""
    s = serializers.get(name)
    payload = data.draw(st.one_of(st.binary(max_size=256), mutated(_valid(name))))
    try:
        _bounded(s.loads, payload, check_memory=s.safe)
    except MemoryError:  # stdlib pickle asked for more than exists: still a clean failure, never for safe ones
        assert not s.safe


def _frame(name: str, obj: object = None) -> bytes:
    obj = {"ids": [1, 2], "s": "x"} if obj is None else obj
    return frame_format.encode(obj, serializers.get(name), max_bytes=1 << 20).frame.tobytes()


# the last one carries a tensor table and inline tensor data
FRAMES = [_frame(n) for n in ("msgpack", "json", "restricted-pickle")] + [
    _frame("msgpack", {"t": torch.arange(6).reshape(2, 3), "h": torch.ones(2, dtype=torch.float16)})
]


def _decode(data: bytes) -> None:
    view = memoryview(data)
    try:
        header = frame_format.parse_header(view)
    except ObjcommError:
        return
    if header.is_error:
        frame_format.read_error(view, header)
    else:
        accept = frozenset({"msgpack", "json", "restricted-pickle"})
        frame_format.decode(frame_format.Incoming(view), sender=0, accept=accept)


@FUZZ
@given(payload=st.binary(max_size=512))
def test_frame_decoder_random_bytes(payload):
    _bounded(_decode, payload)


@settings(FUZZ, max_examples=3000 * FUZZ_SCALE)  # OBJCOMM_FUZZ_SCALE=N: N times as many
@given(data=st.data())
def test_frame_decoder_mutated_frames(data):
    base = data.draw(st.sampled_from(FRAMES))
    _bounded(_decode, data.draw(mutated(base)))
