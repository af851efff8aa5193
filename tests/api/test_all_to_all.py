"""all_to_all of objects on real gloo groups of 1-4 ranks: every serializer, uneven pairs, tensors, failures."""

from __future__ import annotations

import threading
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from _builtins import ON_RANKS
from _ranks import get_pool

import objcomm
from objcomm._api.resolving import Hooks
from objcomm._state import group_facts

pytestmark = pytest.mark.timeout(180)

SERIALIZERS = ON_RANKS
LAYOUTS = {
    "default": {"shm": False},
    "tiny": {"shm": False, "slot_bytes": 128, "chunk_bytes": 1000},
    "shm": {"shm": True, "shm_threshold": 1024},
}
BIG = 300_000


def part(src: int, dst: int, kind: str) -> Any:
    """What ``src`` sends ``dst``: sizes differ per pair, some empty, one pair far bigger than the rest."""
    if kind == "empty":
        return ""
    if kind == "uneven":
        return "x" * (src * 7 + dst * 3)
    if kind == "one-big-pair":
        return "B" * BIG if (src, dst) == (0, dist.get_world_size() - 1) else f"{src}->{dst}"
    if kind == "records":
        return [{"src": src, "dst": dst, "i": i, "v": i / 3} for i in range(dst * 40)]
    raise ValueError(kind)


