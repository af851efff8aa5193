"""A fast root and a slow receiver on the same-host channel: flow control keeps the receiver's memory bounded.

    PYTHONPATH=. python benchmarks/bench_flow.py [--count 1000000] [--op broadcast|gather|send]

Rank 0 sends ``--count`` slot-sized objects (3.6 KB pickled each) as fast as it can: a broadcast's root, a gather's
sender, or ``send`` after ``send``; rank 1 sleeps 10 ms after every 1,000 calls, and keeps an ``irecv`` on another
tag waiting all along (that thread reads rank 0's socket and files whatever comes, the way a slow consumer's
other threads do). Before flow control (issue 25) the receiver's stash filled and the channel failed after about
45,000 broadcasts; now the root waits for credit. Prints the time per call, the most the receiver's stash held,
its credit window, and the receiver's peak resident memory growth.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict

OBJECT = bytes(range(256)) * 14  # 3,584 bytes: fills most of a 4 KiB slot, no second round


def flow(plan: Any, send: Any) -> Dict[str, Any]:
    import torch.distributed as dist

    import objcomm
    from objcomm import _state

    count, op = plan
    rank = dist.get_rank()
    comm = objcomm.Communicator()
    comm.all_gather(0)  # opens the channel
    slow = rank == 1
    pending = comm.irecv(0, tag=77) if slow else None
    before = _peak_rss()
    start = time.perf_counter()
    for i in range(count):
        if slow and i % 1000 == 999:
            time.sleep(0.01)
        if op == "broadcast":
            comm.broadcast(OBJECT if rank == 0 else None, src=0)
        elif op == "gather":
            comm.gather(OBJECT, dst=1)
        elif slow:
            comm.recv(0)
        else:
            comm.send(OBJECT, 1)
    if slow:
        assert pending is not None and pending.wait(600) == "end"
    else:
        comm.send("end", 1, tag=77)
    comm.all_gather(0)
    elapsed = time.perf_counter() - start
    inbox = _state.group_facts(dist.group.WORLD).local[False].channel._inbox
    return {
        "rank": rank,
        "us_per_call": elapsed / count * 1e6,
        "stash_peak": inbox.peak,
        "window": inbox.window,
        "rss_growth": _peak_rss() - before,
    }


def _peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def both(plan: Any, send: Any) -> Any:
    import torch.distributed as dist

    mine = flow(plan, send)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--op", choices=["broadcast", "gather", "send"], default="broadcast")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from objcomm._tools.launch import run_local

    results = run_local(both, (args.count, args.op), world_size=2, timeout_s=3600)
    print(f"| {args.op} x {args.count:,} | rank | µs per call | stash peak | credit window | peak RSS growth |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| | {r['rank']} | {r['us_per_call']:.1f} | {r['stash_peak'] / 2**20:.2f} MiB | "
            f"{r['window'] / 2**20:.0f} MiB | {r['rss_growth'] / 2**20:.1f} MiB |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
