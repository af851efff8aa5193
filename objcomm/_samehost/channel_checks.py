"""What a rank checks of what the same-host channel carried before it acts on it: that every slot is whole or
*trimmed* after its frame, and that every rank read the same. A slot that holds a whole frame and nothing after it
travels without the zeros after the frame (:func:`_trim`) and is read as the whole slot on arrival (:func:`trimmed`;
``docs/wire-format.md`` section 7); any other length means the ranks disagree on ``slot_bytes``, and
:func:`_checked` fails the channel, so that every rank raises. What a decision reads is echoed (:func:`echo`: a
16-byte digest from every rank, then every rank's :data:`PASSED`; :func:`agree_on`: all that round 1 said), so that
no rank acts on another view than the others. Used by round 1 on the channel
(:mod:`objcomm._samehost.channel_slots`), its express path (:mod:`objcomm._api.express`) and two levels
(:mod:`objcomm._samehost.two_level`, :mod:`objcomm._samehost.two_level_moves`).
"""

from __future__ import annotations

import hashlib
import struct
from typing import List, Optional, Sequence, Tuple

from objcomm._errors import CommunicationError
from objcomm._format.message import SLOT_PREFIX_BYTES
from objcomm._format.slot import SlotInfo
from objcomm._samehost import channel as _channel
from objcomm._transport import routes
from objcomm._transport.base import Slot, Wire


def echo(channel: _channel.LocalChannel, seen: bytes, spin: Optional[float], op: str, what: str) -> None:
    """Check that every rank saw ``seen`` (one channel hop: a 16-byte digest each); else fail the channel, so that
    every rank raises rather than act on different views. A digest, not the bytes: cheap at any size, and 128 bits,
    beyond a lying rank's reach for two messages with one digest.

    Then a second hop, :data:`PASSED` from every rank: a rank acts only once every other one found the digests
    alike. A lying rank can send its digest right to one rank and wrong to another; the one that finds it wrong
    fails the channel instead of passing, and every rank waiting for its pass reads that at once, rather than go on
    alone into the group's backend (where the others would not join it, and a reopen would meet it)."""
    digest = hashlib.blake2b(seen, digest_size=16).digest()
    for r, theirs in enumerate(channel.echo(digest, spin, op)):
        if theirs != digest:
            channel.fail(
                op,
                f"rank {r} read other {what} than rank {channel.rank} did in this {op}: a rank told "
                "different ranks different things, or the ranks are at different calls",
            )
    for r, theirs in enumerate(channel.echo(PASSED, spin, op)):
        if theirs != PASSED:
            channel.fail(
                op, f"rank {r} sent {len(theirs)} bytes where its pass of the {what} check was due: a protocol error"
            )


_READ = struct.Struct("<Q???QQq")  # what a rank read of one slot: length, error, round2, inline, limit, total, listed


def agree_on(
    channel: _channel.LocalChannel, spin: Optional[float], infos: Sequence[SlotInfo], op: str, medium: str = ""
) -> None:
    """:func:`echo` of everything round 1 said that a decision reads: the words, and a frame the slot carried (its
    tensor table decides refusals and the second round's route); and ``medium``, the one this rank's settings send
    the rest by (:func:`medium_of`): ranks whose shared memory
    settings differ where it matters would wait on different media (a gloo abort, or the group's timeout)."""
    digest = hashlib.blake2b(medium.encode(), digest_size=16)  # one digest of every slot's words and frame, fed
    for i in infos:  # in turn (a digest and a repr of each, before: 20 ms a call at 8192 ranks)
        listed = -1 if i.sizes is None else len(i.sizes)
        digest.update(_READ.pack(i.length, i.error, i.round2, i.inline is not None, i.limit, i.total, listed))
        if i.sizes:
            digest.update(struct.pack(f"<{len(i.sizes)}Q", *i.sizes))
        if i.inline is not None:
            digest.update(i.inline)
    seen = digest.digest()
    echo(
        channel,
        seen,
        spin,
        op,
        "round-1 slots, or its shared memory settings (shm, shm_threshold) move the rest otherwise,",
    )


def medium_of(infos: Sequence[SlotInfo], op: str, shm: bool, threshold: int, cpu: bool) -> str:
    """The medium a rank with these shared memory settings moves the rest after round 1 (``infos``) by: what
    :func:`agree_on` echoes, so that ranks whose settings differ where it matters raise, not diverge."""
    rests = [i.second_round_bytes for i in infos if not i.error]
    gathered = sum(rests) if op == "gather" else 0
    return routes.rest_after_channel(
        max(rests, default=0), cpu=cpu, shm=shm, shm_threshold=threshold, gathered=gathered
    )


def settings_word(shm: bool, threshold: int) -> int:
    """A rank's shared memory settings in one vote word (:func:`largest_alike`): ``shm_threshold``, or where ``shm`` is
    off ``-1 - shm_threshold`` (the threshold still bounds the channel's rests)."""
    return threshold if shm else -1 - threshold


