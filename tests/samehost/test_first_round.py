"""Round 1 through the same-host channel (objcomm._samehost.channel_slots): every routed collective at W=1..4 and in
a sub-group gives what the backend gives; the fallbacks; failures; a killed rank; no growth."""

from __future__ import annotations

import os
import resource
import signal
import time
from typing import Any, Dict, List, Optional

import pytest
import torch.distributed as dist
from _child import report_raised, run_group_losing_a_rank
from _ranks import get_pool

import objcomm
from objcomm import _state
from objcomm._api.resolving import Hooks

pytestmark = pytest.mark.timeout(180)


def _channel(group: Any = None, separate: bool = False) -> Any:
    """This rank's channel for ``group``: a LocalChannel, None (not usable), or "never opened"."""
    state = _state.group_facts(group if group is not None else dist.group.WORLD).local.get(separate)
    return state.channel if state is not None and state.decided else "never opened"


def _payloads(rank: int) -> List[Any]:
    """Small (round 1 only), one overflowing its slot, and tensors: every path after round 1 too."""
    import torch

    return [rank, {"rank": rank, "s": "x" * (rank * 50)}, "big" * (3000 + rank), torch.arange(rank + 3), None]


def every_collective(local: bool, slot_bytes: int, group_ranks: Optional[List[int]] = None) -> Dict[str, Any]:
    rank = dist.get_rank()
    group = dist.new_group(group_ranks) if group_ranks is not None else None
    if group_ranks is not None and rank not in group_ranks:
        return {}
    members = group_ranks if group_ranks is not None else list(range(dist.get_world_size()))
    comm = objcomm.Communicator(group, local=local, slot_bytes=slot_bytes)
    channel = _channel(group)
    seq_before = channel.sequence if channel not in (None, "never opened") else 0
    results: List[Any] = []
    for mine, everyone in zip(_payloads(rank), zip(*[_payloads(r) for r in members])):
        results.append(comm.all_gather(mine))
        for root in sorted({members[0], members[-1]}):
            results.append(comm.gather(mine, dst=root))
            results.append(comm.broadcast(mine if rank == root else None, src=root))
            results.append(comm.scatter(list(everyone) if rank == root else None, src=root))
        results.append(comm.all_to_all([(mine, r) for r in members]))
    results.append(comm.all_reduce(rank, "sum"))
    results.append(comm.reduce(rank, "max", dst=members[-1]))
    channel = _channel(group)
    used = channel not in (None, "never opened")
    return {
        "results": [_plain(r) for r in results],
        "used": used,
        "seq": (channel.sequence - seq_before) if used else 0,
    }


def _plain(value: Any) -> Any:
    """Tensors as lists, so that results compare with ==."""
    if hasattr(value, "tolist"):
        return ("tensor", value.tolist())
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("slot_bytes", [4096, 128])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_collective_the_same_with_the_channel_on_and_off(world, slot_bytes):
    pool = get_pool(world)
    on = pool.run(every_collective, True, slot_bytes)
    off = pool.run(every_collective, False, slot_bytes)
    assert [r["results"] for r in on] == [r["results"] for r in off]
    assert all(r["used"] == (world > 1) for r in on)
    if world > 1:  # every slot exchange went through the channel: 5 payloads x ops, the reductions' last step,
        # and, for each payload that overflows its slot (the long string; in 128 bytes, the dict and the tensor
        # too), the small words ahead of a second round: each scatter's vote (which carries its longest second
        # round: below the threshold, shared memory is not asked), per root, and all_to_all's vote; and the second
        # round itself of all_gather and all_to_all, and of each root's broadcast, gather and scatter, whose payload
        # overflows (one message each: every payload is far below 64 KiB; in 128 bytes, rank 0's dict fits: its
        # broadcast has none, nor, at W=2, a gather whose only sender it is or a scatter that sends only it)
        roots, overflowing = len({0, world - 1}), {4096: 1, 128: 3}[slot_bytes]
        broadcasts = overflowing * roots - (slot_bytes == 128)
        gathers = scatters = overflowing * roots - (slot_bytes == 128 and world == 2)
        second_rounds = 2 * overflowing + broadcasts + gathers + scatters
        # and one echo (issue 25: every rank read round 1 alike) before each second round of all_gather, gather
        # (any slot overflows) and broadcast (the root's does), and after each vote (scatter's, all_to_all's): two
        # channel collectives each, the digests, then every rank's pass
        echoes = 2 * (2 * overflowing * (roots + 1) + broadcasts)
        expected = 5 * (2 + 3 * roots) + 2 + overflowing * (roots + 1) + second_rounds + echoes
        assert [r["seq"] for r in on] == [expected] * world


