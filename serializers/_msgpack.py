"""msgpack backend: compact and safe; built-in extension types keep Python types exact.

Extension codes (stable: they are part of the wire format):

====  ==================  ===========================================
code  type                ext data
====  ==================  ===========================================
1     tuple               msgpack array
2     set                 msgpack array
3     frozenset           msgpack array
4     int beyond 64 bits  decimal ASCII
5     datetime.datetime   ISO 8601 string (naive or aware kept)
6     datetime.date       ISO 8601 string
7     datetime.timedelta  [days, seconds, microseconds]
8     numpy.ndarray       [dtype.str, shape, raw C-order bytes]
9     numpy scalar        [dtype.str, raw bytes]
10    complex             [real, imag]
11    OrderedDict         array of [key, value] pairs
12    out-of-band object  int key (objcomm's tensors)
13    registered codec    [codec name, encoded value]
====  ==================  ===========================================
"""

from __future__ import annotations

import datetime as _dt
from collections import OrderedDict
from typing import Any, Callable, Dict

from ._codecs import CodecRegistry, codecs
from ._errors import DecodeError, EncodeError
from ._path import describe, locate
from ._protocol import Buffer, Lift, Restore, Serializer

TUPLE, SET, FROZENSET, BIGINT, DATETIME, DATE, TIMEDELTA = 1, 2, 3, 4, 5, 6, 7
NDARRAY, NPSCALAR, COMPLEX, ODICT, EXTERNAL, CODEC = 8, 9, 10, 11, 12, 13

_NATIVE = (type(None), bool, int, float, str, bytes, bytearray, list, dict)
_INT_RANGE = (-(2**63), 2**64 - 1)


def _is_numpy(value: Any) -> bool:
    return type(value).__module__ == "numpy"


