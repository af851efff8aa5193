"""What every medium shares: the :class:`Wire` a call moves over, and the protocols a medium implements.

Media are named by what they carry: :class:`SlotMedium` the fixed-size slots, a call's votes and control words,
and the route of each send/recv (:data:`BACKEND`: the group itself; else the same-host channel, or two levels);
:class:`RestMedia` what did not fit a slot (:data:`DIRECT`: none, the transport moves it through the group; else
the same-host channel and shared memory, or two levels); a :class:`Route` one send/recv. The transport calls
these; the same-host media (:mod:`objcomm._samehost`, a floor above) implement them.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from objcomm._device import is_cpu
from objcomm._errors import NOT_SENT, NOT_THERE, CommunicationError, ranks_note
from objcomm._format.message import SLOT_PREFIX_BYTES, Incoming, Outgoing, SizesOf
from objcomm._format.slot import SlotInfo
from objcomm._transport.let_go import held_by, wait_let_go
from objcomm._transport.patterns import Pattern

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# The tag of objcomm's own point-to-point messages (a reduction's tree, a collective's rest), above every tag a caller
# may pass (objcomm._api.call.MAX_TAG): they never meet a caller's, which may be in flight (eager sends).
INTERNAL_TAG = (1 << 30) - 1


# -- the media of a call's rest ----------------------------------------------------------------
class NotUsed(enum.Enum):
    """A medium's answer (:class:`RestMedia`, :class:`SlotMedium`) when the transport must move the bytes itself."""

    NOT_USED = "not used"


NOT_USED = NotUsed.NOT_USED


class RestMedia(Protocol):
    """The media that may carry a call's rest (what did not fit a slot) instead of the group, asked after round 1.

    The transport calls the method of its operation once, on every rank the operation involves, after
    round 1 and any vote; the media return what the transport would have returned, or
    :data:`NOT_USED` (the same answer on every rank), and the transport moves the bytes itself.
    Shared memory on one host (:class:`objcomm._samehost.shm.SharedMemory`) is one; :data:`DIRECT` is none.
    """

    def worth(self, wire: Wire, moved: int, op: str, peer: Optional[int] = None) -> bool:
        """Whether these media may take ``moved`` second-round bytes (decided from the slot alone,
        so that receivers answer the sender before round 2 when it may); ``peer``: a send/recv's other group rank."""

    def relays(self, wire: Wire, dst: int, op: str) -> Sequence[Tuple[int, Sequence[int]]]:
        """The ranks other than ``dst`` that hold senders' rests on their way to ``dst`` in a gather, each with the
        senders whose rests it holds (a two-level gather's leaders); none where every rest goes straight to ``dst``.
        The same answer on every rank: a gather checks each sender's total against these ranks' ``max_bytes`` too
        (:func:`objcomm._format.limits.check_relays`), as against ``dst``'s."""

    def all_gather(
        self, wire: Wire, out: Outgoing, infos: Sequence[SlotInfo], sizes_of: SizesOf, op: str
    ) -> Union[Sequence[Optional[Incoming]], NotUsed]: ...

    def gather(
        self, wire: Wire, out: Outgoing, infos: Optional[Sequence[SlotInfo]], sizes_of: SizesOf, dst: int, op: str
    ) -> Union[Optional[Sequence[Optional[Incoming]]], NotUsed]:
        """``infos`` None: on a rank other than ``dst`` after ``dst`` read round 1 and said go (only ``dst`` holds every
        slot); the media take that only where round 1 went its way (two levels), else :data:`NOT_USED`."""

    def broadcast(
        self, wire: Wire, out: Optional[Outgoing], info: SlotInfo, sizes_of: SizesOf, src: int, op: str
    ) -> Union[Incoming, NotUsed]: ...

    def scatter(
        self,
        wire: Wire,
        outs: Optional[Sequence[Outgoing]],
        info: SlotInfo,
        sizes_of: SizesOf,
        src: int,
        longest: int,
        op: str,
    ) -> Union[Incoming, NotUsed]: ...

    def all_to_all(
        self, wire: Wire, outs: Sequence[Outgoing], infos: Sequence[SlotInfo], sizes_of: SizesOf, longest: int, op: str
    ) -> Union[Sequence[Optional[Incoming]], NotUsed]:
        """``longest``: the most bytes any rank moves to any other after round 1 (the same on every rank)."""

    def send(
        self, wire: Wire, out: Outgoing, dst: int, op: str, route: Optional[Route] = None, message: int = 0
    ) -> bool:
        """True when the second round went this way (the receiver answered it took it). ``route``: where the slot
        of message ``message`` went (else the group): the media's own words travel there too."""

    def recv(
        self,
        wire: Wire,
        info: SlotInfo,
        sizes_of: SizesOf,
        src: int,
        op: str,
        route: Optional[Route] = None,
        message: int = 0,
    ) -> Union[Incoming, NotUsed]: ...


