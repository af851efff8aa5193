"""Non-blocking calls on real gloo groups: handles, ordering, overlap, failures, misuse, and a soak."""

from __future__ import annotations

import concurrent.futures
import gc
import statistics
import threading
import time
import warnings
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from _ranks import get_pool

import objcomm

pytestmark = pytest.mark.timeout(180)

BIG = 200_000  # above the slot: a second round


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("deliberate")


def _tensor_all_reduce(value: int) -> int:
    """A blocking tensor collective on the default group, run while objcomm's handles are outstanding."""
    t = torch.tensor([value])
    dist.all_reduce(t)
    return int(t.item())


def collectives_out_of_order(size: int) -> List[Any]:
    """Every async collective in flight at once, blocking tensor collectives and a blocking objcomm call in
    between, then waited in reverse issue order; results equal the blocking calls'."""
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator(serializer="msgpack")
    me = {"rank": rank, "pad": "p" * size}
    everyone = [{"rank": r, "pad": "p" * size} for r in range(world)]
    last = world - 1
    requests = [
        comm.all_gather(me, async_op=True),
        comm.gather(me, dst=last, async_op=True),
        comm.broadcast(me if rank == last else None, src=last, async_op=True),
        comm.scatter(everyone if rank == 0 else None, src=0, async_op=True),
        objcomm.all_gather(rank, async_op=True),
        comm.all_to_all([(rank, dst) for dst in range(world)], async_op=True),
        comm.reduce(str(rank) * size, "sum", dst=last, async_op=True),
        objcomm.all_reduce({"n": 1, f"r{rank}": rank}, "merge_sum", async_op=True),
    ]
    sums = [_tensor_all_reduce(rank + i) for i in range(3)]  # the caller keeps using the group meanwhile
    assert comm.all_gather(-rank) == [-r for r in range(world)]  # a blocking call does not wait for them
    results = [request.wait(timeout=120) for request in reversed(requests)][::-1]
    assert all(request.is_completed() for request in requests)
    assert results[:5] == [everyone, everyone if rank == last else None, everyone[last], me, list(range(world))]
    assert results[5] == [(src, rank) for src in range(world)], results[5]
    assert results[6] == ("".join(str(r) * size for r in range(world)) if rank == last else None)
    assert results[7] == {"n": world, **{f"r{r}": r for r in range(world)}}
    assert sums == [sum(range(world)) + i * world for i in range(3)]
    return results


@pytest.mark.parametrize("size", [10, BIG], ids=["small", "big"])
def test_async_collectives_waited_out_of_order_overlap_tensor_collectives(ranks, size):
    assert len(ranks.run(collectives_out_of_order, size)) == ranks.world_size


def in_issue_order() -> bool:
    """Handles of one group complete in issue order: when the last is done, so is every earlier one."""
    world = dist.get_world_size()
    requests = [objcomm.all_gather(i, async_op=True) for i in range(20)]
    assert requests[-1].wait(timeout=120) == [19] * world
    assert all(r.is_completed() for r in requests)
    return [r.wait() for r in requests] == [[i] * world for i in range(20)]


def test_async_collectives_complete_in_issue_order(ranks3):
    assert all(ranks3.run(in_issue_order))


def point_to_point(size: int) -> List[bool]:
    """Each rank posts its irecvs before its isends (one queue for both would deadlock under gloo's
    rendezvous sends), two tags per pair; each stream arrives in order, waited out of order."""
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    receives = {tag: [objcomm.irecv(src=peer, tag=tag) for _ in range(3)] for tag in (1, 2)}
    sends = [
        objcomm.isend({"from": rank, "tag": tag, "i": i, "pad": b"x" * size}, peer, tag=tag)
        for i in range(3)
        for tag in (1, 2)
    ]
    assert _tensor_all_reduce(1) == 2  # tensor collectives on the same group meanwhile
    checks = []
    for tag in (2, 1):
        for i, request in reversed(list(enumerate(receives[tag]))):
            got = request.wait(timeout=120)
            checks.append(got == {"from": peer, "tag": tag, "i": i, "pad": b"x" * size})
    checks += [request.wait(timeout=120) is None for request in sends]
    return checks


@pytest.mark.parametrize("size", [10, BIG], ids=["small", "big"])
def test_isend_irecv_streams_keep_their_order(size):
    for checks in get_pool(2).run(point_to_point, size):
        assert checks == [True] * 12