@pytest.mark.parametrize("world", [3, 4])
def test_a_sub_group_gets_its_own_channel(world):
    pool = get_pool(world)
    members = list(range(1, world))
    on = pool.run(every_collective, True, 4096, members)
    off = pool.run(every_collective, False, 4096, members)
    assert on[0] == off[0] == {}
    assert [r["results"] for r in on[1:]] == [r["results"] for r in off[1:]]
    assert all(r["used"] for r in on[1:])


def switched_off() -> List[Any]:
    group = dist.new_group(list(range(dist.get_world_size())))  # a fresh group: nothing opened on it yet
    seen = []
    previous = objcomm.configure(local=False)
    try:
        assert objcomm.Communicator(group).all_gather(1) == [1] * dist.get_world_size()
        seen.append(_channel(group))
    finally:
        objcomm.restore(previous)
    objcomm.Communicator(group, local=False).broadcast(2)
    seen.append(_channel(group))
    objcomm.Communicator(group, local=True).broadcast(3)
    seen.append(_channel(group) is not None)
    return seen


def test_switched_off_by_configure_and_communicator():
    assert get_pool(2).run(switched_off) == [["never opened", "never opened", True]] * 2


def on_by_default() -> bool:
    group = dist.new_group(list(range(dist.get_world_size())))
    objcomm.Communicator(group).broadcast(1)
    return _channel(group) is not None


def test_on_by_default(monkeypatch):
    monkeypatch.delenv("OBJCOMM_LOCAL", raising=False)
    assert objcomm.Settings().local is True
    assert get_pool(2).run(on_by_default) == [True, True]


def on_separate_hosts() -> Any:
    comm = objcomm.Communicator(local=True, _hooks=Hooks(separate_hosts=True))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert comm.all_gather(rank) == list(range(world))
    assert comm.broadcast("x" * 5000 if rank == 0 else None) == "x" * 5000
    assert comm.all_to_all([rank] * world) == list(range(world))
    return _channel(separate=True)


def test_ranks_on_separate_hosts_keep_the_backend():
    assert get_pool(3).run(on_separate_hosts) == [None] * 3  # decided once, the same on every rank


def encode_fails_on_one_rank() -> List[str]:
    rank = dist.get_rank()
    comm = objcomm.Communicator(local=True)
    seen = []
    for op in ("all_gather", "broadcast", "scatter", "all_to_all"):
        obj: Any = (lambda: None) if rank == 1 else rank  # pickle refuses a lambda
        try:
            if op == "all_gather":
                comm.all_gather(obj)
            elif op == "broadcast":
                comm.broadcast(obj, src=1)
            elif op == "scatter":
                comm.scatter([obj] * dist.get_world_size() if rank == 1 else None, src=1)
            else:
                comm.all_to_all([obj] * dist.get_world_size())
            seen.append("returned")
        except objcomm.RemoteError as exc:
            seen.append("RemoteError" if "rank 1" in str(exc) else str(exc))
        assert comm.all_gather(rank) == list(range(dist.get_world_size()))  # the group is still usable
    assert _channel() is not None and not _channel().closed
    return seen


def test_an_encode_failure_raises_on_every_rank_through_the_channel():
    seen = get_pool(3).run(encode_fails_on_one_rank)
    assert seen == [["RemoteError"] * 4] * 3  # naming rank 1, on rank 1 too


