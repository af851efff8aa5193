"""The send/recv vote's counts on one rank (objcomm._samehost.p2p_state), without ranks: what a rank votes, what a
sender owes after a vote, and the bounds on both. The votes themselves, between real ranks: test_opener.py."""

from __future__ import annotations

import pytest

from objcomm._samehost import p2p_state
from objcomm._samehost.p2p_state import Counted, SameHost

pytestmark = pytest.mark.timeout(30)


class _Group:
    """A group with no pending sends (objcomm._transport.pending knows nothing of it)."""


GROUP = _Group()


def _send(state: SameHost, dst: int, tag: int, posted: bool = True, owed: bool = False) -> None:
    with state.cond:
        lease = Counted(state, True, dst, tag, owed=owed)
    with lease:
        if posted:
            lease.posted()


def test_a_rank_votes_its_waiting_receives_with_the_slots_it_counts():
    state = SameHost()
    with state.cond:
        waiting = Counted(state, False, 1, 7)
    with state.cond:
        taken = Counted(state, False, 1, 7)
    with taken:
        taken.took(1)
    assert state.begin_vote(GROUP, settle=0.0) == [1, 7, 2]  # one taken, one waiting
    state.end_vote()
    with state.cond:
        anyone = Counted(state, False, None, 3)
    assert state.begin_vote(GROUP, settle=0.0) is None  # a receive from any rank waits
    state.end_vote()
    with anyone:
        anyone.took(2)
    assert state.took == {(1, 7): 1, (2, 3): 1}
    with waiting:
        pass  # ended without taking anything: it waits no more
    assert state.begin_vote(GROUP, settle=0.0) == []
    state.end_vote()


def test_a_sender_owes_what_its_receivers_count_past_what_it_sent():
    state = SameHost()
    for _ in range(2):
        _send(state, 1, 7)
    _send(state, 2, 7)
    rows = [[], [0, 7, 3, 0, 9, 1, 2, 7, 5], [0, 7, 1]]  # rank 1: 3 slots from rank 0 under 7, 1 under 9; rank 2: 1
    state.owe(rows, 0)
    assert state.owed == {(1, 7): 1, (1, 9): 1}  # not (2, 7): rank 2 counts what rank 0 sent; rank 2's own: not ours
    state.owe([[], [0, 7, 1]], 0)  # a receiver that counts fewer than were sent (a liar): nothing owed
    assert state.owed == {}


def test_an_owed_send_that_ends_without_posting_is_owed_again():
    state = SameHost()
    state.owed = {}
    _send(state, 1, 7, posted=False, owed=True)
    assert state.owed == {(1, 7): 1} and state.sent == {}
    state.owed = {}
    _send(state, 1, 7, posted=True, owed=True)
    assert state.owed == {} and state.sent == {(1, 7): 1}


def test_past_the_most_keys_a_rank_stops_counting_and_votes_no(monkeypatch):
    monkeypatch.setattr(p2p_state, "MOST_KEYS", 4)
    state = SameHost()
    for tag in range(4):
        _send(state, 1, tag)
    assert state.begin_vote(GROUP, settle=0.0) == [] and not state.uncounted
    state.end_vote()
    _send(state, 1, 4)
    assert len(state.sent) == 4 and state.uncounted
    assert state.begin_vote(GROUP, settle=0.0) is None
    state.end_vote()


def test_the_balance_is_slots_sent_less_taken():
    state = SameHost()
    _send(state, 1, 0)
    _send(state, 1, 1)
    with state.cond:
        lease = Counted(state, False, 1, 0)
    with lease:
        lease.took(1)
    assert state.balance() == 1
