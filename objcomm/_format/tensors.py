"""Tensors inside objects travel as tensors: lifted out of the byte stream, moved natively.

While a serializer encodes an object, :class:`TensorLifter` takes every ``torch.Tensor`` it is
offered (anywhere: in dicts, lists, user classes for the pickle family) and leaves a key in its
place. numpy arrays of a dtype torch shares go the same way (out of band, as a tensor viewing the
array's memory: no copy), and so does a large ``bytes``/``bytearray`` given as the whole object (see
:func:`objcomm._format.frame.encode`). Small ones are then copied into the frame; large ones travel
*out of band* as flat uint8 tensors with native collectives (on NCCL they never touch the host).
Small numpy arrays are left to a serializer that writes them exactly itself and says up to what size
that is cheaper than a table entry (its ``in_band_array_bytes``: 4 KiB for pickle, cloudpickle and
msgpack; never above ``inline_tensor_bytes``): they are inside the frame either way.
The frame's tensor table says which is which::

    entry (24 bytes, little-endian): dtype code u8, flags u8, ndim u8, 5 pad bytes,
                                     nbytes u64, offset u64 (inline: into the inline section;
                                     out of band: its index), then ndim x i64 shape
    flags: 1 inline, 2 requires_grad, 4 torch.nn.Parameter, 8 a numpy array,
           16 bytes, 32 bytearray (8, 16 and 32 exclude each other and 2 and 4)

On the receiver each key becomes a tensor on ``map_location`` (default: the transport device,
the CPU for gloo and the current CUDA device for NCCL), never on the sender's device index.
"""

from __future__ import annotations

import math
import struct
import warnings
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from objcomm._errors import FrameError
from serializers import _auto

DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "bool",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "uint16",
    "uint32",
    "uint64",
)  # codes are positions in this tuple: append only
_CODES: Dict[torch.dtype, int] = {getattr(torch, n): i for i, n in enumerate(DTYPES) if hasattr(torch, n)}
ENTRY = struct.Struct("<BBB5xQQ")
DIM = struct.Struct("<q")
INLINE, REQUIRES_GRAD, PARAMETER, NUMPY, BYTES, BYTEARRAY = 1, 2, 4, 8, 16, 32
KINDS = NUMPY | BYTES | BYTEARRAY  # what the entry becomes on the receiver, other than a tensor (format 2)
_FLAGS = INLINE | REQUIRES_GRAD | PARAMETER | KINDS
MAX_NDIM = 64
MAX_NBYTES = 1 << 62  # no tensor announces this much; keeps every size an int64 for torch
_new = tuple.__new__


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_DIMS = tuple(struct.Struct(f"<{n}q") for n in range(MAX_NDIM + 1))  # the layout of an entry's n sizes
_KNOWN = {code: (getattr(torch, n), getattr(torch, n).itemsize) for code, n in enumerate(DTYPES) if hasattr(torch, n)}


def _valid_flags(kinds: bool) -> FrozenSet[int]:
    """Every flags byte a table entry may carry (``kinds``: format version 2): known bits only, at most one kind,
    and a kind without requires_grad or Parameter."""
    valid = set()
    for flags in range(256):
        kind = flags & KINDS
        if (
            not flags & ~_FLAGS
            and not kind & (kind - 1)
            and not (kind and (flags & (REQUIRES_GRAD | PARAMETER) or not kinds))
        ):
            valid.add(flags)
    return frozenset(valid)


_VALID_FLAGS = {True: _valid_flags(True), False: _valid_flags(False)}


def liftable(value: Any) -> bool:
    """A plain strided CPU or CUDA tensor (or Parameter) of a dtype in :data:`DTYPES`, without attributes of
    its own. A subclass, or a tensor given attributes, is left to the serializer, which keeps them (pickle)
    or refuses it: lifted, it would arrive as a plain tensor, its class and attributes silently lost. So is a
    nested tensor (strided, but with no one shape: pickle carries it in band)."""
    return (
        type(value) in _PLAIN_TENSORS
        and not value.__dict__
        and value.layout == torch.strided
        and not value.is_nested
        and (value.is_cpu or value.is_cuda)
        and value.dtype in _CODES
        and not value.is_quantized
    )


class Entry(NamedTuple):
    """One tensor of the table (a tuple: one is built per table entry on every decode, so it must be cheap)."""

    dtype: torch.dtype
    flags: int
    shape: Tuple[int, ...]
    nbytes: int
    offset: int

    @property
    def inline(self) -> bool:
        return bool(self.flags & INLINE)


class WholeBytes:
    """A large ``bytes`` or ``bytearray`` given as the whole object, offered to the lifter in its place."""

    def __init__(self, data: Any) -> None:
        self.data = data


