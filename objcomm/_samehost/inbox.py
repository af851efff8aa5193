"""The receiving side of the same-host channel (:mod:`objcomm._samehost.channel`): the messages' header and kinds,
the checks every message passes, the bounded stash, and flow control (:class:`Stash`; the waits of the threads that
take messages from it are :mod:`objcomm._samehost.inbox_waits`).

Messages wait in the stash until a call asks for them; it holds at most ``stash_bytes`` (payload plus
:data:`ENTRY_OVERHEAD` per message and :data:`KEY_OVERHEAD` per key with messages waiting, about what Python takes
for them), beyond which the channel fails: a peer that runs that far ahead of this rank, or floods it, cannot grow
its memory without bound.

Flow control: a sender never makes a receiver fail. Each message of a collective (a root or a gather's sender may
run ahead of its receivers) and of send/recv (a slot, a rest) costs its sender credit at that receiver: its length
plus :data:`ENTRY_OVERHEAD` and :data:`KEY_OVERHEAD`, what the stash would count for it. Per peer and class
(collectives, point to point) a sender has :func:`window_for` bytes of credit (8 MiB up to four ranks); a send that
would pass it waits, reading the receiver's socket, until the receiver has taken enough of what came before: a
receiver that hands messages to its calls (or drops them, :meth:`Stash.abandon`) tells the sender its running totals
in a ``CREDIT`` message once they grew by a quarter of the window since it last told them. The two classes keep
apart so that sends nobody received yet never hold up a collective. So an honest sender that runs ahead is slowed
down to its receiver's pace, and the stash, sized to hold every peer's two windows, never fills from honest peers; a
peer that ignores its credit fills it and fails the channel as before. Answers and ``CREDIT`` messages take no
credit: a sender waits for an answer before it sends more under that message, so there are never more of them than
sends in flight. A send that finds its receiver's queue full files meanwhile what its peers sent this rank
(:meth:`~objcomm._samehost.inbox_waits.Inbox.take_in`): two ranks that send each other hundreds of messages before
either receives go on, where each waited for the other until the timeout. A rank whose group is destroyed says so
last (``LEFT``): a receive from any rank goes on with the others.

Every message is checked on arrival, before it is filed, and any violation fails the channel with a
:class:`~objcomm.CommunicationError` naming the peer (the channel then closes, so the others raise too): a datagram
shorter than the header (an empty one is told apart from EOF) or longer than a message may be (``MSG_TRUNC`` gives
its real length; nothing of that size is allocated), an unknown kind or flag bits, a collective's negative call word
(its tag: :mod:`objcomm._transport.call_words`), a point-to-point message with flags or a negative tag, and a
collective sequence number that does not move forward (at or before the last collective done here, or not after the
peer's previous one). Point-to-point messages carry a message id where collectives carry their sequence number: a
send's slot (taken by tag, in order) tells the receiver its id, and its answer and rest
(:mod:`objcomm._samehost.channel_rests`) travel under ``(tag, kind, id)``, so that concurrent sends under one tag
never take each other's (shared memory's words too). After a wait for one of those timed out, later ones under its
key are dropped on arrival (:meth:`Stash.abandon`). A waiter for collective ``s`` from a peer whose later collective
already arrived fails at once (the peer called a different operation), as does a taker of a message of another kind
or call word (another collective, or another root). A wait past the timeout fails the channel in a collective; a recv
that times out raises and leaves it open. The sender and length are the kernel's (socket, datagram size): no lie.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, NoReturn, Optional, Sequence, Set, Tuple

from objcomm._errors import CommunicationError
from objcomm._samehost import credit
from objcomm._samehost.credit import ENTRY_OVERHEAD, KEY_OVERHEAD, MESSAGE_COST, Lending, credit_cost
from objcomm._transport.call_words import described

HEADER = struct.Struct("<BB2xIi")  # kind, flags, collective sequence number or message id, tag (or call word)
HEADER_BYTES = HEADER.size
ALL_GATHER, BROADCAST, SCATTER, ALL_TO_ALL, P2P = 1, 2, 3, 4, 5
ANSWER, REST = 6, 7  # of a send's message (its id): the receiver's answer, and the bytes after the slot
GATHER = 8
CREDIT = 10  # the receiver's running totals of what it took, per class (see "Flow control")
# a collective: a digest of what this rank read in round 1 (objcomm._samehost.channel_slots.ChannelSlots.agree)
ECHO = 11
# the last message of a rank that failed the channel: where (its failure point, as the header's number; see Mesh.fail),
# so that a peer that finds it gone at a later call joins it there; or whose group was destroyed (Mesh.leave)
FAILED, LEFT = 12, 13
NAMES = {
    ALL_GATHER: "all_gather",
    BROADCAST: "broadcast",
    SCATTER: "scatter",
    ALL_TO_ALL: "all_to_all",
    P2P: "send",
    ANSWER: "recv",
    REST: "send",
    GATHER: "gather",
    CREDIT: "credit",
    ECHO: "echo",
    FAILED: "failure notice",
    LEFT: "departure notice",
}
POINT_TO_POINT_KINDS = (P2P, ANSWER, REST)
COLLECTIVE_KINDS = frozenset((ALL_GATHER, BROADCAST, SCATTER, ALL_TO_ALL, GATHER, ECHO))
COLLECTIVES, POINT_TO_POINT = 0, 1  # the two classes of messages that take credit (ANSWER and CREDIT take none)
CLASS_OF = {
    ALL_GATHER: COLLECTIVES,
    BROADCAST: COLLECTIVES,
    SCATTER: COLLECTIVES,
    ALL_TO_ALL: COLLECTIVES,
    GATHER: COLLECTIVES,
    ECHO: COLLECTIVES,
    P2P: POINT_TO_POINT,
    REST: POINT_TO_POINT,
}
_CREDIT = struct.Struct("<qq")  # CREDIT's payload: what the receiver took of each class, in credit bytes, since set-up
NOTICE_WAIT = 0.5  # seconds a send that found its peer gone reads (or waits for another thread to read) its last words
RECV_SLACK = 0.25  # seconds a blocking recv (SO_RCVTIMEO: the whole timeout) may outlast a call's deadline
MASK = 0xFFFFFFFF
_HALF = 1 << 31  # sequence number a comes after b where 0 < (a - b) & MASK < _HALF (after())
# (True, sequence number) of a collective, (False, tag) of a send's slot, (False, tag, kind, id) of its answer and rest
Key = Tuple[Any, ...]
Entry = Tuple[int, int, bytes]  # kind, flags (a send's slot: its message id), payload
Fail = Callable[..., NoReturn]  # (op, why, cause=None): close the channel and raise


def after(a: int, b: int) -> bool:
    """Whether sequence number ``a`` comes after ``b`` (32 bits, wrapping)."""
    return a != b and (a - b) & MASK < 1 << 31


class Stash:
    """What has arrived on one channel's sockets, checked and filed until a call takes it, who reads which socket,
    and the credit counted both ways (see the module docstring); :class:`objcomm._samehost.inbox_waits.Inbox`
    waits on it."""

    def __init__(
        self,
        peers: Dict[int, socket.socket],
        pids: Sequence[int],
        timeout: float,
        largest: int,
        fail: Fail,
        stash_bytes: Optional[int] = None,
        yielding: bool = True,
    ) -> None:
        self.timeout = timeout
        self.yielding = yielding  # a polling wait yields the CPU between polls (see inbox_waits.poll_briefly)
        self.done = 0  # sequence number of the last collective this rank finished
        self.closed: Optional[str] = None  # why the channel closed, once it has
        self.gone: Dict[int, str] = {}  # peers whose connection ended: why
        self.failed: Dict[int, int] = {}  # peers that said where they failed the channel (FAILED): that point
        self.left: Set[int] = set()  # peers that said they left (LEFT): their group was destroyed there
        # send/recv slots this rank sent through the channel, and took from it: where the group's sums differ at a
        # reopening, messages were lost with the channel (objcomm._samehost.channel.LocalChannel.open)
        self.slots_sent = self.slots_taken = 0
        self._lock = threading.RLock()
        self.cond = threading.Condition(self._lock)  # guards everything below
        self._peers = peers
        self._pids = pids
        self.ranks_note = ""  # (LocalChannel's: which group ranks are which global ones, where they differ)
        self._fail = fail
        self._limit = credit.stash_for(len(peers)) if stash_bytes is None else stash_bytes
        self.window = credit.window_for(len(peers))
        # flow control, per peer and class: credit bytes this rank sent it, and what it said it took of them;
        # what this rank took of the peer's, and what it last told the peer (see "Flow control")
        self._sent = {r: [0, 0] for r in peers}
        self._credit = {r: [0, 0] for r in peers}
        self._taken = {r: [0, 0] for r in peers}
        self._told = {r: [0, 0] for r in peers}
        self.owing: Set[int] = set()  # peers whose totals grew by a quarter of the window since told (grants())
        self.lending = Lending()  # send/recv credit lent ahead to senders whose stashed messages hold it (credit.py)
        self._bounced: Set[int] = set()  # peers whose last CREDIT could not be sent (queue full): waits offer it again
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

    def _pop(self, peer: int, key: Key) -> Optional[Entry]:
        queue = self._stash[peer].get(key)
        if not queue:
            return None
        entry = queue.popleft()
        if not queue:
            del self._stash[peer][key]
            self._stashed -= KEY_OVERHEAD
        self._stashed -= len(entry[2]) + ENTRY_OVERHEAD
        if CLASS_OF.get(entry[0] & 0xFF) == POINT_TO_POINT:
            self.lending.held(peer, -credit_cost(len(entry[2])))
        self._took(peer, entry[0], len(entry[2]))
        return entry

    def _release(self, me: int, keep: Sequence[int], counted: bool = True) -> None:
        """Stop reading the sockets this thread claimed, but those of ``keep``; wake whoever waits for them.
        ``counted``: this thread counts in ``_waiting`` (it releases before it stops counting: else the one thread
        left waiting for these sockets would sleep until its timeout, nobody reading them); a lean path does not."""
        let_go = [p for p, reader in self._readers.items() if reader == me and p not in keep]
        for peer in let_go:
            del self._readers[peer]
        if let_go and self._waiting > counted:
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

    def notice_of(self, peer: int, op: str) -> Optional[int]:
        """Where ``peer``, whose connection a send found closed, failed the channel, if it said so: what it sent
        before it closed is read now (checked and filed as ever) up to its :data:`FAILED` notice or the end, unless
        another thread reads its socket (that one files it; this waits for it a moment)."""
        deadline = time.monotonic() + NOTICE_WAIT  # once: a peer that keeps sending cannot hold this rank
        with self.cond:
            self._waiting += 1  # counted: the reader of the socket wakes it when it lets go
            try:
                for _ in range(4096):
                    if peer in self.gone or time.monotonic() > deadline:
                        break
                    if peer in self._readers:
                        self.cond.wait(max(deadline - time.monotonic(), 0.0))
                        continue
                    try:
                        length = self._recv(peer, block=False)
                        if length == -3:  # nothing more
                            break
                        self._file(peer, length, op)
                    except CommunicationError:  # the channel failed on what came: it says why
                        break
            finally:
                self._waiting -= 1
            return self.failed.get(peer)

    # -- filing (under the lock) ------------------------------------------------------------------
    def _file(self, peer: int, length: int, op: str) -> None:
        """Check the message ``peer`` sent and put it in the stash, or note EOF."""
        parsed = self._parse(peer, length, op)
        if parsed is not None:
            self._put(peer, *parsed, op)

    def _parse(self, peer: int, length: int, op: str) -> Optional[Tuple[Key, Entry]]:
        """The key and entry of the message in ``peer``'s buffer, checked (see the module docstring); None at EOF.
        A collective's is checked first: every small call takes one."""
        if not HEADER_BYTES <= length <= self._size:
            self._unparsed(peer, length, op)
            return None
        buffer = self._buffers[peer]
        kind, flags, seq, tag = HEADER.unpack_from(buffer)
        if kind in COLLECTIVE_KINDS:  # after the last from peer, and after what this rank finished (as after() says)
            last = self._last.get(peer, seq - 1)
            if tag < 0 or flags or not 0 < (seq - self.done) & MASK < _HALF or not 0 < (seq - last) & MASK < _HALF:
                self._stale(peer, kind, flags, seq, tag, op)
            self._last[peer] = seq  # the sender's call (objcomm._transport.call_words) above the kind: a taker's own
            return (True, seq), (kind | tag << 8, flags, bytes(memoryview(buffer)[HEADER_BYTES:length]))
        if kind == CREDIT:
            if flags or seq or tag or length != HEADER.size + _CREDIT.size:
                self._fail(
                    op,
                    f"{self._who(peer)} sent a {length}-byte credit message with a bad header (flags "
                    f"{flags}, #{seq}, tag {tag}): a protocol error",
                )
            totals = self._credit[peer]  # running totals: a late or repeated one changes nothing
            for cls, total in enumerate(_CREDIT.unpack_from(buffer, HEADER_BYTES)):
                totals[cls] = max(totals[cls], total)  # a receiver that lies lets this rank run ahead of itself alone
            self.cond.notify_all()  # a sender waiting for credit while another thread reads this socket
            return None
        if kind in (FAILED, LEFT):
            if flags or tag or length != HEADER.size or (kind == LEFT and seq):
                self._fail(
                    op,
                    f"{self._who(peer)} sent a {length}-byte {NAMES[kind]} with a bad header (flags {flags}, "
                    f"#{seq}, tag {tag}): a protocol error",
                )
            if kind == FAILED:
                self.failed.setdefault(peer, seq)
                why = f"closed its connection: it failed the channel at its collective #{seq}"
            else:
                self.left.add(peer)
                why = "left: its process group was destroyed there (dist.destroy_process_group), after what it sent"
            self.gone.setdefault(peer, f"{self._who(peer)} {why}")
            self.cond.notify_all()
            return None
        if kind in POINT_TO_POINT_KINDS:
            if flags or tag < 0:
                self._fail(
                    op,
                    f"{self._who(peer)} sent a point-to-point message with a bad header (flags {flags}, "
                    f"tag {tag}): a protocol error",
                )
            if kind == P2P:  # a slot: keyed by its tag alone (a recv takes the next one), its id as its flags
                return (False, tag), (kind, seq, bytes(memoryview(buffer)[HEADER_BYTES:length]))
            key: Key = (False, tag, kind, seq)
        else:
            self._fail(op, f"{self._who(peer)} sent a message of unknown kind {kind}: a protocol error")
        return key, (kind, flags, bytes(memoryview(buffer)[HEADER_BYTES:length]))

    def _took(self, peer: int, kind: int, data_bytes: int) -> None:
        """A ``kind`` message from ``peer`` left this rank's hands (taken by a call, or dropped): count its credit."""
        cls = CLASS_OF.get(kind & 0xFF)  # (a collective's kind carries its call's word above: call_words)
        if cls is None:
            return
        taken, cost = self._taken[peer], data_bytes + MESSAGE_COST  # (credit_cost, inline: every small call's)
        if cls != COLLECTIVES:
            self.slots_taken += kind == P2P
            cost = self.lending.repaid(peer, cost) if self.lending.total else cost
        taken[cls] += cost
        if taken[cls] - self._told[peer][cls] >= self.window >> 2:
            self.owing.add(peer)

    def grants(self) -> List[Tuple[int, bytes]]:
        """The ``CREDIT`` payloads owed, ``(peer, payload)``, counted as told (one that bounces is owed again)."""
        with self.cond:
            out = []
            for peer in self.owing:
                self._told[peer] = list(self._taken[peer])
                out.append((peer, _CREDIT.pack(*self._taken[peer])))
            self.owing.clear()
            return out

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
        if self._stashed + size > self._limit + self.lending.total:
            self._fail(
                op,
                f"{self._who(peer)} sent more than this rank has asked for: the stash of messages for calls "
                f"not yet made would pass {self._limit + self.lending.total:,} bytes. A rank that far ahead, or "
                "flooding the channel",
            )
        self._stashed += size
        if self._stashed > self.peak:
            self.peak = self._stashed
        queues.setdefault(key, deque()).append(entry)
        if CLASS_OF.get(entry[0] & 0xFF) == POINT_TO_POINT:
            self.lending.held(peer, credit_cost(len(entry[2])))

    def lend(self, peers: Sequence[int]) -> bool:
        """A receive waits for ``peers`` with nothing for it here: lend each the credit its send/recv messages under
        other keys hold in the stash (:mod:`objcomm._samehost.credit`), counted as taken; whether any was lent."""
        lent = False
        for peer in peers:
            amount = self.lending.lend(peer, self.window >> 2)
            if amount:
                self._taken[peer][POINT_TO_POINT] += amount
                self.owing.add(peer)
                lent = True
        return lent

    def _unparsed(self, peer: int, length: int, op: str) -> None:
        """A message that is no message: EOF (-1: ``peer`` is gone), else a protocol error (-2: an empty datagram)."""
        if length == -1:
            if peer not in self.gone:
                self.gone[peer] = f"{self._who(peer)} closed its connection: it died, or failed and closed the channel"
            return
        sent = f"{self._who(peer)} sent a {max(length, 0):,}-byte message"
        if length < HEADER.size:
            self._fail(op, f"{sent}, shorter than the {HEADER.size}-byte header: a protocol error")
        self._fail(op, f"{sent}, above the {self._size:,} bytes a message may have: a protocol error")

    def _stale(self, peer: int, kind: int, flags: int, seq: int, tag: int, op: str) -> NoReturn:
        article = "an" if NAMES[kind][0] in "aeiou" else "a"
        self._fail(
            op,
            f"{self._who(peer)} sent {article} {NAMES[kind]} message with a bad header (collective #{seq} after "
            f"#{self._last.get(peer)} and with #{self.done} finished here, its call {described(tag)}, flags {flags}): "
            "a duplicate or stale message (did the ranks call different collectives, or broadcast or scatter with "
            "different src?), or a protocol error",
        )

    def _who(self, peer: int) -> str:
        return f"rank {peer} (pid {self._pids[peer]})"


_DONTWAIT = int(socket.MSG_DONTWAIT)  # ints: an enum.IntFlag's | costs more than the recv's bookkeeping
_TRUNC = int(socket.MSG_TRUNC)
_PEEK = int(socket.MSG_PEEK)
