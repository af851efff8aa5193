"""restricted-pickle decode time against plain ``pickle.loads`` on the bench payloads (issue 13 item 5).

    python benchmarks/bench_restricted.py                 # 1 KB, 1 MB and 16 MB payloads
    python benchmarks/bench_restricted.py --sizes 1K,1M --profile records:1M

Prints a Markdown table: per payload and size, the median time of ``pickle.loads`` and of
restricted-pickle's ``loads`` on the same restricted-pickle bytes, and their ratio.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pickle
import pstats
import statistics
import time
from typing import Any, Callable, List, Tuple

import serializers
from objcomm._bench._payloads import BUILTIN

_SIZES = {"1K": 1 << 10, "1M": 1 << 20, "16M": 16 << 20}


def _medians(a: Callable[[], Any], b: Callable[[], Any], budget_s: float) -> Tuple[float, float]:
    """Median wall times of ``a`` and ``b``, called alternately to fill about ``budget_s`` (at least 7 each).

    The cyclic garbage collector is paused while timing: it would add the same work to both (the
    values are the same) and most of the run-to-run noise.
    """
    start = time.perf_counter()
    a()
    b()
    repeats = max(7, min(2000, int(budget_s / max(time.perf_counter() - start, 1e-7))))
    times: Tuple[List[float], List[float]] = ([], [])
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for fn, into in ((a, times[0]), (b, times[1])):
                start = time.perf_counter()
                fn()
                into.append(time.perf_counter() - start)
    finally:
        gc.enable()
    return statistics.median(times[0]), statistics.median(times[1])


def _fmt(seconds: float) -> str:
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
    print("| payload | size | pickle bytes | pickle.loads | restricted loads | ratio |")
    print("|---|---|---|---|---|---|")
    for name in args.payloads.split(","):
        payload = BUILTIN[name]
        for label in args.sizes.split(",") if payload.scalable else ["fixed"]:
            data = bytes(restricted.dumps(payload.make(0, _SIZES.get(label, 0))))
            plain, safe = _medians(lambda d=data: pickle.loads(d), lambda d=data: restricted.loads(d), args.budget)
            print(f"| {name} | {label} | {len(data):,} | {_fmt(plain)} | {_fmt(safe)} | {safe / plain:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
