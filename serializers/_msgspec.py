"""msgspec backend: MessagePack through msgspec's C encoder and decoder, built once and reused.

The fastest encoder of JSON-like data (dicts, lists, str, numbers, bytes; its decoding is about pickle's
speed or slower, ``objcomm bench``), and the only backend that checks what arrives while it decodes: give it
a type (a ``msgspec.Struct``, a dataclass, a ``TypedDict``, ``list[Record]``...) and a payload of any other
shape is a :class:`DecodeError` that says where, before anything is built from it. Safe by construction:
decoding builds data only, runs no code of the payload's choosing, refuses truncated input before allocating
what its headers declare, and nests at most as deep as Python's recursion limit, and at most 1,024 levels where
that limit is past :data:`serializers._protocol.SAFE_RECURSION_LIMIT` (deeper: a :class:`DecodeError`).

Without a type (``type=Any``, the registered ``"msgspec"``), what msgspec carries natively comes back
as MessagePack has it: tuples, sets and frozensets as lists, dates, times, durations, decimals and
UUIDs as strings, aware datetimes as UTC datetimes, naive ones as strings. ``objcomm bench`` and
:func:`serializers.fidelity` say so (``converted``); with a type, they come back as the type says.
Extension codes, shared with the msgpack backend where they mean the same:

====  ==================  ==============================================
code  type                ext data
====  ==================  ==============================================
8     numpy.ndarray       [dtype.str, shape, raw C-order bytes] (small)
9     numpy scalar        [dtype.str, raw bytes]
10    complex             [real, imag]
12    out-of-band object  int key (objcomm's tensors and large arrays)
13    registered codec    [codec name, encoded value]
====  ==================  ==============================================

Example::

    import msgspec, serializers

    class Record(msgspec.Struct):
        id: int
        score: float

    serializers.register(serializers.MsgspecSerializer(list[Record], name="records"))
    # every rank registers it; then objcomm.gather(records, serializer="records")
"""

from __future__ import annotations

import functools
import sys
from contextvars import ContextVar
from typing import Any, Callable, Tuple, cast

from serializers import _rebuild
from serializers._codecs import CodecRegistry, codecs
from serializers._errors import DecodeError, EncodeError
from serializers._msgpack import (
    CODEC,
    COMPLEX,
    EXTERNAL,
    MAX_EXT_DEPTH,
    NDARRAY,
    NPSCALAR,
    _Decoding,
    _restore_external,
    encode_lifting,
    lifted,
    refuse_inexact,
)
from serializers._path import INSTEAD, describe, encode_refusal
from serializers._protocol import SAFE_RECURSION_LIMIT, Buffer, Lift, Restore, Serializer

# Per call, as in the msgpack backend (whose encode_lifting holds the lift=): the restore= and extension depth.
_DECODING: ContextVar[_Decoding] = ContextVar("objcomm_msgspec_decoding")


