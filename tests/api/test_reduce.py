"""reduce and all_reduce of objects on real gloo groups of 1-4 ranks: rank order, named ops, failures."""

from __future__ import annotations

import math
import operator
import threading
from collections import Counter
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from _builtins import ON_RANKS
from _ranks import get_pool

import objcomm
from objcomm._api import reduce as _reduce
from objcomm._api.resolving import Hooks

pytestmark = pytest.mark.timeout(180)

SERIALIZERS = ON_RANKS


def in_rank_order(serializer: str) -> List[Any]:
    """Concatenation is not commutative: the result shows the order ranks were combined in."""
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator(serializer=serializer, shm=False)
    results = [comm.all_reduce(str(rank), "sum"), comm.all_reduce([rank], lambda a, b: a + b)]
    for dst in range(world):
        results.append(comm.reduce(f"<{rank}>", "sum", dst=dst))
    results.append(comm.all_reduce({f"k{rank}": 1, "all": rank}, "merge_sum"))
    results.append(comm.all_reduce({"who": rank, f"r{rank}": True}, "merge"))
    results.append(
        (
            comm.all_reduce(rank * 10 - 7, "min"),
            comm.all_reduce(rank * 10 - 7, "max"),
            comm.all_reduce(rank + 2, "prod"),
        )
    )
    return results


