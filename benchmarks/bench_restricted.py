"""restricted-pickle decode time against plain ``pickle.loads`` on the bench payloads (issue 13 item 5).

    python benchmarks/bench_restricted.py                 # 1 KB, 1 MB and 16 MB payloads
    python benchmarks/bench_restricted.py --sizes 1K,1M --profile records:1M

Prints a Markdown table: per payload and size, the median time of ``pickle.loads`` and of
restricted-pickle's ``loads`` on the same restricted-pickle bytes, and their ratio; and the same
``loads`` with both walks in pure Python (``is_plain_python``, ``full_walk_python``: what an install
without a compiler runs), where the C walks were built.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pickle
import pstats
import statistics
import time
from typing import Any, Callable, List, Sequence

import serializers
from objcomm._tools.bench.payloads import BUILTIN
from serializers import _restricted
from serializers._restricted import plain as _plain
from serializers._restricted import scan as _scan

_SIZES = {"1K": 1 << 10, "1M": 1 << 20, "16M": 16 << 20}


def _medians(fns: Sequence[Callable[[], Any]], budget_s: float) -> List[float]:
    """Median wall times of ``fns``, called in turn to fill about ``budget_s`` (at least 7 each).

    The cyclic garbage collector is paused while timing: it would add the same work to all (the
    values are the same) and most of the run-to-run noise.
    """
    start = time.perf_counter()
    for fn in fns:
        fn()
    repeats = max(7, min(2000, int(budget_s / max(time.perf_counter() - start, 1e-7))))
    times: List[List[float]] = [[] for _ in fns]
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for fn, into in zip(fns, times):
                start = time.perf_counter()
                fn()
                into.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return [statistics.median(each) for each in times]


def _python_walk_loads(restricted: Any) -> Callable[[bytes], Any]:
    """restricted-pickle's ``loads`` with both walks in pure Python, as without the C build."""

    def loads(data: bytes) -> Any:
        with _restricted.python_walks():
            return restricted.loads(data)

    return loads


def _fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} µs"
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1K,1M,16M", help="comma-separated among 1K, 1M, 16M")
    parser.add_argument("--payloads", default=",".join(BUILTIN), help="comma-separated payload names")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per measurement")
    parser.add_argument("--profile", metavar="PAYLOAD:SIZE", help="print a cProfile of one restricted loads")
    args = parser.parse_args()
    restricted = serializers.get("restricted-pickle")
    if args.profile:
        name, _, size = args.profile.partition(":")
        data = bytes(restricted.dumps(BUILTIN[name].make(0, _SIZES.get(size or "1M", 0))))
        restricted.loads(data)  # warm: the first load compiles the fast walk's patterns
        start = time.perf_counter()
        restricted.loads(data)
        calls = max(1, min(5000, int(0.5 / max(time.perf_counter() - start, 1e-7))))
        profile = cProfile.Profile()
        gc.collect()
        gc.disable()  # as while timing
        try:
            profile.runcall(lambda: [restricted.loads(data) for _ in range(calls)])
        finally:
            gc.enable()
        print(f"{calls} loads of {len(data):,} bytes, cyclic GC paused")
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)
        return
    with_c = _plain.is_plain_c is not None and _scan._full_walk_c is not None
    python_walk = _python_walk_loads(restricted)
    extra = " | restricted loads, Python walks | ratio" if with_c else ""
    print(f"| payload | size | pickle bytes | pickle.loads | restricted loads | ratio{extra} |")
    print("|---|---|---|---|---|---|" + ("---|---|" if with_c else ""))
    for name in args.payloads.split(","):
        payload = BUILTIN[name]
        for label in args.sizes.split(",") if payload.scalable else ["fixed"]:
            data = bytes(restricted.dumps(payload.make(0, _SIZES.get(label, 0))))
            fns = [lambda d=data: pickle.loads(d), lambda d=data: restricted.loads(d)]
            if with_c:
                fns.append(lambda d=data: python_walk(d))
            plain, safe, *slow = _medians(fns, args.budget)
            row = f"| {name} | {label} | {len(data):,} | {_fmt(plain)} | {_fmt(safe)} | {safe / plain:.2f}x |"
            if slow:
                row += f" {_fmt(slow[0])} | {slow[0] / plain:.2f}x |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