def waits_for_a_late_peer() -> List[float]:
    comm = objcomm.Communicator(local=True)
    comm.all_gather(0)  # the channel is open
    if dist.get_rank() == 1:
        time.sleep(0.3)
    wall, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    comm.all_gather(1)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return [time.perf_counter() - wall, (after.ru_utime + after.ru_stime) - (cpu.ru_utime + cpu.ru_stime)]


def test_a_waiting_rank_does_not_burn_the_cpu():
    wall, cpu = get_pool(2).run(waits_for_a_late_peer)[0]
    assert wall >= 0.25
    assert cpu < 0.1 * wall, f"rank 0 used {cpu * 1e3:.1f} ms of CPU while waiting {wall * 1e3:.0f} ms"


def spins_as_set(spin_us: Optional[int]) -> List[Any]:
    comm = objcomm.Communicator(local_spin_us=spin_us)
    rank = dist.get_rank()
    got = [comm._call({}).wire.slot_medium.spin, comm.all_gather(rank), comm.broadcast("b" if rank == 0 else None)]
    if rank < 2:  # send/recv through the channel (the all_gather above voted them in)
        comm.send(f"from {rank}", 1 - rank)
        got.append(comm.recv(1 - rank))
    return got + [_channel() not in (None, "never opened")]


@pytest.mark.parametrize("spin_us", [0, 20_000, None])
def test_the_spin_setting_reaches_every_wait(spin_us):
    seen = get_pool(3).run(spins_as_set, spin_us)
    spin = None if spin_us is None else spin_us * 1e-6
    assert seen == [
        [spin, [0, 1, 2], "b", "from 1", True],
        [spin, [0, 1, 2], "b", "from 0", True],
        [spin, [0, 1, 2], "b", True],
    ]


def control_words(mismatch: bool) -> Any:
    from objcomm._samehost import channel_slots as _channel_slots

    comm = objcomm.Communicator()
    wire = comm._call({}).wire
    assert isinstance(wire.slot_medium, _channel_slots.ChannelSlots)
    rank = dist.get_rank()
    words = [rank, -rank, 1 << 62] if not (mismatch and rank == 1) else [rank, 0]
    try:
        return wire.slot_medium.gather_words(wire, words, "control")
    except objcomm.CommunicationError as exc:
        assert comm.all_gather(rank) == [0, 1, 2]  # every rank failed at this call: the next collective reopens
        return str(exc)  # (and the pool's next test finds its default group's channel working)


def test_control_words_through_the_channel():
    assert get_pool(3).run(control_words, False) == [[[r, -r, 1 << 62] for r in range(3)]] * 3
    seen = get_pool(3).run(control_words, True)
    assert "rank 1 sent 16 bytes of control words where 24 were due" in seen[0], seen
    assert "rank 0 sent 24 bytes of control words where 16 were due" in seen[1], seen


def message_sizes() -> Dict[str, List[int]]:
    """The payload sizes of the channel messages each collective sends: a small object's slot travels trimmed
    after its frame; a slot with anything after its frame (tensor sizes, a second round) travels whole; the
    second round follows in messages of its own."""
    import torch

    comm = objcomm.Communicator(local=True, slot_bytes=1024, inline_tensor_bytes=0)  # tensors out of band
    comm.all_gather(None)
    channel = _channel()
    sent: List[int] = []
    real = channel._send
    channel._send = lambda peer, header, data, op: (sent.append(len(data)), real(peer, header, data, op))[1]
    sizes: Dict[str, List[int]] = {}
    rank = dist.get_rank()
    try:
        for label, obj in [("small", {"r": 1}), ("tensor", {"t": torch.zeros(3)}), ("past the slot", "x" * 2000)]:
            for op, call in [
                ("all_gather", lambda o: comm.all_gather(o)),
                ("broadcast", lambda o: comm.broadcast(o if rank == 0 else None, src=0)),
                ("scatter", lambda o: comm.scatter([o, o] if rank == 0 else None, src=0)),
                ("all_to_all", lambda o: comm.all_to_all([o, o])),
                ("send/recv", lambda o: comm.send(o, 1) if rank == 0 else comm.recv(0)),
            ]:
                sent.clear()
                result = call(obj)
                if op != "send/recv" or rank == 1:
                    assert _plain(result if op != "all_gather" and op != "all_to_all" else result[0]) == _plain(obj)
                sizes[f"{label} {op}"] = list(sent)
    finally:
        channel._send = real
    return sizes


