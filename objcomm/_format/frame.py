"""The wire format: every payload travels as one self-describing frame.

Frame, format version 1 (all integers little-endian)::

    offset  size  field
    0       4     magic            b"OBJC"
    4       1     version          1
    5       1     flags            bit 0: error report (payload is JSON {"type", "message"}); 1-7: op mark
    6       1     compression      0 none, 1 zstd, 2 lz4
    7       1     name_len         length of the serializer name
    8       4     table_len        bytes of the out-of-band tensor table
    12      4     n_tensors        entries in that table
    16      8     payload_len      payload bytes as stored (after compression)
    24      8     raw_len          payload bytes before compression (== payload_len when none)
    32      8     inline_len       bytes of small tensors stored inside the frame
    40      n     serializer name  ASCII
    40+n    t     tensor table
    ...     p     payload          what the serializer wrote
    ...     i     inline tensor data

A frame is valid only when its length is exactly ``40 + name_len + table_len + payload_len + inline_len``; all is
checked against the bytes received before anything of a declared size is allocated. ``tests/golden/`` pins it.
"""

from __future__ import annotations

import functools
import json
import re
import struct
import sys
from typing import Any, Callable, Collection, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from objcomm._errors import (
    ContentRefusedError,
    DecodeError,
    EncodeError,
    FrameError,
    ObjcommError,
    UnknownSerializerError,
    original,
)
from objcomm._format import compression as _compression
from objcomm._format.limits import too_large
from objcomm._format.message import Incoming, Outgoing
from objcomm._format.tensors import (
    WHOLE_PAYLOAD_MOST,
    Entry,
    TensorLifter,
    WholeBytes,
    check_whole,
    parse_table,
    restorer,
)
from serializers import AutoSerializer, SerializerProtocol, registry
from serializers._auto import exact as auto_exact
from serializers._auto import no_candidate
from serializers._msgpack import unexplained_refusals
from serializers._protocol import SAFE_RECURSION_LIMIT

MAGIC = b"OBJC"
VERSION = 2  # the newest format: a tensor table may carry numpy arrays and whole bytes (objcomm._format.tensors.KINDS)
VERSIONS = (1, 2)  # what this objcomm reads; it writes the lowest that can carry a frame
HEADER = struct.Struct("<4sBBBBIIQQQ")
FLAG_ERROR = 1
MAX_ERROR_REPORT = 1 << 20
_STRUCTURE = re.compile(r'[\[\]{}"\\]')  # what _nesting reads of a report
MAX_REPORT_NESTING = 64  # brackets in a report, counted where SAFE_RECURSION_LIMIT is past (one object is written)
NO_COMPRESSION = _compression.NONE
_new = tuple.__new__


class Header(NamedTuple):
    """The parsed fixed header of a frame (a tuple: built on every decode, so it must be cheap)."""

    version: int
    flags: int
    compression: int
    serializer: str
    table_len: int
    n_tensors: int
    payload_len: int
    raw_len: int
    inline_len: int

    @property
    def is_error(self) -> bool:
        return bool(self.flags & FLAG_ERROR)

    @property
    def payload_offset(self) -> int:
        return HEADER.size + len(self.serializer) + self.table_len


def _assemble(name: str, payload: Any, **fields: Any) -> memoryview:
    """The frame of :func:`_frame_parts` as one buffer."""
    return memoryview(bytearray().join(_frame_parts(name, payload, **fields)[0]))


