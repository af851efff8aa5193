"""Round 1 through the same-host channel: the slots of collectives and of send/recv between the
processes of one host.

:class:`ChannelSlots` is a slot medium (:class:`objcomm._transport.base.SlotMedium`): when every rank
of a group runs on this host, the slots of ``all_gather``/``gather``, ``broadcast``, ``scatter`` and
``all_to_all`` (and of the reductions, which end in one of these), and those of ``send``/``recv``
(``isend``/``irecv``, any source, tags), move through a :class:`objcomm._samehost.channel.LocalChannel` and never
touch the group's backend. A slot that holds a whole frame and nothing after it travels trimmed after
the frame, and is read as the whole slot on arrival (:func:`objcomm._samehost.channel_checks.trimmed`;
``docs/wire-format.md`` section 7): the zeros of a 4 KiB slot were most of what a small call allocated, copied and
moved. After round 1 the collectives' votes and control words go through the channel too; a send/recv's answer
and, below the shared-memory threshold, its second round go through it as well (:class:`ChannelRoute`,
:mod:`objcomm._samehost.channel_rests`); shared memory and the group move the rest as before, and every
failure is unchanged: a slot carries an error report as before, and a dead peer or a wait past the group's
timeout raises :class:`~objcomm.CommunicationError` (a failed collective closes the channel, so the
others raise at once too; a recv that only timed out leaves it open).

When the channel is used (the same answer on every rank, decided without talking to the others): ``local`` is on, the
group has two ranks or more (any backend: NCCL groups' round 1 is host bytes too, and stays off the GPU) and a slot fits
one channel message. On a group of up to :data:`objcomm._samehost.opener.MOST_RANKS` ranks (on one node, where torchrun
says), each rank's first call of any kind starts opening it in the background, through a control group of its own
(:mod:`objcomm._samehost.opener`), and collectives take it once every rank has said at one that its opening is done; on
a larger group the first collective opens it, a collective over the group itself (:meth:`LocalChannel.open`: one
``all_gather`` of identities, one ``all_reduce``, on the group's device). A group whose ranks are not all on this host
gets none, kept too, so later calls go straight to the backend. The channel is kept in
:func:`objcomm._state.group_facts` (a :class:`SameHost`) and closed when the group is collected or at exit. Async
collectives run on the group's shadow (:mod:`objcomm._api.requests`), a group of its own, with a channel of its own;
``isend``/``irecv`` run on the group itself.

A sender and its receiver must route a message the same way, so send/recv move onto the channel at a vote that every
rank sees alike (:mod:`objcomm._samehost.p2p_state`): the set-up, then votes in the background until one passes
(:mod:`objcomm._samehost.opener`), or, on a larger group, an all_gather or all_to_all through the channel (the first 16
after set-up, then every 64th), which then takes one more collective through the control group
(:meth:`objcomm._samehost.channel.LocalChannel.vote`). While this rank's yes-vote is out, a send/recv that starts on
another thread waits for the outcome.

After a failure: send/recv on the group raise until a collective opens a new channel. That
collective does so only if every rank failed at the same point and reopens at the same call (the set-up carries each
rank's ``(generation, failure point, this call)``): a rank that failed tells its peers where (a ``FAILED`` notice,
:meth:`objcomm._samehost.mesh.Mesh._failure_point`), so that a peer that finds it gone at a later call (it had
returned before the failure) opens the new channel at that call with it (:meth:`ChannelSlots._round_one`). Ranks
that failed at different calls (one finished a call the others failed, a notice was lost) are out of step, and every
rank raises at that call and at every later one that may use the channel, rather than match calls that do not belong
together.
"""

from __future__ import annotations

import contextlib
import functools
import struct
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, Union, cast

from objcomm import _state
from objcomm._device import is_cpu, timeout_seconds
from objcomm._errors import CommunicationError
from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._format.slot import SlotInfo
from objcomm._samehost import channel as _channel
from objcomm._samehost import channel_checks as _channel_checks
from objcomm._samehost import channel_rests as _channel_rests
from objcomm._samehost import opener as _opener
from objcomm._samehost.channel_checks import _checked, _trim, agree_on, cut_whole, echo, whole_message, whole_size
from objcomm._samehost.inbox import ALL_GATHER, ALL_TO_ALL, ANSWER, BROADCAST, GATHER, REST, SCATTER
from objcomm._samehost.mesh import MAX_PAYLOAD
from objcomm._samehost.p2p_state import Counted, SameHost
from objcomm._settings import DEFAULT_SHM_THRESHOLD
from objcomm._transport import call_clock
from objcomm._transport.base import ASKS, NOT_USED, THROUGH_GROUP, WHOLE, Lease, Mine, NotUsed, Slot, TreeLevels, Wire
from objcomm._transport.patterns import Pattern