def failures_travel() -> Dict[str, Any]:
    """wait() raises what the blocking call would, on every rank; the group stays usable."""
    rank, world = dist.get_rank(), dist.get_world_size()
    found: Dict[str, Any] = {}
    request = objcomm.all_gather(Unpicklable() if rank == 1 else rank, async_op=True)
    then = objcomm.all_gather(rank, async_op=True)
    try:
        request.wait(timeout=120)
    except objcomm.RemoteError as exc:
        found["collective"] = exc.ranks
    found["after"] = then.wait(timeout=120) == list(range(world))
    try:
        request.wait()  # a failed handle raises again
    except objcomm.RemoteError:
        found["again"] = True
    future = request.get_future()
    found["future"] = isinstance(future, concurrent.futures.Future) and type(future.exception()).__name__
    found["cancel"] = future.cancel()
    if rank == 0:
        sent = objcomm.isend(Unpicklable(), 1, tag=3)
        try:
            sent.wait(timeout=120)
        except objcomm.EncodeError as exc:
            found["sender"] = "deliberate" in str(exc)
    elif rank == 1:
        try:
            objcomm.irecv(0, tag=3).wait(timeout=120)
        except objcomm.RemoteError as exc:
            found["receiver"] = exc.ranks
    return found


def test_wait_raises_on_every_rank_what_the_blocking_call_would(ranks3):
    results = ranks3.run(failures_travel)
    for found in results:
        assert found["collective"] == [1] and found["after"] and found["again"]
        assert found["future"] == "RemoteError" and found["cancel"] is False
    assert results[0]["sender"] is True and results[1]["receiver"] == [0]


def timeouts_and_misuse() -> List[str]:
    """A wait that times out raises and leaves the handle usable; racing blocking calls are refused at once (a
    blocking call on the same peer and tag waits for the requests before it instead: test_mpis_order_...)."""
    rank = dist.get_rank()
    seen: List[Any] = []
    previous = objcomm.configure(local=False)  # through gloo, whose isend waits for its receiver (the channel's
    try:  # returns once the kernel holds it: nothing would be outstanding)
        _timeouts_and_misuse(rank, seen)
    finally:
        objcomm.restore(previous)
    return seen


def _timeouts_and_misuse(rank: int, seen: List[Any]) -> None:
    if rank == 0:
        pending = objcomm.irecv(src=1, tag=4)
        try:
            pending.wait(timeout=0.05)  # rank 1 sends only after the barrier below
        except objcomm.WaitTimeoutError as exc:
            seen.append("timeout" if isinstance(exc, TimeoutError) and not pending.is_completed() else "?")
        for misuse in (lambda: objcomm.recv(tag=4), lambda: objcomm.irecv(tag=4)):  # from any rank: would race
            try:
                misuse()
            except objcomm.ObjcommError as exc:
                seen.append("refused" if "outstanding" in str(exc) else str(exc))
        sending = objcomm.isend("early" + " " * 200_000, 1, tag=5)  # gloo: past 60 KiB, outstanding until received
        dist.barrier()
        seen.append(pending.wait(timeout=120))
        sending.wait(timeout=120)
        objcomm.send("after", 1, tag=5)  # allowed once the isend is done
        seen.append(objcomm.recv(src=1, tag=4))  # and a blocking recv once the irecv is done
    elif rank == 1:
        dist.barrier()
        objcomm.send("late", 0, tag=4)
        seen += [objcomm.recv(0, tag=5).rstrip(), objcomm.recv(0, tag=5)]
        objcomm.send("blocking", 0, tag=4)


def blocking_calls_after_requests(local: bool) -> List[Any]:
    """mpi4py's isend then send, irecv then recv, on one peer and tag: legal MPI, in MPI's order (the request's
    message first). A port's find: the blocking call raised "their messages would race", in 165 of 200 tries (as
    the request was still in its lane or not), and a rank expecting both messages then waited until the timeout."""
    rank = dist.get_rank()
    previous = objcomm.configure(local=local)
    try:
        got: List[Any] = []
        for size in (10, 200_000):  # gloo: a small isend completes once posted, a large one once received
            for step in range(5):
                if rank == 0:
                    first = objcomm.isend((2 * step, "x" * size), dst=1, tag=3)
                    objcomm.send((2 * step + 1, "y"), dst=1, tag=3)
                    first.wait(timeout=60)
                else:
                    first = objcomm.irecv(src=0, tag=3)
                    second = objcomm.recv(src=0, tag=3)
                    got += [first.wait(timeout=60)[0], second[0]]
        return got
    finally:
        objcomm.restore(previous)


