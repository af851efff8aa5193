"""Where round 2 of an all_gather (gather, send/recv) goes, by size: the backend (gloo), the same-host channel,
shared memory.

    PYTHONPATH=. python benchmarks/bench_second_round.py [--world-sizes 2 4] [--sizes 16KB 128KB 512KB 1MB 2MB 4MB]
    PYTHONPATH=. python benchmarks/bench_second_round.py --ops gather send/recv --world-sizes 2

Each rank all_gathers ``{"data": <bytes of the size>, "meta": [...]}`` (the bytes travel out of band, as a
tensor: the second round is the size itself; ``all_to_all``, ``scatter`` (from rank 0): the same object to every
rank; ``gather``: to rank 0;
``send/recv``: a round trip between ranks 0 and 1, the others idle) through three communicators on the same
ranks, whose settings force each route at every size: ``shm=False, shm_threshold=1`` (round 2 through gloo;
send/recv: ``local=False``, both rounds, since a slot that went through the channel takes its rest there too),
``shm=False, shm_threshold=2**30`` (the same-host channel, ``objcomm._samehost.channel_rests``) and ``shm_threshold=1``
(shared memory). By default the channel takes what is below ``shm_threshold`` (2 MiB) and shared memory the rest; the
table shows where that line should be on this machine. Round-robin after a barrier, 4 calls per sample, the
median of 9 samples on rank 0, µs per call (per round trip). The machine is shared: compare within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

ROUTES = {
    "gloo": {"shm": False, "shm_threshold": 1},
    "channel": {"shm": False, "shm_threshold": 1 << 30},
    "shared memory": {"shm_threshold": 1},
}


def dist_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _call(comm: Any, op: str, obj: Any, rank: int) -> None:
    """One ``op`` of ``obj``: an all_gather, ``obj`` to every rank by all_to_all or by scatter from rank 0, a gather
    to rank 0, or a send/recv round trip between ranks 0 and 1."""
    if op == "all_gather":
        comm.all_gather(obj)
    elif op == "all_to_all":
        comm.all_to_all([obj] * dist_size())
    elif op == "scatter":
        comm.scatter([obj] * dist_size() if rank == 0 else None, src=0)
    elif op == "gather":
        comm.gather(obj, dst=0)
    elif rank == 0:
        comm.send(obj, 1)
        comm.recv(1)
    elif rank == 1:
        comm.send(comm.recv(0), 0)


def measure(plan: Tuple[List[int], int, str], send: Any) -> Dict[int, Dict[str, float]]:
    import torch.distributed as dist

    import objcomm

    sizes, rounds, op = plan
    rank = dist.get_rank()
    # a send/recv whose slot went through the channel moves its rest there whatever shm_threshold says (when shared
    # memory does not take it), so its "gloo" route is local=False: round 1 through gloo too
    routes = {**ROUTES, "gloo": {"local": False}} if op == "send/recv" else ROUTES
    comms = {name: objcomm.Communicator(**{"local": True, **settings}) for name, settings in routes.items()}
    for comm in comms.values():
        comm.all_gather(None)  # opens the channel
    medians: Dict[int, Dict[str, float]] = {}
    for size in sizes:
        obj = {"data": b"x" * size, "meta": list(range(10))}
        samples: Dict[str, List[float]] = {name: [] for name in comms}
        for _ in range(rounds):
            for name, comm in comms.items():
                dist.barrier()
                _call(comm, op, obj, rank)  # absorbs how far apart the ranks left the barrier
                start = time.perf_counter()
                for _ in range(4):
                    _call(comm, op, obj, rank)
                samples[name].append((time.perf_counter() - start) / 4)
        medians[size] = {name: statistics.median(s) for name, s in samples.items()}
    return medians


def report(world: int, op: str, medians: Dict[int, Dict[str, float]]) -> str:
    what = "round trip" if op == "send/recv" else op
    lines = [
        f"### W={world} ({os.cpu_count()} CPUs), µs per {what}",
        "",
        "| per rank | " + " | ".join(ROUTES) + " |",
        "|---:|" + "---:|" * len(ROUTES),
    ]
    for size, by_route in medians.items():
        fastest = min(by_route.values())
        cells = [f"**{t * 1e6:,.0f}**" if t == fastest else f"{t * 1e6:,.0f}" for t in by_route.values()]
        lines.append(f"| {size // 1024:,} KB | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", default=["16KB", "128KB", "512KB", "1MB", "2MB", "4MB"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--ops",
        nargs="+",
        choices=["all_gather", "all_to_all", "gather", "scatter", "send/recv"],
        default=["all_gather"],
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from objcomm._tools.bench.payloads import parse_size
    from objcomm._tools.launch import run_local

    sizes = [parse_size(s) for s in args.sizes]
    for op in args.ops:
        for world in args.world_sizes:
            medians = run_local(measure, (sizes, args.rounds, op), world_size=world, timeout_s=1200)
            print(report(world, op, medians), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