def _frame_parts(
    name: str,
    payload: Any,
    *,
    flags: int = 0,
    compression: int = NO_COMPRESSION,
    raw_len: Optional[int] = None,
    table: bytes = b"",
    n_tensors: int = 0,
    inline: Sequence[memoryview] = (),
    version: int = 1,
) -> Tuple[List[Any], int]:
    """``(parts, length)``: header, name, tensor table, payload and inline tensors, a frame's parts in order,
    not joined (:class:`~objcomm._transport.base.Outgoing` joins them only where one buffer is needed), and their
    bytes."""
    name_bytes = name.encode("ascii")
    body = (
        payload
        if type(payload) is memoryview and payload.format == "B" and payload.ndim == 1
        else (memoryview(payload).cast("B"))
    )
    parts: List[Any] = [b"", name_bytes, table, body]
    inline_len = 0
    for part in inline:  # flat unsigned-byte buffers (TensorLifter.pack)
        parts.append(part)
        inline_len += part.nbytes
    parts[0] = HEADER.pack(
        MAGIC,
        version,
        flags,
        compression,
        len(name_bytes),
        len(table),
        n_tensors,
        body.nbytes,
        body.nbytes if raw_len is None else raw_len,
        inline_len,
    )
    return parts, HEADER.size + len(name_bytes) + len(table) + body.nbytes + inline_len


Serialized = Tuple[Any, TensorLifter, SerializerProtocol]  # a payload, what it lifted, who wrote it


def serialize(obj: Any, serializer: SerializerProtocol, inline_tensor_bytes: int) -> Serialized:
    """``(payload, lifter, serializer used)``: the first step of :func:`encode`, the serializer's own work.

    Small numpy arrays stay in the payload where the serializer writes them exactly itself: up to its
    ``in_band_array_bytes`` (none where it has none) and ``inline_tensor_bytes``; see
    :class:`~objcomm._format.tensors.TensorLifter`. Tensors are always lifted: they arrive on the receiver's device.
    ``serializer="auto"`` (:class:`serializers.AutoSerializer`) tries its candidates for ``obj`` in turn.
    """
    if isinstance(serializer, AutoSerializer):
        return _serialize_auto(obj, serializer, inline_tensor_bytes)
    in_band_arrays = min(inline_tensor_bytes, getattr(serializer, "in_band_array_bytes", -1))
    lifter = TensorLifter(in_band_arrays)
    if type(obj) in (bytes, bytearray) and len(obj) > inline_tensor_bytes and serializer.supports_external:
        payload = serializer.dumps(WholeBytes(obj), lift=lifter)  # travels like a tensor: not copied into the payload
        if memoryview(payload).nbytes <= WHOLE_PAYLOAD_MOST:  # the reference alone, as receivers take it (every
            return payload, lifter, serializer  # built-in's: 3-57 bytes); a serializer that writes more: in band
        lifter = TensorLifter(in_band_arrays)
    return serializer.dumps(obj, lift=lifter), lifter, serializer


def _serialize_auto(obj: Any, chooser: AutoSerializer, inline_tensor_bytes: int) -> Serialized:
    try:
        return _choose_and_serialize(obj, chooser, inline_tensor_bytes)
    except ObjcommError:
        raise
    except Exception as exc:  # the object's own code (a hash, an __eq__) raised while auto looked at it
        raise EncodeError(
            f"serializer 'auto' could not look at this {type(obj).__name__} ({type(exc).__name__}: "
            f"{exc}); name a serializer instead"
        ) from exc


def _choose_and_serialize(obj: Any, chooser: AutoSerializer, inline_tensor_bytes: int) -> Serialized:
    """The first candidate's that takes ``obj`` and, where :meth:`~serializers.AutoSerializer.candidates` says so,
    gives it back exactly: decoded here (the lifted objects themselves restored) and judged."""
    refused: Tuple[str, ...] = ()  # who refused obj itself already: not asked again
    fast = chooser.exact_leader(obj)
    if fast is not None:  # JSON-like data (and tensors): msgspec, exact for what it holds
        try:
            with unexplained_refusals():
                return serialize(obj, fast, inline_tensor_bytes)
        except ObjcommError:  # a lone surrogate in a string, say: pickle, without finding where it sits
            refused = (fast.name,)
    leader = chooser.leader(obj)
    if leader is not None:  # the common case: pickle, first and exact by construction; nothing else worked out
        try:
            return serialize(obj, leader, inline_tensor_bytes)
        except ObjcommError:
            chooser.leader_refused(obj)
            refused += (leader.name,)
    sig, trusted = chooser.trusted(obj)
    if trusted is not None and trusted.name not in refused:  # the one that took the last object of this signature
        try:
            return serialize(obj, trusted, inline_tensor_bytes)
        except ObjcommError:
            refused += (trusted.name,)
    for candidate, judged, outcome in chooser.candidates(obj, sig, refused):
        try:
            done = serialize(obj, candidate, inline_tensor_bytes)
            took = not judged or auto_exact(obj, candidate.loads(done[0], restore=done[1].original))
        except ObjcommError:  # refused to encode, or to decode what it wrote (restricted-pickle)
            took = False
        outcome(took)
        if took:
            return done
    raise no_candidate(chooser, obj)


