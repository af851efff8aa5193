"""A collective's rest (what did not fit its slots), written once for every medium that moves bytes between any two
ranks of a group: who sends what to whom is :func:`objcomm._transport.patterns.pattern`'s, a medium carries it out
with one primitive (:meth:`RestMedium.exchange`: this rank's rests out to the pattern's receivers, one rest in from
each of its sources), and :class:`PatternRests` shapes each operation's result around it.

=============  ===========================  =====================================  ================================
operation      a source's rest, here        this rank's own result                 the size that picks the medium
=============  ===========================  =====================================  ================================
all_gather     every other rank's           a copy of its input (never aliased)    the largest sender's
gather         root: every other rank's     root: its input (decoded own=True)     the largest sender's, and the sum
broadcast      the root's                   root: its input                        the root's
scatter        the root's part for it       root: its own part                     the root's longest part (voted)
all_to_all     each sender's part for it    its own part                           the longest of any pair (voted)
=============  ===========================  =====================================  ================================

A sender whose slot carried all it sends moves nothing; its receivers read its frame from the slot. The media are the
same-host channel (:class:`objcomm._samehost.channel_rests.ChannelRest`) and shared memory
(:class:`objcomm._samehost.shm.SharedMemory`); which one takes a call is decided by a subclass's :meth:`medium`, from
:func:`objcomm._transport.routes.rest_medium`. A collective with no method here goes as an all_to_all (its row in
``patterns``: ``Communicator._pattern_call``); giving it rounds of its own: its method here.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple, Union

from objcomm._format import limits as _limits
from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._format.slot import SlotInfo, outgoing_second_round_bytes
from objcomm._transport.base import NOT_USED, NotUsed, Wire
from objcomm._transport.patterns import Pattern, pattern


class Rest(NamedTuple):
    """One rest this rank sends: the message, and whether its slot carried the frame (then its tensors only)."""

    out: Outgoing
    frame_inline: bool


Mine = Union[None, Rest, Sequence[Optional[Rest]]]  # nothing; the same rest to every receiver; a rest per rank


class Due(NamedTuple):
    """What a rank receives of a collective's rest, the same on every rank: from each rank ``r`` of the pattern's
    sources, ``moved[r]`` bytes (0: its slot carried all of it) read against its slot ``infos[r]``."""

    infos: Sequence[SlotInfo]
    moved: Sequence[int]
    longest: int  # the most any sender moves to any receiver
    paced: int  # what a rooted collective moves in all, for a medium that keeps roots from running ahead of receivers
    keep: bool  # False: read and dropped (a receiver over its max_bytes that no vote stopped)
    own: bool  # this rank's own result may come from the medium (keyed by its rank) where that saves a copy
    sizes_of: SizesOf


class RestMedium(Protocol):
    """A medium's one primitive for the rests of collectives."""

    @property
    def drained(self) -> str:
        """What a receiver over its ``max_bytes`` read and dropped, as its error says."""

    def exchange(self, wire: Wire, at: Pattern, mine: Mine, due: Due, op: str) -> Union[Dict[int, Incoming], NotUsed]:
        """This rank's part of ``at``: ``mine`` to ``at.to`` (with ``at.each``, ``mine[r]`` to rank ``r``; None:
        nothing), and the rest of each source that moves one (``due``), read. :data:`NOT_USED` (the same on every
        rank): the transport moves the rest itself."""


def own(out: Outgoing, copy: bool) -> Incoming:
    """This rank's own result from its input: its tensors copied where ``copy`` (an all_gather's never aliases), else
    as they are (the caller decodes its own with ``own=True``)."""
    return Incoming(out.frame, [t.to("cpu", copy=True) for t in out.tensors] if copy else list(out.tensors))


def _from_slot(info: SlotInfo) -> Incoming:
    return Incoming(info.inline)  # type: ignore[arg-type]  # nothing moved: the frame came inline


