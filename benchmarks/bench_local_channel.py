"""Small messages between ranks on one host: Unix-domain sockets and shared memory against gloo (issue 14).

    PYTHONPATH=. python benchmarks/bench_local_channel.py                 # W=2 and W=4, local gloo ranks
    PYTHONPATH=. mpiexec -n 2 python benchmarks/bench_local_channel.py    # the same ranks, plus mpi4py

Every candidate is an all_gather of a 4096-byte slot (objcomm's round 1) on the same processes:

- ``LocalChannel``: the prototype (:mod:`objcomm._samehost.channel`): full mesh of SOCK_SEQPACKET sockets,
  abstract names, a header per message, ``poll`` over every peer;
- ``uds mesh``: the same sockets, bare (send to all, blocking recv from each in turn): the floor;
- ``uds star``: through rank 0 (it receives W-1 slots, sends the W slots back in one message);
- ``shm + eventfd``: mailboxes in one memfd mapped by all (two buffers, alternating), an eventfd
  per rank as the doorbell (written by each peer, read blocking), both passed with SCM_RIGHTS;
- ``raw gloo``: ``all_gather_single`` of 4096 bytes, the baseline;
- under mpiexec: ``mpi4py allgather`` (pickle of a 4096-byte bytes) and ``raw MPI Allgather``.

Candidates run round-robin with a gloo barrier before every call; a sample is the slowest rank's
time, a timing the median (``objcomm._tools.bench.measure.interleaved``). Also: the CPU seconds rank 0
spends (``getrusage``, whole process) in one call while rank 1 arrives 100 ms late, and the set-up
time of a ``LocalChannel``. The machine is shared and small: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import socket
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

SLOT = 4096
LATE_S = 0.1
Candidates = Dict[str, Callable[[], Any]]


def _candidates(comm: Any) -> Candidates:
    import torch
    import torch.distributed as dist

    from objcomm._samehost.channel import LocalChannel
    from objcomm._transport.base import Wire, all_gather_single

    rank, world = dist.get_rank(), dist.get_world_size()
    wire = Wire(
        group=dist.group.WORLD,
        ranks=list(range(world)),
        rank=rank,
        device=torch.device("cpu"),
        slot=SLOT,
        chunk=1 << 20,
        max_bytes=1 << 30,
    )
    slot = os.urandom(SLOT)
    channel, bare = LocalChannel.open(wire), LocalChannel.open(wire)  # bare: its sockets, used directly
    assert channel is not None and bare is not None, "the ranks are not on one host"
    peers = bare._peers

    def mesh() -> List[bytes]:
        for sock in peers.values():
            sock.send(slot)
        return [slot if r == rank else peers[r].recv(SLOT) for r in range(world)]

    def star() -> bytes:
        if rank == 0:
            whole = slot + b"".join(peers[r].recv(SLOT) for r in range(1, world))
            for r in range(1, world):
                peers[r].send(whole)
            return whole
        peers[0].send(slot)
        return peers[0].recv(world * SLOT)

    send = torch.frombuffer(bytearray(slot), dtype=torch.uint8)
    recv = torch.empty(world * SLOT, dtype=torch.uint8)
    found: Candidates = {
        "LocalChannel": lambda: channel.all_gather(slot),
        "uds mesh": mesh,
        "uds star": star,
        "shm + eventfd": _Mailboxes(rank, world, peers).all_gather(slot),
        "raw gloo": lambda: all_gather_single(recv, send),
    }
    if comm is not None:
        import numpy as np

        mine, everyone = np.frombuffer(slot, dtype=np.uint8), np.empty(world * SLOT, dtype=np.uint8)
        found["mpi4py allgather"] = lambda: comm.allgather(slot)
        found["raw MPI Allgather"] = lambda: comm.Allgather(mine, everyone)
    return found


class _Mailboxes:
    """W slots x 2 buffers in one memfd; rank r's eventfd counts the peers that filled this round's slots."""

    def __init__(self, rank: int, world: int, peers: Dict[int, socket.socket]) -> None:
        self.rank, self.world, self.step, self.credit = rank, world, 0, 0
        if rank == 0:  # rank 0 makes the memory, collects every doorbell and hands all of them out
            memory = os.memfd_create("objcomm-bench", os.MFD_CLOEXEC)
            os.ftruncate(memory, 2 * world * SLOT)
            bells = [os.eventfd(0, os.EFD_CLOEXEC)]
            bells += [socket.recv_fds(peers[r], 1, 1)[1][0] for r in range(1, world)]
            for r in range(1, world):
                socket.send_fds(peers[r], [b"x"], [memory, *bells])
        else:
            socket.send_fds(peers[0], [b"x"], [os.eventfd(0, os.EFD_CLOEXEC)])
            _, fds, _, _ = socket.recv_fds(peers[0], 1, world + 1)
            memory, bells = fds[0], fds[1:]
        self.map = mmap.mmap(memory, 2 * world * SLOT)
        os.close(memory)  # the mapping keeps it; nothing named anywhere
        self.bells = bells

    def all_gather(self, slot: bytes) -> Callable[[], List[bytes]]:
        def run() -> List[bytes]:
            base = (self.step % 2) * self.world * SLOT
            self.step += 1
            self.map[base + self.rank * SLOT : base + (self.rank + 1) * SLOT] = slot
            for r, bell in enumerate(self.bells):
                if r != self.rank:
                    os.eventfd_write(bell, 1)
            while self.credit < self.world - 1:  # blocks in the kernel; a peer one round ahead leaves credit
                self.credit += os.eventfd_read(self.bells[self.rank])
            self.credit -= self.world - 1
            return [self.map[base + r * SLOT : base + (r + 1) * SLOT] for r in range(self.world)]

        return run


def _cpu_while_waiting(fn: Callable[[], Any]) -> float:
    """Rank 0's CPU seconds (whole process, every thread) in one call that rank 1 joins LATE_S late."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(LATE_S)
    before = resource.getrusage(resource.RUSAGE_SELF)
    fn()
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = torch.tensor([(after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)], dtype=torch.float64)
    dist.broadcast(cpu, src=0)
    return float(cpu.item())