WHOLE = BYTES | BYTEARRAY
WHOLE_PAYLOAD_MOST = 256  # bytes: the payload of a whole bytes/bytearray frame is one reference (3 to 57 measured)


def check_whole(entries: Sequence[Entry], payload_bytes: int) -> None:
    """A frame that carries a whole ``bytes``/``bytearray`` (:class:`WholeBytes`: the only way a sender makes one)
    carries that entry alone, and its payload is the one reference to it. Else :class:`FrameError`: a payload that
    referred to such an entry many times in a set or dict, next to an equal entry or an equal ``bytes`` of its own,
    made the receiver compare them whole at each reference, quadratic in the frame (an attacker's find: two equal 16
    MiB entries, one referenced 8,000 times in a set, 5.3 s)."""
    if any(entry.flags & WHOLE for entry in entries) and (len(entries) != 1 or payload_bytes > WHOLE_PAYLOAD_MOST):
        held = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
        raise FrameError(
            f"a frame with a whole bytes or bytearray entry holds that entry alone and a payload of at most "
            f"{WHOLE_PAYLOAD_MOST} bytes (the reference to it); this one has {held} and a payload of {payload_bytes:,} "
            "bytes"
        )


# numpy dtypes torch shares, by the table code of the torch dtype of the same name (native byte order)
_NUMPY_NAMES = (
    "float32",
    "float64",
    "float16",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "bool",
    "complex64",
    "complex128",
    "uint16",
    "uint32",
    "uint64",
)
_NUMPY_CODES: Dict[Any, int] = {np.dtype(n): DTYPES.index(n) for n in _NUMPY_NAMES if hasattr(torch, n)}
_NUMPY_OF: Dict[torch.dtype, Any] = {getattr(torch, n): np.dtype(n) for n in _NUMPY_NAMES if hasattr(torch, n)}
_auto.lift_arrays_of(tuple(_NUMPY_CODES))  # serializer="auto" sends dicts of such arrays through msgspec
# what Tensor.numpy() and torch.from_numpy() take in every torch objcomm supports (uint16-64 came in 2.3)
_FROM_NUMPY = frozenset(getattr(torch, n) for n in _NUMPY_NAMES[:11])


def _array(value: Any) -> Optional[Any]:
    """``value`` (a numpy array) C-contiguous, if its dtype is one torch shares; else None (the serializer
    then carries it: object, structured, datetime and '>f4' arrays)."""
    if value.dtype not in _NUMPY_CODES or not value.dtype.isnative:  # '>f8' equals no native dtype: checked anyway
        return None
    if value.flags.c_contiguous:
        return value
    return np.ascontiguousarray(value).reshape(value.shape)  # ascontiguousarray makes a 0-d array 1-d


def _no_copy_tensor(array: Any) -> torch.Tensor:
    """A flat uint8 tensor over a C-contiguous array's memory (read-only arrays too: the tensor is only read)."""
    flat = array.reshape(-1).view(np.uint8)
    if array.flags.writeable:
        return torch.from_numpy(flat)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(flat)


