"""A *plain* frame inside a round-1 slot, written and read in one pass: the express path's frames.

A plain frame has no flag bits, no tensor table, nothing inline or out of band and no compression: a
header, a serializer name and a payload. :func:`small_slot` writes the round-1 slot of such a frame
directly (the slot's prefix and the frame's header packed in one struct, the slot trimmed after the
frame), and :func:`plain_in_slot` and :func:`plain_named` read one back without the general path's
steps (:func:`objcomm._format.slot.read_slot`, then :func:`objcomm._format.frame.parse_header`). They
accept only what that path accepts and read it the same way; any other slot gets None, and the general
path then reads and judges it. The frame's layout is :mod:`objcomm._format.frame`'s, the slot's
:mod:`objcomm._format.slot`'s.
"""

from __future__ import annotations

import struct
from typing import Any, List, Optional, Tuple

from objcomm._format.frame import HEADER, MAGIC, NO_COMPRESSION, VERSIONS, Header, _new
from objcomm._format.slot import COUNT, PREFIX

_SLOT_HEADER = struct.Struct(PREFIX.format + HEADER.format[1:])  # a round-1 slot's prefix, then a frame's header
_NOTHING_LISTED = struct.Struct(PREFIX.format + COUNT.format[1:])  # a slot whose frame follows it, and no tensors


def small_slot(name: bytes, payload: Any, slot_bytes: int, limit: int) -> Optional[bytes]:
    """The round-1 slot of a frame of ``payload`` with no tensor table and no compression, written in
    one pass and *trimmed* after the frame: byte for byte the start of what :func:`objcomm._format.frame.encode`
    and :func:`objcomm._format.slot.fill_slot` write for it, whose rest is zeros (``limit``: the sender's
    ``max_bytes``). A send/recv through the same-host channel may travel so
    (:func:`objcomm._samehost.channel_checks.trimmed`). None when the frame does not fit the slot or ``limit``:
    :func:`objcomm._format.frame.encode` then says why, or the slot's second round moves it.
    """
    body = payload if type(payload) is bytes else memoryview(payload).cast("B")
    size = len(body)  # bytes, or a 1-d view of unsigned bytes: its length is its size
    length = HEADER.size + len(name) + size
    if PREFIX.size + length > slot_bytes or length > limit:
        return None
    # the slot's prefix (no flag bits: not an error, nothing listed), then the frame's header
    head = _SLOT_HEADER.pack(length, limit, length, MAGIC, 1, 0, NO_COMPRESSION, len(name), 0, 0, size, size, 0)
    return b"".join((head, name, body))


def medium_slot(name: bytes, payload: Any, slot_bytes: int, limit: int, most: int) -> Optional[List[Any]]:
    """``[slot, the frame's header, name, payload]``: the untrimmed round-1 slot of a plain frame of ``payload``
    that does not fit it, and the frame that follows it, byte for byte what :func:`objcomm._format.frame.encode`
    and :func:`objcomm._format.slot.fill_slot` write for it (the slot's prefix, no tensors listed, zeros). None where
    the frame fits the slot (:func:`small_slot`), passes ``limit`` (the general path then says why) or ``most``."""
    body = payload if type(payload) is bytes else memoryview(payload).cast("B")
    size = len(body)
    length = HEADER.size + len(name) + size
    if PREFIX.size + length <= slot_bytes or length > limit or length > most:
        return None
    slot = bytearray(slot_bytes)
    _NOTHING_LISTED.pack_into(slot, 0, length, limit, length, 0)
    return [slot, HEADER.pack(MAGIC, 1, 0, NO_COMPRESSION, len(name), 0, 0, size, size, 0), name, body]


def plain_rest(slot: Any, rest: Any) -> Optional[Tuple[memoryview, Header]]:
    """``(frame, header)`` where ``slot`` announces nothing but a frame past it, no tensors listed, and ``rest`` is
    that frame, whole and plain (what :func:`medium_slot` writes); else None: the general path reads and judges
    them. A slot's bytes after its prefix and count are not read (the general path does not read them either)."""
    if len(slot) < _NOTHING_LISTED.size:
        return None
    word, _, total, count = _NOTHING_LISTED.unpack_from(slot, 0)
    if word != total or total != len(rest) or count or PREFIX.size + total <= len(slot):
        return None  # flag bits, tensors, a frame of another length, or one that fitted its slot
    return plain_frame(rest)


def plain_frame(frame: Any) -> Optional[Tuple[memoryview, Header]]:
    """``(frame, header)`` of a whole *plain* frame (see :func:`plain_in_slot`), else None."""
    if len(frame) < HEADER.size:
        return None
    fields = HEADER.unpack_from(frame, 0)
    return _read(memoryview(frame), fields[1], fields[4], fields[7]) if _plain(fields, len(frame)) else None


