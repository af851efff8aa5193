"""JSON backend (orjson): portable and safe, and strict about what JSON cannot say.

- tuples become lists (converted); everything else JSON has no word for is refused:
  non-str dict keys, sets, bytes, NaN/Infinity (orjson would write ``null``), ints beyond 64 bits,
  datetimes, numpy, tensors;
- registered codecs travel as tagged objects ``{"__objcomm_type__": name, "value": ...}``; a dict of the caller's
  with exactly those two keys would decode as one, and is refused.

Decoding hostile input: orjson (3.9.15 or later: earlier versions overflow the C stack on deep
input) refuses nesting over 1024 levels; tagged values are resolved only ``MAX_TAG_DEPTH`` (256)
levels deep; every failure is a :class:`DecodeError`.
"""

from __future__ import annotations

import math
import re
from typing import Any, List

from serializers._codecs import CodecRegistry, codecs
from serializers._errors import DecodeError, EncodeError, decoding
from serializers._path import describe, locate
from serializers._protocol import Buffer, Restore, Serializer

TAG = "__objcomm_type__"
MAX_TAG_DEPTH = 256
_TAG_BYTES = f'"{TAG}"'.encode()
# the tag, or an escape of a character it holds ("_", "a"-"z"), which could spell it (an attacker's find:
# "\u005f_objcomm_type__" skipped the codecs); orjson writes no such escape, so honest payloads do not take the
# slower path for it. Each looked for as a literal first (re searches memoryviews without a copy): one pattern of
# both took 87 ms on an 11 MB payload, the literal 8 ms (orjson's loads: 309 ms)
_TAG_PATTERN = re.compile(re.escape(_TAG_BYTES))
_ESCAPE = re.compile(rb"\\u00")
_ESCAPED = re.compile(rb"\\u00(?:5[fF]|[67][0-9a-fA-F])")
_ESCAPED_TEXT = re.compile(r"\\u00(?:5[fF]|[67][0-9a-fA-F])")
_NATIVE = (type(None), bool, str, list, tuple, dict)
_HINTS = {
    "dict key": "JSON object keys are strings; convert the keys or use msgpack or pickle",
    "float": "JSON has no NaN or Infinity; use msgpack or pickle",
}
_DEFAULT_HINT = "msgpack or pickle can; or register a codec with serializers.register_type()"
# what msgpack carries itself (beside JSON's types): for any other value json's hint names pickle and codecs only
_MSGPACK_CARRIES = {"int", "bytes", "bytearray", "set", "frozenset", "complex", "datetime", "ndarray", "OrderedDict"}
_CLASS_HINT = "pickle can; or register a codec with serializers.register_type() (for json and msgpack)"


def _may_hold_tags(data: Buffer) -> bool:
    """Whether a payload may hold a codec tag: the tag itself, or an escape that could spell one of its characters."""
    if isinstance(data, str):
        return TAG in data or "\\u00" in data and _ESCAPED_TEXT.search(data) is not None
    return _TAG_PATTERN.search(data) is not None or (
        _ESCAPE.search(data) is not None and _ESCAPED.search(data) is not None
    )


def _orjson() -> Any:
    import orjson

    return orjson


class JsonSerializer(Serializer):
    """orjson: portable, safe, strict; tuples become lists, other non-JSON types are refused."""

    name = "json"
    safe = True
    description = "JSON via orjson: portable, safe; tuples become lists, non-JSON types refused unless a codec"
    _raises_own_errors = True

    def __init__(self, registry: CodecRegistry = codecs) -> None:
        self._codecs = registry

    def _default(self, value: Any) -> Any:
        codec = self._codecs.for_value(value)
        if codec is None:
            raise TypeError(f"no JSON encoding for {describe(value)}")
        return {TAG: codec.name, "value": codec.encode(value)}

    def dumps(self, obj: Any, /, **_: Any) -> Buffer:
        orjson = _orjson()
        options = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_SUBCLASS
        encoded: List[Any] = []  # what the codecs wrote: a "__objcomm_type__" beyond their tags is the caller's own

        def tagged(value: Any) -> Any:
            tag = self._default(value)
            encoded.append(tag["value"])
            return tag

        try:
            data = orjson.dumps(obj, default=tagged, option=options)
        except Exception as exc:
            raise self._encode_error(obj, exc) from exc
        # orjson writes NaN and Infinity as null: look for them only when a null was written.
        if b"null" in data:
            found = locate(obj, lambda v, k: type(v) is float and not math.isfinite(v))
            if found is not None:
                raise self._error(found[0], found[1], "float")
        if data.count(_TAG_BYTES) > len(encoded):  # a dict of the caller's (or a codec's) that reads as a tag
            shaped = lambda v, k: type(v) is dict and len(v) == 2 and TAG in v and "value" in v  # noqa: E731
            found = locate(obj, shaped) or next(filter(None, (locate(e, shaped, "a codec's") for e in encoded)), None)
            if found is not None:
                raise EncodeError(
                    f"json cannot encode the dict at {found[0]}: its keys, {TAG!r} and 'value', are how objcomm's "
                    "json marks a value of a registered type, and it would decode as one; rename a key, or use "
                    "msgpack or pickle"
                )
        return data

    def _encode_error(self, obj: Any, exc: BaseException) -> EncodeError:
        def rejects(value: Any, is_key: bool) -> bool:
            cls = type(value)
            if is_key:
                return cls is not str
            if cls is int:
                return not -(2**63) <= value < 2**64
            if cls is float:
                return not math.isfinite(value)
            return cls not in _NATIVE and self._codecs.for_value(value) is None

        found = locate(obj, rejects)
        if found is None:
            return EncodeError(f"json cannot encode {describe(obj)}: {exc}")
        path, value, is_key = found
        return self._error(path, value, "dict key" if is_key else type(value).__name__)

    @staticmethod
    def _error(path: str, value: Any, kind: str) -> EncodeError:
        what = f"dict key {value!r} ({describe(value)})" if kind == "dict key" else describe(value)
        if kind == "float":
            what = f"float {value!r}"
        where = "in the dict at" if kind == "dict key" else "at"
        hint = _HINTS.get(kind, _DEFAULT_HINT if kind in _MSGPACK_CARRIES else _CLASS_HINT)
        return EncodeError(f"json cannot encode {what} {where} {path}; {hint}")

    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any:
        with decoding(self.name, data):
            obj = _orjson().loads(data)
            if _may_hold_tags(data):
                obj = self._untag(obj, 0)
            return obj

    def _untag(self, obj: Any, depth: int) -> Any:
        if depth > MAX_TAG_DEPTH:
            raise DecodeError(f"json payload nests over {MAX_TAG_DEPTH} levels where codec tags are looked for")
        if isinstance(obj, list):
            return [self._untag(v, depth + 1) for v in obj]
        if isinstance(obj, dict):
            if TAG in obj and len(obj) == 2 and "value" in obj:
                codec = self._codecs.named("json", obj[TAG])
                return codec.decode_received(self._untag(obj["value"], depth + 1))
            return {k: self._untag(v, depth + 1) for k, v in obj.items()}
        return obj