def bytes_tensor(data: Any) -> torch.Tensor:
    """A flat uint8 tensor over ``data``'s memory, read-only buffers too (without torch's warning: it is only read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.empty(0, dtype=torch.uint8) if not len(data) else torch.frombuffer(data, dtype=torch.uint8)


class TensorLifter:
    """The ``lift`` hook handed to serializers; collects tensors, each once (aliases share a key).

    ``in_band_bytes``: numpy arrays up to this size are declined, left to the serializer, which writes them in
    place for less than a table entry costs (:func:`objcomm._format.frame.serialize`); if writable, as every lifted
    array arrives (pickle would give a read-only one back for a read-only one). -1: none.
    """

    def __init__(self, in_band_bytes: int = -1) -> None:
        self.tensors: List[Any] = []  # per key: a tensor, a C-contiguous numpy array, or bytes/bytearray
        self.kinds: List[int] = []  # 0, NUMPY, BYTES or BYTEARRAY per key
        self._keys: Dict[int, int] = {}
        self._held: List[Any] = []  # what the keys' ids belong to, alive until encoding ends
        self._in_band = in_band_bytes

    def __call__(self, value: Any) -> Optional[int]:
        cls = type(value)
        if cls is np.ndarray and value.nbytes <= self._in_band and value.flags.writeable:
            return None  # first: the one test a small array pays
        key = self._keys.get(id(value))
        if key is not None:
            return key
        if cls is np.ndarray:
            item, kind = _array(value), NUMPY
            if item is None:
                return None
        elif cls is WholeBytes:
            item, kind = value.data, (BYTES if type(value.data) is bytes else BYTEARRAY)
        elif liftable(value):
            item, kind = value, 0
        else:
            return None
        key = self._keys[id(value)] = len(self.tensors)
        self.tensors.append(item)
        self.kinds.append(kind)
        self._held.append(value)
        return key

    def original(self, key: int) -> Any:
        """The object lifted as ``key`` itself (a ``restore`` hook for a decode on this rank)."""
        held = self._held[key]
        return held.data if type(held) is WholeBytes else held

    def pack(self, inline_max: int) -> Tuple[bytes, List[Any], List[torch.Tensor]]:
        """``(table, inline parts: flat unsigned-byte buffers on the CPU, out-of-band flat uint8 tensors)``."""
        table: List[bytes] = []
        inline: List[Any] = []
        oob: List[torch.Tensor] = []
        inline_len = 0
        for item, kind in zip(self.tensors, self.kinds):
            if kind == NUMPY:
                code, flags, shape, nbytes = _NUMPY_CODES[item.dtype], NUMPY, item.shape, item.nbytes
                if nbytes <= inline_max:
                    part: Any = item.reshape(-1).view(np.uint8).data
                else:
                    part = _no_copy_tensor(item)
            elif kind:  # whole bytes
                code, flags, shape, nbytes = _CODES[torch.uint8], kind, (len(item),), len(item)
                part = memoryview(item).cast("B") if nbytes <= inline_max else bytes_tensor(item)
            else:
                code, shape, nbytes = _CODES[item.dtype], item.shape, item.nbytes
                flags = PARAMETER if type(item) is torch.nn.Parameter else 0  # lifted: a Parameter exactly
                data = item
                if item.requires_grad:
                    flags |= REQUIRES_GRAD
                    data = item.detach()
                if data.is_conj() or data.is_neg():
                    data = data.resolve_conj().resolve_neg()
                part = _host_bytes(data) if nbytes <= inline_max else _flat(data)
            if nbytes <= inline_max:
                flags |= INLINE
                offset = inline_len
                inline.append(part)
                inline_len += nbytes
            else:
                offset = len(oob)
                oob.append(part)
            table.append(ENTRY.pack(code, flags, len(shape), nbytes, offset))
            if shape:
                table.append(_DIMS[len(shape)].pack(*shape))
        return b"".join(table), inline, oob


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor on its device (a copy only where it is not contiguous)."""
    data = tensor.contiguous()
    if not data.numel():  # its strides may be 0 (numpy's empty arrays), which view() refuses
        return torch.empty(0, dtype=torch.uint8, device=data.device)
    return data.reshape(-1).view(torch.uint8)


def _host_bytes(tensor: torch.Tensor) -> Any:
    """A tensor's bytes in C order on the CPU, as a flat unsigned-byte buffer: through numpy where it can (one
    torch call where the torch route takes four: most of what a small tensor costs)."""
    if tensor.is_cpu and tensor.dtype in _FROM_NUMPY and tensor.numel():
        array = tensor.numpy()
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        return array.reshape(-1).view(np.uint8).data
    return _flat(tensor).cpu().numpy().data


def parse_table(view: memoryview, count: int, inline_len: int, kinds: bool = True) -> List[Entry]:
    """Parse and validate a tensor table; raise :class:`FrameError` on anything inconsistent.
    ``kinds``: the frame's format may carry :data:`KINDS` (version 2)."""
    entries, position, oob, inline_end, size = [], 0, 0, 0, view.nbytes
    valid = _VALID_FLAGS[kinds]
    for _ in range(count):
        if position + ENTRY.size > size:
            raise FrameError("truncated tensor table")
        code, flags, ndim, nbytes, offset = ENTRY.unpack_from(view, position)
        position += ENTRY.size
        known = _KNOWN.get(code)
        if known is None or ndim > MAX_NDIM:
            raise FrameError(f"tensor table entry with unknown dtype code {code} or {ndim} dimensions")
        if position + ndim * DIM.size > size:
            raise FrameError("truncated tensor table")
        shape = _DIMS[ndim].unpack_from(view, position)
        position += ndim * DIM.size
        dtype, itemsize = known
        if flags not in valid:
            raise FrameError(f"tensor table entry with flags {flags:#x}: unknown or contradictory")
        if flags & (BYTES | BYTEARRAY) and (dtype != torch.uint8 or ndim != 1):
            raise FrameError("tensor table entry: bytes must be a flat uint8 entry")
        if flags & NUMPY and dtype not in _NUMPY_OF:
            raise FrameError(f"tensor table entry: a numpy array of {dtype}, which numpy has not")
        # checked before anything of this size exists: no negative or overflowing shape, nbytes in range (each
        # size below 2**62, so the product of at most 64 is a small big int); an empty one's other sizes in range too
        # (numpy refuses (0, 2**61, 2**61); torch built it, and a later .sum(0) asked for the product: a helper's find)
        if (
            nbytes >= MAX_NBYTES
            or shape
            and (min(shape) < 0 or max(shape) >= MAX_NBYTES)
            or (math.prod(shape) * itemsize != nbytes)
            or not nbytes
            and math.prod(d for d in shape if d) * itemsize >= MAX_NBYTES
        ):
            raise FrameError(f"tensor table entry: shape {shape} of {dtype} is not {nbytes} bytes")
        if flags & INLINE:
            # in order and disjoint, as the encoder writes them: each entry is copied out, so entries
            # sharing bytes would multiply them
            if offset < inline_end or offset + nbytes > inline_len:
                raise FrameError("tensor table entries point past (or share) the inline tensor data")
            inline_end = offset + nbytes
        elif offset != oob:
            raise FrameError("tensor table lists out-of-band tensors out of order")
        else:
            oob += 1
        entries.append(_new(Entry, (dtype, flags, shape, nbytes, offset)))
    if position != size:
        raise FrameError("tensor table length disagrees with its entries")
    return entries


