"""A group's same-host state on this rank (:class:`SameHost`): its channel, and what decides whether send/recv take it.

send/recv move from the group's backend to the channel at a vote that every rank sees alike
(:meth:`objcomm._samehost.channel.LocalChannel.vote`, through the channel's control group). A rank votes yes
(:meth:`SameHost.begin_vote`) when no send of its is in flight through the group and no receive from any rank waits
there; the receives from given ranks that wait there are listed in its vote, each ``(src, tag)`` with the slots it
counts from ``src`` (taken, and waiting). After a yes from every rank, a sender owes those receives their messages
through the group (:meth:`SameHost.owe`, :attr:`SameHost.owed`): each receive waiting through the group at the vote
gets its message there, every later message goes through the channel, and none is left waiting on a route its
sender no longer uses. Until the vote's outcome, a send/recv that starts on this rank waits for it.

Why the counts are exact: a send through the group completes only once its receiver has posted the receive (gloo), so
a rank with no send in flight has had every message it sent matched by a receive of its peer, posted before the
peer's vote (after it, the peer's send/recv wait); and a rank counts a receive from a given rank when it routes it,
from any rank when it takes a message (the vote waits for those to end). So ``slots - sent`` is the number of
receives still waiting for the sender's messages through the group. NCCL's send returns before its receiver posts:
there a vote passes only with no receive waiting anywhere and every slot sent through the group taken there
(:meth:`SameHost.balance`), and its set-up never moves send/recv.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from objcomm._device import is_cpu
from objcomm._errors import CommunicationError
from objcomm._samehost import channel as _channel
from objcomm._transport import pending as _pending

Key = Tuple[int, int]  # (peer's group rank, tag)
MOST_KEYS = 1 << 16  # (peer, tag) a rank counts slots of, sent or taken, before it stops (and votes no)
PENDING_WAIT = 0.5  # seconds a vote waits for this rank's pending sends to be received (objcomm._transport.pending)


class SameHost:
    """One group's same-host state on this rank: its channel, and what decides whether send/recv use it.

    What a send/recv vote looks at (:meth:`begin_vote`), per (peer, tag), counted while send/recv go through the
    group: sends in flight, receives that have taken nothing yet, slots posted and slots taken. After a vote that
    moved send/recv onto the channel, :attr:`owed` holds the sends this rank still makes through the group: one for
    each receive a peer had waiting there for it at the vote (:meth:`owe`), so that no receive is left waiting on
    the group for a message that now goes through the channel."""

    def __init__(self) -> None:
        self.channel: Optional[_channel.LocalChannel] = None  # the open one, or the last one (failed)
        self.decided = False  # opened once: ``channel`` None then means "not all on one host"
        self.agreed = False  # every rank said so at a collective: collectives may take ``channel``
        self.broken: Optional[str] = None  # the ranks disagreed at a reopen: why
        self.cond = threading.Condition()
        self.sending = 0  # sends of this rank through the group, not finished
        self.anyone = 0  # receives from any rank through the group that took nothing yet
        self.waiting: Dict[Key, int] = {}  # (src, tag): receives from src through the group that took nothing yet
        self.took: Dict[Key, int] = {}  # (src, tag): slots taken through the group from src
        self.sent: Dict[Key, int] = {}  # (dst, tag): slots posted through the group to dst
        self.owed: Dict[Key, int] = {}  # (dst, tag): sends still due through the group after the vote (owe)
        self.uncounted = False  # past MOST_KEYS: this rank votes no from then on
        self.voting = False  # this rank's vote is out now
        # the control group: votes and reopenings (objcomm._transport.groups.sibling), once opened; its lock, held
        # by whoever uses it (a background vote, a reopening: objcomm._samehost.opener)
        self.control: Any = None
        self.control_lock = threading.Lock()
        self.background: Optional[bool] = None  # whether the channel opens and votes in the background (opener)
        self.opener: Any = None  # then this rank's objcomm._samehost.opener.Opener, once started

    def begin_vote(self, group: Any, settle: float = PENDING_WAIT) -> Optional[List[int]]:
        """This rank's send/recv vote: None (no) while it has a send through the group in flight (blocking, or eager and
        not yet received: :mod:`objcomm._transport.pending`), a receive from any rank there, slots of more than
        :data:`MOST_KEYS` (peer, tag) counted, or receives waiting there from more than
        :data:`~objcomm._samehost.channel.VOTE_ROOM` (peer, tag); else (yes) its receives waiting there, as ``(src, tag,
        slots)`` triples, ``slots`` counting those taken from ``src`` under ``tag`` and those waiting. Until
        :meth:`end_vote`, a send/recv that starts meanwhile waits for the outcome. ``settle``: seconds it first waits
        for this rank's pending sends to be received (a collective's vote: their receivers may be about to post; a vote
        in the background: none, its peers' send/recv wait meanwhile)."""
        if settle:
            _pending.idle(group, settle)  # a moment for sends received just now to be known as received
        with self.cond:
            ready = (
                self.sending == 0
                and self.anyone == 0
                and not self.uncounted
                and len(self.waiting) <= _channel.VOTE_ROOM
                and _pending.idle(group)
            )
            self.voting = ready
            if not ready:
                return None
            return [word for key, n in sorted(self.waiting.items()) for word in (*key, self.took.get(key, 0) + n)]

    def owe(self, rows: Sequence[Sequence[int]], rank: int) -> None:
        """After a vote that every rank passed (``rows``: each rank's triples, :meth:`begin_vote`): the sends this
        rank (group rank ``rank``) still makes through the group, one for each slot a receiver counted from it that
        it has not posted there. A rank's count of its own receives only moves its own messages."""
        owed: Dict[Key, int] = {}
        for receiver, row in enumerate(rows):
            for at in range(0, len(row) - 2, 3):
                src, tag, slots = row[at : at + 3]
                due = slots - self.sent.get((receiver, tag), 0)
                if src == rank and receiver != rank and due > 0:
                    owed[receiver, tag] = due
        self.owed = owed

    def balance(self) -> int:
        """Slots this rank posted through the group less those it took there (a vote on an NCCL group, where a send
        returns before its receiver posts: send/recv move onto the channel only where the group's sum is 0)."""
        return sum(self.sent.values()) - sum(self.took.values())

    def vote(self, wire: Any, channel: _channel.LocalChannel, entries: Optional[List[int]], op: str, what: str) -> None:
        """This rank's vote (``entries``: :meth:`begin_vote`'s) through ``channel``'s control group, and its outcome
        (the caller ends the vote). A failure fails the channel here: the next call decides anew."""
        try:
            rows = channel.vote(wire, entries, what, balance=None if is_cpu(wire.device) else self.balance())
        except _channel.OutOfStep as exc:
            self.broken = str(exc)
            channel.fail(op, str(exc))
        except CommunicationError as exc:  # failed on this rank, perhaps not on others
            channel.fail(op, f"the send/recv vote failed ({exc})", exc)
        self.settle(rows, wire.rank, channel)

    def settle(self, rows: Optional[Sequence[Sequence[int]]], rank: int, channel: _channel.LocalChannel) -> None:
        """A vote's outcome (``rows``: :meth:`LocalChannel.vote`'s; None: it did not pass), recorded before the vote
        ends, as a send/recv waiting for it must see it: what this rank owes (:meth:`owe`), and whether send/recv
        take ``channel``."""
        with self.cond:
            if rows is not None:
                self.owe(rows, rank)
            channel.p2p = rows is not None

    def owes(self, dst: int, tag: int) -> bool:
        """(Under :attr:`cond`.) Whether a send to ``dst`` under ``tag`` is one this rank still owes through the
        group (a receive there waited for it at the vote): then one fewer is owed."""
        if (dst, tag) not in self.owed:
            return False
        _less(self.owed, (dst, tag))
        return True

    def end_vote(self) -> None:
        with self.cond:
            self.voting = False
            self.cond.notify_all()


