"""Where round 2 of an all_gather goes, by size: the backend (gloo), the same-host channel, shared memory.

    PYTHONPATH=. python benchmarks/bench_second_round.py [--world-sizes 2 4] [--sizes 16KB 128KB 512KB 1MB 2MB 4MB]

Each rank all_gathers ``{"data": <bytes of the size>, "meta": [...]}`` (the bytes travel out of band, as a
tensor: the second round is the size itself) through three communicators on the same ranks, whose settings
force each route at every size: ``shm=False, shm_threshold=1`` (round 2 through gloo), ``shm=False,
shm_threshold=2**30`` (the same-host channel, ``objcomm._channel_round``) and ``shm_threshold=1`` (shared
memory). By default the channel takes what is below ``shm_threshold`` (2 MiB) and shared memory the rest; the
table shows where that line should be on this machine. Round-robin after a barrier, 4 calls per sample, the
median of 9 samples on rank 0, µs per call. The machine is shared: compare within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

ROUTES = {"gloo": {"shm": False, "shm_threshold": 1}, "channel": {"shm": False, "shm_threshold": 1 << 30},
          "shared memory": {"shm_threshold": 1}}


def measure(plan: Tuple[List[int], int], send: Any) -> Dict[int, Dict[str, float]]:
    import torch.distributed as dist

    import objcomm

    sizes, rounds = plan
    comms = {name: objcomm.Communicator(local=True, **settings) for name, settings in ROUTES.items()}
    for comm in comms.values():
        comm.all_gather(None)  # opens the channel
    medians: Dict[int, Dict[str, float]] = {}
    for size in sizes:
        obj = {"data": b"x" * size, "meta": list(range(10))}
        samples: Dict[str, List[float]] = {name: [] for name in comms}
        for _ in range(rounds):
            for name, comm in comms.items():
                dist.barrier()
                comm.all_gather(obj)  # absorbs how far apart the ranks left the barrier
                start = time.perf_counter()
                for _ in range(4):
                    comm.all_gather(obj)
                samples[name].append((time.perf_counter() - start) / 4)
        medians[size] = {name: statistics.median(s) for name, s in samples.items()}
    return medians


def report(world: int, medians: Dict[int, Dict[str, float]]) -> str:
    lines = [f"### W={world} ({os.cpu_count()} CPUs), µs per all_gather", "",
             "| per rank | " + " | ".join(ROUTES) + " |", "|---:|" + "---:|" * len(ROUTES)]
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
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from objcomm._bench._payloads import parse_size
    from objcomm._launch import run_local

    sizes = [parse_size(s) for s in args.sizes]
    for world in args.world_sizes:
        print(report(world, run_local(measure, (sizes, args.rounds), world_size=world, timeout_s=1200)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
