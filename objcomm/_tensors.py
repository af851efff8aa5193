"""Tensors inside objects travel as tensors: lifted out of the byte stream, moved natively.

While a serializer encodes an object, :class:`TensorLifter` takes every ``torch.Tensor`` it is
offered (anywhere: in dicts, lists, user classes for the pickle family) and leaves a key in its
place. numpy arrays of a dtype torch shares go the same way, as a tensor viewing the array's
memory (no copy), and so does a large ``bytes``/``bytearray`` given as the whole object (see
:func:`objcomm._framing.encode`). Small ones are then copied into the frame; large ones travel
*out of band* as flat uint8 tensors with native collectives (on NCCL they never touch the host).
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

import functools
import struct
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ._errors import FrameError

DTYPES = (
    "float32", "float64", "float16", "bfloat16", "uint8", "int8", "int16", "int32", "int64", "bool",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
)  # codes are positions in this tuple: append only
_CODES: Dict[torch.dtype, int] = {getattr(torch, n): i for i, n in enumerate(DTYPES) if hasattr(torch, n)}
ENTRY = struct.Struct("<BBB5xQQ")
DIM = struct.Struct("<q")
INLINE, REQUIRES_GRAD, PARAMETER, NUMPY, BYTES, BYTEARRAY = 1, 2, 4, 8, 16, 32
KINDS = NUMPY | BYTES | BYTEARRAY  # what the entry becomes on the receiver, other than a tensor (format 2)
_FLAGS = INLINE | REQUIRES_GRAD | PARAMETER | KINDS
MAX_NDIM = 64
MAX_NBYTES = 1 << 62  # no tensor announces this much; keeps every size an int64 for torch


def _product(shape: Tuple[int, ...]) -> int:
    """The element count, stopping once it passes MAX_NBYTES (a hostile shape of 64 huge dims stays cheap)."""
    count = 1
    for d in shape:
        count *= d
        if count >= MAX_NBYTES:
            return MAX_NBYTES
    return count


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def liftable(value: Any) -> bool:
    """A plain strided CPU or CUDA tensor (or Parameter) of a dtype in :data:`DTYPES`, without attributes of
    its own. A subclass, or a tensor given attributes, is left to the serializer, which keeps them (pickle)
    or refuses it: lifted, it would arrive as a plain tensor, its class and attributes silently lost."""
    return (
        type(value) in _PLAIN_TENSORS
        and not value.__dict__
        and value.layout == torch.strided
        and value.device.type in ("cpu", "cuda")
        and value.dtype in _CODES
        and not value.is_quantized
    )


@dataclass(frozen=True)
class Entry:
    """One tensor of the table."""

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


def _as_tensor(value: Any) -> Optional[Tuple[torch.Tensor, int]]:
    """``(tensor sharing value's memory, kind flag)`` for what travels out of band besides tensors."""
    if type(value) is np.ndarray:
        # torch's dtypes only, native byte order (object, structured, datetime and '>f4' stay in band)
        if not value.dtype.isnative or value.dtype.hasobject or value.dtype.fields is not None:
            return None
        try:
            with warnings.catch_warnings():  # a read-only array: the tensor is only ever read
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.from_numpy(np.ascontiguousarray(value))
        except TypeError:  # a dtype torch lacks
            return None
        return (tensor, NUMPY) if tensor.dtype in _CODES else None
    if type(value) is WholeBytes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            empty = not len(value.data)
            flat = torch.empty(0, dtype=torch.uint8) if empty else torch.frombuffer(value.data, dtype=torch.uint8)
        return flat, (BYTES if type(value.data) is bytes else BYTEARRAY)
    return None


class TensorLifter:
    """The ``lift`` hook handed to serializers; collects tensors, each once (aliases share a key)."""

    def __init__(self) -> None:
        self.tensors: List[torch.Tensor] = []
        self.kinds: List[int] = []  # 0, NUMPY, BYTES or BYTEARRAY per key
        self._keys: Dict[int, int] = {}
        self._held: List[Any] = []  # what the keys' ids belong to, alive until encoding ends

    def __call__(self, value: Any) -> Optional[int]:
        key = self._keys.get(id(value))
        if key is not None:
            return key
        if liftable(value):
            tensor, kind = value, 0
        else:
            found = _as_tensor(value)
            if found is None:
                return None
            tensor, kind = found
        key = self._keys[id(value)] = len(self.tensors)
        self.tensors.append(tensor)
        self.kinds.append(kind)
        self._held.append(value)
        return key

    def pack(self, inline_max: int) -> Tuple[bytes, List[torch.Tensor], List[torch.Tensor]]:
        """``(table, inline parts on the CPU, out-of-band flat uint8 tensors)``."""
        table = bytearray()
        inline: List[torch.Tensor] = []
        oob: List[torch.Tensor] = []
        inline_len = 0
        for tensor, kind in zip(self.tensors, self.kinds):
            data = tensor.detach().resolve_conj().resolve_neg().contiguous()
            if data.numel():
                flat = data.reshape(-1).view(torch.uint8)
            else:  # empty: its strides may be 0 (numpy's empty arrays), which view() refuses
                flat = torch.empty(0, dtype=torch.uint8, device=data.device)
            flags = kind | (REQUIRES_GRAD if tensor.requires_grad else 0) | (
                PARAMETER if isinstance(tensor, torch.nn.Parameter) else 0
            )
            if flat.numel() <= inline_max:
                flags |= INLINE
                offset = inline_len
                inline.append(flat.cpu())
                inline_len += flat.numel()
            else:
                offset = len(oob)
                oob.append(flat)
            table += ENTRY.pack(_CODES[tensor.dtype], flags, tensor.dim(), flat.numel(), offset)
            table += b"".join(DIM.pack(d) for d in tensor.shape)
        return bytes(table), inline, oob


def parse_table(view: memoryview, count: int, inline_len: int, kinds: bool = True) -> List[Entry]:
    """Parse and validate a tensor table; raise :class:`FrameError` on anything inconsistent.
    ``kinds``: the frame's format may carry :data:`KINDS` (version 2)."""
    entries, position, oob, inline_end = [], 0, 0, 0
    for _ in range(count):
        if position + ENTRY.size > view.nbytes:
            raise FrameError("truncated tensor table")
        code, flags, ndim, nbytes, offset = ENTRY.unpack_from(view, position)
        position += ENTRY.size
        if code >= len(DTYPES) or not hasattr(torch, DTYPES[code]) or ndim > MAX_NDIM:
            raise FrameError(f"tensor table entry with unknown dtype code {code} or {ndim} dimensions")
        if position + ndim * DIM.size > view.nbytes:
            raise FrameError("truncated tensor table")
        shape = tuple(DIM.unpack_from(view, position + i * DIM.size)[0] for i in range(ndim))
        position += ndim * DIM.size
        dtype, itemsize = _dtype_of(code)
        kind = flags & KINDS
        if flags & ~_FLAGS or kind & (kind - 1) or kind and (flags & (REQUIRES_GRAD | PARAMETER) or not kinds):
            raise FrameError(f"tensor table entry with flags {flags:#x}: unknown or contradictory")
        if kind & (BYTES | BYTEARRAY) and (dtype != torch.uint8 or ndim != 1):
            raise FrameError("tensor table entry: bytes must be a flat uint8 entry")
        # checked before anything of this size exists: no negative or overflowing shape, nbytes in range
        if nbytes >= MAX_NBYTES or any(not 0 <= d < MAX_NBYTES for d in shape) or _product(shape) * itemsize != nbytes:
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
        entries.append(Entry(dtype, flags, shape, nbytes, offset))
    if position != view.nbytes:
        raise FrameError("tensor table length disagrees with its entries")
    return entries


@functools.cache
def _dtype_of(code: int) -> Tuple[torch.dtype, int]:
    """The dtype of a table code and its item size (computing the size costs microseconds: cached)."""
    dtype = getattr(torch, DTYPES[code])
    return dtype, torch.empty((), dtype=dtype).element_size()


def restorer(
    entries: Sequence[Entry], inline: memoryview, oob: Sequence[torch.Tensor], device: torch.device,
    own: bool = False, copy_out: Optional[Callable[[int, type], Any]] = None,
) -> Any:
    """The ``restore`` hook for serializers: key -> tensor on ``device``.

    ``own``: the out-of-band buffers alias the caller's input (a root's own tensors), so copy them.
    ``copy_out``: builds out-of-band ``bytes``/``bytearray`` values from where they lie instead of from
    their tensor (:attr:`objcomm._wire.Incoming.copy_out`).
    """
    out_of_band = [e for e in entries if not e.inline]
    if len(out_of_band) != len(oob) or any(e.nbytes != t.numel() for e, t in zip(out_of_band, oob)):
        raise FrameError(f"the frame announces {len(out_of_band)} out-of-band tensors, {len(oob)} arrived")

    restored: Dict[int, Any] = {}

    def restore(key: Any) -> Any:
        # Each key is built once and shared: a payload naming one tensor many times (the sender's
        # aliases do) gets one tensor, not a copy per mention.
        if type(key) is not int:
            raise FrameError(f"payload refers to a tensor by a {type(key).__name__}, not by its index")
        if not 0 <= key < len(entries):
            raise FrameError(f"payload refers to tensor #{key}, the frame has {len(entries)}")
        if key not in restored:
            restored[key] = _restore(entries[key])
        return restored[key]

    def _restore(entry: Entry) -> Any:
        """The tensor (or numpy array, bytes, bytearray) an entry describes."""
        if entry.inline:
            # one copy into memory the tensor owns (the frame may be read-only or reused)
            data = bytearray(inline[entry.offset : entry.offset + entry.nbytes])
            raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        else:
            raw = oob[entry.offset]
            raw = raw.clone() if own and not entry.flags & (BYTES | BYTEARRAY) else raw  # those are copied below
        if entry.flags & (BYTES | BYTEARRAY):
            kind = bytes if entry.flags & BYTES else bytearray
            if copy_out is not None and not entry.inline:  # never through the tensor's pages (a mapping)
                return copy_out(entry.offset, kind)
            return kind(raw.cpu().numpy().data)  # one copy into the bytes object (which owns its memory)
        if raw.storage_offset() % entry.dtype.itemsize:  # bytes received at an offset the dtype cannot view
            raw = raw.clone()  # (one receive buffer for several tensors: all_to_all's parts, back to back)
        if entry.flags & NUMPY:  # a view on what arrived, on the CPU wherever tensors go
            return raw.cpu().view(entry.dtype).reshape(entry.shape).numpy()
        tensor = raw.view(entry.dtype).reshape(entry.shape).to(device)
        if entry.flags & PARAMETER:
            return torch.nn.Parameter(tensor, requires_grad=bool(entry.flags & REQUIRES_GRAD))
        if entry.flags & REQUIRES_GRAD:
            tensor.requires_grad_(True)
        return tensor

    return restore