def largest_alike(rows: Sequence[Sequence[int]], moved_at: Optional[int], cpu: bool, op: str) -> List[int]:
    """The element-wise maximum of every rank's words (``rows``, read alike by every rank). Where ``moved_at`` says
    which is the size of the rest that follows, each row ends with its rank's :func:`settings_word`, dropped from the
    answer: where the ranks' settings move that rest by different media, every rank raises here, alike, before any
    of it moves (one would wait for shared memory, or the channel, where another sends through the backend)."""
    largest = [max(column) for column in zip(*rows)]
    if moved_at is None:
        return largest
    moved, theirs = largest[moved_at], [(row[-1] >= 0, max(row[-1], -1 - row[-1])) for row in rows]
    if len({routes.rest_after_channel(moved, cpu=cpu, shm=shm, shm_threshold=t) for shm, t in theirs}) > 1:
        shown = ", ".join(
            f"rank {r}: shm {'on' if shm else 'off'}, shm_threshold {threshold:,}"
            for r, (shm, threshold) in enumerate(theirs)
        )
        raise CommunicationError(
            f"{op}: the ranks' shared memory settings differ ({shown}) and would move this call's {moved:,}-byte "
            "rest by different media; every rank of a group must use the same shm and shm_threshold. Nothing more "
            "of this call moved, on any rank"
        )
    return largest[:-1]


PASSED = b"\x01"  # what every rank echoes once it found every rank's digest alike (echo)


def trimmed(slot: Slot, size: int) -> bool:
    """Whether ``slot``, a message of the channel, is a slot of ``size`` bytes trimmed after its frame: shorter,
    and exactly a prefix without flag bits and the frame it announces. Such a slot holds nothing after its
    frame but zeros, which nobody reads: they stay behind (:func:`_trim`;
    :func:`objcomm._format.plain_slot.small_slot`).
    """
    n = len(slot)
    return SLOT_PREFIX_BYTES <= n < size and _FRAME_LENGTH.unpack_from(slot)[0] == n - SLOT_PREFIX_BYTES


def _trim(slot: Slot) -> Slot:
    """``slot`` without the zeros after its frame, where it holds a whole frame and nothing else (no flag bits:
    not an error report, no sizes listed after the frame, no second round); else ``slot`` itself."""
    end = SLOT_PREFIX_BYTES + _FRAME_LENGTH.unpack_from(slot)[0]  # flag bits make it far too large
    return memoryview(slot)[:end] if end < len(slot) else slot


_FRAME_LENGTH = struct.Struct("<Q")  # a slot's first word: its frame's length, and flag bits above it


_WHOLE_SLOT = struct.Struct("<I")  # a WHOLE message's first word: its sender's slot_bytes


def whole_size(slot: Slot, rest_bytes: int) -> int:
    """The bytes of a :func:`whole_message` of ``slot`` and a rest of ``rest_bytes``."""
    return _WHOLE_SLOT.size + len(slot) + rest_bytes


def whole_message(slot: Slot, rest: Sequence[Slot]) -> bytes:
    """One channel message of ``slot`` (untrimmed) and the ``rest`` that follows it (a message id with
    :data:`objcomm._transport.base.WHOLE` set): the sender's ``slot_bytes`` first, so that a receiver of another
    ``slot_bytes`` says so rather than cut it elsewhere."""
    return b"".join([_WHOLE_SLOT.pack(len(slot)), slot, *rest])


def cut_whole(
    channel: _channel.LocalChannel, got: bytes, size: int, sender: int, op: str, cpu: bool = True
) -> Tuple[bytes, bytearray]:
    """``(slot, rest)`` of a message :func:`whole_message` made, for a receiver of ``slot_bytes=size``; the rest
    writable, as every path hands a rest to the decoder. The channel fails where the sender's slot was of another
    size, where nothing follows it (such a slot travels alone), or on a group whose rests go through the backend
    (``cpu`` False: an NCCL group's; no honest sender sends one there)."""
    if not cpu:
        channel.fail(
            op,
            f"rank {sender} sent a slot with its rest in one message on a GPU group, whose rests go through the "
            "group: a protocol error",
        )
    head = _WHOLE_SLOT.size
    theirs = _WHOLE_SLOT.unpack_from(got)[0] if len(got) >= head else -1
    if theirs != size:
        channel.fail(
            op,
            f"rank {sender} sent a slot with its rest whose slot is {theirs:,} bytes where this rank uses "
            f"slot_bytes={size:,}; every rank of a group must use the same slot_bytes",
        )
    if len(got) <= head + size:
        channel.fail(op, f"rank {sender} sent a slot marked as followed by its rest, without one: a protocol error")
    return got[head : head + size], bytearray(memoryview(got)[head + size :])


def _checked(
    wire: Wire, channel: _channel.LocalChannel, slots: Sequence[Slot], op: str, mine: Optional[Slot] = None
) -> List[Slot]:
    """``slots``, each ``wire.slot`` bytes long or :func:`trimmed` (which :func:`objcomm._format.slot.read_slot`
    reads as the whole slot: a prefix without flag bits and its frame), ``mine``, when given, in this rank's
    place; else ranks disagree on ``slot_bytes`` (the backend would fail too): the channel fails, so that the
    others raise as well."""
    whole = list(slots)
    if mine is not None:
        whole[wire.rank] = mine
    for slot in whole:
        if len(slot) != wire.slot and not trimmed(slot, wire.slot):
            channel.fail(
                op,
                f"rank {wire.rank} received a {len(slot):,}-byte slot but uses "
                f"slot_bytes={wire.slot:,}; every rank of a group must use the same slot_bytes",
            )
    return whole
