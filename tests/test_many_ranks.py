"""Eight real ranks, each treated as its own host (no same-host channel, no shared memory): every collective
takes a bounded number of torch.distributed calls whatever the spread of sizes, and bad input still gets the
same clear error on every rank on these paths (issue 27).

The counts are of the calls objcomm makes on each rank: collectives (a batch of sends and receives counts once)
and blocking sends and receives. One pool serves every test here.
"""

from __future__ import annotations

import contextlib
import os
import random
import struct
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist
from _ranks import get_pool

import objcomm
import serializers
from objcomm._format import frame as _frame
from objcomm._format import tensors as _tensors
from objcomm._format.message import Outgoing
from objcomm._transport import base as _base
from objcomm._transport import bytes as _bytes
from objcomm._transport import rounds as _rounds

W = 8
COLLECTIVES = ("broadcast", "all_gather", "all_reduce", "reduce", "gather", "scatter", "all_to_all_single",
               "batch_isend_irecv", "barrier")


@contextlib.contextmanager
def calls() -> Iterator[Dict[str, int]]:
    """Count this rank's torch.distributed calls inside (``collectives``; ``blocking``: send and recv)."""
    counts = {"collectives": 0, "blocking": 0}
    saved = []

    def wrap(owner: Any, name: str, key: str) -> None:
        real = getattr(owner, name)
        saved.append((owner, name, real))

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return real(*args, **kwargs)

        setattr(owner, name, counted)

    try:
        for name in COLLECTIVES:
            wrap(dist, name, "collectives")
        for owner in (_base, _bytes, _rounds):  # bound at import under its torch-version name
            wrap(owner, "all_gather_single", "collectives")
        for name in ("send", "recv"):
            wrap(dist, name, "blocking")
        yield counts
    finally:
        for owner, name, real in reversed(saved):
            setattr(owner, name, real)


def spread(case: str, rank: int) -> Any:
    """Rank ``rank``'s object in each case of the issue's table."""
    if case == "all 1 KB":
        return {"r": rank, "b": b"s" * 1000}
    if case == "all 1 MB":
        return {"r": rank, "b": b"l" * (1 << 20)}
    if case == "one 20 MB":
        return {"r": rank, "b": b"o" * ((20 << 20) if rank == 1 else 1000)}
    if case == "two 2 MB":
        return {"r": rank, "b": b"t" * ((2 << 20) if rank in (0, 5) else 1000)}
    if case == "log-normal":
        return {"r": rank, "b": b"n" * int(min(32_000 * random.Random(rank).lognormvariate(0, 2), 8 << 20))}
    if case == "uneven tensors":
        return {"r": rank, "t": torch.arange(64_000 + 2_000 * rank, dtype=torch.float32)}  # 256-312 KB
    raise ValueError(case)


CASES = ["all 1 KB", "all 1 MB", "one 20 MB", "two 2 MB", "log-normal", "uneven tensors"]


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return bool(got == want)


def _comm() -> objcomm.Communicator:
    comm = objcomm.Communicator(local=False, shm=False)
    comm._separate_hosts = True
    return comm


def each_spread(op: str) -> List[Any]:
    """``op`` on every spread: (case, right result, collectives, blocking calls)."""
    comm, rank = _comm(), dist.get_rank()
    rows = []
    for case in CASES:
        obj = spread(case, rank)
        root_obj = spread(case, 1) if rank == 1 else None
        run = {"all_gather": lambda obj=obj: comm.all_gather(obj), "gather": lambda obj=obj: comm.gather(obj, dst=3),
               "broadcast": lambda root_obj=root_obj: comm.broadcast(root_obj, src=1)}[op]
        with calls() as counts:
            got = run()
        if op == "all_gather":
            right = all(_same(g, spread(case, r)) for r, g in enumerate(got))
        elif op == "gather":
            right = all(_same(g, spread(case, r)) for r, g in enumerate(got)) if rank == 3 else got is None
        else:
            right = _same(got, spread(case, 1))
        rows.append((case, right, counts["collectives"], counts["blocking"]))
    return rows


# broadcast: its slot, a vote where a piece is past the scratch size (recursive doubling on gloo: log2(8) = 3
# exchanges), its rest
@pytest.mark.parametrize("op, most", [("all_gather", 3), ("gather", 3), ("broadcast", 2 + 3)])
def test_bounded_calls_whatever_the_spread(op, most):
    for rank, rows in enumerate(get_pool(W).run(each_spread, op, timeout=120)):
        for case, right, collectives, blocking in rows:
            assert right, f"{op}, {case}: a wrong result on rank {rank}"
            assert collectives <= most, f"{op}, {case}: {collectives} collectives on rank {rank}"
            assert blocking == 0, f"{op}, {case}: {blocking} blocking sends/receives on rank {rank}"


def reductions() -> List[Any]:
    """all_reduce and reduce of a small and a large value: results and this rank's calls."""
    comm, rank = _comm(), dist.get_rank()
    rows = []
    for value in (rank + 1, {"b": b"r" * (300_000 + rank)}):
        plus = (lambda a, b: a + b) if isinstance(value, int) else (lambda a, b: {"b": a["b"] + b["b"][:1]})
        with calls() as counts:
            got = comm.all_reduce(value, plus)
            red = comm.reduce(value, plus, dst=2)
        rows.append((got, red, counts["collectives"]))
    return rows


