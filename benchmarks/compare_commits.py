"""One benchmark on two commits, run alternately in one sitting: is the new code as fast as the old?

    python benchmarks/compare_commits.py fb7c0c7 HEAD --runs 3 -n 2 -- --only small medium
    python benchmarks/compare_commits.py fb7c0c7 HEAD --runs 3 -n 4 -- --only small

Each commit is checked out into a temporary worktree (its C extensions built in place) and runs its own
``benchmarks/bench_peers.py`` under ``mpiexec -n N``, old and new in turn, ``--runs`` times each. Absolute times
drift on a shared machine, so what is compared is each objcomm row's median as a ratio of the rows every commit
measures with the same code (mpi4py, raw gloo: the collective of the same bytes) within its own run; the table gives the
median of those ratios per commit and new ÷ old. Rank 0's tables are parsed as bench_peers prints them.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

ROW = re.compile(r"^\| (?P<scenario>[^|]+?) \| (?P<who>[^|*]+?) \| (?P<ms>[\d.,]+) (?P<unit>µs|ms|s) \| \|$")
UNIT = {"µs": 1e-6, "ms": 1e-3, "s": 1.0}
REFERENCES = ("mpi4py", "raw gloo")  # the same code on both commits: the yardsticks


def _checkout(repo: str, rev: str, into: str) -> str:
    path = os.path.join(into, rev.replace("/", "_"))
    subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", "-q", path, rev], check=True)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=path, check=True,
                   capture_output=True)  # fmt: skip
    return path


def _run(tree: str, ranks: int, extra: List[str]) -> Dict[Tuple[str, str], float]:
    env = {**os.environ, "PYTHONPATH": tree}
    command = ["mpiexec", "-n", str(ranks), sys.executable, "benchmarks/bench_peers.py", *extra]
    out = subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        match = ROW.match(line.strip())
        if match:
            seconds = float(match["ms"].replace(",", "")) * UNIT[match["unit"]]
            found[(match["scenario"].strip(), match["who"].strip())] = seconds
    return found


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0], epilog="arguments after -- go to bench_peers.py"
    )
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("-n", type=int, default=2, help="ranks (mpiexec -n)")
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.extra = argv[cut + 1 :]  # bench_peers' own arguments, after --
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True)
    with tempfile.TemporaryDirectory() as into:
        trees = {rev: _checkout(repo.stdout.strip(), rev, into) for rev in (args.old, args.new)}
        runs: Dict[str, List[Dict[Tuple[str, str], float]]] = {rev: [] for rev in trees}
        try:
            for i in range(args.runs):
                for rev, tree in trees.items():
                    print(f"run {i + 1}/{args.runs}: {rev}", file=sys.stderr, flush=True)
                    runs[rev].append(_run(tree, args.n, args.extra))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", repo.stdout.strip(), "worktree", "remove", "--force", tree], check=False)
    print(f"| scenario (W={args.n}) | objcomm ÷ | {args.old} | {args.new} | new ÷ old |")
    print("|---|---|---:|---:|---:|")
    scenarios = sorted({s for found in runs[args.new] for (s, who) in found if who.startswith("objcomm")})
    for scenario in scenarios:
        for who in sorted({w for found in runs[args.new] for (s, w) in found if s == scenario}):
            if not who.startswith("objcomm"):
                continue
            for reference in REFERENCES:
                ratio = {}
                for rev in trees:
                    values = [
                        found[(scenario, who)] / found[(scenario, reference)]
                        for found in runs[rev]
                        if (scenario, who) in found and (scenario, reference) in found
                    ]
                    ratio[rev] = statistics.median(values) if values else None
                old, new = ratio[args.old], ratio[args.new]
                if old is None or new is None:
                    continue
                print(f"| {scenario}: {who} | {reference} | {old:.2f} | {new:.2f} | **{new / old:.2f}** |")


if __name__ == "__main__":
    main(sys.argv[1:])