class _Direct:
    """No rest medium: the transport moves every rest through the group itself."""

    def worth(self, wire: Wire, moved: int, op: str, peer: Optional[int] = None) -> bool:
        return False

    def relays(self, wire: Wire, dst: int, op: str) -> Sequence[Tuple[int, Sequence[int]]]:
        return ()

    def all_gather(self, *args: Any) -> NotUsed:
        return NOT_USED

    gather = broadcast = scatter = all_to_all = recv = all_gather

    def send(self, *args: Any) -> bool:
        return False

    def __repr__(self) -> str:
        return "DIRECT"


DIRECT: RestMedia = _Direct()


# -- the medium of a call's slots --------------------------------------------------------------
Slot = Union[bytes, bytearray, memoryview]  # one rank's round-1 slot (``Wire.slot`` bytes), host memory
Mine = Union[None, Slot, Sequence[Slot]]  # what a rank sends in round 1: nothing, its slot, or one slot per rank


class SlotMedium(Protocol):
    """The medium that carries a call's round-1 slots (and its votes, words and send/recv routes), asked by the
    transport before it uses the group.

    Round 1 of every collective is one primitive, :meth:`exchange`, over its pattern (who sends what to whom,
    :mod:`objcomm._transport.patterns`): this rank's slot bytes (host memory, ``wire.slot`` long) out, what the
    group's collective would have delivered from each source in, as host bytes, or :data:`NOT_USED` (the same answer
    on every rank of the call, decided without talking to the others) and the transport moves the slots itself;
    :meth:`p2p` routes the slot of a send/recv. Every rank of the group calls the method of its operation, in the same
    order. The same-host channel (:class:`objcomm._samehost.channel_slots.ChannelSlots`) is one; :data:`BACKEND` none.
    """

    def exchange(self, wire: Wire, at: Pattern, mine: Mine, op: str) -> Union[Dict[int, Slot], NotUsed]:
        """Round 1 of the collective whose pattern on this rank is ``at`` (all_gather, broadcast, scatter or
        all_to_all: :func:`objcomm._transport.patterns.pattern`): this rank's slot (``mine``; one per rank where
        ``at.each``; None where it sends none) to the ranks of ``at.to``, and the slot of each rank of ``at.sources``,
        by group rank. ``op``: the user's call (a gather's round 1 on one host is an all_gather's pattern)."""

    def gather(self, wire: Wire, slot: Slot, dst: int, op: str) -> Union[Optional[List[Slot]], NotUsed]:
        """Every rank's slot on group rank ``dst`` (None elsewhere): round 1 of a gather, which :meth:`share` ends."""

    def share(self, wire: Wire, data: Optional[Slot], length: int, src: int, op: str) -> Union[Slot, NotUsed]:
        """Group rank ``src``'s ``length`` bytes (``data`` there) on every rank, where :meth:`gather` moved round 1: a
        gather's word from its destination, and every slot after a failure."""

    def gather_words(self, wire: Wire, words: Sequence[int], op: str) -> Union[List[List[int]], NotUsed]:
        """Every rank's ``words`` (int64s, as many on every rank), in group-rank order: the small control
        collectives of a call's later rounds (the receivers' votes, :func:`largest_of`; the shared-memory
        announcement, :mod:`objcomm._samehost.shm`)."""

    def largest(
        self, wire: Wire, values: Sequence[int], op: str, moved_at: Optional[int] = None
    ) -> Union[List[int], NotUsed]:
        """The element-wise maximum of every rank's ``values`` (:func:`largest_of`: a call's votes); ``moved_at``:
        where among them the size of the rest that follows lies (the same-host channel checks that every rank's
        settings send it the same way)."""

    def agree(self, wire: Wire, infos: Sequence[Any], op: str) -> None:
        """Before a call acts on round 1 beyond "it ended" (a second round, a refusal, a vote), check that every rank
        read the same slots (``infos``, this rank's reading of them) where they came one message per peer (the
        same-host channel: a lying rank could tell each rank something different, and honest ranks would then take
        different routes); on a difference every rank raises :class:`~objcomm.CommunicationError`. Through the
        group, every rank saw the same: nothing to do."""

    def p2p(self, wire: Wire, op: str, peer: Optional[int]) -> Lease:
        """The route of one send (``op`` "send", to group rank ``peer``) or recv (from ``peer``, None: any), held for
        the whole call (round 2 included): entering it gives a :class:`Route`, or None when the group moves the slot.
        Sender and receiver get the same."""

    def tree_levels(self, wire: Wire, op: str) -> Optional[TreeLevels]:
        """A reduction's tree on two levels (:func:`objcomm._transport.routes.tree_on_two_levels`): the wire whose
        send/recv take this rank's host's channel, and where each host's ranks lie; None where the tree runs over
        the group. The same answer on every rank (the levels are set up by an earlier collective of the group); every
        rank of the call asks (a host's channel that failed reopens here, a collective of the host's ranks)."""

    def checks_slots(self, wire: Wire) -> bool:
        """Whether round 1 goes where a slot of another size fails the call on every rank by itself (an open same-host
        channel); else a group that first takes a slot votes on it (``rounds.agree_on_round_one``). Alike on all."""

    def channel_of(self, wire: Wire, op: str) -> Optional[Tuple[Any, Optional[float]]]:
        """The same-host channel (:class:`objcomm._samehost.channel.LocalChannel`) that carried this call's round 1, and
        the spin of its waits; None when round 1 went through the group (the same answer on every rank). Raises
        :class:`~objcomm.CommunicationError` when that channel has closed since (another thread's call failed it):
        the others, which go on through it, then raise too, instead of this rank moving on through the group."""


