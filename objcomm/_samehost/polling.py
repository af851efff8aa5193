"""The polling wait of the same-host channel: a waiting rank polls its sockets for a moment before it sleeps in
the kernel (:mod:`objcomm._samehost.inbox_waits`)."""

from __future__ import annotations

import os
import time
from typing import Any


def poll_briefly(poll: Any, until: float, yielding: bool = False) -> bool:
    """Poll ``poll`` without sleeping until ``time.perf_counter()`` reaches ``until``; whether something arrived.

    A rank that sleeps in the kernel is woken by the peer's send, which on this machine's virtual CPUs
    costs ~50 µs a hop (a blocking round trip through a socket pair: ~106 µs; polling: ~6 µs). Waits
    shorter than the spin skip it; longer ones sleep after it, so the CPU a waiting rank spends is
    bounded by the spin, once per call. ``yielding`` (the channel's, always): ``sched_yield`` between polls, so
    that a peer that needs this CPU gets it (a rank polling on a CPU its peer needs delays that very peer). Where
    nothing else waits for the CPU the yield returns at once (2 ranks on 2 idle CPUs: a small all_gather 25 µs
    either way); where something does, it keeps the call steady: 2 ranks on 2 CPUs beside one busy process, a
    small all_gather took 46 µs to 1.1 ms from launch to launch polling without yielding (a newcomer's bench rows
    slower than torch's), 89-140 µs yielding (``benchmarks/bench_busy_host.py``, benchmarks/history/; torch's
    ``all_gather_object`` 1.9-4.1 ms there). It yielded only where the group's ranks outnumbered the CPUs before.
    """
    if yielding:
        while not poll.poll(0):
            if time.perf_counter() >= until:
                return False
            os.sched_yield()
        return True
    while not poll.poll(0):
        if time.perf_counter() >= until:
            return False
    return True
