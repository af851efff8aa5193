"""The same-host channel prototype (objcomm._samehost.channel): every operation at W=1..4, a killed peer, CPU
while waiting, nothing left behind, strangers refused."""

from __future__ import annotations

import os
import resource
import secrets
import select
import signal
import socket
import struct as _struct
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from _child import run_group_losing_a_rank
from _ranks import get_pool

from objcomm import CommunicationError
from objcomm._samehost import channel as _channel
from objcomm._samehost import credit as _credit
from objcomm._samehost import inbox as _inbox
from objcomm._samehost import inbox_waits as _inbox_waits
from objcomm._samehost import mesh as _mesh
from objcomm._transport import call_words
from objcomm._transport.base import Wire


def _wire(group: Any = None) -> Wire:
    group = group if group is not None else dist.group.WORLD
    return Wire(
        group=group,
        ranks=dist.get_process_group_ranks(group),
        rank=dist.get_rank(group),
        device=torch.device("cpu"),
        slot=4096,
        chunk=1 << 20,
        max_bytes=1 << 30,
    )


def _names(pids: List[int], besides: Iterable[str] = ()) -> List[str]:
    """Abstract socket names in /proc/net/unix that belong to ``pids``' channels (``@objcomm-<pid>-``),
    other than ``besides`` (those of channels objcomm itself keeps open for the group)."""
    with open("/proc/net/unix") as table:
        names = [line.split()[-1] for line in table if any(f"@objcomm-{p}-" in line for p in pids)]
    return [n for n in names if n not in set(besides)]


def _all_names() -> List[str]:
    with open("/proc/net/unix") as table:
        return [line.split()[-1] for line in table if "@objcomm-" in line]


def _payload(rank: int, step: int, size: int = 4096) -> bytes:
    return bytes((rank * 31 + step + i) % 251 for i in range(size))


