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


# A row that breaks on one rank only: the root sends to itself too
TO_THE_ROOT_TOO = Row(
    root="dst",
    each=False,
    to=lambda me, world, root: (root,),
    sources=lambda me, world, root: tuple(r for r in range(world) if r != me) if me == root else (),
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


def shifted(way: str, comm: Optional[WithShift] = None) -> List[bool]:
    patterns.add_row("shift", SHIFT)
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = comm or WithShift(**WAYS[way])
    sizes = ("small", "large", "tensor")
    started = [comm.shift(_value(rank, size), async_op=True) for size in sizes]
    return [_same(comm.shift(_value(rank, size)), _value((rank - 1) % world, size)) for size in sizes] + [
        _same(request.wait(), _value((rank - 1) % world, size)) for request, size in zip(started, sizes)
    ]


@pytest.mark.parametrize("way", WAYS)
def test_a_collective_added_as_a_row_and_a_method_works_over_every_medium(way):
    assert get_pool(4).run(shifted, way) == [[True] * 6] * 4


def built_in_rows(way: str, comm: Optional[objcomm.Communicator] = None) -> List[str]:
    """Each built-in collective's row through ``_pattern_call``, shaped into the collective's result, against the
    collective itself: the names of those that differ."""
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = comm or objcomm.Communicator(**WAYS[way])
    differ = []
    for size in ("small", "large", "tensor"):
        mine = _value(rank, size)
        parts = [_value(rank * 10 + r, size) for r in range(world)]
        root = world - 1

        def carried(op: str, obj: Any, root: Optional[int] = None, size: str = size) -> Dict[int, Any]:
            got = comm._pattern_call(comm._call({}), op, obj, root)
            if sorted(got) != list(patterns.pattern(op, me=rank, world=world, root=root).sources):
                differ.append(f"{op} {size}: from {sorted(got)}")
            return got

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


def on_two_levels() -> List[Any]:
    """Hosts of four consecutive ranks (each host's channel, its leader on the backend): the added collective and
    every built-in row carried by its pattern, as above."""
    from test_many_ranks import ranks_per_host

    with ranks_per_host(4):
        comm = WithShift()
        comm.all_gather(dist.get_rank())  # sets the two levels up
        return [shifted("", comm), built_in_rows("", comm)]


def test_on_two_levels_too():
    world = 8
    assert get_pool(world).run(on_two_levels, timeout=180) == [[[True] * 6, []]] * world


class Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("this object cannot be pickled")


def failures(way: str) -> Dict[str, str]:
    """A rank whose part cannot be encoded, a scatter-like row's list of the wrong length, a row that breaks on one
    rank, and ranks that pass different roots (with check_calls too): what each rank raised (its type and its
    message)."""
    patterns.add_row("shift", SHIFT)
    patterns.add_row("to_the_root_too", TO_THE_ROOT_TOO)
    rank, world = dist.get_rank(), dist.get_world_size()
    comm, checked = WithShift(**WAYS[way]), WithShift(check_calls=True, **WAYS[way])
    raised: Dict[str, str] = {}
    for case, call in {
        "encode": lambda: comm.shift(Unpicklable() if rank == 1 else rank),
        "length": lambda: comm._pattern_call(comm._call({}), "scatter", [1, 2] if rank == 0 else None, 0),
        "row": lambda: comm._pattern_call(comm._call({}), "to_the_root_too", rank, 2),
        "roots": lambda: comm._pattern_call(comm._call({}), "broadcast", rank, 0 if rank < 2 else 1),
        "roots, check_calls": lambda: checked._pattern_call(checked._call({}), "broadcast", rank, 0 if rank < 2 else 1),
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
        assert raised["row"].startswith("RemoteError") and "gives rank 2 of 4 the ranks (2,)" in raised["row"], rank
        # ranks 0-1 take rank 0 for the root, ranks 2-3 rank 1. Over the channel every message carries its call's
        # root, and every rank raises; over the backend the ranks whose sources sent nothing where they have one
        # send, or a part where they have none (2 and 3), while 0 and 1 saw what they expected (check_calls: all)
        if way == "host" or rank >= 2:
            assert raised["roots"].startswith("CommunicationError") and "src" in raised["roots"], (rank, raised)
        else:
            assert raised["roots"] == "returned", (rank, raised)
        said = raised["roots, check_calls"]  # every rank, before anything moves, naming the calls
        assert said.startswith("CommunicationError") and "broadcast(src=0)" in said and "src=1" in said, (rank, said)


def test_a_row_that_is_not_there_or_gives_ranks_a_row_cannot_is_refused_by_name():
    with pytest.raises(ValueError, match="no pattern for 'ring'"):
        patterns.pattern("ring", me=0, world=2)
    nobody = lambda me, world, root: ()  # noqa: E731
    bad = {  # (to, sources, what rank 0 of 2 or 1 of 3 is given)
        "to_itself": (lambda me, world, root: (me,), nobody, "rank 0 of 2 the ranks \\(0,\\)"),
        "past_the_group": (lambda me, world, root: (me - 1,), nobody, "rank 0 of 2 the ranks \\(-1,\\)"),
        "twice": (lambda me, world, root: (1 - me, 1 - me), nobody, "rank 0 of 2 the ranks \\(1, 1\\)"),
        "from_past_it": (nobody, lambda me, world, root: (world,), "rank 0 of 2 the ranks \\(2,\\)"),
        "out_of_order": (
            nobody,
            lambda me, world, root: (2, 0) if world == 3 else (),
            "rank 1 of 3 the ranks \\(2, 0\\)",
        ),
    }
    for name, (to, sources, said) in bad.items():
        patterns.add_row(name, Row("", False, to, sources))
        try:
            with pytest.raises(ValueError, match=f"the row of '{name}' gives {said}: a row's ranks are other ranks"):
                patterns.pattern(name, me=0, world=2)
                patterns.pattern(name, me=1, world=3)
        finally:
            patterns.remove_row(name)
    assert not set(bad) & set(patterns.ROWS)


def test_a_row_is_added_once_under_a_name_of_its_own():
    patterns.add_row("shift", SHIFT)
    try:
        patterns.add_row("shift", Row("", False, SHIFT.to, SHIFT.sources))  # an equal row again: nothing
        assert patterns.pattern("shift", me=0, world=3).to == (1,)
        with pytest.raises(ValueError, match="'shift' has another row already: remove_row\\('shift'\\) first"):
            patterns.add_row("shift", Row("", False, SHIFT.sources, SHIFT.to))
        for name in ("broadcast", "all_reduce", "scan"):
            with pytest.raises(ValueError, match=f"'{name}' is a built-in collective"):
                patterns.add_row(name, SHIFT)
        with pytest.raises(ValueError, match="a row's root is 'src', 'dst' or ''"):
            patterns.add_row("rooted", Row("root", False, SHIFT.to, SHIFT.sources))
        with pytest.raises(ValueError, match="'gather' is a built-in collective's row"):
            patterns.remove_row("gather")
    finally:
        patterns.remove_row("shift")
    patterns.add_row("shift", Row("", False, SHIFT.sources, SHIFT.to))  # removed, its patterns with it: another row
    try:
        assert patterns.pattern("shift", me=0, world=3).to == (2,)
    finally:
        patterns.remove_row("shift")


def test_a_call_that_names_no_row_or_a_root_its_row_has_not_is_refused():
    comm = WithShift()
    with pytest.raises(ValueError, match="no pattern for 'ring'"):
        comm._pattern_call(comm._call({}), "ring", 1)
    with pytest.raises(ValueError, match="all_gather takes no root, got 0"):
        comm._pattern_call(comm._call({}), "all_gather", 1, 0)
