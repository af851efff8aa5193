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

Decoding hostile input: a payload is first walked in C without building anything, so truncated
headers cannot make the unpacker pre-allocate what they declare. Each extension re-enters the C
unpacker, which keeps about 40 KiB of state on the C stack and a copy of the extension's bytes,
so extension values nest at most ``MAX_EXT_DEPTH`` (16) deep — deeper is a :class:`DecodeError`,
not a stack overflow. Plain arrays and maps nest at most 1024 deep inside one extension level
(msgpack's own limit). msgpack's timestamp extension (-1) decodes to a UTC ``datetime``.
Every extension's fields are checked before anything is built (dtype, shape against the bytes
present, digit counts of big ints). The fields of an array (8) and an out-of-band key (12), the
ones a payload holds by the hundred, are read first without the walk, by an unpacker that takes
arrays of at most 32 items and no map or extension: whatever the bytes declare, it pre-allocates at
most 32 slots per nesting level (256 KiB at msgpack's 1024 levels, freed when it refuses), and
whatever it refuses is then read the walked way, with the same errors as any other extension.
"""

from __future__ import annotations

import datetime as _dt
import functools
import sys
import threading
from collections import OrderedDict
from contextvars import ContextVar
from typing import Any, Callable, Dict, Optional

from serializers import _budget, _rebuild
from serializers._codecs import CodecRegistry, codecs
from serializers._errors import DecodeError, EncodeError, decoding
from serializers._msgpack_fields import array_of, check_complete, numbers_of, pairs_of, short_text
from serializers._path import INSTEAD, describe, encode_refusal
from serializers._protocol import Buffer, Lift, Restore, Serializer

TUPLE, SET, FROZENSET, BIGINT, DATETIME, DATE, TIMEDELTA = 1, 2, 3, 4, 5, 6, 7
NDARRAY, NPSCALAR, COMPLEX, ODICT, EXTERNAL, CODEC = 8, 9, 10, 11, 12, 13

MAX_EXT_DEPTH = 16
_NATIVE = (type(None), bool, int, float, str, bytes, bytearray, list, dict)
_EXTENDED = (tuple, set, frozenset, _dt.datetime, _dt.date, _dt.timedelta, complex, OrderedDict)  # (_ext_type's)
_INT_RANGE = (-(2**63), 2**64 - 1)


class _Decoding:
    """One ``loads`` call: its ``restore`` hook and how deep extension values nest at this moment."""

    __slots__ = ("restore", "depth")

    def __init__(self, restore: Restore | None) -> None:
        self.restore = restore
        self.depth = 0


# The hooks are built once per serializer; what differs per call reaches them through these: the
# call's lift= while encoding, its restore= and extension depth while decoding. Context variables
# keep threads (and asyncio tasks) apart, and a nested call (a codec that uses msgpack) sets its own.
_LIFT: ContextVar[Optional[Lift]] = ContextVar("objcomm_msgpack_lift", default=None)
# False: a refusal does not say where the offending value sits (see unexplained_refusals)
_EXPLAIN: ContextVar[bool] = ContextVar("objcomm_msgpack_explain", default=True)
_DECODING: ContextVar[_Decoding] = ContextVar("objcomm_msgpack_decoding")


def _is_numpy(value: Any) -> bool:
    return type(value).__module__ == "numpy"


class MsgpackSerializer(Serializer):
    """msgpack with extension types for tuple, set, bytes, int keys, numpy, datetime and your codecs."""

    name = "msgpack"
    safe = True
    description = "msgpack: compact, safe; builtins, numpy, datetime exact via ext types; codecs for the rest"
    supports_external = True
    # numpy arrays up to this size travel in the payload (extension 8, exact); objcomm lifts larger ones: the
    # extension copies an array's data five times between dumps and loads, a lift twice (docs/bench.md)
    in_band_array_bytes = 4 << 10
    _raises_own_errors = True

    def __init__(self, registry: CodecRegistry = codecs) -> None:
        # Codecs are looked up in ``registry`` on every value: ones registered later count too.
        self._codecs = registry
        unpack = self._unpack
        # how each extension's bytes decode; built once, like the hooks below
        self._decoders: Dict[int, Callable[[bytes], Any]] = {
            TUPLE: lambda raw: tuple(array_of(unpack(raw))),
            SET: lambda raw: set(array_of(unpack(raw))),
            FROZENSET: lambda raw: frozenset(array_of(unpack(raw))),
            BIGINT: lambda raw: int(_rebuild.bounded_int_text(raw.decode("ascii"), "msgpack big int")),
            DATETIME: lambda raw: _dt.datetime.fromisoformat(short_text(raw)),
            DATE: lambda raw: _dt.date.fromisoformat(short_text(raw)),
            TIMEDELTA: lambda raw: _dt.timedelta(*numbers_of(unpack(raw), 3)),
            COMPLEX: lambda raw: complex(*numbers_of(unpack(raw), 2)),
            ODICT: lambda raw: OrderedDict(pairs_of(unpack(raw))),
            NDARRAY: lambda raw: _decode_ndarray(*array_of(unpack(raw), 3)),
            NPSCALAR: lambda raw: _rebuild.numpy_scalar(*array_of(unpack(raw), 2)),
            CODEC: lambda raw: self._decode_codec(*array_of(unpack(raw), 2)),
            EXTERNAL: lambda raw: _restore_external(_DECODING.get().restore, self._unpack_small(raw)),
        }

    @functools.cached_property
    def _msgpack(self) -> Any:
        import msgpack  # on first use, not when serializers is imported

        return msgpack

    @functools.cached_property
    def _packb(self) -> Callable[[Any], bytes]:
        """``msgpack.packb`` with this serializer's ``default=`` hook."""
        return functools.partial(self._msgpack.packb, default=self._default, use_bin_type=True, strict_types=True)

    @functools.cached_property
    def _unpack_array_fields(self) -> Callable[[Any], Any]:
        """``msgpack.unpackb`` for an array extension's fields: arrays of at most ``MAX_DIMS`` items, no maps and
        no extensions, so that it pre-allocates little whatever the bytes declare (no walk needed first)."""
        return functools.partial(
            self._msgpack.unpackb, raw=False, max_array_len=_rebuild.MAX_DIMS, max_map_len=0, max_ext_len=0
        )

    @functools.cached_property
    def _unpackb(self) -> Callable[[Any], Any]:
        """``msgpack.unpackb`` with this serializer's ``ext_hook=``; msgpack's timestamps decode to UTC datetimes."""
        return functools.partial(
            self._msgpack.unpackb, ext_hook=self._ext_hook, raw=False, strict_map_key=False, timestamp=3
        )

    # -- encoding ---------------------------------------------------------------------------
    def dumps(self, obj: Any, /, *, lift: Lift | None = None) -> Buffer:
        return encode_lifting(self._packb, self._encode_error, obj, lift)

    def _default(self, value: Any) -> Any:
        """The ``default=`` hook: out of band first (when this call lifts), then codecs and extension types."""
        key = lifted(value)
        if key is not None:
            return self._msgpack.ExtType(EXTERNAL, self._packb(key))
        return self._ext_type(value)

    def _ext_type(self, value: Any) -> Any:
        """The extension value for what msgpack cannot carry natively; ``TypeError`` if there is none."""
        ext, pack, cls = self._msgpack.ExtType, self._packb, type(value)
        codec = self._codecs.for_value(value)
        if codec is not None:
            return ext(CODEC, pack([codec.name, codec.encode(value)]))
        if cls.__module__ == "numpy":  # first (exact types below: none is numpy's): many small arrays are common
            return self._numpy_ext(value, pack, ext)
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
        if _is_numpy(value):  # a subclass of a numpy type defined elsewhere (np.matrix is numpy's own)
            return self._numpy_ext(value, pack, ext)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):  # what objcomm lifts never gets here
            raise TypeError(
                f"no msgpack encoding for {describe(value)}: msgpack carries tensors only through "
                "objcomm, and only plain ones (no subclass, no attributes set on the tensor); use pickle"
            )
        raise TypeError(f"no msgpack encoding for {describe(value)}")

    @staticmethod
    def _numpy_ext(value: Any, pack: Callable[[Any], bytes], ext: Any) -> Any:
        import numpy as np

        refuse_inexact(value, np)
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise TypeError("numpy arrays of dtype=object have no msgpack encoding")
            data = value if value.flags.c_contiguous else np.ascontiguousarray(value)  # that makes 0-d arrays 1-d:
            raw = data.reshape(-1).data.cast("B") if data.size else b""  # the shape written is value's
            if data.nbytes <= _FIELDS_PACKER_BYTES:  # no packer built for each small array
                pack = _fields_packer()
            return ext(NDARRAY, pack([data.dtype.str, list(value.shape), raw]))
        if isinstance(value, np.generic) and not value.dtype.hasobject:
            return ext(NPSCALAR, pack([value.dtype.str, value.tobytes()]))
        raise TypeError(f"no msgpack encoding for {describe(value)}")

    def _encode_error(self, obj: Any, exc: BaseException, lift: Lift | None) -> EncodeError:
        def rejects(value: Any, is_key: bool) -> bool:
            if type(value) in _NATIVE and not (type(value) is int and not _INT_RANGE[0] <= value <= _INT_RANGE[1]):
                return False
            if lift is not None and lift(value) is not None:
                return False
            try:
                self._ext_type(value)
            except Exception:
                return True
            return False

        return encode_refusal("msgpack", obj, rejects, exc, INSTEAD, whole=self._no_way)

    def _no_way(self, value: Any) -> bool:
        """Whether msgpack has no way at all to take a value of this type: not native, no extension, no codec."""
        cls = type(value)
        return (
            cls not in _NATIVE
            and cls not in _EXTENDED
            and cls.__module__ != "numpy"
            and not _is_numpy(value)
            and self._codecs.for_value(value) is None
        )

    # -- decoding ---------------------------------------------------------------------------
    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any:
        token = _DECODING.set(_Decoding(restore))
        try:
            with decoding(self.name, data):
                return self._unpack(data)
        finally:
            _DECODING.reset(token)

    def _unpack(self, raw: Any) -> Any:
        check_complete(self._msgpack, raw)
        return self._unpackb(raw)

    def _ext_hook(self, code: int, raw: bytes) -> Any:
        """The ``ext_hook=``: decode one extension value, at most ``MAX_EXT_DEPTH`` deep."""
        if code == NDARRAY:  # the hot one (a dict of many small arrays): its fields hold no extension, no nesting
            found = self._plain_ndarray(raw)
            if found is not None:
                return found
        decoder = self._decoders.get(code)
        if decoder is None:
            raise DecodeError(f"msgpack payload holds unknown extension type {code}; was it written by objcomm?")
        state = _DECODING.get()
        if state.depth >= MAX_EXT_DEPTH:
            raise DecodeError(f"msgpack payload nests extension types (tuples, sets...) over {MAX_EXT_DEPTH} deep")
        state.depth += 1
        try:
            return decoder(raw)
        finally:
            state.depth -= 1

    def _unpack_small(self, raw: bytes) -> Any:
        """An extension's fields as :meth:`_unpack` reads them, without its walk where they are small enough for
        :attr:`_unpack_array_fields`, which then has nothing to pre-allocate (an out-of-band key: one int)."""
        try:
            return self._unpack_array_fields(raw)
        except Exception:
            return self._unpack(raw)  # what is wrong, said as for every other extension

    def _plain_ndarray(self, raw: bytes) -> Any:
        """Extension 8, ``[dtype.str, shape, C-order bytes]``, straight from its fields where they are plain: a
        dtype whose every byte pattern is a value, a shape of ints whose size is the bytes'. None for anything
        else, or anything wrong: the extension is then decoded as every other, with
        :func:`serializers._rebuild.ndarray`'s checks and errors."""
        try:
            fields = self._unpack_array_fields(raw)
        except Exception:
            return None
        if type(fields) is not list or len(fields) != 3:
            return None
        descr, shape, data = fields
        if (
            type(descr) is not str
            or type(shape) is not list
            or type(data) is not bytes
            or not data
            or len(descr) > _rebuild.MAX_DTYPE_TEXT
        ):
            return None
        dtype = _plain_dtype(descr)
        if dtype is None:
            return None
        count = dtype.itemsize
        for size in shape:  # at most MAX_DIMS (_unpack_array_fields)
            if type(size) is not int or not 0 <= size < 2**62:
                return None
            count *= size
        if count != len(data):
            return None
        _budget.charge(count, "an array copy")
        return _numpy().ndarray(shape, dtype, bytearray(data))  # over a copy it owns: writable

    def _decode_codec(self, name: str, value: Any) -> Any:
        return self._codecs.named("msgpack", name).decode_received(value)


