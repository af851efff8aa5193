"""Why a small call costs more between two ranks than in a tight loop: work right after a wait runs cold.

    python benchmarks/bench_cold_calls.py

A rank in a round trip spends most of its time waiting (polling its socket for the peer's answer) and
then runs a few microseconds of Python. This times the same piece of work (serializing a small dict three
times with the ``pickle`` serializer's lifting path, as a send does) in one process:

- in a tight loop (what ``bench_call_cost.py`` reports);
- right after a wait of 20 or 50 µs, spent polling a socket (as the channel's waits do) or only reading
  the clock (no system call);
- with a second process spinning on the other CPU, against it sleeping (is it the neighbour?).

Medians of 2,000 repetitions, 7 rounds. Run it on a quiet machine: another job on the CPUs moves the
numbers far more than what is measured here.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import socket
import statistics
import sys
import time
from typing import Any, Callable, List, Optional

OBJ = {"rank": 0, "step": 1234, "loss": 0.25, "acc": 0.9, "name": "train"}
REPEAT, ROUNDS = 2000, 7


def _work() -> Callable[[], None]:
    from objcomm._format.tensors import TensorLifter
    from serializers import registry

    serializer = registry.guarded("pickle")

    def work() -> None:
        for _ in range(3):
            serializer.dumps(OBJ, lift=TensorLifter())

    return work


def _poller() -> Callable[..., List[tuple]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    poll = select.poll()
    poll.register(a, select.POLLIN)
    _poller.keep = (a, b)  # type: ignore[attr-defined]
    return poll.poll


def after_waits() -> List[str]:
    work, poll, clock = _work(), _poller(), time.perf_counter

    def poll_wait(us: float) -> None:
        until = clock() + us * 1e-6
        while not poll(0) and clock() < until:
            pass

    def clock_wait(us: float) -> None:
        until = clock() + us * 1e-6
        while clock() < until:
            pass

    rows = []
    for label, wait, us in [
        ("tight loop", None, 0),
        ("after polling a socket", poll_wait, 20),
        ("after polling a socket", poll_wait, 50),
        ("after reading the clock", clock_wait, 20),
        ("after reading the clock", clock_wait, 50),
    ]:
        medians = []
        for _ in range(ROUNDS):
            total = 0.0
            for _ in range(REPEAT):
                if wait is not None:
                    wait(us)
                start = clock()
                work()
                total += clock() - start
            medians.append(total / REPEAT * 1e6)
        name = label if wait is None else f"{label} for {us} µs"
        rows.append(f"| {name} | {statistics.median(medians):.2f} µs |")
    return rows


def _spinner(mode: Any) -> None:  # a multiprocessing.Value("i")
    poll = _poller()
    while mode.value != 2:
        if mode.value == 1:
            for _ in range(1000):
                poll(0)
        else:
            time.sleep(0.001)


def with_a_neighbour() -> Optional[List[str]]:
    if len(os.sched_getaffinity(0)) < 2:
        return None
    cpus = sorted(os.sched_getaffinity(0))[:2]
    os.sched_setaffinity(0, {cpus[0]})
    mode = multiprocessing.Value("i", 0)
    peer = multiprocessing.Process(target=_spinner, args=(mode,), daemon=True)
    peer.start()
    try:
        assert peer.pid is not None
        os.sched_setaffinity(peer.pid, {cpus[1]})
        work, clock = _work(), time.perf_counter
        found: dict = {0: [], 1: []}
        for _ in range(ROUNDS):
            for state in (0, 1):
                mode.value = state
                time.sleep(0.02)
                start = clock()
                for _ in range(REPEAT):
                    work()
                found[state].append((clock() - start) / REPEAT * 1e6)
    finally:
        mode.value = 2
        peer.join(5)
        if peer.is_alive():
            peer.kill()
    return [
        f"| tight loop, the other CPU's process {label} | {statistics.median(found[state]):.2f} µs |"
        for state, label in ((0, "sleeping"), (1, "spinning"))
    ]


def main() -> int:
    lines = [
        f"### Serializing a small dict three times, one process ({os.cpu_count()} CPUs)",
        "",
        "| when | median |",
        "|---|---:|",
        *after_waits(),
    ]
    neighbour = with_a_neighbour()
    lines += neighbour if neighbour is not None else ["| (one CPU: no neighbour measured) | |"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