WHOLE = 1 << 31  # the bit of a message id (a route's) that says its rest came with its slot (Route.send_whole)
ASKS = 1 << 30  # and the bit that says its sender waits for the receiver's answer before the rest (Route.send)


class Route(Protocol):
    """Where a send/recv goes instead of the group (see :meth:`SlotMedium.p2p`): its slot, then, when a second
    round follows, the receiver's answer (one byte: a ``REFUSE_*`` code of :mod:`objcomm._transport.rounds`, 0 to go
    ahead), and on CPU wires the rest wherever the rest media (shared memory) does not take it."""

    def send_whole(self, wire: Wire, slot: Slot, out: Outgoing, info: SlotInfo, dst: int) -> bool:
        """Send ``slot`` and the rest that follows it at once (no answer) as one message, where they fit in one;
        whether it did. Its receiver's :meth:`recv` gives a message id with :data:`WHOLE` set, and its
        :meth:`recv_rest` the rest that came with the slot."""

    def send(self, wire: Wire, slot: Slot, dst: int, asks: bool = False) -> int:
        """Send ``slot`` to group rank ``dst`` under ``wire.tag``; the message's id (for its answer and rest), with
        :data:`ASKS` set where ``asks``: the sender waits for an answer."""

    def recv(self, wire: Wire, src: Optional[int], op: str) -> Tuple[int, Slot, int]:
        """``(sender, slot, message id)``: the next slot under ``wire.tag`` from group rank ``src`` (``None``: any)."""

    def answer(self, wire: Wire, dst: int, message: int, code: int) -> None:
        """Answer message ``message`` of group rank ``dst`` (the receiver, after its slot)."""

    def answer_of(self, wire: Wire, src: int, message: int, op: str) -> int:
        """The answer of group rank ``src`` to this rank's message ``message`` (the sender waits for it); a second
        call, the next answer to it (the rest media's own, after the first)."""

    def send_words(self, wire: Wire, words: Sequence[int], dst: int, message: int) -> None:
        """int64 words of message ``message`` to group rank ``dst`` (the rest media's own, before its rest)."""

    def recv_words(self, wire: Wire, count: int, src: int, message: int, op: str) -> List[int]:
        """``count`` int64 words of group rank ``src``'s message ``message`` (see :meth:`send_words`)."""

    def send_rest(self, wire: Wire, out: Outgoing, info: SlotInfo, dst: int, message: int) -> None:
        """Send what follows the slot of message ``message`` to group rank ``dst``."""

    def recv_rest(
        self, wire: Wire, info: SlotInfo, sizes_of: SizesOf, src: int, message: int, op: str, drain: bool = False
    ) -> Incoming:
        """What follows the slot ``info`` of group rank ``src``'s message ``message`` (``drain``: read and dropped, by a
        receiver that refuses it)."""


