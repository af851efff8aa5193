"""The waits of the same-host channel's receiving side (objcomm._samehost.inbox_waits), on socket pairs in one
process: several threads taking messages from one inbox at once."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, Tuple

import pytest

from objcomm import CommunicationError
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


def _inbox_of_two(timeout: float) -> Tuple[_inbox_waits.Inbox, Dict[int, Tuple[socket.socket, socket.socket]]]:
    """Rank 2's inbox on socket pairs to peers 0 and 1 (each a pair: rank 2's end, the peer's end), every blocking
    read bounded by ``timeout``."""
    pairs = {peer: socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for peer in (0, 1)}
    for mine, _ in pairs.values():
        mine.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(timeout), 0))
    return _inbox_waits.Inbox({p: pair[0] for p, pair in pairs.items()}, [os.getpid()] * 3, timeout, 4096, _fail), pairs


def test_a_thread_that_stops_reading_a_socket_wakes_the_one_left_waiting_for_it():
    """Rank 2's view: a receiver from any rank reads peer 1's socket while a collective waits for peer 1's message
    (asleep: that socket is the receiver's). The receiver's message, filed by the thread reading peer 0's socket,
    ends its wait; the collective must then read peer 1's socket itself. Before the fix the receiver let go of it
    without telling anyone (it had stopped counting as waiting, and the collective was the only thread left), and
    the collective slept until the timeout, its message unread in the socket (the many_threads test of
    test_first_round_p2p.py, 2 CI runs of 5)."""
    timeout = 3.0
    inbox, pairs = _inbox_of_two(timeout)
    header = _inbox.HEADER
    try:
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
        pairs[1][1].send(header.pack(_inbox.ALL_GATHER, 0, 1, 0) + b"gathered")
        collective.join(2 * timeout + 5)
        assert collective.outcome == ({1: b"gathered"}, 0), collective.outcome
    finally:
        pairs[0][1].send(header.pack(_inbox.P2P, 0, 5, 1) + b"reader's")  # lets the tag-1 receiver go
        reader.join(2 * timeout)
        for pair in pairs.values():
            for sock in pair:
                sock.close()
    assert reader.outcome == ({0: b"reader's"}, 5)


def test_a_collective_files_every_message_that_came_with_a_peer_s_end():
    """A collective reading several peers at once (the lean path) that finds one pending peer's connection ended
    still files what the others sent in the same wake-up (before: dropped, read from the socket and never filed,
    a send/recv message among them)."""
    inbox, pairs = _inbox_of_two(2.0)
    header = _inbox.HEADER
    try:
        pairs[1][1].send(header.pack(_inbox.P2P, 0, 3, 4) + b"kept")
        pairs[0][1].close()  # peer 0's end, and peer 1's message, come in one poll
        with pytest.raises(CommunicationError, match="rank 0 .* closed its connection"):
            inbox.take([0, 1], (True, 1), _inbox.ALL_GATHER, "all_gather")
        assert inbox.take([1], (False, 4), _inbox.P2P, "recv", first=True) == ({1: b"kept"}, 3)
    finally:
        for pair in pairs.values():
            for sock in pair:
                sock.close()
