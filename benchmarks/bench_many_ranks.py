"""objcomm's all_gather against torch's ``all_gather_object`` on many real ranks, each treated as its own host, for
every spread of sizes in issue 27's table (and a raw ``all_gather_into_tensor`` of the padded bytes: the floor).

    PYTHONPATH=. python benchmarks/bench_many_ranks.py [--world-size 16] [--rounds 5] [--ranks-per-host 4]

Every rank is its own host (``OBJCOMM_FORCE_SEPARATE_HOSTS=1``: no same-host channel, no shared memory), so each
call takes the path it takes across nodes: round 1 through the group, then one exchange of every rank's rest. With
``--ranks-per-host k`` (``OBJCOMM_TEST_RANKS_PER_HOST=k``) each run of k ranks is one simulated host, and objcomm
takes two levels (``objcomm._samehost.two_level``): each host's channel and shared memory, one rank per host on
the backend; torch's calls are the same either way (every rank on the backend). The
three candidates run round-robin after a barrier (``objcomm._tools.bench.measure.interleaved``); each sample is the
slowest rank's time, and the table shows the median over ``--rounds`` samples. This machine has 2 cores for 16
processes: times are long and noisy; compare within one run.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional

import torch

from objcomm._tools.bench.spreads import CASES, spread_of


def measure(plan: Any, send: Any = None) -> Dict[str, Dict[str, float]]:
    import torch.distributed as dist

    import objcomm
    from objcomm._tools.bench.measure import interleaved
    from objcomm._transport.base import all_gather_single as raw_all_gather

    rounds, cases = plan
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator()
    rows: Dict[str, Dict[str, float]] = {}
    for case in cases:
        obj = spread_of(case, rank, world)
        padded = len(objcomm.serializers.get("pickle").dumps(obj)) if case != "uneven tensors" else 0
        widest = torch.tensor([padded], dtype=torch.int64)
        dist.all_reduce(widest, op=dist.ReduceOp.MAX)
        out = torch.empty(int(widest) * world, dtype=torch.uint8)
        mine = torch.zeros(int(widest), dtype=torch.uint8)
        listing: List[Any] = [None] * world
        timings = interleaved(
            {
                "objcomm": lambda obj=obj: comm.all_gather(obj),
                "torch all_gather_object": lambda obj=obj, listing=listing: dist.all_gather_object(listing, obj),
                "raw all_gather of the padded bytes": lambda out=out, mine=mine: raw_all_gather(out, mine),
            },
            repeat=rounds,
            warmup=1,
        )
        rows[case] = {name: t.median_s for name, t in timings.items()}
    return rows


def breakdown(plan: Any, send: Any = None) -> List[List[float]]:
    """One all_gather of ``case`` in its phases on each rank (encode, round 1, the exchange of the rests, decode),
    then torch's all_gather_object of the same object, each after a barrier; ``rounds`` times. Every rank's medians
    in ms (its phases, then the whole of its objcomm call and of torch's), and last the slowest rank's median of
    the two wholes, sample by sample."""
    import statistics
    import time

    import torch.distributed as dist

    import objcomm
    from objcomm._format import frame as _frame
    from objcomm._transport import rounds as _rounds

    rounds, case = plan
    rank, world = dist.get_rank(), dist.get_world_size()
    comm, obj = objcomm.Communicator(), spread_of(case, rank, world)
    samples = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        call = comm._call({})
        out, _ = call.encode(obj)
        t1 = time.perf_counter()
        route, memory = comm._route(call.wire, "all_gather")
        wire, infos, taught = _rounds._exchange_slots(call.wire, out, "all_gather", route.summed, memory)  # (a call's)
        t2 = time.perf_counter()
        incoming = _rounds.all_gather_rest(wire, out, infos, _frame.tensor_sizes, memory=taught)
        t3 = time.perf_counter()
        [call.decode(item, r) for r, item in enumerate(incoming)]
        t4 = time.perf_counter()
        dist.barrier()
        t5 = time.perf_counter()
        dist.all_gather_object([None] * world, obj)
        samples.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, time.perf_counter() - t5))
    every: List[Any] = [None] * world
    dist.all_gather_object(every, samples)
    rows = [[statistics.median(column) * 1e3 for column in zip(*ranks)] for ranks in every]
    slowest = [statistics.median(max(ranks[i][k] for ranks in every) for i in range(rounds)) * 1e3 for k in (4, 5)]
    return [*rows, slowest]


def report(world: int, rows: Dict[str, Dict[str, float]], per_host: int = 1) -> str:
    hosts = "each its own host" if per_host == 1 else f"hosts of {per_host} ranks"
    lines = [
        f"all_gather on {world} ranks, {hosts} (median of the slowest rank, ms)",
        "",
        "| sizes per rank | objcomm | torch all_gather_object | raw padded all_gather | objcomm / torch |",
        "|---|---:|---:|---:|---:|",
    ]
    for case, row in rows.items():
        ours, torch_, raw = row["objcomm"], row["torch all_gather_object"], row["raw all_gather of the padded bytes"]
        raw_cell = f"{raw * 1e3:,.1f}" if case != "uneven tensors" else "n/a"
        lines.append(f"| {case} | {ours * 1e3:,.1f} | {torch_ * 1e3:,.1f} | {raw_cell} | {ours / torch_:.2f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES)
    parser.add_argument("--breakdown", choices=CASES, help="time one all_gather of this case in its phases")
    parser.add_argument("--ranks-per-host", type=int, default=1, help="simulated hosts of this many ranks")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.ranks_per_host > 1:
        os.environ["OBJCOMM_TEST_RANKS_PER_HOST"] = str(args.ranks_per_host)
    else:
        os.environ["OBJCOMM_FORCE_SEPARATE_HOSTS"] = "1"
    from objcomm._tools.launch import run_local

    if args.breakdown:
        *ranks, slowest = run_local(
            breakdown, (args.rounds, args.breakdown), world_size=args.world_size, timeout_s=1800
        )
        phases = ranks[0]
        print(
            f"{args.breakdown}, rank 0, median ms: encode {phases[0]:.1f}, round 1 {phases[1]:.1f}, exchange "
            f"{phases[2]:.1f}, decode {phases[3]:.1f}; torch all_gather_object {phases[5]:.1f}"
        )
        ours, theirs = [r[4] for r in ranks], [r[5] for r in ranks]
        print(
            f"every rank's median call, ms: objcomm {min(ours):.1f}-{max(ours):.1f}, torch {min(theirs):.1f}-"
            f"{max(theirs):.1f}; the slowest rank's, median over the samples: objcomm {slowest[0]:.1f}, torch "
            f"{slowest[1]:.1f} ({slowest[0] / slowest[1]:.2f}x)"
        )
        return 0
    rows = run_local(measure, (args.rounds, args.cases), world_size=args.world_size, timeout_s=1800)
    print(report(args.world_size, rows, args.ranks_per_host), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