def encode(
    obj: Any,
    serializer: SerializerProtocol,
    *,
    max_bytes: int,
    inline_tensor_bytes: int = 64 << 10,
    compression: Optional[str] = None,
    serialized: Optional[Serialized] = None,
    flags: int = 0,
) -> Outgoing:
    """Serialize ``obj`` into a frame plus out-of-band tensors; raise :class:`EncodeError` or :class:`TooLargeError`.

    ``serializer`` is one ``serializers.registry.guarded()`` returns, so it raises only objcomm's errors. Tensors are
    lifted out when it supports that (the pickle family, msgpack). ``serialized``: what :func:`serialize` returned for
    ``obj`` already, not serialized again. ``flags``: the header's (a reduction's op: ``_api.reduce.op_flags``).
    """
    payload, lifter, serializer = serialize(obj, serializer, inline_tensor_bytes) if serialized is None else serialized
    packed = lifter.pack(inline_tensor_bytes) if lifter.tensors else None
    raw = memoryview(payload).cast("B")
    code, stored = (NO_COMPRESSION, raw) if compression is None else _compression.compress(compression, raw)
    if packed is not None:
        table, inline, oob = packed
        version = 2 if any(lifter.kinds) else 1  # a version 1 reader would take numpy or bytes for tensors
        parts, length = _frame_parts(
            serializer.name,
            stored,
            compression=code,
            raw_len=raw.nbytes,
            table=table,
            n_tensors=len(lifter.tensors),
            inline=inline,
            version=version,
            flags=flags,
        )
    else:  # the common small case: no tensor table, nothing out of band
        parts, length = _frame_parts(serializer.name, stored, compression=code, raw_len=raw.nbytes, flags=flags)
        oob = []
    out = Outgoing(parts=parts, tensors=oob, nbytes=length)
    if out.total > max_bytes:
        raise too_large(
            f"the encoded object is {out.total:,} bytes, above max_bytes={max_bytes:,}",
            outcome="nothing was sent",
            where="on this rank",
        )
    return out


def error_frame(exc: Union[BaseException, Tuple[str, str]], limit: int) -> Outgoing:
    """An error report about ``exc`` in at most ``limit`` bytes and :data:`MAX_ERROR_REPORT` (what a reader takes),
    its message cut to fit, then its type's name: what really failed (an :class:`EncodeError`'s cause, e.g.
    ``PicklingError``), the message ``exc``'s; or a report's ``(type name, message)`` (:func:`read_error`'s)."""
    kind, message = exc if isinstance(exc, tuple) else (type(original(exc)).__name__, str(exc))
    limit = min(limit, MAX_ERROR_REPORT)
    while True:
        payload = json.dumps({"type": kind, "message": message}).encode()
        frame = _assemble("", payload, flags=FLAG_ERROR)
        if frame.nbytes <= limit or not message and not kind:
            return Outgoing(frame, error=True)
        cut, text = frame.nbytes - limit + 4, message or kind  # (characters: each at least a byte of the JSON)
        text = text[: max(0, len(text) - cut)] + "…" if len(text) > 8 else ""
        message, kind = (text, kind) if message else ("", text)


