"""One send/recv round trip between two local ranks, µs per round trip: the number to compare two trees by.

    PYTHONPATH=. python benchmarks/bench_round_trip.py --bytes 16384            # records of ~16 KB pickled
    PYTHONPATH=. python benchmarks/bench_round_trip.py --bytes 0 --count 3000   # the small dict of bench_peers.py
    for i in 1 2 3; do for tree in /old/tree /new/tree; do
        PYTHONPATH=$tree python benchmarks/bench_round_trip.py --bytes 16384; done; done

Two spawned ranks join a gloo group on 127.0.0.1, run one all_gather (which opens the same-host channel;
``--no-channel`` skips it: send/recv then go through gloo), warm up, and time ``--count`` round trips back to back:
rank 0 sends the object and receives it back, rank 1 receives and sends it back. Rank 0 prints one line. Alternating
process pairs of the old and the new tree (as above) is what makes two trees comparable on a noisy machine: the
objects are those of ``bench_peers.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

SMALL = {"loss": 0.2513, "accuracy": 0.9172, "step": 12_000, "lr": 3e-4, "run": "resnet50-ablation-7"}


def _object(size: int) -> Any:
    if not size:
        return SMALL
    return [{"id": i, "label": i % 10, "score": i * 0.001, "text": "sample text"} for i in range(size // 27)]


def _rank(args: argparse.Namespace, send: Any) -> str:
    """One rank of :func:`main` (``objcomm._tools.launch.run_local``: the group is joined); rank 0's line."""
    import torch.distributed as dist

    import objcomm

    rank = dist.get_rank()
    if not args.no_channel:
        objcomm.all_gather(None)
    obj = _object(args.bytes)

    def trip() -> None:
        if rank == 0:
            objcomm.send(obj, 1)
            objcomm.recv(1)
        else:
            objcomm.send(objcomm.recv(0), 0)

    for _ in range(min(200, args.count)):
        trip()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.count):
        trip()
    took = (time.perf_counter() - start) / args.count
    dist.barrier()
    return f"{took * 1e6:.1f} µs a round trip ({objcomm.__file__})"


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--bytes", type=int, default=16 << 10, help="records of about this many bytes pickled (0: a small dict)"
    )
    parser.add_argument("--count", type=int, default=1000, help="round trips timed")
    parser.add_argument("--no-channel", action="store_true", help="no collective first: send/recv through gloo")
    args = parser.parse_args(argv)
    from objcomm._tools.launch import run_local

    print(run_local(_rank, args, world_size=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