T = TypeVar("T")
_KINDS = {  # a round-1 message's kind on the channel, by its collective's pattern
    "all_gather": ALL_GATHER,
    "gather": GATHER,
    "broadcast": BROADCAST,
    "scatter": SCATTER,
    "all_to_all": ALL_TO_ALL,
}
_EVERYONE = ("all_gather", "all_to_all")  # every rank sends to every rank: the send/recv vote may ride along
_BACKEND = THROUGH_GROUP  # send/recv through the group, uncounted


class ChannelRoute:
    """send/recv through a channel: the route :meth:`ChannelSlots.p2p` gives once the channel takes them."""

    __slots__ = ("channel", "spin", "folded")

    def __init__(
        self, channel: _channel.LocalChannel, spin: Optional[float], folded: Optional[bytearray] = None
    ) -> None:
        self.channel = channel
        self.spin = spin
        # the rest that came with the slot :meth:`recv` took (a message id with WHOLE set)
        self.folded = bytearray() if folded is None else folded

    def __enter__(self) -> ChannelRoute:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def posted(self) -> None:  # (the group's route counts; this one is not it)
        pass

    def took(self, sender: int) -> None:
        pass

    def send(self, wire: Wire, slot: Slot, dst: int, asks: bool = False) -> int:
        message = self.channel.new_message() | (ASKS if asks else 0)
        self.channel.send(_trim(slot), dst, wire.tag, message)
        return message

    def send_whole(self, wire: Wire, slot: Slot, out: Outgoing, info: SlotInfo, dst: int) -> bool:
        if whole_size(slot, info.second_round_bytes) > MAX_PAYLOAD:
            return False
        whole = whole_message(slot, _channel_rests.pieces(out, info.inline is not None))  # the slot untrimmed
        self.channel.send(whole, dst, wire.tag, self.channel.new_message() | WHOLE)
        return True

    def recv(self, wire: Wire, src: Optional[int], op: str) -> Tuple[int, Slot, int]:
        sender, slot, message = self.channel.recv(src, wire.tag, self.spin)
        if message & WHOLE:
            slot, self.folded = cut_whole(self.channel, slot, wire.slot, sender, op, is_cpu(wire.device))
        return sender, _checked(wire, self.channel, [slot], op)[0], message

    def answer(self, wire: Wire, dst: int, message: int, code: int) -> None:
        self.channel.send_part(ANSWER, bytes((code,)), dst, wire.tag, message)

    def answer_of(self, wire: Wire, src: int, message: int, op: str) -> int:
        got = self.channel.recv_part(ANSWER, src, wire.tag, message, self.spin)
        if len(got) != 1:
            self.channel.fail(
                op, f"rank {src} answered message #{message} with {len(got):,} bytes where 1 was due: a protocol error"
            )
        return got[0]

    def send_words(self, wire: Wire, words: Sequence[int], dst: int, message: int) -> None:
        self.channel.send_part(REST, struct.pack(f"<{len(words)}q", *words), dst, wire.tag, message)

    def recv_words(self, wire: Wire, count: int, src: int, message: int, op: str) -> List[int]:
        got = self.channel.recv_part(REST, src, wire.tag, message, self.spin)
        if len(got) != 8 * count:
            self.channel.fail(
                op,
                f"rank {src} sent {len(got):,} bytes of control words for message #{message} where "
                f"{8 * count} were due: a protocol error",
            )
        return list(struct.unpack(f"<{count}q", got))

    def send_rest(self, wire: Wire, out: Outgoing, info: SlotInfo, dst: int, message: int) -> None:
        _channel_rests.send_p2p(self.channel, wire, out, info, dst, message)

    def recv_rest(
        self, wire: Wire, info: SlotInfo, sizes_of: SizesOf, src: int, message: int, op: str, drain: bool = False
    ) -> Incoming:
        if message & WHOLE:
            return _channel_rests.came_with_slot(self.channel, self.folded, info, sizes_of, src, message, op, drain)
        return _channel_rests.recv_p2p(self.channel, self.spin, wire, info, sizes_of, src, message, op, drain)


