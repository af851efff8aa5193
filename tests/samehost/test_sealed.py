"""Sealed segments (objcomm._samehost.sealed): zero-copy results that no writer can change, and their lifetime.

Reads of hostile descriptors run in a child process (``_child.run_in_child``), so a crash would fail
one test instead of killing pytest.
"""

from __future__ import annotations

import fcntl
import gc
import os
import socket
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _child import run_in_child
from _ranks import get_pool

import objcomm
import serializers
from objcomm import _state
from objcomm._api.resolving import NO_HOOKS, Hooks
from objcomm._format import frame as _frame
from objcomm._samehost import sealed as _sealed
from objcomm._samehost import segments as _segments
from objcomm._samehost.sealed import Sealed

THRESHOLD = 4096
FRAME = b"frame-bytes" * 10


def _pieces() -> List[memoryview]:
    return [memoryview(bytes(range(7)) * 100), memoryview(b""), memoryview(np.arange(1000, dtype=np.float64))]


def _sizes(view: memoryview) -> List[int]:
    return [piece.nbytes for piece in _pieces()]


def _size() -> int:
    return len(FRAME) + sum(_sizes(memoryview(b"")))


def _outcome(fn: Any) -> Tuple[str, str]:
    try:
        fn()
        return "mapped", ""
    except Exception as exc:
        return type(exc).__name__, str(exc)


# -- in one process ------------------------------------------------------------------------------
def round_trip(read_frame: int) -> Dict[str, Any]:
    _sealed.READ_FRAME = read_frame  # 0: the frame is mapped (as a large one is), else read
    segment = _sealed.write_sealed("objcomm-test", memoryview(FRAME), _pieces())
    where = Sealed(os.getpid(), segment.fd)
    got = _sealed.map_sealed(where, _size(), None, len(FRAME), _sizes)
    tensors = got.tensors
    report = {
        "frame": bytes(got.frame) == FRAME,
        "tensors": [bytes(t.numpy()) for t in tensors] == [bytes(p) for p in _pieces()],
        "aligned": all(t.data_ptr() % _sealed.ALIGN == 0 for t in tensors if t.numel()),
        "seals": fcntl.fcntl(segment.fd, fcntl.F_GET_SEALS) & _sealed.SEALS == _sealed.SEALS,
    }
    tensors[0][:5] = 255  # copy on write: the file (and every other reader) keeps the original
    again = _sealed.map_sealed(where, _size(), None, len(FRAME), _sizes)
    report["private"] = bytes(again.tensors[0].numpy()) == bytes(_pieces()[0]) and int(tensors[0][0]) == 255
    report["writer write"] = _outcome(lambda: os.pwrite(segment.fd, b"x", 0))[0]
    report["writer truncate"] = _outcome(lambda: os.ftruncate(segment.fd, 1))[0]
    segment.release()  # the writer is done; what readers hold stays valid
    report["after release"] = bytes(got.tensors[2].numpy()) == bytes(_pieces()[2])
    return report


@pytest.mark.parametrize("read_frame", [0, _sealed.READ_FRAME])
def test_round_trip_is_aligned_private_and_immutable_for_the_writer(read_frame):
    report = run_in_child(round_trip, read_frame, memory_budget=256 << 20)
    assert report == {
        "frame": True,
        "tensors": True,
        "aligned": True,
        "seals": True,
        "private": True,
        "writer write": "PermissionError",
        "writer truncate": "PermissionError",
        "after release": True,
    }


