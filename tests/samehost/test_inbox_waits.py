"""The waits of the same-host channel's receiving side (objcomm._samehost.inbox_waits), on socket pairs in one
process: several threads taking messages from one inbox at once."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest

from objcomm import CommunicationError
from objcomm._samehost import credit as _credit
from objcomm._samehost import inbox as _inbox
from objcomm._samehost import inbox_waits as _inbox_waits

pytestmark = pytest.mark.timeout(60)


def _fail(op: str, why: str, cause: Any = None) -> Any:
    raise CommunicationError(f"{op}: {why}")


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.001)


class _Run(threading.Thread):
    """``fn()`` on a thread of its own; ``outcome``: what it returned, or the exception it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.outcome: Any = None

    def run(self) -> None:
        try:
            self.outcome = self.fn()
        except BaseException as exc:  # noqa: B036 - the test looks at it
            self.outcome = exc


Pairs = Dict[int, Tuple[socket.socket, socket.socket]]


@pytest.fixture
def inbox_of() -> Iterator[Callable[..., Tuple[_inbox_waits.Inbox, Pairs]]]:
    """``inbox_of(timeout, peers=2)``: the last rank's inbox on socket pairs to peers 0, 1, … (each pair: this rank's
    end, the peer's end), every blocking read bounded by ``timeout``; the sockets are closed at the end."""
    made: List[socket.socket] = []

    def make(timeout: float, peers: int = 2) -> Tuple[_inbox_waits.Inbox, Pairs]:
        pairs = {peer: socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for peer in range(peers)}
        for mine, theirs in pairs.values():
            mine.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(timeout), 0))
            made.extend((mine, theirs))
        inbox = _inbox_waits.Inbox(
            {p: pair[0] for p, pair in pairs.items()}, [os.getpid()] * (peers + 1), timeout, 4096, _fail
        )
        return inbox, pairs

    yield make
    for sock in made:
        sock.close()


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def _message(kind: int, number: int, tag: int = 0, data: bytes = b"") -> bytes:
    """A channel message: a collective's (``number``: its sequence number) or a send/recv slot's (its message id)."""
    return _inbox.HEADER.pack(kind, 0, number, tag) + data


def test_a_thread_that_stops_reading_a_socket_wakes_the_one_left_waiting_for_it(inbox_of):
    """A receiver from any rank reads peer 1's socket while a collective waits for peer 1's message (asleep: that
    socket is the receiver's). The receiver's message, filed by the thread reading peer 0's socket, ends its wait;
    the collective must then read peer 1's socket itself. Before the fix the receiver let go of it without telling
    anyone (it had stopped counting as waiting, and the collective was the only thread left), and the collective
    slept until the timeout, its message unread in the socket (the many_threads test of test_first_round_p2p.py,
    2 CI runs of 5)."""
    timeout = 3.0
    inbox, pairs = inbox_of(timeout)
    # peer 0's socket: a thread alone reads it (waiting for its tag-1 message)
    reader = _Run(lambda: inbox.take([0], (False, 1), _inbox.P2P, "recv", first=True))
    reader.start()
    _until(lambda: 0 in inbox._readers, "the tag-1 receiver reads peer 0's socket")
    # a receiver from any rank: peer 0's socket is taken, it reads peer 1's (and an eventfd, to be woken)
    anyone = _Run(lambda: inbox.take([0, 1], (False, 9), _inbox.P2P, "recv", first=True))
    anyone.start()
    _until(lambda: inbox._readers.get(1) == anyone.ident and anyone.ident in inbox._wakes, "anyone reads 1")
    collective = _Run(lambda: inbox.take([1], (True, 1), _inbox.ALL_GATHER, "all_gather"))
    collective.start()
    _until(lambda: inbox._waiting == 2, "the collective waits")
    time.sleep(0.05)  # asleep on the condition by now: peer 1's socket is the receiver's
    with inbox.cond:  # what the reader of peer 0's socket does with a tag-9 message it read while nobody slept
        inbox._put(0, (False, 9), (_inbox.P2P, 7, b"for anyone"), "recv")
        os.eventfd_write(inbox._wakes[anyone.ident], 1)
    anyone.join(10)
    assert anyone.outcome == ({0: b"for anyone"}, 7)
    pairs[1][1].send(_message(_inbox.ALL_GATHER, 1, data=b"gathered"))
    collective.join(2 * timeout + 5)
    assert collective.outcome == ({1: b"gathered"}, 0), collective.outcome
    pairs[0][1].send(_message(_inbox.P2P, 5, tag=1, data=b"reader's"))
    reader.join(2 * timeout)
    assert reader.outcome == ({0: b"reader's"}, 5)