class PatternRests:
    """The rests of all_gather, gather, broadcast, scatter and all_to_all over the medium :meth:`medium` picks
    (a :class:`objcomm._transport.base.RestMedia`'s collectives); a subclass says which medium and adds send/recv."""

    def medium(self, wire: Wire, largest: int, gathered: int, op: str) -> Optional[RestMedium]:
        """The medium of a rest whose largest sender moves ``largest`` bytes (``gathered``: a gather's, all of them;
        else 0), or None (the transport moves it): the same answer on every rank."""
        raise NotImplementedError

    def relays(self, wire: Wire, dst: int, op: str) -> Sequence[Tuple[int, Sequence[int]]]:
        """None: on one host each rest goes from its sender to its receivers (:meth:`RestMedia.relays`)."""
        return ()

    def _move(
        self,
        wire: Wire,
        kind: str,
        root: Optional[int],
        mine: Mine,
        infos: Sequence[SlotInfo],
        moved: Sequence[int],
        largest: int,
        sizes_of: SizesOf,
        op: str,
        keep: bool = True,
        copy: bool = False,
        medium: Optional[RestMedium] = None,
    ) -> Union[Tuple[RestMedium, Dict[int, Incoming]], NotUsed]:
        """``kind``'s rest (``root``: its root) over the medium :meth:`medium` picks (or ``medium``, where the caller
        asked), asked first: where none takes it (the backend on NCCL, most of the time on gloo), nothing of W ranks
        is built here."""
        gathered = sum(moved) if kind == "gather" else 0
        medium = self.medium(wire, largest, gathered, op) if medium is None else medium
        if medium is None:
            return NOT_USED
        at = pattern(kind, me=wire.rank, world=wire.size, root=root)
        got = medium.exchange(wire, at, mine, Due(infos, moved, largest, gathered or largest, keep, copy, sizes_of), op)
        return NOT_USED if got is NOT_USED else (medium, got)

    @staticmethod
    def _every(
        got: Dict[int, Incoming], infos: Sequence[SlotInfo], me: int, out: Outgoing, copy: bool
    ) -> List[Incoming]:
        """Every rank's result in group-rank order: its rest where it moved one, else what its slot carried."""
        mine = got.pop(me) if me in got else own(out, copy)
        return [mine if r == me else got[r] if r in got else _from_slot(info) for r, info in enumerate(infos)]

    def all_gather(
        self, wire: Wire, out: Outgoing, infos: Sequence[SlotInfo], sizes_of: SizesOf, op: str
    ) -> Union[Sequence[Optional[Incoming]], NotUsed]:
        me, moved = wire.rank, [info.second_round_bytes for info in infos]
        mine = Rest(out, infos[me].inline is not None) if moved[me] else None
        done = self._move(wire, "all_gather", None, mine, infos, moved, max(moved), sizes_of, op, copy=True)
        return NOT_USED if done is NOT_USED else self._every(done[1], infos, me, out, copy=True)

    def gather(
        self, wire: Wire, out: Outgoing, infos: Optional[Sequence[SlotInfo]], sizes_of: SizesOf, dst: int, op: str
    ) -> Union[Optional[Sequence[Optional[Incoming]]], NotUsed]:
        if infos is None:  # only the destination read round 1 (two levels took it)
            return NOT_USED
        me, moved = wire.rank, [0 if r == dst else info.second_round_bytes for r, info in enumerate(infos)]
        mine = Rest(out, infos[me].inline is not None) if moved[me] else None
        done = self._move(wire, "gather", dst, mine, infos, moved, max(moved), sizes_of, op)
        if done is NOT_USED:
            return NOT_USED
        return self._every(done[1], infos, me, out, copy=False) if me == dst else None

    def broadcast(
        self, wire: Wire, out: Optional[Outgoing], info: SlotInfo, sizes_of: SizesOf, src: int, op: str
    ) -> Union[Incoming, NotUsed]:
        me, moved = wire.rank, info.second_round_bytes
        assert out is not None or me != src
        mine = Rest(out, info.inline is not None) if out is not None and me == src else None
        refuse = me != src and info.total > wire.max_bytes  # above this rank's limit (no vote came first): dropped
        medium = self.medium(wire, moved, 0, op)
        if medium is None:  # (asked before the lists of W below are built)
            return NOT_USED
        infos, sizes = [info] * wire.size, [moved] * wire.size
        done = self._move(wire, "broadcast", src, mine, infos, sizes, moved, sizes_of, op, not refuse, medium=medium)
        if done is NOT_USED:
            return NOT_USED
        got = done[1]
        if out is not None and me == src:
            return own(out, copy=False)  # the caller decodes its own with own=True
        if refuse:
            raise _limits.refused(op, src, wire, info.total, None, drained=True, into=medium.drained)
        return got[src] if src in got else _from_slot(info)

    def scatter(
        self,
        wire: Wire,
        outs: Optional[Sequence[Outgoing]],
        info: SlotInfo,
        sizes_of: SizesOf,
        src: int,
        longest: int,
        op: str,
    ) -> Union[Incoming, NotUsed]:
        """``longest``: the root's longest rest to any rank, which the vote told every rank."""
        me, medium = wire.rank, self.medium(wire, longest, 0, op)
        if medium is None:  # (asked before the lists of W below are built)
            return NOT_USED
        mine = _parts(wire, outs) if outs is not None and me == src else None
        moved = [info.second_round_bytes] * wire.size
        done = self._move(wire, "scatter", src, mine, [info] * wire.size, moved, longest, sizes_of, op, medium=medium)
        if done is NOT_USED:
            return NOT_USED
        if outs is not None and me == src:
            return own(outs[me], copy=False)  # the caller decodes its own with own=True
        return done[1][src] if src in done[1] else _from_slot(info)

    def all_to_all(
        self, wire: Wire, outs: Sequence[Outgoing], infos: Sequence[SlotInfo], sizes_of: SizesOf, longest: int, op: str
    ) -> Union[Sequence[Optional[Incoming]], NotUsed]:
        """``longest``: the longest rest of any pair, which every rank's vote carried."""
        me, moved = wire.rank, [info.second_round_bytes for info in infos]
        done = self._move(wire, "all_to_all", None, _parts(wire, outs), infos, moved, longest, sizes_of, op)
        return NOT_USED if done is NOT_USED else self._every(done[1], infos, me, outs[me], copy=False)


def _parts(wire: Wire, outs: Sequence[Outgoing]) -> List[Optional[Rest]]:
    """The rest of each rank's part (scatter's root, all_to_all): none for this rank's own, nor for a part whose slot
    carries it whole."""
    capacity = wire.inline_capacity
    return [
        Rest(o, o.frame_nbytes <= capacity) if r != wire.rank and outgoing_second_round_bytes(o, capacity) else None
        for r, o in enumerate(outs)
    ]