def _setup_s(repeat: int) -> float:
    import torch
    import torch.distributed as dist

    from objcomm._samehost.channel import LocalChannel
    from objcomm._transport.base import Wire

    world = dist.get_world_size()
    wire = Wire(
        group=dist.group.WORLD,
        ranks=list(range(world)),
        rank=dist.get_rank(),
        device=torch.device("cpu"),
        slot=SLOT,
        chunk=1 << 20,
        max_bytes=1 << 30,
    )
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        channel = LocalChannel.open(wire)
        times.append(time.perf_counter() - start)
        assert channel is not None
        channel.close()
    return statistics.median(times)


def measure(comm: Any, repeat: int) -> Dict[str, Any]:
    """On every rank of the default group: medians, CPU while waiting, set-up time (same on every rank)."""
    import torch

    from objcomm._tools.bench.measure import interleaved

    torch.set_num_threads(1)
    candidates = _candidates(comm)
    medians = {k: t.median_s for k, t in interleaved(candidates, repeat=repeat, warmup=20).items()}
    cpu = {k: statistics.median(_cpu_while_waiting(fn) for _ in range(5)) for k, fn in candidates.items()}
    return {"medians": medians, "cpu": cpu, "setup": _setup_s(10)}


def _task(repeat: int, send: Any) -> Dict[str, Any]:
    return measure(None, repeat)


def report(world: int, results: Dict[str, Any], repeat: int) -> str:
    medians, cpu = results["medians"], results["cpu"]
    gloo, mpi = medians["raw gloo"], medians.get("mpi4py allgather")
    head = "| candidate | median | ÷ raw gloo |" + (" ÷ mpi4py allgather |" if mpi else "")
    lines = [
        f"### W={world} ({os.cpu_count()} CPUs, {repeat} rounds)",
        "",
        head + f" CPU of rank 0 waiting {LATE_S * 1e3:.0f} ms |",
        "|---|---:|---:|" + ("---:|" if mpi else "") + "---:|",
    ]
    for name, t in medians.items():
        row = f"| {name} | {t * 1e6:.0f} µs | {t / gloo:.2f}x |" + (f" {t / mpi:.2f}x |" if mpi else "")
        lines.append(row + f" {cpu[name] * 1e3:.1f} ms |")
    lines += ["", f"LocalChannel set-up (once per group, median of 10): {results['setup'] * 1e3:.1f} ms"]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="without mpiexec")
    parser.add_argument("--repeat", type=int, default=500)
    parser.add_argument("--append", help="append the tables to this file (rank 0)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    comm = None
    if any(v in os.environ for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_RANK")):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    texts = []
    if comm is not None:
        import torch.distributed as dist
        from bench_peers import join_gloo  # this script's folder is on sys.path

        join_gloo(comm)
        results = measure(comm, args.repeat)
        if comm.rank == 0:
            texts.append(report(comm.size, results, args.repeat) + "(under mpiexec: MPICH busy-polls)\n")
        dist.barrier()
        dist.destroy_process_group()
    else:
        from objcomm._tools.launch import run_local

        for world in args.world_sizes:
            texts.append(report(world, run_local(_task, args.repeat, world_size=world, timeout_s=1200), args.repeat))
    for text in texts:
        print(text, flush=True)
        if args.append:
            with open(args.append, "a") as f:
                f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
