"""A failure learnt down the reduce tree (objcomm._transport.tree_reports): the reports move along the tree's edges, so
that a lying relay, who can hand its subtree a failure nobody else sees, never sends that subtree into a collective of
the group alone (where it would meet the others' next call and hand them wrong data). The honest failure path is
tests/transport/test_many_ranks.py::test_all_reduce_returns_down_the_tree ("op raises on rank 6"). A rank that refuses
what its relay sent (a relay higher up hid its limit) began the failure itself: its reports stop there."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, List, Optional

import pytest
import torch.distributed as dist
from _hostile import a_relay_that_lies, all_reduce_under, result_or_error
from _ranks import get_pool

import objcomm
from objcomm._api.resolving import Hooks
from objcomm._transport import tree_reports as _tree_reports

pytestmark = pytest.mark.timeout(180)

W = 8  # the pool of tests/transport/test_many_ranks.py; the group here is its first 4 ranks
LIAR = 2  # relays group rank 3 in the binomial tree of 4 (0 <- 1, 0 <- 2 <- 3)


def _first_four() -> Any:
    """A group of global ranks 0-3 (3 s timeout; every rank makes it) and, on its members, a Communicator whose
    all_reduce results go down the reduce tree (NCCL's route, taken on gloo here)."""
    sub = dist.new_group(list(range(4)), timeout=timedelta(seconds=3))
    if dist.get_rank() >= 4:
        return sub, None
    return sub, objcomm.Communicator(sub, local=False, shm=False, _hooks=Hooks(separate_hosts=True, down_tree=True))


def lying_relay(case: str) -> Optional[List[Any]]:
    """Ranks 0-3 in a group of their own (3 s timeout), all_reduce's result down the tree; rank 2 lies to its child,
    rank 3: ``forged``: it hands it an error report in place of the result; ``hidden limit``: it announces a limit of
    2**61 for its subtree up the tree, hiding rank 3's max_bytes, so that rank 3 refuses the result. Then one
    all_gather on the group. What each rank got of both."""
    sub, comm = _first_four()
    if comm is None:
        return None
    rank = dist.get_rank()
    down = case == "forged"  # to its child (rank 3) on the way down, else to its parent (rank 0) on the way up
    with a_relay_that_lies(case, lambda wire, dst: dst > wire.rank if down else dst < wire.rank, rank == LIAR):
        reduced = all_reduce_under(case, comm, rank, 4, limited=3)
    gathered = result_or_error(lambda: comm.all_gather(rank))
    dist.destroy_process_group(sub)
    return [reduced, gathered]


def test_a_lying_relay_never_leaves_honest_ranks_with_wrong_data():
    """``forged``: the misled rank cannot tell a forged error report from group rank 0's, so it waits for its relay's
    reports until the group's timeout, never in a collective of the group, and the others' next call waits for it:
    it raises, or returns the right result where the misled rank comes in time. ``hidden limit``: rank 3 refuses
    what its relay sends; the failure began there, so it raises at once (its reports go to nobody: its relay
    returned the result) and the group stays in step."""
    outcomes = get_pool(W).run(lying_relay, "forged", timeout=120)
    assert outcomes[4:] == [None] * 4
    in_time_or_not = ([0, 1, 2, 3], "CommunicationError")  # the next call waits for rank 3, which comes late
    for rank in (0, 1, 2):  # outside the liar's lie: the right result
        assert outcomes[rank][0] == 10 and outcomes[rank][1] in in_time_or_not, (rank, outcomes)
    assert outcomes[3][0] == "CommunicationError" and outcomes[3][1] in in_time_or_not, outcomes
    outcomes = get_pool(W).run(lying_relay, "hidden limit", timeout=120)
    assert outcomes[:4] == [[160_000, [0, 1, 2, 3]]] * 3 + [["RemoteError", [0, 1, 2, 3]]], outcomes


def stale_reports(next_call: str) -> Optional[List[Any]]:
    """Ranks 0-7 in a group of their own (3 s timeout), all_reduce's result down the tree (0 <- 4 <- 6 <- 7); rank 4
    hides rank 7's max_bytes on its way up, so rank 7 refuses what its honest relay, rank 6, passes on. Then two
    calls of ``next_call`` (a gather's slots up the tree: each message's size is known, a longer one aborts gloo)."""
    sub = dist.new_group(list(range(W)), timeout=timedelta(seconds=3))
    hooks = Hooks(separate_hosts=True, down_tree=True, up_tree=True, tree_radix=2)  # (binomial: 0 <- 4 <- 6 <- 7)
    comm = objcomm.Communicator(sub, local=False, shm=False, _hooks=hooks)
    rank = dist.get_rank()
    with a_relay_that_lies("hidden limit", lambda wire, dst: dst == 0, rank == 4):
        reduced = all_reduce_under("hidden limit", comm, rank, W, limited=7, message=True)
    run = {"all_reduce": lambda: comm.all_reduce(rank + 1, "sum"), "gather": lambda: comm.gather(rank, dst=0)}
    after = [result_or_error(run[next_call]) for _ in range(2)]
    dist.destroy_process_group(sub)
    return [reduced, *after]


@pytest.mark.parametrize("next_call", ["all_reduce", "gather"])
def test_a_rank_that_refuses_what_an_honest_relay_sent_reports_to_nobody(next_call):
    """A refusal that began at rank 7 (a relay higher up hid its limit) is its own: its honest relay returned the
    result and reads nothing more from it. Its reports used to wait on that relay's pair and be read as rank 7's
    message of the next call (a FrameError on both; before a gather's slots up the tree, an abort inside gloo). Its
    error says that the others received the result (it said "no rank received a result")."""
    outcomes = get_pool(W).run(stale_reports, next_call, timeout=120)
    want = sum(range(1, W + 1)) if next_call == "all_reduce" else None
    kind, message = outcomes[7][0]
    assert kind == "RemoteError" and "failed on rank 7, so rank 7 and the ranks below it" in message, outcomes[7]
    assert "where the other ranks did" in message and "no rank received" not in message, message
    for rank, (reduced, *after) in enumerate(outcomes):
        assert rank == 7 or reduced == 160_000, (rank, outcomes)
        right = list(range(W)) if next_call == "gather" and rank == 0 else want
        assert after == [right] * 2, (rank, outcomes)


def unreadable_reports() -> Optional[List[Any]]:
    """Ranks 0-3 as above; rank 1's object cannot be encoded (a real failure), and rank 2 sends garbage in place of
    its failure reports, up to rank 0 and down to rank 3. Rank 0 goes on with rank 2's reports as one unreadable
    report and sends everyone the rest: every rank raises at once (rank 3, misled, a FrameError), naming rank 1's
    failure where it could be read, and the group stays in step."""
    sub, comm = _first_four()
    if comm is None:
        return None
    rank = dist.get_rank()
    real = _tree_reports._pack
    if rank == LIAR:
        _tree_reports._pack = lambda reports: b"\xff" * 11  # type: ignore[assignment]
    try:
        comm.all_reduce(object() if rank == 1 else rank, "sum", serializer="json")
        outcome: Any = "returned"
    except objcomm.RemoteError as exc:
        outcome = {r: t for r, (t, _) in exc.failures.items()}
    except objcomm.ObjcommError as exc:
        outcome = type(exc).__name__
    finally:
        _tree_reports._pack = real  # type: ignore[assignment]
    after = result_or_error(lambda: comm.all_gather(rank))
    dist.destroy_process_group(sub)
    return [outcome, after]


def test_unreadable_failure_reports_stand_for_their_sender_and_the_tree_goes_on():
    outcomes = get_pool(W).run(unreadable_reports, timeout=120)
    for rank in (0, 1):
        assert outcomes[rank][0] == {1: "TypeError", 2: "FrameError"}, outcomes
    assert outcomes[3][0] == "FrameError", outcomes
    assert [o[1] for o in outcomes[:4]] == [[0, 1, 2, 3]] * 4, outcomes  # in step: nobody waited for a timeout
