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
from typing import Any, Optional, Tuple

from objcomm._format.frame import HEADER, MAGIC, NO_COMPRESSION, VERSIONS, Header, _new
from objcomm._format.slot import PREFIX

_SLOT_HEADER = struct.Struct(PREFIX.format + HEADER.format[1:])  # a round-1 slot's prefix, then a frame's header


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


def plain_in_slot(slot: Any) -> Optional[Tuple[memoryview, Header]]:
    """``(frame, header)`` of a round-1 slot that holds a whole *plain* frame, read in one step: no flag
    bits, nothing out of band or listed, no compression, every length consistent. None for any other slot:
    :func:`objcomm._format.slot.read_slot`, :mod:`objcomm._format.limits` and :func:`objcomm._format.frame.parse_header`
    then read and judge it, with their own errors. Whatever this accepts, they accept too and read the same way."""
    lengths = _plain_lengths(slot)
    if lengths is None:
        return None
    version, name_len, payload_len, word = lengths
    try:
        name = str(slot[_SLOT_HEADER.size : _SLOT_HEADER.size + name_len], "ascii")
    except UnicodeDecodeError:
        return None
    frame = memoryview(slot)[PREFIX.size : PREFIX.size + word]
    return frame, _new(Header, (version, 0, NO_COMPRESSION, name, 0, 0, payload_len, payload_len, 0))


def plain_named(slot: Any) -> Optional[Tuple[bytes, memoryview]]:
    """``(serializer name as bytes, payload)`` of the plain frame in ``slot`` (as :func:`plain_in_slot` reads it),
    else None: what a caller that holds the serializers it expects needs, without the header."""
    lengths = _plain_lengths(slot)
    if lengths is None:
        return None
    start = _SLOT_HEADER.size + lengths[1]
    return bytes(slot[_SLOT_HEADER.size : start]), memoryview(slot)[start : start + lengths[2]]


def _plain_lengths(slot: Any) -> Optional[Tuple[int, int, int, int]]:
    """``(version, name length, payload length, frame length)`` of the whole plain frame in ``slot``, or None
    (see :func:`plain_in_slot`)."""
    if len(slot) < _SLOT_HEADER.size:
        return None
    (
        word,
        _,
        total,
        magic,
        version,
        flags,
        compression,
        name_len,
        table_len,
        n_tensors,
        payload_len,
        raw_len,
        inline_len,
    ) = _SLOT_HEADER.unpack_from(slot, 0)
    if (
        word != total
        or word > len(slot) - PREFIX.size
        or magic != MAGIC
        or version not in VERSIONS
        or flags
        or compression != NO_COMPRESSION
        or table_len
        or n_tensors
        or inline_len
        or raw_len != payload_len
        or HEADER.size + name_len + payload_len != word
    ):
        return None  # word == total, within the slot: no flag bits, and the frame and nothing else follows
    return version, name_len, payload_len, word