def test_reductions_end_without_an_all_gather_of_slots():
    results = get_pool(W).run(reductions, timeout=120)
    want_big = {"b": b"r" * (300_000 + 3)}  # the tree combines log2(8) = 3 times on group rank 0
    for rank, ((small, small_red, small_calls), (big, big_red, big_calls)) in enumerate(results):
        assert small == sum(range(1, W + 1)) and big == want_big
        assert (small_red, big_red) == ((sum(range(1, W + 1)), want_big) if rank == 2 else (None, None))
        # all_reduce: one broadcast (its value in the slot) or a broadcast and its rest; reduce: a gather of
        # slots and dst's word, then (a value past the slot) one batch; the tree's sends are point to point
        assert small_calls <= 3 and big_calls <= 6, (rank, small_calls, big_calls)


def _forged_table(nbytes: int) -> Outgoing:
    """A frame with one 1,000-byte out-of-band tensor whose table entry announces ``nbytes`` (a lying sender)."""
    out = _frame.encode({"t": torch.ones(1000, dtype=torch.uint8)}, serializers.get("pickle"), max_bytes=1 << 30,
                        inline_tensor_bytes=0)
    frame = bytearray(out.frame)
    entry = _frame.HEADER.size + len(_frame.parse_header(memoryview(frame)).serializer)
    struct.pack_into("<Q", frame, entry + 8, nbytes)  # the entry's byte count
    struct.pack_into("<q", frame, entry + _tensors.ENTRY.size, nbytes)  # its one dimension, so the entry agrees
    return Outgoing(memoryview(frame), out.tensors)


def bad_input(case: str) -> str:
    """What each rank raises when one rank misbehaves on the paths above."""
    comm, rank = _comm(), dist.get_rank()
    try:
        if case == "over the destination's limit":
            comm.gather(b"x" * ((1 << 20) if rank == 6 else 10), dst=3, max_bytes=(1 << 19) if rank == 3 else None)
        elif case == "over a receiver's limit":
            comm.all_gather(b"x" * ((1 << 20) if rank == 6 else 10), max_bytes=(1 << 19) if rank == 2 else None)
        elif case == "a failing encode (gather)":
            comm.gather(object() if rank == 5 else rank, dst=0, serializer="json")
        elif case == "a failing encode (all_gather)":
            comm.all_gather(object() if rank == 5 else b"x" * 100_000, serializer="json")
        elif case == "a lying sender":
            if rank == 4:
                _rounds.gather(comm._call({}).wire, _forged_table(1 << 40), _frame.tensor_sizes, 0)
            else:
                comm.gather({"t": torch.ones(1000, dtype=torch.uint8)}, dst=0)
        return "no error"
    except objcomm.ObjcommError as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"


@pytest.mark.parametrize("case", ["over the destination's limit", "over a receiver's limit",
                                  "a failing encode (gather)", "a failing encode (all_gather)", "a lying sender"])
def test_bad_input_gets_the_same_error_on_every_rank(case):
    outcomes = get_pool(W).run(bad_input, case, timeout=120)
    assert len(set(outcomes)) == 1, outcomes
    assert outcomes[0] != "no error"
    expected = {"over the destination's limit": "TooLargeError", "over a receiver's limit": "TooLargeError",
                "a failing encode (gather)": "RemoteError", "a failing encode (all_gather)": "RemoteError",
                "a lying sender": "FrameError"}[case]
    assert outcomes[0].startswith(expected), outcomes[0]


def simulated_hosts() -> List[Any]:
    """With ``OBJCOMM_TEST_RANKS_PER_HOST=4``: the whole group (two simulated hosts) takes the backend and gets
    what every rank sent; a group inside one simulated host takes its same-host channel (no backend call)."""
    os.environ["OBJCOMM_TEST_RANKS_PER_HOST"] = "4"
    previous = objcomm.configure()
    try:
        rank, comm = dist.get_rank(), objcomm.Communicator()
        rows: List[Any] = []
        for case in CASES:
            got = comm.all_gather(spread(case, rank))
            rows.append(all(_same(g, spread(case, r)) for r, g in enumerate(got)))
        hosts = [dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5, 6, 7])]  # every rank makes both, in order
        inside = objcomm.Communicator(group=hosts[rank // 4])
        inside.all_gather(rank)
        with calls() as counts:
            got = inside.all_gather(rank)
        with calls() as whole:
            everyone = comm.all_gather(rank)
        rows.append((got, counts["collectives"], everyone == list(range(W)), whole["collectives"]))
        return rows
    finally:
        del os.environ["OBJCOMM_TEST_RANKS_PER_HOST"]
        objcomm.restore(previous)


def test_simulated_hosts_of_four_ranks():
    for rank, rows in enumerate(get_pool(W).run(simulated_hosts, timeout=120)):
        assert rows[:-1] == [True] * len(CASES), (rank, rows[:-1])
        got, collectives, whole, whole_calls = rows[-1]
        assert got == [r for r in range(W) if r // 4 == rank // 4] and collectives == 0, (rank, rows[-1])
        assert whole and whole_calls == 1, (rank, rows[-1])  # two hosts: round 1 through the backend


def votes_off_a_power_of_two() -> Any:
    """A broadcast that votes first (its rest is past the scratch size), through the group of a world that is no
    power of two: the vote's recursive doubling hands the extra ranks' words over and back; a receiver over its
    limit makes every rank raise."""
    comm, rank = _comm(), dist.get_rank()
    got = comm.broadcast(b"x" * (3 << 20) if rank == 1 else None, src=1)
    try:
        comm.broadcast(b"y" * (3 << 20) if rank == 1 else None, src=1, max_bytes=(1 << 20) if rank == 2 else None)
        refused = "no error"
    except objcomm.ObjcommError as exc:
        refused = type(exc).__name__
    return got == b"x" * (3 << 20), refused


def test_votes_on_a_world_that_is_no_power_of_two():
    assert get_pool(3).run(votes_off_a_power_of_two, timeout=60) == [(True, "TooLargeError")] * 3
