"""What a collective with no rounds of its own costs: a built-in collective's row carried by ``_pattern_call``.

    PYTHONPATH=. python benchmarks/bench_pattern_call.py [--world-size 4] [--rounds 30] [--sizes 200 200000]

A new collective is its row of ``objcomm/_transport/patterns.py`` and a method that calls
``Communicator._pattern_call``, which carries any row as one all_to_all whose parts for the ranks outside the pattern
are empty (docs/internals.md, "Adding a collective"). This prices that path against the rounds a built-in collective
has of its own: the same call (broadcast, gather, all_gather of a dict of ``--sizes`` bytes) both ways, and torch's
object collective, on gloo over the same-host channel (the default) and through the backend (``local=False``, every
rank its own host). Interleaved in one run (``objcomm._tools.bench.measure.interleaved``), each sample the slowest
rank's time; median ms.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, List, Tuple

MEDIA = {"channel": {}, "backend": {"local": False}}
OPS = ("broadcast", "gather", "all_gather")


def _ways(comm: Any, obj: Any) -> Dict[str, Dict[str, Callable[[], Any]]]:
    """Each op three ways: its own rounds, its row through ``_pattern_call``, torch's object collective."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()

    def carried(op: str, mine: Any, root: Any = None) -> Any:
        return comm._pattern_call(comm._call({}), op, mine, root)

    def torch_broadcast() -> Any:
        box = [obj if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def torch_gather() -> Any:
        every = [None] * world if rank == 0 else None
        dist.gather_object(obj, every, dst=0)
        return every

    def torch_all_gather() -> Any:
        every: List[Any] = [None] * world
        dist.all_gather_object(every, obj)
        return every

    return {
        "broadcast": {
            "own": lambda: comm.broadcast(obj, src=0),
            "pattern": lambda: carried("broadcast", obj, 0),
            "torch": torch_broadcast,
        },
        "gather": {
            "own": lambda: comm.gather(obj, dst=0),
            "pattern": lambda: carried("gather", obj, 0),
            "torch": torch_gather,
        },
        "all_gather": {
            "own": lambda: comm.all_gather(obj),
            "pattern": lambda: carried("all_gather", obj),
            "torch": torch_all_gather,
        },
    }


def timed(arg: Dict[str, Any], send: Any) -> Dict[Tuple[str, str, int], Dict[str, float]]:
    import torch.distributed as dist

    import objcomm
    from objcomm._api.resolving import Hooks
    from objcomm._tools.bench.measure import interleaved

    rank = dist.get_rank()
    out: Dict[Tuple[str, str, int], Dict[str, float]] = {}
    for medium, settings in MEDIA.items():
        comm = objcomm.Communicator(**settings, _hooks=Hooks(separate_hosts=medium == "backend"))
        for size in arg["sizes"]:
            for op, runs in _ways(comm, {"rank": rank, "data": "x" * size}).items():
                timings = interleaved(runs, repeat=arg["rounds"], warmup=3)
                out[medium, op, size] = {name: timing.median_s for name, timing in timings.items()}
    return out


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", type=int, nargs="+", default=[200, 200_000])
    args = parser.parse_args(argv)
    from objcomm._tools.launch import run_local

    got = run_local(timed, {"rounds": args.rounds, "sizes": args.sizes}, world_size=args.world_size)
    print("| W | medium | op | value | own rounds | its row | row ÷ own | torch | row ÷ torch |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for (medium, op, size), row in got.items():
        own, carried, torch_ms = (row[k] * 1e3 for k in ("own", "pattern", "torch"))
        value = f"{size // 1000} KB" if size >= 1000 else f"{size} B"
        print(
            f"| {args.world_size} | {medium} | {op} | {value} | {own:.2f} ms | {carried:.2f} ms | "
            f"{carried / own:.2f} | {torch_ms:.2f} ms | {carried / torch_ms:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
