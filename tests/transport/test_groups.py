"""objcomm._transport.groups: the arrival every member of a group makes before a sibling group's rendezvous."""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any, List

import pytest
import torch.distributed as dist
from _ranks import get_pool

from objcomm._transport import groups

pytestmark = pytest.mark.timeout(120)


def arrivals(name: str, case: str) -> List[Any]:
    """Both ranks arrive under ``name``: ``together``, at once; ``one gives up``, rank 0 stops 0.3 s after it arrived,
    before rank 1 comes (1 s late). (answer, seconds)."""
    rank, stopping = dist.get_rank(), threading.Event()
    if case == "one gives up" and rank == 0:
        threading.Timer(0.3, stopping.set).start()
    if case == "one gives up" and rank == 1:
        time.sleep(1.0)
    start = time.monotonic()
    answer = groups.arrive(dist.group.WORLD, name, stopping, timeout=20)
    dist.barrier()
    return [answer, time.monotonic() - start]


@pytest.mark.parametrize("case", ["together", "one gives up"])
def test_every_member_ends_on_the_same_answer(case):
    """A rank that gives up after it was counted (its group destroyed, or the process ending) makes every member give
    up, the latecomer included: before, the latecomer saw every member counted and went on into a rendezvous the
    other never joined, waiting there until the group's timeout."""
    name = f"test-arrive-{secrets.token_hex(4)}"
    got = get_pool(2).run(arrivals, name, case, timeout=60)
    answers = [a for a, _ in got]
    assert answers == ([True, True] if case == "together" else [False, False]), got
    assert all(seconds < 10 for _, seconds in got), got
