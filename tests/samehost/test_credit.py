"""credit: flow control's numbers, and the credit a receiver lends a sender whose other tags wait in its stash."""

from __future__ import annotations

import doctest

import pytest

from objcomm._samehost import credit
from objcomm._samehost.credit import Lending, unreceived

pytestmark = pytest.mark.timeout(30)


def test_the_module_examples_run():
    assert doctest.testmod(credit).attempted >= 1


def test_lending_lends_what_is_held_once_within_its_most_and_is_paid_back():
    lending = Lending(most=1000)
    lending.held(1, 300)
    assert lending.lend(1, minimum=400) == 0  # less than a step: nothing
    lending.held(1, 300)
    assert lending.lend(1, minimum=400) == 600 and lending.lend(1, minimum=1) == 0  # lent once
    lending.held(2, 900)
    assert lending.lend(2, minimum=1) == 400  # within most, all peers together
    assert lending.repaid(1, 250) == 0 and lending.total == 750  # a message lent for counts nothing more
    assert lending.repaid(1, 500) == 150 and lending.total == 400  # past what was lent: counted as taken
    assert lending.repaid(3, 70) == 70  # a peer nothing was lent: as ever


def test_a_receive_that_timed_out_says_why_where_other_tags_hold_the_credit():
    lending = Lending(most=64)
    stash = {0: {(False, 10): [], (False, 30): [], (True, 7): []}, 1: {(False, 20): []}}  # (collective, tag) keys
    assert unreceived(lending, [0], 2, stash) == " under tag 2 (no other tag matches it)"
    lending.held(0, 5000)
    # nothing lent: the sender was not held back; its messages came under other tags (a porting review's find: the
    # error said "past the 67,108,864 bytes of credit lent" for 3 KB under tags 10, 20 and 30)
    said = unreceived(lending, [0, 1], 2, stash)
    assert said.startswith(" under tag 2, while 5,000 bytes of their messages under other tags (10, 20, 30) wait")
    assert "a recv takes its own tag only" in said and "credit" not in said
    assert lending.lend(0, minimum=1) == 64  # all of it lent: the sender waits for its messages to be received
    said = unreceived(lending, [0], 2, stash)
    assert said.startswith(" under tag 2, while 5,000 bytes of their messages under other tags (10, 30) wait here")
    assert "past the 64 bytes of credit lent" in said and "Receive those first, post irecv for them first" in said