def parse_header(view: memoryview) -> Header:
    """Parse and check a frame's header against the bytes received; raise :class:`FrameError`."""
    size = view.nbytes
    if size < HEADER.size:
        raise FrameError(f"truncated frame: {size} bytes received, a header alone takes {HEADER.size}")
    magic, version, flags, compression, name_len, table_len, n_tensors, payload_len, raw_len, inline_len = (
        HEADER.unpack_from(view, 0)
    )
    if magic != MAGIC:
        raise FrameError(
            f"not an objcomm frame (magic {bytes(magic)!r}, expected {MAGIC!r}); "
            "is every rank running objcomm, and the same version?"
        )
    if version not in VERSIONS:
        raise FrameError(
            f"frame format version {version} is unknown here (this objcomm reads {', '.join(map(str, VERSIONS))}); "
            "upgrade objcomm"
        )
    expected = HEADER.size + name_len + table_len + payload_len + inline_len
    if expected != size:
        raise FrameError(f"frame lengths disagree: the header declares {expected:,} bytes, {size:,} were received")
    try:
        name = str(view[HEADER.size : HEADER.size + name_len], "ascii")
    except UnicodeDecodeError:
        name_bytes = bytes(view[HEADER.size : HEADER.size + name_len])
        raise FrameError(f"frame names a serializer that is not ASCII: {name_bytes!r}") from None
    # tuple.__new__: Header's own __new__ is a Python function, one more call on every decode
    return _new(Header, (version, flags, compression, name, table_len, n_tensors, payload_len, raw_len, inline_len))


def read_error(view: memoryview, header: Header) -> tuple[str, str]:
    """The ``(type name, message)`` an error frame carries; anything else there is a :class:`FrameError`."""
    if header.payload_len > MAX_ERROR_REPORT:
        raise FrameError(f"error report of {header.payload_len:,} bytes, above the {MAX_ERROR_REPORT:,} allowed")
    start = header.payload_offset
    try:
        # UTF-8, as reports are written: json.loads would take UTF-16 or -32 bytes too, which _nesting cannot read (a
        # reviewer's find: a UTF-16 report hid its brackets from it)
        text = str(view[start : start + header.payload_len], "utf-8")
        # json's C scanner checks its own recursion (RecursionError, not a crash), in linear time; a regex pre-scan
        # for nesting was quadratic on an unterminated string of escaped quotes. Where a program raised the
        # recursion limit that check comes too late for the C stack (an attacker's find: 200 KB of brackets under a
        # limit of 1,000,000, a segfault): there the nesting is counted first.
        if sys.getrecursionlimit() > SAFE_RECURSION_LIMIT and _nesting(text) > MAX_REPORT_NESTING:
            raise TypeError(f"a report nested over {MAX_REPORT_NESTING} deep")
        report = json.loads(text)
        if not isinstance(report, dict) or not all(isinstance(report.get(k), str) for k in ("type", "message")):
            raise TypeError('expected {"type": str, "message": str}')
        return report["type"], report["message"]
    except (ValueError, TypeError, RecursionError) as exc:
        raise FrameError(f"malformed error report in frame: {exc}") from None


def _nesting(text: str) -> int:
    """How deep JSON ``text`` nests arrays and objects, its strings skipped: linear (one regex of single characters,
    then a loop over what it found)."""
    depth = deepest = 0
    in_string, escaped_at = False, -1  # where the byte a backslash escapes lies (only the one right after it)
    for found in _STRUCTURE.finditer(text):
        char, at = found.group(), found.start()
        if at == escaped_at:
            continue
        if char == "\\":
            escaped_at = at + 1 if in_string else -1
        elif char == '"':
            in_string = not in_string
        elif not in_string:
            depth += 1 if char in "[{" else -1
            deepest = max(deepest, depth)
    return deepest


def tensor_sizes(view: memoryview) -> List[int]:
    """Byte sizes of the out-of-band tensors a frame announces (the transport's ``sizes_of``)."""
    header = parse_header(view)
    if header.is_error or not header.n_tensors:
        return []
    return [e.nbytes for e in _table(view, header) if not e.inline]


