"""Python work per call on one rank of a W-rank group, W = 1024 ... 8192, no other rank started.

Each W runs in a process of its own as one rank of a group on torch's ``fake`` backend (``torch.testing``'s
``FakeStore``): its collectives move nothing, but for all_gather and gather, which copy this rank's input into every
row (so every rank "sends" what this one sends). What is timed is objcomm's own work on that rank, end to end
through the public API: slots, limit checks, plans, routes, decoding W frames. It is what ``scale_model.py`` does not
count (the model charges the network only). CPU time of the process (``time.process_time``), best of 5, torch on one
thread; ``local=False`` (no same-host channel: W ranks are not on one host) on the CPU (gloo's routes). torch's own
object collective of the same objects is timed alike, in the same process (all_gather_object, gather_object)::

    python benchmarks/bench_python_work.py                    # W = 1024, 2048, 4096, 8192: a markdown table
    python benchmarks/bench_python_work.py --worlds 1024 2048

A growth of about 2x per doubling of W is O(W); 4x would be O(W^2).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List

CALLS = (
    "all_gather, 1 KB each",
    "all_gather, 8 KB each (a rest)",
    "gather to rank 0, on rank 0",
    "gather to rank 0, on rank 5",
    "broadcast 100 KB tensor, on a receiver",
    "broadcast, a new root each call, on a receiver",
)


def _best(fn: Callable[[], Any], repeat: int = 5, least: float = 0.2) -> float:
    """The best CPU time of one call, over ``repeat`` rounds of at least ``least`` seconds each."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        calls, start = 0, time.process_time()
        while True:
            fn()
            calls += 1
            spent = time.process_time() - start
            if spent >= least:
                break
        best = min(best, spent / calls)
    return best


def _one_world(world: int, freeze: bool = False) -> Dict[str, float]:
    """On one rank (rank 0 and rank 5, in turn) of a fake group of ``world`` ranks: each call's CPU time
    (``freeze``: after ``gc.freeze()``, once torch and objcomm are imported)."""
    import gc

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import objcomm
    from objcomm._format import frame as _frame
    from objcomm._format.slot import fill_slot
    from objcomm._transport import routes
    from serializers import registry

    if freeze:  # the imports' objects (torch's ~170,000) out of the collector's full passes
        gc.freeze()

    # The fake broadcast delivers nothing: a receiver's round 1 gets the slot the root would send (the root's is
    # this rank's own object, as every fake collective's), what follows (the tensor's bytes) arrives as zeros.
    canned = bytearray(4096)
    tensor = torch.zeros(100_000, dtype=torch.uint8)
    fill_slot(memoryview(canned), _frame.encode(tensor, registry.guarded("pickle"), max_bytes=1 << 40), 1 << 40)
    fake_broadcast = dist.broadcast

    def broadcast(data: Any, src: Any = None, group: Any = None, async_op: bool = False, **more: Any) -> Any:
        if data.numel() == len(canned) and src != dist.get_rank():
            data.copy_(torch.frombuffer(canned, dtype=torch.uint8))
            return None
        return fake_broadcast(data, src=src, group=group, async_op=async_op, **more)

    dist.broadcast = broadcast
    # the fake point-to-point messages deliver nothing: a gather's slots go the backend's way (its fake gather)
    routes.cutoffs.TREE_GATHER_FROM = 1 << 40
    found: Dict[str, float] = {}
    for rank in (0, 5):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        found.update(_calls(objcomm.Communicator(local=False, device="cpu"), rank, world, tensor))
        dist.destroy_process_group()
    return found


def _calls(comm: Any, rank: int, world: int, tensor: Any) -> Dict[str, float]:
    """Each call's CPU time on this rank, objcomm's under its name and torch's object collective under ``torch:``
    and its name (not for broadcast: the fake broadcast delivers nothing, and torch would unpickle zeros)."""
    import torch.distributed as dist

    small, rest = b"x" * 1000, b"y" * 8000
    got: List[Any] = [None] * world

    def torch_gather(obj: Any) -> None:
        dist.gather_object(obj, got if rank == 0 else None, dst=0)

    if rank == 0:
        return {
            CALLS[0]: _best(lambda: comm.all_gather(small)),
            CALLS[1]: _best(lambda: comm.all_gather(rest)),
            CALLS[2]: _best(lambda: comm.gather(small, dst=0)),
            "torch: " + CALLS[0]: _best(lambda: dist.all_gather_object(got, small)),
            "torch: " + CALLS[1]: _best(lambda: dist.all_gather_object(got, rest)),
            "torch: " + CALLS[2]: _best(lambda: torch_gather(small)),
        }
    roots = (r % world for r in range(rank + 1, 1 << 40) if r % world != rank)
    return {
        CALLS[3]: _best(lambda: comm.gather(small, dst=0)),
        CALLS[4]: _best(lambda: comm.broadcast(tensor, src=0)),
        CALLS[5]: _best(lambda: comm.broadcast(tensor, src=next(roots))),
        "torch: " + CALLS[3]: _best(lambda: torch_gather(small)),
    }


def _shown(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.0f} us"


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument(
        "--gc-freeze", action="store_true", help="call gc.freeze() once everything is imported (docs/scaling.md)"
    )
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # (a child: one world, JSON out)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one_world(args.one, args.gc_freeze)))
        return
    rows: Dict[int, Dict[str, float]] = {}
    for world in args.worlds:
        done = subprocess.run(
            [sys.executable, __file__, "--one", str(world), *(["--gc-freeze"] if args.gc_freeze else [])],
            capture_output=True,
            text=True,
            check=True,
        )
        rows[world] = json.loads(done.stdout.strip().splitlines()[-1])
    worlds = args.worlds
    print("| call | " + " | ".join(f"W={w}" for w in worlds) + " | growth per doubling |")
    print("|---|" + "---:|" * len(worlds) + "---:|")
    for call in CALLS:
        times = [rows[w][call] for w in worlds]
        steps = [(b / a) ** (1 / math.log2(wb / wa)) for a, b, wa, wb in zip(times, times[1:], worlds, worlds[1:])]
        growth = ", ".join(f"{s:.1f}" for s in steps) or "-"
        print(f"| {call} | " + " | ".join(_shown(t) for t in times) + f" | {growth} |")
    print()
    print("torch's object collective, the same call (all_gather_object, gather_object); objcomm / torch in brackets:")
    print()
    print("| call | " + " | ".join(f"W={w}" for w in worlds) + " |")
    print("|---|" + "---:|" * len(worlds))
    for call in CALLS:
        if "torch: " + call in rows[worlds[0]]:
            cells = [
                f"{_shown(rows[w]['torch: ' + call])} ({rows[w][call] / rows[w]['torch: ' + call]:.2f})" for w in worlds
            ]
            print(f"| {call} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
