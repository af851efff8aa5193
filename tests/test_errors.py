"""objcomm._errors: what a RemoteError says, at a few failing ranks and at thousands."""

from __future__ import annotations

import pickle

import pytest

from objcomm import RemoteError

pytestmark = pytest.mark.timeout(60)


def test_a_few_failing_ranks_are_named_one_by_one():
    e = RemoteError("gather", {3: ("ValueError", "bad"), 1: ("TypeError", "cannot pickle 'lock'")})
    assert str(e) == (
        "gather failed on ranks 1, 3, so no rank received a result. rank 1: TypeError: cannot pickle 'lock'; "
        "rank 3: ValueError: bad. The group is still usable; fix what failed there and retry."
    )
    assert e.ranks == [1, 3]


def test_thousands_of_ranks_that_fail_alike_make_one_short_message():
    """Every one of 8192 ranks failing the same way (an object none can pickle) once took megabytes on every rank,
    printed by each: now the ranks that failed alike together, the failures all kept on the exception."""
    failures = {r: ("TypeError", "cannot pickle '_thread.lock' object") for r in range(8192)}
    failures[77] = ("MemoryError", "")
    e = RemoteError("all_gather", failures)
    message = str(e)
    assert len(message) < 400, message
    assert message.startswith("all_gather failed on 8,192 ranks (0-8191), so no rank received a result. ")
    assert "ranks 0-76, 78-8191: TypeError: cannot pickle '_thread.lock' object; rank 77: MemoryError: ." in message
    assert e.failures == failures and e.ranks == list(range(8192))
    assert pickle.loads(pickle.dumps(e)).failures == failures


def test_many_distinct_failures_are_cut_short_and_say_where_the_rest_is():
    failures = {r: ("ValueError", f"rank {r}'s own reason") for r in range(0, 4000, 2)}
    message = str(RemoteError("scatter", failures))
    assert len(message) < 1000, len(message)
    assert "2,000 ranks (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, ... (1990 more runs))" in message
    assert "; 1992 more distinct failures (the exception's .failures holds every rank's)." in message


def test_a_groups_ranks_in_an_error_are_the_list_or_its_runs():
    from objcomm._errors import shown_ranks

    assert shown_ranks((0, 1, 2)) == "[0, 1, 2]"
    assert shown_ranks(range(16)) == str(list(range(16)))
    assert shown_ranks(range(8192)) == "8,192 ranks: 0-8191"
    assert shown_ranks([*range(0, 100), *range(200, 300)]) == "200 ranks: 0-99, 200-299"


def test_every_ranks_value_in_an_error_is_the_list_or_each_value_with_its_ranks():
    """collect_results' sizes and part lengths by rank: 8192 of them took ~49 KB on every rank (a scale audit's
    find)."""
    from objcomm._errors import shown_values

    assert shown_values([5, 5, 7]) == "[5, 5, 7]"
    assert shown_values([100] * 8191 + [None]) == "8,192 ranks: ranks 0-8190: 100; rank 8191: None"
    many = shown_values(list(range(8192)))
    assert many.startswith("8,192 ranks: rank 0: 0; rank 1: 1; ") and many.endswith("; 8184 more distinct values")
    assert len(many) < 200
