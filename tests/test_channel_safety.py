"""The same-host channel under a fast sender and a lying rank (issue 25): flow control (objcomm._inbox, "Flow
control") slows an honest sender that runs ahead of a slow receiver, never fails it, and keeps the receiver's stash
bounded; the send/recv vote is a value every rank sees alike (objcomm._first); and before a call acts on round 1
beyond "it ended", every rank checks that the others read the same slots (the echo), so a lying rank cannot send
honest ranks down different routes."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Dict, List

import pytest
import torch.distributed as dist
from _ranks import get_pool

import objcomm
from objcomm import _first, _framing, _inbox, _slots, _state

pytestmark = pytest.mark.timeout(240)

SLOT = 4096
COUNT = 20_000  # slot-sized messages: ~100 MB in the stash without flow control, which failed at 64 MiB


def _channel(group: Any) -> Any:
    return _state.group_facts(group).local[False].channel


def _object(i: int) -> bytes:
    return i.to_bytes(4, "little") * 900  # 3,600 bytes: a slot-sized frame, no second round


def runs_ahead(op: str) -> Dict[str, Any]:
    """One rank sends COUNT slot-sized objects as fast as it can (a broadcast's root, a gather's senders, a send);
    the other sleeps 3 s first and between every 1,000 calls, then takes them all, while an ``irecv`` of its waits
    on another tag meanwhile: that thread reads the sender's socket all along, and files what it reads. What each
    got, and the most its stash held (before issue 25 it filled and failed the channel)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    comm = objcomm.Communicator(group, local=True, slot_bytes=SLOT)
    comm.all_gather(0)  # opens the channel; send/recv on it
    slow = rank == 1
    got: List[Any] = []
    if slow:
        pending = comm.irecv(0, tag=77)
        time.sleep(3)
    for i in range(COUNT):
        if slow and i % 1000 == 999:
            time.sleep(0.05)
        if op == "broadcast":
            value = comm.broadcast(_object(i) if rank == 0 else None, src=0)
            ok = value == _object(i)
        elif op == "gather":
            value = comm.gather(_object(i), dst=1)
            ok = value == [_object(i), _object(i)] if slow else value is None
        else:
            if slow:
                ok = comm.recv(0) == _object(i)
            else:
                comm.send(_object(i), 1)
                ok = True
        if not ok:
            got.append(i)
    if slow:
        if pending.wait(60) != "end":
            got.append("end")
    else:
        comm.send("end", 1, tag=77)
    comm.all_gather(0)
    inbox = _channel(group)._inbox
    return {"wrong": got, "peak": inbox.peak, "window": inbox.window, "open": not _channel(group).closed}


@pytest.mark.parametrize("op", ["broadcast", "gather", "send"])
def test_a_sender_that_runs_ahead_is_slowed_down_not_failed(op):
    for result in get_pool(2).run(runs_ahead, op, timeout=200):
        assert result["wrong"] == [] and result["open"], result
        # the stash never held much more than one peer's two windows (without flow control: past 64 MiB, failed)
        assert result["peak"] <= 2 * result["window"] + (1 << 20), result