def test_a_collective_files_every_message_that_came_with_a_peer_s_end(inbox_of):
    """A collective reading several peers at once (the lean path) that finds one pending peer's connection ended
    still files what the others sent in the same wake-up (before: dropped, read from the socket and never filed,
    a send/recv message among them)."""
    inbox, pairs = inbox_of(2.0)
    pairs[1][1].send(_message(_inbox.P2P, 3, tag=4, data=b"kept"))
    pairs[0][1].close()  # peer 0's end, and peer 1's message, come in one poll
    with pytest.raises(CommunicationError, match="rank 0 .* closed its connection"):
        inbox.take([0, 1], (True, 1), _inbox.ALL_GATHER, "all_gather")
    assert inbox.take([1], (False, 4), _inbox.P2P, "recv", first=True) == ({1: b"kept"}, 3)


def test_a_collective_waiting_for_its_last_peer_still_reads_the_others(inbox_of):
    """A collective that holds every peer's socket and waits for the last peer's message lets the others go: a
    receiver's message from a peer done with the collective (and a sender's credit) is taken at once, not when the
    last peer comes (before: the collective read the last peer's socket alone, holding the others; a program whose
    last peer waits for that receiver first waited the timeout)."""
    inbox, pairs = inbox_of(3.0)
    pairs[0][1].send(_message(_inbox.ALL_GATHER, 1, data=b"c0"))  # peer 0 is in the collective already
    collective = _Run(lambda: inbox.take([0, 1], (True, 1), _inbox.ALL_GATHER, "all_gather"))
    collective.start()
    _until(lambda: inbox._readers.get(1) == collective.ident and not _readable(pairs[0][0]), "peer 0's message read")
    receiver = _Run(lambda: inbox.take([0], (False, 4), _inbox.P2P, "recv", first=True))
    receiver.start()
    pairs[0][1].send(_message(_inbox.P2P, 9, tag=4, data=b"for the receiver"))
    receiver.join(10)
    assert receiver.outcome == ({0: b"for the receiver"}, 9), receiver.outcome
    assert collective.is_alive()  # still waiting for peer 1
    pairs[1][1].send(_message(_inbox.ALL_GATHER, 1, data=b"c1"))
    collective.join(10)
    assert collective.outcome == ({0: b"c0", 1: b"c1"}, 0)


@pytest.mark.parametrize("alone", [True, False], ids=["reader alone", "reader among others"])
def test_a_failure_notice_read_by_another_thread_reaches_the_sender_that_asks(inbox_of, alone):
    """A sender that found a peer's connection closed asks where it failed (``notice_of``) while another thread
    reads that peer's socket: the reader, done, wakes it, and it reads the peer's notice (before: it slept its 0.5 s
    uncounted, and the notice was dropped unread at the close)."""
    inbox, pairs = inbox_of(3.0)
    if not alone:  # the reader takes the general path (counted as waiting)
        inbox._put(0, (False, 7), (_inbox.P2P, 1, b"other"), "recv")
    reader = _Run(lambda: inbox.take([0], (False, 1), _inbox.P2P, "recv", first=True))
    reader.start()
    _until(lambda: inbox._readers.get(0) == reader.ident, "the reader reads peer 0's socket")
    sender = _Run(lambda: inbox.notice_of(0, "send"))
    sender.start()
    time.sleep(0.05)  # asleep on the condition by now: the socket is the reader's
    with inbox.cond:  # all queued before the reader files what it read (as from a peer that closed before the send)
        pairs[0][1].send(_message(_inbox.P2P, 5, tag=1, data=b"the reader's"))  # what peer 0 sent before it failed
        pairs[0][1].send(_message(_inbox.FAILED, 42))
        pairs[0][1].close()
    reader.join(10)
    sender.join(10)
    assert reader.outcome == ({0: b"the reader's"}, 5)
    assert sender.outcome == 42


def test_a_peer_gone_during_a_collective_reaches_a_receiver_waiting_on_it(inbox_of):
    """A collective holding every peer's socket reads the end of a peer it no longer waits for: a receiver waiting
    for that peer raises at once (before: at its timeout, or when the collective ended)."""
    timeout = 3.0
    inbox, pairs = inbox_of(timeout, peers=3)
    pairs[0][1].send(_message(_inbox.ALL_GATHER, 1, data=b"c0"))
    collective = _Run(lambda: inbox.take([0, 1, 2], (True, 1), _inbox.ALL_GATHER, "all_gather"))
    collective.start()
    _until(lambda: inbox._readers.get(0) == collective.ident and not _readable(pairs[0][0]), "peer 0's message read")
    receiver = _Run(lambda: inbox.take([0], (False, 4), _inbox.P2P, "recv", first=True))
    receiver.start()
    _until(lambda: inbox._waiting == 1, "the receiver waits")
    pairs[0][1].close()  # peer 0 dies
    receiver.join(timeout / 2)  # the bound: before the receiver's own timeout could end its wait
    assert isinstance(receiver.outcome, CommunicationError), receiver.outcome
    assert "rank 0" in str(receiver.outcome) and "closed its connection" in str(receiver.outcome)
    for peer in (1, 2):
        pairs[peer][1].send(_message(_inbox.ALL_GATHER, 1, data=b"c"))
    collective.join(10)
    assert collective.outcome == ({0: b"c0", 1: b"c", 2: b"c"}, 0)


