"""The same-host shared-memory path: every op on both paths, thresholds, fallbacks and segment lifetime."""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from _child import run_group_losing_a_rank
from _ranks import RankDied, RankPool, get_pool

import objcomm
from objcomm import _state
from objcomm._api.call import rest_media_for as _rest_media
from objcomm._format import slot as _slot
from objcomm._samehost import segments as _segments
from objcomm._samehost import shm as _shm
from objcomm._samehost import two_level as _two_level
from objcomm._samehost.rests import SameHostRests
from objcomm._samehost.two_level_rests import TwoLevelRests
from objcomm._samehost.voted_rests import VotedRests
from objcomm._transport import broadcast as _broadcast
from objcomm._transport import gather as _gather
from objcomm._transport import p2p as _p2p
from objcomm._transport import parts as _parts
from objcomm._transport import rounds as _rounds
from objcomm._transport.base import BACKEND, DIRECT
from objcomm._transport.rounds import Outgoing

SLOT = 128
CAPACITY = SLOT - _slot.PREFIX.size
THRESHOLD = 4096


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _logged(fn: Any, *args: Any) -> tuple[Any, List[str]]:
    """Run ``fn`` with the objcomm logger at DEBUG, returning its result and the lines it logged."""
    logger = logging.getLogger("objcomm")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        return fn(*args), handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _wire(
    directory: str,
    separate: bool,
    group: Any = None,
    threshold: int = THRESHOLD,
    strategy: type = _shm.SharedMemory,
    zero_copy: bool = False,
    local: bool = False,
) -> _rounds.Wire:
    """A wire whose second round may take shared memory: files in ``directory`` unless ``zero_copy``; round 1
    and the control words through the same-host channel when ``local``."""
    group = group if group is not None else dist.group.WORLD
    return _rounds.Wire(
        group=group,
        ranks=dist.get_process_group_ranks(group),
        rank=dist.get_rank(group),
        device=torch.device("cpu"),
        slot=SLOT,
        chunk=1 << 20,
        max_bytes=1 << 30,
        rest_media=strategy(threshold=threshold, directory=directory, separate=separate, zero_copy=zero_copy),
        slot_medium=_two_level.strategy(separate, None) if local else BACKEND,
    )


def _bytes(seed: int, length: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(length))


def _payload(seed: int, frame: int, tensors: List[int]) -> Outgoing:
    def tensor(i: int, n: int) -> torch.Tensor:
        data = bytearray(_bytes(seed + 1 + i, n))
        return torch.frombuffer(data, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)

    return Outgoing(memoryview(bytearray(_bytes(seed, frame))), [tensor(i, n) for i, n in enumerate(tensors)])


def _check(item: Any, seed: int, frame: int, tensors: List[int]) -> None:
    assert bytes(item.frame) == _bytes(seed, frame)
    assert [bytes(t.numpy()) for t in item.tensors] == [_bytes(seed + 1 + i, n) for i, n in enumerate(tensors)]