def _table(view: memoryview, header: Header) -> List[Entry]:
    start = HEADER.size + len(header.serializer)
    kinds = header.version >= 2  # numpy arrays and whole bytes came with version 2
    return parse_table(view[start : start + header.table_len], header.n_tensors, header.inline_len, kinds)


def decode(
    incoming: Incoming,
    *,
    sender: int,
    accept: Optional[Collection[str]],
    device: torch.device = torch.device("cpu"),
    max_bytes: int = 1 << 62,
    own: bool = False,
) -> Any:
    """Decode what arrived from group rank ``sender``; tensors are placed on ``device``.

    Raises :class:`FrameError`, :class:`ContentRefusedError` (serializer not in ``accept``, checked
    before the payload is touched), :class:`UnknownSerializerError` or :class:`DecodeError`.
    ``own``: the tensors are the caller's own input (a root keeping its own object): copy them.
    """
    view = incoming.frame
    return decode_parsed(view, parse_header(view), incoming, sender, accept, device, max_bytes, own)


def decode_parsed(
    view: memoryview,
    header: Header,
    incoming: Incoming,
    sender: int,
    accept: Optional[Collection[str]],
    device: torch.device,
    max_bytes: int,
    own: bool = False,
) -> Any:
    """:func:`decode` of a frame whose header is parsed and checked already."""
    if header.flags & FLAG_ERROR:  # header.is_error, without a call
        raise FrameError(f"rank {sender} sent an error report where data was expected")
    if accept is not None and header.serializer not in accept:
        raise ContentRefusedError(
            f"rank {sender} sent a {header.serializer!r} payload, but this rank accepts only {sorted(accept)}; "
            "add it to accept= if you trust the sender, or send with an accepted serializer"
            + registry.unregistered(accept)
        )
    try:
        serializer = registry.guarded(header.serializer)
    except UnknownSerializerError as exc:
        raise UnknownSerializerError(
            f"rank {sender} sent a frame encoded with {header.serializer!r}, but {exc}"
        ) from None
    entries = _table(view, header) if header.n_tensors else []
    if entries and header.version >= 2:  # (whole bytes came with version 2)
        check_whole(entries, max(header.payload_len, header.raw_len))
    start = HEADER.size + len(header.serializer) + header.table_len  # header.payload_offset, without a call
    payload = view[start : start + header.payload_len]
    if header.compression != NO_COMPRESSION:
        payload = memoryview(_compression.decompress(header.compression, payload, header.raw_len, max_bytes))
    restore_of = None
    if entries:  # the inline tensor data follows the payload
        restore_of = functools.partial(
            restorer,
            entries,
            view[start + header.payload_len :],
            incoming.tensors,
            device,
            own=own,
            copy_out=incoming.copy_out,
        )
    return loads_payload(serializer, header.serializer, payload, sender, restore_of)


def loads_payload(
    serializer: SerializerProtocol,
    name: str,
    payload: memoryview,
    sender: int,
    restore_of: Optional[Callable[[], Any]] = None,
) -> Any:
    """``serializer.loads(payload)``, what goes wrong saying it came from group rank ``sender``; ``name``: the
    serializer's. ``restore_of()``: the hook that restores the frame's tensors, where it has some."""
    try:
        restore = None if restore_of is None else restore_of()
        if restore is not None and not serializer.supports_external:
            raise DecodeError(f"{name!r} cannot take tensors out of band, yet the frame carries some")
        return serializer.loads(payload, restore=restore)
    except ContentRefusedError as exc:
        raise ContentRefusedError(f"payload from rank {sender}: {exc}") from exc
    except FrameError:
        raise
    except ObjcommError as exc:  # the serializer's own DecodeError: say where the payload came from
        raise DecodeError(f"could not decode the {name!r} payload from rank {sender}: {exc}") from exc