def every_operation(rounds: int) -> Dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    before = _all_names()
    channel = _channel.LocalChannel.open(_wire(), timeout=30)
    assert channel is not None
    with channel:
        for step in range(rounds):
            assert channel.all_gather(_payload(rank, step)) == [_payload(r, step) for r in range(world)]
            for src in range(world):
                mine = _payload(src, step, 100 + step) if rank == src else None
                assert channel.broadcast(mine, src) == _payload(src, step, 100 + step)
            parts = [_payload(rank * world + r, step, step % 7) for r in range(world)]
            assert channel.scatter(parts if rank == step % world else None, step % world) == _payload(
                (step % world) * world + rank, step, step % 7
            )
            assert channel.all_to_all(parts) == [_payload(r * world + rank, step, step % 7) for r in range(world)]
            if world > 1:  # a ring of send/recv under two tags, received in the other order
                right, left = (rank + 1) % world, (rank - 1) % world
                channel.send(b"tag1:%d" % step, right, tag=1, message=step)
                channel.send(b"tag2:%d" % step, right, tag=2, message=1000 + step)
                assert channel.recv(left, tag=2) == (left, b"tag2:%d" % step, 1000 + step)  # its id, too
                assert channel.recv(None, tag=1) == (left, b"tag1:%d" % step, step)
        assert channel.all_gather(b"") == [b""] * world
        pids = [int(p) for p in channel.all_gather(str(os.getpid()).encode())]
    dist.barrier()  # every rank has closed
    return {"pids": pids, "left": _names(pids, before)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_operation(world):
    results = get_pool(world).run(every_operation, 25)
    assert [r["left"] for r in results] == [[]] * world  # no name survives close(), and none is a file


def falls_back(separate: bool) -> Optional[str]:
    channel = _channel.LocalChannel.open(_wire(), separate=separate)
    if channel is None:
        return None
    channel.close()
    return "opened"


@pytest.mark.timeout(60)
def test_ranks_on_other_hosts_fall_back_on_every_rank():
    pool = get_pool(3)
    assert pool.run(falls_back, True) == [None] * 3  # every rank "elsewhere": no channel anywhere
    assert pool.run(falls_back, False) == ["opened"] * 3


def channel_yields() -> bool:
    """Whether this rank's channel polls yielding the CPU (the inbox its waits poll)."""
    channel = _channel.LocalChannel.open(_wire())
    assert channel is not None
    with channel:
        return bool(channel._inbox.yielding)


def waits_for_a_late_peer(late_s: float, spin: Optional[float]) -> Tuple[float, float, List[bool]]:
    """Rank 0's wall and CPU seconds in an all_gather that rank 1 joins ``late_s`` late, and what each
    spin of the wait gave (True: a message came while polling)."""
    channel = _channel.LocalChannel.open(_wire())
    assert channel is not None
    spins: List[bool] = []
    real = _inbox_waits.poll_briefly

    def watched(poll: Any, until: float, yielding: bool = False) -> bool:
        spins.append(real(poll, until, yielding))
        return spins[-1]

    _inbox_waits.poll_briefly = watched  # type: ignore[assignment]
    try:
        with channel:
            channel.all_gather(b"warm", spin=spin)
            spins.clear()
            if dist.get_rank() == 1:
                time.sleep(late_s)
            # this thread's: the rank's other threads (the pool's watchdog, what earlier calls left) are not the wait
            wall, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_THREAD)
            channel.all_gather(b"x" * 4096, spin=spin)
            after = resource.getrusage(resource.RUSAGE_THREAD)
            return time.perf_counter() - wall, (after.ru_utime + after.ru_stime) - (cpu.ru_utime + cpu.ru_stime), spins
    finally:
        _inbox_waits.poll_briefly = real  # type: ignore[assignment]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "spin, world",
    [(None, 2), (0.0, 2), (0.02, 2), (None, 3)],
    ids=["automatic", "no spin", "20 ms spin", "automatic, three ranks"],
)
def test_a_waiting_rank_does_not_burn_the_cpu(spin, world):
    """A wait polls for at most its spin (yielding the CPU between polls), once per call, then sleeps in the kernel
    until the peer comes."""
    wall, cpu, spins = get_pool(world).run(waits_for_a_late_peer, 0.3, spin)[0]
    assert wall >= 0.25
    assert cpu < 0.1 * wall, f"rank 0's waiting thread used {cpu * 1e3:.1f} ms of CPU while waiting {wall * 1e3:.0f} ms"
    expected = _channel.AUTO_SPIN if spin is None else spin
    if world == 2 or not expected:
        assert spins.count(False) == (1 if expected else 0)  # polled in vain once (the spin is the call's), then slept
    else:  # a poll per wait, but the spin is the call's: only the first can spin (rank 2 may come after it, loaded)
        assert 1 <= spins.count(False) <= len(spins) <= world - 1, spins
    if world == 2:
        assert spins == ([False] if expected else [])  # polled once, in vain, then slept; or slept at once


def test_the_channel_s_polling_yields_the_cpu_between_polls(monkeypatch):
    """A busy process beside the ranks made a wait that polled without yielding keep its peer from running (a small
    all_gather of 2 ranks on 2 CPUs: 26 µs or ~1 ms from launch to launch): the channel's waits yield, whatever the
    number of CPUs."""
    assert _channel.AUTO_SPIN > 0
    assert all(get_pool(2).run(channel_yields))
    yielded: List[int] = []
    monkeypatch.setattr(_inbox_waits.os, "sched_yield", lambda: yielded.append(1))
    a, b = socket.socketpair()
    with a, b:
        poll = select.poll()
        poll.register(a.fileno(), select.POLLIN)
        for yielding in (False, True):
            yielded.clear()
            assert _inbox_waits.poll_briefly(poll, time.perf_counter() + 0.002, yielding) is False  # nothing came
            assert bool(yielded) == yielding  # between polls, only where asked to
        b.send(b"x")
        yielded.clear()
        assert _inbox_waits.poll_briefly(poll, time.perf_counter() + 1.0, True) is True and not yielded  # already there


