"""Longer hostile-input run: the adversarial fuzz tests at N times their CI size, plus the worst cases.

    python benchmarks/fuzz_hostile.py --scale 20          # about 440,000 generated inputs
    python benchmarks/fuzz_hostile.py --amplification     # memory and time per input byte, worst cases

The fuzz tests (tests/*/test_adversarial_*.py -k fuzz) decode restricted-pickle opcode programs
built from the allowed globals, nested msgpack extension trees, and frames, slots and error
reports with lying fields, each in a child process with its address space capped. In CI they run
22,000 inputs; ``--scale N`` multiplies that through ``OBJCOMM_FUZZ_SCALE``.

``--amplification`` decodes one-megabyte payloads built to maximise memory per input byte (empty
containers) and reports peak traced memory and decode time per byte for each safe serializer: the
constants docs/security.md quotes. Then, for every constructor restricted-pickle allows, the worst of
its hostile cases (tests/serializing/test_restricted_constructor_work.py: one argument memoized, the constructor
called on it five bytes a call; and what it built used as set members, as often as the walk lets
through): peak memory (traced, or RSS growth where larger) and decode CPU per input byte (~5 minutes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 1_000_000


def _worst_cases() -> dict:
    n4 = N.to_bytes(4, "big")
    return {
        ("restricted-pickle", "empty lists"): b"\x80\x05](" + b"]" * N + b"e.",
        ("restricted-pickle", "empty dicts"): b"\x80\x05](" + b"}" * N + b"e.",
        ("restricted-pickle", "empty sets"): b"\x80\x05](" + b"\x8f" * N + b"e.",
        ("restricted-pickle", "empty frozensets"): b"\x80\x05](" + b"(\x91" * (N // 2) + b"e.",
        ("restricted-pickle", "memo references"): b"\x80\x05]\x94(" + b"h\x00" * N + b"e.",
        ("msgpack", "empty arrays"): b"\xdd" + n4 + b"\x90" * N,
        ("msgpack", "empty maps"): b"\xdd" + n4 + b"\x80" * N,
        ("msgpack", "empty tuples (ext)"): b"\xdd" + n4 + b"\xd4\x01\x90" * N,
        ("json", "empty arrays"): b"[" + b"[]," * (N - 1) + b"[]]",
        ("json", "empty objects"): b"[" + b"{}," * (N - 1) + b"{}]",
    }


def amplification() -> None:
    import serializers

    print("| serializer | payload | input bytes | peak memory / input byte | decode ns / input byte |")
    print("|---|---|---|---|---|")
    for (name, label), data in _worst_cases().items():
        s = serializers.get(name)
        start = time.perf_counter()
        s.loads(data)
        elapsed = time.perf_counter() - start
        tracemalloc.start()
        s.loads(data)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"| {name} | {label} | {len(data):,} | {peak / len(data):.1f} | {elapsed / len(data) * 1e9:.0f} |")
    print()
    constructor_amplification()


def constructor_amplification() -> None:
    """The worst case of each allowed constructor, from the test that bounds them (its cases, 1 MiB each)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_restricted_constructor_work import AS_KEYS, measure_all

    worst: dict = {}
    for label, (_, size, cpu, peak, _) in measure_all(size=N).items():
        constructor, _, case = label.partition(": ")
        row = worst.setdefault(constructor, {"memory": (0.0, ""), "cpu": (0.0, ""), "keys": (0.0, "")})
        if case.endswith(AS_KEYS):
            row["keys"] = max(row["keys"], (cpu / size * 1e9, case[: -len(AS_KEYS)]))
        else:
            row["memory"] = max(row["memory"], (peak / size, case))
            row["cpu"] = max(row["cpu"], (cpu / size * 1e9, case))
    print(
        "| restricted-pickle constructor | worst peak memory / input byte | worst decode CPU ns / input byte "
        "| worst CPU ns / input byte, what it built used as keys |"
    )
    print("|---|---|---|---|")
    for constructor, row in sorted(worst.items()):
        cells = [
            f"{value:.1f} ({case})" if kind == "memory" else f"{value:.0f} ({case})"
            for kind, (value, case) in row.items()
        ]
        print(f"| {constructor} | " + " | ".join(cells) + " |")


def fuzz(scale: int) -> int:
    env = dict(os.environ, OBJCOMM_FUZZ_SCALE=str(scale))
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-k",
        "fuzz",
        "-o",
        f"timeout={300 * scale}",
        "tests/serializing/test_adversarial_serializers.py",
        "tests/format/test_adversarial_wire.py",
    ]
    print("running:", f"OBJCOMM_FUZZ_SCALE={scale}", " ".join(command[1:]), flush=True)
    start = time.perf_counter()
    code = subprocess.call(command, cwd=ROOT, env=env)
    print(f"{22_000 * scale:,} inputs in {time.perf_counter() - start:.0f} s, exit code {code}")
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=int, default=10, help="multiply the CI fuzz sizes by this (default 10)")
    parser.add_argument("--amplification", action="store_true", help="only measure the worst cases per byte")
    args = parser.parse_args()
    if args.amplification:
        amplification()
        return 0
    return fuzz(args.scale)


if __name__ == "__main__":
    sys.exit(main())