def test_a_collective_reading_some_of_its_peers_is_woken_to_read_the_rest(inbox_of):
    """A collective reads peer 1's socket while a receiver reads peer 0's; once the receiver lets go, the collective
    reads peer 0's too, and so learns at once that peer 0 is gone (before: only once peer 1 had sent, or at its
    timeout, saying no message came)."""
    timeout = 3.0
    inbox, pairs = inbox_of(timeout)
    receiver = _Run(lambda: inbox.take([0], (False, 1), _inbox.P2P, "recv", first=True))
    receiver.start()
    _until(lambda: inbox._readers.get(0) == receiver.ident, "the receiver reads peer 0's socket")
    collective = _Run(lambda: inbox.take([0, 1], (True, 1), _inbox.ALL_GATHER, "all_gather"))
    collective.start()
    _until(lambda: inbox._readers.get(1) == collective.ident, "the collective reads peer 1's socket")
    pairs[0][1].send(_message(_inbox.P2P, 5, tag=1, data=b"the receiver's"))
    receiver.join(10)
    assert receiver.outcome == ({0: b"the receiver's"}, 5)
    pairs[0][1].close()  # peer 0 dies
    collective.join(timeout / 2)
    assert isinstance(collective.outcome, CommunicationError), collective.outcome
    assert "rank 0" in str(collective.outcome) and "closed its connection" in str(collective.outcome)


def _credit_taken(sock: socket.socket, timeout: float) -> Any:
    """The totals of the first ``CREDIT`` that comes on ``sock`` within ``timeout`` (others skipped), or None."""
    deadline = time.monotonic() + timeout
    while select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
        data = sock.recv(1 << 17)
        if data[:1] == bytes((_inbox.CREDIT,)):
            return struct.unpack_from("<qq", data, _inbox.HEADER.size)
    return None


