"""objcomm._transport.groups: the arrival every member of a group makes before a sibling group's rendezvous."""

from __future__ import annotations

import os
import secrets
import threading
import time
from typing import Any, List

import pytest
import torch
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


def connections_to_the_store() -> List[Any]:
    """Which store connections gloo siblings made in this thread, in another thread, and an NCCL sibling's would take
    (``reuse=False``), by identity; then two gloo siblings made and used, one after the other, in the main thread."""
    mine = [groups._own_store(reuse=True) for _ in range(3)]
    theirs: List[Any] = []
    worker = threading.Thread(target=lambda: theirs.extend(groups._own_store(reuse=True) for _ in range(2)))
    worker.start()
    worker.join()
    fresh = groups._own_store(reuse=False)
    made = [groups.sibling(dist.group.WORLD, f"test-reuse-{n}", "gloo") for n in range(2)]
    sums = []
    for group in made:
        value = torch.tensor([dist.get_rank() + 1])
        dist.all_reduce(value, group=group)
        sums.append(int(value))
        groups.forget(group)
    asked, real_own_store = [], groups._own_store

    def own_store(reuse: bool = False) -> Any:
        asked.append(reuse)
        return real_own_store(reuse)

    groups._own_store = own_store  # type: ignore[assignment]
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # a gloo group then connects at its first collective, on gloo's threads
    try:
        lazy = groups.sibling(dist.group.WORLD, "test-reuse-lazy", "gloo")
    finally:
        del os.environ["TORCH_GLOO_LAZY_INIT"]
        groups._own_store = real_own_store  # type: ignore[assignment]
    value = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(value, group=lazy)
    groups.forget(lazy)
    return [
        mine[0] is mine[1] is mine[2],
        theirs[0] is theirs[1] and theirs[0] is not mine[0],
        fresh is not mine[0],
        groups._own_store(reuse=True) is mine[0],
        sums,
        asked,
        int(value),
    ]


def test_a_threads_gloo_siblings_share_one_connection_to_the_store():
    """Each thread clones the default store once for the gloo siblings it makes (a new connection to torch's store
    sometimes takes 5 s): the same clone for every gloo sibling of a thread, another in another thread, a clone of its
    own where the sibling is NCCL's (``reuse=False``); siblings made on the shared clone work. A gloo group made under
    ``TORCH_GLOO_LAZY_INIT``, which asks the store at its first collective, on gloo's threads, takes a clone of its
    own."""
    for got in get_pool(2).run(connections_to_the_store, timeout=60):
        assert got == [True, True, True, True, [3, 3], [False], 3]
