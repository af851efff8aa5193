"""all_to_all, all_reduce and scan of objects against what users write today, and against the raw floor.

    python benchmarks/bench_vocabulary.py                     # world sizes 2 and 4, gloo, markdown to stdout
    python benchmarks/bench_vocabulary.py --world-sizes 2 --repeat-scale 0.3
    python benchmarks/bench_vocabulary.py --world-sizes 4 8 --only scan    # the scenarios whose name has "scan"

torch has no object all-to-all, no object reduction and no scan, so the comparison is the workaround:
``all_gather_object`` of everything, then pick one's own part (all_to_all), reduce locally
(all_reduce) or combine the ranks up to this one (scan); the same workaround through ``objcomm.all_gather``; and a raw
``all_to_all_single``
of the same pickled bytes with uneven splits (the floor for all_to_all). Candidates run
round-robin on live local gloo ranks; a sample is the slowest rank's time; medians are reported.
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import pickle
import sys
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

import objcomm
from objcomm._tools.bench.launch import run_local
from objcomm._tools.bench.measure import interleaved

MB = 1 << 20


def _records(src: int, dst: int, count: int) -> List[Dict[str, Any]]:
    return [
        {"id": src * 100_000 + dst * 1000 + i, "label": i % 7, "score": i / 13, "tag": f"s{src}d{dst}"}
        for i in range(count)
    ]


def _torch_pick(objs: List[Any]) -> Callable[[], Any]:
    """What users write today: gather every rank's whole list, keep the parts addressed to this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: List[Any] = [None] * world

    def run() -> List[Any]:
        dist.all_gather_object(out, objs)
        return [out[src][rank] for src in range(world)]

    return run


def _objcomm_pick(objs: List[Any]) -> Callable[[], Any]:
    rank = dist.get_rank()
    return lambda: [row[rank] for row in objcomm.all_gather(objs)]


def _raw_all_to_all(objs: List[Any]) -> Callable[[], Any]:
    """all_to_all_single of each part's pickled size, uneven splits: the bytes alone."""
    sizes = [len(pickle.dumps(o, protocol=5)) for o in objs]
    incoming = torch.tensor(sizes, dtype=torch.int64)
    received_sizes = torch.empty_like(incoming)
    dist.all_to_all_single(received_sizes, incoming)
    send = torch.zeros(sum(sizes), dtype=torch.uint8)
    recv = torch.empty(int(received_sizes.sum()), dtype=torch.uint8)
    splits = received_sizes.tolist()
    return lambda: dist.all_to_all_single(recv, send, output_split_sizes=splits, input_split_sizes=sizes)


def _torch_reduce(obj: Any, op: Callable[[Any, Any], Any]) -> Callable[[], Any]:
    out: List[Any] = [None] * dist.get_world_size()

    def run() -> Any:
        dist.all_gather_object(out, obj)
        return functools.reduce(op, out)

    return run


def _torch_scan(obj: Any, op: Callable[[Any, Any], Any]) -> Callable[[], Any]:
    out: List[Any] = [None] * dist.get_world_size()

    def run() -> Any:
        dist.all_gather_object(out, obj)
        return functools.reduce(op, out[: dist.get_rank() + 1])

    return run


def _merge_sum(a: Dict[Any, int], b: Dict[Any, int]) -> Dict[Any, int]:
    merged = dict(a)
    for key, value in b.items():
        merged[key] = merged.get(key, 0) + value
    return merged