def from_any_rank_in_a_group_of_one() -> str:
    pending = objcomm.irecv(tag=9)  # src=None in a group of one: this rank
    try:
        objcomm.recv(tag=9)
    except objcomm.ObjcommError as exc:
        outcome = type(exc).__name__
    objcomm.send("done", dist.get_rank(), tag=9)
    assert pending.wait(timeout=30) == "done"
    return outcome


def test_a_receive_from_oneself_after_an_irecv_from_oneself_raises_at_once():
    """A reviewer's find: in a group of one, recv(src=None) is a receive from oneself, which nothing could answer while
    it waits: it raises at once, as recv(src=rank) does, not after the group's timeout."""
    assert get_pool(1).run(from_any_rank_in_a_group_of_one, timeout=20) == ["ObjcommError"]


@pytest.mark.parametrize("local", [False, True])
def test_mpis_order_a_blocking_call_after_requests_on_its_peer_and_tag(local):
    assert get_pool(2).run(blocking_calls_after_requests, local) == [[], list(range(10)) * 2]


def isend_waited_before_recv(local: bool) -> List[Any]:
    """Each rank isends a small object, waits for it, then receives the other's (mpi4py's ``isend(...).wait()``
    then ``recv()``): an isend of a small message completes once posted, as a blocking send does and as MPI's does,
    through gloo as through the same-host channel (before, through gloo it waited for a receive that came only
    after it: both ranks until the timeout)."""
    rank = dist.get_rank()
    previous = objcomm.configure(local=local)
    try:
        got = []
        for step in range(3):
            objcomm.isend({"step": step, "from": rank}, dst=1 - rank, tag=6).wait(timeout=20)
            got.append(objcomm.recv(src=1 - rank, tag=6))
        return got
    finally:
        objcomm.restore(previous)


@pytest.mark.parametrize("local", [False, True])
def test_an_isend_of_a_small_message_completes_before_its_receive(local):
    results = get_pool(2).run(isend_waited_before_recv, local)
    assert results == [[{"step": s, "from": 1 - r} for s in range(3)] for r in range(2)]


def exit_waits_for_outstanding_receives() -> Any:
    """What a rank does at exit with an irecv outstanding (``requests._at_exit``, called here, not at a real exit):
    a thread left inside torch.distributed aborts a process whose peer closes the connection while the interpreter
    is torn down, so the exit waits for it first. Rank 0's irecv waits on a higher rank: 2 s, then a warning. Rank
    1's waits on a lower one: until it completes (rank 0 satisfies it once its own wait is over), so that of two
    ranks waiting on each other the lower ends first, and its exit ends the higher's wait."""
    import warnings

    from objcomm._api import requests as _requests

    rank = dist.get_rank()
    pending = objcomm.irecv(src=1 - rank, tag=77)
    dist.barrier()
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if rank == 1:
            waiting = threading.Thread(target=_requests._at_exit)
            waiting.start()
            objcomm.send("for rank 0", dst=0, tag=78)
            waiting.join()
        else:
            _requests._at_exit()
    waited = time.monotonic() - started
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if rank == 0:
        assert objcomm.recv(src=1, tag=78) == "for rank 0"
        objcomm.send("for rank 1", dst=1, tag=77)  # ends rank 1's wait at its exit
    got = pending.wait(timeout=30) if rank == 1 else None
    dist.barrier()
    if rank == 1:
        objcomm.send("late", dst=0, tag=77)  # rank 0's irecv, which its exit gave up on
    else:
        got = pending.wait(timeout=30)
    return got, waited, warned


def a_forked_child_waits_for_none_of_its_parents_requests() -> Any:
    """A child forked while an irecv is outstanding: its exit waits for nothing (the parent's lanes, their threads
    not copied and their locks perhaps held, are forgotten in the child)."""
    import os

    from objcomm._api import requests as _requests

    rank = dist.get_rank()
    pending = objcomm.irecv(src=1 - rank, tag=79)
    dist.barrier()
    child = os.fork()
    if child == 0:
        os._exit(0 if not _requests._outstanding() else 1)
    _, status = os.waitpid(child, 0)
    seen = bool(_requests._outstanding())  # the parent's is still there
    dist.barrier()  # (before either rank sends)
    objcomm.send(rank, dst=1 - rank, tag=79)
    return os.waitstatus_to_exitcode(status), seen, pending.wait(timeout=30)