def _nesting_checked(data: Any, name: str) -> None:
    """Refuse ``data`` nested past msgpack's C stack where the recursion limit would not stop msgspec in time.

    msgspec bounds nesting by Python's recursion limit, not by its C stack: where a program raised the limit, a 40 KB
    payload of 40,000 nested arrays crashed the interpreter (an attacker's find). Past :data:`SAFE_RECURSION_LIMIT` a
    payload is first walked by msgpack's C unpacker, whose fixed stack refuses nesting past 1,024 without building
    anything (about 4% of msgspec's own decoding time)."""
    if sys.getrecursionlimit() <= SAFE_RECURSION_LIMIT:
        return
    import msgpack

    unpacker = msgpack.Unpacker(raw=True, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    try:
        unpacker.skip()
    except msgpack.StackError:
        raise DecodeError(
            f"{name} payload nests deeper than msgpack's 1,024 levels, under a recursion limit of "
            f"{sys.getrecursionlimit():,} (past {SAFE_RECURSION_LIMIT:,} msgspec's own check would not stop it in time)"
        ) from None
    except Exception:  # malformed, truncated: msgspec says what
        pass


class MsgspecSerializer(Serializer):
    """msgspec's MessagePack, optionally decoding into ``type`` (validated while it decodes).

    ``type``: what every payload must decode to (``Any``: anything MessagePack carries); ``name``: the
    name to register it under (every rank registers the same one); ``registry``: codecs to use.
    """

    safe = True
    supports_external = True
    in_band_array_bytes = 4 << 10  # numpy arrays up to this size travel in the payload; objcomm lifts larger ones
    _raises_own_errors = True

    def __init__(self, type: Any = Any, *, name: str = "msgspec", registry: CodecRegistry = codecs) -> None:
        self.name = name
        self.type = type
        self.description = (
            "msgspec MessagePack: safe, fast to encode; decodes into a type you give; untyped, tuples arrive as lists"
            if type is Any
            else f"msgspec MessagePack decoding into {getattr(type, '__name__', type)!r}, safe"
        )
        self._codecs = registry

    @functools.cached_property
    def _msgspec(self) -> Any:
        import msgspec  # on first use, not when serializers is imported

        return msgspec

    @functools.cached_property
    def _encode(self) -> Callable[[Any], bytes]:
        return cast(Callable[[Any], bytes], self._msgspec.msgpack.Encoder(enc_hook=self._enc_hook).encode)

    @functools.cached_property
    def _decode(self) -> Callable[[Any], Any]:
        return cast(Callable[[Any], Any], self._msgspec.msgpack.Decoder(self.type, ext_hook=self._ext_hook).decode)

    @functools.cached_property
    def _decode_any(self) -> Callable[[Any], Any]:
        """A codec's value: anything, its own extensions included."""
        return cast(
            Callable[[Any], Any], self._msgspec.msgpack.Decoder(Tuple[str, Any], ext_hook=self._ext_hook).decode
        )

    @functools.cached_property
    def _fields(self) -> Any:
        """Decoders of each extension's fields, typed: msgspec checks them in C before anything is built."""
        decoder = self._msgspec.msgpack.Decoder
        return {
            NDARRAY: decoder(Tuple[str, Tuple[int, ...], bytes]).decode,
            NPSCALAR: decoder(Tuple[str, bytes]).decode,
            COMPLEX: decoder(Tuple[float, float]).decode,
            EXTERNAL: decoder(int).decode,
        }

    # -- encoding ---------------------------------------------------------------------------
    def dumps(self, obj: Any, /, *, lift: Lift | None = None) -> Buffer:
        return encode_lifting(self._encode, self._encode_error, obj, lift)

    def _enc_hook(self, value: Any) -> Any:
        """What msgspec calls for a value it has no encoding of: out of band first, then codecs and extensions."""
        key = lifted(value)
        return self._ext(EXTERNAL, key) if key is not None else self._ext_value(value)

    def _ext(self, code: int, fields: Any) -> Any:
        return self._msgspec.msgpack.Ext(code, self._encode(fields))

    def _ext_value(self, value: Any) -> Any:
        codec = self._codecs.for_value(value)
        if codec is not None:
            return self._ext(CODEC, [codec.name, codec.encode(value)])
        if type(value) is complex:
            return self._ext(COMPLEX, [value.real, value.imag])
        if type(value).__module__ == "numpy" or _numpy_instance(value):
            import numpy as np

            refuse_inexact(value, np)
            if isinstance(value, np.ndarray) and not value.dtype.hasobject:
                data = value if value.flags.c_contiguous else np.ascontiguousarray(value)
                raw = data.reshape(-1).data.cast("B") if data.size else b""
                return self._ext(NDARRAY, [data.dtype.str, list(value.shape), raw])
            if isinstance(value, np.generic) and not value.dtype.hasobject:
                return self._ext(NPSCALAR, [value.dtype.str, value.tobytes()])
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):  # what objcomm lifts never gets here
            raise TypeError(
                f"no msgspec encoding for {describe(value)}: msgspec carries tensors only through "
                "objcomm, and only plain ones (no subclass, no attributes set on the tensor); use pickle"
            )
        raise TypeError(f"no msgspec encoding for {describe(value)}")

    def _encode_error(self, obj: Any, exc: BaseException, lift: Lift | None) -> EncodeError:
        def rejects(value: Any, is_key: bool) -> bool:
            if type(value) in (list, dict, tuple, set, frozenset):
                return False  # containers: their items are looked at one by one
            try:
                self.dumps(value, lift=lift)
            except Exception:
                return True
            return False

        return encode_refusal("msgspec", obj, rejects, exc, "msgpack, " + INSTEAD)

    # -- decoding ---------------------------------------------------------------------------
    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any:
        token = _DECODING.set(_Decoding(restore))
        try:
            _nesting_checked(data, self.name)
            return self._decode(data)
        except DecodeError:
            raise
        except Exception as exc:  # msgspec.DecodeError and ValidationError, RecursionError, MemoryError...
            raise DecodeError(f"{self.name} could not decode the payload: {exc}") from exc
        finally:
            _DECODING.reset(token)

    def _ext_hook(self, code: int, raw: memoryview) -> Any:
        """msgspec's ``ext_hook``: one extension value, its fields checked by type, at most ``MAX_EXT_DEPTH`` deep."""
        state = _DECODING.get()
        if code == EXTERNAL:
            return _restore_external(state.restore, self._fields[EXTERNAL](raw))
        if code == NDARRAY:
            dtype, shape, data = self._fields[NDARRAY](raw)
            return _rebuild.ndarray(dtype, list(shape), "C", data)  # checked; copies out of the read-only payload
        if code == NPSCALAR:
            return _rebuild.numpy_scalar(*self._fields[NPSCALAR](raw))
        if code == COMPLEX:
            return complex(*self._fields[COMPLEX](raw))
        if code != CODEC:
            raise DecodeError(f"{self.name} payload holds unknown extension type {code}; was it written by objcomm?")
        if state.depth >= MAX_EXT_DEPTH:
            raise DecodeError(f"{self.name} payload nests registered types over {MAX_EXT_DEPTH} deep")
        state.depth += 1
        try:
            _nesting_checked(raw, self.name)
            name, value = self._decode_any(raw)
        finally:
            state.depth -= 1
        return self._codecs.named(self.name, name).decode_received(value)


def _numpy_instance(value: Any) -> bool:
    """A subclass of a numpy type defined elsewhere (numpy itself is checked by module first: cheaper)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, (numpy.ndarray, numpy.generic))
