"""gloo's exchange at exact sizes by stripes against one batch of sends, on real ranks of one machine.

    PYTHONPATH=. python benchmarks/bench_stripes.py [--world-size 4 8] [--rounds 10]

``objcomm._transport.exchange.all_gather_rests`` on a gloo group, its shape forced each way (one batch in which
every rank sends its rest to each peer itself; stripes: each rest to the ranks whose stripe holds it, then one
all_gather of the stripes), alternating, for one rank with a rest ("one") and every other rank with one ("half"),
of 16 KB to 16 MB: the median over ``--rounds`` of the slowest rank's time, ms, and the shape
``routes.exchange_shape`` picks. On one machine every byte is a copy on the same cores whoever sends it, so this
shows what stripes cost where they are not needed; their gain is on a network (``benchmarks/scale_model.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List

SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def timed(arg: Dict[str, int], send: Any) -> List[Any]:
    import torch
    import torch.distributed as dist

    from objcomm._transport import exchange, routes
    from objcomm._transport.base import Wire

    rank, world = dist.get_rank(), dist.get_world_size()
    wire = Wire(dist.group.WORLD, list(range(world)), rank, torch.device("cpu"), 4096, 256 << 20, 1 << 30)
    rows = []
    for size in SIZES:
        for spread in ("one", "half"):
            lengths = [size if r == world - 1 or (spread == "half" and r % 2) else 0 for r in range(world)]
            own = torch.ones(lengths[rank], dtype=torch.uint8)
            samples: Dict[str, List[float]] = {routes.EXACT: [], routes.STRIPES: []}
            for _ in range(arg["rounds"]):
                for shape in samples:
                    dist.barrier()
                    start = time.perf_counter()
                    if shape == routes.STRIPES:
                        exchange.by_stripes(wire, own, lengths, "all_gather")
                    else:  # the batch: what all_gather_rests runs for EXACT on gloo
                        real = routes.exchange_shape
                        exchange.routes.exchange_shape = lambda *a, **k: routes.EXACT  # type: ignore[assignment]
                        try:
                            exchange.all_gather_rests(wire, [own], lengths, "all_gather")
                        finally:
                            exchange.routes.exchange_shape = real  # type: ignore[assignment]
                    mine = time.perf_counter() - start
                    every: List[Any] = [None] * world
                    dist.all_gather_object(every, mine)
                    samples[shape].append(max(every))
            picked = routes.exchange_shape(lengths, cpu=True)
            rows.append((spread, size, *(statistics.median(v) for v in samples.values()), picked))
    return rows


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    from objcomm._tools.launch import run_local

    print("| W | ranks with a rest | rest | batch (ms) | stripes (ms) | stripes / batch | picked |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for world in args.world_size:
        for spread, size, batch, stripes, picked in run_local(timed, {"rounds": args.rounds}, world_size=world):
            print(
                f"| {world} | {spread} | {size >> 10:,} KB | {batch * 1e3:.2f} | {stripes * 1e3:.2f} | "
                f"{stripes / batch:.2f} | {picked} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
