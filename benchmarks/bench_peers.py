"""objcomm against mpi4py (plain and pkl5), torch's object collectives and raw MPI / gloo, in one run.

    pip install -e ".[peers]"                     # mpi4py and MPICH from the package index
    mpiexec -n 2 python benchmarks/bench_peers.py
    mpiexec -n 4 python benchmarks/bench_peers.py --repeat-scale 0.5 --append benchmarks/RESULTS.md

The MPI ranks join a gloo group (rank 0 picks a free port and broadcasts it over MPI), so every
candidate runs on the same processes: objcomm, mpi4py's pickle-based ``allgather``/``bcast``/``send``
and its ``pkl5`` communicator, torch's ``all_gather_object`` and friends, and raw ``Allgather`` /
``all_gather_single`` (and broadcast, a send/recv round trip, a ring's sendrecv) of the same number of bytes.
Candidates of a scenario run round-robin with a gloo barrier before every sample
(``objcomm._tools.bench.measure.interleaved``); a sample is the slowest rank's time per call, a timing the median of
the samples. A large call is one
sample; ``medium`` ones (lists of records of ~16 KB and ~256 KB pickled: past the slot, below the
shared-memory threshold, where the second round goes through the same-host channel) are timed 5 back to
back per sample, small calls 25, as MPI's own latency benchmarks do, because ranks leave a gloo barrier
up to a few hundred microseconds apart on a small machine, which would otherwise be most of every sample.
Rank 0 prints markdown tables of medians and the ratios the targets of the issues are stated in, then,
with ``--append``, appends them to a file. Absolute times are context only: only ratios within one run mean much.

Also measured: peak extra resident memory of one all_gather (``VmHWM`` reset through
``/proc/self/clear_refs`` before each call, so one process measures several; the slowest rank's
figure, in units of W ranks x S bytes per rank), next to the shared memory the results hold on the
whole host (growth of ``Shmem`` in ``/proc/meminfo`` while they are alive: the sealed memory files
behind objcomm's zero-copy results, which resident-set figures do not show until pages are
touched), and where objcomm's time goes in a small, a 64 MB tensor and a 1M-floats all_gather
(encode, round 1 alone, both rounds, decode; each after a barrier).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import pickle
import platform
import re
import socket
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

MB = 1 << 20
SMALL = {"loss": 0.2513, "accuracy": 0.9172, "step": 12_000, "lr": 3e-4, "run": "resnet50-ablation-7"}
MEDIUM = (16 << 10, 256 << 10)  # about the bytes pickled: past the slot, below the shared-memory threshold
MEDIUM_BATCH = 5


def _medium(size: int) -> Any:
    """Per-sample evaluation records of about ``size`` pickled bytes."""
    return [{"id": i, "label": i % 10, "score": i * 0.001, "text": "sample text"} for i in range(size // 27)]


Candidates = Dict[str, Callable[[], Any]]
Ratio = Tuple[str, str]  # (numerator, denominator) candidate names


def _all_gather_single(recv: Any, send: Any) -> Any:
    import torch.distributed as dist

    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(recv, send)


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0],
        epilog='Run under MPI: pip install -e ".[peers]" && mpiexec -n 2 python benchmarks/bench_peers.py',
    )
    parser.add_argument("--repeat-scale", type=float, default=1.0, help="scale every scenario's rounds (min 3)")
    parser.add_argument("--mb", type=int, default=64, help="per-rank payload of the large scenarios, in MiB")
    parser.add_argument(
        "--only",
        choices=["large", "medium", "small", "sendrecv", "memory", "breakdown"],
        nargs="+",
        help="run only these parts (default: all)",
    )
    parser.add_argument("--append", metavar="FILE", help="also append the tables to FILE (rank 0)")
    return parser.parse_args(argv)


# -- joining gloo from MPI ---------------------------------------------------------------------
def join_gloo(comm: Any) -> None:
    """A gloo group over the MPI ranks: rank 0 picks a free port, MPI tells the others."""
    import torch.distributed as dist

    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)


# -- candidates ------------------------------------------------------------------------------
class Peers:
    """Every candidate's callables, built on this rank over MPI ``comm`` and the default gloo group."""

    def __init__(self, comm: Any) -> None:
        import torch.distributed as dist
        from mpi4py.util import pkl5

        import objcomm

        self.comm = comm
        self.comm5 = pkl5.Intracomm(comm)
        self.rank, self.size = comm.rank, comm.size
        self.shm_on = objcomm.Communicator(shm=True)
        self.shm_off = objcomm.Communicator(shm=False)
        self.default = objcomm.Communicator()
        self.backend = objcomm.Communicator(local=False)  # round 1 through gloo, not the same-host channel
        # a group of its own that never runs a collective: what a program that only calls send/recv gets
        self.p2p_only = objcomm.Communicator(dist.new_group(list(range(comm.size))))
        # the same after objcomm.connect() (every rank, once, before its first send/recv)
        self.connected = objcomm.Communicator(dist.new_group(list(range(comm.size))))
        self.connected.connect()

    def all_gather(self, obj: Any, nbytes: int, *, shm: bool) -> Candidates:
        import torch.distributed as dist

        out: List[Any] = [None] * self.size
        candidates = {"objcomm": lambda: self.default.all_gather(obj)}
        if shm:
            candidates["objcomm shm=False"] = lambda: self.shm_off.all_gather(obj)
        else:
            candidates["objcomm local=False"] = lambda: self.backend.all_gather(obj)
        candidates.update(
            {
                "mpi4py": lambda: self.comm.allgather(obj),
                "mpi4py pkl5": lambda: self.comm5.allgather(obj),
                "torch": lambda: dist.all_gather_object(out, obj),
                "raw MPI": self._raw_mpi_all_gather(nbytes),
                "raw gloo": self._raw_gloo_all_gather(nbytes),
            }
        )
        return candidates

    def broadcast(self, obj: Any, nbytes: int) -> Candidates:
        import numpy as np
        import torch
        import torch.distributed as dist

        mine = obj if self.rank == 0 else None
        gloo_buf = torch.zeros(nbytes, dtype=torch.uint8)
        mpi_buf = np.zeros(nbytes, dtype=np.uint8)
        return {
            "objcomm": lambda: self.default.broadcast(mine, src=0),
            "objcomm local=False": lambda: self.backend.broadcast(mine, src=0),
            "mpi4py": lambda: self.comm.bcast(mine, root=0),
            "mpi4py pkl5": lambda: self.comm5.bcast(mine, root=0),
            "torch": lambda: dist.broadcast_object_list([mine], src=0),
            "raw MPI": lambda: self.comm.Bcast(mpi_buf, root=0),
            "raw gloo": lambda: dist.broadcast(gloo_buf, src=0),
        }

    def send_recv(self, obj: Any, nbytes: int) -> Candidates:
        """A round trip: rank 0 sends and then receives, rank 1 receives and sends back; the others idle."""
        import numpy as np
        import torch
        import torch.distributed as dist

        gloo_buf = torch.zeros(nbytes, dtype=torch.uint8)
        mpi_buf = np.zeros(nbytes, dtype=np.uint8)
        box: List[Any] = [None]
        pairs = {
            "objcomm": (
                lambda: self.default.send(obj, dst=1),
                lambda: self.default.recv(src=0),
                lambda: self.default.send(obj, dst=0),
                lambda: self.default.recv(src=1),
            ),
            "objcomm local=False": (
                lambda: self.backend.send(obj, dst=1),
                lambda: self.backend.recv(src=0),
                lambda: self.backend.send(obj, dst=0),
                lambda: self.backend.recv(src=1),
            ),
            "objcomm send/recv only": (
                lambda: self.p2p_only.send(obj, dst=1),
                lambda: self.p2p_only.recv(src=0),
                lambda: self.p2p_only.send(obj, dst=0),
                lambda: self.p2p_only.recv(src=1),
            ),
            "objcomm send/recv only, connect()": (
                lambda: self.connected.send(obj, dst=1),
                lambda: self.connected.recv(src=0),
                lambda: self.connected.send(obj, dst=0),
                lambda: self.connected.recv(src=1),
            ),
            "mpi4py": (
                lambda: self.comm.send(obj, dest=1),
                lambda: self.comm.recv(source=0),
                lambda: self.comm.send(obj, dest=0),
                lambda: self.comm.recv(source=1),
            ),
            "mpi4py pkl5": (
                lambda: self.comm5.send(obj, dest=1),
                lambda: self.comm5.recv(source=0),
                lambda: self.comm5.send(obj, dest=0),
                lambda: self.comm5.recv(source=1),
            ),
            "torch": (
                lambda: dist.send_object_list([obj], dst=1),
                lambda: dist.recv_object_list(box, src=0),
                lambda: dist.send_object_list([obj], dst=0),
                lambda: dist.recv_object_list(box, src=1),
            ),
            "raw MPI": (
                lambda: self.comm.Send(mpi_buf, dest=1),
                lambda: self.comm.Recv(mpi_buf, source=0),
                lambda: self.comm.Send(mpi_buf, dest=0),
                lambda: self.comm.Recv(mpi_buf, source=1),
            ),
            "raw gloo": (
                lambda: dist.send(gloo_buf, dst=1),
                lambda: dist.recv(gloo_buf, src=0),
                lambda: dist.send(gloo_buf, dst=0),
                lambda: dist.recv(gloo_buf, src=1),
            ),
        }
        return {name: _round_trip(self.rank, *calls) for name, calls in pairs.items()}

    def sendrecv(self, obj: Any, nbytes: int) -> Candidates:
        """A ring's shift: every rank sends to the next and receives from the one before, at once."""
        import numpy as np
        import torch
        import torch.distributed as dist

        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        gloo_out, gloo_in = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
        mpi_out, mpi_in = np.zeros(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
        box: List[Any] = [None]

        def torch_in_turn() -> Any:  # torch has no sendrecv: blocking calls in the order that cannot deadlock
            if left < self.rank:
                dist.recv_object_list(box, src=left)
                dist.send_object_list([obj], dst=right)
            else:
                dist.send_object_list([obj], dst=right)
                dist.recv_object_list(box, src=left)
            return box[0]

        def raw_gloo() -> None:
            ops = [dist.P2POp(dist.isend, gloo_out, right), dist.P2POp(dist.irecv, gloo_in, left)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return {
            "objcomm": lambda: self.default.sendrecv(obj, dst=right, src=left),
            "objcomm local=False": lambda: self.backend.sendrecv(obj, dst=right, src=left),
            "mpi4py": lambda: self.comm.sendrecv(obj, dest=right, source=left),
            "mpi4py pkl5": lambda: self.comm5.sendrecv(obj, dest=right, source=left),
            "torch": torch_in_turn,
            "raw MPI": lambda: self.comm.Sendrecv(mpi_out, dest=right, recvbuf=mpi_in, source=left),
            "raw gloo": raw_gloo,
        }

    def _raw_mpi_all_gather(self, nbytes: int) -> Callable[[], Any]:
        import numpy as np

        send = np.zeros(nbytes, dtype=np.uint8)
        recv = np.empty(nbytes * self.size, dtype=np.uint8)
        return lambda: self.comm.Allgather(send, recv)

    def _raw_gloo_all_gather(self, nbytes: int) -> Callable[[], Any]:
        import torch

        send = torch.zeros(nbytes, dtype=torch.uint8)
        recv = torch.empty(nbytes * self.size, dtype=torch.uint8)
        return lambda: _all_gather_single(recv, send)


def _round_trip(
    rank: int,
    send_there: Callable[[], Any],
    recv_there: Callable[[], Any],
    send_back: Callable[[], Any],
    recv_back: Callable[[], Any],
) -> Callable[[], Any]:
    """Rank 0's half of a round trip (send to 1, receive from 1), rank 1's (the other way), or nothing."""
    if rank == 0:
        return lambda: (send_there(), recv_back())
    if rank == 1:
        return lambda: (recv_there(), send_back())
    return lambda: None


def _pickled(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _large_payloads(mb: int) -> List[Tuple[str, Any, int, List[Ratio]]]:
    """(name, object, raw bytes per rank, ratios) of the large all_gather scenarios."""
    import numpy as np
    import torch

    size = mb * MB
    floats = [float(i) * 0.5 for i in range(1_000_000)]
    large_ratios = [("objcomm", "mpi4py pkl5"), ("objcomm", "objcomm shm=False"), ("objcomm", "raw gloo")]
    return [
        (f"{mb} MB numpy array", np.ones(size, dtype=np.uint8), size, large_ratios),
        (
            f"dict with a {mb} MB tensor",
            {"weights": torch.ones(size // 4)},
            size,
            [*large_ratios, ("objcomm", "raw MPI"), ("objcomm", "torch")],
        ),
        (f"{mb} MB bytes", np.ones(size, dtype=np.uint8).tobytes(), size, large_ratios),
        (
            "1M floats",
            floats,
            _pickled(floats),
            [("objcomm", "mpi4py"), ("objcomm", "mpi4py pkl5"), ("objcomm", "torch")],
        ),
    ]


# name, rounds, calls per sample, candidates, ratios, note
Scenario = Tuple[str, int, int, Candidates, List[Ratio], str]
SMALL_BATCH = 25  # small calls per sample, back to back after the barrier (see interleaved's batch)


def _scenarios(peers: Peers, parts: List[str], scale: float, mb: int) -> List[Scenario]:
    import objcomm

    rounds = lambda n: max(3, int(n * scale))  # noqa: E731
    found = []
    if "large" in parts:
        for name, obj, nbytes, ratios in _large_payloads(mb):
            shm = nbytes >= objcomm.settings().shm_threshold
            note = f"{_pickled(obj) / MB:.1f} MB pickled per rank; raw = {nbytes / MB:.1f} MB per rank"
            found.append((f"{name} all_gather", rounds(5), 1, peers.all_gather(obj, nbytes, shm=shm), ratios, note))
    if "medium" in parts:  # past the slot, below shm_threshold: the second round through the same-host channel
        ratios = [
            ("objcomm", "mpi4py"),
            ("objcomm", "mpi4py pkl5"),
            ("objcomm", "torch"),
            ("objcomm", "raw gloo"),
            ("objcomm local=False", "raw gloo"),
        ]
        for size in MEDIUM:
            obj = _medium(size)
            nbytes = _pickled(obj)
            note = f"{nbytes / 1024:.0f} KB pickled; raw = the same bytes; per call, {MEDIUM_BATCH} a sample"
            label = f"{size // 1024} KB records"
            found.append(
                (
                    f"{label} all_gather",
                    rounds(20),
                    MEDIUM_BATCH,
                    peers.all_gather(obj, nbytes, shm=False),
                    ratios,
                    note,
                )
            )
            found.append((f"{label} broadcast", rounds(20), MEDIUM_BATCH, peers.broadcast(obj, nbytes), ratios, note))
            if peers.size > 1:
                found.append(
                    (
                        f"{label} send/recv round trip",
                        rounds(20),
                        MEDIUM_BATCH,
                        peers.send_recv(obj, nbytes),
                        [
                            *ratios,
                            ("objcomm send/recv only", "mpi4py"),
                            ("objcomm send/recv only, connect()", "mpi4py"),
                        ],
                        note,
                    )
                )
    if "small" in parts:
        slot = objcomm.settings().slot_bytes
        small_ratios = [
            ("objcomm", "raw gloo"),
            ("objcomm", "mpi4py"),
            ("objcomm", "torch"),
            ("objcomm local=False", "raw gloo"),
        ]
        note = (
            f"{_pickled(SMALL)} B pickled; raw = one {slot} B slot (objcomm's round 1); per call, "
            f"{SMALL_BATCH} back to back per sample"
        )
        gather = peers.all_gather(SMALL, slot, shm=False)
        found.append(("small dict all_gather", rounds(40), SMALL_BATCH, gather, small_ratios, note))
        found.append(
            ("small dict broadcast", rounds(40), SMALL_BATCH, peers.broadcast(SMALL, slot), small_ratios, note)
        )
        if peers.size > 1:
            found.append(
                (
                    "small dict send/recv round trip",
                    rounds(40),
                    SMALL_BATCH,
                    peers.send_recv(SMALL, slot),
                    [
                        *small_ratios,
                        ("objcomm send/recv only", "mpi4py"),
                        ("objcomm send/recv only, connect()", "mpi4py"),
                    ],
                    note,
                )
            )
    if "sendrecv" in parts and peers.size > 1:  # a ring's shift (W=2: a swap with the other rank)
        ratios = [("objcomm", "mpi4py"), ("objcomm", "mpi4py pkl5"), ("objcomm", "torch"), ("objcomm", "raw gloo")]
        for label, obj, batch in [("small dict", SMALL, SMALL_BATCH)] + [
            (f"{size // 1024} KB records", _medium(size), MEDIUM_BATCH) for size in MEDIUM
        ]:
            nbytes = _pickled(obj)
            note = f"{nbytes:,} B pickled; raw = the same bytes; per call, {batch} a sample; torch: send/recv in turn"
            found.append((f"{label} sendrecv", rounds(20), batch, peers.sendrecv(obj, nbytes), ratios, note))
    return found


# -- peak memory -----------------------------------------------------------------------------
def _hwm_kb() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1))  # type: ignore[union-attr]


def _shmem_kb() -> int:
    with open("/proc/meminfo") as f:
        return int(re.search(r"\nShmem:\s+(\d+)", f.read()).group(1))  # type: ignore[union-attr]


def _peak_extra(fn: Callable[[], Any]) -> Tuple[Optional[int], int]:
    """Bytes the peak resident set grew by during ``fn()`` (None where the peak cannot be reset), and
    bytes the host's shared memory grew by while its result is alive (read after a barrier, so every
    rank's result is alive)."""
    import torch.distributed as dist

    gc.collect()
    shmem = _shmem_kb()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (and ru_maxrss) to the current RSS
    except OSError:
        base = None
    else:
        base = _hwm_kb()
    result = fn()
    peak = _hwm_kb()
    dist.barrier()
    held = _shmem_kb() - shmem
    dist.barrier()
    del result
    return (None if base is None else (peak - base) * 1024), max(held, 0) * 1024


def memory_task(peers: Peers, mb: int) -> Dict[str, Tuple[Optional[float], float]]:
    """Peak extra RSS of one all_gather per candidate (slowest rank) and the host's shared memory its
    results hold (rank 0's reading), in units of W x S."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from objcomm._tools.bench.measure import reduce_max

    size, world = mb * MB, peers.size
    payloads: Dict[str, Callable[[], Any]] = {
        "tensor dict": lambda: {"weights": torch.ones(size // 4)},
        "numpy": lambda: np.ones(size, dtype=np.uint8),
        "bytes": lambda: b"\x01" * size,
    }
    checks: List[Tuple[str, str, Callable[[Any], Callable[[], Any]]]] = [
        ("objcomm", "tensor dict", lambda o: lambda: peers.default.all_gather(o)),
        ("objcomm shm=False", "tensor dict", lambda o: lambda: peers.shm_off.all_gather(o)),
        ("objcomm", "numpy", lambda o: lambda: peers.default.all_gather(o)),
        ("objcomm", "bytes", lambda o: lambda: peers.default.all_gather(o)),
        ("mpi4py pkl5", "numpy", lambda o: lambda: peers.comm5.allgather(o)),
        ("mpi4py pkl5", "tensor dict", lambda o: lambda: peers.comm5.allgather(o)),
        ("raw MPI", "numpy", lambda o: lambda: peers.comm.Allgather(o, np.empty(size * world, dtype=np.uint8))),
        (
            "raw gloo",
            "numpy",
            lambda o: lambda: _all_gather_single(torch.empty(size * world, dtype=torch.uint8), torch.from_numpy(o)),
        ),
    ]
    peers.default.all_gather(1)  # lazy imports, first buffers
    peers.comm5.allgather(1)
    found: Dict[str, Tuple[Optional[float], float]] = {}
    for who, kind, make in checks:
        obj = payloads[kind]()
        dist.barrier()
        extra, held = _peak_extra(make(obj))
        del obj
        slowest = reduce_max(torch.tensor([-1.0 if extra is None else float(extra)], dtype=torch.float64))[0]
        found[f"{who}, {kind}"] = (None if slowest < 0 else slowest / (world * size), held / (world * size))
    return found


# -- where objcomm's time goes ---------------------------------------------------------------
def breakdown_task(obj: Any, repeat: int) -> Dict[str, float]:
    """Median seconds (slowest rank) of each stage of one objcomm all_gather, each after a barrier."""
    import torch
    import torch.distributed as dist

    import objcomm
    from objcomm._format import frame as _frame
    from objcomm._tools.bench.measure import reduce_max
    from objcomm._transport import rounds as _rounds

    comm = objcomm.Communicator()
    call = comm._call({})  # what Communicator.all_gather does, stage by stage
    stages = ["whole call", "encode", "round 1 alone (slot all_gather)", "rounds 1 + 2", "decode (W frames)"]
    rows = []
    for index in range(repeat + 1):
        times = []
        dist.barrier()
        start = time.perf_counter()
        comm.all_gather(obj)
        times.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        out, _ = call.encode(obj)
        times.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        _rounds._exchange_slots(call.wire, out, "all_gather", _rounds.route_of(call.wire).summed)  # type: ignore[arg-type]
        times.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        incoming = _rounds.all_gather(call.wire, out, _frame.tensor_sizes)  # type: ignore[arg-type]
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        [call.decode(item, r) for r, item in enumerate(incoming)]
        times.append(time.perf_counter() - start)
        del incoming, out
        if index:  # the first is a warm-up
            rows.append(times)
    slowest = reduce_max(torch.tensor(rows, dtype=torch.float64))
    return {name: statistics.median(r[i] for r in slowest) for i, name in enumerate(stages)}


# -- report ----------------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def _timing_table(results: List[Tuple[str, Dict[str, float], List[Ratio], str, int]]) -> List[str]:
    lines = ["| scenario | candidate | median | ratio |", "|---|---|---:|---:|"]
    for name, medians, ratios, note, repeat in results:
        for who, seconds in medians.items():
            lines.append(f"| {name} | {who} | {_ms(seconds)} | |")
        for a, b in ratios:
            if a in medians and b in medians:
                lines.append(f"| {name} | **{a} ÷ {b}** | | **{medians[a] / medians[b]:.2f}x** |")
        lines.append(f"| {name} | *{note}; {repeat} rounds* | | |")
    return lines


def _report(
    world: int,
    argv: List[str],
    timings: List[Any],
    memory: Dict[str, Tuple[Optional[float], float]],
    breakdown: Dict[str, Dict[str, float]],
) -> str:
    import mpi4py
    import torch
    from mpi4py import MPI

    library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    lines = [
        f"### W={world}",
        "",
        f"Command: `{' '.join(['mpiexec -n', str(world), 'python benchmarks/bench_peers.py', *argv])}`",
        "",
        f"{datetime.date.today().isoformat()}; {platform.machine()}, {os.cpu_count()} CPU cores; "
        f"Python {platform.python_version()}, torch {torch.__version__}, mpi4py {mpi4py.__version__}, {library}.",
        "",
    ]
    if timings:
        lines += _timing_table(timings) + [""]
    if memory:
        lines += [
            "Memory of one all_gather, in units of W x S: peak extra RSS (slowest rank), and the shared "
            "memory its results hold on the whole host (all ranks together):",
            "",
            "| candidate, payload | peak extra RSS | shared memory held |",
            "|---|---:|---:|",
        ]
        lines += [
            f"| {k} | {'n/a' if rss is None else f'{rss:.2f} x W x S'} | {held:.2f} x W x S |"
            for k, (rss, held) in memory.items()
        ]
        lines.append("")
    for name, stages in breakdown.items():
        lines.append(
            f"Where objcomm's time goes, {name} (median of the slowest rank, each stage after a barrier): "
            + ", ".join(f"{k} {_ms(v)}" for k, v in stages.items())
            + "."
        )
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        from mpi4py import MPI
    except ImportError:
        print('bench_peers needs mpi4py: pip install -e ".[peers]"', file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    from objcomm._tools.bench.measure import interleaved

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    join_gloo(comm)
    parts = args.only or ["memory", "large", "medium", "small", "sendrecv", "breakdown"]
    peers = Peers(comm)

    def say(text: str) -> None:
        if comm.rank == 0:
            print(f"  [{comm.size} ranks] {text}", file=sys.stderr, flush=True)

    memory = memory_task(peers, args.mb) if "memory" in parts else {}
    say("memory done")
    timings = []
    for name, repeat, batch, candidates, ratios, note in _scenarios(peers, parts, args.repeat_scale, args.mb):
        warmup = 1 if repeat * batch < 20 else 5
        timed = interleaved(candidates, repeat=repeat, warmup=warmup, batch=batch)
        medians = {k: t.median_s for k, t in timed.items()}
        timings.append((name, medians, ratios, note, repeat))
        del candidates
        gc.collect()
        say(f"{name} done")
    breakdown = {}
    if "breakdown" in parts:
        breakdown["small dict all_gather"] = breakdown_task(SMALL, max(20, int(200 * args.repeat_scale)))
        big = {"weights": torch.ones(args.mb * MB // 4)}
        name = f"dict with a {args.mb} MB tensor all_gather"
        breakdown[name] = breakdown_task(big, max(3, int(5 * args.repeat_scale)))
        floats = [float(i) * 0.5 for i in range(1_000_000)]
        breakdown["1M floats all_gather"] = breakdown_task(floats, max(3, int(5 * args.repeat_scale)))
        say("breakdown done")
    if comm.rank == 0:
        text = _report(comm.size, list(sys.argv[1:] if argv is None else argv), timings, memory, breakdown)
        print(text, flush=True)
        if args.append:
            with open(args.append, "a") as f:
                f.write("\n" + text + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
