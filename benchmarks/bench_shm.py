"""The same-host shared-memory path against the normal transport and a raw gloo all_gather, in one run.

    PYTHONPATH=. python benchmarks/bench_shm.py                 # world sizes 2 and 4
    PYTHONPATH=. python benchmarks/bench_shm.py --world-sizes 2 --scale 0.5

Local gloo ranks; the candidates of a scenario run round-robin (interleaved), with a barrier before
every call; a sample is the slowest rank's time. Reports medians and the ratios the targets are
stated in: 64 MB shm <= 0.3x raw gloo, 1 MB shm no slower than normal, small payloads unaffected.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

from objcomm._launch import run_local

MB = 1 << 20
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _raw(nbytes: int) -> Callable[[], Any]:
    send = torch.zeros(nbytes, dtype=torch.uint8)
    recv = torch.empty(nbytes * dist.get_world_size(), dtype=torch.uint8)
    return lambda: _all_gather_single(recv, send)


def _scenarios(scale: float) -> List[tuple[str, int, Dict[str, Callable[[], Any]]]]:
    import objcomm

    shm, normal = objcomm.Communicator(shm=True), objcomm.Communicator(shm=False)
    big = torch.randint(0, 255, (64 * MB,), dtype=torch.uint8).numpy().tobytes()
    mid = big[:MB]
    small = {"loss": 0.25, "step": 12_000, "name": "run-7", "hist": list(range(200))}
    rounds = lambda n: max(3, int(n * scale))  # noqa: E731
    return [
        ("64 MB bytes", rounds(7), {
            "shm": lambda: shm.all_gather(big), "normal": lambda: normal.all_gather(big), "raw gloo": _raw(len(big)),
        }),
        ("1 MB bytes", rounds(40), {
            "shm": lambda: shm.all_gather(mid), "normal": lambda: normal.all_gather(mid), "raw gloo": _raw(len(mid)),
        }),
        ("small dict", rounds(200), {"shm": lambda: shm.all_gather(small), "normal": lambda: normal.all_gather(small)}),
    ]


def _task(scale: float, send: Any) -> Dict[str, Dict[str, float]]:
    """One rank: every scenario, interleaved; returns the medians of the slowest rank's times."""
    torch.set_num_threads(1)
    results: Dict[str, Dict[str, float]] = {}
    for name, rounds, candidates in _scenarios(scale):
        samples: Dict[str, List[float]] = {c: [] for c in candidates}
        for fn in candidates.values():  # warm-up: discovery, page cache, connections
            fn()
        for _ in range(rounds):
            for label, fn in candidates.items():
                dist.barrier()
                start = time.perf_counter()
                fn()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                samples[label].append(elapsed.item())
        results[name] = {label: statistics.median(values) for label, values in samples.items()}
    dist.barrier()
    return results


def run(world: int, scale: float) -> Dict[str, Dict[str, float]]:
    """Local gloo ranks from objcomm's launcher; rank 0's medians."""
    return run_local(_task, scale, world_size=world, timeout_s=1800)  # type: ignore[no-any-return]


def _markdown(world: int, results: Dict[str, Dict[str, float]]) -> str:
    lines = [f"### world size {world}", "", "| payload | shm | normal | raw gloo | shm / normal | shm / raw gloo |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        raw = r.get("raw gloo")
        raw_ms = f"{raw * 1e3:.2f} ms" if raw else "-"
        vs_raw = f"{r['shm'] / raw:.2f}x" if raw else "-"
        lines.append(
            f"| {name} | {r['shm'] * 1e3:.2f} ms | {r['normal'] * 1e3:.2f} ms | {raw_ms} | "
            f"{r['shm'] / r['normal']:.2f}x | {vs_raw} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the number of rounds")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; medians, slowest rank\n")
    for world in args.world_sizes:
        print(_markdown(world, run(world, args.scale)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