def _owing_a_bounced_credit(
    inbox_of: Callable[..., Tuple[_inbox_waits.Inbox, Pairs]], timeout: float
) -> Tuple[_inbox_waits.Inbox, socket.socket, socket.socket]:
    """An inbox with one peer (``(inbox, its socket, the peer's end)``) that took enough of peer 0's sends to owe it
    credit, and whose queue to peer 0 is full (what it sent, unread): the ``CREDIT`` it offers bounces."""
    inbox, pairs = inbox_of(timeout, peers=1)
    mine, theirs = pairs[0]
    data = b"s" * 4000
    for n in range(inbox.window // 4 // len(data) + 1):  # peer 0's sends, each taken by a recv: credit owed
        theirs.send(_message(_inbox.P2P, n, tag=1, data=data))
        assert inbox.take([0], (False, 1), _inbox.P2P, "recv", first=True) == ({0: data}, n)
    assert inbox.owing
    with contextlib.suppress(BlockingIOError):
        while True:
            mine.send(b"x" * 60000, socket.MSG_DONTWAIT)
    inbox.grant()
    assert inbox.bounced and inbox.owing
    return inbox, mine, theirs


def test_a_credit_that_could_not_be_sent_is_offered_again_while_this_rank_waits(inbox_of):
    """This rank took enough of peer 0's sends to owe it credit, but its queue to peer 0 was full when it offered it
    (the ``CREDIT`` bounced). Then it waits for peer 0's next message while peer 0, out of credit, waits for that
    ``CREDIT`` before it sends: the wait must offer it again once peer 0 has read its queue (before: only at the end
    of a call, or in a wait for credit; both ranks waited until the timeout)."""
    timeout = 4.0
    inbox, mine, theirs = _owing_a_bounced_credit(inbox_of, timeout)
    receiver = _Run(lambda: inbox.take([0], (False, 2), _inbox.P2P, "recv", first=True))
    receiver.start()
    _until(lambda: inbox._readers.get(0) == receiver.ident, "the receiver waits on peer 0's socket")
    taken = _credit_taken(theirs, timeout / 2)  # peer 0 reads its queue, looking for the credit
    assert taken is not None, "the CREDIT was never offered again while this rank waited"
    assert taken[1] > 0  # what it took of peer 0's point-to-point messages
    theirs.send(_message(_inbox.P2P, 99, tag=2, data=b"next"))
    receiver.join(timeout)
    assert receiver.outcome == ({0: b"next"}, 99), receiver.outcome
    assert not inbox.bounced


def test_two_senders_out_of_credit_offer_a_bounced_credit_again(inbox_of):
    """This rank, out of credit at peer 0, waits for peer 0's ``CREDIT`` while the credit it owes peer 0 bounced;
    peer 0, out of credit too, waits for that one before it grants its own. The wait for credit must offer it again
    (before: once per wake-up, and nothing came to wake it: both waited until the timeout)."""
    timeout = 4.0
    inbox, mine, theirs = _owing_a_bounced_credit(inbox_of, timeout)
    cost = _credit.credit_cost(60000)
    for _ in range(inbox.window // cost):  # this rank's sends to peer 0, none taken yet: its credit is spent
        inbox.reserve(0, _inbox.P2P, 60000, "send")
    sender = _Run(lambda: inbox.reserve(0, _inbox.P2P, 60000, "send"))
    sender.start()
    _until(lambda: inbox._readers.get(0) == sender.ident, "the sender waits for peer 0's credit")
    assert _credit_taken(theirs, timeout / 2) is not None, "the CREDIT was never offered again while this rank waited"
    taken = inbox.window // cost * cost  # peer 0 took everything this rank sent: its CREDIT says so
    theirs.send(_inbox.HEADER.pack(_inbox.CREDIT, 0, 0, 0) + struct.pack("<qq", 0, taken))
    sender.join(timeout)
    assert sender.outcome is None and not sender.is_alive(), sender.outcome


def test_a_message_filed_while_a_waiter_offers_its_credit_ends_its_wait(inbox_of):
    """A receiver waits for its message (tag 2) while another thread reads peer 0's socket (waiting for tag 5), and
    it offers a bounced CREDIT again with the lock let go: the message comes and is filed meanwhile. The receiver
    must find it at once (before: it went to sleep on the condition after the notify, for its whole timeout)."""
    timeout = 4.0
    inbox, mine, theirs = _owing_a_bounced_credit(inbox_of, timeout)
    reader = _Run(lambda: inbox.take([0], (False, 5), _inbox.P2P, "recv", first=True))
    reader.start()
    _until(lambda: inbox._readers.get(0) == reader.ident, "the tag-5 receiver reads peer 0's socket")
    grant = inbox.grant

    def offered() -> None:  # in the receiver, the lock let go: the CREDIT leaves, its message comes and is filed
        if threading.current_thread() is receiver:
            with contextlib.suppress(BlockingIOError):
                while True:
                    theirs.recv(1 << 17, socket.MSG_DONTWAIT)  # peer 0 reads its queue
            grant()
            theirs.send(_message(_inbox.P2P, 7, tag=2, data=b"for the receiver"))
            _until(lambda: (False, 2) in inbox._stash[0], "the reader files the receiver's message")
            return
        grant()

    inbox.grant = offered  # type: ignore[method-assign]
    receiver = _Run(lambda: inbox.take([0], (False, 2), _inbox.P2P, "recv", first=True))
    started = time.monotonic()
    receiver.start()
    receiver.join(timeout)
    assert receiver.outcome == ({0: b"for the receiver"}, 7), receiver.outcome
    assert time.monotonic() - started < timeout / 2
    theirs.send(_message(_inbox.P2P, 8, tag=5))
    reader.join(timeout)
    assert reader.outcome == ({0: b""}, 8)


def test_a_send_waiting_for_credit_from_a_peer_that_left_raises_alone(inbox_of):
    """A send out of credit at a peer that then leaves (its group destroyed: its LEFT notice, then EOF) raises at once,
    leaving the channel open to the others: the peer will take nothing more. A review's find: the credit wait read
    the notice and failed the channel, which broke the other workers of a task farm whose worker left."""
    inbox, pairs = inbox_of(3.0)
    failed: List[str] = []
    inbox._fail = lambda op, why, cause=None: failed.append(why) or _fail(op, why)  # what fails the channel
    inbox._sent[1][_inbox.POINT_TO_POINT] = inbox.window + 1  # what the peer filed and never took
    pairs[1][1].send(_inbox.HEADER.pack(_inbox.LEFT, 0, 0, 0))
    pairs[1][1].close()
    with pytest.raises(CommunicationError, match="left: its process group was destroyed") as raised:
        inbox.reserve(1, _inbox.P2P, 10, "send")
    assert failed == [] and inbox.left == {1}, (failed, raised.value)
    pairs[0][1].send(_message(_inbox.P2P, 1, tag=4, data=b"x"))  # the other peer's messages still arrive
    got, _ = inbox.take([0], (False, 4), _inbox.P2P, "recv", first=True)
    assert got == {0: b"x"}
