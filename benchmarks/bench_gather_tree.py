"""gather's slots up a tree against the backend's gather, on real ranks (gloo, every rank its own host).

    PYTHONPATH=. python benchmarks/bench_gather_tree.py [--world-size 8 16] [--rounds 30] [--size 1000] [--radix 2 8]
    PYTHONPATH=. python benchmarks/bench_gather_tree.py --message-cost     # what one more message in a batch costs

From 64 ranks a gather through the backend moves its slots up a tree of send/recv (radix
``objcomm._transport.routes.SLOT_TREE_RADIX``), trimmed (``objcomm._transport.routes.slots_up_tree``); below, the
backend's gather (every rank to the destination). This runs the backend's gather and the tree of each ``--radix``
(2: the binomial tree) at small world sizes, alternating call by call on one group (the tree forced by a test hook),
each rank gathering an object of about ``--size`` bytes (slot only) to rank 0: the median over ``--rounds`` of the
slowest rank's time, ms. It shows what the tree costs where it is not taken; where it is taken (W >= 64) nothing
here can run, and ``benchmarks/scale_model.py`` costs it.

``--message-cost``: 2 ranks, rank 1 sends rank 0 batches of 1 to 128 messages of 64 bytes (``dist.isend`` /
``dist.irecv``, every message posted, then every one waited on), the median over ``--rounds`` of each batch's time
and what a message adds (the CPU a tree's receiver pays a child, one after another: scale_model.py's
``--radix-table`` takes it as a parameter).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List


def timed(arg: Dict[str, Any], send: Any) -> Dict[str, float]:
    import torch.distributed as dist

    import objcomm
    from objcomm._api.resolving import Hooks

    rank, world = dist.get_rank(), dist.get_world_size()
    routes = {"backend gather": Hooks(separate_hosts=True)}
    for radix in arg["radix"]:
        routes[f"tree, radix {radix}"] = Hooks(separate_hosts=True, up_tree=True, tree_radix=radix)
    comms = {name: objcomm.Communicator(local=False, shm=False, _hooks=hooks) for name, hooks in routes.items()}
    obj = {"rank": rank, "text": "y" * arg["size"]}
    for comm in comms.values():
        for _ in range(5):
            comm.gather(obj, dst=0)
    samples: Dict[str, List[float]] = {name: [] for name in comms}
    for _ in range(arg["rounds"]):
        for name, comm in comms.items():
            dist.barrier()
            start = time.perf_counter()
            comm.gather(obj, dst=0)
            mine = time.perf_counter() - start
            every: List[Any] = [None] * world
            dist.all_gather_object(every, mine)
            samples[name].append(max(every))
    return {name: statistics.median(times) for name, times in samples.items()}


BATCHES = (1, 8, 16, 32, 64, 128)


def message_cost(arg: Dict[str, Any], send: Any) -> Dict[int, float]:
    """Rank 0's median time to take each batch of :data:`BATCHES` messages from rank 1 (seconds)."""
    import torch
    import torch.distributed as dist

    rank, times = dist.get_rank(), {}
    for count in BATCHES:
        samples = []
        for _ in range(arg["rounds"]):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                works = [dist.irecv(torch.empty(64, dtype=torch.uint8), src=1, tag=7) for _ in range(count)]
            else:
                works = [dist.isend(torch.ones(64, dtype=torch.uint8), dst=0, tag=7) for _ in range(count)]
            for work in works:
                work.wait()
            samples.append(time.perf_counter() - start)
        times[count] = statistics.median(samples)
    return times


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--size", type=int, default=1000, help="bytes of text in each rank's object")
    parser.add_argument("--radix", type=int, nargs="+", default=[2, 4, 8], help="the trees' radixes (2: binomial)")
    parser.add_argument("--message-cost", action="store_true", help="what one more message in a batch costs (2 ranks)")
    args = parser.parse_args(argv)
    from objcomm._tools.launch import run_local

    if args.message_cost:
        got = run_local(message_cost, {"rounds": max(args.rounds, 100)}, world_size=2)
        print("| messages in a batch | batch (us) | a message more than one alone (us) |\n|---:|---:|---:|")
        for count in BATCHES:
            more = (got[count] - got[1]) / (count - 1) * 1e6 if count > 1 else float("nan")
            print(f"| {count} | {got[count] * 1e6:.0f} | {more:.1f} |")
        return 0

    trees = [f"tree, radix {radix}" for radix in args.radix]
    print("| W | backend gather (ms) | " + " | ".join(f"{t} (ms) | / backend" for t in trees) + " |")
    print("|---:|---:|" + "---:|---:|" * len(trees))
    for world in args.world_size:
        arg = {"rounds": args.rounds, "size": args.size, "radix": args.radix}
        got = run_local(timed, arg, world_size=world)
        flat = got["backend gather"] * 1e3
        cells = [f"{got[t] * 1e3:.2f} | {got[t] * 1e3 / flat:.2f}" for t in trees]
        print(f"| {world} | {flat:.2f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
