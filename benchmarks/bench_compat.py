"""The one-line switch: ``objcomm.compat``'s shims against torch.distributed's own object collectives.

    PYTHONPATH=. python benchmarks/bench_compat.py [--world-size 2] [--rounds 15]

A program that imports its object collectives from ``objcomm.compat`` (or calls ``objcomm.compat.patch()``) runs
these shims in place of torch's. This times the same calls both ways: ``all_gather_object``, ``gather_object``
(to rank 0), ``broadcast_object_list`` and ``scatter_object_list`` (from rank 0), and ``send_object_list`` /
``recv_object_list`` from rank 0 to rank 1 and back (a round trip), each of a metrics dict, lists of records of
~16 KB and ~256 KB pickled, and a dict holding a 4 MB tensor; with the process-wide defaults (pickle, the same-host
channel) on gloo over 127.0.0.1. Interleaved in one run (``objcomm._tools.bench.measure.interleaved``, small calls
timed several at a time), each sample the slowest rank's time; median per call.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, List, Tuple

PAYLOADS = ("metrics dict", "16 KB records", "256 KB records", "4 MB tensor")
OPS = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list", "send/recv round trip")


def _payload(name: str, rank: int) -> Any:
    import torch

    if name == "metrics dict":
        return {"loss": 0.2513 + rank, "accuracy": 0.9172, "step": 12_000, "lr": 3e-4, "run": "resnet50-ablation-7"}
    if name == "4 MB tensor":
        return {"rank": rank, "logits": torch.full((1 << 20,), float(rank))}
    size = 16 << 10 if name.startswith("16") else 256 << 10
    return [{"id": i, "label": i % 10, "score": i * 0.001, "text": "sample text"} for i in range(size // 27)]


def _calls(api: Any, obj: Any) -> Dict[str, Callable[[], Any]]:
    """Each op through ``api`` (``torch.distributed`` or ``objcomm.compat``: the same names and arguments)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()

    def all_gather() -> Any:
        every: List[Any] = [None] * world
        api.all_gather_object(every, obj)
        return every

    def gather() -> Any:
        every = [None] * world if rank == 0 else None
        api.gather_object(obj, every, dst=0)
        return every

    def broadcast() -> Any:
        box = [obj if rank == 0 else None]
        api.broadcast_object_list(box, src=0)
        return box[0]

    def scatter() -> Any:
        box: List[Any] = [None]
        api.scatter_object_list(box, [obj] * world if rank == 0 else None, src=0)
        return box[0]

    def round_trip() -> Any:
        box: List[Any] = [None]
        if rank == 0:
            api.send_object_list([obj], dst=1)
            api.recv_object_list(box, src=1)
        elif rank == 1:
            api.recv_object_list(box, src=0)
            api.send_object_list(box, dst=0)
        return box[0]

    return dict(zip(OPS, (all_gather, gather, broadcast, scatter, round_trip)))


def timed(arg: Dict[str, Any], send: Any) -> Dict[Tuple[str, str], Dict[str, float]]:
    import torch.distributed as dist

    from objcomm import compat
    from objcomm._tools.bench.measure import interleaved

    out: Dict[Tuple[str, str], Dict[str, float]] = {}
    for name in PAYLOADS:
        obj = _payload(name, dist.get_rank())
        ours, theirs = _calls(compat, obj), _calls(dist, obj)
        for op in OPS:
            runs = {"objcomm.compat": ours[op], "torch": theirs[op]}
            timings = interleaved(runs, repeat=arg["rounds"], warmup=3, min_sample_s=0.003)
            out[name, op] = {who: timing.median_s for who, timing in timings.items()}
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    from objcomm._tools.launch import run_local

    got = run_local(timed, {"rounds": args.rounds}, world_size=args.world_size)
    print("| W | payload | op | objcomm.compat | torch | compat ÷ torch |")
    print("|---:|---|---|---:|---:|---:|")
    for (name, op), row in got.items():
        ours, theirs = row["objcomm.compat"], row["torch"]
        print(f"| {args.world_size} | {name} | {op} | {_ms(ours)} | {_ms(theirs)} | **{ours / theirs:.2f}x** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
