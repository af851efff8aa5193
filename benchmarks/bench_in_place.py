"""A leader's hand-over of an all_gather's result on two levels: copied into a sealed file, or received in place.

    PYTHONPATH=. python benchmarks/bench_in_place.py --mb 4 16 64

Two spawned gloo ranks stand for two hosts' leaders. Each sample, alternately: *copy*, what a leader did before
``routes.in_place_table`` (the all_gather into a torch buffer, then ``sealed.write_sealed`` of its rows and the
file mapped back), and *in place* (``sealed.SealedTable``: the all_gather into the memory file itself, sealed, its
rows mapped with ``map_rows``), with the in-place steps timed apart (making the table, the all_gather, sealing,
mapping). Rank 0 prints the medians of 10 samples (after 2 unmeasured), ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List


def _rank(sizes: List[int], send: Any) -> List[str]:
    """One rank of :func:`main` (``objcomm._tools.launch.run_local``: the group is joined); rank 0's lines."""
    import torch
    import torch.distributed as dist

    from objcomm._samehost.sealed import Sealed, SealedTable, map_parts, map_rows, write_sealed
    from objcomm._transport.base import all_gather_single

    rank, lines = dist.get_rank(), []
    for mb in sizes:
        n = mb << 20
        mine = torch.full((n,), rank + 1, dtype=torch.uint8)
        times: Dict[str, List[float]] = {}
        for sample in range(12):
            for mode in ("copy", "in place"):
                dist.barrier()
                start = time.perf_counter()
                steps = [start]
                if mode == "copy":
                    out = torch.empty(2 * n, dtype=torch.uint8)
                    all_gather_single(out, mine)
                    rows = [memoryview(out[i * n : (i + 1) * n].numpy()) for i in range(2)]
                    segment = write_sealed("objcomm-bench", None, rows)
                    del rows, out
                    parts = map_parts(Sealed(os.getpid(), segment.fd), [n, n])
                else:
                    table = SealedTable("objcomm-bench", 2 * n)
                    steps.append(time.perf_counter())
                    into = table.tensor
                    all_gather_single(into, mine)
                    steps.append(time.perf_counter())
                    del into
                    segment = table.seal()
                    steps.append(time.perf_counter())
                    parts = map_rows(segment.fd, [n, n], n)
                    steps.append(time.perf_counter())
                assert parts[1][n - 1] == 2
                segment.release()
                del parts
                if sample >= 2:
                    times.setdefault(mode, []).append((time.perf_counter() - start) * 1e3)
                    for name, (a, b) in zip(("make", "all_gather", "seal", "map"), zip(steps, steps[1:])):
                        times.setdefault(f"  {name}", []).append((b - a) * 1e3)
        shown = ", ".join(f"{k.strip()} {statistics.median(v):.2f}" for k, v in times.items())
        lines.append(f"{mb} MB a rank: {shown}")
    dist.barrier()
    return lines


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[4, 16, 64], help="each leader's bundle, MiB")
    args = parser.parse_args(argv)
    from objcomm._tools.launch import run_local

    for line in run_local(_rank, args.mb, world_size=2):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