def _scenarios(repeat_scale: float) -> Dict[str, Dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    rounds = lambda n: max(3, int(n * repeat_scale))  # noqa: E731
    small = [_records(rank, dst, 10) for dst in range(world)]
    wide = [bytes([dst]) * MB for dst in range(world)]
    skewed = [b"B" * (8 * MB) if (rank, dst) == (0, world - 1) else b"s" for dst in range(world)]
    counters = {f"class-{(rank * 37 + i) % 1500}": i for i in range(1000)}
    big_counters = {(rank * 7 + i) % 60_000: 1 for i in range(50_000)}
    scenarios: Dict[str, Dict[str, Any]] = {}
    for name, objs, repeat in (
        ("all_to_all 10 records per pair", small, 200),
        ("all_to_all 1 MB per pair", wide, 20),
        ("all_to_all one 8 MB pair, the rest tiny", skewed, 20),
    ):
        scenarios[name] = {
            "repeat": rounds(repeat),
            "candidates": {
                "objcomm": lambda objs=objs: objcomm.all_to_all(objs),
                "torch all_gather_object + pick": _torch_pick(objs),
                "objcomm all_gather + pick": _objcomm_pick(objs),
                "raw all_to_all_single": _raw_all_to_all(objs),
            },
            "ratios": [
                ("objcomm", "torch all_gather_object + pick"),
                ("objcomm", "objcomm all_gather + pick"),
                ("objcomm", "raw all_to_all_single"),
            ],
        }
    for name, obj, repeat in (
        ("all_reduce of 1,000 counters", counters, 100),
        ("all_reduce of 50,000 counters", big_counters, 10),
    ):
        scenarios[name] = {
            "repeat": rounds(repeat),
            "candidates": {
                "objcomm": lambda obj=obj: objcomm.all_reduce(obj, "merge_sum"),
                "torch all_gather_object + reduce": _torch_reduce(obj, _merge_sum),
                "objcomm all_gather + reduce": lambda obj=obj: functools.reduce(_merge_sum, objcomm.all_gather(obj)),
            },
            "ratios": [("objcomm", "torch all_gather_object + reduce"), ("objcomm", "objcomm all_gather + reduce")],
        }
    for name, obj, repeat in (("scan of a count", 1000 + rank, 200), ("scan of 1,000 counters", counters, 100)):
        add = operator.add if isinstance(obj, int) else _merge_sum
        scenarios[name] = {
            "repeat": rounds(repeat),
            "candidates": {
                "objcomm": lambda obj=obj, add=add: objcomm.scan(obj, add),
                "torch all_gather_object + prefix": _torch_scan(obj, add),
                "objcomm all_gather + prefix": lambda obj=obj, add=add: functools.reduce(
                    add, objcomm.all_gather(obj)[: rank + 1]
                ),
            },
            "ratios": [("objcomm", "torch all_gather_object + prefix"), ("objcomm", "objcomm all_gather + prefix")],
        }
    return scenarios


def timing_task(scale_and_only: Any, send: Callable[[Any], None]) -> Dict[str, Any]:
    repeat_scale, only = scale_and_only
    results = {}
    for name, scenario in _scenarios(repeat_scale).items():
        if only not in name:
            continue
        timings = interleaved(scenario["candidates"], repeat=scenario["repeat"], warmup=2)
        medians = {k: t.median_s for k, t in timings.items()}
        ratios = [{"of": a, "to": b, "ratio": medians[a] / medians[b]} for a, b in scenario["ratios"]]
        results[name] = {"median_s": medians, "ratios": ratios, "repeat": scenario["repeat"]}
        if dist.get_rank() == 0:
            send(name)
    return results


def _markdown(world: int, results: Dict[str, Any]) -> str:
    lines = [
        f"### gloo, world size {world}",
        "",
        "torch has no object all-to-all or reduce: its column is the all_gather_object workaround.",
        "",
        "| scenario | candidate | median | ratio |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        for k, seconds in r["median_s"].items():
            lines.append(f"| {name} | {k} | {seconds * 1000:.2f} ms | |")
        for q in r["ratios"]:
            lines.append(f"| {name} | {q['of']} / {q['to']} | | {q['ratio']:.2f}x |")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat-scale", type=float, default=1.0, help="scale every scenario's rounds")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--only", default="", help="only the scenarios whose name holds this text")
    args = parser.parse_args(argv)
    everything = {}
    for world in args.world_sizes:
        progress = lambda name, world=world: print(f"  [{world} ranks] {name} done", file=sys.stderr)  # noqa: E731
        task_arg = (args.repeat_scale, args.only)
        everything[world] = run_local(timing_task, task_arg, world_size=world, on_message=progress)
        print(_markdown(world, everything[world]), flush=True)
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
