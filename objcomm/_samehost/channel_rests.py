"""Medium second rounds through the same-host channel: the bytes of an ``all_gather``, ``gather``, ``broadcast``,
``scatter``, ``all_to_all`` or send/recv that overflow their slots, below the shared-memory threshold (and
:data:`MOST`), in messages of the channel.

A frame past its slot (or with tensors) has a second round, which the group's backend moves: on one host,
gloo over loopback TCP, hundreds of microseconds a collective, where the bytes themselves take a few (a
16 KB all_gather: ~0.8 ms, mpi4py ~0.02 ms). Shared memory (:mod:`objcomm._samehost.shm`) pays a file, a mapping
and two control words per call, worth it from ``shm_threshold`` (2 MiB) on. Between the two, when round 1
of the call went through the group's channel (:mod:`objcomm._samehost.channel_slots`), the second round does too: each
sender's bytes (its frame unless the slot carried it, then its tensors, back to back: a segment file's
layout) in messages of at most :data:`CHUNK` bytes, one channel collective per message (a gather's: each
rank's message to the destination alone; an all_to_all's: each pair's), as many as the largest sender needs
(every rank knows each sender's size from round 1, or a scatter's or all_to_all's longest stream from its vote,
so every rank makes the same calls; a sender with fewer bytes sends empty
messages; every :data:`MOST` bytes of broadcasts, gathers and scatters, one ends with an empty all_gather, so
that no root, or gather's sender, runs far ahead of its receivers). Receivers check each message's length against
what the sender's slot announced (a mismatch fails the channel: the ranks are out of step), then read the
bytes as a segment is read: the frame, its tensor table against its sender's slot (:class:`FrameError`, as
on the backend's path, after every message moved, so the group stays in step), the tensors as views of
the received bytes. A broadcast receiver over its ``max_bytes`` (which round 1 told it; no vote comes first when
the slot listed every transfer) receives the messages, drops them and raises alone, as the backend's path does.

:class:`ChannelRest` is the channel as a medium of collectives' rests (:class:`objcomm._transport.rests.RestMedium`):
who sends what to whom, and each operation's result, are :class:`objcomm._transport.rests.PatternRests`'; which
calls it takes (host bytes only: an NCCL group's tensors stay on the GPU),
:class:`objcomm._samehost.rests.SameHostRests`.

send/recv (:func:`send_p2p`, :func:`recv_p2p`, called by :class:`objcomm._samehost.channel_slots.ChannelRoute`) move the
same bytes in the same messages, without a collective: kind ``REST`` under the send's message id, which its slot
carried, so that concurrent sends under one tag (threads, ``isend`` lanes) never take each other's: everything
shared memory does not take (below ``shm_threshold`` all of it; shared memory's own words go under the id too).
Where the receiver need not agree first (every size listed in the slot, none past 1 MiB: see
:func:`objcomm._transport.rounds._agreement_needed`) they follow the slot at once, paced by the channel's credit
(:mod:`objcomm._samehost.inbox`, "Flow control": before it, a sender that ran ahead of a slow receiver filled its stash,
so rests waited for the receiver's answer, a wake-up more per message); a refusing receiver reads and drops them
(``drain``). Otherwise they follow the receiver's answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Iterator, List, Optional, Sequence, Union

from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._format.rest import incoming as incoming  # (re-exported: two levels read their bundles so)
from objcomm._format.rest import pieces as pieces  # (looked up here by the route's send_whole, and by tests)
from objcomm._format.slot import SlotInfo
from objcomm._samehost import channel as _socket
from objcomm._samehost.inbox import ALL_GATHER, ALL_TO_ALL, BROADCAST, GATHER, REST, SCATTER
from objcomm._samehost.mesh import MAX_PAYLOAD
from objcomm._transport import routes
from objcomm._transport.base import WHOLE, Slot, Wire
from objcomm._transport.patterns import Pattern
from objcomm._transport.rests import Due, Mine, Rest

CHUNK = MAX_PAYLOAD  # bytes of one channel message
MOST = routes.CHANNEL_MOST  # the most second-round bytes (largest sender's; a gather's, all senders') it takes


@dataclass(frozen=True)
class ChannelRest:
    """The channel as a medium of the rests of collectives (:class:`objcomm._transport.rests.RestMedium`): the
    rests of ``at``'s senders in messages of :data:`CHUNK` bytes, one channel collective of the operation per message,
    as many as the ``longest`` rest needs."""

    channel: _socket.LocalChannel
    spin: Optional[float]
    drained: ClassVar[str] = f"messages of at most {CHUNK:,} bytes of the same-host channel"

    def exchange(self, wire: Wire, at: Pattern, mine: Mine, due: Due, op: str) -> Dict[int, Incoming]:
        channel, moved, longest = self.channel, due.moved, due.longest
        if at.each:  # a part per receiver: each sender's vote carried the longest
            for r in at.sources:
                if moved[r] > longest:
                    channel.fail(
                        op,
                        f"rank {r}'s slot announces a {moved[r]:,}-byte second round to this rank, but the vote "
                        f"{longest:,} at most: a protocol error",
                    )
        streams: Any = iter(())  # this rank sends nothing (an iterator that ended sends empty messages)
        if isinstance(mine, Rest):
            streams = chunks(pieces(mine.out, mine.frame_inline))
        elif mine is not None:
            streams = [iter(()) if rest is None else chunks(pieces(rest.out, rest.frame_inline)) for rest in mine]
        got = streamed(channel, at, streams, moved, longest, due.keep, self.spin, op)
        if at.op in _PACED:
            all_received(channel, due.paced, self.spin, op)
        return {r: incoming(into, due.infos[r], due.sizes_of, r, op) for r, into in got.items() if into is not None}


_PACED = ("gather", "broadcast", "scatter")  # rooted: a root (or gather's senders) could run ahead of its receivers


# -- send/recv: the rest of a message whose slot the channel carried (objcomm._samehost.channel_slots's route)
# ----------------
def send_p2p(channel: _socket.LocalChannel, wire: Wire, out: Outgoing, info: SlotInfo, dst: int, message: int) -> None:
    """The rest of message ``message`` to group rank ``dst``, once it answered for it: its frame unless the slot
    carried it, then its tensors, in messages of :data:`CHUNK` bytes under ``(tag, REST, message)``."""
    for chunk in chunks(pieces(out, info.inline is not None)):
        channel.send_part(REST, chunk, dst, wire.tag, message)


def recv_p2p(
    channel: _socket.LocalChannel,
    spin: Optional[float],
    wire: Wire,
    info: SlotInfo,
    sizes_of: SizesOf,
    src: int,
    message: int,
    op: str,
    drain: bool = False,
) -> Incoming:
    """The rest of group rank ``src``'s message ``message`` (see :func:`send_p2p`), each message's length checked
    against what its slot ``info`` announced; read as a segment is (:func:`incoming`). ``drain``: a refusing
    receiver's, read and dropped (an empty result)."""
    moved = info.second_round_bytes
    into = bytearray(0 if drain else moved)
    start = time.monotonic()
    for index in range(-(-moved // CHUNK)):
        in_time(channel, start, index, moved, op)
        chunk = channel.recv_part(REST, src, wire.tag, message, spin)
        if drain:
            checked(channel, chunk, index, moved, src, op)
        else:
            place(channel, into, chunk, index, src, op)
    return Incoming(memoryview(b"")) if drain else incoming(into, info, sizes_of, src, op)


def came_with_slot(
    channel: _socket.LocalChannel,
    rest: bytearray,
    info: SlotInfo,
    sizes_of: SizesOf,
    src: int,
    message: int,
    op: str,
    drain: bool = False,
) -> Incoming:
    """The rest of group rank ``src``'s message ``message`` that came in one message with its slot
    (:meth:`objcomm._samehost.channel_slots.ChannelRoute.send_whole`), checked against what the slot announced, as
    :func:`recv_p2p` checks each message of a rest that follows its slot."""
    if len(rest) != info.second_round_bytes:
        channel.fail(
            op,
            f"rank {src} sent {len(rest):,} bytes with the slot of message #{message & ~WHOLE} where its slot "
            f"announced {info.second_round_bytes:,}: a protocol error",
        )
    return Incoming(memoryview(b"")) if drain else incoming(rest, info, sizes_of, src, op)


_KINDS = {
    "all_gather": ALL_GATHER,
    "gather": GATHER,
    "broadcast": BROADCAST,
    "scatter": SCATTER,
    "all_to_all": ALL_TO_ALL,
}


def streamed(
    channel: _socket.LocalChannel,
    at: Pattern,
    mine: Any,
    sizes: Sequence[int],
    longest: int,
    keep: bool,
    spin: Optional[float],
    op: str,
    into: Optional[Dict[int, memoryview]] = None,
    names: Optional[Sequence[int]] = None,
) -> Dict[int, Optional[Union[bytearray, memoryview]]]:
    """This rank's part of ``at`` in the second round through ``channel``: ``mine`` (an iterator of this rank's
    messages, or with ``at.each`` one per rank) in messages of the channel's collective of the operation, as many as
    the ``longest`` stream needs (every rank knows it, from round 1 or its vote; an iterator that ended sends empty
    messages). What each of ``at.sources`` sends is checked against ``sizes[r]``, what its slot announced (a message
    of another length fails the channel: the ranks are out of step), and put together in a buffer of that size, or
    in ``into[r]`` (a view of that size) where given (``None`` for none, or read and dropped where not ``keep``).
    ``names``: the group rank of each of the channel's ranks, as errors name them (two levels: a host's channel)."""
    kind = _KINDS[at.op]
    received: Dict[int, Optional[Union[bytearray, memoryview]]] = {
        r: (bytearray(sizes[r]) if into is None else into[r]) if keep and sizes[r] else None for r in at.sources
    }
    start = time.monotonic()
    for index in range(-(-longest // CHUNK)):
        in_time(channel, start, index, longest, op)
        if not at.to:
            now: Any = None
        elif at.each:
            now = [next(stream, b"") for stream in mine]
        else:
            now = next(mine, b"")
        got = channel.move(kind, at, now, spin, op)
        for r, buffer in received.items():
            sender = r if names is None else names[r]
            if buffer is not None:
                place(channel, buffer, got[r], index, sender, op)
            else:
                checked(channel, got[r], index, sizes[r], sender, op)  # (0 where nothing is due)
    return received


def in_time(channel: _socket.LocalChannel, start: float, index: int, moved: int, op: str) -> None:
    """Before message ``index`` of a stream of ``moved`` bytes begun at ``start``: the channel fails once the group's
    timeout has passed. Each message waits that long at most, so a whole stream ends within twice it, however many
    messages a sender announced and however slowly, each just within it, it sends them (as the backend's pieces:
    :class:`objcomm._transport.bytes.Deadline`)."""
    if index and time.monotonic() - start > channel.timeout:
        channel.fail(
            op,
            f"a second round of {moved:,} bytes was not done after the group's timeout of {channel.timeout:,.0f} s: "
            "a rank sends too slowly for this timeout, or announced more than it sends",
        )


def chunks(pieces: List[memoryview]) -> Iterator[Slot]:
    """``pieces`` back to back, in messages of :data:`CHUNK` bytes (the last one shorter)."""
    pending: List[memoryview] = []
    room = CHUNK
    for piece in pieces:
        while piece.nbytes:
            take = piece[:room]
            pending.append(take)
            piece, room = piece[take.nbytes :], room - take.nbytes
            if not room:
                yield pending[0] if len(pending) == 1 else b"".join(pending)
                pending, room = [], CHUNK
    if pending:
        yield pending[0] if len(pending) == 1 else b"".join(pending)


def all_received(channel: _socket.LocalChannel, moved: int, spin: Optional[float], op: str) -> None:
    """After a broadcast's, gather's or scatter's second round of ``moved`` bytes, on every rank: once the channel's
    broadcasts, gathers and scatters moved :data:`MOST` bytes since the last time, an empty all_gather, so that a sender
    (a root, a gather's non-destination) cannot run further ahead of its receivers (what a receiver's other
    threads read meanwhile waits in its stash: at most twice :data:`MOST`, below the stash's limit). Every rank
    counts the same bytes (from the slots), so all of them take part; in between, a sender goes on while its
    receivers decode, as through the backend."""
    channel.unsynced += moved
    if channel.unsynced < MOST:
        return
    channel.unsynced = 0
    got = channel.all_gather(b"", spin, op)
    if any(got):
        channel.fail(
            op,
            f"a rank sent bytes where the end of a {op}'s second round was due: the ranks are at "
            "different calls, or a protocol error",
        )


def place(
    channel: _socket.LocalChannel, into: Union[bytearray, memoryview], chunk: Slot, index: int, sender: int, op: str
) -> None:
    """Message ``index`` of ``sender``'s second round, checked (:func:`checked`), in its place in ``into``."""
    at = checked(channel, chunk, index, len(into), sender, op)
    into[at : at + len(chunk)] = chunk


def checked(channel: _socket.LocalChannel, chunk: Slot, index: int, total: int, sender: int, op: str) -> int:
    """Where message ``index`` of ``sender``'s ``total`` second-round bytes goes, once its length is the one due
    (else the channel fails: the ranks are out of step)."""
    at = index * CHUNK
    due = max(0, min(CHUNK, total - at))
    if len(chunk) != due:
        channel.fail(
            op,
            f"rank {sender} sent {len(chunk):,} bytes of its second round's message #{index} where "
            f"{due:,} were due (its slot announced {total:,}): the ranks are at different calls, or "
            "a protocol error",
        )
    return at