def test_slots_travel_trimmed_after_a_whole_frame_and_whole_otherwise():
    sender, receiver = get_pool(2).run(message_sizes)
    for label in ("small", "tensor", "past the slot"):
        for op in ("all_gather", "broadcast", "scatter", "all_to_all", "send/recv"):
            sizes = sender[f"{label} {op}"] + receiver[f"{label} {op}"]
            assert sizes, f"{label} {op} sent nothing through the channel"
            if label == "small":
                assert all(n < 100 for n in sizes), (label, op, sizes)  # a 1024-byte slot, trimmed
            elif op == "send/recv":  # the slot, whole, and its rest in one message, after a word of its slot_bytes
                # (objcomm._samehost.channel_checks.whole_message): the tensor's 12 bytes, the 2,064-byte frame
                assert sizes == [4 + 1024 + (12 if label == "tensor" else 2064)], (label, op, sizes)
            else:  # sizes listed after the frame, or a frame past the slot: the whole slot (or control words); and
                # the second round (objcomm._samehost.channel_rests): the 2,000-byte frame past the slot in one
                # message, the tensor's 12 bytes
                assert 1024 in sizes and all(n == 1024 or n < 100 or n == 2064 for n in sizes), (label, op, sizes)
                if label == "past the slot":
                    from_every_sender = [2064] * (2 if op in ("all_gather", "all_to_all") else 1)  # W=2: both ranks,
                    # or the root, or the sender
                    assert [n for n in sizes if n != 1024 and n >= 100] == from_every_sender, (label, op, sizes)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def many_small_calls(count: int) -> Dict[str, int]:
    """``count`` small calls on each rank: all_gather, broadcast and a send/recv round trip, in turn."""
    comm = objcomm.Communicator(local=True)
    rank = dist.get_rank()

    def four(i: int) -> None:
        assert comm.all_gather(i)[0] == i
        assert comm.broadcast(i if rank == 0 else None) == i
        if rank == 0:
            comm.send(i, 1)
            assert comm.recv(1) == -i
        else:
            comm.send(-comm.recv(0), 0)

    for i in range(1000):  # warm: allocator, caches
        four(i)
    fds, rss = _open_fds(), _rss_kib()
    for i in range(count // 4):
        four(i)
    return {
        "fds": _open_fds() - fds,
        "rss_kib": _rss_kib() - rss,
        "used": int(_channel() is not None),
        "p2p": int(_channel().p2p),
    }


@pytest.mark.timeout(400)
def test_a_hundred_thousand_small_calls_leave_nothing_behind():
    for grown in get_pool(2).run(many_small_calls, 100_000):
        assert grown["used"] == grown["p2p"] == 1  # every call through the channel, send/recv too
        assert grown["fds"] == 0, grown
        assert grown["rss_kib"] < 4096, grown  # flat: well under 1 byte per call kept


# -- a SIGKILLed rank mid-call: a group of our own, so that the survivors can report (the pool kills everyone) --
def _killed_rank(rank: int, world: int, store: str, victim: int, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    objcomm.configure(local=True)  # a process of its own: nothing to restore
    assert objcomm.all_gather(rank) == list(range(world))  # opens the channel
    assert _channel() is not None
    if rank == victim:
        time.sleep(0.5)  # the others are waiting in the all_gather below by now
        os.kill(os.getpid(), signal.SIGKILL)
    report_raised(results, rank, lambda: objcomm.all_gather("after"))


def test_a_rank_killed_mid_call_makes_the_others_raise_within_seconds():
    world, victim = 3, 2
    got, victim_exit = run_group_losing_a_rank(_killed_rank, world, victim)
    assert victim_exit == -signal.SIGKILL
    for rank, (message, elapsed) in got.items():
        assert "local channel failed" in message, (rank, message)
        assert "closed its connection" in message or "reset its connection" in message, (rank, message)
        assert elapsed < 5.0, (rank, elapsed)