class Lease(Protocol):
    """A send/recv's route while it runs (:meth:`SlotMedium.p2p`): entered, a :class:`Route` or None (the group);
    through the group, the transport tells it each slot it posted (:meth:`posted`) or took (:meth:`took`)."""

    def __enter__(self) -> Optional[Route]: ...

    def __exit__(self, *exc: Any) -> Optional[bool]: ...

    def posted(self) -> None:
        """The send's slot is posted through the group."""

    def took(self, sender: int) -> None:
        """The recv took group rank ``sender``'s slot through the group."""


class _ThroughGroup:
    """The group's route, with nothing to count."""

    def __exit__(self, *exc: Any) -> None:
        return None

    __enter__ = posted = took = __exit__


THROUGH_GROUP = _ThroughGroup()


class _Backend:
    """The group's backend as the slot medium: the transport moves every round-1 slot through the group."""

    def exchange(self, *args: Any) -> NotUsed:
        return NOT_USED

    gather_words = largest = gather = share = exchange

    def agree(self, wire: Wire, infos: Sequence[Any], op: str) -> None:
        pass

    def p2p(self, wire: Wire, op: str, peer: Optional[int]) -> Lease:
        return THROUGH_GROUP

    def tree_levels(self, wire: Wire, op: str) -> None:
        return None

    def channel_of(self, wire: Wire, op: str) -> None:
        return None

    def checks_slots(self, wire: Wire) -> bool:
        return False

    def __repr__(self) -> str:
        return "BACKEND"


BACKEND: SlotMedium = _Backend()


class Wire(NamedTuple):
    """Where and how frames move: the group, this rank's place in it, and the size limits."""

    group: Any
    ranks: Sequence[int]  # global rank of each group rank
    rank: int  # this process's rank in the group
    device: torch.device
    slot: int  # bytes per rank in round 1, prefix included
    chunk: int  # largest single transfer in round 2
    max_bytes: int  # largest payload (frame plus tensors) this rank accepts
    rest_media: RestMedia = DIRECT  # the media that may carry a rest instead of the group
    slot_medium: SlotMedium = BACKEND  # the medium of the round-1 slots, votes and send/recv (BACKEND: the group)
    tag: int = 0  # send/recv: the caller's tag (see data_tag, answer_tag)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def inline_capacity(self) -> int:
        return self.slot - SLOT_PREFIX_BYTES

    @property
    def data_tag(self) -> int:
        """The backend tag of send/recv messages from sender to receiver. Answers travel back under
        :attr:`answer_tag`, so that no answer is ever taken for data the other way between the same pair."""
        return 2 * self.tag

    @property
    def answer_tag(self) -> int:
        return 2 * self.tag + 1


class TreeLevels(NamedTuple):
    """A reduction's tree on two levels (:meth:`SlotMedium.tree_levels`): each host's ranks combine on its leader
    over the host's channel, then the leaders combine on group rank 0 through the group. Every host holds
    consecutive group ranks, so the order of a host's ranks, then of the hosts, is the group's."""

    host: Optional[Wire]  # the group's wire, its send/recv over this rank's host's channel (None: the host's only rank)
    home: int  # this rank's host
    leaders: Sequence[int]  # each host's lowest group rank, hosts in order
    lasts: Sequence[int]  # each host's highest group rank
    # a leader's step among the leaders, lead(fn, *args): where it fails, the host's channel fails too, so that the
    # host's ranks, waiting for their leader there, raise at once rather than at the group's timeout
    lead: Callable[..., Any]


# torch.distributed calls that never return None (a work to wait for, or recv's sender): guarded() never waits for
# gloo to let go of their tensors, so it does not count their references first (~50 Python steps a call)
_NEVER_NONE = frozenset((dist.isend, dist.irecv, dist.recv, dist.batch_isend_irecv))


