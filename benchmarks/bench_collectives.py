"""objcomm against torch's object collectives and a raw collective of the same bytes, in one run.

    python benchmarks/bench_collectives.py                    # world sizes 2 and 4, gloo, markdown to stdout
    python benchmarks/bench_collectives.py --world-sizes 2 --json out.json

Each scenario times its candidates round-robin on live local gloo ranks (a barrier before every
call; a sample is the slowest rank's time), reports medians, and the ratios the targets in
``benchmarks/RESULTS.md`` are stated in. Absolute times are context only: the machine is shared.
"""

from __future__ import annotations

import argparse
import functools
import json
import pickle
import resource
import sys
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

import objcomm
from objcomm._tools.bench.launch import run_local
from objcomm._tools.bench.measure import interleaved

SLOT = objcomm.settings().slot_bytes
SMALL = {"loss": 0.2513, "accuracy": 0.9172, "step": 12_000, "lr": 3e-4, "run": "resnet50-ablation-7"}
MB = 1 << 20


def _raw_all_gather(nbytes: int) -> Callable[[], Any]:
    send = torch.zeros(nbytes, dtype=torch.uint8)
    recv = torch.empty(nbytes * dist.get_world_size(), dtype=torch.uint8)
    return lambda: dist.all_gather_single(recv, send)


def _torch_all_gather(obj: Any) -> Callable[[], Any]:
    out: List[Any] = [None] * dist.get_world_size()
    return lambda: dist.all_gather_object(out, obj)


def _p2p(send_fn: Callable[[], Any], recv_fn: Callable[[], Any]) -> Callable[[], Any]:
    """Rank 0 sends, rank 1 receives, the others idle."""
    rank = dist.get_rank()
    return send_fn if rank == 0 else recv_fn if rank == 1 else (lambda: None)


def _scenarios(repeat_scale: float) -> Dict[str, Dict[str, Any]]:
    """Every rank builds the same candidates; each scenario names its ratios."""
    rank = dist.get_rank()
    rounds = lambda n: max(3, int(n * repeat_scale))  # noqa: E731
    floats = [float(i) * 0.5 for i in range(1_000_000)]
    floats_bytes = len(pickle.dumps(floats, protocol=5))
    tensor = {"weights": torch.randn(16 * MB)}  # 64 MB of float32
    blob = torch.randint(0, 255, (MB,), dtype=torch.uint8).numpy().tobytes()
    raw_mb = torch.zeros(len(pickle.dumps(blob, protocol=5)), dtype=torch.uint8)
    torch_list: List[Any] = [None]
    return {
        "small object all_gather": {
            "repeat": rounds(300),
            "candidates": {
                "objcomm": lambda: objcomm.all_gather(SMALL),
                "objcomm msgpack": lambda: objcomm.all_gather(SMALL, serializer="msgpack"),
                "torch": _torch_all_gather(SMALL),
                "raw": _raw_all_gather(SLOT),
            },
            "ratios": [("objcomm", "torch", 0.6), ("objcomm", "raw", 1.3)],
            "note": f"{len(pickle.dumps(SMALL))} B pickled; raw = one all_gather of a {SLOT} B slot",
        },
        "1M floats all_gather": {
            "repeat": rounds(7),
            "candidates": {
                "objcomm": lambda: objcomm.all_gather(floats),
                "objcomm msgpack": lambda: objcomm.all_gather(floats, serializer="msgpack"),
                "objcomm json": lambda: objcomm.all_gather(floats, serializer="json"),
                "torch": _torch_all_gather(floats),
                "raw": _raw_all_gather(floats_bytes),
            },
            "ratios": [("objcomm", "torch", 0.9), ("objcomm msgpack", "torch", None), ("objcomm json", "torch", None)],
            "note": f"pickle {floats_bytes / MB:.1f} MB per rank",
        },
        "64 MB tensor dict all_gather": {
            "repeat": rounds(5),
            "candidates": {
                "objcomm": lambda: objcomm.all_gather(tensor),
                "torch": _torch_all_gather(tensor),
                "raw": _raw_all_gather(64 * MB),
            },
            "ratios": [("objcomm", "torch", 0.4), ("objcomm", "raw", 1.5)],
            "note": "{'weights': float32 tensor of 16 Mi elements}",
        },
        "1 MiB send/recv": {
            "repeat": rounds(30),
            "candidates": {
                "objcomm": _p2p(lambda: objcomm.send(blob, dst=1), lambda: objcomm.recv(src=0)),
                "torch": _p2p(
                    lambda: dist.send_object_list([blob], dst=1), lambda: dist.recv_object_list(torch_list, src=0)
                ),
                "raw": _p2p(lambda: dist.send(raw_mb, dst=1), lambda: dist.recv(raw_mb, src=0)),
            },
            "ratios": [("objcomm", "raw", 1.2), ("objcomm", "torch", None)],
            "note": "a 1 MiB bytes object; raw = send/recv of its pickled size",
        },
        "1 MiB broadcast": {
            "repeat": rounds(30),
            "candidates": {
                "objcomm": lambda: objcomm.broadcast(blob if rank == 0 else None, src=0),
                "torch": lambda: dist.broadcast_object_list([blob if rank == 0 else None], src=0),
                "raw": lambda: dist.broadcast(raw_mb, src=0),
            },
            "ratios": [("objcomm", "raw", 1.2), ("objcomm", "torch", None)],
            "note": "a 1 MiB bytes object; raw = broadcast of its pickled size",
        },
    }