def test_a_forked_child_waits_for_none_of_its_parents_requests():
    results = get_pool(2).run(a_forked_child_waits_for_none_of_its_parents_requests)
    assert results == [(0, True, 1), (0, True, 0)]


def test_the_exit_waits_for_outstanding_receives_lower_ranks_first():
    results = get_pool(2).run(exit_waits_for_outstanding_receives)
    got0, waited0, warned0 = results[0]
    got1, waited1, warned1 = results[1]
    assert got0 == "late" and got1 == "for rank 1"
    assert 2.0 <= waited0 < 10.0 and len(warned0) == 1 and "irecv(src=1, tag=77)" in warned0[0], results[0]
    assert waited1 < 10.0 and warned1 == [], results[1]  # ended by rank 0's message, not its cap


def test_timeouts_leave_the_handle_usable_and_misuse_is_an_error():
    results = get_pool(2).run(timeouts_and_misuse)
    assert results[0] == ["timeout", "refused", "refused", "late", "blocking"]
    assert results[1] == ["early", "after"]


def test_without_process_group_handles_complete_at_once():
    assert not dist.is_initialized()
    request = objcomm.all_gather({"a": 1}, async_op=True)
    assert isinstance(request, objcomm.Request) and request.is_completed()
    assert request.wait() == [{"a": 1}] and request.get_future().result() == [{"a": 1}]
    assert objcomm.broadcast("x", async_op=True).wait(timeout=1) == "x"
    with pytest.raises(objcomm.ObjcommError, match="init_process_group"):
        objcomm.isend("x", dst=1).wait()
    with pytest.raises(objcomm.EncodeError):
        objcomm.Communicator(serializer="json").all_gather({1}, async_op=True).wait()


def test_a_failed_request_dropped_without_wait_warns():
    """Nobody asked for its outcome, so no wait() raises its failure: a RuntimeWarning says so (the case met: an
    isend not waited for before dist.destroy_process_group(), whose message never left, and nothing said so)."""
    with pytest.warns(RuntimeWarning, match="all_gather failed and its request was dropped without wait"):
        objcomm.Communicator(serializer="json").all_gather({1}, async_op=True)
        gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failure waited for, or whose future was taken, is the caller's
        with pytest.raises(objcomm.EncodeError):
            objcomm.Communicator(serializer="json").all_gather({1}, async_op=True).wait()
        objcomm.Communicator(serializer="json").all_gather({1}, async_op=True).get_future()
        objcomm.all_gather({1}, async_op=True)  # succeeded: nothing to say
        gc.collect()


def on_subgroup() -> Any:
    rank = dist.get_rank()
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    request = objcomm.all_gather(rank, group=group, async_op=True)
    assert objcomm.all_gather(rank, group=group) == [1, 2]  # blocking, on the group itself, meanwhile
    return request.wait(timeout=120)


def test_async_collectives_on_a_subgroup(ranks3):
    assert ranks3.run(on_subgroup) == [None, [1, 2], [1, 2]]


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def _settled_threads(baseline: int) -> int:
    """The thread count once finished lanes' threads have exited (they end right after their last job)."""
    deadline = time.monotonic() + 30
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    return threading.active_count()


def _transient_threads_ended() -> None:
    """Wait (30 s at most) until no lane or eager-send thread of an earlier call is alive: the baseline."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
        t.name.startswith("objcomm-") and t.name != "objcomm-watch-parent" for t in threading.enumerate()
    ):
        time.sleep(0.01)


def soak(calls: int) -> Dict[str, Any]:
    """``calls`` async calls per rank, eight in flight at a time: collectives and isend/irecv pairs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = (rank + 1) % world
    objcomm.all_gather(0, async_op=True).wait(timeout=120)  # the group's shadow exists before measuring
    _transient_threads_ended()  # a lane's thread ends just after its last job; an eager send's reaper lingers
    threads, rss = threading.active_count(), []
    done = 0
    while done < calls:
        batch = []
        for i in range(done, done + 8):
            if i % 4 == 0:
                batch.append(objcomm.isend({"i": i}, peer, tag=1))
            elif i % 4 == 1:
                batch.append(objcomm.irecv((rank - 1) % world, tag=1))
            else:
                batch.append(objcomm.all_gather({"i": i, "pad": "p" * (i % 500)}, async_op=True))
        for request in batch:
            request.wait(timeout=120)
        done += len(batch)
        if done % 400 == 0:
            rss.append(_rss_kib())
    quarter = len(rss) // 4
    return {
        "threads": (threads, _settled_threads(threads)),
        "growth_kib": statistics.median(rss[-quarter:]) - statistics.median(rss[1:quarter]),
    }


