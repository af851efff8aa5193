"""The same-host shared-memory path against the normal transport and a raw gloo all_gather, in one run.

    PYTHONPATH=. python benchmarks/bench_shm.py                 # world sizes 2 and 4
    PYTHONPATH=. python benchmarks/bench_shm.py --world-sizes 2 --scale 0.5
    PYTHONPATH=. python benchmarks/bench_shm.py --lower-threshold 256KB # the default against a lower one

Local gloo ranks; the candidates of a scenario run round-robin (interleaved), with a barrier before
every call; a sample is the slowest rank's time. Reports medians and the ratios the targets are
stated in: 64 MB shm <= 0.3x raw gloo, 1 MB shm no slower than normal, small payloads unaffected.

``--lower-threshold``: all_gather and broadcast of ``bytes``, a list of floats and a dict with a tensor of
256 KB to 3 MB (below the default ``shm_threshold``), with the default threshold and with the one given,
round-robin (``objcomm._tools.bench.measure.interleaved``): whether shared memory would pay from lower down.
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

from objcomm._settings import DEFAULT_SHM_THRESHOLD as DEFAULT_THRESHOLD
from objcomm._tools.bench.payloads import parse_size
from objcomm._tools.launch import run_local

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
        (
            "64 MB bytes",
            rounds(7),
            {"shm": lambda: shm.all_gather(big), "normal": lambda: normal.all_gather(big), "raw gloo": _raw(len(big))},
        ),
        (
            "1 MB bytes",
            rounds(40),
            {"shm": lambda: shm.all_gather(mid), "normal": lambda: normal.all_gather(mid), "raw gloo": _raw(len(mid))},
        ),
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


SWEEP = (256 << 10, 1 << 20, 2 << 20, 3 << 20)


def _threshold_task(lower: int, send: Any) -> Dict[str, float]:
    """One rank: every size, kind and op with the default threshold and with ``lower``; slowest-rank medians."""
    import objcomm
    from objcomm._tools.bench.measure import interleaved

    torch.set_num_threads(1)
    default, low = objcomm.Communicator(), objcomm.Communicator(shm_threshold=lower)
    default.all_gather(None)
    low.all_gather(None)
    medians: Dict[str, float] = {}
    for size in SWEEP:
        for kind, obj in (
            ("bytes", bytes(size)),
            ("floats", [0.5] * (size // 9)),
            ("tensor dict", {"t": torch.ones(size // 4)}),
        ):
            candidates: Dict[str, Callable[[], Any]] = {}
            for label, comm in (("default", default), ("lower", low)):
                candidates[f"{kind} {size >> 10} KB all_gather|{label}"] = lambda c=comm, o=obj: c.all_gather(o)
                candidates[f"{kind} {size >> 10} KB broadcast|{label}"] = lambda c=comm, o=obj: c.broadcast(o)
            medians.update({k: t.median_s for k, t in interleaved(candidates, repeat=15, warmup=2).items()})
    return medians


def _threshold_markdown(world: int, lower: int, medians: Dict[str, float]) -> str:
    lines = [
        f"### world size {world}: shm_threshold {DEFAULT_THRESHOLD >> 10:,} KB (default) and {lower >> 10:,} KB",
        "",
        "| payload, op | default | lower | lower / default |",
        "|---|---:|---:|---:|",
    ]
    for name, t in medians.items():
        if name.endswith("|default"):
            low = medians[name.replace("|default", "|lower")]
            lines.append(f"| {name[: -len('|default')]} | {t * 1e3:.2f} ms | {low * 1e3:.2f} ms | {low / t:.2f}x |")
    return "\n".join(lines) + "\n"


def run(world: int, scale: float) -> Dict[str, Dict[str, float]]:
    """Local gloo ranks from objcomm's launcher; rank 0's medians."""
    return run_local(_task, scale, world_size=world, timeout_s=1800)  # type: ignore[no-any-return]


def _markdown(world: int, results: Dict[str, Dict[str, float]]) -> str:
    lines = [
        f"### world size {world}",
        "",
        "| payload | shm | normal | raw gloo | shm / normal | shm / raw gloo |",
        "|---|---:|---:|---:|---:|---:|",
    ]
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
    parser.add_argument("--lower-threshold", help="compare the default shm_threshold with this one (e.g. 256KB)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; medians, slowest rank\n")
    for world in args.world_sizes:
        if args.lower_threshold:
            lower = parse_size(args.lower_threshold)
            medians = run_local(_threshold_task, lower, world_size=world, timeout_s=1800)
            print(_threshold_markdown(world, lower, medians), flush=True)
        else:
            print(_markdown(world, run(world, args.scale)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