def restorer(
    entries: Sequence[Entry],
    inline: memoryview,
    oob: Sequence[torch.Tensor],
    device: torch.device,
    own: bool = False,
    copy_out: Optional[Callable[[int, type], Any]] = None,
) -> Any:
    """The ``restore`` hook for serializers: key -> tensor on ``device``.

    ``own``: the out-of-band buffers alias the caller's input (a root's own tensors), so copy them.
    ``copy_out``: builds out-of-band ``bytes``/``bytearray`` values from where they lie instead of from
    their tensor (:attr:`objcomm._transport.base.Incoming.copy_out`).
    """
    out_of_band = [e for e in entries if not e.flags & INLINE]
    if len(out_of_band) != len(oob):
        raise FrameError(f"the frame announces {len(out_of_band)} out-of-band tensors, {len(oob)} arrived")
    for i, (entry, tensor) in enumerate(zip(out_of_band, oob)):
        if entry.nbytes != tensor.numel():
            raise FrameError(
                f"the frame announces {entry.nbytes:,} bytes for out-of-band tensor #{i}, {tensor.numel():,} arrived"
            )
    on_cpu = device.type == "cpu"
    restored: Dict[int, Any] = {}

    def restore(key: Any) -> Any:
        # Each key is built once and shared: a payload naming one tensor many times (the sender's
        # aliases do) gets one tensor, not a copy per mention.
        if type(key) is not int:
            raise FrameError(f"payload refers to a tensor by a {type(key).__name__}, not by its index")
        if not 0 <= key < len(entries):
            raise FrameError(f"payload refers to tensor #{key}, the frame has {len(entries)}")
        found = restored.get(key)
        if found is None:
            found = restored[key] = _restore(entries[key])
        return found

    def _restore(entry: Entry) -> Any:
        """The tensor (or numpy array, bytes, bytearray) an entry describes."""
        dtype, flags, shape, nbytes, offset = entry
        if flags & INLINE:
            # one copy into memory the result owns (the frame may be read-only or reused)
            if flags & (BYTES | BYTEARRAY):
                return (bytes if flags & BYTES else bytearray)(inline[offset : offset + nbytes])
            data = bytearray(inline[offset : offset + nbytes])
            if flags & NUMPY:  # on the CPU wherever tensors go
                return np.ndarray(shape, _NUMPY_OF[dtype], data)
            if dtype in _FROM_NUMPY:  # cheaper than torch.frombuffer(...).reshape(...)
                tensor = torch.from_numpy(np.ndarray(shape, _NUMPY_OF[dtype], data))
            else:
                tensor = (torch.frombuffer(data, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)).reshape(shape)
            if not on_cpu:
                tensor = tensor.to(device)
        else:
            raw = oob[offset]
            raw = raw.clone() if own and not flags & (BYTES | BYTEARRAY) else raw  # those are copied below
            if flags & (BYTES | BYTEARRAY):
                kind = bytes if flags & BYTES else bytearray
                if copy_out is not None:  # never through the tensor's pages (a mapping)
                    return copy_out(offset, kind)
                return kind(raw.cpu().numpy().data)  # one copy into the bytes object (which owns its memory)
            if raw.storage_offset() % dtype.itemsize:  # bytes received at an offset the dtype cannot view
                raw = raw.clone()  # (one receive buffer for several tensors: all_to_all's parts, back to back)
            if flags & NUMPY:  # a view on what arrived, on the CPU wherever tensors go
                return raw.cpu().view(dtype).reshape(shape).numpy()
            tensor = raw.view(dtype).reshape(shape).to(device)
        if flags & PARAMETER:
            return torch.nn.Parameter(tensor, requires_grad=bool(flags & REQUIRES_GRAD))
        if flags & REQUIRES_GRAD:
            tensor.requires_grad_(True)
        return tensor

    return restore