EncodeErrorOf = Callable[[Any, BaseException, Optional[Lift]], EncodeError]


def encode_lifting(
    encode: Callable[[Any], bytes], encode_error: EncodeErrorOf, obj: Any, lift: Optional[Lift]
) -> bytes:
    """``encode(obj)`` with this call's ``lift`` where the hooks find it (:func:`lifted`); a failure that is not an
    :class:`EncodeError` already becomes ``encode_error(obj, exc, lift)`` (the msgpack and msgspec backends)."""
    token = _LIFT.set(lift)
    try:
        return encode(obj)
    except EncodeError:
        raise
    except Exception as exc:
        if not _EXPLAIN.get():
            raise EncodeError(f"refused ({type(exc).__name__}: {exc})") from exc
        raise encode_error(obj, exc, lift) from exc
    finally:
        _LIFT.reset(token)


class unexplained_refusals:  # lower case: used as a function, `with unexplained_refusals():`
    """Within, the msgpack and msgspec backends refuse an object without saying where the offending value sits:
    finding it walks the whole object, encoding each value alone (half a second for 100,000 strings), which
    ``serializer="auto"`` does not need when it tries msgspec first and goes on to pickle. A class, not a
    ``contextlib.contextmanager``: it is entered on every call of auto's msgspec lane (0.5 µs against 1.6)."""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _EXPLAIN.set(False)

    def __exit__(self, *exc: Any) -> None:
        _EXPLAIN.reset(self._token)


