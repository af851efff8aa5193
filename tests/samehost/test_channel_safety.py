"""The same-host channel under a fast sender and a lying rank (issue 25): flow control (objcomm._samehost.inbox, "Flow
control") slows an honest sender that runs ahead of a slow receiver, never fails it, and keeps the receiver's stash
bounded; the send/recv vote is a value every rank sees alike (objcomm._samehost.channel_slots); and before a call acts
on round 1 beyond "it ended", every rank checks that the others read the same slots (the echo), so a lying rank cannot
send honest ranks down different routes."""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any, Dict, List

import pytest
import torch.distributed as dist
from _ranks import get_pool

import objcomm
from objcomm import _state
from objcomm._format import frame as _frame
from objcomm._format import slot as _slot
from objcomm._samehost import channel_checks as _channel_checks
from objcomm._samehost import channel_slots as _channel_slots
from objcomm._samehost import credit as _credit
from objcomm._samehost import inbox as _inbox

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
        # the stash never held much more than one peer's two windows (without flow control: past 64 MiB, failed);
        # sends: and what the irecv waiting on another tag lent the sender (credit.Lending: at most LEND_BYTES more)
        lent = _credit.LEND_BYTES if op == "send" else 0
        assert result["peak"] <= 2 * result["window"] + lent + (1 << 20), result


