"""call_words: the word of a rank's call that every same-host channel message of a collective carries."""

from __future__ import annotations

import doctest
import threading
from typing import Any

import pytest
from _ranks import get_pool

from objcomm._samehost.inbox import ALL_GATHER, BROADCAST, NAMES
from objcomm._transport import call_words, patterns
from objcomm._transport.patterns import Row

pytestmark = pytest.mark.timeout(120)


def test_the_module_examples_run():
    assert doctest.testmod(call_words).attempted >= 1


def test_a_word_names_its_call_and_outside_a_call_there_is_none():
    call_words.enter("reduce", 3)
    assert call_words.described(call_words.current()) == "reduce(dst=3)"
    call_words.enter("all_gather")
    assert call_words.described(call_words.current()) == "all_gather()"
    call_words.leave()
    assert call_words.current() == 0
    assert call_words.described(0) == "no collective of objcomm's object API"
    assert call_words.described(12345 << 16) == f"an unknown call (word {12345 << 16})"


def test_a_collective_added_since_has_the_same_word_whatever_order_the_ranks_added_rows_in():
    row = Row("src", False, lambda me, world, root: (), lambda me, world, root: ())
    seen = []
    for order in (("b_row", "a_row"), ("a_row", "b_row")):
        call_words.WORDS.clear()
        for name in order:
            patterns.add_row(name, row)
        try:
            words = {}
            for name in ("a_row", "b_row"):
                call_words.enter(name, 2)
                words[name] = call_words.current()
            assert {name: call_words.described(word) for name, word in words.items()} == {
                "a_row": "a_row(src=2)",
                "b_row": "b_row(src=2)",
            }
            seen.append(words)
        finally:
            for name in order:
                patterns.remove_row(name)
    call_words.leave()
    assert seen[0] == seen[1] and len(set(seen[0].values())) == 2
    assert all(len(call_words.OPS) < word >> 16 < 2**15 for word in seen[0].values())


def test_a_word_no_call_makes_is_described_not_raised():
    all_reduce = call_words.OPS.index("all_reduce") + 1
    assert call_words.described(all_reduce << 16 | 3) == "all_reduce(root=2)"
    assert call_words.described(-5) == "an unknown call (word -5)"


def test_each_thread_has_its_own():
    call_words.enter("scatter", 0)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(call_words.current()))
    thread.start()
    thread.join()
    assert seen == [0] and call_words.described(call_words.current()) == "scatter(src=0)"


def test_roots_and_operations_give_distinct_words():
    words = set()
    for op in call_words.OPS:
        for root in (None, 0, 1, 8191):
            call_words.enter(op, root)
            words.add(call_words.current())
    assert len(words) == len(call_words.OPS) * 4 and 0 not in words and max(words) < 2**31


def test_what_a_taker_says_of_another_call():
    call_words.enter("gather", 0)
    mine = call_words.current()
    call_words.enter("gather", 1)
    theirs = call_words.current()
    call_words.enter("broadcast", 2)
    broadcast = call_words.current()
    said = call_words.other_call(4, ALL_GATHER | theirs << 8, ALL_GATHER | mine << 8, NAMES)
    assert said.startswith("rank 4 called gather(dst=1) where this rank called gather(dst=0) (roots as group ranks)")
    said = call_words.other_call(4, BROADCAST | broadcast << 8, ALL_GATHER | mine << 8, NAMES)
    assert said == f"rank 4 called {NAMES[BROADCAST]} instead (its call: broadcast(src=2))"
    assert call_words.other_call(4, BROADCAST, ALL_GATHER, NAMES) == f"rank 4 called {NAMES[BROADCAST]} instead"


def a_recv_that_fails_after_a_collective() -> Any:
    """The word stays the last collective's after it: a send/recv that fails later must not be named as that call (a
    porting review's find: "all_to_all(): recv over the local channel failed ...")."""
    import torch.distributed as dist

    import objcomm

    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    comm = objcomm.Communicator(group)
    comm.all_to_all([rank, rank])
    channel = comm._express().state.channel
    said = None
    if rank == 1:
        channel.close("closed by the test")  # rank 0 reads its end of the connection
    else:
        try:
            comm.recv(1, tag=3)
        except objcomm.CommunicationError as exc:
            said = str(exc)
    dist.barrier()
    dist.destroy_process_group(group)
    # a reduction's tree, its own point-to-point messages: their failure is named after the reduction (a reviewer's
    # find: tying the name to the channel's collectives dropped it there)
    group = dist.new_group([0, 1])
    comm = objcomm.Communicator(group)
    comm.all_reduce(rank, "sum")
    in_tree = None
    if rank == 1:
        comm._express().state.channel.close("closed by the test")
    else:
        try:
            comm.all_reduce(rank, "sum")
        except objcomm.CommunicationError as exc:
            in_tree = str(exc)
    dist.barrier()
    dist.destroy_process_group(group)
    return said, in_tree


def test_a_send_or_recv_is_not_named_after_the_last_collective():
    (said, in_tree), _ = get_pool(2).run(a_recv_that_fails_after_a_collective)
    assert said is not None and said.startswith("recv over the local channel failed on rank 0 of 2"), said
    assert in_tree is not None and in_tree.startswith("all_reduce(): recv over the local channel failed"), in_tree