@dataclass(frozen=True)
class ChannelSlots:
    """Round-1 slots through the group's same-host channel, opened on the first call that may use it."""

    separate: Union[bool, int] = False  # tests: every rank its own host (True), or hosts of k ranks
    spin_us: Optional[int] = None  # the local_spin_us setting: µs a wait polls before sleeping; None: automatic
    shm: bool = False  # this rank's shm and shm_threshold: they pick a rest's medium, which the echo checks
    threshold: int = DEFAULT_SHM_THRESHOLD

    @property
    def spin(self) -> Optional[float]:
        """The spin in seconds, as the channel's operations take it (None: the channel's automatic one)."""
        return None if self.spin_us is None else self.spin_us * 1e-6

    def state(self, wire: Wire) -> Optional[SameHost]:
        """The group's same-host state, or None when the channel can never take this wire's slots (the
        same answer on every rank): one rank, slots above a message, no group to keep it on. NCCL groups
        take it too: round 1 is host bytes either way, and the channel spares them a copy to the GPU, a
        collective and a copy back."""
        if wire.size < 2 or wire.slot > MAX_PAYLOAD:
            return None
        try:
            weakref.ref(wire.group)
        except TypeError:  # nowhere to keep a channel: it would be opened again on every call
            return None
        known: Dict[int, SameHost] = _state.group_facts(wire.group).local
        found = known.get(self.separate)
        if found is None:
            found = known.setdefault(self.separate, SameHost())
        return found

    def checks_slots(self, wire: Wire) -> bool:
        """Where the group's channel is open and agreed: a slot of another size fails it on every rank."""
        state = self.state(wire)
        return state is not None and state.agreed and state.channel is not None

    def channel_of(self, wire: Wire, op: str) -> Optional[Tuple[_channel.LocalChannel, Optional[float]]]:
        state = self.state(wire)
        channel = None if state is None or not state.agreed else state.channel
        if channel is None:
            return None
        channel.check(op)  # round 1 went through it (a call that finds it closed opens a new one, or raises)
        return channel, self.spin

    def channel(self, wire: Wire, op: str, foreground: bool = False) -> Optional[_channel.LocalChannel]:
        """The group's channel for a collective, or None (the backend moves the slots): the same answer on
        every rank. Opens it on the first call, and again on the first call after it failed. ``foreground``: opened
        by this call, through the group, whatever its size (a host's group on two levels, opened at their set-up)."""
        state = self.state(wire)
        if state is None:
            return None
        channel = state.channel
        if state.agreed and channel is not None and not channel.closed:
            return channel
        if state.broken:
            raise CommunicationError(f"{op}: {state.broken}")
        if foreground and state.background is None:
            state.background = False
        background = _opener.background(wire, state, self.separate)
        if background and not state.agreed:  # opening in the background, where send/recv start it too
            return _opener.agreed_channel(wire, state, self.separate, op, lambda: self._reopen(wire, state, None, op))
        if state.decided and channel is None:
            return None  # not all on one host
        if channel is not None and channel.failed_at is None:  # closed, not failed: a forked child, or at exit
            channel.check(op)  # raises
        _opener.end_votes(wire, state)  # its votes (through the control group) end first
        with state.control_lock:
            channel = self._reopen(wire, state, channel, op)
        if channel is not None and background and not channel.p2p:
            _opener.vote_on(wire, state, channel)
        return channel

    def _reopen(
        self, wire: Wire, state: SameHost, channel: Optional[_channel.LocalChannel], op: str
    ) -> Optional[_channel.LocalChannel]:
        """Open the group's channel in the foreground: its first opening on a group too large to open it in the
        background, and after a failure (``channel``: the one that failed)."""
        history = (0,) * 5 if channel is None else channel.history()
        try:  # (begin_vote may raise; end_vote then clears what it set)
            mine = state.begin_vote(wire.group)
            channel = _channel.LocalChannel.open(
                wire,
                timeout=timeout_seconds(wire.group),
                separate=self.separate,
                op=f"{op} (opening the same-host channel)",
                # the set-up has no room for receives waiting: none may; on NCCL only votes count (balance)
                ready=mine == [] and is_cpu(wire.device),
                history=history,
                control=state.control,
            )
            if channel is not None and state.control is None:  # every rank is here: the first set-up worked on all
                try:
                    state.control = channel.control = _channel.control_group(wire, op)
                except BaseException:
                    channel.close(f"{op}: the ranks could not agree on the channel's control group")
                    raise
            with state.cond:  # before the vote ends: a send/recv waiting for it must see the new channel
                state.channel, state.decided, state.agreed, state.owed = channel, True, True, {}
        except _channel.OutOfStep as exc:
            state.broken = str(exc)
            raise
        finally:
            state.end_vote()
        if channel is not None:  # also runs at exit
            weakref.finalize(wire.group, channel.close)
        return channel

    def _round_one(self, wire: Wire, op: str, move: Callable[[_channel.LocalChannel], T]) -> Union[T, NotUsed]:
        """``move(channel)``: round 1 of a collective through the group's channel (opened first if it must be), or
        NOT_USED where the backend moves it. A peer that failed the channel before this call began opens a new one
        at this call: this rank does so too, and moves round 1 through that
        (:meth:`objcomm._samehost.mesh.Mesh.rejoins_after`)."""
        channel = self.channel(wire, op)
        if channel is None:
            return NOT_USED
        channel.rounds += 1
        start = channel.sequence
        try:
            return move(channel)
        except CommunicationError:
            if not channel.rejoins_after(start):
                raise
        channel = self.channel(wire, op)
        if channel is None:
            return NOT_USED
        channel.rounds += 1
        return move(channel)

    def exchange(self, wire: Wire, at: Pattern, mine: Mine, op: str) -> Union[Dict[int, Slot], NotUsed]:
        """Round 1 through the channel: each slot sent trimmed after its frame (:func:`_trim`), each one received
        checked (:func:`_checked`); an all_gather or all_to_all carries the send/recv vote where one is due
        (:meth:`_voting`). A gather's round 1 on one host is an all_gather's pattern, its messages of a gather's kind
        (:meth:`objcomm._samehost.mesh.Mesh.all_gather`)."""
        kind = GATHER if op == "gather" else _KINDS[at.op]

        def exchange(channel: _channel.LocalChannel) -> Dict[int, Slot]:  # (trimmed once a channel takes it: W parts)
            parts = cast(Sequence[Slot], mine)
            sent = mine if mine is None else [_trim(s) for s in parts] if at.each else _trim(cast(Slot, mine))
            got = channel.move(kind, at, sent, self.spin, op)
            return dict(zip(got, _checked(wire, channel, list(got.values()), op)))

        if at.op in _EVERYONE:
            return self._round_one(wire, op, lambda channel: self._voting(wire, channel, exchange, op))
        return self._round_one(wire, op, exchange)

    def gather(self, wire: Wire, slot: Slot, dst: int, op: str) -> Union[Optional[List[Slot]], NotUsed]:
        return NOT_USED  # on one host a gather's round 1 is the channel's all_gather

    def share(self, wire: Wire, data: Optional[Slot], length: int, src: int, op: str) -> Union[Slot, NotUsed]:
        return NOT_USED

    def tree_levels(self, wire: Wire, op: str) -> Optional[TreeLevels]:
        return None  # on one host the tree's send/recv take the group's channel (p2p)

    def gather_words(self, wire: Wire, words: Sequence[int], op: str) -> Union[List[List[int]], NotUsed]:
        found = self.channel_of(wire, op)  # round 1 opened it, or found none: never opened here, mid-call
        if found is None:
            return NOT_USED
        channel = found[0]
        packing = _words(len(words))
        got = channel.all_gather(packing.pack(*words), self.spin, op)
        for r, data in enumerate(got):
            if len(data) != packing.size:
                channel.fail(
                    op,
                    f"rank {r} sent {len(data)} bytes of control words where {packing.size} were due "
                    "(the ranks are at different calls, or a protocol error)",
                )
        echo(channel, b"".join(got), self.spin, op, "control words")  # what every rank acts on: the same rows
        return [list(packing.unpack(data)) for data in got]

    def largest(
        self, wire: Wire, values: Sequence[int], op: str, moved_at: Optional[int] = None
    ) -> Union[List[int], NotUsed]:
        """Every rank's ``values``' maximum; this rank's shared memory settings with them where ``values[moved_at]`` is
        the rest that follows (:func:`~objcomm._samehost.channel_checks.largest_alike`)."""
        shared = [] if moved_at is None else [_channel_checks.settings_word(self.shm, self.threshold)]
        rows, cpu = self.gather_words(wire, [*values, *shared], op), is_cpu(wire.device)
        return rows if rows is NOT_USED else _channel_checks.largest_alike(rows, moved_at, cpu, op)

    def agree(self, wire: Wire, infos: Sequence[SlotInfo], op: str) -> None:
        found = self.channel_of(wire, op)
        if found is not None:
            medium = _channel_checks.medium_of(infos, op, self.shm, self.threshold, is_cpu(wire.device))
            agree_on(found[0], found[1], infos, op, medium)
            # every rank of the group echoed (on one host): where round 1 was one rank's slot to all (a broadcast's,
            # a scatter's) this is the first moment every rank is here; the steps after share one timeout
            call_clock.round_one_done()

    def _voting(
        self,
        wire: Wire,
        channel: _channel.LocalChannel,
        exchange: Callable[[_channel.LocalChannel], Dict[int, Slot]],
        op: str,
    ) -> Dict[int, Slot]:
        """``exchange(channel)``, an all_gather or all_to_all, then, until send/recv are on the channel and where a
        vote is due (:meth:`~objcomm._samehost.channel.LocalChannel.vote_due`), this rank's send/recv vote. The vote
        goes through the group
        (:meth:`~objcomm._samehost.channel.LocalChannel.vote`), whose result every rank sees alike; a rank whose
        exchange failed still votes (no) before it raises, so that the others' vote never meets its next call."""
        state = self.state(wire) if not channel.p2p else None
        if state is None or state.background or not channel.vote_due():  # (background: objcomm._samehost.opener votes)
            return exchange(channel)
        what = f"{op} (voting send/recv onto the same-host channel)"
        try:  # the vote is out from here: a send/recv that starts meanwhile waits for the outcome
            entries = state.begin_vote(wire.group)
            start = channel.sequence
            try:
                got = exchange(channel)
            except CommunicationError:  # still vote (no): the others' vote must not meet this rank's next call
                if not channel.rejoins_after(start):  # (none votes where every rank opens a new channel now)
                    with contextlib.suppress(CommunicationError):
                        channel.vote(wire, None, what)
                raise
            state.vote(wire, channel, entries, op, what)
        finally:
            state.end_vote()
        return got

    def connect(self, wire: Wire) -> bool:
        """``connect()``: the group's channel, opened on every rank, and whether send/recv take it, settled now
        alike on every rank (a collective): the background's votes end first, then one vote through the control
        group; where it does not pass, the background votes on."""
        state, op = self.state(wire), "connect"
        channel = self.channel(wire, op)
        while channel is None and state is not None and state.background and not state.agreed:
            channel = self.channel(wire, op)  # (each round one collective: the ranks leave the loop together)
        if state is None or channel is None or channel.closed:
            return False
        if not channel.p2p:
            _opener.end_votes(wire, state)
            with state.control_lock:
                if not channel.p2p:
                    try:
                        state.vote(wire, channel, state.begin_vote(wire.group), op, f"{op} (voting send/recv)")
                    finally:
                        state.end_vote()
            if not channel.p2p and state.background:
                _opener.vote_on(wire, state, channel)
        return channel.p2p

    def p2p(self, wire: Wire, op: str, peer: Optional[int]) -> Lease:
        """The route of one send/recv: entering gives an object with ``send``/``recv`` (the channel), or
        None (the group); see the module docstring for when it is which."""
        state = self.state(wire)
        if state is None:
            return _BACKEND
        channel = state.channel
        if channel is not None and channel.p2p and not channel.closed:  # (then owed: a vote sets it before p2p)
            owed = state.owed
            if not owed or (peer, wire.tag) not in owed:
                return ChannelRoute(channel, self.spin)
        if state.decided and channel is None:  # not all on one host: never the channel, nothing to count
            return _BACKEND
        if state.opener is None and not state.decided and _opener.background(wire, state, self.separate):
            _opener.start(wire, state, self.separate)  # this rank's first call on the group: open the channel
        sends = op == "send"
        with state.cond:
            timeout = timeout_seconds(wire.group)
            if state.voting and not state.cond.wait_for(lambda: not state.voting, timeout):
                raise CommunicationError(
                    f"{op}: a collective on this group has decided for {timeout:.0f}s whether "
                    "send/recv may use the same-host channel; it has not finished"
                )
            channel = state.channel
            if state.broken:
                raise CommunicationError(f"{op}: {state.broken}")
            if channel is not None and channel.closed and channel.failed_at is not None:
                raise CommunicationError(
                    f"{op}: this group's same-host channel failed earlier (on this rank: {channel.failed_at}); "
                    "send/recv on it raise until a collective on the group has opened it again"
                )
            if channel is not None and channel.closed and channel.p2p:  # closed, not failed (a forked child, at exit):
                channel.check(op)  # raises, as a collective does (the peers' send/recv still take the channel)
            if channel is not None and channel.p2p and not channel.closed:
                # a receive the peer had waiting through the group at the vote takes an owed send there
                if not (sends and peer is not None and state.owes(peer, wire.tag)):
                    return ChannelRoute(channel, self.spin)
                return Counted(state, sends, peer, wire.tag, owed=True)
            return Counted(state, sends, peer, wire.tag)


@functools.lru_cache(maxsize=16)
def _words(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}q")