@pytest.mark.parametrize("serializer", SERIALIZERS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_are_combined_in_order(world, serializer):
    ranks = range(world)
    for rank, got in enumerate(get_pool(world).run(in_rank_order, serializer)):
        assert got[0] == "".join(map(str, ranks)) and got[1] == list(ranks)
        assert got[2 : 2 + world] == ["".join(f"<{r}>" for r in ranks) if dst == rank else None for dst in ranks]
        assert got[2 + world] == {**{f"k{r}": 1 for r in ranks}, "all": sum(ranks)}
        assert got[3 + world] == {"who": world - 1, **{f"r{r}": True for r in ranks}}
        assert got[4 + world] == (-7, 10 * world - 17, math.prod(r + 2 for r in ranks))


_decoded = Counter()


class Counted:
    """Counts how often this rank unpickles one (each decode of an object holding it)."""

    def __init__(self, ranks: List[int]) -> None:
        self.ranks = ranks

    def __reduce__(self) -> Any:
        return (_counted, (self.ranks,))

    def __deepcopy__(self, memo: Any) -> Counted:  # the copy a combining rank makes of its own: not a decode
        return Counted(list(self.ranks))


def _counted(ranks: List[int]) -> Counted:
    _decoded["n"] += 1
    return Counted(ranks)


def decodes(world_op: str) -> Dict[str, Any]:
    rank = dist.get_rank()
    _decoded.clear()
    comm = objcomm.Communicator(shm=False)
    if world_op == "all_reduce":
        result = comm.all_reduce(Counted([rank]), lambda a, b: Counted(a.ranks + b.ranks))
    else:
        result = comm.reduce(Counted([rank]), lambda a, b: Counted(a.ranks + b.ranks), dst=0)
    return {"ranks": None if result is None else result.ranks, "decoded": _decoded["n"]}


@pytest.mark.parametrize("op", ["all_reduce", "reduce"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_no_rank_decodes_more_than_log2_world_objects(world, op):
    results = get_pool(world).run(decodes, op)
    bound = math.ceil(math.log2(world))
    assert max(r["decoded"] for r in results) <= bound, results
    assert results[0]["ranks"] == list(range(world))
    if op == "all_reduce":
        assert all(r["ranks"] == list(range(world)) for r in results)


def tensors_inside(shm: bool) -> List[bool]:
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator(shm=shm, shm_threshold=1024)
    big = comm.all_reduce({"t": torch.full((5000,), float(rank)), "n": 1}, "merge_sum")
    total = comm.all_reduce(torch.arange(4) * rank, "sum")
    return [
        torch.equal(big["t"], torch.full((5000,), float(sum(range(world))))),
        big["n"] == world,
        torch.equal(total, torch.arange(4) * sum(range(world))),
    ]


@pytest.mark.parametrize("shm", [False, True], ids=["group", "shm"])
def test_tensors_inside(shm):
    assert get_pool(3).run(tensors_inside, shm) == [[True] * 3] * 3


def failing(position: int, how: str, op_name: str) -> Dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    obj: Any = {"r": rank}

    def op(a: Any, b: Any) -> Any:
        if how == "op" and rank == position:
            raise KeyError("boom")
        return {**a, **b} if isinstance(a, dict) else a  # a lock on rank 0 stays the value it must encode

    if how == "encode" and rank == position:
        obj = threading.Lock()
    chosen: Any = "no-such-op" if how == "unknown-op" and rank == position else op
    try:
        if op_name == "all_reduce":
            objcomm.all_reduce(obj, chosen)
        else:
            objcomm.reduce(obj, chosen, dst=world - 1)
        outcome: Any = "returned"
    except objcomm.RemoteError as exc:
        outcome = {"ranks": exc.ranks, "types": [t for t, _ in exc.failures.values()]}
    after = objcomm.all_reduce(rank, "sum")  # the group is still usable
    return {"outcome": outcome, "after": after == sum(range(world))}


# ranks that combine (and so call op) in a tree of 4: 0 (children 1, 2) and 2 (child 3); leaves: 1, 3
@pytest.mark.parametrize("op_name", ["all_reduce", "reduce"])
@pytest.mark.parametrize(
    ("position", "how", "expected"),
    [
        (0, "op", "KeyError"),
        (2, "op", "KeyError"),
        (3, "encode", "TypeError"),
        (1, "encode", "TypeError"),
        (0, "encode", "TypeError"),
        (2, "unknown-op", "ValueError"),
    ],
)
def test_a_failure_anywhere_reaches_every_rank(position, how, expected, op_name):
    for result in get_pool(4).run(failing, position, how, op_name):
        assert result["outcome"] == {"ranks": [position], "types": [expected]}
        assert result["after"]


def refused() -> Dict[str, Any]:
    rank = dist.get_rank()
    try:
        objcomm.all_reduce("z" * (50_000 if rank == 1 else 10), "sum", max_bytes=10_000 if rank == 0 else None)
        outcome: Any = "returned"
    except objcomm.RemoteError as exc:
        outcome = sorted(set(t for t, _ in exc.failures.values()))
    try:
        objcomm.all_reduce({"r": rank}, "merge", accept=["msgpack"] if rank == 0 else None)
        accept: Any = "returned"
    except objcomm.RemoteError as exc:
        accept = {r: t for r, (t, _) in exc.failures.items()}
    return {"max_bytes": outcome, "accept": accept, "after": objcomm.all_reduce(1, "sum") == dist.get_world_size()}


def test_max_bytes_and_accept_refusals_reach_every_rank():
    for result in get_pool(2).run(refused):
        assert result["max_bytes"] == ["TooLargeError"]
        assert result["accept"] == {0: "ContentRefusedError"}
        assert result["after"]


def result_over_a_limit() -> Dict[str, Any]:
    """all_reduce whose result (40 KB) passes rank 1's max_bytes though every object (20 KB) is within it, through
    the channel and off it (the result back down the tree)."""
    rank, outcomes = dist.get_rank(), {}
    tree = objcomm.Communicator(local=False, _hooks=Hooks(down_tree=True))  # NCCL's route off the channel
    for route, comm in (
        ("channel", objcomm.Communicator()),
        ("backend", objcomm.Communicator(local=False)),
        ("tree", tree),
    ):
        try:
            comm.all_reduce(b"y" * 20_000, "sum", max_bytes=30_000 if rank == 1 else None)
            outcomes[route] = "returned"
        except objcomm.RemoteError as exc:
            outcomes[route] = {r: t for r, (t, _) in exc.failures.items()}
        outcomes[route + " after"] = comm.all_reduce(b"y" * 20_000, "sum") == b"y" * 40_000
    return outcomes


def test_a_result_over_a_receivers_limit_is_refused_for_every_rank():
    """Group rank 0 learns every rank's max_bytes on the way up the tree, and refuses the result once: every rank
    raises the same (before, the receiver over its limit raised alone, after taking the bytes)."""
    for result in get_pool(2).run(result_over_a_limit):
        assert result == {
            "channel": {0: "TooLargeError"},
            "channel after": True,
            "backend": {0: "TooLargeError"},
            "backend after": True,
            "tree": {0: "TooLargeError"},
            "tree after": True,
        }


def _recording_sizes() -> Any:
    """dist's send/isend and recv/irecv wrapped to record each point-to-point tensor's bytes (``sent``, ``received``);
    ``restore()`` puts them back. (In torch's own module too, whose ``P2POp`` accepts only the functions there.)"""
    from torch.distributed import distributed_c10d

    sent: List[int] = []
    received: List[int] = []
    real = {name: getattr(dist, name) for name in ("send", "isend", "recv", "irecv")}

    inside = threading.local()  # (torch's send and recv may call its isend and irecv: one message, recorded once)

    def wrapped(name: str, into: List[int]) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if getattr(inside, "on", False):
                return real[name](tensor, *args, **kwargs)
            into.append(tensor.numel() * tensor.element_size())
            inside.on = True
            try:
                return real[name](tensor, *args, **kwargs)
            finally:
                inside.on = False

        return call

    for name in real:
        fn = wrapped(name, sent if "send" in name else received)
        setattr(dist, name, fn)
        setattr(distributed_c10d, name, fn)

    def restore() -> None:
        for name, fn in real.items():
            setattr(dist, name, fn)
            setattr(distributed_c10d, name, fn)

    return sent, received, restore


def trees_as_on_a_gpu(gpu: bool) -> Dict[str, Any]:
    """all_reduce, reduce and scan off the channel and down the tree (NCCL's route), with a GPU group's tree messages
    where ``gpu`` (``p2p.GPU_RULES_ON_CPU``: each the envelope, the slot and BACKEND_WHOLE_BYTES of room, a frame's
    rest up to that within it, tensors never): each result, this rank's sends per all_reduce, and the bytes of every
    point-to-point send and receive posted."""
    from objcomm._format.message import SLOT_PREFIX_BYTES
    from objcomm._transport import p2p, patterns

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator(local=False, shm=False, _hooks=Hooks(down_tree=True))
    room = objcomm.Settings().slot_bytes - SLOT_PREFIX_BYTES
    sent, received, restore = _recording_sizes()
    p2p.GPU_RULES_ON_CPU, got = gpu, {}
    edges = patterns.binomial(rank, world)
    try:
        for case, size in (("in the slot", 100), ("with its slot", 20_000), ("past the room", 100_000)):
            obj = f"{rank}" + "v" * size  # "max" keeps one object whole: every message up the tree is one of them
            before = len(sent)
            got[case] = comm.all_reduce(obj, "max") == f"{world - 1}" + "v" * size
            got[case + " sends"] = len(sent) - before
            got[case + " reduce"] = comm.reduce(obj, "max", dst=2) == (
                f"{world - 1}" + "v" * size if rank == 2 else None
            )
            got[case + " scan"] = comm.scan(obj, "max") == f"{rank}" + "v" * size
        before = len(sent)  # a tensor's rest: never with its slot on a GPU group
        oob = objcomm.Communicator(local=False, shm=False, inline_tensor_bytes=0, _hooks=Hooks(down_tree=True))
        summed = oob.all_reduce(torch.full((1000,), rank), "sum")  # (its 8,000 bytes out of band)
        got["tensors"] = torch.equal(summed, torch.full((1000,), 6))
        got["tensors sends"] = len(sent) - before
        try:
            comm.all_reduce("w" * 20_000, lambda a, b: a if rank != 2 else 1 / 0)
            got["op raised"] = "returned"
        except objcomm.RemoteError as exc:
            got["op raised"] = {r: t for r, (t, _) in exc.failures.items()}
        try:  # rank 0's limit, below the 20 KB that come to it with their slots
            comm.all_reduce("0" if rank == 0 else "w" * 20_000, "max", max_bytes=10_000 if rank == 0 else None)
            got["refused"] = "returned"
        except objcomm.RemoteError as exc:
            got["refused"] = {r: t for r, (t, _) in exc.failures.items()}
        got["after"] = comm.all_reduce(str(rank), "sum") == "0123"
    finally:
        p2p.GPU_RULES_ON_CPU = False
        restore()
    got["edges"] = (edges.parent is not None) + len(edges.children)  # an all_reduce's sends: up once, down each child
    got["sent"], got["received"], got["room"] = sent, received, room
    return got


def test_a_gpu_groups_tree_messages_run_on_gloo():
    """On a GPU group (NCCL moves exact sizes) every message of a reduction's tree or a scan is the envelope, the slot
    and BACKEND_WHOLE_BYTES of room, and a rest of its frame alone up to that comes with its slot: an edge is one
    message where the slot, then the rest, were two (the scale model's all_reduce log-normal on NCCL: 2.06x -> 1.13x
    the ideal). Run on gloo with those rules: every result and failure as on a CPU group, every send exactly as long
    as the receive posted for it (with a CPU group's rules they differ: gloo takes a shorter message), and the
    messages per edge ``routes.tree_messages`` counts for the plan."""
    from objcomm._transport import routes

    cpu_rules = get_pool(4).run(trees_as_on_a_gpu, False)
    gpu_rules = get_pool(4).run(trees_as_on_a_gpu, True)
    chunk = objcomm.Settings().chunk_bytes
    for rules, every in (("cpu", cpu_rules), ("gpu", gpu_rules)):
        for rank, got in enumerate(every):
            for case in ("in the slot", "with its slot", "past the room"):
                assert got[case] and got[case + " reduce"] and got[case + " scan"], (rules, rank, case)
            assert got["tensors"] and got["after"], (rules, rank)
            assert got["op raised"] == {2: "ZeroDivisionError"}, (rules, rank, got["op raised"])
            assert set(got["refused"].values()) == {"TooLargeError"}, (rules, rank, got["refused"])
            assert got["refused"] == cpu_rules[rank]["refused"], (rules, rank)
        sent = sorted(n for got in every for n in got["sent"])
        received = sorted(n for got in every for n in got["received"])
        assert (sent == received) == (rules == "gpu"), rules  # NCCL's rule: each send as long as its receive
    for rank, got in enumerate(gpu_rules):
        for case, size in (("in the slot", 100), ("with its slot", 20_000), ("past the room", 100_000)):
            frame = size + 60  # (the frame's own bytes: a few dozen past the string)
            rest = 0 if frame <= got["room"] else frame
            per_edge = routes.tree_messages(rest, cpu=False, listed=True, chunk=chunk)
            assert got[case + " sends"] == got["edges"] * per_edge, (rank, case, got[case + " sends"])
        per_edge = routes.tree_messages(8000, cpu=False, listed=True, chunk=chunk, tensors=True)
        assert got["tensors sends"] == got["edges"] * per_edge == got["edges"] * 2, (rank, got["tensors sends"])
    assert [got["with its slot sends"] for got in gpu_rules] == [got["edges"] for got in gpu_rules]  # one an edge


def in_a_subgroup() -> Any:
    group = dist.new_group([1, 2, 3])
    rank = dist.get_rank()
    if rank == 0:
        return None
    return objcomm.all_reduce(str(rank), "sum", group=group), objcomm.reduce([rank], "sum", dst=3, group=group)


def test_a_subgroup_combines_in_group_rank_order():
    assert get_pool(4).run(in_a_subgroup) == [None, ("123", None), ("123", None), ("123", [1, 2, 3])]


def test_without_a_group_the_object_comes_back():
    assert objcomm.all_reduce({"a": 1}, "merge") == {"a": 1}
    assert objcomm.reduce([1], "sum") == [1]
    with pytest.raises(ValueError, match="op must be a callable"):
        objcomm.all_reduce(1, "average")


def result_that_cannot_be_encoded() -> Any:
    """reduce to rank 0: rank 0 combined the result and keeps it, so it is never encoded (it cannot be: a lock)."""
    try:
        return type(objcomm.reduce(dist.get_rank(), lambda a, b: (a, b, threading.Lock()), dst=0)).__name__
    except Exception as exc:  # the outcome is what it raised
        return type(exc).__name__


def test_a_reduce_to_rank_0_never_encodes_its_result():
    assert get_pool(2).run(result_that_cannot_be_encoded) == ["tuple", "NoneType"]


def merged_type() -> List[str]:
    return [type(objcomm.all_reduce(Counter({"a": 1}), op)).__name__ for op in ("merge", "merge_sum")]


def test_merges_keep_the_first_dicts_type_at_every_world_size():
    assert get_pool(1).run(merged_type) == [["Counter", "Counter"]]
    assert get_pool(2).run(merged_type) == [["Counter", "Counter"]] * 2


def own_object_back() -> List[bool]:
    """Group rank 0 holds the largest list: "max" returns that very object there, as a user's op may."""
    mine = [10 - dist.get_rank()]
    return [
        objcomm.all_reduce(mine, "max") is mine,
        objcomm.reduce(mine, "max", dst=0) is mine,
        objcomm.all_reduce(mine, lambda a, b: a) == [10],
    ]


def test_group_rank_0_never_gets_its_own_object_back():
    """Every rank gets a copy of the result, rank 0 too (a helper's find: there, mutating the result of a "max" that
    rank 0's object won changed that object; mpi4py returns a copy)."""
    assert get_pool(2).run(own_object_back) == [[False, False, True], [False, False, True]]


def updates_in_place() -> List[Any]:
    """Functions that update their first argument and return it (dict.update, list.extend, +=), as mpi4py allows."""
    rank = dist.get_rank()
    counts, seen, total = {f"r{rank}": rank}, [rank], torch.tensor([float(rank)])

    def merge(a: Dict[str, int], b: Dict[str, int]) -> Dict[str, int]:
        a.update(b)
        return a

    def extend(a: List[int], b: List[int]) -> List[int]:
        a.extend(b)
        return a

    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a += b
        return a

    results = [objcomm.all_reduce(counts, merge), objcomm.reduce(seen, extend, dst=0), objcomm.all_reduce(total, add)]
    return [counts, seen, total.item(), results[0], results[1], results[2].item()]


def test_an_op_that_updates_its_first_argument_leaves_every_rank_s_object_as_it_was():
    """A port's find: ranks 0 and 2 of 4, which combine their children's objects with their own, found their own
    dict, list and tensor overwritten by a partial result (mpi4py combines unpickled copies)."""
    got = get_pool(4).run(updates_in_place)
    everyone = {f"r{r}": r for r in range(4)}
    for rank, (counts, seen, total, merged, extended, summed) in enumerate(got):
        assert (counts, seen, total) == ({f"r{rank}": rank}, [rank], float(rank))
        assert merged == everyone and summed == 6.0
        assert extended == ([0, 1, 2, 3] if rank == 0 else None)


WAYS = {"backend": {"local": False}, "hosts": {"_hooks": Hooks(separate_hosts=True)}, "host": {}}


def ops_that_differ(way: str) -> Dict[str, Any]:
    """Each call with one rank's op not the others': every rank raises, where they returned a mixture of both."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(**WAYS[way])
    first = lambda a, b: a + b  # noqa: E731
    second = lambda a, b: a + b  # noqa: E731  (the same code on another line: another function)
    calls = {
        "all_reduce": lambda: comm.all_reduce(rank + 1, "max" if rank == 3 else "sum"),
        "reduce": lambda: comm.reduce(rank + 1, "max" if rank == 1 else "sum", dst=2),
        "scan": lambda: comm.scan(rank + 1, "prod" if rank == 2 else "sum"),
        "exscan": lambda: comm.exscan(rank + 1, "prod" if rank == 3 else "sum"),
        "functions": lambda: comm.all_reduce([rank], second if rank == 2 else first),
    }
    out: Dict[str, Any] = {}
    for name, call in calls.items():
        try:
            out[name] = f"returned {call()!r}"
        except objcomm.RemoteError as exc:
            out[name] = [(t, "passed another op than this rank's" in m) for t, m in exc.failures.values()]
    # the same op, named on one rank and the function it names on another; and the group goes on
    out["same"] = comm.all_reduce(rank + 1, operator.add if rank == 1 else "sum")
    return out


@pytest.mark.parametrize("way", list(WAYS))
def test_ranks_that_pass_different_ops_all_raise_saying_so(way):
    for outcome in get_pool(4).run(ops_that_differ, way):
        for name in ("all_reduce", "reduce", "scan", "exscan", "functions"):
            assert set(outcome[name]) == {("ValueError", True)}, name  # (the ranks that met it: one, or two in a scan)
        assert outcome["same"] == 10


def test_an_op_is_marked_alike_on_every_rank_that_passes_it():
    """op_flags: the name of NAMED_OPS also for the function it names; a function by module, name and first line."""
    first = lambda a, b: a + b  # noqa: E731
    second = lambda a, b: a + b  # noqa: E731
    assert _reduce.op_name(operator.add) == _reduce.op_name("sum") == "sum"
    assert _reduce.op_name(max) == "max" and _reduce.op_name(_reduce.NAMED_OPS["merge"]) == "merge"
    assert _reduce.op_name(first) != _reduce.op_name(second)
    assert _reduce.op_name(first).startswith(f"{__name__}.test_an_op_is_marked_alike_on_every_rank_that_passes_it.")
    marks = {_reduce.op_flags(op) for op in ("sum", "prod", "min", "max", "merge", "merge_sum")}
    assert len(marks) == 6 and all(m & 1 == 0 and 2 <= m <= 254 for m in marks)  # bits 1-7: bit 0 is the error flag