def _memfd(data: bytes, seals: int) -> int:
    fd = os.memfd_create("objcomm-hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def hostile_descriptors(tmp: str) -> Dict[str, Tuple[str, str]]:
    """What a reader makes of descriptors a lying writer could announce."""
    segment = _sealed.write_sealed("objcomm-test", memoryview(FRAME), _pieces())
    with open(f"/proc/self/fd/{segment.fd}", "rb") as handle:
        content = handle.read()
    plain = os.path.join(tmp, "plain")
    with open(plain, "wb") as handle:
        handle.write(content)
    reading, writing = os.pipe()
    sparse = _memfd(b"", 0)
    os.ftruncate(sparse, 4 << 30)  # 4 GiB of holes, sealed: mapping it would exceed the child's address space
    fcntl.fcntl(sparse, fcntl.F_ADD_SEALS, _sealed.SEALS)
    fds = {
        "unsealed memfd": _memfd(content, 0),
        "writable memfd": _memfd(content, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW),
        "shrinkable memfd": _memfd(content, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW),
        "file on disk": os.open(plain, os.O_RDONLY),
        "pipe": reading,
        "longer than its layout": _memfd(content + b"\0" * 64, _sealed.SEALS),
        "shorter than its layout": _memfd(content[:-8], _sealed.SEALS),
        "far longer than announced": _memfd(content + b"\0" * (1 << 20), _sealed.SEALS),
        "4 GiB sparse": sparse,
    }
    try:
        huge = os.memfd_create("objcomm-huge", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
        os.ftruncate(huge, 2 << 20)
        fcntl.fcntl(huge, fcntl.F_ADD_SEALS, _sealed.SEALS)
        fds["huge pages"] = huge
    except OSError:  # no hugetlbfs here: nothing to announce
        pass
    me = os.getpid()
    outcomes = {
        kind: _outcome(lambda fd=fd: _sealed.map_sealed(Sealed(me, fd), _size(), None, len(FRAME), _sizes))
        for kind, fd in fds.items()
    }
    right = Sealed(me, segment.fd)
    outcomes["tensors announced beyond the size"] = _outcome(
        lambda: _sealed.map_sealed(right, _size(), None, len(FRAME), lambda view: [10**12])
    )
    outcomes["frame longer than the size"] = _outcome(
        lambda: _sealed.map_sealed(right, _size(), None, _size() + 1, _sizes)
    )
    outcomes["size understated"] = _outcome(lambda: _sealed.map_sealed(right, 10, None, len(FRAME), _sizes))
    outcomes["no such descriptor"] = _outcome(
        lambda: _sealed.map_sealed(Sealed(me, 10**6), _size(), None, len(FRAME), _sizes)
    )
    outcomes["no such process"] = _outcome(
        lambda: _sealed.map_sealed(Sealed(-1, segment.fd), _size(), None, len(FRAME), _sizes)
    )
    outcomes["socket"] = _outcome(lambda: _sealed.map_sealed(Sealed(me, _socket()), _size(), None, len(FRAME), _sizes))
    os.close(writing)
    return outcomes


def _socket() -> int:
    import socket

    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).detach()


def a_terminal_announced() -> Dict[str, Any]:
    """A session leader without a terminal (a torchrun worker) is told to read a pseudo-terminal."""
    os.setsid()
    master, terminal = os.openpty()
    outcome = _outcome(lambda: _sealed.map_sealed(Sealed(os.getpid(), terminal), _size(), None, len(FRAME), _sizes))
    try:
        os.close(os.open("/dev/tty", os.O_RDWR))
        controlling = True
    except OSError:
        controlling = False
    os.write(master, b"\x1c")  # ^\ : SIGQUIT to the foreground group of that terminal, if it were ours
    return {"outcome": outcome, "controlling terminal": controlling}


def test_a_terminal_announced_is_refused_without_becoming_the_readers_terminal():
    report = run_in_child(a_terminal_announced)
    assert report["outcome"][0] == "FrameError" and "is not a regular file" in report["outcome"][1], report
    assert report["controlling terminal"] is False


def test_hostile_descriptors_are_refused_or_fall_back(tmp_path):
    outcomes = run_in_child(hostile_descriptors, str(tmp_path), memory_budget=256 << 20)
    refused = {kind: message for kind, (name, message) in outcomes.items() if name == "FrameError"}
    assert set(refused) == {
        "unsealed memfd",
        "writable memfd",
        "shrinkable memfd",
        "file on disk",
        "pipe",
        "longer than its layout",
        "shorter than its layout",
        "far longer than announced",
        "tensors announced beyond the size",
        "frame longer than the size",
        "size understated",
        "4 GiB sparse",
        "socket",
        *(["huge pages"] if "huge pages" in outcomes else []),
    }, outcomes
    assert all("sealed segment" in message and "refused" in message for message in refused.values())
    # what cannot be opened is not an attack the reader can tell from a gone writer: the call falls back
    assert {outcomes[k][0] for k in ("no such descriptor", "no such process")} == {"Unopenable"}, outcomes


def _memfd_rss_kib() -> int:
    """Resident KiB of this process's mappings of objcomm's sealed files (from the page tables: exact)."""
    total, ours = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:  # a mapping's header line
                ours = "memfd:objcomm" in line
            elif ours and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def bytes_received(kind_name: str) -> Dict[str, Any]:
    """A large ``bytes``/``bytearray`` through a sealed segment, decoded as a receiver does."""
    n = 8 << 20
    value = {"bytes": bytes, "bytearray": bytearray}[kind_name](bytes(range(256)) * (n // 256))
    out = _frame.encode(value, serializers.registry.guarded("pickle"), max_bytes=1 << 30)
    segment = _sealed.write_sealed("objcomm-test", out.parts, [t.numpy().data for t in out.tensors])
    got = _sealed.map_sealed(Sealed(os.getpid(), segment.fd), out.total, None, out.frame_nbytes, _frame.tensor_sizes)
    segment.release()
    back = _frame.decode(got, sender=0, accept=None)
    report = {
        "type": type(back).__name__,
        "equal": back == value,
        "mapped KiB": _memfd_rss_kib(),
        "open while held": _open_sealed(),
    }
    del got
    gc.collect()
    report["open after"] = _open_sealed()
    return report


@pytest.mark.parametrize("kind", ["bytes", "bytearray"])
def test_bytes_from_a_sealed_segment_are_read_not_mapped(kind):
    """Its pages never enter the reader's mappings (the copy is read from the file), whose descriptor the
    received buffers hold until they go."""
    report = run_in_child(bytes_received, kind, memory_budget=256 << 20)
    assert report.pop("mapped KiB") < 1024, report  # 8 MiB when copied from the mapping; the frame's page here
    assert report.pop("open while held") >= 1  # the reader's descriptor (the writer's is closed)
    assert report == {"type": kind, "equal": True, "open after": 0}


def _read(buffers: _sealed.Buffers, index: int, kind: type) -> Tuple[str, str]:
    try:
        got = buffers(index, kind)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return type(got).__name__, bytes(got).hex()


def short_reads() -> Dict[Tuple[str, int], Tuple[str, str]]:
    """:class:`Buffers` over a sealed file of 100 bytes, given a layout that claims 164: each buffer read."""
    fd = _memfd(bytes(range(100)), _sealed.SEALS)
    buffers = _sealed.Buffers(fd, Sealed(os.getpid(), fd), [(0, 100), (64, 100), (0, 0)])
    found = {(kind.__name__, index): _read(buffers, index, kind) for kind in (bytes, bytearray) for index in range(3)}
    _sealed.MAX_READ = 32  # beyond one read(2): read in pieces, each of which must be whole
    found.update({("pieces", index): _read(buffers, index, bytes) for index in range(2)})
    return found


def test_a_read_past_what_a_sealed_file_holds_is_refused():
    found = run_in_child(short_reads)
    whole = bytes(range(100)).hex()
    assert {key: kind for key, (kind, _) in found.items() if kind == "FrameError"} == {
        ("bytes", 1): "FrameError",
        ("bytearray", 1): "FrameError",
        ("pieces", 1): "FrameError",
    }, found
    assert all(
        "bytes at offset" in text and "could be read; refused" in text
        for kind, text in found.values()
        if kind == "FrameError"
    ), found
    assert [found[key] for key in [("bytes", 0), ("bytearray", 0), ("pieces", 0), ("bytes", 2), ("bytearray", 2)]] == [
        ("bytes", whole),
        ("bytearray", whole),
        ("bytes", whole),
        ("bytes", ""),
        ("bytearray", ""),
    ]


def interrupted_after_the_open() -> Dict[str, Any]:
    """map_sealed interrupted after it built the result (as a KeyboardInterrupt would): its descriptor is
    closed once. Before, the error path closed it and the result's finalizer closed the same number again,
    by then a socket opened meanwhile."""
    frame = bytes(16)
    fd = _memfd(frame + bytes(48) + bytes(range(64)), _sealed.SEALS)
    real, seen = _sealed.Incoming, {}

    def fails_once_built(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt("in the last step")

    _sealed.Incoming = fails_once_built  # type: ignore[misc]
    held: Optional[BaseException] = None
    try:
        _sealed.map_sealed(Sealed(os.getpid(), fd), 16 + 64, None, 16, lambda view: [64])
    except KeyboardInterrupt as exc:
        held = exc  # kept, with its traceback, as a caller's handler may
    finally:
        _sealed.Incoming = real  # type: ignore[misc]
    bystander = socket.socketpair()  # takes the lowest free numbers, the one just closed among them
    del held
    gc.collect()  # whatever the failed call left behind goes now
    try:
        bystander[0].send(b"still open")
        seen["bystander"] = bystander[1].recv(100).decode()
    except OSError as exc:
        seen["bystander"] = f"closed under it: {exc}"
    return seen


def test_a_descriptor_is_closed_once_when_a_map_is_interrupted():
    assert run_in_child(interrupted_after_the_open) == {"bystander": "still open"}


# -- on a group ------------------------------------------------------------------------------------
def _mapped() -> int:
    """How many of this process's mappings are objcomm's sealed files."""
    with open("/proc/self/maps") as maps:
        return sum("memfd:objcomm" in line for line in maps)


def _open_sealed() -> int:
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += "memfd:objcomm" in os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return count


def _shmem_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssShmem:"))


def lifetime() -> Dict[str, Any]:
    """Zero-copy results through all_gather at W=3: views, private, kept, re-sent, dropped."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(shm_threshold=THRESHOLD)
    n = 1 << 18  # 2 MiB of float64
    value = rank + 1  # rank r sends r + 1 everywhere
    mine = {"a": np.full(n, float(value)), "t": torch.full((n,), value, dtype=torch.int32), "b": bytes([value]) * n}
    baseline = _shmem_kib()
    got = comm.all_gather(mine)
    report: Dict[str, Any] = {
        "values": all(
            np.all(g["a"] == r + 1)
            and torch.equal(g["t"], torch.full((n,), r + 1, dtype=torch.int32))
            and g["b"] == bytes([r + 1]) * n
            for r, g in enumerate(got)
        ),
        "mapped": _mapped() > 0,
        "types": [type(got[0]["a"]).__name__, type(got[0]["t"]).__name__, type(got[0]["b"]).__name__],
        "writable": bool(got[0]["a"].flags.writeable),
    }
    if rank == 1:  # mutate what arrived from rank 0, and this rank's own result
        got[0]["a"][:] = 99.0
        got[0]["t"].add_(1000)
        got[1]["a"][:] = -1.0
    sums = comm.all_gather((float(got[0]["a"].sum()), int(got[0]["t"].sum()), float(mine["a"].sum())))
    report["writer and others unchanged"] = sums[0][:2] == sums[2][:2] == (1.0 * n, n)  # rank 0's own, rank 2's view
    report["mutated here"] = sums[1][:2] == (99.0 * n, 1001 * n)
    report["input unchanged"] = bool(np.all(mine["a"] == value)) and [s[2] for s in sums] == [n, 2.0 * n, 3.0 * n]
    for _ in range(5):  # more calls through sealed segments; the kept results stay intact
        comm.broadcast({"a": np.zeros(n)} if rank == 0 else None, src=0)
    report["kept"] = bool(np.all(got[2]["a"] == 3)) and got[2]["b"] == bytes([3]) * n
    if rank == 1:  # re-send a mutated zero-copy result
        comm.send(got[0], dst=2)
    elif rank == 2:
        again = comm.recv(src=1)
        report["re-sent"] = bool(np.all(again["a"] == 99.0)) and torch.equal(
            again["t"], torch.full((n,), 1001, dtype=torch.int32)
        )
        del again
    dist.barrier()  # writers close their files once their readers are done, maybe just after those return
    del got
    gc.collect()
    report["dropped"] = (_mapped(), _open_sealed())
    report["shmem back to baseline"] = _shmem_kib() <= baseline + 64
    return report


@pytest.mark.timeout(90)
def test_zero_copy_results_are_private_views_that_outlive_the_call_and_go_when_dropped():
    reports = get_pool(3).run(lifetime)
    for rank, report in enumerate(reports):
        assert report.pop("types") == ["ndarray", "Tensor", "bytes"]
        assert report.pop("re-sent", True) is True
        assert report == {
            "values": True,
            "mapped": True,
            "writable": True,
            "writer and others unchanged": True,
            "mutated here": True,
            "input unchanged": True,
            "kept": True,
            "dropped": (0, 0),
            "shmem back to baseline": True,
        }, (rank, report)


class _Lying(_segments.SegmentBook):
    """Writes a proper sealed segment, then announces another descriptor: ``how`` says which."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def create_sealed(self, frame: Optional[memoryview], tensors: Any) -> Any:
        segment = super().create_sealed(frame, tensors)
        with open(f"/proc/self/fd/{segment.fd}", "rb") as handle:
            content = handle.read()
        os.close(segment.fd)
        if self.how == "unsealed":
            segment.fd = _memfd(content, 0)
        elif self.how == "writable":
            segment.fd = _memfd(content, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        else:  # a descriptor number that does not exist: readers cannot open it, as where /proc is closed
            segment = _Unopenable(1 << 20)
        return segment


class _Unopenable(_sealed.SealedSegment):
    def release(self) -> None:  # nothing was opened
        pass


def lying_writer(how: str, directory: str) -> Dict[str, Any]:
    """Rank 0 announces a descriptor that is not what sealed segments must be; then clean calls follow."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])  # a fresh group: what the group learns stays with it
    settings = dict(shm_threshold=THRESHOLD, shm_dir=directory)
    comm = objcomm.Communicator(group, **settings, _hooks=Hooks(segments=_Lying(how)) if rank == 0 else NO_HOOKS)
    big = lambda tag: {"a": np.full(THRESHOLD, float(tag)), "blob": bytes([tag]) * THRESHOLD}  # noqa: E731
    error = None
    try:
        got = comm.broadcast(big(1) if rank == 0 else None, src=0)
        first = bool(np.all(got["a"] == 1.0))
    except objcomm.ObjcommError as exc:
        error, first = (type(exc).__name__, str(exc)), False
    counted: List[int] = []

    class Counting(_segments.SegmentBook):
        def create(self, path: str, frame: Any, tensors: Any) -> Any:
            counted.append(1)
            return super().create(path, frame, tensors)

    comm = objcomm.Communicator(group, **settings, _hooks=Hooks(segments=Counting()))
    after = comm.broadcast(big(2) if rank == 0 else None, src=0)
    unsealed = (-1, False) in _state.group_facts(group).unsealed
    dist.barrier(group)
    dist.destroy_process_group(group)
    return {
        "error": error,
        "first": first,
        "clean": bool(np.all(after["a"] == 2.0)),
        "files after": len(counted),
        "remembered": unsealed,
    }


def _memfds() -> int:
    """This process's open descriptors that are memory files (sealed segments among them)."""
    found = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:")
        except OSError:
            pass
    return found


def refused_again_and_again(calls: int) -> Dict[str, Any]:
    """Rank 1 announces an unsealed file in every all_gather; rank 0 refuses each, with the cyclic garbage
    collector off (as some training loops run): what it mapped of its own segment must go with each error,
    not wait for a collection (the re-raised error's traceback once closed a cycle through the call)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    lying = Hooks(segments=_Lying("unsealed")) if rank == 1 else NO_HOOKS
    comm = objcomm.Communicator(group, shm_threshold=THRESHOLD, _hooks=lying)
    value = {"t": torch.zeros(1 << 17), "a": np.zeros(1 << 16)}  # out of band: views on the mapping
    errors, grown = 0, []
    gc.collect()
    gc.disable()
    try:
        before = _memfds()
        for _ in range(calls):
            try:
                comm.all_gather(value)
            except objcomm.FrameError:
                errors += 1
            grown.append(_memfds() - before)
    finally:
        gc.enable()
    dist.barrier(group)
    dist.destroy_process_group(group)
    return {"errors": errors, "most memfds held after a call": max(grown)}


@pytest.mark.timeout(90)
def test_refused_segments_release_what_was_mapped_without_a_garbage_collection():
    refuser, _ = get_pool(2).run(refused_again_and_again, 20)
    assert refuser == {"errors": 20, "most memfds held after a call": 0}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["unsealed", "writable"])
def test_a_descriptor_that_is_not_sealed_is_refused_and_the_group_stays_usable(how, shm_dir):
    writer, reader = get_pool(2).run(lying_writer, how, shm_dir)
    assert writer["error"] is None and writer["first"]  # the writer's own result is its own; the reader refuses
    assert reader["error"] is not None and reader["error"][0] == "FrameError", reader["error"]
    assert "is not sealed against writing and resizing" in reader["error"][1]
    assert writer["clean"] and reader["clean"]
    assert (writer["files after"], writer["remembered"], reader["remembered"]) == (0, False, False)


@pytest.mark.timeout(90)
def test_a_descriptor_readers_cannot_open_falls_back_and_the_group_uses_files_from_then_on(shm_dir):
    writer, reader = get_pool(2).run(lying_writer, "unopenable", shm_dir)
    assert writer["error"] is None and reader["error"] is None  # the normal transport carried it
    assert writer["first"] and reader["first"] and writer["clean"] and reader["clean"]
    assert writer["remembered"] and reader["remembered"]
    assert writer["files after"] == 1  # the next call wrote a segment file


def every_serializer(names: List[str]) -> Dict[str, bool]:
    """The same large object through sealed segments and without shared memory, for each serializer:
    equal values on every rank (what each serializer can carry: tensors and arrays where it lifts them)."""
    rank = dist.get_rank()
    found = {}
    for name in names:
        plain = {
            "rank": rank,
            "text": "é" * 3000,
            "floats": [0.5 * i for i in range(THRESHOLD)],
            "nested": {"k": [1, 2, {"x": None}]},
        }
        n = 32 * THRESHOLD  # above inline_tensor_bytes: out of band, so results are views on the mapping
        rich = {
            **plain,
            "t": torch.arange(n, dtype=torch.float32) + rank,
            "a": np.arange(n, dtype=np.int64) * rank,
            "b": bytes([rank]) * n,
        }
        obj = plain if name == "json" else rich
        counting = _Counting()
        comm = objcomm.Communicator(serializer=name, shm_threshold=THRESHOLD, _hooks=Hooks(segments=counting))
        sealed = comm.all_gather(obj)
        normal = objcomm.Communicator(serializer=name, shm=False).all_gather(obj)
        viewed = _mapped() > 0 or name == "json"  # json lifts nothing: its results are built from the frame
        found[name] = counting.sealed == 1 and viewed and _equal(sealed, normal)
        del sealed
    return found


class _Counting(_segments.SegmentBook):
    sealed = 0

    def create_sealed(self, frame: Optional[memoryview], tensors: Any) -> Any:
        self.sealed += 1
        return super().create_sealed(frame, tensors)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.mark.timeout(120)
def test_every_serializer_gives_the_same_values_through_sealed_segments():
    names = sorted(serializers.registry.available())
    for found in get_pool(2).run(every_serializer, names):
        assert found == {name: True for name in names}