def timing_task(repeat_scale: float, send: Callable[[Any], None]) -> Dict[str, Any]:
    """Run every scenario on this rank; rank 0's result is reported."""
    results = {}
    for name, scenario in _scenarios(repeat_scale).items():
        if name == "1 MiB send/recv" and dist.get_world_size() < 2:
            continue
        timings = interleaved(scenario["candidates"], repeat=scenario["repeat"], warmup=2)
        medians = {k: t.median_s for k, t in timings.items()}
        ratios = [
            {"of": a, "to": b, "ratio": medians[a] / medians[b], "target": target}
            for a, b, target in scenario["ratios"]
        ]
        results[name] = {"median_s": medians, "ratios": ratios, "repeat": scenario["repeat"], "note": scenario["note"]}
        if dist.get_rank() == 0:
            send(name)
    return results


SLOT_SIZES = (256, 1024, 4096, 16384, 65536)


def slot_task(repeat: int, send: Callable[[Any], None]) -> Dict[str, float]:
    """Raw all_gather latency per slot size: how big round 1 can be before it costs more."""
    candidates = {f"{n} B": _raw_all_gather(n) for n in SLOT_SIZES}
    return {name: t.median_s for name, t in interleaved(candidates, repeat=repeat, warmup=5).items()}


def memory_task(spec: Dict[str, Any], send: Callable[[Any], None]) -> Dict[str, float]:
    """Peak extra resident memory of one all_gather, in units of world_size x payload bytes.

    ``kind`` "raw" is gloo's own all_gather of the same bytes, for comparison: gloo copies through
    an internal buffer, which no caller can avoid.
    """
    world = dist.get_world_size()
    size = spec["mb"] * MB
    kind = spec["kind"]
    payload: Any = torch.ones(size // 4) if kind in ("tensor", "raw") else b"\x01" * size
    objcomm.all_gather(1)  # warm up: lazy imports, first buffers
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if kind == "raw":
        result: Any = torch.empty(world * size // 4)
        dist.all_gather_single(result, payload)
    else:
        result = objcomm.all_gather(payload, serializer="pickle")
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del result
    extra = (peak_kb - base_kb) * 1024
    return {"extra_bytes": extra, "per_world_x_size": extra / (world * size)}


def _markdown(world: int, results: Dict[str, Any], memory: Dict[str, Dict[str, float]]) -> str:
    lines = [f"### gloo, world size {world}", "", "| scenario | candidate | median | ratio | target | met |"]
    lines.append("|---|---|---|---|---|---|")
    for name, r in results.items():
        for k, seconds in r["median_s"].items():
            lines.append(f"| {name} | {k} | {seconds * 1000:.2f} ms | | | |")
        for q in r["ratios"]:
            target = "—" if q["target"] is None else f"≤ {q['target']}x"
            met = "—" if q["target"] is None else ("yes" if q["ratio"] <= q["target"] else "**no**")
            lines.append(f"| {name} | {q['of']} / {q['to']} | | {q['ratio']:.2f}x | {target} | {met} |")
    for kind, m in memory.items():
        who = "raw gloo" if kind.startswith("raw") else "objcomm"
        met = "—" if who == "raw gloo" else ("yes" if m["per_world_x_size"] <= 1.5 else "**no**")
        lines.append(
            f"| peak extra RSS, all_gather of {kind} | {who} | {m['extra_bytes'] / MB:.0f} MB | "
            f"{m['per_world_x_size']:.2f} x W x S | ≤ 1.5 x W x S | {met} |"
        )
    return "\n".join(lines)


def _progress(world: int, name: str) -> None:
    print(f"  [{world} ranks] {name} done", file=sys.stderr)


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat-scale", type=float, default=1.0, help="scale every scenario's rounds")
    parser.add_argument("--memory-mb", type=int, default=64, help="payload per rank of the memory check")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args(argv)
    everything = {}
    for world in args.world_sizes:
        progress = functools.partial(_progress, world)
        results = run_local(timing_task, args.repeat_scale, world_size=world, on_message=progress)
        slots = run_local(slot_task, max(20, int(200 * args.repeat_scale)), world_size=world)
        memory = {}
        for kind in ("tensor", "bytes", "raw"):
            spec = {"kind": kind, "mb": args.memory_mb}
            memory[f"{kind} {args.memory_mb} MB"] = run_local(memory_task, spec, world_size=world)
        everything[world] = {"timings": results, "memory": memory, "slot_sizes": slots}
        print(_markdown(world, results, memory), flush=True)
        print()
        print("raw all_gather per slot size: " + ", ".join(f"{k}: {v * 1e6:.0f} µs" for k, v in slots.items()))
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
