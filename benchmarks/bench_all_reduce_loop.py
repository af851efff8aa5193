"""all_reduce in a loop, its result in the backend's broadcast: the slot learnt from the results before, or not.

    PYTHONPATH=. python benchmarks/bench_all_reduce_loop.py [--world-size 4] [--rounds 30] [--sizes 20000 200000 800000]

Every rank its own host, gloo (``local=False``: no same-host channel, no two levels), so an all_reduce's result
goes back from group rank 0 in the backend's broadcast. A loop's results of one size past the 4 KiB slot took two
broadcasts a call (the slot, then the rest); with the group's memory of the last two results
(``rounds.SlotMemory`` under ``("all_reduce", slot_bytes)``, ``routes.slot_after``) the result rides in one slot of
its width. Interleaved in one run, each sample the slowest rank's time, median ms, for a dict of ``--sizes``
bytes on every rank (kept from the left: the result is group rank 0's):

* ``learnt slot``: ``Communicator.all_reduce`` as it runs in a loop;
* ``settings' slot``: the same call with the group's memory of all_reduce results cleared before it (the code
  before this memory, in the same run);
* ``torch``: what users write without objcomm, ``all_gather_object`` and a local reduce.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List


def timed(arg: Dict[str, Any], send: Any) -> Dict[int, Dict[str, float]]:
    import functools

    import torch.distributed as dist

    import objcomm
    from objcomm._state import group_facts

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator(local=False, shm=False)
    slots = group_facts(dist.group.WORLD).slots
    left = lambda a, b: a  # noqa: E731

    def forgetting(obj: Any) -> Any:
        slots.pop(("all_reduce", objcomm.Settings().slot_bytes), None)
        return comm.all_reduce(obj, op=left)

    def torch_way(obj: Any) -> Any:
        every: List[Any] = [None] * world
        dist.all_gather_object(every, obj)
        return functools.reduce(left, every)

    out: Dict[int, Dict[str, float]] = {}
    for size in arg["sizes"]:
        obj = {"rank": rank, "data": b"x" * size}
        ways = {
            "learnt slot": lambda obj=obj: comm.all_reduce(obj, op=left),
            "settings' slot": lambda obj=obj: forgetting(obj),
            "torch": lambda obj=obj: torch_way(obj),
        }
        samples: Dict[str, List[float]] = {name: [] for name in ways}
        for _ in range(3):
            for run in ways.values():
                run()
        for _ in range(arg["rounds"]):
            for name, run in ways.items():
                if name == "learnt slot":  # (the loop's two calls before: what the memory learns from)
                    run(), run()
                dist.barrier()
                start = time.perf_counter()
                run()
                mine = time.perf_counter() - start
                every: List[Any] = [None] * world
                dist.all_gather_object(every, mine)
                samples[name].append(max(every))
        out[size] = {name: statistics.median(times) for name, times in samples.items()}
    return out


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", type=int, nargs="+", default=[20_000, 200_000, 800_000])
    args = parser.parse_args(argv)
    import os

    os.environ["OBJCOMM_FORCE_SEPARATE_HOSTS"] = "1"
    from objcomm._tools.launch import run_local

    got = run_local(timed, {"rounds": args.rounds, "sizes": args.sizes}, world_size=args.world_size)
    print("| W | value | learnt slot (ms) | settings' slot (ms) | learnt / settings' | torch (ms) | learnt / torch |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size, row in got.items():
        learnt, base, torch_ms = (row[k] * 1e3 for k in ("learnt slot", "settings' slot", "torch"))
        print(
            f"| {args.world_size} | {size:,} B | {learnt:.2f} | {base:.2f} | {learnt / base:.2f} | "
            f"{torch_ms:.2f} | {learnt / torch_ms:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