def takes_tags_in_another_order(count: int, size: int) -> Dict[str, Any]:
    """Rank 0 isends ``count`` objects of ``size`` bytes to rank 1 under tags 0, 1, 2 in turn; rank 1 receives every
    one of tag 2, then of tag 1, then of tag 0 (a correct MPI program: each isend completes once its receive is
    posted). Until 2026-12-07 the stream stopped once a window of tags 0 and 1 waited in rank 1's stash, holding rank
    0's credit, until the timeout (a helper's find); now rank 1's receive lends that credit (credit.Lending)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=timedelta(seconds=30))
    comm = objcomm.Communicator(group, local=True)
    comm.all_gather(0)  # opens the channel; send/recv on it
    if rank == 0:
        requests = [comm.isend({"i": i, "b": bytes(size)}, dst=1, tag=i % 3) for i in range(count)]
        for request in requests:
            request.wait(60)
        out: Dict[str, Any] = {"sent": count}
    else:
        order = [i for tag in (2, 1, 0) for i in range(count) if i % 3 == tag]
        out = {"wrong": [i for i in order if comm.recv(0, tag=i % 3)["i"] != i]}
        out["lent back"] = _channel(group)._inbox.lending.total == 0  # every message lent for was taken
    comm.all_gather(0)
    out["open"] = not _channel(group).closed
    return out


def test_a_receiver_that_takes_tags_in_another_order_lends_the_sender_credit():
    sender, receiver = get_pool(2).run(takes_tags_in_another_order, 1200, 10_000, timeout=120)
    assert sender == {"sent": 1200, "open": True}
    assert receiver == {"wrong": [], "lent back": True, "open": True}


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
        real_vote = _channel_slots.SameHost.begin_vote
        _channel_slots.SameHost.begin_vote = lambda self, group, settle=0.0: None  # type: ignore[method-assign]
        comm.broadcast(0)  # set-up: "not ready"
        channel = _channel(group)
        real_send = channel._send
        channel._send = (
            lambda peer, header, data, op: real_send(  # flag 1 (READY before issue 25) to rank 0 only
                peer, header[:1] + bytes([1 if peer == 0 else 0]) + header[2:], data, op
            )
        )
        try:
            comm.all_gather(1)
        except objcomm.ObjcommError as exc:
            report["liar"] = type(exc).__name__
        _channel_slots.SameHost.begin_vote = real_vote  # type: ignore[method-assign]
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
        window, stash = _credit.window_for(peers), _credit.stash_for(peers)
        assert window >= 4 * _credit.credit_cost(64 << 10), peers  # a quarter of it holds the largest message
        assert 2 * peers * window + _credit.RESERVE <= stash, peers
    assert _credit.stash_for(7) == _credit.STASH_BYTES  # 8 ranks on a host: the stash as before


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
        out = _frame.encode(
            b"x" * (3 << 20),
            registry.guarded("pickle"),
            max_bytes=1 << 40,
            inline_tensor_bytes=1 << 16,
            compression=None,
        )
        slot = bytearray(4096)
        _slot.fill_slot(memoryview(slot), out, 8 << 30)
        channel = _channel(group)
        real_send = channel._send
        channel._send = lambda peer, header, data, op: real_send(peer, header, bytes(slot) if peer == 1 else data, op)
        comm.all_gather("small from 2")
        channel._send = real_send
        work = dist.broadcast(
            torch.frombuffer(bytearray(out.frame), dtype=torch.uint8), src=2, group=group, async_op=True
        )
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


# -- second attack round (issue 25): a lying echo, a frame the echo did not cover, a credit owed to a rank that never
# reads, and a sender that closes with credits unread ---------------------------------------------------------------
def _three_rank_group(**settings: Any) -> Any:
    group = dist.new_group([0, 1, 2], timeout=timedelta(seconds=5))
    comm = objcomm.Communicator(group, local=True, shm=False, **settings)
    comm.all_gather(dist.get_rank())  # opens the channel
    return group, comm


def _resync(report: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    total = torch.ones(1)
    dist.all_reduce(total)  # the world group: every rank gets here, whatever objcomm said
    report["world"] = total.item()
    return report


def lies_in_the_echo(what: str) -> Dict[str, Any]:
    """Rank 2 of 3 lies to rank 1 only in the echo of an all_gather whose second round the backend moves (4 MiB
    tensors, shared memory off); then every rank makes one more call.

    ``digest``: rank 2 sends rank 1 another digest. Before the pass round rank 1 failed alone and rank 0 went on
    into the backend's all_gather, which nobody joined; rank 1's next call then reopened the channel with a backend
    all_gather that met rank 0's, and gloo aborted the process. Now every rank raises at that call.
    ``pass``: the right digest to everyone, then something else than a pass to rank 1. Rank 1 fails at once; rank 0
    saw every pass and goes on into the backend with rank 2, until the group's timeout; rank 1's next call reopens
    the channel, before on the group (gloo aborted a process, as above), now on the control group: every honest rank
    raises, none dies."""
    import torch

    from objcomm._samehost import inbox as _inbox

    rank = dist.get_rank()
    group, comm = _three_rank_group()
    channel = _channel(group)
    report: Dict[str, Any] = {}
    if rank == 2:
        real_send = channel._send
        lie = {
            "digest": (lambda data: len(data) == 16, bytes(16)),
            "pass": (lambda data: data == _channel_checks.PASSED, b"2"),
        }

        def lying_send(peer: int, header: bytes, data: Any, op: str) -> None:
            told = header[0] == _inbox.ECHO and peer == 1 and lie[what][0](bytes(data))
            real_send(peer, header, lie[what][1] if told else data, op)

        channel._send = lying_send
    for call in ("first", "next"):
        try:
            comm.all_gather(torch.full((4 << 20,), rank, dtype=torch.uint8) if call == "first" else f"{call} {rank}")
            report[call] = "returned"
        except objcomm.ObjcommError as exc:
            report[call] = type(exc).__name__
    if rank == 2:
        channel._send = real_send
    return _resync(report)


def test_a_lying_echo_makes_every_rank_raise_at_that_call():
    reports = get_pool(3).run(lies_in_the_echo, "digest", timeout=120)
    assert [r["world"] for r in reports] == [3.0] * 3  # every process alive, the world group in step
    assert [r["first"] for r in reports] == ["CommunicationError"] * 3, reports


def test_a_lying_pass_leaves_honest_ranks_raising_not_aborted():
    reports = get_pool(3).run(lies_in_the_echo, "pass", timeout=120)
    assert [r["world"] for r in reports] == [3.0] * 3  # every process alive: none aborted by gloo
    assert [r["first"] for r in reports[:2]] == ["CommunicationError"] * 2, reports


def _slot_of(out: Any) -> bytes:
    slot = bytearray(SLOT)
    _slot.fill_slot(memoryview(slot), out, 8 << 30)
    return bytes(slot)


def tells_each_rank_another_table() -> Dict[str, Any]:
    """A lying broadcast root (rank 2 of 3) sends rank 0 its slot and rank 1 the same slot words with another
    inline frame of the same length: a tensor table of other sizes, which decides refusals and the second round's
    route. The echo once covered the slot's words only: rank 1 refused while rank 0 went on into the second round."""
    import torch

    from serializers import registry

    rank = dist.get_rank()
    group, comm = _three_rank_group(slot_bytes=SLOT)
    report: Dict[str, Any] = {}
    size = 1 << 20
    if rank == 2:

        def encode(obj: Any) -> Any:
            return _frame.encode(obj, registry.guarded("pickle"), max_bytes=1 << 40, inline_tensor_bytes=1 << 16)

        real = [torch.full((size // 2,), 7, dtype=torch.uint8), torch.full((size // 2,), 9, dtype=torch.uint8)]
        other = encode([torch.zeros(size // 4, dtype=torch.uint8), torch.zeros(3 * size // 4, dtype=torch.uint8)])
        forged = bytearray(_slot_of(encode(real)))
        forged[24 : 24 + other.frame_nbytes] = bytes(other.frame)  # the same words, another frame inline
        channel = _channel(group)
        real_send = channel._send
        forged_sent = []

        def lying_send(peer: int, header: bytes, data: Any, op: str) -> None:
            lie = header[0] == _inbox.BROADCAST and peer == 1 and not forged_sent  # the broadcast's slot, to rank 1
            forged_sent.extend([True] if lie else [])
            real_send(peer, header, bytes(forged) if lie else data, op)

        channel._send = lying_send
        try:
            comm.broadcast(real, src=2)
            report["broadcast"] = "returned"
        except objcomm.ObjcommError as exc:
            report["broadcast"] = type(exc).__name__
        channel._send = real_send
    else:
        try:
            got = comm.broadcast(None, src=2)
            report["broadcast"] = f"returned {[tuple(t.shape) for t in got]}"
        except objcomm.ObjcommError as exc:
            report["broadcast"] = type(exc).__name__
    return _resync(report)


def test_the_echo_covers_the_frame_a_slot_carries():
    zero, one, _ = get_pool(3).run(tells_each_rank_another_table, timeout=120)
    assert zero["world"] == one["world"] == 3.0
    assert zero["broadcast"] == one["broadcast"] == "CommunicationError", (zero, one)


def owes_credit_to_a_rank_that_never_reads() -> Dict[str, Any]:
    """Rank 2 of 3 never reads its socket: rank 0 fills it, then takes 40 messages of 60 KB from it, so rank 0 owes
    it a CREDIT message it cannot send. Rank 0 then sends 200 such messages to rank 1, which reads them slowly. Before
    the fix, rank 0's wait for rank 1's credit offered the owed CREDIT in a loop that never waited (a CPU core, for as
    long as rank 2 stayed alive); now its sends finish, and before rank 2 closes its channel."""
    rank = dist.get_rank()
    group, comm = _three_rank_group()
    channel = _channel(group)
    blob = b"x" * 60_000
    store = dist.distributed_c10d._get_default_store()
    key = f"credit-owed-{dist.distributed_c10d._world.pg_names[group]}"  # the group's name: alike on its ranks
    report: Dict[str, Any] = {}
    dist.barrier()  # rank 2 is done with the opening all_gather: it reads rank 0's socket no more
    if rank == 0:
        while True:  # fill rank 2's queue: what an eager send leaves in the kernel
            try:
                channel._peers[2].send(b"\0" * 60_000, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
        for _ in range(40):
            comm.recv(2)
        report["owing"] = bool(channel._inbox.owing)  # (the live set: grants() empties it)
        for _ in range(200):
            comm.send(blob, 1)
        report["sent"] = time.monotonic()
        store.set(key, "sent")
    elif rank == 1:
        time.sleep(0.5)
        for i in range(200):
            if i % 20 == 19:
                time.sleep(0.02)
            comm.recv(0)
    else:
        # a rank that never reads rank 0's socket: nor while its own sends wait for room (Inbox.take_in, which files
        # what its peers sent meanwhile, and would read rank 0's filler)
        channel._inbox.unread = lambda: []
        channel._inbox.take_in = lambda op: None
        for _ in range(40):
            comm.send(blob, 0)
        deadline = time.monotonic() + 30  # until rank 0's sends are done, or 30 s (before the fix: they waited)
        while time.monotonic() < deadline and not store.check([key]):
            time.sleep(0.05)
        report["closed"] = time.monotonic()
        channel.close()
    return _resync(report)


def test_credit_owed_to_a_rank_that_never_reads_does_not_stall_a_sender():
    zero, _, two = get_pool(3).run(owes_credit_to_a_rank_that_never_reads, timeout=120)
    assert zero["owing"], zero  # the scenario: a CREDIT rank 2 cannot take
    assert zero["sent"] < two["closed"], (zero, two)  # rank 0's sends did not wait for rank 2 to go


def closes_with_credit_unread() -> Dict[str, Any]:
    """Rank 0 sends 2,000 objects eagerly to rank 1, which takes them slowly and sends CREDIT as it does; rank 0 then
    closes its channel at once, CREDIT unread. Linux then tells rank 1 ECONNRESET ahead of the messages still queued
    for it: before the fix rank 1 lost the last of them."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=timedelta(seconds=10))
    comm = objcomm.Communicator(group, local=True)
    comm.all_gather(rank)
    got = 0
    try:
        if rank == 0:
            for i in range(2000):
                comm.send(_object(i), 1)
            _channel(group).close()
        else:
            for i in range(2000):
                if i % 100 == 99:
                    time.sleep(0.05)
                got += comm.recv(0) == _object(i)
    except objcomm.ObjcommError as exc:
        return {"got": got, "raised": str(exc)}
    return {"got": got}


def test_a_sender_that_closes_right_after_sending_loses_nothing():
    _, one = get_pool(2).run(closes_with_credit_unread, timeout=120)
    assert one == {"got": 2000}, one


def differs_in_shared_memory(op: str, how: str = "shm") -> Dict[str, Any]:
    """Rank 1 of 3 has shared memory on (the others off) for a 4 MiB rest: it would wait for shared memory where
    the others move the rest through the backend (a review's find: gloo aborted a process, or the group's timeout
    passed). The medium its settings pick goes with the echo of round 1 (all_gather, broadcast), its shm_threshold
    with the vote before the rest (scatter, all_to_all): every rank raises at that call, naming the settings; then a
    call with the same settings everywhere returns. A 100 KB rest, which the channel moves whatever each rank's
    shared memory settings, goes through first. ``how="threshold"``: shared memory off everywhere, rank 1's
    shm_threshold 8 MiB, the others' 1 MiB, which bounds the channel's rests too: rank 1 would take the 4 MiB rest
    through the channel where the others send it through the backend (the echo compared the media as if every rank
    with shared memory off had the default threshold: both waited for the group's timeout). ``how="backend"``: as
    ``"shm"`` with ``local=False``, round 1 through the backend, where no echo runs: every rank takes part in shared
    memory's announcement, the ranks whose settings do not take the rest decline there, and all move it through the
    backend, the right data on every rank (gloo aborted the process of a rank with shared memory on, handed another
    rank's exchange of the bytes)."""
    import torch

    rank = dist.get_rank()
    group, alike = _three_rank_group()
    if how in ("shm", "backend"):
        odd = objcomm.Communicator(group, local=how == "shm", shm=rank == 1)
    else:
        odd = objcomm.Communicator(group, local=True, shm=False, shm_threshold=(8 if rank == 1 else 1) << 20)
    report: Dict[str, Any] = {}
    small = bytes([rank]) * 100_000  # a rest the channel (the backend) moves whatever each rank's shm: let through
    report["small"] = odd.all_gather(small) == [bytes([r]) * 100_000 for r in range(3)]
    big = torch.full((4 << 20,), rank, dtype=torch.uint8)
    calls = {
        "all_gather": lambda: odd.all_gather(big),
        "broadcast": lambda: odd.broadcast(big if rank == 0 else None, src=0),
        "gather": lambda: odd.gather(big, dst=1),
        "scatter": lambda: odd.scatter([big] * 3 if rank == 0 else None, src=0),
        "all_to_all": lambda: odd.all_to_all([big] * 3),
    }
    started = time.monotonic()
    try:
        got = calls[op]()
        senders = {"all_gather": range(3), "gather": range(3) if rank == 1 else (), "all_to_all": range(3)}
        expected = [torch.full((4 << 20,), r, dtype=torch.uint8) for r in senders.get(op, [0])]
        values = got if isinstance(got, list) else [] if got is None else [got]
        right = len(values) == len(expected) and all(torch.equal(g, e) for g, e in zip(values, expected))
        report["first"] = "returned" if right else "returned wrong data"
    except objcomm.CommunicationError as exc:
        said = str(exc)  # at once, not at the group's timeout (whose error lists these settings too)
        report["first"] = ("shared memory settings" in said and time.monotonic() - started < 4) or said
    report["next"] = alike.all_gather(rank)
    return _resync(report)


@pytest.mark.parametrize(
    "op, how",
    [
        (op, how)
        for how in ("shm", "threshold", "backend")
        for op in ("all_gather", "broadcast", "gather", "scatter", "all_to_all")
        if op != "gather" or how == "backend"
    ],
)
def test_ranks_whose_shared_memory_settings_differ_raise_at_that_call(op, how):
    reports = get_pool(3).run(differs_in_shared_memory, op, how, timeout=120)
    assert [r["world"] for r in reports] == [3.0] * 3  # every process alive, the world group in step
    assert [r["small"] for r in reports] == [True] * 3, reports
    # (without the channel they agree instead: the rank whose settings do not take the rest declines in shared
    # memory's announcement, and every rank moves it through the backend)
    assert [r["first"] for r in reports] == [True if how != "backend" else "returned"] * 3, reports
    assert [r["next"] for r in reports] == [[0, 1, 2]] * 3, reports


def gather_against_all_gather(express: bool) -> Dict[str, Any]:
    """Rank 0 calls gather, rank 1 all_gather (the express path's, or the general one's): on one host both used to
    return, each its own op's result (a newcomer's find: the same program waits out the timeout across hosts). The
    gather's all_gather of slots goes as messages of its own kind, so both raise; the next call returns."""
    rank = dist.get_rank()
    comm = objcomm.Communicator() if express else objcomm.Communicator(max_bytes=1 << 30)  # (a setting: general)
    comm.all_gather(None)
    report: Dict[str, Any] = {}
    try:
        report["first"] = comm.gather(rank, dst=0) if rank == 0 else comm.all_gather(rank)
    except objcomm.CommunicationError as exc:
        report["first"] = "called gather instead" in str(exc) or "called all_gather instead" in str(exc) or str(exc)
    report["next"] = comm.all_gather(rank)
    return _resync(report)


@pytest.mark.parametrize("express", [True, False], ids=["express all_gather", "general all_gather"])
def test_ranks_in_gather_and_in_all_gather_raise(express):
    reports = get_pool(2).run(gather_against_all_gather, express, timeout=60)
    assert [r["first"] for r in reports] == [True, True], reports
    assert [r["next"] for r in reports] == [[0, 1]] * 2, reports


def names_global_ranks() -> Any:
    """Two groups of global ranks 1 and 2: rank 2 waits for a message that global rank 1 never sends, through the
    backend of one, then through the other's channel (send/recv on it: objcomm.connect). Its errors name group
    ranks, and say which global ranks they are."""
    groups = [dist.new_group([1, 2], timeout=timedelta(seconds=2)) for _ in range(2)]
    if dist.get_rank() in (1, 2):
        objcomm.connect(groups[1])
    dist.barrier()
    said = []
    if dist.get_rank() == 2:
        for group, local in zip(groups, (False, True)):
            try:
                objcomm.Communicator(group, local=local, shm=False).recv(src=1, tag=3)
            except objcomm.CommunicationError as exc:
                said.append(str(exc))
    dist.barrier()
    return said


def test_errors_about_a_subgroup_say_which_global_ranks_its_ranks_are():
    said = get_pool(3).run(names_global_ranks, timeout=120)[2]
    assert len(said) == 2 and all("their global ranks: [1, 2]" in s for s in said), said
    assert "over the local channel" in said[1] and "over the local channel" not in said[0], said
