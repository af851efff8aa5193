"""scan and exscan of objects on real gloo groups of 1-4 ranks: rank order, named ops, failures raised alike, the
calls they make."""

from __future__ import annotations

from typing import Any, List

import pytest
import torch
import torch.distributed as dist
from _counting import counting
from _ranks import get_pool

import objcomm
from objcomm._transport import p2p as _p2p
from objcomm._transport import rounds as _rounds
from objcomm._transport.patterns import prefix_steps

pytestmark = pytest.mark.timeout(180)


def test_prefix_steps_reach_every_rank_below_once():
    """Simulated: after its steps each rank holds ranks 0 .. r, each exactly once and in order, and every send meets
    a receive at the same step; a rank in an even block of the distance sends first, so a message waits for one other
    at most."""
    for world in range(1, 40):
        held = [[r] for r in range(world)]
        steps = [prefix_steps(r, world) for r in range(world)]
        assert {len(s) for s in steps} == {(world - 1).bit_length()}
        for k in range((world - 1).bit_length()):
            sent = {r: list(held[r]) for r in range(world) if steps[r][k].to is not None}
            for r in range(world):
                step = steps[r][k]
                if step.to is not None:
                    assert steps[step.to][k].source == r and step.send_first != steps[step.to][k].send_first
                if step.source is not None:
                    held[r] = sent[step.source] + held[r]
        assert held == [list(range(r + 1)) for r in range(world)], world


def scans(serializer: str) -> List[Any]:
    rank = dist.get_rank()
    comm = objcomm.Communicator(serializer=serializer, shm=False)
    own = {"r": [rank]}
    got_own = comm.scan(own, "merge")
    return [
        comm.scan(str(rank), "sum"),
        comm.exscan(str(rank), "sum"),
        comm.scan([rank], lambda a, b: a + b),
        comm.exscan({f"k{rank}": 1, "all": rank}, "merge_sum"),
        (comm.scan(rank * 10 - 7, "min"), comm.scan(rank * 10 - 7, "max"), comm.exscan(rank + 2, "prod")),
        (got_own == {"r": [0]} if rank == 0 else got_own == own, got_own is not own),
        comm.scan(str(rank), "sum", async_op=True).wait(),
    ]


@pytest.mark.parametrize("serializer", ["pickle", "msgpack"])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_each_rank_gets_the_ranks_up_to_it_in_order(world, serializer):
    for r, got in enumerate(get_pool(world).run(scans, serializer)):
        below = range(r)
        assert got[0] == "".join(map(str, range(r + 1))) == got[6]
        assert got[1] == ("".join(map(str, below)) or None)
        assert got[2] == list(range(r + 1))
        assert got[3] == ({**{f"k{q}": 1 for q in below}, "all": sum(below)} if r else None)
        prod = 1
        for q in below:
            prod *= q + 2
        assert got[4] == (-7, 10 * r - 7, prod if r else None)
        assert got[5] == (True, True)  # (rank 0's own object comes back as a copy)


class Uncopyable:
    """An accumulator that ``copy.deepcopy`` refuses, pickled as any object."""

    def __init__(self, values: List[int]) -> None:
        self.values = values

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError("not copyable")


def _extend(a: Uncopyable, b: Uncopyable) -> Uncopyable:
    a.values.extend(b.values)  # updates its first argument, as mpi4py's ops may
    return a


def in_place_ops() -> List[Any]:
    rank, comm = dist.get_rank(), objcomm.Communicator(shm=False)
    mine = Uncopyable([rank])
    got = [comm.scan(mine, _extend), comm.exscan(mine, _extend)]
    return [None if g is None else g.values for g in got] + [mine.values]


def test_an_op_that_updates_its_first_argument_changes_no_other_combination():
    """exscan combines what it receives twice (the prefix it returns, the partial it sends on): a function that
    updates its first argument gets its own decoding each time, also of an object that cannot be copied; the caller's
    object stays as it was."""
    for r, (scanned, exscanned, mine) in enumerate(get_pool(4).run(in_place_ops)):
        assert scanned == list(range(r + 1)) and exscanned == (list(range(r)) or None), (r, scanned, exscanned)
        assert mine == [r]


def failing(case: str) -> Any:
    rank = dist.get_rank()
    comm = objcomm.Communicator(shm=False)
    try:
        if case == "op raises on rank 1":
            comm.scan(rank, lambda a, b: a + b if rank != 1 else a + None)
        elif case == "exscan's op raises on the last rank":
            comm.exscan(rank, lambda a, b: a + b if rank != dist.get_world_size() - 1 else a + None)
        elif case == "over the last rank's max_bytes":
            last = rank == dist.get_world_size() - 1
            comm.scan(b"x" * 3000, "sum", max_bytes=5000 if last else None)
        elif case == "an unknown op":
            comm.scan(rank, "sums")
        result: Any = "returned"
    except objcomm.RemoteError as exc:
        result = {r: kind for r, (kind, _) in exc.failures.items()}
    return result, comm.scan(1, "sum")  # in step afterwards


@pytest.mark.parametrize(
    "case, failed",
    [
        ("op raises on rank 1", {1: "TypeError"}),
        ("exscan's op raises on the last rank", {3: "TypeError"}),
        ("over the last rank's max_bytes", {3: "TooLargeError"}),
        ("an unknown op", {r: "ValueError" for r in range(4)}),
    ],
)
def test_a_failure_anywhere_raises_the_same_on_every_rank(case, failed):
    """The ranks below a failure never hear of it on the way up; the vote at the end tells them."""
    for r, (result, after) in enumerate(get_pool(4).run(failing, case)):
        assert result == failed, (case, r, result)
        assert after == r + 1


def counted() -> Any:
    """This rank's calls in a scan and an exscan of small objects: point-to-point messages, and collectives."""
    comm = objcomm.Communicator(shm=False, local=False)
    targets = {
        "p2p": [(_p2p, "send"), (_p2p, "recv")],
        "all_gather": [(_rounds, "all_gather")],
        "collectives": [(dist, "all_reduce"), (dist, "broadcast"), (dist, "all_gather_into_tensor")],
    }
    with counting(targets) as counts:
        comm.scan({"rank": dist.get_rank()}, "merge")
        comm.exscan(torch.ones(4), "sum")
    return counts


def test_a_scan_sends_log2_w_messages_and_votes_once():
    """4 ranks: 2 steps, each rank at most one send and one receive a step; no all_gather where nothing failed; the
    vote (recursive doubling on gloo: exchanges, then a broadcast) the only collective."""
    for r, counts in enumerate(get_pool(4).run(counted)):
        assert counts["p2p"] <= 2 * 2 * 2, (r, counts)
        assert counts["all_gather"] == 0, (r, counts)
        assert counts["collectives"] <= 2, (r, counts)  # one vote per call: its closing broadcast
