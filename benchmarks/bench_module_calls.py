"""Module-level calls on a given group against a kept Communicator: what making a Communicator per call costs.

    PYTHONPATH=. python benchmarks/bench_module_calls.py [--world-size 2] [--rounds 15]

``objcomm.all_gather(x, group=g)`` (and every module-level function given ``group=``, and the ``objcomm.compat``
shims) makes a ``Communicator`` for the call; communicators made alike on a group share what their calls worked
out, the short path of small calls included. This times a small dict's all_gather, broadcast (from rank 0) and
send/recv round trip (rank 0 to 1 and back) on a subgroup of every rank three ways: through the module-level
functions with ``group=``, through one kept ``Communicator(g)``, and torch's object collectives; gloo over 127.0.0.1,
the process-wide defaults. Interleaved in one run (``objcomm._tools.bench.measure.interleaved``, calls timed several
at a time), each sample the slowest rank's time; median per call.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, List

SMALL = {"loss": 0.2513, "accuracy": 0.9172, "step": 12_000, "lr": 3e-4, "run": "resnet50-ablation-7"}
WAYS = ("objcomm.f(..., group=g)", "Communicator(g), kept", "torch")


def _calls(group: Any) -> Dict[str, Dict[str, Callable[[], Any]]]:
    import torch.distributed as dist

    import objcomm

    rank, world = dist.get_rank(), dist.get_world_size(group)
    kept = objcomm.Communicator(group)

    def torch_all_gather() -> Any:
        every: List[Any] = [None] * world
        dist.all_gather_object(every, SMALL, group=group)
        return every

    def torch_broadcast() -> Any:
        box = [SMALL if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def round_trip(send: Callable[..., Any], recv: Callable[..., Any]) -> Callable[[], Any]:
        def trip() -> Any:
            if rank == 0:
                send(SMALL, 1)
                return recv(1)
            if rank == 1:
                send(recv(0), 0)
            return None

        return trip

    def torch_send(obj: Any, dst: int) -> None:
        dist.send_object_list([obj], dst=dst, group=group)

    def torch_recv(src: int) -> Any:
        box: List[Any] = [None]
        dist.recv_object_list(box, src=src, group=group)
        return box[0]

    return {
        "all_gather": {
            WAYS[0]: lambda: objcomm.all_gather(SMALL, group=group),
            WAYS[1]: lambda: kept.all_gather(SMALL),
            WAYS[2]: torch_all_gather,
        },
        "broadcast": {
            WAYS[0]: lambda: objcomm.broadcast(SMALL if rank == 0 else None, src=0, group=group),
            WAYS[1]: lambda: kept.broadcast(SMALL if rank == 0 else None, src=0),
            WAYS[2]: torch_broadcast,
        },
        "send/recv round trip": {
            WAYS[0]: round_trip(
                lambda obj, dst: objcomm.send(obj, dst, group=group), lambda src: objcomm.recv(src, group=group)
            ),
            WAYS[1]: round_trip(kept.send, kept.recv),
            WAYS[2]: round_trip(torch_send, torch_recv),
        },
    }


def timed(arg: Dict[str, Any], send: Any) -> Dict[str, Dict[str, float]]:
    import torch.distributed as dist

    from objcomm._tools.bench.measure import interleaved

    group = dist.new_group(list(range(dist.get_world_size())))
    out: Dict[str, Dict[str, float]] = {}
    for op, runs in _calls(group).items():
        timings = interleaved(runs, repeat=arg["rounds"], warmup=3, min_sample_s=0.003)
        out[op] = {way: timing.median_s for way, timing in timings.items()}
    return out


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    from objcomm._tools.launch import run_local

    got = run_local(timed, {"rounds": args.rounds}, world_size=args.world_size)
    print(f"| W | op | {' | '.join(WAYS)} | per call ÷ kept | per call ÷ torch |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for op, row in got.items():
        made, kept, theirs = (row[way] for way in WAYS)
        cells = " | ".join(f"{row[way] * 1e6:.0f} µs" for way in WAYS)
        print(f"| {args.world_size} | {op} | {cells} | {made / kept:.2f} | {made / theirs:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
