"""objcomm.collect_results: per-rank results back in dataset order, with a real DistributedSampler."""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import objcomm
from objcomm import collect_results

pytestmark = pytest.mark.timeout(120)

N = 11  # divides by neither 2 nor 3, so the sampler pads (drop_last=False) or drops (drop_last=True)


def result(index: int) -> Dict[str, Any]:
    """What 'evaluating' dataset item ``index`` gives; distinct per item so order mistakes show."""
    return {"index": index, "square": index * index, "pair": (index, -index)}


def evaluate_with_sampler(n: int, shuffle: bool, drop_last: bool) -> dict:
    """Evaluate this rank's shard through a DataLoader, then collect it four ways."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = list(range(n))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, drop_last=drop_last, seed=7)
    sampler.set_epoch(3)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    part = [result(int(i)) for batch in loader for i in batch]
    return {
        "evaluated": list(sampler),
        "indexed_dst0": collect_results(part, n, indices=sampler),
        "indexed_everywhere": collect_results(part, n, dst=None, indices=list(sampler), serializer="msgpack"),
        "strided_last": collect_results(part, n, dst=world - 1),
    }


@pytest.mark.parametrize("drop_last", [False, True], ids=["pad", "drop"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("world", [2, 3])
def test_distributed_sampler_results_come_back_in_dataset_order(world, shuffle, drop_last):
    from _ranks import get_pool

    seen = get_pool(world).run(evaluate_with_sampler, N, shuffle, drop_last)
    evaluated = [set(s["evaluated"]) for s in seen]
    if drop_last:  # the sampler skipped the last N % world items of its (maybe shuffled) order
        kept = sorted(set().union(*evaluated))
        assert len(kept) == N - N % world
    else:
        kept = list(range(N))
        assert set().union(*evaluated) == set(kept)  # ... and padded with repeats
        assert sum(len(s["evaluated"]) for s in seen) > N
    in_order = [result(i) for i in kept]

    assert seen[0]["indexed_dst0"] == in_order
    assert [s["indexed_dst0"] for s in seen[1:]] == [None] * (world - 1)
    assert [s["indexed_everywhere"] for s in seen] == [in_order] * world  # msgpack keeps the tuples

    strided = seen[world - 1]["strided_last"]
    assert [s["strided_last"] for s in seen[:-1]] == [None] * (world - 1)
    if not shuffle:  # rank r held r, r+W, ...: no indices needed
        prefix = list(range(N)) if not drop_last else list(range(N - N % world))
        assert strided == [result(i) for i in prefix]
    else:  # why indices= exists: interleaving a shuffled shard gives the sampler's order, not the dataset's
        assert [r["index"] for r in strided] != sorted(r["index"] for r in strided)


def unequal_shards(n: int) -> list:
    """Unpadded ``dataset[rank::world]`` shards have lengths that differ by one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    part = [result(i) for i in range(rank, n, world)]
    collected = collect_results(part, dst=None)
    parts = objcomm.all_gather(part)
    seed_style = [item for round_ in zip(*parts) for item in round_]  # collect_results_gpu's merge
    return [collected, len(seed_style)]


@pytest.mark.parametrize("n", [0, 1, 7, N])
def test_unequal_parts_lose_nothing(ranks3, n):
    for collected, seed_count in ranks3.run(unequal_shards, n):
        assert collected == [result(i) for i in range(n)]
        if n % 3:
            assert seed_count < n  # the seed's zip(*parts) drops the last round's items


def on_a_sub_group() -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    members = list(range(1, world))
    group = dist.new_group(members)
    if rank not in members:
        return []
    me = members.index(rank)  # interleaving follows group ranks, not global ranks
    part = [result(i) for i in range(me, 8, len(members))]
    return [collect_results(part, 8, dst=members[-1], group=group)]


def test_sub_group_interleaves_by_group_rank(ranks4):
    assert ranks4.run(on_a_sub_group) == [[], [None], [None], [[result(i) for i in range(8)]]]


def bad_inputs() -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    seen: List[Any] = []

    def record(call: Callable[[], Any]) -> None:
        try:
            call()
            seen.append("ok")
        except objcomm.RemoteError as exc:
            cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
            seen.append(("RemoteError", {r: t for r, (t, _) in exc.failures.items()}, cause))
        except (ValueError, TypeError) as exc:
            seen.append((type(exc).__name__, str(exc)))

    # rank 1's indices do not pair up with its results
    record(lambda: collect_results([1, 2, 3], indices=[0, 1] if rank == 1 else [0, 1, 2]))
    # indices on some ranks only
    record(lambda: collect_results([rank], indices=[rank] if rank == 0 else None))
    # lengths that grow with the rank: not a strided shard
    record(lambda: collect_results(list(range(rank + 1))))
    # an index past the dataset's end on rank 0
    record(lambda: collect_results([rank], 5, indices=[5 if rank == 0 else rank]))
    # a dict is not a list of results
    record(lambda: collect_results({"a": 1} if rank == world - 1 else [rank], dst=None))
    # a size that is no int on rank 1 (an array, whose == makes no single bool)
    record(lambda: collect_results([rank], __import__("numpy").array([3, 4]) if rank == 1 else 3))
    seen.append(collect_results([rank], dst=None))  # the group is still in step
    return seen


def test_bad_input_raises_on_every_rank_and_names_the_culprit(ranks3):
    results = ranks3.run(bad_inputs)
    for rank, seen in enumerate(results):
        assert seen[0] == ("RemoteError", {1: "ValueError"}, "ValueError" if rank == 1 else None)
        assert seen[1] == ("ValueError", seen[1][1]) and "given on ranks [0] but not on ranks [1, 2]" in seen[1][1]
        assert seen[2] == ("ValueError", seen[2][1]) and "part lengths by rank are [1, 2, 3]" in seen[2][1]
        assert seen[3] == ("RemoteError", {0: "ValueError"}, "ValueError" if rank == 0 else None)
        assert seen[4] == ("RemoteError", {2: "TypeError"}, "TypeError" if rank == 2 else None)
        assert seen[5] == ("RemoteError", {1: "ValueError"}, "ValueError" if rank == 1 else None)
        assert seen[6] == [0, 1, 2]


