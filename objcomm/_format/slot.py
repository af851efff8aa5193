"""The round-1 slot: a fixed-size record per rank that says what its sender sends.

A leaf module (it imports only :mod:`objcomm._format.message`, and numpy); the byte layout is on one page,
``docs/wire-format.md`` section 5. A slot starts with a 24-byte :data:`PREFIX`: the frame length
(with flag bits on top), the sender's ``max_bytes`` and the total bytes the sender moves (frame plus
out-of-band tensors). The frame follows when it fits (*inline*), then, where they fit, the tensor
sizes as a :data:`COUNT` and that many u64s, so that round 1 tells every receiver every transfer
that follows. :mod:`objcomm._format.limits` checks the numbers; nobody trusts one alone.
"""

from __future__ import annotations

import functools
import struct
from typing import List, NamedTuple, Optional

import numpy

from objcomm._format.message import SLOT_PREFIX_BYTES, Outgoing

PREFIX = struct.Struct("<QQQ")  # word (length | flags), sender's max_bytes, sender's total
assert PREFIX.size == SLOT_PREFIX_BYTES
COUNT = struct.Struct("<I")
SIZES_UNLISTED = 0xFFFFFFFF
ERROR_BIT = 1 << 63  # the frame is an error report
ROUND2_BIT = 1 << 62  # scatter: some rank's part needs a second round
LISTED_BIT = 1 << 61  # tensor sizes follow the inline frame
PIECE_SHIFT = 56  # bits 56-60: log2 of the sender's piece size (chunk_bytes), XOR DEFAULT_PIECE_LOG2
PIECE_MASK = 0x1F
DEFAULT_PIECE_LOG2 = 28  # 256 MiB, the default chunk_bytes: its bits are zero
DEFAULT_PIECE = 1 << DEFAULT_PIECE_LOG2
LENGTH_MASK = (1 << PIECE_SHIFT) - 1
_new = tuple.__new__


class SlotInfo(NamedTuple):
    """What one slot says (nothing checked yet: see :mod:`objcomm._format.limits`)."""

    length: int
    error: bool
    round2: bool
    limit: int
    total: int
    inline: Optional[memoryview]
    sizes: Optional[List[int]] = None  # tensor sizes listed in the slot (None: only the frame tells)
    piece: int = DEFAULT_PIECE  # the sender's piece size: what its rest moves in through the backend

    @property
    def second_round_bytes(self) -> int:
        """Bytes this sender moves after round 1."""
        return second_round_bytes(self.length, self.total, self.inline is not None)


def second_round_bytes(length: int, total: int, inline: bool) -> int:
    """What a sender moves after round 1: its frame unless the slot carried it, and its tensors."""
    return total - (length if inline else 0)


def outgoing_second_round_bytes(out: Outgoing, capacity: int) -> int:
    """:func:`second_round_bytes` of what this rank sends, with slots of ``capacity`` bytes after the prefix."""
    return second_round_bytes(out.frame_nbytes, out.total, out.frame_nbytes <= capacity)


def piece_size(chunk_bytes: int) -> int:
    """The pieces a rank with ``chunk_bytes`` cuts its transfers into: the largest power of two not above it, at
    most 2 GiB (what a slot can announce)."""
    return 1 << min(chunk_bytes.bit_length() - 1, 31)


def piece_bits(piece: int) -> int:
    """The word's bits that announce ``piece`` (a :func:`piece_size`): zero for the default."""
    return ((piece.bit_length() - 1) ^ DEFAULT_PIECE_LOG2) << PIECE_SHIFT


def fill_slot(slot: memoryview, out: Outgoing, limit: int, round2: bool = False, piece: int = DEFAULT_PIECE) -> None:
    """Write the slot describing ``out`` (``limit``: the sender's ``max_bytes``; ``piece``: its
    :func:`piece_size`) into ``slot``, zeroed."""
    length = out.frame_nbytes
    sizes = [t.numel() for t in out.tensors] if out.tensors else []
    inline = length <= slot.nbytes - PREFIX.size
    at = PREFIX.size + (length if inline else 0)  # list the tensor sizes here, so a receiver knows every transfer
    listed = bool(sizes or not inline) and at + COUNT.size + 8 * len(sizes) <= slot.nbytes
    if length > LENGTH_MASK:
        raise ValueError(f"a frame of {length:,} bytes: a slot announces at most {LENGTH_MASK:,}")
    word = length | (ERROR_BIT if out.error else 0) | (ROUND2_BIT if round2 else 0) | piece_bits(piece)
    PREFIX.pack_into(slot, 0, word | (LISTED_BIT if inline and listed else 0), limit, out.total)
    if inline:
        out.copy_frame_into(slot[PREFIX.size : at])
    if listed:
        COUNT.pack_into(slot, at, len(sizes))
        struct.pack_into(f"<{len(sizes)}Q", slot, at + COUNT.size, *sizes)
    elif not inline:
        COUNT.pack_into(slot, at, SIZES_UNLISTED)


def read_slot(view: memoryview) -> SlotInfo:
    """What the slot in ``view`` says; sizes that do not fit the slot read as unlisted."""
    return _slot_info(view, *PREFIX.unpack_from(view, 0))


def _slot_info(view: memoryview, word: int, limit: int, total: int) -> SlotInfo:
    """:func:`read_slot` of the slot in ``view`` whose prefix says ``word``, ``limit`` and ``total``."""
    length = word & LENGTH_MASK
    inline = view[PREFIX.size : PREFIX.size + length] if length <= view.nbytes - PREFIX.size else None
    at = PREFIX.size + (length if inline is not None else 0)
    sizes = None
    if (inline is None or word & LISTED_BIT) and at + COUNT.size <= view.nbytes:
        count = COUNT.unpack_from(view, at)[0]
        if count != SIZES_UNLISTED and at + COUNT.size + 8 * count <= view.nbytes:
            sizes = list(struct.unpack_from(f"<{count}Q", view, at + COUNT.size))
    # tuple.__new__: SlotInfo's own __new__ is a Python function, one more call per slot read
    piece = 1 << (((word >> PIECE_SHIFT) & PIECE_MASK) ^ DEFAULT_PIECE_LOG2)
    info = (length, bool(word & ERROR_BIT), bool(word & ROUND2_BIT), limit, total, inline, sizes, piece)
    return _new(SlotInfo, info)


def read_slots(host: memoryview, count: int, slot: int) -> List[SlotInfo]:
    """The ``count`` slots of ``slot`` bytes each laid end to end in ``host``, each read as :func:`read_slot` reads
    it; from :data:`PREFIXES_AT_ONCE` slots their prefixes are unpacked at once (numpy)."""
    if count < PREFIXES_AT_ONCE:
        return [read_slot(host[r * slot : (r + 1) * slot]) for r in range(count)]
    rows = numpy.frombuffer(host, _prefixes(slot), count)
    prefixes = zip(range(0, count * slot, slot), rows["word"].tolist(), rows["limit"].tolist(), rows["total"].tolist())
    return [_slot_info(host[at : at + slot], word, limit, total) for at, word, limit, total in prefixes]


PREFIXES_AT_ONCE = 32  # slots: below this, one read_slot each costs less than numpy's set-up


@functools.lru_cache(maxsize=64)  # (learnt slots take a few widths)
def _prefixes(slot: int) -> numpy.dtype:
    """A slot of ``slot`` bytes as numpy sees its prefix: the word, the sender's limit, its total."""
    return numpy.dtype(
        {"names": ["word", "limit", "total"], "formats": ["<u8"] * 3, "offsets": [0, 8, 16], "itemsize": slot}
    )
