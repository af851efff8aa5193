"""The operations of a same-host channel once its sockets are connected (:class:`Mesh`, the base of
:class:`objcomm._samehost.channel.LocalChannel`, which sets it up): collectives, send/recv and the parts of a send,
each message sent with its header and the credit it takes, and closing after a failure.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from typing import Any, Dict, Iterator, List, NoReturn, Optional, Sequence, Tuple

from objcomm._errors import NOT_THERE, CommunicationError
from objcomm._samehost.inbox import (
    ALL_GATHER,
    ALL_TO_ALL,
    ANSWER,
    BROADCAST,
    ECHO,
    FAILED,
    GATHER,
    HEADER,
    LEFT,
    MASK,
    NAMES,
    P2P,
    POINT_TO_POINT_KINDS,
    REST,
    SCATTER,
)
from objcomm._samehost.inbox import after as _after
from objcomm._samehost.inbox_waits import SEND_FLAGS as _FLAGS
from objcomm._samehost.inbox_waits import Inbox
from objcomm._transport import any_source, call_clock
from objcomm._transport.base import Slot
from objcomm._transport.call_words import WORD as CALL_WORD
from objcomm._transport.call_words import described
from objcomm._transport.patterns import Pattern, pattern

MAX_PAYLOAD = 64 << 10  # bytes in one message; a SEQPACKET message must fit the socket's send buffer
_WAITER = {ANSWER: "send", REST: "recv"}  # the operation that waits for each part of a send
EVERY_VOTE, LATER_VOTES = 16, 64  # send/recv votes: at the first 16 all_gathers and all_to_alls, then every 64th


class Mesh:
    """A full mesh of Unix-domain sockets between the ranks of one group on one host, connected: what moves over it
    (see :class:`objcomm._samehost.channel.LocalChannel`, which sets it up and holds these fields)."""

    rank: int
    size: int
    timeout: float
    failed_at: Optional[int]
    generation: int
    rounds: int
    rejoins: bool
    found_in: Optional[int]
    rejoining: bool
    _current: Optional[int]
    auto_spin: float
    closed: bool
    _pids: Tuple[int, ...]
    ranks_note: str
    _peers: Dict[int, socket.socket]
    _others: List[int]
    _patterns: Dict[Tuple[str, Optional[int]], Pattern]
    _inbox: Inbox
    _votes: int
    sequence: int  # the number of the last collective this rank began on this channel
    _messages: Iterator[int]
    _owner: int
    _lock: threading.Lock

    # -- operations (who sends what to whom: objcomm._transport.patterns) ---------------------------------
    def move(
        self, kind: int, pattern: Pattern, mine: Any, spin: Optional[float] = None, op: Optional[str] = None
    ) -> Dict[int, bytes]:
        """One collective of ``kind`` (its header's kind: :data:`ALL_GATHER`, ...): this rank's part of ``pattern``
        (``mine``: one part, or one per rank), and what its sources sent, by rank. ``spin`` (every operation that
        waits): seconds a wait polls before it sleeps; ``None``: :attr:`auto_spin`. ``op`` (every operation): the
        user's call this step is part of, as errors name it (a broadcast's echo fails as "broadcast"); ``None``: the
        kind's name."""
        return self._collective(kind, pattern.outgoing(mine), pattern.sources, spin, op)

    def _pattern(self, op: str, root: Optional[int] = None) -> Pattern:
        """This rank's part in ``op`` (:func:`objcomm._transport.patterns.pattern`), kept by the channel: a small
        call's round 1 looks it up in one dict (the module's table, by keywords, cost ~30 Python steps a call)."""
        found = self._patterns.get((op, root))
        if found is None:
            found = self._patterns[op, root] = pattern(op, me=self.rank, world=self.size, root=root)
        return found

    def all_gather(self, data: Slot, spin: Optional[float] = None, op: Optional[str] = None) -> List[Slot]:
        """Every rank's ``data``, in group-rank order. A gather's all_gathers (its round 1 on one host, its words)
        go as messages of kind GATHER, so that ranks of which some call gather and others all_gather raise, where
        both would have returned (a newcomer's find: a program that passes on one host and hangs across hosts)."""
        kind = GATHER if op == "gather" else ALL_GATHER
        ring = self._patterns.get(("all_gather", None)) or self._pattern("all_gather")
        got = self._collective(kind, ring.outgoing(data), ring.sources, spin, op)
        got[self.rank] = data  # type: ignore[assignment]  # (a Slot among the bytes: the result's element)
        return list(map(got.__getitem__, range(self.size)))  # (no Python step an element)

    def broadcast(self, data: Optional[Slot], src: int, spin: Optional[float] = None, op: Optional[str] = None) -> Slot:
        """``src``'s ``data`` on every rank (ignored elsewhere)."""
        spread = self._patterns.get(("broadcast", src)) or self._pattern("broadcast", src)
        if self.rank == src:
            assert data is not None
            self._collective(BROADCAST, spread.outgoing(data), spread.sources, spin, op)
            return data
        return self._collective(BROADCAST, {}, spread.sources, spin, op)[src]  # (a receiver sends nothing)

    def gather(
        self, data: Optional[Slot], dst: int, spin: Optional[float] = None, op: Optional[str] = None
    ) -> Dict[int, bytes]:
        """Every other rank's ``data`` on group rank ``dst``, by rank (``data`` ignored there); ``{}`` elsewhere."""
        assert data is not None or self.rank == dst
        return self.move(GATHER, self._pattern("gather", dst), data, spin, op)

    def scatter(
        self, parts: Optional[Sequence[Slot]], src: int, spin: Optional[float] = None, op: Optional[str] = None
    ) -> Slot:
        """``src``'s ``parts[r]`` on group rank ``r``."""
        assert self.rank != src or parts is not None and len(parts) == self.size
        got = self.move(SCATTER, self._pattern("scatter", src), parts, spin, op)
        return parts[src] if parts is not None and self.rank == src else got[src]

    def all_to_all(self, parts: Sequence[Slot], spin: Optional[float] = None, op: Optional[str] = None) -> List[Slot]:
        """``parts[j]`` to group rank ``j``; element ``i`` of the result came from rank ``i``."""
        assert len(parts) == self.size
        got = self.move(ALL_TO_ALL, self._pattern("all_to_all"), parts, spin, op)
        return [parts[r] if r == self.rank else got[r] for r in range(self.size)]

    def echo(self, data: Slot, spin: Optional[float] = None, op: Optional[str] = None) -> List[Slot]:
        """An all_gather of kind ``ECHO``: what every rank read in round 1, so that a rank that skipped this step
        (it read round 1 differently) is told apart from one at its next call (see
        :meth:`objcomm._samehost.channel_slots.ChannelSlots.agree`)."""
        got = self.move(ECHO, self._pattern("all_gather"), data, spin, op)
        return [data if r == self.rank else got[r] for r in range(self.size)]

    def send(self, data: Slot, dst: int, tag: int = 0, message: int = 0) -> None:
        """Send ``data`` to group rank ``dst`` under ``tag``; returns once the kernel holds it. ``message``:
        its id (:meth:`new_message`), under which the answer and the rest of a send travel (:meth:`send_part`)."""
        if self.closed:  # (check(), called where it raises: every small send asks)
            self.check("send")
        self._send(dst, HEADER.pack(P2P, 0, message, tag), data, "send")

    def recv(self, src: Optional[int] = None, tag: int = 0, spin: Optional[float] = None) -> Tuple[int, bytes, int]:
        """The next message under ``tag`` from group rank ``src`` (``None``: any); ``(sender, data, its id)``. From any
        rank, within :func:`objcomm._transport.any_source.watching`, :class:`~objcomm._transport.any_source.OwnMessage`
        once a message to oneself waits for it."""
        if self.closed:  # (as send)
            self.check("recv")
        sources, watch = (self._others, any_source.WATCH.get()) if src is None else ([src], None)
        spin = self.auto_spin if spin is None else spin
        got, message = self._inbox.take(sources, (False, tag), P2P, "recv", first=True, spin=spin, watch=watch)
        if self._inbox.owing:
            self._inbox.grant()
        sender, data = got.popitem()
        return sender, data, message

    def wake(self) -> None:
        """This rank sent itself a message: a receive from any rank waiting here looks at it (``any_source``)."""
        self._inbox.wake()

    def new_message(self) -> int:
        """A message id for :meth:`send`, distinct from this rank's others until 2**30 sends later."""
        return next(self._messages) & (MASK >> 2)  # the top bits: objcomm._transport.base.WHOLE and ASKS

    def send_part(self, kind: int, data: Slot, dst: int, tag: int, message: int) -> None:
        """Send ``data`` to group rank ``dst`` as ``kind`` (:data:`ANSWER` or :data:`REST`) of message ``message``
        under ``tag``: what :meth:`recv_part` with the same four takes there."""
        self.check(NAMES[kind])
        self._send(dst, HEADER.pack(kind, 0, message, tag), data, NAMES[kind])

    def recv_part(self, kind: int, src: int, tag: int, message: int, spin: Optional[float] = None) -> bytes:
        """The next ``kind`` of message ``message`` under ``tag`` from group rank ``src`` (see :meth:`send_part`).
        After a wait that timed out (the channel stays open), what comes later under the same key is dropped on
        arrival: nobody waits for it any more."""
        op = _WAITER[kind]
        self.check(op)
        spin = self.auto_spin if spin is None else spin
        key = (False, tag, kind, message)
        try:
            got = self._inbox.take([src], key, kind, op, first=True, spin=spin)[0][src]
            if self._inbox.owing:
                self._inbox.grant()
            return got
        except CommunicationError:
            if not self.closed:
                self._inbox.abandon(src, key)
            raise

    def close(self, why: Optional[str] = None) -> None:
        """Close every connection (the peers read EOF, and threads of this rank waiting on it raise); idempotent."""
        with self._inbox.cond:
            self.closed = True
            if self._inbox.closed is None:
                self._inbox.closed = why or (
                    f"the local channel of rank {self.rank} was closed (after an error, or "
                    "close()); the group's other ranks raise too"
                )
            for sock in self._peers.values():
                if self._owner == os.getpid():  # wakes a thread blocked in recv; a forked child must not
                    _drop_unread(sock)
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                sock.close()
            self._inbox.cond.notify_all()

    def leave(self) -> None:
        """Close every connection after telling the peers this rank left (``LEFT``: its group was destroyed), so that
        their receives from any rank go on with the others (a peer that reads EOF alone takes it for a rank that died).
        Best effort: a peer whose queue is full reads the EOF alone."""
        if not self.closed and self._owner == os.getpid():
            notice = HEADER.pack(LEFT, 0, 0, 0)
            for sock in self._peers.values():
                try:
                    sock.send(notice, _FLAGS)
                except OSError:
                    pass
        self.close(f"the local channel of rank {self.rank} was closed: its process group was destroyed")

    def fail(self, op: str, why: str, cause: Optional[BaseException] = None) -> NoReturn:
        """Close the channel and raise :class:`~objcomm.CommunicationError` (``why``: what went wrong)."""
        self._fail(op, why, cause)

    def _forget(self) -> None:
        """In a forked child: drop the copies of the descriptors, so that the parent's death still
        reaches its peers as EOF (a child holding them would keep the connections open)."""
        self._owner = -1
        self.close()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- moving messages ---------------------------------------------------------------------
    def check(self, op: str) -> None:
        """Raise :class:`~objcomm.CommunicationError` if this channel cannot be used (closed, or a forked child's)."""
        if self.closed:  # a forked child's are closed at the fork (_forget_in_child): no getpid() per call
            if os.getpid() != self._owner:
                raise CommunicationError(f"{op}: a local channel cannot be used in a forked child; open one there")
            self._fail(op, "")

    def vote_due(self) -> bool:
        """Whether this all_gather or all_to_all votes on letting send/recv in: the first :data:`EVERY_VOTE`, then
        every :data:`LATER_VOTES`-th (the same calls on every rank; a vote costs one small collective through the
        group, :meth:`vote`)."""
        self._votes += 1
        return self._votes <= EVERY_VOTE or self._votes % LATER_VOTES == 0

    def _collective(
        self,
        kind: int,
        outgoing: Dict[int, Slot],
        sources: Sequence[int],
        spin: Optional[float] = None,
        op: Optional[str] = None,
    ) -> Dict[int, bytes]:
        op = op or NAMES[kind]
        if self.closed:  # (as send)
            self.check(op)
        with self._lock:
            self.sequence = self._current = seq = (self.sequence + 1) & MASK
            try:
                word = CALL_WORD.get()  # which call this rank is in: every receiver checks it (call_words)
                header = HEADER.pack(kind, 0, seq, word)
                for peer, data in outgoing.items():
                    self._send(peer, header, data, op)
                got: Dict[int, bytes] = {}
                if sources:  # not the root of a broadcast or scatter, which only sends
                    spin = self.auto_spin if spin is None else spin
                    got = self._inbox.take(sources, (True, seq), kind | word << 8, op, spin=spin)[0]
                self._inbox.done = seq
            finally:
                self._current = None
        if self._inbox.owing:
            self._inbox.grant()
        return got

    def _send(self, peer: int, header: bytes, data: Slot, op: str) -> None:
        if len(data) > MAX_PAYLOAD:
            self._fail(op, f"{len(data):,} bytes exceed the local channel's {MAX_PAYLOAD:,}-byte messages")
        if peer in self._inbox.gone:
            self._inbox.gone_from(peer, op, header[0] not in POINT_TO_POINT_KINDS)
        self._inbox.reserve(peer, header[0], len(data), op)  # header[0]: the kind
        sock, parts = self._peers[peer], [header, data]
        deadline = None
        while True:
            try:
                sock.sendmsg(parts, [], _FLAGS)
                return
            except BlockingIOError:  # the peer's queue is full: wait until it reads, bounded, taking in meanwhile
                now = time.monotonic()  # what the peers send this rank (Inbox.take_in: they may wait for it too)
                if deadline is None:  # the timeout, or a collective's call's end (call_clock, as Inbox.take)
                    deadline = call_clock.until(now, self.timeout, shared=header[0] not in POINT_TO_POINT_KINDS)
                try:
                    writable = now < deadline and self._writable(sock, deadline - now, op)
                except (OSError, ValueError) as exc:  # closed here meanwhile, by another thread (ValueError: fd -1)
                    self._unsent(header)
                    self._fail(op, f"the connection to rank {peer} closed while this rank waited to send", exc)
                if writable is None:  # something came in and was filed: try again
                    continue
                if not writable:
                    self._unsent(header)
                    self._fail(op, f"rank {peer} did not read within the timeout of {self.timeout:.0f}s ({NOT_THERE})")
            except OSError as exc:  # EPIPE, ECONNRESET: it is gone (EBADF: closed here meanwhile)
                self._unsent(header)
                self._inbox.notice_of(peer, op)  # what it sent before it went: where it failed, if it did
                if peer in self._inbox.left:
                    self._inbox.gone_from(peer, op, header[0] not in POINT_TO_POINT_KINDS)
                self._fail(op, f"rank {peer} (pid {self._pids[peer]}) closed its connection ({exc.strerror})", exc)

    def _writable(self, sock: socket.socket, wait: float, op: str) -> Optional[bool]:
        """Whether ``sock`` takes a message within ``wait`` seconds; None where a peer's message came first (filed)."""
        poll, mine = select.poll(), sock.fileno()
        masks = dict.fromkeys(self._inbox.unread(), select.POLLIN)  # (one mask an fd: a second register replaces it)
        masks[mine] = masks.get(mine, 0) | select.POLLOUT
        for fd, mask in masks.items():
            poll.register(fd, mask)
        events = poll.poll(wait * 1000)
        if any(fd == mine and event & select.POLLOUT for fd, event in events):
            return True
        if events:
            self._inbox.take_in(op)
            return None
        return False

    def _unsent(self, header: bytes) -> None:
        """A send/recv slot that ``reserve`` counted as sent did not leave (the channel fails now)."""
        if header[0] == P2P:
            with self._inbox.cond:
                self._inbox.slots_sent -= 1

    def _fail(self, op: str, why: str, cause: Optional[BaseException] = None) -> NoReturn:
        if self.closed:  # an earlier call, another thread or close(): say why it closed
            raise CommunicationError(
                f"{op} over the local channel failed on rank {self.rank}: the channel closed "
                f"before. {self._inbox.closed}"
            ) from cause
        word = CALL_WORD.get()
        call = described(word) if word else ""  # the caller's call, where a step of it failed
        message = (
            f"{f'{call}: ' if call and not call.startswith(op.split()[0] + '(') else ''}{op} over the local channel "
            f"failed on rank {self.rank} of {self.size}{self.ranks_note}: {why}. The channel is closed"
        )
        if self.failed_at is None:
            self._failure_point()
        if self._owner == os.getpid():  # the peers learn where (FAILED), ahead of the end of the connection
            notice = HEADER.pack(FAILED, 0, (self.failed_at or 0) & MASK, 0)
            for sock in self._peers.values():
                try:
                    sock.send(notice, _FLAGS)
                except OSError:  # gone, or its queue full: it learns of the close alone
                    pass
        self.close(message)
        raise CommunicationError(message) from cause

    def rejoins_after(self, sequence: int) -> bool:
        """Whether this rank failed the channel in the collective after ``sequence`` (:attr:`sequence` before it)
        because a peer had failed it earlier (:meth:`_failure_point`); if so, the next opening of the group's channel
        takes the place of that collective (:attr:`resumes_at`): the caller opens it at once, in the same call, as
        that peer does at its next."""
        rejoins = self.rejoins and self.found_in == (sequence + 1) & MASK
        # or: the call began no collective on a channel that another thread of this rank failed after the call found
        # it open: this rank takes its place in this call, as a peer told of the failure (FAILED) does in its own
        failed_meanwhile = self.sequence == sequence and self.closed and self.failed_at is not None
        if not (rejoins or failed_meanwhile):
            return False
        self.rejoining = True
        return True

    @property
    def resumes_at(self) -> int:
        """The call whose first round the next opening of the group's channel takes the place of, counted in
        :attr:`rounds`, as compared at that opening (:meth:`objcomm._samehost.channel.LocalChannel.open`): the one
        after the last this rank began, or that one itself where this rank rejoins a peer that failed first
        (:meth:`rejoins_after`). Calls, not collectives: ranks that raised out of one call may have begun different
        numbers of collectives in it."""
        return self.rounds if self.rejoining else self.rounds + 1

    def history(self) -> Tuple[int, int, int, int, int]:
        """What the next opening of the group's channel compares of this one (:meth:`LocalChannel.open`)."""
        inbox = self._inbox
        return (self.generation, self.failed_at or 0, self.resumes_at, inbox.slots_sent, inbox.slots_taken)

    def _failure_point(self) -> None:
        """Where this rank failed the channel (``failed_at``, told to the peers and compared where the group opens
        the next one, :meth:`LocalChannel.open`).

        Where this rank failed: the last collective it began (a failed send/recv: the one before it). But where a
        peer that failed the channel before this rank's current collective began told it so (its failure notice,
        :data:`~objcomm._samehost.inbox.FAILED`), that peer will open a new channel at this very call: this rank
        takes the peer's point, so that it may do the same (:meth:`rejoins_after`), where otherwise it would raise
        out of a call that the peer then waits in until the group's timeout (a sender whose message had gone before
        its receiver found it broken)."""
        current = self._current
        earlier = [p for _, p in sorted(self._inbox.failed.items()) if current is not None and _after(current, p)]
        self.rejoins, self.found_in = bool(earlier), current
        self.failed_at = earlier[0] if earlier else self.sequence


def _drop_unread(sock: socket.socket) -> None:
    """Read and drop what is queued for this rank on ``sock`` before it closes (credits, mostly): closing with
    unread messages makes Linux tell the peer ECONNRESET ahead of the messages this rank sent it last."""
    try:
        for _ in range(4096):  # bounded: a peer that keeps sending cannot hold the close
            if not sock.recv(MAX_PAYLOAD + 1, socket.MSG_DONTWAIT):
                return  # EOF (or an empty message: what follows it goes unread, as before)
    except OSError:
        pass