def test_without_a_process_group():
    assert not dist.is_initialized()
    assert collect_results([result(2), result(0), result(1)], indices=[2, 0, 1]) == [result(i) for i in range(3)]
    assert collect_results(["a", "b"], 2) == ["a", "b"]
    with pytest.raises(ValueError, match="1 would be dropped, and a sampler pads at most 0"):
        collect_results(["a", "b", "a"], 2)  # a group of one is never padded
    assert collect_results(["x", "y"], dst=None, indices=[1, 1]) == ["x"]  # a repeated index is kept once
    with pytest.raises(ValueError, match="part has 2 results but indices has 3"):
        collect_results([1, 2], indices=[0, 1, 2])
    with pytest.raises(ValueError, match="below size=2"):
        collect_results([1, 2], 2, indices=[0, 2])
    with pytest.raises(TypeError, match="indices must be an iterable of ints"):
        collect_results([1], indices=["0"])
    with pytest.raises(ValueError, match="size must be"):
        collect_results([1], -1)
    with pytest.raises(ValueError, match="no process group"):
        collect_results([1], dst=1)


def sizes_that_lose_results() -> List[Any]:
    """size differing by rank, and size too small for what the ranks hold (len(sampler) passed by mistake)."""
    rank = dist.get_rank()
    got = []
    for part, size in [(list(range(rank, 8, 2)), 5 + rank), (list(range(rank, 40, 2)), 20)]:
        try:
            got.append(("ok", collect_results(part, size=size, dst=None)))
        except ValueError as exc:
            got.append(("raised", str(exc)))
    got.append(collect_results(list(range(rank, 7, 2)), size=__import__("numpy").int64(7), dst=None))  # padded by 1
    return got


def test_a_size_that_would_lose_results_raises_on_every_rank():
    for differ, too_small, padded in get_pool_2().run(sizes_that_lose_results):
        assert differ[0] == "raised" and "size by rank is [5, 6]" in differ[1]
        assert too_small[0] == "raised" and "20 would be dropped" in too_small[1]
        assert padded == list(range(7))


def get_pool_2() -> Any:
    from _ranks import get_pool

    return get_pool(2)


def gathers_by_outcome() -> List[Any]:
    """How many object all_gathers a healthy collect_results makes (on a rank that receives nothing, too), and how
    many a failing one does."""
    from _counting import counting

    from objcomm._api.communicator import Communicator

    rank = dist.get_rank()
    with counting({"all_gather": [(Communicator, "all_gather")], "all_reduce": [(Communicator, "all_reduce")]}) as n:
        got = collect_results(list(range(rank, 10, 4)), 10)
    healthy = dict(n)
    with counting({"all_gather": [(Communicator, "all_gather")]}) as n:
        try:
            collect_results(list(range(rank + 1)))  # lengths that grow with the rank
        except ValueError as exc:
            failed = (n["all_gather"], str(exc))
    return [got, healthy, failed]


def test_ranks_agree_through_a_reduction_and_gather_shapes_only_when_something_is_wrong(ranks4):
    """The check that every rank's input is usable is one all_reduce of a few words (2 log W hops, not W slots into
    every rank); the all_gather of every rank's shape, which names the culprits, runs only when it fails."""
    for rank, (got, healthy, failed) in enumerate(ranks4.run(gathers_by_outcome)):
        assert got == (list(range(10)) if rank == 0 else None)
        assert healthy == {"all_gather": 0, "all_reduce": 1}
        assert failed[0] == 1 and "part lengths by rank are [1, 2, 3, 4]" in failed[1]


def test_the_summary_passes_exactly_when_the_shapes_do():
    """The reduction's verdict (:func:`_all_well` of the combined summaries) is :func:`_check_agreement`'s, over
    every shape of up to 4 ranks from a few lengths, sizes, indices flags and failures; in every combining order."""
    import functools
    import itertools
    import random

    from objcomm._api.collect import _all_well, _check_agreement, _combine, _summary

    rng = random.Random(5)
    per_rank = list(itertools.product([0, 1, 2, 3], [False, True], [None, ["ValueError", "x"]], [None, 3, 4, 7]))
    checked = {True: 0, False: 0}
    for world in (1, 2, 3, 4):
        for _ in range(3000):
            metas = [list(rng.choice(per_rank)) for _ in range(world)]
            if rng.random() < 0.5:  # mostly healthy shapes too: one size, one flag, strided lengths, no failure
                size, indexed, longest = rng.choice([None, 3, 4, 7]), rng.random() < 0.3, rng.randint(0, 3)
                cut = rng.randint(0, world)
                metas = [[longest if r < cut else max(longest - 1, 0), indexed, None, size] for r in range(world)]
            try:
                _check_agreement(metas, None)
                expected = True
            except Exception:
                expected = False
            summaries = [_summary(m) for m in metas]
            split = rng.randint(1, world)  # a tree combines runs of ranks in any grouping, never out of order
            left = functools.reduce(_combine, summaries[:split])
            combined = _combine(left, functools.reduce(_combine, summaries[split:])) if split < world else left
            assert _all_well(combined) == expected, metas
            assert _all_well(functools.reduce(_combine, summaries)) == expected, metas
            checked[expected] += 1
    assert min(checked.values()) > 1000  # both verdicts were reached often