# -- a SIGKILLed peer: a group of our own, so that the survivors can report (the pool kills everyone) --
def _killed_peer_rank(rank: int, world: int, store: str, victim: int, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    channel = _channel.LocalChannel.open(_wire(), timeout=60)
    assert channel is not None
    pids = [int(p) for p in channel.all_gather(str(os.getpid()).encode())]
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)  # the victim is gone by now
    start = time.monotonic()
    try:
        for _ in range(3):
            channel.all_gather(b"after")
        results.put((rank, "no error", 0.0, []))
    except CommunicationError as exc:
        elapsed = time.monotonic() - start
        deadline = time.monotonic() + 5.0  # the other survivor closes when it reads the EOF too: not the same instant
        while _names(pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        results.put((rank, str(exc), elapsed, _names(pids)))


def _sender_ends_after_a_failed_call(
    rank: int, world: int, store: str, victim: int, results: Any, destroy: bool = True
) -> None:
    """Every rank's all_to_all fails (a RemoteError, caught: its traceback holds the group in a cycle until the
    collector runs); the victim sends one message and ends, after ``destroy_process_group`` or without it (an error's
    end); rank 0 receives it, then waits for another."""
    import datetime

    import objcomm

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    objcomm.connect()
    try:
        objcomm.all_to_all([1] * (world + 1))
    except objcomm.RemoteError:
        pass
    if rank == victim:
        objcomm.send("only one", dst=0, tag=5)
        if destroy:
            dist.destroy_process_group()
        return  # the interpreter exits
    got: List[Any] = [objcomm.recv(src=victim, tag=5)]
    try:
        got.append(objcomm.recv(src=victim, tag=5))
    except CommunicationError as exc:
        got.append(str(exc))
    results.put((rank, got))


def _sender_ends_without_destroying(rank: int, world: int, store: str, victim: int, results: Any) -> None:
    _sender_ends_after_a_failed_call(rank, world, store, victim, results, destroy=False)


@pytest.mark.timeout(120)
def test_a_rank_that_destroyed_its_group_is_said_to_have_left_even_while_the_group_lives_on():
    """A porting review's find: after a call that raised, the group stayed alive past destroy_process_group (held by
    the caught exception), its channel closed at exit without its departure notice, and the peer said it died. At exit
    a destroyed group's channel now leaves; one whose process ends without destroying it still reads as died."""
    got, _ = run_group_losing_a_rank(_sender_ends_after_a_failed_call, 2, 1, timeout=90, exits=True)
    first, said = got[0][0]
    assert first == "only one" and "rank 1" in said and "left: its process group was destroyed" in said, said
    got, _ = run_group_losing_a_rank(_sender_ends_without_destroying, 2, 1, timeout=90, exits=True)
    first, said = got[0][0]
    assert first == "only one" and "closed its connection: it died" in said, said


@pytest.mark.timeout(120)
def test_a_killed_peer_makes_the_others_raise_at_once():
    world, victim = 3, 1
    got, victim_exit = run_group_losing_a_rank(_killed_peer_rank, world, victim, timeout=90)
    assert victim_exit == -signal.SIGKILL
    for rank, (message, elapsed, left) in got.items():
        assert "local channel failed" in message, (rank, message)
        assert "closed its connection" in message, (rank, message)
        assert elapsed < 5.0, (rank, elapsed)
        assert left == [], (rank, left)  # the victim's names went with it, the survivors' with close()


# -- strangers at set-up ------------------------------------------------------------------------
def _stranger(address: str, hello: bytes, uid: Optional[int]) -> int:
    """Fork a process that connects to ``address`` (as ``uid``), says ``hello`` and waits for an answer."""
    pid = os.fork()
    if pid:
        return pid
    code = 3
    try:
        if uid is not None:
            os.setresuid(uid, uid, uid)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(address)
        sock.send(hello)
        sock.settimeout(10)
        code = 0 if sock.recv(16) == b"" else 1  # 0: refused (EOF)
    except (BrokenPipeError, ConnectionResetError):
        code = 0  # refused before it could even say hello
    except socket.timeout:
        code = 2  # still connected: accepted
    finally:
        os._exit(code)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("who", ["another pid", "wrong secret", "another uid", "the announced rank"])
def test_set_up_refuses_strangers(who):
    if who == "another uid" and os.getuid() != 0:
        pytest.skip("needs root to become another user")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    nonce, secret = secrets.randbits(63), secrets.randbits(63)
    address = _channel._address(os.getpid(), nonce)
    listener.bind(address)
    listener.listen(4)
    hello = _channel._HELLO.pack(1, secret if who != "wrong secret" else secret ^ 1)
    child = _stranger(address, hello, 65534 if who == "another uid" else None)
    announced = os.getpid() + 1_000_000 if who == "another pid" else child  # the pid the group announced for rank 1
    peers: Dict[int, socket.socket] = {}
    try:
        ok = _channel.LocalChannel._connect(
            0, peers, [os.getpid(), announced], [nonce, 0], [secret, 0], secret, listener, time.monotonic() + 2.0
        )
    finally:
        listener.close()
        for sock in peers.values():
            sock.close()
    _, status = os.waitpid(child, 0)
    if who == "the announced rank":
        assert ok and os.waitstatus_to_exitcode(status) == 0  # accepted, then EOF from our close above
    else:
        assert not ok and not peers
        assert os.waitstatus_to_exitcode(status) == 0, "the stranger's connection was not closed"


def _silent(address: str) -> int:
    """Fork a process that connects to ``address`` first and then says nothing (any user can: the name is
    listed in /proc/net/unix and abstract names have no permissions)."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        os.read(ready_r, 1)  # connected: it is ahead of the real rank in the listener's queue
        os.close(ready_r)
        return pid
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(address)
        os.write(ready_w, b"x")
        sock.settimeout(10)
        sock.recv(16)  # until refused
    finally:
        os._exit(0)


@pytest.mark.timeout(60)
def test_a_silent_stranger_ahead_of_the_rank_does_not_hold_up_set_up():
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    nonce, secret = secrets.randbits(63), secrets.randbits(63)
    address = _channel._address(os.getpid(), nonce)
    listener.bind(address)
    listener.listen(4)
    stranger = _silent(address)
    rank1 = _stranger(address, _channel._HELLO.pack(1, secret), None)  # the real rank 1, after it
    peers: Dict[int, socket.socket] = {}
    started = time.monotonic()
    try:
        ok = _channel.LocalChannel._connect(
            0, peers, [os.getpid(), rank1], [nonce, 0], [secret, 0], secret, listener, time.monotonic() + 20.0
        )
        took = time.monotonic() - started
    finally:
        listener.close()
        for sock in peers.values():
            sock.close()
    os.waitpid(rank1, 0)
    os.waitpid(stranger, 0)
    assert ok and list(peers) == [1]
    assert took < 10  # a bound on a stall, not a speed figure: before, it waited out the 20 s deadline


# -- a hostile (or buggy) member: authenticated, then breaking the protocol ------------------------------
def _header(kind: int, seq: int = 0, tag: int = 0, flags: int = 0) -> bytes:
    return _inbox.HEADER.pack(kind, flags, seq, tag)


_P2P, _GATHER = _inbox.P2P, _inbox.ALL_GATHER
HOSTILE = {  # what rank 1 sends rank 0, and the error rank 0 must raise
    "short": ([b"12345"], "5-byte message, shorter than the 12-byte header"),
    "empty": ([b""], "0-byte message, shorter than the 12-byte header"),
    "too long": ([_header(_P2P) + b"x" * (_mesh.MAX_PAYLOAD + 1)], "above the 65,548 bytes a message may have"),
    "unknown kind": ([_header(9) + b"x"], "unknown kind 9"),
    "flags": ([_header(_P2P, flags=4)], "point-to-point message with a bad header"),
    "answer with flags": ([_header(_inbox.ANSWER, seq=7, flags=1)], "point-to-point message with a bad header"),
    "rest with a negative tag": ([_header(_inbox.REST, seq=7, tag=-2)], "point-to-point message with a bad header"),
    "negative tag": ([_header(_P2P, tag=-1)], "point-to-point message with a bad header"),
    "collective with a negative call word": ([_header(_GATHER, seq=1, tag=-5)], "all_gather message with a bad header"),
    # the tag of a collective's message is its call's word (call_words): another call's fails the taker, naming both
    "collective of another call": (
        [_header(_GATHER, seq=1, tag=5) + b"x"],
        "rank 1 called an unknown call (word 5) where this rank called ",
    ),
    "stale seq": ([_header(_GATHER, seq=0)], "a duplicate or stale message"),
    "duplicate seq": ([_header(_GATHER, seq=1) + b"x", _header(_GATHER, seq=1) + b"x"], "a duplicate or stale message"),
    "skipped seq": ([_header(_GATHER, seq=2) + b"x"], "sent collective #2 but not #1"),
    "flood": ([_header(_P2P, tag=99) + b"f" * 4000] * 200, "the stash of messages for calls not yet made would pass"),
    # empty messages under 100 distinct tags: each key costs Python far more than its 0 bytes (counted since)
    "many tags": ([_header(_P2P, tag=t) for t in range(1, 100)], "the stash of messages for calls not yet made"),
    "empty, then more": ([b"", _header(_P2P, tag=7) + b"x"], "0-byte message, shorter than the 12-byte header"),
}


def hostile_member(case: str) -> Tuple[str, float]:
    """Rank 1 (authenticated at set-up like any rank) sends rank 0 what HOSTILE[case] says, raw; rank 0 waits
    in a recv or an all_gather and reports what it raised, and how long that took."""
    messages, _ = HOSTILE[case]
    channel = _channel.LocalChannel.open(_wire(), timeout=20, stash_bytes=64 << 10)
    assert channel is not None
    with channel:
        if dist.get_rank() == 1:
            for message in messages:
                try:
                    channel._peers[0].sendmsg([message])
                except OSError:  # rank 0 closed the channel: the flood is over
                    break
            try:
                channel.recv(0)
            except CommunicationError as exc:  # rank 0 closed: EOF here
                return "closed its connection" in str(exc), 0.0
            return "no error", 0.0
        start = time.monotonic()
        call_words.leave()  # (its collectives through the channel itself: of no call, as rank 1's raw messages say)
        try:
            for _ in range(2):  # a duplicate shows in the second call
                if "seq" in case or "collective" in case:
                    channel.all_gather(b"x")
                else:
                    channel.recv(1)
        except CommunicationError as exc:
            return str(exc), time.monotonic() - start
        return "no error", time.monotonic() - start


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", HOSTILE)
def test_a_member_that_breaks_the_protocol_gets_a_clear_error_not_a_hang(case):
    (message, elapsed), (closed, _) = get_pool(2).run(hostile_member, case)
    assert HOSTILE[case][1] in message and "local channel failed on rank 0" in message, message
    assert "a protocol error" in message or case in (
        "flood",
        "many tags",
        "skipped seq",
        "collective of another call",
    ), message
    assert elapsed < 10.0, elapsed  # never the 20 s timeout: refused on arrival
    assert closed is True  # the channel closed: the hostile rank reads EOF


def floods_the_stash() -> Any:
    """The stash holds what no call asked for yet, up to its limit: one message under it is kept (and taken
    later, in order), beyond it the channel fails."""
    channel = _channel.LocalChannel.open(
        _wire(), timeout=20, stash_bytes=4 * (1000 + _credit.ENTRY_OVERHEAD) + 2 * _credit.KEY_OVERHEAD
    )
    assert channel is not None
    with channel:
        if dist.get_rank() == 1:
            for i in range(3):
                channel.send(bytes([i]) * 1000, 0, tag=5)
            channel.send(b"now", 0, tag=6)
            channel.all_gather(b"")
            return None
        got = [channel.recv(1, tag=6)[:2], *(channel.recv(1, tag=5)[:2] for _ in range(3))]
        channel.all_gather(b"")
        return got


@pytest.mark.timeout(60)
def test_the_stash_keeps_what_fits_in_order():
    assert get_pool(2).run(floods_the_stash)[0] == [(1, b"now")] + [(1, bytes([i]) * 1000) for i in range(3)]


def recv_times_out() -> List[str]:
    """A recv that waits past the timeout raises, and the channel stays open (nothing else was waiting);
    a collective that does closes it, so that the others raise at once."""
    channel = _channel.LocalChannel.open(_wire(), timeout=0.5)
    assert channel is not None
    seen = []
    with channel:
        if dist.get_rank() == 0:
            try:
                channel.recv(1, tag=3)
            except CommunicationError as exc:
                seen.append("stays open" if "within the timeout" in str(exc) and not channel.closed else str(exc))
        dist.barrier()
        seen.append(channel.all_gather(b"still") == [b"still"] * 2)
        if dist.get_rank() == 1:
            time.sleep(1.5)
        try:
            channel.all_gather(b"late")
        except CommunicationError as exc:
            seen.append("closed" if channel.closed else str(exc))
    return seen


@pytest.mark.timeout(60)
def test_a_recv_past_the_timeout_raises_and_leaves_the_channel_open():
    assert get_pool(2).run(recv_times_out) == [["stays open", True, "closed"], [True, "closed"]]


def one_late_peer_one_missing(timeout: float) -> Tuple[int, float, str]:
    """At W=3 rank 1 comes to an all_gather at 3/4 of the timeout, rank 2 long after it: rank 0's wait, begun
    on both, must end at its deadline, not a whole timeout after rank 1's message (a blocking recv is bounded
    by ``SO_RCVTIMEO``, the whole timeout)."""
    channel = _channel.LocalChannel.open(_wire(), timeout=timeout)
    assert channel is not None
    rank = dist.get_rank()
    with channel:
        start = time.monotonic()
        if rank > 0:
            time.sleep(timeout * 0.75 if rank == 1 else timeout * 1.5)
        try:
            channel.all_gather(b"x")
            return rank, time.monotonic() - start, "no error"
        except CommunicationError as exc:
            return rank, time.monotonic() - start, str(exc)


@pytest.mark.timeout(60)
def test_a_wait_ends_at_its_deadline_when_one_peer_came_late():
    timeout = 4.0
    rank, took, error = get_pool(3).run(one_late_peer_one_missing, timeout)[0]
    assert "no message from rank(s) [2] within the timeout of 4s" in error, error
    assert "settings that every rank of a group must share" in error and "shm_threshold" in error, error
    assert timeout - 0.1 < took < timeout + 2 * _inbox.RECV_SLACK + 1.0, took  # before: 7 s (3 + a whole 4)


def skips_a_collective_at_three() -> Any:
    """At W=3 (the path that reads several peers at once): rank 1 sends collective #2 where #1 was due; rank 0
    raises at once instead of waiting out the timeout."""
    channel = _channel.LocalChannel.open(_wire(), timeout=20)
    assert channel is not None
    with channel:
        rank = dist.get_rank()
        if rank == 1:
            channel._peers[0].sendmsg([_header(_GATHER, seq=2) + b"x"])
        start = time.monotonic()
        try:
            channel.all_gather(b"x") if rank != 1 else channel.recv(0)
        except CommunicationError as exc:
            return str(exc) if rank == 0 else "raised", time.monotonic() - start
        return "no error", time.monotonic() - start


@pytest.mark.timeout(120)
def test_a_skipped_collective_is_refused_when_reading_several_peers():
    (message, elapsed), *others = get_pool(3).run(skips_a_collective_at_three)
    assert "rank 1 sent collective #2 but not #1" in message and elapsed < 10.0, (message, elapsed)
    assert [o[0] for o in others] == ["raised", "raised"]


@pytest.mark.parametrize("key, kind", [((False, 0), _inbox.P2P), ((True, 1), _inbox.ALL_GATHER)])
def test_a_wait_on_one_silent_source_raises_after_one_timeout_not_two(key, kind):
    """The lean path's blocking recv uses the call's timeout; the general path after it must not start another."""
    timeout = 0.5
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _struct.pack("ll", 0, int(timeout * 1e6)))

    def fail(op: str, why: str, cause: Any = None) -> Any:
        raise CommunicationError(f"{op}: {why}")

    inbox = _inbox_waits.Inbox({1: mine}, [os.getpid(), os.getpid()], timeout, 4096, fail)
    start = time.monotonic()
    try:
        with pytest.raises(CommunicationError, match="within the timeout"):
            inbox.take([1], key, kind, "op")
        assert time.monotonic() - start < 1.5 * timeout
    finally:
        mine.close()
        theirs.close()


def sends_both_ways_then_receives(count: int) -> Any:
    """Ranks 0 and 1 of a group of their own, its channel open with send/recv on it: each sends the other ``count``
    small messages, then receives as many; then an all_gather. What this rank received, and the all_gather."""
    import objcomm

    group = dist.new_group([0, 1])
    if dist.get_rank() > 1:
        return None
    objcomm.connect(group)
    comm = objcomm.Communicator(group)
    other = 1 - dist.get_rank()
    for i in range(count):
        comm.send(i, dst=other, tag=5)
    got = [comm.recv(src=other, tag=5) for _ in range(count)]
    return got, comm.all_gather(dist.get_rank())


def test_two_ranks_that_send_each_other_a_burst_before_receiving_go_on():
    """Each rank's queue fills with the other's messages while neither receives: a send that finds its peer's queue
    full takes in what its peers sent meanwhile (Inbox.take_in), as MPI's eager sends go on. 3,000 messages each way
    (a few hundred filled the socket's queue: both waited for each other until the timeout, a newcomer's find)."""
    results = get_pool(3).run(sends_both_ways_then_receives, 3000, timeout=120)
    for rank in (0, 1):
        got, gathered = results[rank]
        assert got == list(range(3000)) and gathered == [0, 1], (rank, got[:5], gathered)


def leaves_while_others_send() -> Any:
    """Three ranks of a group of their own, send/recv on its channel: rank 0 sends rank 2 one message, then destroys
    the group; rank 1 sends rank 2 one a moment later, then destroys it. Rank 2 receives from any rank twice, then once
    more (nobody is left to send), then from rank 0 (it left): what it got, or the errors."""
    import gc

    import objcomm

    group = dist.new_group([0, 1, 2])
    objcomm.connect(group)
    comm = objcomm.Communicator(group)
    rank, got = dist.get_rank(), []
    if rank < 2:
        time.sleep(0.5 * rank)
        comm.send(f"from {rank}", dst=2, tag=9)
    else:
        got = [comm.recv(src=None, tag=9) for _ in range(2)]
        for src in (None, 0):
            start = time.monotonic()
            try:
                got.append(comm.recv(src=src, tag=9))
            except objcomm.CommunicationError as exc:
                got.append((str(exc), time.monotonic() - start < 30))
    dist.destroy_process_group(group)
    del comm, group
    gc.collect()  # the group's objects go: its channel closes, telling the peers this rank left
    return got


def test_a_rank_that_destroys_its_group_leaves_the_others_receiving():
    """A rank done with a group destroys it while others still exchange messages (a task farm's fast worker): its
    channel tells its peers it left, so a receive from any rank goes on with the ranks still there, and raises at once
    (no timeout, the channel open) once nobody is left or from a rank that left. It used to fail the channel: the
    receive from any rank raised that rank 0 died, and rank 1's send found the channel closed."""
    got = get_pool(3).run(leaves_while_others_send, timeout=120)[2]
    assert sorted(got[:2]) == ["from 0", "from 1"], got
    (anyone, quick), (from_zero, quick_too) = got[2:]
    assert quick and "every other rank had left before" in anyone and "nothing under tag 9" in anyone, anyone
    assert quick_too and "rank 0" in from_zero and "left: its process group was destroyed" in from_zero, from_zero
