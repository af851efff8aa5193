"""broadcast's rest down the binomial tree of send/recv from the source, or spread (a scatter, then an all_gather),
against the same call through the backend's broadcast, on gloo.

    PYTHONPATH=. python benchmarks/bench_broadcast_tree.py [--world-size 8] [--rounds 7]

On NCCL from 64 ranks a broadcast's rest goes down the tree (``routes.rest_down_tree``) instead of NCCL's
broadcast, a ring of W - 1 hops; this machine has no GPU and not 64 ranks, so what it can show is what the tree
costs in Python against a tree of the same shape in C++: gloo's broadcast is binomial too. Every rank is its own
host (``OBJCOMM_FORCE_SEPARATE_HOSTS=1``: no same-host channel, no shared memory). Interleaved in one run, each
sample the slowest rank's time, median ms:

* ``backend's broadcast``: ``Communicator.broadcast`` as it runs on gloo (its rest in gloo's broadcast);
* ``down the tree``: the same call with the rest down the tree, forced (``Hooks(rest_tree=True)``);
* ``spread``: the same call with each part of the rest as a scatter of W blocks, then Bruck's all_gather of them
  (``routes.rest_spread``: NCCL's route from 64 ranks after a vote), forced (``Hooks(rest_spread=True)``); where no
  vote runs (a rest whose pieces fit 1 MiB) it takes the backend's broadcast;
* ``torch``: ``broadcast_object_list``;
* ``raw broadcast``: ``dist.broadcast`` of the payload's bytes, the floor.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional

import torch

CASES = ("256 KB bytes", "1 MB tensor", "4 MB tensor", "16 MB tensor")


def _value(case: str) -> Any:
    if case == "256 KB bytes":
        return b"b" * (256 << 10)
    return torch.arange(int(case.split()[0]) << 18, dtype=torch.float32)


def measure(rounds: int, send: Any = None) -> Dict[str, Dict[str, float]]:
    import torch.distributed as dist

    import objcomm
    from objcomm._api.resolving import Hooks
    from objcomm._tools.bench.measure import interleaved

    rank = dist.get_rank()
    backend = objcomm.Communicator(local=False, shm=False)
    tree = objcomm.Communicator(local=False, shm=False, _hooks=Hooks(rest_tree=True))
    spread = objcomm.Communicator(local=False, shm=False, _hooks=Hooks(rest_spread=True))
    rows: Dict[str, Dict[str, float]] = {}
    for case in CASES:
        value = _value(case)
        mine = value if rank == 0 else None
        raw = torch.frombuffer(bytearray(value), dtype=torch.uint8) if isinstance(value, bytes) else value.clone()
        raw = raw.view(torch.uint8).clone()

        def torch_broadcast(value: Any = value) -> Any:
            box = [value if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        candidates = {
            "backend's broadcast": lambda mine=mine: backend.broadcast(mine, src=0),
            "down the tree": lambda mine=mine: tree.broadcast(mine, src=0),
            "spread": lambda mine=mine: spread.broadcast(mine, src=0),
            "torch": torch_broadcast,
            "raw broadcast": lambda raw=raw: dist.broadcast(raw, src=0),
        }
        for name in ("backend's broadcast", "down the tree", "spread", "torch"):
            got = candidates[name]()
            same = torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
            assert same, f"{case}: a wrong result from {name}"
        timings = interleaved(candidates, repeat=rounds, warmup=1)
        rows[case] = {name: t.median_s for name, t in timings.items()}
    return rows


def report(world: int, rows: Dict[str, Dict[str, float]]) -> str:
    lines = [
        f"broadcast from rank 0 on {world} ranks, gloo, each its own host (median of the slowest rank, ms)",
        "",
        "| value | backend's broadcast | down the tree | spread | torch | raw broadcast | tree / backend's "
        "| spread / backend's | spread / torch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = ("backend's broadcast", "down the tree", "spread", "torch", "raw broadcast")
    for case, row in rows.items():
        flat, tree, spread, torch_, raw = (row[k] for k in names)
        lines.append(
            f"| {case} | {flat * 1e3:,.1f} | {tree * 1e3:,.1f} | {spread * 1e3:,.1f} | {torch_ * 1e3:,.1f} "
            f"| {raw * 1e3:,.1f} | {tree / flat:.2f} | {spread / flat:.2f} | {spread / torch_:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["OBJCOMM_FORCE_SEPARATE_HOSTS"] = "1"
    from objcomm._tools.launch import run_local

    rows = run_local(measure, args.rounds, world_size=args.world_size, timeout_s=1800)
    print(report(args.world_size, rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
