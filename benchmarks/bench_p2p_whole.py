"""A send/recv round trip through a CPU group's backend: a medium message's slot and rest in one message of gloo
against two (its slot, then its rest), on two real ranks of one machine.

    PYTHONPATH=. python benchmarks/bench_p2p_whole.py [--rounds 8] [--calls 200]

What every send between ranks on different hosts takes (and on one host with ``OBJCOMM_LOCAL=0``, or before the
same-host channel opens). gloo's send waits until its receiver posts the receive, so each message costs a
rendezvous: ``routes.backend_whole`` sends a rest of at most ``routes.BACKEND_WHOLE_BYTES`` with its slot. Both ways
are forced alternately in one run (``BACKEND_WHOLE_BYTES`` set to 0 on both ranks: the two-message way), with
torch's ``send_object_list`` / ``recv_object_list`` and a raw gloo round trip of the same pickled bytes (the floor):
the median over ``--rounds`` samples of ``--calls`` round trips each, rank 0's time per round trip, µs.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

SIZES = (6 << 10, 16 << 10, 48 << 10)  # about the bytes pickled: past the 4 KiB slot, within the 60 KiB cut-off


def _records(size: int) -> List[Dict[str, Any]]:
    return [{"id": i, "label": i % 10, "score": i * 0.001, "text": "sample text"} for i in range(size // 27)]


def _trips(rank: int, obj: Any, raw: Any) -> Dict[str, Callable[[], None]]:
    """One round trip of each candidate, by name (``one`` and ``two`` are objcomm's, run with the cut-off each way)."""
    import torch.distributed as dist

    import objcomm

    peer = 1 - rank

    def objcomm_trip() -> None:
        if rank == 0:
            objcomm.send(obj, 1)
            objcomm.recv(1)
        else:
            objcomm.send(objcomm.recv(0), 0)

    def torch_trip() -> None:
        box = [obj if rank == 0 else None]
        if rank == 0:
            dist.send_object_list(box, 1)
            dist.recv_object_list(box, 1)
        else:
            dist.recv_object_list(box, 0)
            dist.send_object_list(box, 0)

    def raw_trip() -> None:
        if rank == 0:
            dist.send(raw, peer)
            dist.recv(raw, peer)
        else:
            dist.recv(raw, peer)
            dist.send(raw, peer)

    return {"one": objcomm_trip, "two": objcomm_trip, "torch": torch_trip, "raw": raw_trip}


def timed(arg: Dict[str, int], send: Any) -> List[Any]:
    import torch
    import torch.distributed as dist

    import objcomm
    from objcomm._transport.routes import cutoffs

    objcomm.configure(local=False)  # through the backend, as between hosts
    rank = dist.get_rank()
    whole = cutoffs.BACKEND_WHOLE_BYTES
    rows = []
    for size in SIZES:
        obj = _records(size)
        raw = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)

        ways = _trips(rank, obj, raw)
        samples: Dict[str, List[float]] = {name: [] for name in ways}
        for _ in range(arg["rounds"]):
            for name, trip in ways.items():
                cutoffs.BACKEND_WHOLE_BYTES = 0 if name == "two" else whole
                dist.barrier()
                for _ in range(10):
                    trip()
                start = time.perf_counter()
                for _ in range(arg["calls"]):
                    trip()
                samples[name].append((time.perf_counter() - start) / arg["calls"])
        cutoffs.BACKEND_WHOLE_BYTES = whole
        rows.append((len(raw), *(statistics.median(v) for v in samples.values())))
    return rows


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    from objcomm._tools.launch import run_local

    rows = run_local(timed, {"rounds": args.rounds, "calls": args.calls}, world_size=2)
    print("| pickled | one message (µs) | two messages (µs) | one / two | torch (µs) | one / torch | raw gloo (µs) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size, one, two, torch_s, raw in rows:
        print(
            f"| {size / 1024:.1f} KB | {one * 1e6:.0f} | {two * 1e6:.0f} | {one / two:.2f} | {torch_s * 1e6:.0f} | "
            f"{one / torch_s:.2f} | {raw * 1e6:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