def every_kind(serializer: str, layout: str) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator(serializer=serializer, **LAYOUTS[layout])
    kinds = ["empty", "uneven", "one-big-pair", "records"]
    for kind in kinds:
        got = comm.all_to_all([part(rank, dst, kind) for dst in range(world)])
        assert got == [part(src, rank, kind) for src in range(world)], kind
    return len(kinds)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("serializer", SERIALIZERS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_serializer_every_shape(world, serializer, layout):
    assert get_pool(world).run(every_kind, serializer, layout) == [4] * world


def tensors_inside(layout: str) -> List[bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator(**LAYOUTS[layout])

    def tensor(src: int, dst: int) -> torch.Tensor:
        return torch.arange((src + 1) * (dst + 1) * 1000, dtype=torch.float32) + src

    got = comm.all_to_all([{"t": tensor(rank, dst), "n": dst} for dst in range(world)])
    mine = comm.all_to_all([tensor(rank, dst) for dst in range(world)])
    return [torch.equal(g["t"], tensor(src, rank)) and g["n"] == rank for src, g in enumerate(got)] + [
        torch.equal(t, tensor(src, rank)) for src, t in enumerate(mine)
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tensors_travel_as_tensors(layout):
    for checks in get_pool(3).run(tensors_inside, layout):
        assert checks == [True] * 6


def failing(position: int, how: str) -> Dict[str, Any]:
    """Rank ``position`` cannot encode its part for the next rank, or gives a list of the wrong length."""
    rank, world = dist.get_rank(), dist.get_world_size()
    objs: List[Any] = [f"{rank}->{dst}" for dst in range(world)]
    if rank == position:
        if how == "encode":
            objs[(rank + 1) % world] = threading.Lock()
        else:
            objs = objs[:-1]
    try:
        objcomm.all_to_all(objs)
        outcome: Any = "returned"
    except objcomm.RemoteError as exc:
        outcome = {
            "ranks": exc.ranks,
            "types": [t for t, _ in exc.failures.values()],
            "cause": type(exc.__cause__).__name__ if exc.__cause__ else None,
        }
    after = objcomm.all_to_all([(rank, dst) for dst in range(world)])  # the group is still usable
    return {"outcome": outcome, "after": after == [(src, rank) for src in range(world)]}


@pytest.mark.parametrize("how", ["encode", "wrong-length"])
@pytest.mark.parametrize("position", [0, 2, 3])
def test_a_failing_rank_fails_the_call_on_every_rank(position, how):
    results = get_pool(4).run(failing, position, how)
    expected_type = "TypeError" if how == "encode" else "ValueError"
    for rank, result in enumerate(results):
        assert result["after"]
        assert result["outcome"]["ranks"] == [position] and result["outcome"]["types"] == [expected_type]
        assert (result["outcome"]["cause"] is not None) == (rank == position)


def refusals() -> Dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    outcomes: Dict[str, Any] = {}
    limit = 10_000 if rank == 0 else None
    try:  # the others send rank 0 more than it accepts: every rank raises before anything big moves
        objcomm.all_to_all(["y" * (50_000 if rank else 10) for _ in range(world)], max_bytes=limit)
        outcomes["max_bytes"] = "returned"
    except objcomm.TooLargeError:
        outcomes["max_bytes"] = "TooLargeError"
    try:  # rank 0 accepts msgpack only; the others send pickle: rank 0 refuses what arrives, alone
        got = objcomm.all_to_all([{"to": dst} for dst in range(world)], accept=["msgpack"] if rank == 0 else None)
        outcomes["accept"] = got == [{"to": rank}] * world
    except objcomm.ContentRefusedError:
        outcomes["accept"] = "ContentRefusedError"
    outcomes["after"] = objcomm.all_to_all(list(range(world))) == [rank] * world
    return outcomes


def test_max_bytes_and_accept_refusals():
    results = get_pool(3).run(refusals)
    assert [r["max_bytes"] for r in results] == ["TooLargeError"] * 3
    assert [r["accept"] for r in results] == ["ContentRefusedError", True, True]
    assert all(r["after"] for r in results)


def in_a_subgroup() -> Any:
    group = dist.new_group([1, 2, 3])
    rank = dist.get_rank()
    if rank == 0:
        return None
    comm = objcomm.Communicator(group)
    return comm.all_to_all([f"{rank}->{dst}" for dst in (1, 2, 3)])


def test_a_subgroup_uses_group_ranks():
    assert get_pool(4).run(in_a_subgroup) == [None] + [[f"{src}->{dst}" for src in (1, 2, 3)] for dst in (1, 2, 3)]


def counted_segments(shm: bool) -> int:
    """How many segments this rank wrote for one all_to_all with big parts."""
    from objcomm._samehost import segments as _segments

    class Counting(_segments.SegmentBook):
        created = 0

        def create(self, path: str, frame: Any, tensors: Any) -> Any:
            Counting.created += 1
            return super().create(path, frame, tensors)

        def create_sealed(self, frame: Any, tensors: Any) -> Any:
            Counting.created += 1
            return super().create_sealed(frame, tensors)

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator(shm=shm, shm_threshold=1024, _hooks=Hooks(segments=Counting()))
    got = comm.all_to_all([{"blob": bytes([rank]) * 5000, "t": torch.full((500,), dst)} for dst in range(world)])
    assert [g["blob"] for g in got] == [bytes([src]) * 5000 for src in range(world)]
    assert all(torch.equal(g["t"], torch.full((500,), rank)) for g in got)
    return Counting.created


def test_big_parts_go_through_shared_memory_on_one_host():
    assert get_pool(3).run(counted_segments, True) == [2, 2, 2]  # one per other rank
    assert get_pool(3).run(counted_segments, False) == [0, 0, 0]


def _outcome(fn: Any) -> Any:
    try:
        return ("ok", fn())
    except Exception as exc:  # the outcome is what it raised, by type
        return ("raised", type(exc).__name__)


def tensors_at_odd_offsets() -> List[Any]:
    """Parts whose tensors land at offsets of one receive buffer their dtype cannot start at: an odd-length uint8
    tensor from one rank next to float tensors from the others, and a frame of odd length past the slot."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def mine(s: int) -> torch.Tensor:
        return torch.ones(70_001, dtype=torch.uint8) if s == 0 else torch.arange(100_000.0) + s

    def framed(s: int) -> Dict[str, Any]:
        return {"s": "x" * (5001 + s), "t": torch.arange(100_000.0) + s}

    plain = objcomm.Communicator(shm=False)  # one receive buffer for every part
    return [
        _outcome(lambda: [torch.equal(g, mine(s)) for s, g in enumerate(plain.all_to_all([mine(rank)] * world))]),
        _outcome(
            lambda: [
                torch.equal(g["t"], framed(s)["t"]) for s, g in enumerate(plain.all_to_all([framed(rank)] * world))
            ]
        ),
    ]


def test_tensors_arriving_at_any_offset_decode():
    for got in get_pool(3).run(tensors_at_odd_offsets):
        assert got == [("ok", [True] * 3)] * 2


def with_the_parts_table_of(world_at_8192: bool) -> List[Any]:
    """all_to_all and scatter with each part's slot as at 8192 ranks (routes.PARTS_TABLE made so that this group's
    slots come out at routes.PART_SLOT_LEAST, 512 bytes) or the settings' 4 KiB: parts in the slot, past it, a
    failing encode (its report in the smaller slot), then what each rank got."""
    from objcomm._transport.routes import cutoffs

    rank, world = dist.get_rank(), dist.get_world_size()
    saved, routes_made = cutoffs.PARTS_TABLE, group_facts(dist.group.WORLD).routes
    if world_at_8192:
        cutoffs.PARTS_TABLE = world * cutoffs.PART_SLOT_LEAST
    routes_made.clear()  # (a group's route reads the cut-offs once: routes.calls)
    try:
        comm = objcomm.Communicator(shm=False)
        got: List[Any] = []
        for size in (10, 400, 3000, 20_000):
            got.append(comm.all_to_all([f"{rank}>{dst}:" + "p" * size for dst in range(world)]))
            got.append(comm.scatter([f"1>{dst}:" + "s" * size for dst in range(world)] if rank == 1 else None, src=1))
        try:
            comm.all_to_all([threading.Lock() if rank == 2 and dst == 0 else "x" * 100 for dst in range(world)])
        except objcomm.RemoteError as exc:
            got.append((exc.ranks, [t for t, _ in exc.failures.values()], "cannot pickle" in str(exc)))
        return [got, comm._parts_of(comm._call({})).wire.slot]  # (and the part slot these calls took)
    finally:
        cutoffs.PARTS_TABLE = saved
        routes_made.clear()


def test_parts_slots_shrink_past_a_table_of_4_mib_with_the_same_results():
    """Past 1024 ranks each part of a scatter or an all_to_all gets a slot smaller than the settings' (routes.part_slot:
    512 bytes at 8192 ranks, where 4 KiB slots made 32 MiB of round 1 on every rank): parts past it take the second
    round, results and failures the same as with 4 KiB slots (forced here on 3 ranks)."""
    (small, slots_small), (whole, slots_whole) = (
        zip(*get_pool(3).run(with_the_parts_table_of, at)) for at in (True, False)
    )
    assert slots_small == (512,) * 3 and slots_whole == (4096,) * 3, (slots_small, slots_whole)
    assert small == whole, (small, whole)
    for rank, got in enumerate(small):
        assert got[0] == [f"{src}>{rank}:" + "p" * 10 for src in range(3)] and got[-1] == ([2], ["TypeError"], True)