def plain_payload(frame: Any, name: bytes) -> Optional[memoryview]:
    """The payload of ``frame`` where it is a whole *plain* frame (see :func:`plain_in_slot`) of the serializer whose
    ASCII name is ``name``, else None: what :func:`objcomm._format.frame.decode` would hand that serializer, found
    without building a header (a caller that decoded one frame of that serializer decodes the next ones so)."""
    if len(frame) < HEADER.size:
        return None
    fields = HEADER.unpack_from(frame, 0)
    start = HEADER.size + fields[4]
    if not _plain(fields, len(frame)) or frame[HEADER.size : start] != name:
        return None
    return memoryview(frame)[start:]


def plain_in_slot(slot: Any) -> Optional[Tuple[memoryview, Header]]:
    """``(frame, header)`` of a round-1 slot that holds a whole *plain* frame, read in one step: no flag
    bits, nothing out of band or listed, no compression, every length consistent. None for any other slot:
    :func:`objcomm._format.slot.read_slot`, :mod:`objcomm._format.limits` and :func:`objcomm._format.frame.parse_header`
    then read and judge it, with their own errors. Whatever this accepts, they accept too and read the same way."""
    lengths = _plain_lengths(slot)
    if lengths is None:
        return None
    version, name_len, payload_len, word = lengths
    return _read(memoryview(slot)[PREFIX.size : PREFIX.size + word], version, name_len, payload_len)


def _read(frame: memoryview, version: int, name_len: int, payload_len: int) -> Optional[Tuple[memoryview, Header]]:
    """``(frame, header)`` of a plain frame whose numbers were checked, unless its name is not ASCII."""
    try:
        name = str(frame[HEADER.size : HEADER.size + name_len], "ascii")
    except UnicodeDecodeError:
        return None
    return frame, _new(Header, (version, 0, NO_COMPRESSION, name, 0, 0, payload_len, payload_len, 0))


def plain_named(slot: Any, size: int = 0) -> Optional[Tuple[bytes, memoryview]]:
    """``(serializer name as bytes, payload)`` of the plain frame in ``slot`` (as :func:`plain_in_slot` reads it),
    else None: what a caller that holds the serializers it expects needs, without the header. With ``size`` (the
    slot's bytes): also None unless ``slot`` has that size or, shorter, ends where its frame does (trimmed, as
    :func:`objcomm._samehost.channel_checks.trimmed` says: a channel's caller then judges it)."""
    lengths = _plain_lengths(slot, size)
    if lengths is None:
        return None
    start = _SLOT_HEADER.size + lengths[1]
    return bytes(slot[_SLOT_HEADER.size : start]), memoryview(slot)[start : start + lengths[2]]


def _plain_lengths(slot: Any, size: int = 0) -> Optional[Tuple[int, int, int, int]]:
    """``(version, name length, payload length, frame length)`` of the whole plain frame in ``slot``, or None
    (see :func:`plain_in_slot`; ``size``: see :func:`plain_named`)."""
    n = len(slot)
    if n < _SLOT_HEADER.size:
        return None
    room = n - PREFIX.size  # for the frame
    word, _, total, magic, version, flags, compression, name_len, table_len, n_tensors, payload_len, raw_len, inline = (
        _SLOT_HEADER.unpack_from(slot, 0)
    )
    if (  # word == total, within the slot: no flag bits, and the frame and nothing else follows; then _plain's test,
        # spelled out: every small call reads a slot so, and a call and a tuple's slice cost ~0.4 µs of ~20
        word != total
        or word > room
        or (size and n != size and (n > size or word != room))  # not a slot of size, nor one trimmed
        or magic != MAGIC
        or version not in VERSIONS
        or flags
        or compression != NO_COMPRESSION
        or table_len
        or n_tensors
        or inline
        or raw_len != payload_len
        or HEADER.size + name_len + payload_len != word
    ):
        return None
    return version, name_len, payload_len, word


def _plain(header: Tuple[Any, ...], length: int) -> bool:
    """Whether a frame's header fields (:data:`objcomm._format.frame.HEADER`'s) describe a plain frame of ``length``
    bytes: this format, no flag bits, compression, tensor table, tensors or inline bytes, consistent lengths."""
    magic, version, flags, compression, name_len, table_len, n_tensors, payload_len, raw_len, inline_len = header
    return not (
        magic != MAGIC
        or version not in VERSIONS
        or flags
        or compression != NO_COMPRESSION
        or table_len
        or n_tensors
        or inline_len
        or raw_len != payload_len
        or HEADER.size + name_len + payload_len != length
    )
