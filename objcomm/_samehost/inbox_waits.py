"""The waits of the same-host channel's receiving side (:mod:`objcomm._samehost.inbox`): :class:`Inbox`, on which
any number of threads take messages and wait for credit at once.

Several threads may wait on one channel at once: the caller's collectives, and ``send``/``recv`` on
``isend``/``irecv`` lanes under different peers and tags. Each socket has at most one reader at a time: a waiting
thread claims the sockets of the peers it waits for that nobody reads, reads them (one blocking ``recv`` when it is
one socket, else ``poll``) and files every message under its peer and key (a collective's sequence number, or a
point-to-point tag); threads waiting for a socket another thread reads sleep on a condition until that thread files
something or lets go. A thread that reads only some of the sockets it waits for also polls an eventfd, so that a
message another thread files for it, or a socket let go, wakes it. Every thread that waits counts itself in
``_waiting``, and lets its sockets go before it stops counting. When no other thread waits (the common case) a call
takes leaner paths to the same result: it reads its sources itself and keeps the message it wants without filing it
(one blocking ``recv`` for one source; for a collective over every peer, the ``poll`` registered at set-up until one
peer is left, whose socket it then reads alone), and polls up to the call's spin first (:func:`poll_briefly`).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from typing import Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

from objcomm._errors import NOT_THERE, CommunicationError
from objcomm._samehost.credit import MESSAGE_COST, credit_cost, unreceived
from objcomm._samehost.inbox import CLASS_OF, CREDIT, HEADER, NAMES, P2P, REST, Key, Stash, after
from objcomm._samehost.polling import poll_briefly
from objcomm._transport import call_clock, call_words
from objcomm._transport.any_source import OwnMessage
from objcomm._transport.call_clock import CLOCK as CALL_CLOCK

SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL  # every send on the channel's sockets: never blocks
CREDIT_RETRY = 0.01  # seconds between offers of a CREDIT that bounced, while this rank waits
TAKE_IN_MOST = 256  # messages take_in files from one peer at a time (then the send tries again)
_CREDIT_HEADER = HEADER.pack(CREDIT, 0, 0, 0)


class Inbox(Stash):
    """What has arrived on one channel's sockets and who is reading them (see :mod:`objcomm._samehost.inbox`), and the
    waits of the threads that take messages (:meth:`take`) and of the senders that wait for credit (:meth:`reserve`)."""

    # -- waiting ---------------------------------------------------------------------------------
    def take(
        self,
        sources: Sequence[int],
        key: Key,
        kind: int,
        op: str,
        first: bool = False,
        spin: float = 0.0,
        watch: Optional[Callable[[], bool]] = None,
    ) -> Tuple[Dict[int, bytes], int]:
        """One message under ``key`` from each of ``sources`` (``first``: from whichever has one first),
        and the AND of their flags (a send's slot: its message id; collectives carry none).
        ``spin``: seconds a wait polls before it sleeps in the kernel, over the whole call (the lean paths; see
        :func:`poll_briefly`). ``watch``: a receive from any rank raises :class:`OwnMessage` once ``watch()`` is
        true, nothing taken (:mod:`objcomm._transport.any_source`; :meth:`wake` wakes it)."""
        now = time.monotonic()  # (before any wait: a lean path that timed out used the deadline up)
        # after a collective's round 1 its waits share one timeout (objcomm._transport.call_clock; a send/recv's keep
        # their own: a wait that ran out leaves the channel open); the lean path of one source blocks for a whole
        # timeout, so it is taken only while more than half of the call's is left
        started = CALL_CLOCK.get() if key[0] else None  # (call_clock.until, inline where no clock runs: a small call)
        deadline = now + self.timeout if started is None else call_clock.until(now, self.timeout)
        spin_until = time.perf_counter() + spin if spin > 0 else 0.0
        lock = self._lock
        lock.acquire()  # self.cond, without its __enter__ and __exit__ (Python functions): a small call pays for them
        try:
            if not self._waiting and self.closed is None and not self._bounced:  # none waits: the lean paths
                if len(sources) == 1:
                    if started is None or deadline - now > self.timeout / 2:  # (a timeout of its own: all of it)
                        fast = self._alone(sources[0], key, kind, op, spin_until, watch)
                        if fast is not None:
                            return fast
                elif not first and not any(p in self._readers or p in self.gone for p in sources):
                    got, ready, pending = self._together(sources, key, kind, op, deadline, spin_until)
                    if not pending:
                        return got, ready
                    return self._take(
                        pending, key, kind, op, first, deadline, got, ready, deadline < now + self.timeout
                    )
            return self._take(sources, key, kind, op, first, deadline, cut=deadline < now + self.timeout, watch=watch)
        finally:
            lock.release()

    def wake(self) -> None:
        """Wake every thread waiting here: a receive from any rank looks at its ``watch`` again (:meth:`take`)."""
        with self.cond:
            self._notify()

    def _together(
        self, sources: Sequence[int], key: Key, kind: int, op: str, deadline: float, spin_until: float
    ) -> Tuple[Dict[int, bytes], int, List[int]]:
        """One thread and several sources nobody else reads (a collective at W > 2): take what the stash
        holds, read the rest, taking the messages wanted directly and filing the others; ``(got, ready,
        pending)``, pending non-empty when it stopped early (EOF, the deadline: the general path says why).
        When the sources are every live peer, the poll registered once at set-up serves (a peer done with this
        call keeps being read: what it sends next is filed) until one peer is left: then this thread lets the others'
        sockets go, for any thread that wants them, and reads the last one alone."""
        me = threading.get_ident()
        got: Dict[int, bytes] = {}
        ready, pending = -1, []
        for peer in sources:
            entry = self._pop(peer, key)
            if entry is None:
                pending.append(peer)
                continue
            if entry[0] != kind:
                self._fail(op, call_words.other_call(peer, entry[0], kind, NAMES))
            got[peer] = entry[2]
            ready &= entry[1]
        if not pending:
            return got, ready, pending
        everyone = len(sources) == len(self._peers)  # none gone: checked by the caller
        mine = list(sources) if everyone else list(pending)
        fds = {self._peers[p].fileno(): p for p in mine}
        poll = self._poll_all if everyone else select.poll()
        for fd, peer in fds.items():
            self._readers[peer] = me
            if not everyone:
                poll.register(fd, select.POLLIN)
        try:
            while pending and time.monotonic() < deadline:
                if len(pending) == 1 and len(mine) > 1:  # a thread may want the others' sockets meanwhile
                    self._release(me, pending, counted=False)
                    mine = list(pending)
                self.cond.release()
                try:
                    if len(pending) == 1:  # one recv, no poll while the whole timeout is left
                        if spin_until:
                            poll_briefly(self._poll_one[pending[0]], spin_until, self.yielding)
                        arrived = [(pending[0], self._recv_by(pending[0], deadline))]
                    else:
                        if spin_until:
                            poll_briefly(poll, spin_until, self.yielding)
                        events = poll.poll((deadline - time.monotonic()) * 1000)
                        arrived = [(fds[fd], self._recv(fds[fd], block=False)) for fd, _ in events]
                finally:
                    self.cond.acquire()
                lost = False  # a pending peer's connection ended: the general path says so, once what came is filed
                for peer, length in arrived:
                    parsed = self._parse(peer, length, op) if length != -3 else None
                    if parsed is None:
                        if peer in self.gone:
                            with contextlib.suppress(KeyError, ValueError):
                                self._poll_all.unregister(self._peers[peer].fileno())
                            lost = lost or peer in pending
                            if self._waiting:  # a thread waiting for that peer learns it is gone now
                                self._notify()
                        continue
                    if parsed[0] != key or peer not in pending:
                        self._put(peer, *parsed, op)
                        if peer in pending and parsed[0][0] and after(parsed[0][1], key[1]):  # a later collective
                            self._fail(
                                op,
                                f"rank {peer} sent collective #{parsed[0][1]} but not #{key[1]}: it "
                                "called a different operation",
                            )
                    else:
                        their_kind, flags, data = parsed[1]
                        if their_kind != kind:
                            self._fail(op, call_words.other_call(peer, their_kind, kind, NAMES))
                        self._took(peer, kind, len(data))
                        got[peer] = data
                        ready &= flags
                        pending.remove(peer)
                        if not everyone:
                            poll.unregister(self._peers[peer].fileno())
                            del self._readers[peer]
                    if self._waiting:  # a thread came meanwhile: it may want what was filed, or the socket
                        self._notify()
                if lost:
                    return got, ready, pending
            return got, ready, pending
        finally:
            for peer in mine:
                if self._readers.get(peer) == me:
                    del self._readers[peer]
            if self._waiting:
                self._notify()

    def _alone(
        self, peer: int, key: Key, kind: int, op: str, spin_until: float, watch: Optional[Callable[[], bool]] = None
    ) -> Optional[Tuple[Dict[int, bytes], int]]:
        """The common case, one thread and one source: read its socket once; the message, if it is the one
        wanted (nothing filed), else None (anything read is filed). With a ``watch`` (:meth:`take`), only what
        arrives within the spin: a longer wait takes the general path, which the watch can stop."""
        if peer in self._readers or self._stash[peer] or peer in self.gone:  # read by another thread, or filed
            return None
        self._readers[peer] = threading.get_ident()
        lock = self._lock
        lock.release()
        try:
            if spin_until:
                poll = self._poll_one[peer]
                if not poll.poll(0) and not poll_briefly(poll, spin_until, self.yielding) and watch is not None:
                    return None  # (nothing read: the general path waits, which the watch can stop)
            elif watch is not None and not self._poll_one[peer].poll(0):
                return None
            length = self._recv(peer, block=True)
        finally:
            lock.acquire()
            del self._readers[peer]
            if self._waiting:  # a thread came meanwhile, waiting for this socket
                self._notify()
        parsed = self._parse(peer, length, op) if length != -3 else None
        if parsed is None:
            return None
        if parsed[0] != key:
            self._put(peer, *parsed, op)
            return None
        their_kind, flags, data = parsed[1]
        if their_kind != kind:
            self._fail(op, call_words.other_call(peer, their_kind, kind, NAMES))
        self._took(peer, kind, len(data))
        return {peer: data}, flags

    def _take(
        self,
        sources: Sequence[int],
        key: Key,
        kind: int,
        op: str,
        first: bool,
        deadline: float,
        got: Optional[Dict[int, bytes]] = None,
        ready: int = -1,
        cut: bool = False,
        watch: Optional[Callable[[], bool]] = None,
    ) -> Tuple[Dict[int, bytes], int]:
        """The general path: any number of threads; ``got``/``ready``: what a lean path already took; ``cut``: the
        call's one timeout after its round 1 set ``deadline``; ``watch``: as :meth:`take`'s."""
        got = {} if got is None else got
        pending = list(sources)
        me = threading.get_ident()
        mine: List[int] = []
        wake = -1
        offer_at = 0.0  # when a CREDIT that bounced is offered again (see _offer_credit)
        self._waiting += 1
        try:
            while True:
                if self.closed is not None:
                    self._fail(op, self.closed)
                if watch is not None and watch():
                    raise OwnMessage()
                for peer in list(pending):
                    entry = self._pop(peer, key)
                    if entry is not None:
                        their_kind, flags, data = entry
                        if their_kind != kind:
                            self._fail(op, call_words.other_call(peer, their_kind, kind, NAMES))
                        got[peer] = data
                        ready &= flags
                        pending.remove(peer)
                        if first:
                            return got, ready
                    elif peer in self.gone:
                        if key[0] or peer not in self.left or len(pending) == 1:  # (1: every one left)
                            more = "" if len(sources) == 1 else "; every other rank had left before"
                            self.gone_from(
                                peer, op, key[0], f"{more}; nothing under tag {key[1]} was left for this rank"
                            )
                        pending.remove(peer)  # a send's slot from a peer that left: none comes from it any more
                    elif key[0] and peer in self._last and after(self._last[peer], key[1]):
                        self._fail(
                            op,
                            f"rank {peer} sent collective #{self._last[peer]} but not #{key[1]}: "
                            "it called a different operation",
                        )
                if not pending:
                    return got, ready
                if not key[0] and self.lending.total < self.lending.most and self.lend(pending):
                    self._offer_credit()  # their messages under other tags held the senders' credit: they send on
                    continue
                if any(p not in pending for p in mine):  # let others read what this thread no longer needs
                    mine = [p for p in mine if p in pending]
                    self._release(me, pending)
                for peer in pending:
                    if peer not in self._readers:
                        self._readers[peer] = me
                        mine.append(peer)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    why = f"no message from rank(s) {pending} within the timeout of {self.timeout:.0f}s" + (
                        ", counted for the call as a whole (its steps share one timeout after its round 1, two before)"
                        if cut
                        else ""
                    )
                    why += f" ({NOT_THERE})" if key[0] else unreceived(self.lending, pending, key[1], self._stash)
                    if key[0]:  # the others wait in the same collective: close, so that they learn at once
                        self._fail(op, why)
                    raise CommunicationError(
                        f"{op} over the local channel{self.ranks_note}: {why}; the channel stays open"
                    )
                if self.bounced:  # a CREDIT this rank owes could not leave: offer it again every CREDIT_RETRY
                    now = time.monotonic()
                    if now >= offer_at:
                        offer_at = now + CREDIT_RETRY
                        self._offer_credit()
                        continue  # the lock was let go: look again at what was filed meanwhile
                    remaining = min(remaining, offer_at - now)
                if not mine:  # another thread reads every socket this one waits on: it files and notifies
                    self.cond.wait(remaining)
                    continue
                if (len(mine) < len(pending) or watch is not None) and wake < 0:  # woken as another lets go, or watch
                    wake = self._wakes[me] = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                self._read_and_file(mine, wake, remaining, op)
        finally:  # release first: a thread that waits on these sockets is told while this one still counts
            self._release(me, ())
            self._waiting -= 1
            if wake >= 0:
                del self._wakes[me]
                os.close(wake)

    def gone_from(self, peer: int, op: str, collective: bool, more: str = "") -> NoReturn:
        """Raise for ``peer``, which has gone, in ``op``: where it left (its group destroyed) and ``op`` moves a
        send/recv's message, alone, the channel open to the others; else (a collective's, or a peer that died) the
        channel fails. ``more``: what the error adds, where it raises alone."""
        if collective or peer not in self.left:
            self._fail(op, self.gone[peer])
        raise CommunicationError(f"{op} over the local channel{self.ranks_note}: {self.gone[peer]}{more}")

    def take_in(self, op: str) -> None:
        """File what the peers sent this rank and no other thread reads now, without waiting: a send whose peer's
        queue is full calls it (:meth:`objcomm._samehost.mesh.Mesh._send`), so that two ranks that send each other
        many messages before either receives do not wait for each other (each one's queue full of the other's, and
        neither reading): a blocked send takes in what arrives, as an MPI send does. What is filed stays within what
        credit lets a peer send ahead."""
        with self.cond:
            took = False
            for peer in self._peers:
                for _ in range(TAKE_IN_MOST):
                    if peer in self._readers or peer in self.gone:
                        break
                    length = self._recv(peer, block=False)
                    if length == -3:  # nothing (more) there
                        break
                    self._file(peer, length, op)
                    took = True
            if took and self._waiting:
                self._notify()

    def unread(self) -> List[int]:
        """The sockets of the peers that no thread reads now and that have not gone (their file descriptors)."""
        with self.cond:
            return [s.fileno() for p, s in self._peers.items() if p not in self._readers and p not in self.gone]

    # -- flow control (see "Flow control" in the module docstring) ------------------------------------
    def grant(self) -> None:
        """Tell the peers owed credit what this rank took of theirs (``CREDIT``); never waits. A peer whose queue is
        full stays owed (:attr:`bounced`): every wait of this rank offers it again each :data:`CREDIT_RETRY` seconds
        (that peer may be waiting for this credit to send what this rank waits for)."""
        for peer, payload in self.grants():
            try:
                self._peers[peer].sendmsg([_CREDIT_HEADER, payload], [], SEND_FLAGS)
            except BlockingIOError:
                with self.cond:
                    self.owing.add(peer)
                    self._bounced.add(peer)
                continue
            except OSError:  # gone: found out by the next call
                pass
            if peer in self._bounced:
                with self.cond:
                    self._bounced.discard(peer)

    @property
    def bounced(self) -> bool:
        """Whether a ``CREDIT`` owed could not be sent (queue full) and has not left since: set also while another
        thread offers it again, so that a wait that looks meanwhile offers it too, never sleeping on it."""
        return bool(self._bounced)

    def _offer_credit(self) -> None:
        """Called holding the lock: offer what this rank owes (:meth:`grant`), the lock let go meanwhile (the caller
        looks again at what it waits for afterwards: another thread may have filed it)."""
        self.cond.release()
        try:
            self.grant()
        finally:
            self.cond.acquire()

    def reserve(self, peer: int, kind: int, data_bytes: int, op: str) -> None:
        """Take the credit a ``kind`` message of ``data_bytes`` to ``peer`` costs, first waiting (reading ``peer``'s
        socket, or while another thread reads it) until ``peer`` has taken enough of what this rank sent it before,
        and offering the credit this rank owes meanwhile (two ranks waiting for each other tell each other). Past
        the timeout it raises; in a collective it fails the channel (the others wait in it)."""
        cls = CLASS_OF.get(kind)
        if cls is None:
            return
        cost = data_bytes + MESSAGE_COST  # (credit_cost and below _allowed, inline: every small call sends)
        with self._lock:  # (self.cond's: its __enter__ and __exit__ are Python functions)
            sent = self._sent[peer]
            outstanding = sent[cls] - self._credit[peer][cls]
            if outstanding > 0 and outstanding + cost > self.window:
                self._await_credit(peer, cls, cost, op, kind != P2P and kind != REST)
            sent[cls] += cost
            if kind == P2P:  # counted as sent here, under the lock held already (a send that fails fails the channel)
                self.slots_sent += 1

    def _allowed(self, peer: int, cls: int, cost: int) -> bool:
        outstanding = self._sent[peer][cls] - self._credit[peer][cls]
        return outstanding <= 0 or outstanding + cost <= self.window  # one message always goes when none is out

    def _await_credit(self, peer: int, cls: int, cost: int, op: str, collective: bool) -> None:
        me = threading.get_ident()
        now = time.monotonic()
        deadline = call_clock.until(now, self.timeout, shared=collective)  # (as in take)
        mine = False
        flushed = False  # what this rank owes was offered since the last wake-up (a peer whose queue is full keeps
        self._waiting += 1  # it owed: offered again after the next wake-up, never in a loop that waits for nothing)
        try:
            while not self._allowed(peer, cls, cost):
                if self.closed is not None:
                    self._fail(op, self.closed)
                if peer in self.gone:
                    self.gone_from(peer, op, collective)
                if self.owing and not flushed:
                    self._offer_credit()
                    flushed = True
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    why = (
                        f"{self._who(peer)} took none of the {self.window:,} bytes this rank sent it ahead within "
                        f"the timeout of {self.timeout:.0f}s (a sender waits for its receiver to take what it "
                        "sent: does it receive? Two ranks that each send the other more than this before either "
                        "receives wait for each other: receive in between, or irecv first; a message counts its "
                        f"bytes and {credit_cost(0):,} more)"
                    )
                    if collective:
                        self._fail(op, why)
                    raise CommunicationError(
                        f"{op} over the local channel{self.ranks_note}: {why}; the channel stays open"
                    )
                if not mine and peer not in self._readers:
                    self._readers[peer] = me
                    mine = True
                flushed = False  # offered again after this wait, which a bounced CREDIT cuts short
                wait = min(remaining, CREDIT_RETRY) if self.bounced else remaining
                if not mine:  # another thread reads the socket: it files the credit and notifies
                    self.cond.wait(wait)
                    continue
                self._read_and_file([peer], -1, wait, op)
        finally:  # (as in _take: release, then stop counting)
            if mine:
                self._release(me, ())
            self._waiting -= 1
