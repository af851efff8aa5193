"""gather's slots up a binomial tree against the backend's gather, on real ranks (gloo, every rank its own host).

    PYTHONPATH=. python benchmarks/bench_gather_tree.py [--world-size 8 16] [--rounds 30] [--size 1000]

From 64 ranks a gather through the backend moves its slots up a binomial tree of send/recv, trimmed
(``objcomm._transport.routes.slots_up_tree``); below, the backend's gather (every rank to the destination). This
runs both at small world sizes, alternating call by call on one group (the tree forced by a test hook), each rank
gathering an object of about ``--size`` bytes (slot only) to rank 0: the median over ``--rounds`` of the slowest
rank's time, ms. It shows what the tree costs where it is not taken; where it is taken (W >= 64) nothing here can
run, and ``benchmarks/scale_model.py`` costs it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List


def timed(arg: Dict[str, int], send: Any) -> Dict[str, float]:
    import torch.distributed as dist

    import objcomm
    from objcomm._api.resolving import Hooks

    rank, world = dist.get_rank(), dist.get_world_size()
    comms = {
        tree: objcomm.Communicator(local=False, shm=False, _hooks=Hooks(separate_hosts=True, up_tree=tree))
        for tree in (False, True)
    }
    obj = {"rank": rank, "text": "y" * arg["size"]}
    for comm in comms.values():
        for _ in range(5):
            comm.gather(obj, dst=0)
    samples: Dict[bool, List[float]] = {False: [], True: []}
    for _ in range(arg["rounds"]):
        for tree, comm in comms.items():
            dist.barrier()
            start = time.perf_counter()
            comm.gather(obj, dst=0)
            mine = time.perf_counter() - start
            every: List[Any] = [None] * world
            dist.all_gather_object(every, mine)
            samples[tree].append(max(every))
    return {"backend gather": statistics.median(samples[False]), "tree": statistics.median(samples[True])}


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--size", type=int, default=1000, help="bytes of text in each rank's object")
    args = parser.parse_args(argv)
    from objcomm._tools.launch import run_local

    print("| W | backend gather (ms) | tree (ms) | tree / backend |\n|---:|---:|---:|---:|")
    for world in args.world_size:
        got = run_local(timed, {"rounds": args.rounds, "size": args.size}, world_size=world)
        flat, tree = got["backend gather"] * 1e3, got["tree"] * 1e3
        print(f"| {world} | {flat:.2f} | {tree:.2f} | {tree / flat:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