class MsgpackSerializer(Serializer):
    """msgpack with extension types for tuple, set, bytes, int keys, numpy, datetime and your codecs."""

    name = "msgpack"
    safe = True
    description = "msgpack: compact, safe; builtins, numpy, datetime exact via ext types; codecs for the rest"
    supports_external = True

    def __init__(self, registry: CodecRegistry = codecs) -> None:
        self._codecs = registry

    # -- encoding ---------------------------------------------------------------------------
    def dumps(self, obj: Any, /, *, lift: Lift | None = None) -> Buffer:
        import msgpack

        default = self._default_hook(lift)
        try:
            return msgpack.packb(obj, default=default, use_bin_type=True, strict_types=True)  # type: ignore[no-any-return]
        except EncodeError:
            raise
        except Exception as exc:
            raise self._encode_error(obj, exc, lift) from exc

    def _default_hook(self, lift: Lift | None) -> Callable[[Any], Any]:
        import msgpack

        ext = msgpack.ExtType

        def pack(value: Any) -> bytes:
            return msgpack.packb(value, default=default, use_bin_type=True, strict_types=True)  # type: ignore[no-any-return]

        def default(value: Any) -> Any:
            cls = type(value)
            if lift is not None:
                key = lift(value)
                if key is not None:
                    return ext(EXTERNAL, pack(key))
            codec = self._codecs.for_value(value)
            if codec is not None:
                return ext(CODEC, pack([codec.name, codec.encode(value)]))
            if cls is tuple:
                return ext(TUPLE, pack(list(value)))
            if cls is set:
                return ext(SET, pack(list(value)))
            if cls is frozenset:
                return ext(FROZENSET, pack(list(value)))
            if cls is int:
                return ext(BIGINT, str(value).encode())
            if cls is _dt.datetime:
                return ext(DATETIME, value.isoformat().encode())
            if cls is _dt.date:
                return ext(DATE, value.isoformat().encode())
            if cls is _dt.timedelta:
                return ext(TIMEDELTA, pack([value.days, value.seconds, value.microseconds]))
            if cls is complex:
                return ext(COMPLEX, pack([value.real, value.imag]))
            if cls is OrderedDict:
                return ext(ODICT, pack([[k, v] for k, v in value.items()]))
            if _is_numpy(value):
                return self._numpy_ext(value, pack, ext)
            raise TypeError(f"no msgpack encoding for {describe(value)}")

        return default

    @staticmethod
    def _numpy_ext(value: Any, pack: Callable[[Any], bytes], ext: Any) -> Any:
        import numpy as np

        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise TypeError("numpy arrays of dtype=object have no msgpack encoding")
            data = np.ascontiguousarray(value)
            raw = data.reshape(-1).data.cast("B") if data.size else b""
            return ext(NDARRAY, pack([data.dtype.str, list(data.shape), raw]))
        if isinstance(value, np.generic) and not value.dtype.hasobject:
            return ext(NPSCALAR, pack([value.dtype.str, value.tobytes()]))
        raise TypeError(f"no msgpack encoding for {describe(value)}")

    def _encode_error(self, obj: Any, exc: BaseException, lift: Lift | None) -> EncodeError:
        default = self._default_hook(None)

        def rejects(value: Any, is_key: bool) -> bool:
            if type(value) in _NATIVE and not (type(value) is int and not _INT_RANGE[0] <= value <= _INT_RANGE[1]):
                return False
            if lift is not None and lift(value) is not None:
                return False
            try:
                default(value)
            except Exception:
                return True
            return False

        found = locate(obj, rejects)
        path, value, _ = found if found is not None else ("$", obj, False)
        return EncodeError(
            f"msgpack cannot encode {describe(value)} at {path} ({exc}); "
            "register a codec with serializers.register_type(), or use pickle"
        )

    # -- decoding ---------------------------------------------------------------------------
    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any:
        import msgpack

        def unpack(raw: bytes) -> Any:
            return msgpack.unpackb(raw, ext_hook=ext_hook, raw=False, strict_map_key=False)

        decoders: Dict[int, Callable[[bytes], Any]] = {
            TUPLE: lambda raw: tuple(unpack(raw)),
            SET: lambda raw: set(unpack(raw)),
            FROZENSET: lambda raw: frozenset(unpack(raw)),
            BIGINT: lambda raw: int(raw.decode("ascii")),
            DATETIME: lambda raw: _dt.datetime.fromisoformat(raw.decode("ascii")),
            DATE: lambda raw: _dt.date.fromisoformat(raw.decode("ascii")),
            TIMEDELTA: lambda raw: _dt.timedelta(*unpack(raw)),
            COMPLEX: lambda raw: complex(*unpack(raw)),
            ODICT: lambda raw: OrderedDict(unpack(raw)),
            NDARRAY: lambda raw: _decode_ndarray(*unpack(raw)),
            NPSCALAR: lambda raw: _decode_npscalar(*unpack(raw)),
            CODEC: lambda raw: self._decode_codec(*unpack(raw)),
            EXTERNAL: lambda raw: _restore_external(restore, unpack(raw)),
        }

        def ext_hook(code: int, raw: bytes) -> Any:
            decoder = decoders.get(code)
            if decoder is None:
                raise DecodeError(f"msgpack payload holds unknown extension type {code}; was it written by objcomm?")
            return decoder(raw)

        try:
            return unpack(data)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(
                f"msgpack cannot decode {memoryview(data).nbytes} bytes: {type(exc).__name__}: {exc}"
            ) from exc

    def _decode_codec(self, name: str, value: Any) -> Any:
        codec = self._codecs.by_name(name)
        if codec is None:
            raise DecodeError(
                f"msgpack payload holds a value of registered type {name!r}, but no codec of that name is "
                f"registered on this rank (known: {self._codecs.names()}); call serializers.register_type() here too"
            )
        return codec.decode(value)


def _decode_ndarray(dtype: str, shape: list, raw: bytes) -> Any:
    import numpy as np

    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()


def _decode_npscalar(dtype: str, raw: bytes) -> Any:
    import numpy as np

    return np.frombuffer(raw, dtype=np.dtype(dtype))[0]


def _restore_external(restore: Restore | None, key: int) -> Any:
    if restore is None:
        raise DecodeError(
            f"the payload refers to out-of-band object #{key}, but none came with it; decode it through objcomm"
        )
    return restore(key)
