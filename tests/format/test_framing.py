"""The wire format: golden frames decode, and every malformed frame is refused before allocation."""

from __future__ import annotations

import pathlib
import struct

import pytest
import torch

import serializers
from objcomm import ContentRefusedError, FrameError, UnknownSerializerError
from objcomm._format import frame as _frame

pytestmark = pytest.mark.timeout(30)

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"
GOLDEN_OBJECT = {"metrics": {"loss": 0.25}, "ids": [1, 2, 3], "name": "golden"}


def frame_bytes(obj=GOLDEN_OBJECT, name="msgpack") -> bytearray:
    return bytearray(_frame.encode(obj, serializers.get(name), max_bytes=1 << 30).frame)


@pytest.mark.parametrize("name", ["pickle", "msgpack", "json"])
def test_golden_frames_still_decode(name):
    data = (GOLDEN / f"v1-{name}.frame").read_bytes()
    assert _frame.decode(_frame.Incoming(memoryview(data)), sender=0, accept=None) == GOLDEN_OBJECT
    # and today's encoder writes the very same bytes: a format change is never silent
    assert bytes(frame_bytes(name=name)) == data


def test_golden_error_frame():
    view = memoryview((GOLDEN / "v1-error.frame").read_bytes())
    header = _frame.parse_header(view)
    assert header.is_error and header.serializer == ""
    assert _frame.read_error(view, header) == ("ValueError", "boom on rank 3")


def test_header_layout_is_documented_size():
    assert _frame.HEADER.size == 40
    data = frame_bytes()
    magic, version, flags, compression, name_len = struct.unpack_from("<4sBBBB", data)
    assert (magic, version, flags, compression, name_len) == (b"OBJC", 1, 0, 0, len("msgpack"))
    assert data[40:47] == b"msgpack"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.__setitem__(slice(0, 4), b"PKL\x05"), "not an objcomm frame"),
        (lambda d: d.__setitem__(4, 9), "version 9 is unknown"),
        (lambda d: d.__delitem__(slice(len(d) - 1, len(d))), "lengths disagree"),
        (lambda d: d.extend(b"!"), "lengths disagree"),
        (lambda d: d.__delitem__(slice(20, None)), "truncated frame"),
        (lambda d: struct.pack_into("<Q", d, 16, 2**62), "lengths disagree"),
        (lambda d: d.__setitem__(slice(40, 47), b"ms\xffpack"), "not ASCII"),
    ],
    ids=["magic", "version", "short-by-one", "long-by-one", "truncated-header", "huge-length", "name"],
)
def test_malformed_frames_raise_frame_error(mutate, message):
    data = frame_bytes()
    mutate(data)
    with pytest.raises(FrameError, match=message):
        _frame.decode(_frame.Incoming(memoryview(data)), sender=2, accept=None)


def test_accept_refuses_before_the_payload_is_touched():
    data = frame_bytes(name="pickle")
    with pytest.raises(
        ContentRefusedError, match=r"rank 5 sent a 'pickle' payload.*accepts only \['json', 'msgpack'\]"
    ):
        _frame.decode(_frame.Incoming(memoryview(data)), sender=5, accept=frozenset({"msgpack", "json"}))


def test_a_refusal_names_what_accept_lists_that_no_serializer_is_called():
    """A newcomer's find: ``accept=["msgpak"]`` refused every sender, and the message named only the sender's
    serializer; it now says that no serializer of that name is registered here. A correct list adds nothing."""
    data = frame_bytes(name="pickle")
    with pytest.raises(ContentRefusedError, match=r"no serializer named 'msgpak' is registered.*misspelling"):
        _frame.decode(_frame.Incoming(memoryview(data)), sender=5, accept=frozenset({"msgpak"}))
    with pytest.raises(ContentRefusedError) as refused:
        _frame.decode(_frame.Incoming(memoryview(data)), sender=5, accept=frozenset({"msgpack"}))
    assert "registered" not in str(refused.value)


def test_unknown_serializer_names_it_and_lists_registered():
    data = frame_bytes(name="json")
    data[40:44] = b"yaml"
    with pytest.raises(UnknownSerializerError, match=r"'yaml'.*registered: .*msgpack"):
        _frame.decode(_frame.Incoming(memoryview(data)), sender=1, accept=None)


def test_error_frames_fit_their_limit():
    for limit in (128, 200, 4096):
        frame = _frame.error_frame(RuntimeError("x" * 10_000), limit)
        assert frame.error and frame.frame.nbytes <= limit
        view = frame.frame
        kind, message = _frame.read_error(view, _frame.parse_header(view))
        assert kind == "RuntimeError" and message.startswith("x")


def test_error_frames_stay_readable_whatever_the_limit_and_the_type_name():
    """A report is at most MAX_ERROR_REPORT whatever the slot (a helper's find: slot_bytes past 1 MiB made every
    report unreadable); a type's name that leaves no room is cut after the message, ASCII or not; a report read back
    read back is cut again the same way."""

    def read(out: _frame.Outgoing) -> tuple:
        view = memoryview(out.frame)
        return _frame.read_error(view, _frame.parse_header(view))

    huge = _frame.error_frame(RuntimeError("E" * 3_000_000), 2 << 20)
    assert huge.frame_nbytes <= _frame.MAX_ERROR_REPORT and read(huge)[1].startswith("E" * 1000)
    for name in ("E" * 2_000, "ОшибкаЧтенияКонфигурации" * 7):  # 2,000 ASCII; 168 non-ASCII (6 JSON bytes each)
        long_named = type(name, (Exception,), {})("x" * 5_000)
        for limit in (104, 1_000, 4_072):
            out = _frame.error_frame(long_named, limit)
            assert out.frame_nbytes <= limit, (name[:10], limit)
            kind, message = read(out)
            assert kind[:8] == name[:8] or kind in ("", "…"), (limit, kind)  # cut, never another name
    again = _frame.error_frame(read(huge), 1_000)
    assert again.frame_nbytes <= 1_000 and read(again)[0] == "RuntimeError" and read(again)[1].startswith("E" * 800)


def test_frames_are_writable_host_buffers_that_become_tensors_without_copy():
    out = _frame.encode([1, 2], serializers.get("pickle"), max_bytes=1 << 20)
    assert isinstance(out.frame, memoryview) and not out.frame.readonly
    tensor = out.frame_tensor()
    assert tensor.dtype == torch.uint8 and tensor.numel() == out.frame.nbytes
    tensor[0] = ord("X")
    assert out.frame[0] == ord("X")  # shared memory, not a copy