@pytest.mark.timeout(300)
def test_soak_of_async_calls_keeps_memory_and_threads_flat():
    for result in get_pool(2).run(soak, 10_000, timeout=280):
        before, after = result["threads"]
        assert after == before, f"{after - before} threads left behind"
        assert result["growth_kib"] < 16 << 10, f"resident memory grew by {result['growth_kib']} KiB"


def blocking_recv_in_a_done_callback() -> Any:
    """A done-callback runs on the lane's thread; its blocking recv next to an outstanding irecv on the same peer
    and tag is refused, as from any thread, and the outstanding irecv gets the next message. Rank 1 sends once rank 0
    holds the callback (else both messages may have come first, and the callback ran on rank 0's own thread with
    nothing outstanding: a CI run's flake)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    comm = objcomm.Communicator(group)
    if rank == 1:
        assert comm.recv(0, tag=2) == "go"
        for message in ("A", "B"):
            comm.send(message, 0, tag=1)
        dist.destroy_process_group(group)
        return None
    first, second = comm.irecv(1, tag=1), comm.irecv(1, tag=1)
    seen: List[Any] = []
    called = threading.Event()

    def callback(_: Any) -> None:
        try:
            seen.append(("callback received", comm.recv(1, tag=1, max_bytes=1 << 20)))
        except objcomm.ObjcommError as exc:
            seen.append(("callback refused", type(exc).__name__))
        called.set()

    first.get_future().add_done_callback(callback)
    comm.send("go", 1, tag=2)
    got = [first.wait(30), second.wait(30)]
    called.wait(30)
    dist.destroy_process_group(group)
    return got, seen


def test_a_done_callbacks_calls_are_checked_like_any_threads():
    got, seen = get_pool(2).run(blocking_recv_in_a_done_callback)[0]
    assert got == ["A", "B"] and seen == [("callback refused", "ObjcommError")]


def test_which_outstanding_request_a_point_to_point_call_races_with():
    """requests._Lanes.conflict, without ranks: a receive from a peer races with an outstanding receive from that
    peer or from any rank under its tag, a receive from any rank with any outstanding receive under its tag; sends
    and other tags never; a key no longer outstanding never. Thousands of outstanding irecvs, one per peer (a master
    posting one to each worker), each asked at posting, no longer scan each other (O(1) a call)."""
    from objcomm._api.requests import _Lanes

    lanes = _Lanes()
    assert lanes.conflict("recv", 3, 0) is None
    lanes.hold(("recv", 3, 0))
    lanes.hold(("recv", 3, 0))
    lanes.hold(("send", 5, 0))
    assert lanes.conflict("recv", 3, 0) == ("recv", 3, 0)
    assert lanes.conflict("recv", None, 0) == ("recv", 3, 0)
    assert lanes.conflict("recv", 4, 0) is None and lanes.conflict("recv", 3, 1) is None
    assert lanes.conflict("send", 3, 0) is None and lanes.conflict("send", None, 0) == ("send", 5, 0)
    lanes.hold(("recv", None, 2))
    assert lanes.conflict("recv", 7, 2) == ("recv", None, 2)
    lanes._done(("recv", 3, 0))
    assert lanes.conflict("recv", 3, 0) == ("recv", 3, 0)  # one of its two is still outstanding
    lanes._done(("recv", 3, 0))
    assert lanes.conflict("recv", 3, 0) is None and lanes.conflict("recv", None, 0) is None
    assert lanes.tagged == {("send", 0): {("send", 5, 0): None}, ("recv", 2): {("recv", None, 2): None}}
    for peer in range(1, 8192):
        assert lanes.conflict("recv", peer, 9) is None
        lanes.hold(("recv", peer, 9))
    assert lanes.conflict("recv", None, 9) == ("recv", 1, 9)
