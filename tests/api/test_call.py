"""objcomm._api.call: decoding every rank's frame at once (Call.decode_all) gives what decoding each alone gives."""

from __future__ import annotations

import struct
from typing import Any, Callable, List, Optional, Tuple

import pytest
import torch

from objcomm._api import call as call_module
from objcomm._api.call import PLAIN_AHEAD, Call
from objcomm._format import frame as _frame
from objcomm._format.message import Incoming
from objcomm._format.plain_slot import plain_payload
from objcomm._settings import CallOptions
from serializers import Serializer, registry


def _item(obj: Any, serializer: str = "pickle", **encoding: Any) -> Incoming:
    out = _frame.encode(obj, registry.guarded(serializer), max_bytes=1 << 40, **encoding)
    return Incoming(memoryview(bytes(out.frame)), list(out.tensors), error=out.error)


def _changed(item: Incoming, at: int, data: bytes) -> Incoming:
    frame = bytearray(item.frame)
    frame[at : at + len(data)] = data
    return Incoming(memoryview(frame), item.tensors)


def _plain(n: int) -> List[Incoming]:
    return [_item({"rank": r, "values": list(range(r % 7))}) for r in range(n)]


def _outcome(decode: Callable[[], List[Any]]) -> Tuple[str, Any]:
    try:
        objects = decode()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", [o.tolist() if isinstance(o, torch.Tensor) else o for o in objects]


NAME_AT = _frame.HEADER.size  # where a frame's serializer name starts
PAYLOAD_LEN_AT, RAW_LEN_AT = 16, 24  # the header's payload_len and raw_len (docs/wire-format.md)


def _corpora() -> List[Tuple[str, List[Incoming], Optional[List[str]]]]:
    """Each case's frames, then enough plain ones that the first plain frame takes the fast path for what follows."""
    plain = _plain(40)
    json_frame = _item({"rank": "j"}, "json")
    lying_raw = _changed(plain[3], RAW_LEN_AT, struct.pack("<Q", 1))  # no compression: raw_len is not read
    tail = plain[20 : 21 + PLAIN_AHEAD]
    return [(name, [*items, *tail], accept) for name, items, accept in _cases(plain, json_frame, lying_raw)]


def _cases(plain: List[Incoming], json_frame: Incoming, lying_raw: Incoming) -> List[Any]:
    return [
        ("plain", plain[:20], None),
        ("serializers in turn", [plain[0], json_frame, plain[1], _item([1, 2], "msgpack"), plain[2]], None),
        ("compressed between", [plain[0], _item(b"z" * 5000, compression="zstd"), plain[1]], None),
        ("tensors between", [plain[0], _item(torch.arange(5), inline_tensor_bytes=0), plain[1]], None),
        ("raw_len that lies", [plain[0], lying_raw, plain[4]], None),
        (
            "payload spoilt",
            [*plain[:5], _changed(plain[5], len(plain[5].frame) - 3, b"\xff\xff\xff"), *plain[6:20]],
            None,
        ),
        ("another name, same length", [plain[0], _changed(plain[1], NAME_AT, b"ma"), plain[2]], None),
        ("a name not ASCII", [plain[0], _changed(plain[1], NAME_AT, b"\xff"), plain[2]], None),
        ("lengths disagree", [plain[0], _changed(plain[1], PAYLOAD_LEN_AT, struct.pack("<Q", 9)), plain[2]], None),
        ("truncated", [plain[0], Incoming(plain[1].frame[:30], []), plain[2]], None),
        ("an error report", [plain[0], Incoming(_frame.error_frame(ValueError("no"), 4000).frame, []), plain[1]], None),
        ("a name accept refuses", [json_frame, plain[0]], ["json"]),
        ("accepted, then one refused", [plain[0], plain[1], json_frame], ["pickle"]),
    ]


@pytest.mark.parametrize("case", [c[0] for c in _corpora()])
def test_decoding_every_rank_at_once_is_decoding_each_alone(case, monkeypatch):
    """Once one plain frame is decoded, the next plain frames of its serializer skip the header's objects
    (plain_slot.plain_payload): every outcome, a refusal or an error first of all, stays the same."""
    _, items, accept = next(c for c in _corpora() if c[0] == case)
    call = Call(CallOptions(accept=accept), registry.guarded("pickle"), None)
    each = _outcome(lambda: [call.decode(item, r) for r, item in enumerate(items)])
    asked: List[int] = []
    monkeypatch.setattr(call_module, "plain_payload", lambda *a: asked.append(1) or plain_payload(*a))
    assert _outcome(lambda: call.decode_all(items)) == each
    assert asked, "the fast path was not taken"  # (every case opens with a plain frame and more than 8 follow)
    if case == "plain":
        assert each[0] == "ok"
    elif case not in ("serializers in turn", "compressed between", "tensors between", "raw_len that lies"):
        assert each[0] != "ok", each  # (each case but those fails on some rank)


class _Swapping(Serializer):
    """Replaces itself in the registry (``replace=True``) while it decodes its second payload, b"1"."""

    name, safe = "swapping", True

    def dumps(self, obj: Any, /, **_: Any) -> bytes:
        return repr(obj).encode()

    def loads(self, data: Any, /, **_: Any) -> Any:
        if bytes(data) == b"1":
            registry.register(_Swapped(), replace=True)
        return "before", bytes(data).decode()


class _Swapped(_Swapping):
    def loads(self, data: Any, /, **_: Any) -> Any:
        return "after", bytes(data).decode()


class _Leaving(_Swapping):
    """Unregisters itself while it decodes."""

    name = "leaving"

    def loads(self, data: Any, /, **_: Any) -> Any:
        registry.unregister("leaving")
        return bytes(data).decode()


@pytest.mark.parametrize("kind, count", [(_Swapping, 3 + PLAIN_AHEAD), (_Leaving, 1), (_Leaving, 2 + PLAIN_AHEAD)])
def test_a_registry_changed_while_a_call_decodes_is_seen_as_decoding_each_alone_sees_it(kind, count):
    """decode_all keeps the serializer it found for plain frames only while the registry's version is the one it
    found it in: a serializer replaced or unregistered mid-call (by its own loads here; another thread alike) decodes,
    or fails, each next frame as decode would."""
    call = Call(CallOptions(), registry.guarded("pickle"), None)
    registry.register(kind(), replace=True)
    try:
        items = [_item(r, kind.name) for r in range(count)]
        registry.register(kind(), replace=True)
        each = _outcome(lambda: [call.decode(item, r) for r, item in enumerate(items)])
        registry.register(kind(), replace=True)
        assert _outcome(lambda: call.decode_all(items)) == each
    finally:
        if kind.name in registry.available():
            registry.unregister(kind.name)
    if kind is _Swapping:
        assert each == ("ok", [("before", "0"), ("before", "1"), *(("after", str(r)) for r in range(2, count))])
    else:
        assert each[0] == ("ok" if count == 1 else "UnknownSerializerError"), each
