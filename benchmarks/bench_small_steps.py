"""A small object's broadcast, all_gather and send/recv round trip at W=2: Python steps and time per call.

Small calls are where objcomm's own Python shows: a metrics dict moves in ~20 µs, and every layer a call passes adds
to it. Time per call on a shared machine drifts by more than a layer costs, so this counts what does not drift too:
the Python bytecodes each rank executes per call, and the Python functions it enters (``sys.settrace`` opcode events;
the waits' polling loop left out, which spins as long as the peer takes). On gloo over 127.0.0.1, the defaults (the
express path; each rank pinned to its own CPU where there are two) or ``--backend`` (``local=False``: the general
path, round 1 through gloo, whose threads need the CPUs free). Given several source trees (a checkout of an
older commit, say), each runs its own ``objcomm`` in turn, ``--runs`` times, timings as the best sample of each run::

    python benchmarks/bench_small_steps.py                        # this tree
    python benchmarks/bench_small_steps.py --trees /tmp/old .     # two trees, alternately
    python benchmarks/bench_small_steps.py --backend              # local=False: the general path, round 1 through gloo

The steps are the same from run to run; a tree that takes more of them per call is slower by about 10-20 ns each on
this machine, plus ~0.1 µs a function entered.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

SMALL = {"loss": 0.2513, "accuracy": 0.9172, "step": 12_000, "lr": 3e-4, "run": "resnet50-ablation-7"}
OPS = ("broadcast", "all_gather", "send/recv round trip")
SPINNING = ("poll_briefly",)  # waits that loop while the peer works: their steps count time, not work


def _rank_main() -> None:
    """One rank: warm up, count the steps of 100 calls, time 15 batches of 400; rank 0 prints both ranks' JSON."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    import objcomm

    comm = objcomm.Communicator(local=os.environ.get("STEPS_LOCAL") != "0")
    mine = SMALL if rank == 0 else None

    def round_trip() -> Any:  # rank 0 sends to rank 1, which sends it back
        if rank == 0:
            comm.send(SMALL, 1)
            return comm.recv(1)
        comm.send(comm.recv(0), 0)
        return None

    calls = {
        "broadcast": lambda: comm.broadcast(mine, src=0),
        "all_gather": lambda: comm.all_gather(SMALL),
        "send/recv round trip": round_trip,
    }
    found: Dict[str, Any] = {"objcomm": os.path.dirname(os.path.dirname(objcomm.__file__))}
    for op, call in calls.items():
        for _ in range(300):
            call()
        steps, functions = _count(call, 100)
        best = float("inf")
        for _ in range(15):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(400):
                call()
            best = min(best, (time.perf_counter() - start) / 400)
        found[op] = {"steps": steps, "functions": functions, "seconds": best}
    both: List[Any] = [None, None]
    dist.all_gather_object(both, found)
    if rank == 0:
        print(json.dumps(both))
    dist.destroy_process_group()


def _count(call: Callable[[], Any], times: int) -> Tuple[float, float]:
    """Python steps (bytecodes) and functions entered per ``call()``, the spinning waits left out, with the
    barrier before them (the peer runs the same calls)."""
    import torch.distributed as dist

    steps, entered = [0], [0]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_qualname in SPINNING:
            return None
        if event == "call":
            frame.f_trace_opcodes = True
            entered[0] += 1
        elif event == "opcode":
            steps[0] += 1
        return tracer

    dist.barrier()
    sys.settrace(tracer)
    try:
        for _ in range(times):
            call()
    finally:
        sys.settrace(None)
    return steps[0] / times, entered[0] / times


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run(tree: str, local: bool) -> List[Dict[str, Any]]:
    """Both ranks of one run on ``tree``'s objcomm (``local``: the calls' setting); each rank's counts."""
    port, pin = _free_port(), (os.cpu_count() or 1) >= 2
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": os.path.abspath(tree),
            "STEPS_LOCAL": str(int(local)),
            "OMP_NUM_THREADS": "1",
        }
        env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        command = [sys.executable, os.path.abspath(__file__), "--rank"]
        procs.append(subprocess.Popen(["taskset", "-c", str(rank), *command] if pin and local else command, env=env,
                                      stdout=subprocess.PIPE, text=True))  # fmt: skip
    try:
        out, _ = procs[0].communicate(timeout=300)
        procs[1].wait(timeout=60)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    if procs[0].returncode or procs[1].returncode:
        raise SystemExit(f"a rank failed on {tree} (exit codes {procs[0].returncode}, {procs[1].returncode})")
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--trees", nargs="+", default=["."], help="source trees, each with its own objcomm")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backend", action="store_true", help="local=False: round 1 through gloo (ranks not pinned)")
    args = parser.parse_args(argv)
    runs: Dict[str, List[List[Dict[str, Any]]]] = {tree: [] for tree in args.trees}
    for _ in range(args.runs):
        for tree in args.trees:
            runs[tree].append(_run(tree, local=not args.backend))
    print("| tree | op | rank | Python steps a call | functions entered | µs a call, best of each run |")
    print("|---|---|---:|---:|---:|---|")
    for tree, found in runs.items():
        for op in OPS:
            for rank in (0, 1):
                first = found[0][rank][op]
                times = ", ".join(f"{run[rank][op]['seconds'] * 1e6:.1f}" for run in found)
                print(f"| {tree} | {op} | {rank} | {first['steps']:.0f} | {first['functions']:.0f} | {times} |")


if __name__ == "__main__":
    if sys.argv[1:] == ["--rank"]:
        _rank_main()
    else:
        main(sys.argv[1:])