# Shapes of (frame bytes, tensor bytes): second-round bytes one below, at and one above the threshold,
# carried by an overflowing frame, by tensors behind an inline frame, or by both.
SHAPES = [
    (THRESHOLD - 1, []),
    (THRESHOLD, []),
    (THRESHOLD + 1, []),
    (10, [THRESHOLD // 2, THRESHOLD // 2 - 1]),
    (10, [THRESHOLD // 2, THRESHOLD // 2 + 1]),
    (CAPACITY + 1, [0, THRESHOLD - CAPACITY]),
    (3 * THRESHOLD, [THRESHOLD, 5]),
]


def _moved(frame: int, tensors: List[int]) -> int:
    return (frame if frame > CAPACITY else 0) + sum(tensors)


def every_op(directory: str, separate: bool, zero_copy: bool, local: bool = False) -> Dict[str, List[Any]]:
    """Each op at each shape; for each, did rank 0 take the normal transport (it logs why)? With ``local``, also
    how many channel collectives each all_gather took (round 1 and, through shared memory, its two control words)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world))) if local else None  # a channel of its own, opened here
    wire = _wire(directory, separate, group=group, zero_copy=zero_copy, local=local)
    sizes = lambda view: tensors  # noqa: E731 - every rank sends the same shape
    fell_back: Dict[str, List[Any]] = {op: [] for op in ("all_gather", "gather", "broadcast", "scatter", "send/recv")}
    fell_back["channel collectives"] = []
    for frame, tensors in SHAPES:
        before = _channel_seq(wire)
        got, lines = _logged(_rounds.all_gather, wire, _payload(rank, frame, tensors), sizes)
        fell_back["all_gather"].append(any("normal transport" in line for line in lines))
        fell_back["channel collectives"].append(_channel_seq(wire) - before)
        for r in range(world):
            _check(got[r], r, frame, tensors)

        got, lines = _logged(_gather.gather, wire, _payload(rank, frame, tensors), sizes, world - 1)
        fell_back["gather"].append(any("normal transport" in line for line in lines))
        if rank == world - 1:
            for r in range(world):
                _check(got[r], r, frame, tensors)

        item, lines = _logged(_broadcast.broadcast, wire, _payload(0, frame, tensors) if rank == 0 else None, sizes, 0)
        fell_back["broadcast"].append(any("normal transport" in line for line in lines))
        _check(item, 0, frame, tensors)

        outs = [_payload(10 * r, frame, tensors) for r in range(world)] if rank == 0 else None
        item, lines = _logged(_parts.scatter, wire, outs, sizes, 0)
        fell_back["scatter"].append(any("normal transport" in line for line in lines))
        _check(item, 10 * rank, frame, tensors)

        if rank == 0:
            _, lines = _logged(_p2p.send, wire, _payload(5, frame, tensors), 1)
            fell_back["send/recv"].append(any("normal transport" in line for line in lines))
        elif rank == 1:
            sender, item, error = _p2p.recv(wire, None, sizes)
            assert (sender, error) == (0, False)
            _check(item, 5, frame, tensors)
    dist.barrier()  # writers unlink once their readers are done, maybe just after those return
    assert os.listdir(directory) == []
    return fell_back


def _channel_seq(wire: _rounds.Wire) -> int:
    """How many collectives the group's same-host channel has carried (0: it has none)."""
    state = _state.group_facts(wire.group).local.get(False)
    return state.channel.sequence if state is not None and state.channel is not None else 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("separate", [False, True], ids=["same-host", "separate-hosts"])
@pytest.mark.parametrize("zero_copy", [False, True], ids=["files", "sealed"])
@pytest.mark.parametrize("local", [False, True], ids=["group", "channel"])
def test_every_op_both_paths_at_the_threshold(world, separate, zero_copy, local, shm_dir):
    results = get_pool(world).run(every_op, shm_dir, separate, zero_copy, local)
    expected = [separate or _moved(frame, tensors) < THRESHOLD for frame, tensors in SHAPES]
    counts = results[0].pop("channel collectives")
    for op, fell_back in results[0].items():
        if op == "gather":  # through the group, only its destination reads the slots and picks the route
            fell_back = results[world - 1][op]
        assert fell_back == expected, op
    # Through the channel: round 1 and its echo (issue 25), then, through shared memory, the announcement and the
    # outcome, each with its echo (the set-up of the first call goes through the group); an echo is two channel
    # collectives, the digests and then every rank's pass. Never when the ranks are "elsewhere", nor with it off.
    assert counts == ([0] * len(SHAPES) if separate or not local else [3 if normal else 9 for normal in expected])
    assert os.listdir(shm_dir) == []


def objects_roundtrip(directory: str) -> List[str]:
    """Every op through the Communicator, tensors of several dtypes; with ``shm_zero_copy=False`` results never
    point into shared memory."""
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator(shm_threshold=THRESHOLD, shm_dir=directory, shm_zero_copy=False)

    def obj(r: int) -> Any:
        return {
            "r": r,
            "blob": bytes([r]) * 3 * THRESHOLD,
            "f": torch.arange(2000, dtype=torch.float64) * r,
            "p": torch.nn.Parameter(torch.full((3000,), float(r))),
            "h": torch.ones(5000, dtype=torch.int16),
        }

    def same(a: Any, b: Any) -> None:
        assert a["r"] == b["r"] and a["blob"] == b["blob"]
        assert torch.equal(a["f"], b["f"]) and torch.equal(a["h"], b["h"])
        assert isinstance(a["p"], torch.nn.Parameter) and torch.equal(a["p"], b["p"])

    kept = []
    for r, got in enumerate(comm.all_gather(obj(rank))):
        same(got, obj(r))
        kept.append(got)
    gathered = comm.gather(obj(rank), dst=0)
    if rank == 0:
        for r, got in enumerate(gathered):
            same(got, obj(r))
        kept.extend(gathered)
    kept.append(comm.broadcast(obj(7) if rank == 0 else None, src=0))
    same(kept[-1], obj(7))
    kept.append(comm.scatter([obj(20 + r) for r in range(world)] if rank == 0 else None, src=0))
    same(kept[-1], obj(20 + rank))
    if rank == 0:
        comm.send(obj(30), 1)
    elif rank == 1:
        kept.append(comm.recv(0))
        same(kept[-1], obj(30))
    kept[0]["f"].add_(1)  # results are writable, own memory
    with open("/proc/self/maps") as maps:
        return [line for line in maps if "objcomm-" in line]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_objects_with_tensors_through_shared_memory(world, shm_dir):
    assert get_pool(world).run(objects_roundtrip, shm_dir) == [[]] * world
    assert os.listdir(shm_dir) == []


def mixed_group(directory: str) -> Dict[str, Any]:
    """Rank 2 plays another host: collectives keep the normal transport, 0 -> 1 uses shared memory."""
    rank = dist.get_rank()
    group = dist.new_group(list(range(dist.get_world_size())))  # a fresh group: every rank discovers it anew
    wire = _wire(directory, separate=rank == 2, group=group)
    sizes = lambda view: []  # noqa: E731
    frame = 2 * THRESHOLD
    got, gather_lines = _logged(_rounds.all_gather, wire, _payload(rank, frame, []), sizes)
    for r, item in enumerate(got):
        _check(item, r, frame, [])
    lines: List[str] = []
    for peer in (1, 2):
        if rank == 0:
            lines += _logged(_p2p.send, wire, _payload(peer, frame, []), peer)[1]
        elif rank == peer:
            _check(_p2p.recv(wire, 0, sizes)[1], peer, frame, [])
    dist.destroy_process_group(group)
    return {"all_gather": gather_lines, "send": lines}


@pytest.mark.timeout(60)
def test_mixed_group_keeps_the_normal_transport_where_hosts_differ(shm_dir):
    results = get_pool(3).run(mixed_group, shm_dir)
    assert all(any("spans 2 hosts" in line for line in r["all_gather"]) for r in results)
    assert results[0]["send"] == ["objcomm shm: send to rank 2 crosses hosts; normal transport"]
    assert os.listdir(shm_dir) == []


def fallback(directory: str, enabled: bool) -> tuple[int, List[str]]:
    rank = dist.get_rank()
    comm = objcomm.Communicator(shm=enabled, shm_threshold=THRESHOLD, shm_dir=directory, shm_zero_copy=False)
    got, lines = _logged(comm.all_gather, bytes([rank]) * 2 * THRESHOLD)
    assert got == [bytes([r]) * 2 * THRESHOLD for r in range(dist.get_world_size())]
    return len(got), lines


@pytest.mark.timeout(60)
def test_unwritable_directory_falls_back_with_a_debug_line(tmp_path):
    missing = str(tmp_path / "no-such-dir")
    for count, lines in get_pool(2).run(fallback, missing, True):
        assert count == 2
        assert len([line for line in lines if "could not write shared memory" in line]) == 1, lines


@pytest.mark.timeout(60)
def test_switched_off_moves_nothing_through_shared_memory(shm_dir):
    for count, lines in get_pool(2).run(fallback, shm_dir, False):
        assert (count, lines) == (2, [])


def _shm_config(comm: objcomm.Communicator) -> Any:
    """The shared-memory configuration a call through ``comm`` would use (no group needed)."""
    strategy = _rest_media(comm._call({}).options, comm._hooks.segments)
    if isinstance(strategy, TwoLevelRests):  # with local on, two levels and the same-host rests wrap it
        strategy = strategy.inner
    if isinstance(strategy, (SameHostRests, VotedRests)):  # with local on or off
        strategy = strategy.shared or DIRECT
    return None if strategy is DIRECT else strategy


def test_config_reads_the_environment_through_configure(monkeypatch):
    """The environment is read by configure() (not per call), and an explicit setting beats it."""
    previous = objcomm.configure()
    try:
        monkeypatch.setenv("OBJCOMM_SHM", "0")
        objcomm.configure()
        assert _shm_config(objcomm.Communicator()) is None
        assert _shm_config(objcomm.Communicator(shm=True)) is not None  # the explicit value wins
        monkeypatch.setenv("OBJCOMM_SHM", "1")
        monkeypatch.setenv("OBJCOMM_FORCE_SEPARATE_HOSTS", "1")
        monkeypatch.setenv("OBJCOMM_SHM_DIR", "/somewhere")
        objcomm.configure()
        expected = _shm.SharedMemory(threshold=5, directory="/somewhere", separate=True)
        assert _shm_config(objcomm.Communicator(shm_threshold=5)) == expected
        assert _shm_config(objcomm.Communicator(shm=False, shm_threshold=5)) is None
        assert _shm_config(objcomm.Communicator(shm_dir="/here")).directory == "/here"  # explicit beats variable
        assert _shm_config(objcomm.Communicator()).zero_copy  # the default
        monkeypatch.setenv("OBJCOMM_SHM_ZERO_COPY", "0")
        objcomm.configure()
        assert not _shm_config(objcomm.Communicator()).zero_copy
        assert _shm_config(objcomm.Communicator(shm_zero_copy=True)).zero_copy
    finally:
        monkeypatch.undo()
        objcomm.restore(previous)
    with pytest.raises(ValueError):
        objcomm.Settings(shm_threshold=-1)


@pytest.mark.timeout(10)
def test_too_little_space_is_refused_before_creating(shm_dir):
    with pytest.raises(OSError, match="free"):
        huge = torch.empty(1, dtype=torch.uint8).expand(1 << 60)  # no memory behind it
        _segments.SegmentBook().create(os.path.join(shm_dir, "objcomm-x-1-1-0"), None, [huge])
    assert os.listdir(shm_dir) == []


# -- lifetime -------------------------------------------------------------------------------------
def many_calls(directory: str, calls: int) -> List[int]:
    rank = dist.get_rank()
    wire = _wire(directory, separate=False, threshold=256)  # files: the directory shows what is left
    sizes = lambda view: [300]  # noqa: E731
    for i in range(calls):
        op = i % 4
        if op == 0:
            _rounds.all_gather(wire, _payload(rank, 200, [300]), sizes)
        elif op == 1:
            _broadcast.broadcast(wire, _payload(0, 200, [300]) if rank == 0 else None, sizes, 0)
        elif op == 2:
            _gather.gather(wire, _payload(rank, 200, [300]), sizes, 0)
        elif rank == 0:
            _p2p.send(wire, _payload(0, 200, [300]), 1)
        elif rank == 1:
            _p2p.recv(wire, 0, sizes)
    dist.barrier()  # a writer unlinks once its readers are done, which may be just after they return
    return [os.getpid(), len(os.listdir(directory))]


@pytest.mark.timeout(60)
def test_a_thousand_calls_leave_no_segments(shm_dir):
    results = get_pool(2).run(many_calls, shm_dir, 1000)
    assert [count for _, count in results] == [0, 0]
    assert os.listdir(shm_dir) == []
    pids = {str(pid) for pid, _ in results}
    writers = [_segments._parse(n) for n in os.listdir("/dev/shm")]
    assert not [w for w in writers if w is not None and str(w.pid) in pids]


def die_after_writing(directory: str) -> None:
    """Rank 1 is SIGKILLed after writing its segment, before anyone could read or unlink it."""

    class Killed(_shm.SharedMemory):
        def _gather_rows(self, *args: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

    rank = dist.get_rank()
    wire = _wire(directory, separate=False, strategy=Killed if rank == 1 else _shm.SharedMemory)
    _rounds.all_gather(wire, _payload(rank, 2 * THRESHOLD, []), lambda view: [])


def interrupted(directory: str) -> int:
    """A KeyboardInterrupt in the middle of a call unlinks what this rank wrote."""

    class Interrupted(_shm.SharedMemory):
        def _any(self, *args: Any) -> Any:
            raise KeyboardInterrupt

    try:
        wire = _wire(directory, separate=False, strategy=Interrupted)
        _rounds.all_gather(wire, _payload(dist.get_rank(), 2 * THRESHOLD, []), lambda v: [])
    except KeyboardInterrupt:
        pass
    dist.barrier()  # both ranks skipped the same collective, so they are still in step
    return len(os.listdir(directory))


@pytest.mark.timeout(60)
def test_interrupted_call_unlinks_its_segments(shm_dir):
    assert get_pool(2).run(interrupted, shm_dir) == [0, 0]


@pytest.mark.timeout(60)
def test_killed_rank_leaves_nothing_once_the_job_is_gone(shm_dir):
    with RankPool(2, failure_grace=5) as pool:
        with pytest.raises(RankDied):
            pool.run(die_after_writing, shm_dir)
    left = os.listdir(shm_dir)  # whatever the killed job's ranks wrote ...
    _segments.sweep(shm_dir)  # ... is removed by the next job's first shared-memory call (same function)
    assert os.listdir(shm_dir) == [], left


def _killed_after_the_rows(directory: str, rank: int, world: int, store: str, victim: int, results: Any) -> None:
    """The victim is SIGKILLed in the outcome vote of a shared-memory all_gather, after every rank wrote its file
    and read the others' rows; the survivor reports the files left once its call raised (no sweep of its own)."""
    from datetime import timedelta

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    comm = objcomm.Communicator(shm_dir=directory, shm_zero_copy=False, shm_threshold=THRESHOLD)
    comm.all_gather(bytes(2 * THRESHOLD))  # the set-up: hosts, the channel
    if rank == victim:
        _shm.SharedMemory._any = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[assignment]
    try:
        comm.all_gather(bytes(2 * THRESHOLD))
        results.put((rank, "returned", os.listdir(directory)))
    except objcomm.CommunicationError:
        results.put((rank, "CommunicationError", os.listdir(directory)))
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.mark.timeout(120)
def test_a_writer_killed_mid_call_leaves_no_file_once_its_peer_raised(shm_dir):
    """The survivor sweeps as it raises, while the killed writer may still be on its way out (its sockets closed,
    which is what the survivor saw): a process that is exiting counts as dead (a helper's find: its file outlived
    that sweep in 9 runs of 10)."""
    for _ in range(3):
        got, victim_exit = run_group_losing_a_rank(functools.partial(_killed_after_the_rows, shm_dir), 2, 1)
        assert victim_exit == -signal.SIGKILL
        assert got[0] == ("CommunicationError", []), got


def new_group_discovers(directory: str) -> List[str]:
    group = dist.new_group(list(range(dist.get_world_size())))
    wire = _wire(directory, separate=False, group=group)
    _rounds.all_gather(wire, _payload(dist.get_rank(), 2 * THRESHOLD, []), lambda view: [])
    dist.barrier(group)  # writers unlink once their readers are done, maybe just after those return
    dist.destroy_process_group(group)
    return sorted(os.listdir(directory))


def new_group_learns_its_hosts_from_its_channel(directory: str) -> List[Any]:
    """A new group whose same-host channel opens in the foreground, through the group (as for more than
    ``opener.MOST_RANKS`` ranks), whose set-up words tell every rank the hosts: a shared-memory all_gather on it,
    then what the folder holds, and how often the hosts were discovered apart from the channel."""
    from _counting import counting

    from objcomm._samehost import hosts as _hosts
    from objcomm._samehost import opener as _opener

    saved, _opener.MOST_RANKS = _opener.MOST_RANKS, 1
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        comm = objcomm.Communicator(group, shm_dir=directory, shm_threshold=THRESHOLD, shm_zero_copy=False)
        with counting({"discover": [(_hosts, "discover")]}) as discovered:
            comm.all_gather(bytes(2 * THRESHOLD))
        dist.barrier(group)  # writers unlink once their readers are done, maybe just after those return
        dist.destroy_process_group(group)
    finally:
        _opener.MOST_RANKS = saved
    return [sorted(os.listdir(directory)), discovered["discover"]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hosts_from", ["discovery", "the channel's set-up"])
def test_a_groups_first_shared_memory_call_removes_segments_of_dead_processes(shm_dir, hosts_from):
    """Whether the group learnt its hosts in a discovery of their own or from its channel's set-up (the
    second skipped the sweep: a helper's find)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = _segments._name(shm_dir, _segments._me(0)._replace(pid=dead.pid), 1, 0)
    alive = _segments._name(shm_dir, _segments._me(0), 1, 0)
    for path in (stale, alive):
        open(path, "wb").close()
    if hosts_from == "discovery":
        assert get_pool(2).run(new_group_discovers, shm_dir) == [[os.path.basename(alive)]] * 2
    else:
        got = get_pool(2).run(new_group_learns_its_hosts_from_its_channel, shm_dir)
        assert got == [[[os.path.basename(alive)], 0]] * 2


def tensors_split_against_their_table(shm_threshold: int, local: bool = True, zero_copy: bool = True) -> Any:
    """Rank 1's tensors split otherwise than its frame's table says (the same total, frames of equal length on
    both ranks, so the table agrees with the other rank's slot): what each rank raises, and the group after."""
    import torch
    from _hostile import tensor_tables_that_lie

    rank = dist.get_rank()
    comm = objcomm.Communicator(shm_threshold=shm_threshold, local=local, shm_zero_copy=zero_copy)
    try:
        with tensor_tables_that_lie(rank == 1):
            comm.all_gather({"a": torch.ones(100_000, dtype=torch.uint8), "b": torch.ones(100_000, dtype=torch.uint8)})
        outcome = "ok"
    except objcomm.ObjcommError as exc:
        outcome = type(exc).__name__
    return outcome, comm.all_gather(rank)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["sealed", "files"])
def test_a_frame_is_checked_against_its_own_senders_slot(zero_copy):
    pool = get_pool(2)
    through_shared_memory = pool.run(tensors_split_against_their_table, 1, True, zero_copy)
    assert through_shared_memory == pool.run(tensors_split_against_their_table, 1 << 30, False)  # the backend's
    assert through_shared_memory == [("FrameError", [0, 1])] * 2