def lifted(value: Any) -> Optional[int]:
    """The out-of-band key the current call's ``lift`` gives ``value`` (None: it stays in the payload)."""
    lift = _LIFT.get()
    return None if lift is None else lift(value)


_FIELDS = threading.local()
_FIELDS_PACKER_BYTES = 64 << 10  # what a kept packer's buffer may grow to (it keeps its largest)


def _fields_packer() -> Callable[[Any], bytes]:
    """``pack`` for plain fields that call no hook (str, ints, bytes), as ``_packb`` packs them, byte for byte;
    from a packer kept per thread, where ``packb`` builds and frees one (with its buffer) for every value."""
    try:
        return _FIELDS.pack  # type: ignore[no-any-return]  # msgpack has no type hints
    except AttributeError:
        import msgpack

        _FIELDS.pack = msgpack.Packer(use_bin_type=True, strict_types=True, autoreset=True).pack
        return _FIELDS.pack  # type: ignore[no-any-return]  # msgpack has no type hints


def refuse_inexact(value: Any, np: Any) -> None:
    """Raise if ``value`` is a numpy value the MessagePack encodings here cannot carry exactly: a structured one (a
    dtype with named fields: ``dtype.str`` would drop the field names, and the receiver would get bare bytes,
    ``|V12``, where the sender had records), or an ndarray subclass other than a memmap (``np.matrix``), which would
    arrive as a plain array. ``np``: numpy, imported by the caller."""
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.fields is not None:
        raise TypeError(
            f"no MessagePack encoding for a structured numpy {type(value).__name__} (dtype "
            f"{value.dtype}): its field names would be lost; use pickle or restricted-pickle"
        )
    if isinstance(value, np.ndarray) and type(value) is not np.ndarray and not isinstance(value, np.memmap):
        # (a compat review's find: np.matrix arrived as a plain ndarray, whose * is no longer a matrix product; a
        # memmap's data arrives as an array, as its slices' do)
        raise TypeError(
            f"no MessagePack encoding for numpy.{type(value).__name__}, a subclass of ndarray: it would arrive as a "
            "plain ndarray; send np.asarray(x), or use pickle"
        )


def _decode_ndarray(dtype: Any, shape: Any, raw: Any) -> Any:
    """An array from ``[dtype.str, shape, C-order bytes]``: the bytes must be exactly what the shape needs."""
    return _rebuild.ndarray(dtype, shape, "C", raw)  # copies out of the read-only payload


@functools.cache
def _numpy() -> Any:
    """numpy, imported on first use (not when serializers is imported)."""
    import numpy

    return numpy


@functools.lru_cache(maxsize=64)
def _plain_dtype(descr: str) -> Any:
    """The dtype of ``descr`` as :func:`serializers._rebuild.numpy_dtype` builds and checks it, if it is one whose
    every byte pattern is a valid value (not unicode: its code points are checked); else None. Cached: the
    same few dtypes come again and again, and building one costs more than the rest of a small array."""
    try:
        dtype = _rebuild.numpy_dtype(descr)
    except DecodeError:
        return None
    return None if dtype.fields is not None or dtype.kind == "U" else dtype


def _restore_external(restore: Restore | None, key: int) -> Any:
    if restore is None:
        raise DecodeError(
            f"the payload refers to out-of-band object #{key}, but none came with it; decode it through objcomm"
        )
    return restore(key)
