"""A small all_gather on two ranks of one host while other processes keep CPUs busy: how steady the same-host
channel's polling wait is, launch after launch, next to torch's ``all_gather_object``.

    PYTHONPATH=. python benchmarks/bench_busy_host.py [--launches 5] [--busy 1] [--calls 200]

Each launch starts two fresh gloo ranks (``torch.multiprocessing.spawn``) beside ``--busy`` processes that spin
(``while True: pass``) for the whole run, and times rank 0's ``objcomm.all_gather`` of a small dict, then torch's
``all_gather_object`` of it, ``--calls`` back to back each: µs per call, one row per launch. On a host with as
many CPUs as ranks, one busy process is what a data-loader worker or a second job does to a training node: a rank
polling for its peer (``local_spin_us``, 1 ms automatic) that never yields the CPU can keep that peer from running.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import time
from typing import Any, List


def _spin() -> None:
    while True:
        pass


def _rank(rank: int, port: int, calls: int, results: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import objcomm

    obj = {"rank": rank, "loss": 0.25, "step": 100}
    for _ in range(5):
        objcomm.all_gather(obj)
    start = time.perf_counter()
    for _ in range(calls):
        objcomm.all_gather(obj)
    ours = (time.perf_counter() - start) / calls
    out: List[Any] = [None, None]
    start = time.perf_counter()
    for _ in range(calls // 2):
        dist.all_gather_object(out, obj)
    theirs = (time.perf_counter() - start) / (calls // 2)
    if rank == 0:
        results.put((ours, theirs))
    dist.destroy_process_group()


def _launch(calls: int) -> Any:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(port, calls, results), nprocs=2)
    return results.get()


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--busy", type=int, default=1, help="processes that keep a CPU busy meanwhile")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    hogs = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for hog in hogs:
        hog.start()
    try:
        print(f"{os.cpu_count()} CPUs, 2 ranks, {args.busy} busy process(es); µs per small all_gather, rank 0")
        print("| launch | objcomm.all_gather | dist.all_gather_object |\n|---:|---:|---:|")
        for launch in range(1, args.launches + 1):
            ours, theirs = _launch(args.calls)
            print(f"| {launch} | {ours * 1e6:,.0f} | {theirs * 1e6:,.0f} |", flush=True)
    finally:
        for hog in hogs:
            hog.terminate()


if __name__ == "__main__":
    main(sys.argv[1:])