def guarded(what: str, wire: Wire, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a torch.distributed call, turning its failures into CommunicationError. A gloo call that completed
    returns once gloo let go of its tensors (:mod:`.let_go`: else the process may abort at exit)."""
    held = held_by(args, kwargs) if fn not in _NEVER_NONE else None  # (those never wait: see below)
    try:
        result = fn(*args, **kwargs)
    except RuntimeError as exc:
        # a caller's own receive: its sender, not the group's calls (a reduction's or scan's, under INTERNAL_TAG: calls)
        why = NOT_SENT if what.startswith("recv") and wire.tag < INTERNAL_TAG else NOT_THERE
        raise CommunicationError(
            f"{what} failed on rank {wire.rank} of a group of {wire.size}{ranks_note(wire.ranks)}: {exc}. "
            f"{why[0].upper()}{why[1:]}; the group's timeout (init_process_group(timeout=...)) bounds how long ranks "
            "wait"
        ) from exc
    if held and result is None:
        wait_let_go(held)
    return result


def largest_of(
    wire: Wire, values: Sequence[int], op: str, dtype: torch.dtype = torch.int64, moved_at: Optional[int] = None
) -> List[int]:
    """The element-wise maximum of ``values`` over the ranks of ``wire``'s group (every rank calls it): through
    the slot medium when it moves words (the same-host channel, or two levels: as int64), else one
    ``all_reduce(MAX)`` of ``dtype`` on the group. The small votes and outcomes ahead of a second round.

    An answer below this rank's own ``values`` anywhere proves that a rank which relays words (a partner in the
    doubling, a leader on two levels) dropped this rank's: this rank raises :class:`~objcomm.CommunicationError`
    there, before it acts on an answer that hides, say, its refusal of a payload above its ``max_bytes`` (the others,
    which go on, fail at their timeout where they wait for it). ``moved_at``: :meth:`SlotMedium.largest`'s."""
    answer = wire.slot_medium.largest(wire, values, op, moved_at)
    if answer is NOT_USED:
        largest = torch.tensor(list(values), dtype=dtype, device=wire.device)
        if is_cpu(wire.device) and wire.size > 2:  # gloo's all_reduce is a ring: 2(W - 1) steps in sequence
            answer = _largest_by_doubling(wire, largest, op)
        else:
            guarded(op, wire, dist.all_reduce, largest, op=dist.ReduceOp.MAX, group=wire.group)
            answer = largest.tolist()
    if any(theirs < own for theirs, own in zip(answer, values)):
        raise CommunicationError(
            f"{op}: the group's vote came back below rank {wire.rank}'s own words ({list(values)} here, {answer} in "
            "the answer): a rank that relays the vote dropped them. Nothing more was moved on this rank; the ranks "
            "that went on fail at their timeout"
        )
    return answer


def _largest_by_doubling(wire: Wire, mine: torch.Tensor, op: str) -> List[int]:
    """:func:`largest_of` on gloo: recursive doubling, then a broadcast. Ranks past the largest power of two first
    hand their words to a partner below it; the others take the maximum in ceil(log2 W) steps of pairwise exchanges
    (under :data:`INTERNAL_TAG`, odd: apart from the data of objcomm's own point-to-point messages); then group rank
    0's answer goes to every rank in gloo's broadcast (a binomial tree, ceil(log2 W) steps). The broadcast, which
    gloo forwards itself, gives every rank one answer: a rank that lies in the exchanges (one word to one partner,
    another to another) could otherwise leave honest ranks with different answers, which they would act on
    differently."""
    me, size, tag = wire.rank, wire.size, 2 * INTERNAL_TAG + 1
    below = 1 << (size.bit_length() - 1)  # the largest power of two <= size

    def post(*pairs: Tuple[Any, torch.Tensor, int]) -> None:
        ops = [dist.P2POp(kind, tensor, wire.ranks[peer], wire.group, tag) for kind, tensor, peer in pairs]
        for work in guarded(op, wire, dist.batch_isend_irecv, ops):
            guarded(op, wire, work.wait)

    if me >= below:  # hand over, then wait for the answer
        post((dist.isend, mine, me - below))
    else:
        theirs = torch.zeros_like(mine)  # (a short message leaves zeros: see objcomm._transport.bytes.zeroed)
        if me + below < size:
            post((dist.irecv, theirs, me + below))
            torch.maximum(mine, theirs, out=mine)
        step = 1
        while step < below:
            post((dist.isend, mine, me ^ step), (dist.irecv, theirs, me ^ step))
            torch.maximum(mine, theirs, out=mine)
            step *= 2
    guarded(op, wire, dist.broadcast, mine, src=wire.ranks[0], group=wire.group)
    return mine.tolist()