class Counted:
    """A send/recv through the group, counted in its :class:`SameHost` while it runs (a vote looks at the counts)."""

    __slots__ = ("state", "tag", "key", "sends", "waits", "owed")

    def __init__(self, state: SameHost, sends: bool, peer: Optional[int], tag: int, owed: bool = False) -> None:
        """(Under ``state.cond``.) ``owed``: a send that one of :attr:`SameHost.owed` sends through the group, given
        back if it ends without posting its slot."""
        self.state, self.tag, self.sends, self.owed = state, tag, sends, owed
        self.key: Optional[Key] = None if peer is None else (peer, tag)
        self.waits = not sends  # a receive that took nothing yet
        if sends:
            state.sending += 1
        elif self.key is None:
            state.anyone += 1
        else:
            state.waiting[self.key] = state.waiting.get(self.key, 0) + 1

    def __enter__(self) -> None:
        return None

    def posted(self) -> None:
        assert self.key is not None
        with self.state.cond:
            _count(self.state, self.state.sent, self.key)
            self.owed = False

    def took(self, sender: int) -> None:
        state, taken = self.state, (sender, self.tag)
        with state.cond:
            self._stop_waiting()
            _count(state, state.took, taken)

    def __exit__(self, *exc: Any) -> None:
        with self.state.cond:
            if self.sends:
                self.state.sending -= 1
                if self.owed and self.key is not None:  # raised before posting: the receive still waits for one
                    self.state.owed[self.key] = self.state.owed.get(self.key, 0) + 1
            else:
                self._stop_waiting()

    def _stop_waiting(self) -> None:
        if not self.waits:
            return
        self.waits = False
        if self.key is None:
            self.state.anyone -= 1
        else:
            _less(self.state.waiting, self.key)


def _less(counts: Dict[Key, int], key: Key) -> None:
    """One fewer under ``key``, which is there: gone at none."""
    if counts[key] > 1:
        counts[key] -= 1
    else:
        del counts[key]


def _count(state: SameHost, counts: Dict[Key, int], key: Key) -> None:
    """One more slot under ``key`` (under ``state.cond``). Past :data:`MOST_KEYS` (peer, tag) counted, a rank stops
    counting and votes no from then on (a program with a tag per message would grow them without end)."""
    if key in counts:
        counts[key] += 1
    elif len(counts) < MOST_KEYS:
        counts[key] = 1
    else:
        state.uncounted = True