def splits_the_vote() -> Dict[str, Any]:
    """Rank 1 of 3 lies: it says "not ready" at set-up (send/recv stay on the backend), then marks its first
    all_gather message "ready" (flag 1) to rank 0 only. The honest ranks 0 and 2 must not end up on different
    send/recv routes: a message between them arrives, or both sides raise; never "sent" on one side while the
    other waits for it elsewhere."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1, 2], timeout=timedelta(seconds=8))
    comm = objcomm.Communicator(group, local=True)
    report: Dict[str, Any] = {}
    if rank == 1:
        real_vote = _first.SameHost.begin_vote
        _first.SameHost.begin_vote = lambda self, group: False  # type: ignore[method-assign]
        comm.broadcast(0)  # set-up: "not ready"
        channel = _channel(group)
        real_send = channel._send
        channel._send = lambda peer, header, data, op: real_send(  # flag 1 (READY before issue 25) to rank 0 only
            peer, header[:1] + bytes([1 if peer == 0 else 0]) + header[2:], data, op)
        try:
            comm.all_gather(1)
        except objcomm.ObjcommError as exc:
            report["liar"] = type(exc).__name__
        _first.SameHost.begin_vote = real_vote  # type: ignore[method-assign]
        return report
    comm.broadcast(0)
    try:
        comm.all_gather(rank)
        report["all_gather"] = "ok"
    except objcomm.ObjcommError as exc:
        report["all_gather"] = type(exc).__name__
    try:  # 0 -> 2, then 2 -> 0
        if rank == 0:
            comm.send("zero", 2)
            report["sent"] = True
            report["got"] = comm.recv(2)
        else:
            report["got"] = comm.recv(0)
            comm.send("two", 0)
            report["sent"] = True
    except objcomm.ObjcommError as exc:
        report["raised"] = type(exc).__name__
    return report


def test_a_lying_rank_cannot_split_the_send_recv_routes_of_honest_ones():
    zero, _, two = get_pool(3).run(splits_the_vote, timeout=120)
    for me, other in ((zero, two), (two, zero)):
        if me.get("sent"):  # a message this rank sent arrived, or the other side raised too: nothing lost quietly
            assert "got" in other or "raised" in other, (zero, two)
    assert ("got" in zero) == ("got" in two) or "raised" in zero and "raised" in two, (zero, two)
    assert zero.get("got", "two") == "two" and two.get("got", "zero") == "zero", (zero, two)


def test_credit_windows_fit_the_stash():
    for peers in (1, 2, 3, 7, 15, 31, 63, 255):
        window, stash = _inbox.window_for(peers), _inbox.stash_for(peers)
        assert window >= 4 * _inbox.credit_cost(64 << 10), peers  # a quarter of it holds the largest message
        assert 2 * peers * window + _inbox.RESERVE <= stash, peers
    assert _inbox.stash_for(7) == _inbox.STASH_BYTES  # 8 ranks on a host: the stash as before


def tells_each_rank_another_slot() -> Dict[str, Any]:
    """Rank 2 of 3 lies in round 1 of an all_gather through the channel: rank 0 gets its small complete slot, rank 1
    a slot announcing a 3 MiB frame (a second round on the backend: shared memory off, above the channel's limit);
    it posts the backend broadcast rank 1 would wait for. The honest ranks must not both return, holding different
    objects for rank 2 (before issue 25 they did, and their backends were one collective apart)."""
    import torch

    from serializers import registry

    rank = dist.get_rank()
    group = dist.new_group([0, 1, 2], timeout=timedelta(seconds=5))
    comm = objcomm.Communicator(group, local=True, shm=False)
    comm.all_gather(rank)  # opens the channel
    report: Dict[str, Any] = {}
    if rank == 2:
        out = _framing.encode(b"x" * (3 << 20), registry.guarded("pickle"), max_bytes=1 << 40,
                              inline_tensor_bytes=1 << 16, compression=None)
        slot = bytearray(4096)
        _slots.fill_slot(memoryview(slot), out, 8 << 30)
        channel = _channel(group)
        real_send = channel._send
        channel._send = lambda peer, header, data, op: real_send(peer, header, bytes(slot) if peer == 1 else data, op)
        comm.all_gather("small from 2")
        channel._send = real_send
        work = dist.broadcast(torch.frombuffer(bytearray(out.frame), dtype=torch.uint8), src=2, group=group,
                              async_op=True)
    else:
        try:
            got = comm.all_gather(f"from {rank}")
            report["item 2"] = got[2] if isinstance(got[2], str) else f"{len(got[2]):,} bytes"
        except objcomm.ObjcommError as exc:
            report["raised"] = str(exc)
    total = torch.ones(1)
    dist.all_reduce(total)  # the world group: every rank gets here, the honest ones whatever objcomm said
    report["world"] = total.item()
    if rank == 2:
        try:
            work.wait()
        except RuntimeError:  # nobody joined it: times out (the group's 5 s)
            pass
    return report


def test_a_lying_rank_cannot_send_honest_ranks_down_different_routes():
    zero, one, _ = get_pool(3).run(tells_each_rank_another_slot, timeout=120)
    assert zero["world"] == one["world"] == 3.0
    assert not ("item 2" in zero and "item 2" in one), (zero, one)  # both returned, holding different objects
    assert "raised" in one and "local channel failed on rank 1" in one["raised"], one
