"""all_reduce on simulated hosts: the reduce tree on two levels against the same call with its tree over the group.

    PYTHONPATH=. python benchmarks/bench_reduce_levels.py [--world-size 16] [--ranks-per-host 4] [--rounds 7]

Each run of ``--ranks-per-host`` consecutive ranks is one simulated host (``OBJCOMM_TEST_RANKS_PER_HOST``), so a
gloo group takes two levels (``objcomm._samehost.two_level``), and an all_reduce's tree climbs each host's channel,
then the leaders' tree through the backend (``routes.tree_on_two_levels``). Interleaved in one run, each sample the
slowest rank's time, median ms:

* ``two levels``: ``Communicator.all_reduce`` as it runs;
* ``tree over the group``: the same call with the tree's two levels turned off for it (every rank turns them off
  for that call alone: ``TwoLevel.tree_levels`` answers None), so its tree's messages all go through gloo, as
  before the two levels took it; the result's broadcast is the same two-level one in both;
* ``result down the tree``: ``two levels`` with the result sent back down the same two trees, as from 64 hosts
  (``routes.TREE_DOWN_FROM``) it is; forced here, on fewer (``Hooks(down_tree=True)``), to show what it costs there;
* ``torch``: what users write without objcomm, ``all_gather_object`` then a local reduce;
* ``raw all_reduce`` (tensor case only): ``dist.all_reduce`` of the same tensor, the floor.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, Callable, Dict, List, Optional

import torch

CASES = ("metrics dict", "1 MB tensor")


def _value(case: str, rank: int) -> Any:
    if case == "metrics dict":
        return {"loss": 0.25 + rank, "correct": 90 + rank, "seen": 128}
    return torch.full((1 << 18,), float(rank))  # 1 MB of float32


def _torch_all_reduce(obj: Any, fn: Callable[[Any, Any], Any], world: int) -> Any:
    import torch.distributed as dist

    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, obj)
    return functools.reduce(fn, everyone)


def measure(rounds: int, send: Any = None) -> Dict[str, Dict[str, float]]:
    import torch.distributed as dist

    import objcomm
    from objcomm._api.reduce import NAMED_OPS
    from objcomm._api.resolving import Hooks
    from objcomm._samehost.two_level import TwoLevel
    from objcomm._tools.bench.measure import interleaved

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator()
    comm.all_gather(rank)  # sets the two levels up
    down = objcomm.Communicator(_hooks=Hooks(down_tree=True))
    real = TwoLevel.tree_levels

    def over_the_group(obj: Any, op: str) -> Any:
        TwoLevel.tree_levels = lambda self, wire, what: None  # type: ignore[method-assign,assignment]
        try:
            return comm.all_reduce(obj, op)
        finally:
            TwoLevel.tree_levels = real  # type: ignore[method-assign]

    rows: Dict[str, Dict[str, float]] = {}
    for case in CASES:
        obj = _value(case, rank)
        op = "merge_sum" if case == "metrics dict" else "sum"
        fn = NAMED_OPS[op]
        candidates = {
            "two levels": lambda obj=obj, op=op: comm.all_reduce(obj, op),
            "tree over the group": lambda obj=obj, op=op: over_the_group(obj, op),
            "result down the tree": lambda obj=obj, op=op: down.all_reduce(obj, op),
            "torch": lambda obj=obj, fn=fn: _torch_all_reduce(obj, fn, world),
        }
        if isinstance(obj, torch.Tensor):
            candidates["raw all_reduce"] = lambda obj=obj: dist.all_reduce(obj.clone())
        want = functools.reduce(fn, [_value(case, r) for r in range(world)])
        got = [candidates[name]() for name in ("two levels", "tree over the group", "result down the tree", "torch")]
        same = [torch.equal(g, want) if isinstance(want, torch.Tensor) else g == want for g in got]
        assert all(same), f"{case}: a wrong result ({same})"
        timings = interleaved(candidates, repeat=rounds, warmup=1)
        rows[case] = {name: t.median_s for name, t in timings.items()}
    return rows


def report(world: int, per_host: int, rows: Dict[str, Dict[str, float]]) -> str:
    lines = [
        f"all_reduce on {world} ranks, hosts of {per_host} (median of the slowest rank, ms)",
        "",
        "| value | two levels | tree over the group | result down the tree | torch | raw all_reduce "
        "| two levels / tree over the group | down the tree / two levels | two levels / torch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case, row in rows.items():
        two, flat, torch_ = row["two levels"], row["tree over the group"], row["torch"]
        tree = row["result down the tree"]
        raw = f"{row['raw all_reduce'] * 1e3:,.1f}" if "raw all_reduce" in row else "n/a"
        lines.append(
            f"| {case} | {two * 1e3:,.1f} | {flat * 1e3:,.1f} | {tree * 1e3:,.1f} | {torch_ * 1e3:,.1f} | {raw} "
            f"| {two / flat:.2f} | {tree / two:.2f} | {two / torch_:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-size", type=int, default=16)
    parser.add_argument("--ranks-per-host", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["OBJCOMM_TEST_RANKS_PER_HOST"] = str(args.ranks_per_host)
    from objcomm._tools.launch import run_local

    rows = run_local(measure, args.rounds, world_size=args.world_size, timeout_s=1800)
    print(report(args.world_size, args.ranks_per_host, rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
