"""Tagged send/recv and recv from any rank, on real gloo groups: streams never mix."""

from __future__ import annotations

import threading
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from _ranks import get_pool

import objcomm

pytestmark = pytest.mark.timeout(120)

BIG = 200_000  # above the slot and the shared-memory threshold used below: a second round


def _item(tag: int, size: int) -> Any:
    return {"tag": tag, "blob": bytes([tag % 251]) * size, "t": torch.full((size // 100,), float(tag))}


def _same(got: Any, tag: int, size: int) -> bool:
    want = _item(tag, size)
    return got["tag"] == tag and got["blob"] == want["blob"] and torch.equal(got["t"], want["t"])


def concurrent_streams(size: int, shm: bool) -> List[bool]:
    """Two threads per rank, one per tag, each moving a stream of messages between the same pair at
    the same time: every message arrives in its own stream, in order. (A blocking send waits for its
    receiver, as gloo's does, so streams need threads, or isend, to overlap.)"""
    comm = objcomm.Communicator(shm=shm, shm_threshold=1024)
    rank = dist.get_rank()
    checks: Dict[int, List[bool]] = {1: [], 2: []}

    def stream(tag: int) -> None:
        for i in range(5):
            if rank == 0:
                comm.send(_item(10 * i + tag, size), 1, tag=tag)
            else:
                checks[tag].append(_same(comm.recv(0, tag=tag), 10 * i + tag, size))

    threads = [threading.Thread(target=stream, args=(tag,)) for tag in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return checks[1] + checks[2]


@pytest.mark.parametrize("shm", [False, True], ids=["group", "shm"])
@pytest.mark.parametrize("size", [10, BIG], ids=["small", "big"])
def test_concurrent_tagged_streams_never_mix(size, shm):
    assert get_pool(2).run(concurrent_streams, size, shm)[1] == [True] * 10


def interleaved_streams(size: int, shm: bool) -> List[bool]:
    """Two tagged streams between the same pair, in both directions at once, each message in order."""
    comm = objcomm.Communicator(shm=shm, shm_threshold=1024)
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    checks = []
    for i in range(4):
        for tag in (3, 4):
            if rank == 0:
                comm.send(_item(10 * i + tag, size), peer, tag=tag)
                checks.append(_same(comm.recv(peer, tag=tag), 100 + 10 * i + tag, size))
            else:
                checks.append(_same(comm.recv(peer, tag=tag), 10 * i + tag, size))
                comm.send(_item(100 + 10 * i + tag, size), peer, tag=tag)
    return checks


@pytest.mark.parametrize("shm", [False, True], ids=["group", "shm"])
@pytest.mark.parametrize("size", [10, BIG], ids=["small", "big"])
def test_big_tagged_streams_interleave(size, shm):
    assert all(all(r) for r in get_pool(2).run(interleaved_streams, size, shm))


def from_any_rank() -> Any:
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        got = sorted(objcomm.recv(tag=5, return_sender=True) for _ in range(world - 1))
        return got
    objcomm.send({"from": rank}, 0, tag=5)
    return None


@pytest.mark.parametrize("world", [2, 4])
def test_recv_from_any_rank_reports_the_sender(world):
    got = get_pool(world).run(from_any_rank)[0]
    assert got == [(r, {"from": r}) for r in range(1, world)]


def bad_tags() -> List[str]:
    messages = []
    for tag in (-1, 1 << 30, 1.5, True):
        try:
            objcomm.send("x", 1 - dist.get_rank(), tag=tag)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_a_bad_tag_is_refused_before_anything_moves():
    for messages in get_pool(2).run(bad_tags):
        assert len(messages) == 4 and all("tag must be an int from 0 to" in m for m in messages)


def eager_then_gather() -> Any:
    """Rank 0's send returns before rank 1 takes it (it fits its slot); then a gather to rank 1 through the group,
    whose rests travel point to point between the same two ranks, then rank 1 takes the send."""
    comm = objcomm.Communicator(local=False, shm=False)
    rank = dist.get_rank()
    if rank == 0:
        comm.send({"early": 1}, dst=1)
    got = comm.gather({"r": rank, "b": bytes([rank]) * 100_000}, dst=1)
    early = comm.recv(src=0) if rank == 1 else None
    ok = got is None if rank != 1 else [g["r"] for g in got] == [0, 1] and got[0]["b"] == bytes(100_000)
    return ok, early


def test_a_send_in_flight_never_meets_a_collectives_own_messages():
    # before objcomm's own point-to-point messages had a tag of their own (INTERNAL_TAG), rank 1's gather took
    # the send's slot for rank 0's rest: "not an objcomm frame", and rank 0 hung
    assert get_pool(2).run(eager_then_gather, timeout=60) == [(True, None), (True, {"early": 1})]
