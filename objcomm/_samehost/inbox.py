"""The receiving side of the same-host channel (:mod:`objcomm._samehost.channel`): reads shared between threads,
a bounded stash, and the checks every message passes.

Several threads may wait on one channel at once: the caller's collectives, and ``send``/``recv`` on
``isend``/``irecv`` lanes under different peers and tags. Each socket has at most one reader at a
time: a waiting thread claims the sockets of the peers it waits for that nobody reads, reads them
(one blocking ``recv`` when it is one socket, else ``poll``) and files every message under its
peer and key (a collective's sequence number, or a point-to-point tag); threads waiting for a
socket another thread reads sleep on a condition until that thread files something or lets go.
A receive from any rank (``first``) also polls an eventfd, so that a message another thread files
for it wakes it. When no other thread waits (the common case) a call takes leaner paths to the same
result: it reads its sources itself and keeps the message it wants without filing it (one blocking
``recv`` for one source; for a collective over every peer, the ``poll`` registered at set-up), and
polls without sleeping for up to the call's spin first (:func:`poll_briefly`).
Messages wait in the stash until a call asks for them; it holds at most ``stash_bytes`` (payload
plus :data:`ENTRY_OVERHEAD` per message and :data:`KEY_OVERHEAD` per key with messages waiting,
about what Python takes for them), beyond which the channel fails: a peer that runs that far
ahead of this rank, or floods it, cannot grow its memory without bound.

Flow control: a sender never makes a receiver fail. Each message of a collective (a root or a gather's sender
may run ahead of its receivers) and of send/recv (a slot, a rest) costs its sender credit at that receiver: its
length plus :data:`ENTRY_OVERHEAD` and :data:`KEY_OVERHEAD`, what the stash would count for it. Per peer and
class (collectives, point to point) a sender has :func:`window_for` bytes of credit (8 MiB up to four ranks); a
send that would pass it waits, reading the receiver's socket, until the receiver has taken enough of what came
before: a receiver that hands messages to its calls (or drops them, :meth:`Inbox.abandon`) tells the sender its
running totals in a ``CREDIT`` message once they grew by a quarter of the window since it last told them. The two
classes keep apart so that sends nobody received yet never hold up a collective. So an honest sender that runs
ahead is slowed down to its receiver's pace, and the stash, sized to hold every peer's two windows, never fills
from honest peers; a peer that ignores its credit fills it and fails the channel as before. Answers and
``CREDIT`` messages take no credit: a sender waits for an answer before it sends more under that message, so
there are never more of them than sends in flight.

Every message is checked on arrival, before it is filed, and any violation fails the channel with
a :class:`~objcomm.CommunicationError` naming the peer (the channel then closes, so the others
raise too): a datagram shorter than the header (an empty one is told apart from EOF) or longer than
a message may be (``MSG_TRUNC`` gives its real length; nothing of that size is allocated), an unknown
kind, unknown flag bits, a collective message that carries a tag, a point-to-point message that
carries flags or a negative tag, and a collective sequence number that does not move
forward: at or before the last collective this rank finished, or not after the peer's previous one.
Point-to-point messages carry a message id where collectives carry their sequence number: a send's
slot (taken by tag, in order) tells the receiver its id, and the receiver's answer and the rest of
the send (:mod:`objcomm._samehost.channel_rounds`) travel under ``(tag, kind, id)``, so that concurrent sends
under one tag never take each other's (shared memory's words, at or above its threshold, go under the
id too). After a wait for one of those timed out, later ones under its key are
dropped on arrival (:meth:`Inbox.abandon`).
A waiter for collective ``s`` from a peer whose later collective already arrived fails at once (the
peer called a different operation). A wait past the timeout fails the channel in a collective (the
others wait in the same call); a recv that times out raises and leaves it open. The sender and the
length are the kernel's (the socket it came on, the datagram's size), not the header's, so they
cannot lie.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, NoReturn, Optional, Sequence, Set, Tuple

from objcomm._errors import CommunicationError

HEADER = struct.Struct("<BB2xIi")  # kind, flags, collective sequence number or message id, tag
ALL_GATHER, BROADCAST, SCATTER, ALL_TO_ALL, P2P = 1, 2, 3, 4, 5
ANSWER, REST = 6, 7  # of a send's message (its id): the receiver's answer, and the bytes after the slot
GATHER = 8
CREDIT = 10  # the receiver's running totals of what it took, per class (see "Flow control")
# a collective: a digest of what this rank read in round 1 (objcomm._samehost.channel_slots.SameHostSlots.agree)
ECHO = 11
NAMES = {ALL_GATHER: "all_gather", BROADCAST: "broadcast", SCATTER: "scatter", ALL_TO_ALL: "all_to_all", P2P: "send",
         ANSWER: "recv", REST: "send", GATHER: "gather", CREDIT: "credit", ECHO: "echo"}
_POINT_TO_POINT = (P2P, ANSWER, REST)
COLLECTIVES, POINT_TO_POINT = 0, 1  # the two classes of messages that take credit (ANSWER and CREDIT take none)
CLASS_OF = {ALL_GATHER: COLLECTIVES, BROADCAST: COLLECTIVES, SCATTER: COLLECTIVES, ALL_TO_ALL: COLLECTIVES,
            GATHER: COLLECTIVES, ECHO: COLLECTIVES, P2P: POINT_TO_POINT, REST: POINT_TO_POINT}
ENTRY_OVERHEAD = 256  # bytes a stashed message is counted for besides its payload
KEY_OVERHEAD = 768  # and a key (a tag, a sequence number) that has messages waiting: its queue and dict slot
STASH_BYTES = 64 << 20  # the most one channel keeps for calls not yet made (up to 30 peers: see stash_for)
WINDOW_BYTES = 8 << 20  # the most credit one peer gets for one class (up to 4 peers; less with more)
MIN_WINDOW = 1 << 20  # and the least: a quarter of it, when credit is granted back, holds the largest message
RESERVE = 4 << 20  # the stash's room for what takes no credit (answers, keys) besides the windows
_CREDIT = struct.Struct("<qq")  # CREDIT's payload: what the receiver took of each class, in credit bytes, since set-up
RECV_SLACK = 0.25  # seconds a blocking recv (SO_RCVTIMEO: the whole timeout) may outlast a call's deadline
MASK = 0xFFFFFFFF
# (True, sequence number) of a collective, (False, tag) of a send's slot, (False, tag, kind, id) of its answer and rest
Key = Tuple[Any, ...]
Entry = Tuple[int, int, bytes]  # kind, flags (a send's slot: its message id), payload
Fail = Callable[..., NoReturn]  # (op, why, cause=None): close the channel and raise


def window_for(peers: int) -> int:
    """A sender's credit per class at one receiver of a channel of ``peers`` other ranks (see "Flow control")."""
    return max(MIN_WINDOW, min(WINDOW_BYTES, (STASH_BYTES - RESERVE) // (2 * max(peers, 1))))


def stash_for(peers: int) -> int:
    """The stash a receiver needs so that every peer's two windows fit, with :data:`RESERVE` to spare."""
    return max(STASH_BYTES, 2 * peers * window_for(peers) + RESERVE)


def credit_cost(data_bytes: int) -> int:
    """What a message of ``data_bytes`` costs its sender's credit: what the receiver's stash counts for it at most."""
    return data_bytes + ENTRY_OVERHEAD + KEY_OVERHEAD


def after(a: int, b: int) -> bool:
    """Whether sequence number ``a`` comes after ``b`` (32 bits, wrapping)."""
    return a != b and (a - b) & MASK < 1 << 31


class Inbox:
    """What has arrived on one channel's sockets and who is reading them (see the module docstring)."""

    def __init__(self, peers: Dict[int, socket.socket], pids: Sequence[int], timeout: float, largest: int,
                 fail: Fail, stash_bytes: Optional[int] = None, yielding: bool = False) -> None:
        self.timeout = timeout
        self.yielding = yielding  # a polling wait yields the CPU between polls (see poll_briefly)
        self.done = 0  # sequence number of the last collective this rank finished
        self.closed: Optional[str] = None  # why the channel closed, once it has
        self.gone: Dict[int, str] = {}  # peers whose connection ended: why
        self._lock = threading.RLock()
        self.cond = threading.Condition(self._lock)  # guards everything below
        self._peers = peers
        self._pids = pids
        self._fail = fail
        self._limit = stash_for(len(peers)) if stash_bytes is None else stash_bytes
        self.window = window_for(len(peers))
        # flow control, per peer and class: credit bytes this rank sent it, and what it said it took of them;
        # what this rank took of the peer's, and what it last told the peer (see "Flow control")
        self._sent = {r: [0, 0] for r in peers}
        self._credit = {r: [0, 0] for r in peers}
        self._taken = {r: [0, 0] for r in peers}
        self._told = {r: [0, 0] for r in peers}
        self._owing: Set[int] = set()  # peers whose totals grew by a quarter of the window since they were told
        self._size = HEADER.size + largest
        self._buffers = {r: bytearray(self._size) for r in peers}  # one reader per socket: one buffer each
        self._stash: Dict[int, Dict[Key, Deque[Entry]]] = {r: {} for r in peers}
        self._abandoned: Dict[int, Set[Key]] = {r: set() for r in peers}  # keys nobody will take: dropped on arrival
        self._stashed = 0
        self.peak = 0  # the most the stash held
        self._last: Dict[int, int] = {}  # peer -> sequence number of its latest collective message
        self._readers: Dict[int, int] = {}  # peer -> thread reading its socket
        self._wakes: Dict[int, int] = {}  # thread -> eventfd, for receivers from any rank that poll
        self._waiting = 0
        self._poll_all = select.poll()  # every live peer's socket, for a collective read by one thread
        self._poll_one: Dict[int, Any] = {}  # peer -> a poll of its socket alone, for spinning
        for peer, sock in peers.items():
            self._poll_all.register(sock.fileno(), select.POLLIN)
            self._poll_one[peer] = one = select.poll()
            one.register(sock.fileno(), select.POLLIN)

    # -- waiting ---------------------------------------------------------------------------------
    def take(self, sources: Sequence[int], key: Key, kind: int, op: str,
             first: bool = False, spin: float = 0.0) -> Tuple[Dict[int, bytes], int]:
        """One message under ``key`` from each of ``sources`` (``first``: from whichever has one first),
        and the AND of their flags (a send's slot: its message id; collectives carry none).
        ``spin``: seconds a wait polls before it sleeps in the kernel, over the whole call (the lean paths; see
        :func:`poll_briefly`)."""
        deadline = time.monotonic() + self.timeout  # before any wait: a lean path that timed out used it up
        spin_until = time.perf_counter() + spin if spin > 0 else 0.0
        lock = self._lock
        lock.acquire()  # self.cond, without its __enter__ and __exit__ (Python functions): a small call pays for them
        try:
            if not self._waiting and self.closed is None:  # no other thread waits: the lean paths
                if len(sources) == 1:
                    fast = self._alone(sources[0], key, kind, op, spin_until)
                    if fast is not None:
                        return fast
                elif not first and not any(p in self._readers or p in self.gone for p in sources):
                    got, ready, pending = self._together(sources, key, kind, op, deadline, spin_until)
                    if not pending:
                        return got, ready
                    return self._take(pending, key, kind, op, first, deadline, got, ready)
            return self._take(sources, key, kind, op, first, deadline)
        finally:
            lock.release()

    def _together(self, sources: Sequence[int], key: Key, kind: int, op: str,
                  deadline: float, spin_until: float) -> Tuple[Dict[int, bytes], int, List[int]]:
        """One thread and several sources nobody else reads (a collective at W > 2): take what the stash
        holds, read the rest, taking the messages wanted directly and filing the others; ``(got, ready,
        pending)``, pending non-empty when it stopped early (EOF, the deadline: the general path says why).
        When the sources are every live peer, the poll registered once at set-up serves (a peer done with this
        call keeps being read: what it sends next is filed)."""
        me = threading.get_ident()
        got: Dict[int, bytes] = {}
        ready, pending = -1, []
        for peer in sources:
            entry = self._pop(peer, key)
            if entry is None:
                pending.append(peer)
                continue
            if entry[0] != kind:
                self._fail(op, f"rank {peer} called {NAMES[entry[0]]} instead")
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
                for peer, length in arrived:
                    parsed = self._parse(peer, length, op) if length != -3 else None
                    if parsed is None:
                        if peer in self.gone:
                            with contextlib.suppress(KeyError, ValueError):
                                self._poll_all.unregister(self._peers[peer].fileno())
                            if peer in pending:
                                return got, ready, pending
                        continue
                    if parsed[0] != key or peer not in pending:
                        self._put(peer, *parsed, op)
                        if peer in pending and parsed[0][0] and after(parsed[0][1], key[1]):  # a later collective
                            self._fail(op, f"rank {peer} sent collective #{parsed[0][1]} but not #{key[1]}: it "
                                           "called a different operation")
                    else:
                        their_kind, flags, data = parsed[1]
                        if their_kind != kind:
                            self._fail(op, f"rank {peer} called {NAMES[their_kind]} instead")
                        self._took(peer, kind, len(data))
                        got[peer] = data
                        ready &= flags
                        pending.remove(peer)
                        if not everyone:
                            poll.unregister(self._peers[peer].fileno())
                            del self._readers[peer]
                    if self._waiting:  # a thread came meanwhile: it may want what was filed, or the socket
                        self._notify()
            return got, ready, pending
        finally:
            for peer in mine:
                if self._readers.get(peer) == me:
                    del self._readers[peer]
            if self._waiting:
                self._notify()

    def _alone(self, peer: int, key: Key, kind: int, op: str,
               spin_until: float) -> Optional[Tuple[Dict[int, bytes], int]]:
        """The common case, one thread and one source: read its socket once; the message, if it is the one
        wanted (nothing filed), else None (anything read is filed)."""
        if peer in self._readers or self._stash[peer] or peer in self.gone:  # read by another thread, or filed
            return None
        self._readers[peer] = threading.get_ident()
        lock = self._lock
        lock.release()
        try:
            if spin_until:
                poll = self._poll_one[peer]
                if not poll.poll(0):  # not there yet: spin
                    poll_briefly(poll, spin_until, self.yielding)
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
            self._fail(op, f"rank {peer} called {NAMES[their_kind]} instead")
        self._took(peer, kind, len(data))
        return {peer: data}, flags

    def _take(self, sources: Sequence[int], key: Key, kind: int, op: str, first: bool, deadline: float,
              got: Optional[Dict[int, bytes]] = None, ready: int = -1) -> Tuple[Dict[int, bytes], int]:
        """The general path: any number of threads; ``got``/``ready``: what a lean path already took."""
        got = {} if got is None else got
        pending = list(sources)
        me = threading.get_ident()
        mine: List[int] = []
        wake = -1
        self._waiting += 1
        try:
            while True:
                if self.closed is not None:
                    self._fail(op, self.closed)
                for peer in list(pending):
                    entry = self._pop(peer, key)
                    if entry is not None:
                        their_kind, flags, data = entry
                        if their_kind != kind:
                            self._fail(op, f"rank {peer} called {NAMES[their_kind]} instead")
                        got[peer] = data
                        ready &= flags
                        pending.remove(peer)
                        if first:
                            return got, ready
                    elif peer in self.gone:
                        self._fail(op, self.gone[peer])
                    elif key[0] and peer in self._last and after(self._last[peer], key[1]):
                        self._fail(op, f"rank {peer} sent collective #{self._last[peer]} but not #{key[1]}: "
                                       "it called a different operation")
                if not pending:
                    return got, ready
                if any(p not in pending for p in mine):  # let others read what this thread no longer needs
                    mine = [p for p in mine if p in pending]
                    self._release(me, pending)
                for peer in pending:
                    if peer not in self._readers:
                        self._readers[peer] = me
                        mine.append(peer)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    why = f"no message from rank(s) {pending} within the timeout of {self.timeout:.0f}s"
                    if key[0]:  # the others wait in the same collective: close, so that they learn at once
                        self._fail(op, why)
                    raise CommunicationError(f"{op} over the local channel: {why}; the channel stays open")
                if not mine:  # another thread reads every socket this one waits on: it files and notifies
                    self.cond.wait(remaining)
                    continue
                if first and len(mine) < len(pending) and wake < 0:
                    wake = self._wakes[me] = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                self._read_and_file(mine, wake, remaining, op)
        finally:
            self._waiting -= 1
            self._release(me, ())
            if wake >= 0:
                del self._wakes[me]
                os.close(wake)

    def _pop(self, peer: int, key: Key) -> Optional[Entry]:
        queue = self._stash[peer].get(key)
        if not queue:
            return None
        entry = queue.popleft()
        if not queue:
            del self._stash[peer][key]
            self._stashed -= KEY_OVERHEAD
        self._stashed -= len(entry[2]) + ENTRY_OVERHEAD
        self._took(peer, entry[0], len(entry[2]))
        return entry

    def _release(self, me: int, keep: Sequence[int]) -> None:
        """Stop reading the sockets this thread claimed, but those of ``keep``; wake whoever waits for them."""
        let_go = [p for p, reader in self._readers.items() if reader == me and p not in keep]
        for peer in let_go:
            del self._readers[peer]
        if let_go and self._waiting > 1:
            self._notify()

    def _notify(self) -> None:
        self.cond.notify_all()
        for fd in self._wakes.values():
            os.eventfd_write(fd, 1)

    # -- reading (without the lock: this thread alone reads these sockets) ----------------------------
    def _read_and_file(self, mine: List[int], wake: int, remaining: float, op: str) -> None:
        """Called holding the lock: :meth:`_read` from ``mine`` without it, then file what came and wake the other
        waiting threads (what came may be theirs)."""
        self.cond.release()
        try:
            arrived = self._read(mine, wake, remaining)
        finally:
            self.cond.acquire()
        for peer, length in arrived:
            self._file(peer, length, op)
        if arrived and self._waiting > 1:
            self._notify()

    def _read(self, mine: List[int], wake: int, remaining: float) -> List[Tuple[int, int]]:
        """Receive at least one message (or EOF) from the sockets of ``mine``, unless woken or timed out:
        ``[(peer, datagram length, or -1 at EOF / -2 for an empty datagram)]``."""
        if len(mine) == 1 and wake < 0:  # one recv: no poll while the whole timeout is left, one wake-up
            length = self._recv_by(mine[0], time.monotonic() + remaining)
            return [] if length == -3 else [(mine[0], length)]  # -3: the caller's deadline came
        poll = select.poll()
        fds = {self._peers[p].fileno(): p for p in mine}
        for fd in fds:
            poll.register(fd, select.POLLIN)
        if wake >= 0:
            poll.register(wake, select.POLLIN)
        arrived = []
        for fd, _ in poll.poll(remaining * 1000):
            if fd == wake:
                try:
                    os.eventfd_read(wake)
                except BlockingIOError:
                    pass
            elif fd in fds:
                arrived.append((fds[fd], self._recv(fds[fd], block=False)))
        return [(p, n) for p, n in arrived if n != -3]  # -3: nothing to read after all

    def _recv_by(self, peer: int, deadline: float) -> int:
        """:meth:`_recv` from ``peer``'s socket, waiting until ``deadline`` at most (-3: nothing came by then).

        A blocking ``recv`` (one system call) while about the whole timeout is left, since ``SO_RCVTIMEO``
        bounds it by the timeout; with less left, ``poll`` first: a wait that began after others in the
        same call must not add a whole timeout to theirs."""
        remaining = deadline - time.monotonic()
        if remaining > self.timeout - RECV_SLACK:
            return self._recv(peer, block=True)
        if remaining <= 0 or not self._poll_one[peer].poll(remaining * 1000):
            return -3
        return self._recv(peer, block=False)

    def _recv(self, peer: int, block: bool, reset: bool = False) -> int:
        sock = self._peers[peer]
        try:
            length = sock.recv_into(self._buffers[peer], self._size, _TRUNC if block else _TRUNC | _DONTWAIT)
        except BlockingIOError:
            return -1 if reset else -3
        except ConnectionResetError:
            # The peer closed while messages of this rank's lay unread in its queue (credits it had no more use
            # for): Linux says so once, ahead of what the peer sent before it closed, which is still queued here.
            return -1 if reset else self._recv(peer, block=False, reset=True)
        except OSError:
            return -1  # closed under us
        if length:
            return length
        try:  # 0: EOF, or an empty datagram (then the socket still works, and may hold more)
            peeked = sock.recv(1, _PEEK | _DONTWAIT)
        except BlockingIOError:
            return -2
        except OSError:
            return -1
        return -2 if peeked else -1

    # -- filing (under the lock) ------------------------------------------------------------------
    def _file(self, peer: int, length: int, op: str) -> None:
        """Check the message ``peer`` sent and put it in the stash, or note EOF."""
        parsed = self._parse(peer, length, op)
        if parsed is not None:
            self._put(peer, *parsed, op)

    def _parse(self, peer: int, length: int, op: str) -> Optional[Tuple[Key, Entry]]:
        """The key and entry of the message in ``peer``'s buffer, checked (see the module docstring); None at EOF."""
        if length == -1:
            if peer not in self.gone:
                self.gone[peer] = f"{self._who(peer)} closed its connection: it died, or failed and closed the channel"
            return None
        if length < HEADER.size:  # -2: an empty datagram
            self._fail(op, f"{self._who(peer)} sent a {max(length, 0)}-byte message, shorter than the "
                           f"{HEADER.size}-byte header: a protocol error")
        if length > self._size:
            self._fail(op, f"{self._who(peer)} sent a {length:,}-byte message, above the {self._size:,} bytes a "
                           "message may have: a protocol error")
        kind, flags, seq, tag = HEADER.unpack_from(self._buffers[peer])
        if kind == CREDIT:
            if flags or seq or tag or length != HEADER.size + _CREDIT.size:
                self._fail(op, f"{self._who(peer)} sent a {length}-byte credit message with a bad header (flags "
                               f"{flags}, #{seq}, tag {tag}): a protocol error")
            credit = self._credit[peer]  # running totals: a late or repeated one changes nothing
            for cls, total in enumerate(_CREDIT.unpack_from(self._buffers[peer], HEADER.size)):
                credit[cls] = max(credit[cls], total)  # a receiver that lies lets this rank run ahead of itself alone
            self.cond.notify_all()  # a sender waiting for credit while another thread reads this socket
            return None
        if kind in _POINT_TO_POINT:
            if flags or tag < 0:
                self._fail(op, f"{self._who(peer)} sent a point-to-point message with a bad header (flags {flags}, "
                               f"tag {tag}): a protocol error")
            if kind == P2P:  # a slot: keyed by its tag alone (a recv takes the next one), its id as its flags
                return (False, tag), (kind, seq, bytes(memoryview(self._buffers[peer])[HEADER.size : length]))
            key: Key = (False, tag, kind, seq)
        elif kind in NAMES:
            last = self._last.get(peer)
            if tag or flags or not after(seq, self.done) or (last is not None and not after(seq, last)):
                self._fail(op, f"{self._who(peer)} sent a {NAMES[kind]} message with a bad header (collective "
                               f"#{seq} after #{last} and with #{self.done} finished here, tag {tag}, flags {flags}): "
                               "a duplicate or stale message (did the ranks call different collectives, or broadcast "
                               "or scatter with different src?), or a protocol error")
            self._last[peer] = seq
            key = (True, seq)
        else:
            self._fail(op, f"{self._who(peer)} sent a message of unknown kind {kind}: a protocol error")
        return key, (kind, flags, bytes(memoryview(self._buffers[peer])[HEADER.size : length]))

    # -- flow control (see "Flow control" in the module docstring) ------------------------------------
    def reserve(self, peer: int, kind: int, data_bytes: int, op: str, flush: Callable[[], None]) -> None:
        """Take the credit a ``kind`` message of ``data_bytes`` to ``peer`` costs, first waiting (reading ``peer``'s
        socket, or while another thread reads it) until ``peer`` has taken enough of what this rank sent it before.
        ``flush``: sends the credit this rank owes (called while it waits, so that two ranks waiting for each other
        tell each other). Past the timeout it raises; in a collective it fails the channel (the others wait in it)."""
        cls = CLASS_OF.get(kind)
        if cls is None:
            return
        cost = credit_cost(data_bytes)
        with self.cond:
            if not self._allowed(peer, cls, cost):
                self._await_credit(peer, cls, cost, op, flush, kind != P2P and kind != REST)
            self._sent[peer][cls] += cost

    def _allowed(self, peer: int, cls: int, cost: int) -> bool:
        outstanding = self._sent[peer][cls] - self._credit[peer][cls]
        return outstanding <= 0 or outstanding + cost <= self.window  # one message always goes when none is out

    def _await_credit(self, peer: int, cls: int, cost: int, op: str, flush: Callable[[], None],
                      collective: bool) -> None:
        me = threading.get_ident()
        deadline = time.monotonic() + self.timeout
        mine = False
        flushed = False  # what this rank owes was offered since the last wake-up (a peer whose queue is full keeps
        self._waiting += 1  # it owed: offered again after the next wake-up, never in a loop that waits for nothing)
        try:
            while not self._allowed(peer, cls, cost):
                if self.closed is not None:
                    self._fail(op, self.closed)
                if peer in self.gone:
                    self._fail(op, self.gone[peer])
                if self._owing and not flushed:
                    self.cond.release()
                    try:
                        flush()
                    finally:
                        self.cond.acquire()
                    flushed = True
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    why = (f"{self._who(peer)} took none of the {self.window:,} bytes this rank sent it ahead within "
                           f"the timeout of {self.timeout:.0f}s (a sender waits for its receiver to take what it sent)")
                    if collective:
                        self._fail(op, why)
                    raise CommunicationError(f"{op} over the local channel: {why}; the channel stays open")
                if not mine and peer not in self._readers:
                    self._readers[peer] = me
                    mine = True
                flushed = False
                if not mine:  # another thread reads the socket: it files the credit and notifies
                    self.cond.wait(remaining)
                    continue
                self._read_and_file([peer], -1, remaining, op)
        finally:
            self._waiting -= 1
            if mine:
                self._release(me, ())

    def _took(self, peer: int, kind: int, data_bytes: int) -> None:
        """A ``kind`` message from ``peer`` left this rank's hands (taken by a call, or dropped): count its credit."""
        cls = CLASS_OF.get(kind)
        if cls is None:
            return
        taken = self._taken[peer]
        taken[cls] += credit_cost(data_bytes)
        if taken[cls] - self._told[peer][cls] >= self.window >> 2:
            self._owing.add(peer)

    @property
    def owing(self) -> bool:
        """Whether some peer is owed a ``CREDIT`` message (:meth:`grants`)."""
        return bool(self._owing)

    def grants(self) -> List[Tuple[int, bytes]]:
        """The ``CREDIT`` payloads owed, ``(peer, payload)``, counted as told; one that could not be sent goes back
        with :meth:`owe`."""
        with self.cond:
            out = []
            for peer in self._owing:
                self._told[peer] = list(self._taken[peer])
                out.append((peer, _CREDIT.pack(*self._taken[peer])))
            self._owing.clear()
            return out

    def owe(self, peer: int) -> None:
        """The ``CREDIT`` message for ``peer`` could not be sent now (its queue is full): send it at the next call."""
        with self.cond:
            self._owing.add(peer)

    def abandon(self, peer: int, key: Key) -> None:
        """Nobody will take ``peer``'s messages under ``key`` (a wait for them timed out): drop those stashed, and
        those that come later on arrival, so that a late peer cannot fill the stash with them."""
        with self.cond:
            self._abandoned[peer].add(key)
            while self._pop(peer, key) is not None:
                pass

    def _put(self, peer: int, key: Key, entry: Entry, op: str) -> None:
        if key in self._abandoned[peer]:
            self._took(peer, entry[0], len(entry[2]))  # dropped: its sender may send as much again
            return
        queues = self._stash[peer]
        size = len(entry[2]) + ENTRY_OVERHEAD + (0 if key in queues else KEY_OVERHEAD)
        if self._stashed + size > self._limit:
            self._fail(op, f"{self._who(peer)} sent more than this rank has asked for: the stash of messages for "
                           f"calls not yet made would pass {self._limit:,} bytes. A rank that far ahead, or flooding "
                           "the channel")
        self._stashed += size
        if self._stashed > self.peak:
            self.peak = self._stashed
        queues.setdefault(key, deque()).append(entry)

    def _who(self, peer: int) -> str:
        return f"rank {peer} (pid {self._pids[peer]})"


def poll_briefly(poll: Any, until: float, yielding: bool = False) -> bool:
    """Poll ``poll`` without sleeping until ``time.perf_counter()`` reaches ``until``; whether something arrived.

    A rank that sleeps in the kernel is woken by the peer's send, which on this machine's virtual CPUs
    costs ~50 µs a hop (a blocking round trip through a socket pair: ~106 µs; polling: ~6 µs). Waits
    shorter than the spin skip it; longer ones sleep after it, so the CPU a waiting rank spends is
    bounded by the spin, once per call. ``yielding`` (where the group's ranks outnumber the CPUs:
    :func:`objcomm._samehost.channel.yields`): ``sched_yield`` between polls, so that a peer that needs this CPU
    gets it (a rank polling on a CPU its peer needs delays that very peer).
    """
    if yielding:
        while not poll.poll(0):
            if time.perf_counter() >= until:
                return False
            os.sched_yield()
        return True
    while not poll.poll(0):
        if time.perf_counter() >= until:
            return False
    return True


_DONTWAIT = int(socket.MSG_DONTWAIT)  # ints: an enum.IntFlag's | costs more than the recv's bookkeeping
_TRUNC = int(socket.MSG_TRUNC)
_PEEK = int(socket.MSG_PEEK)
