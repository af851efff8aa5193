"""Where one send/recv round trip's time goes, per phase, on both ranks (W=2, the same-host channel).

    PYTHONPATH=. python benchmarks/bench_p2p_phases.py [--size 16384] [--trips 300] [--spin-us 100]

Rank 0 sends a list of evaluation records of about ``--size`` pickled bytes to rank 1, which sends it back
(``--trips`` round trips after a warm-up, the channel opened by a collective first). Each phase of objcomm's path
is wrapped with a timer: serializing, the transport's send (slot and rest through the channel), receiving the
rest, decoding and the serializer's ``loads`` inside it; and, in the same process afterwards, pickle's ``dumps``
and ``loads`` of the same object in a loop of their own. Prints microseconds per message, per rank. The timers
cost a few µs a phase; compare phases, not totals, with ``bench_peers.py``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import pickle
import sys
import time
from typing import Any, Dict, List


def phases(arg: Dict[str, int], send: Any) -> List[Dict[str, str]]:
    import torch.distributed as dist

    import objcomm
    from objcomm._format import frame as _frame
    from objcomm._samehost import channel_rests as _channel_rests
    from objcomm._transport import rounds as _rounds

    spent: Dict[str, float] = collections.defaultdict(float)

    def timed(module: Any, name: str, label: str) -> None:
        fn = getattr(module, name)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - start

        setattr(module, name, wrapper)

    for module, name, label in [
        (_frame, "serialize", "serialize"),
        (_rounds, "_send", "transport send"),
        (_channel_rests, "recv_p2p", "transport receive, the rest"),
        (_frame, "decode_parsed", "decode"),
        (_frame, "loads_payload", "loads in decode"),
    ]:
        timed(module, name, label)
    rank, trips = dist.get_rank(), arg["trips"]
    obj = [{"id": i, "label": i % 10, "score": i * 0.001, "text": "sample text"} for i in range(arg["size"] // 27)]
    comm = objcomm.Communicator(local_spin_us=arg["spin_us"])
    comm.all_gather(None)  # opens the channel, send/recv on it

    def trip() -> None:
        if rank == 0:
            comm.send(obj, dst=1)
            comm.recv(src=1)
        else:
            comm.recv(src=0)
            comm.send(obj, dst=0)

    for _ in range(30):
        trip()
    spent.clear()
    start = time.perf_counter()
    for _ in range(trips):
        trip()
    row = {label: f"{seconds / trips * 1e6:.0f}" for label, seconds in sorted(spent.items())}
    row["round trip"] = f"{(time.perf_counter() - start) / trips * 1e6:.0f}"
    data = pickle.dumps(obj, protocol=5)
    for label, fn in [
        ("pickle dumps alone", lambda: pickle.dumps(obj, protocol=5)),
        ("pickle loads alone", lambda: pickle.loads(data)),
    ]:
        start = time.perf_counter()
        for _ in range(trips):
            fn()
        row[label] = f"{(time.perf_counter() - start) / trips * 1e6:.0f}"
    rows: List[Any] = [None, None]
    dist.all_gather_object(rows, row)
    return rows


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=16384, help="bytes the records pickle to (about)")
    parser.add_argument("--trips", type=int, default=300)
    parser.add_argument("--spin-us", type=int, default=100, help="local_spin_us (µs a wait polls before it sleeps)")
    args = parser.parse_args(argv)
    from objcomm._tools.launch import run_local

    rows = run_local(phases, {"size": args.size, "trips": args.trips, "spin_us": args.spin_us}, world_size=2)
    labels = list(rows[0])
    print(f"µs per message, {args.trips} round trips of ~{args.size:,} B, local_spin_us={args.spin_us}")
    print("| phase | rank 0 | rank 1 |\n|---|---:|---:|")
    for label in labels:
        print(f"| {label} | {rows[0].get(label, '')} | {rows[1].get(label, '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
