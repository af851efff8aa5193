"""A collective carried out by its row of ``patterns.ROWS`` alone (``Communicator._pattern_call``), on real gloo
groups: a new collective added as a newcomer would (a row, a method), and each built-in row through the same path
giving what the collective's own rounds give, over every medium; its failures raise on every rank."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
from _ranks import get_pool

import objcomm
from objcomm._api.resolving import Hooks
from objcomm._transport import patterns
from objcomm._transport.patterns import Row

pytestmark = pytest.mark.timeout(180)

WAYS = {
    "backend": {"local": False},
    "host": {"shm": False},
    "shm": {"shm": True, "shm_threshold": 1024},
    "hosts": {"_hooks": Hooks(separate_hosts=True)},
    "tiny": {"local": False, "slot_bytes": 128, "chunk_bytes": 1000},
}

# A collective that objcomm does not have: each rank's object to the next rank, around the ring. Its row:
SHIFT = Row(
    root="",
    each=False,
    to=lambda me, world, root: ((me + 1) % world,) if world > 1 else (),
    sources=lambda me, world, root: ((me - 1) % world,) if world > 1 else (),
)


class WithShift(objcomm.Communicator):
    """And its public method: all that adding it takes besides the row."""

    def shift(self, obj: Any, *, async_op: bool = False, **options: Any) -> Any:
        """The object of the rank before this one (group ranks, around the ring)."""
        if async_op:
            return self._submit("shift", WithShift.shift, obj, **options)
        got = self._pattern_call(self._call(options), "shift", obj)
        return got.popitem()[1] if got else obj


def _value(rank: int, size: str) -> Any:
    """Small, past the slot, or with a tensor inside past the shared-memory threshold."""
    if size == "small":
        return {"rank": rank}
    if size == "large":
        return {"rank": rank, "text": "x" * (3000 + 700 * rank)}
    return {"rank": rank, "t": torch.arange(20_000 + rank, dtype=torch.float32) + rank}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def shifted(way: str) -> List[bool]:
    patterns.ROWS.setdefault("shift", SHIFT)
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = WithShift(**WAYS[way])
    sizes = ("small", "large", "tensor")
    started = [comm.shift(_value(rank, size), async_op=True) for size in sizes]
    return [_same(comm.shift(_value(rank, size)), _value((rank - 1) % world, size)) for size in sizes] + [
        _same(request.wait(), _value((rank - 1) % world, size)) for request, size in zip(started, sizes)
    ]


@pytest.mark.parametrize("way", WAYS)
def test_a_collective_added_as_a_row_and_a_method_works_over_every_medium(way):
    assert get_pool(4).run(shifted, way) == [[True] * 6] * 4


def built_in_rows(way: str) -> List[str]:
    """Each built-in collective's row through ``_pattern_call``, shaped into the collective's result, against the
    collective itself: the names of those that differ."""
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator(**WAYS[way])
    differ = []
    for size in ("small", "large", "tensor"):
        mine = _value(rank, size)
        parts = [_value(rank * 10 + r, size) for r in range(world)]
        root = world - 1

        def carried(op: str, obj: Any, root: Optional[int] = None) -> Dict[int, Any]:
            return comm._pattern_call(comm._call({}), op, obj, root)

        got = carried("all_gather", mine)
        if not _same([got.get(r, mine) for r in range(world)], comm.all_gather(mine)):
            differ.append(f"all_gather {size}")
        got = carried("gather", mine, root)
        gathered = [got.get(r, mine) for r in range(world)] if rank == root else None
        if not _same(gathered, comm.gather(mine, dst=root)) or (rank != root and got):
            differ.append(f"gather {size}")
        got = carried("broadcast", mine, root)
        if not _same(got.get(root, mine), comm.broadcast(mine, src=root)):
            differ.append(f"broadcast {size}")
        got = carried("scatter", parts if rank == root else None, root)
        own = parts[rank] if rank == root else got[root]
        if not _same(own, comm.scatter(parts if rank == root else None, src=root)):
            differ.append(f"scatter {size}")
        got = carried("all_to_all", parts)
        if not _same([got.get(r, parts[r]) for r in range(world)], comm.all_to_all(parts)):
            differ.append(f"all_to_all {size}")
    return differ


@pytest.mark.parametrize("way", WAYS)
def test_every_built_in_row_carried_by_its_pattern_gives_what_its_own_rounds_give(way):
    assert get_pool(4).run(built_in_rows, way) == [[]] * 4


class Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("this object cannot be pickled")


def failures(way: str) -> Dict[str, str]:
    """A rank whose part cannot be encoded, a scatter-like row's list of the wrong length, and ranks that pass
    different roots: what each rank raised (its type and the first words of its message)."""
    patterns.ROWS.setdefault("shift", SHIFT)
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = WithShift(**WAYS[way])
    raised: Dict[str, str] = {}
    for case, call in {
        "encode": lambda: comm.shift(Unpicklable() if rank == 1 else rank),
        "length": lambda: comm._pattern_call(comm._call({}), "scatter", [1, 2] if rank == 0 else None, 0),
        "roots": lambda: comm._pattern_call(comm._call({}), "broadcast", rank, 0 if rank < 2 else 1),
    }.items():
        try:
            call()
            raised[case] = "returned"
        except Exception as exc:  # noqa: BLE001  (what each rank raised is the test's answer)
            raised[case] = f"{type(exc).__name__}: {exc}"
        assert comm.shift(rank) == (rank - 1) % world  # the group works on after each
    return raised


@pytest.mark.parametrize("way", ["backend", "host"])
def test_its_failures_raise_on_every_rank_saying_what_went_wrong(way):
    for rank, raised in enumerate(get_pool(4).run(failures, way)):
        assert raised["encode"].startswith("RemoteError") and "cannot be pickled" in raised["encode"], rank
        assert raised["length"].startswith("RemoteError") and "exactly one object per rank" in raised["length"], rank
        # ranks 0-1 take rank 0 for the root, ranks 2-3 rank 1. Over the channel every message carries its call's
        # root, and every rank raises; over the backend the ranks whose sources sent nothing where they have one
        # send, or a part where they have none (2 and 3), while 0 and 1 saw what they expected (check_calls: all)
        if way == "host" or rank >= 2:
            assert raised["roots"].startswith("CommunicationError") and "src" in raised["roots"], (rank, raised)
        else:
            assert raised["roots"] == "returned", (rank, raised)


def test_a_row_that_is_not_there_or_sends_a_rank_its_own_part_is_refused_by_name():
    with pytest.raises(ValueError, match="no pattern for 'ring'"):
        patterns.pattern("ring", me=0, world=2)
    patterns.ROWS["to_itself"] = Row("", False, lambda me, world, root: (me,), lambda me, world, root: ())
    try:
        with pytest.raises(ValueError, match="the row of 'to_itself' has rank 1 of 2 send to or receive from itself"):
            patterns.pattern("to_itself", me=1, world=2)
    finally:
        del patterns.ROWS["to_itself"]
