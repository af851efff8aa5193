"""The same-host path does not trust the file system: planted links, shrunk segments, and a sweep run as root.

Reads that could crash (a mapping of a file that shrinks dies of SIGBUS) run in a child process
(``_child.run_in_child``), so a crash fails one test instead of killing pytest.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from _child import run_in_child
from _ranks import get_pool

import objcomm
from objcomm._api.resolving import Hooks
from objcomm._samehost import hosts as _hosts
from objcomm._samehost import segments as _segments

THRESHOLD = 4096
NOBODY = 65534


def _write(path: str, data: bytes, mode: int = 0o600) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)  # whatever the umask says
    finally:
        os.close(fd)
    return path


def _read(path: str, size: int, sizes_of: Callable[[memoryview], List[int]]) -> Any:
    """Read a segment whose frame came inline (empty) and whose bytes are tensors, as a receiver does."""
    return _segments.read_segment(path, size, memoryview(b""), 0, sizes_of)


def _outcome(path: str, size: int) -> Tuple[str, str]:
    """``("read", bytes)`` when the reader took the segment, else the exception's type and message."""
    try:
        got = _read(path, size, lambda view: [size])
        return "read", bytes(got.tensors[0].numpy())[:16].hex()
    except Exception as exc:
        return type(exc).__name__, str(exc)


# -- attack 1: a link (or anything but our own private regular file) at a segment's name ----------------
def read_planted(paths: Dict[str, str], size: int) -> Dict[str, Tuple[str, str]]:
    return {kind: _outcome(path, size) for kind, path in paths.items()}


@pytest.mark.timeout(60)
def test_reader_refuses_links_and_files_it_did_not_write(shm_dir, tmp_path):
    size = 1 << 16
    secret = _write(str(tmp_path / "secret"), b"s" * size)  # right size, right owner: only the link is wrong
    paths = {"symlink": os.path.join(shm_dir, "objcomm-link"), "dangling": os.path.join(shm_dir, "objcomm-dangling")}
    os.symlink(secret, paths["symlink"])
    os.symlink(str(tmp_path / "nothing"), paths["dangling"])
    paths["fifo"] = os.path.join(shm_dir, "objcomm-fifo")
    os.mkfifo(paths["fifo"], 0o600)  # would block an O_RDONLY open without O_NONBLOCK
    paths["world-writable"] = _write(os.path.join(shm_dir, "objcomm-open"), b"w" * size, mode=0o666)
    if os.geteuid() == 0:
        paths["other-user"] = _write(os.path.join(shm_dir, "objcomm-other"), b"o" * size)
        os.chown(paths["other-user"], NOBODY, NOBODY)
    outcomes = run_in_child(read_planted, paths, size, timeout=60)
    why = {
        "symlink": "symbolic link",
        "dangling": "symbolic link",
        "fifo": "not a regular file",
        "world-writable": "writable by group or others",
        "other-user": f"belongs to uid {NOBODY}",
    }
    for kind, (kind_of_outcome, message) in outcomes.items():
        assert kind_of_outcome == "FrameError" and why[kind] in message, (kind, kind_of_outcome, message)
    with open(secret, "rb") as handle:
        assert handle.read() == b"s" * size


# -- attack 2: a segment shorter than announced, or shrunk while it is read ------------------------------
def read_shrinking(path: str, size: int, keep: int) -> Tuple[str, str]:
    """Read ``path``; between the size check and the tensor bytes, the file shrinks to ``keep`` bytes."""

    def sizes_of(view: memoryview) -> List[int]:
        os.truncate(path, keep)  # what a hostile or buggy writer can do at the worst moment
        return [size]

    try:
        _read(path, size, sizes_of)
        return "read", ""
    except Exception as exc:
        return type(exc).__name__, str(exc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "size, keep", [(1 << 16, 0), (1 << 16, 4097), (16 << 20, 9 << 20)], ids=["to-nothing", "mid-page", "threaded-read"]
)
def test_segment_shrunk_while_read_is_a_frame_error_not_sigbus(shm_dir, size, keep):
    path = _write(os.path.join(shm_dir, "objcomm-shrinks"), bytes(size))
    kind, message = run_in_child(read_shrinking, path, size, keep, timeout=60)  # ChildCrashed: SIGBUS
    assert kind == "FrameError" and "truncated while being read" in message, (kind, message)


def read_outcome(path: str, size: int) -> Tuple[str, str]:
    return _outcome(path, size)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("found", [0, 100, (1 << 16) - 1])
def test_segment_smaller_than_announced_is_refused(shm_dir, found):
    path = _write(os.path.join(shm_dir, "objcomm-short"), bytes(found))
    kind, message = run_in_child(read_outcome, path, 1 << 16, timeout=60)
    assert kind == "FrameError" and f"holds {found:,} bytes, the sender announced {1 << 16:,}" in message, message


def test_frame_announcing_more_than_the_segment_holds_is_refused(shm_dir):
    path = _write(os.path.join(shm_dir, "objcomm-lies"), bytes(100))
    with pytest.raises(objcomm.FrameError, match="announces 1,000,000,000 bytes of tensors"):
        _segments.read_segment(path, 100, memoryview(b""), 0, lambda view: [10**9])  # never allocated


@pytest.mark.timeout(60)
def test_segment_reads_back_exactly_in_threaded_pieces(shm_dir):
    sizes = [(9 << 20) + 3, 0, 5]  # the first is read in pieces on several threads where torch has them
    data = torch.randint(0, 256, (sum(sizes) + 100,), dtype=torch.uint8)
    path = _write(os.path.join(shm_dir, "objcomm-big"), bytes(data.numpy()))
    got = _segments.read_segment(path, data.numel(), None, 100, lambda view: sizes)
    assert bytes(got.frame) == bytes(data[:100].numpy())
    assert [bytes(t.numpy()) for t in got.tensors] == [bytes(p.numpy()) for p in data[100:].split(sizes)]


def test_writer_creates_private_files_and_never_follows_a_planted_link(shm_dir, tmp_path):
    victim = _write(str(tmp_path / "victim"), b"keep")
    planted = os.path.join(shm_dir, "objcomm-planted")
    os.symlink(victim, planted)
    with pytest.raises(FileExistsError):
        _segments.SegmentBook().create(planted, memoryview(b"overwrite"), [])
    assert os.path.islink(planted) and open(victim, "rb").read() == b"keep"
    old_umask = os.umask(0)
    try:
        segment = _segments.SegmentBook().create(os.path.join(shm_dir, "objcomm-mine"), memoryview(b"data"), [])
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.lstat(segment.path).st_mode) == 0o600
    segment.release()
    assert os.listdir(shm_dir) == ["objcomm-planted"]


# -- attacks 1 and 2 end to end: rank 0 tampers with its segment before rank 1 reads it -----------------
def _tamper(path: str, how: str, decoy: str) -> None:
    if how == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    else:  # a link to a copy of the same bytes: only the link gives it away
        shutil.copyfile(path, decoy)
        os.unlink(path)
        os.symlink(decoy, path)


def _big(tag: int) -> Dict[str, Any]:
    return {"tag": tag, "blob": bytes([tag]) * 4 * THRESHOLD, "t": torch.arange(5000, dtype=torch.float32) + tag}


def _same(got: Any, tag: int) -> bool:
    return got["tag"] == tag and got["blob"] == bytes([tag]) * 4 * THRESHOLD and torch.equal(got["t"], _big(tag)["t"])


def tampered_then_clean(directory: str, decoy: str, how: str, op: str) -> Dict[str, Any]:
    """One call where rank 0 tampers with the segment it wrote, then clean calls on the same group."""
    rank = dist.get_rank()
    files = dict(shm_threshold=THRESHOLD, shm_dir=directory, shm_zero_copy=False)
    comm = plain = objcomm.Communicator(**files)
    names: List[str] = []

    def call(tag: int) -> Any:
        if op == "broadcast":
            return comm.broadcast(_big(tag) if rank == 0 else None, src=0)
        if op == "all_gather":
            return comm.all_gather(_big(tag + rank))[1 - rank]
        if rank == 0:
            return comm.send(_big(tag), 1)
        return comm.recv(0)

    class Tampering(_segments.SegmentBook):
        def create(self, path: str, frame: Optional[memoryview], tensors: Any) -> Any:
            segment = super().create(path, frame, tensors)
            names.append(os.path.basename(path))
            _tamper(path, how, decoy)
            return segment

    error: Optional[Tuple[str, str]] = None
    if rank == 0:
        comm = objcomm.Communicator(**files, _hooks=Hooks(segments=Tampering()))  # call() uses it
    try:
        call(1)
    except objcomm.ObjcommError as exc:
        error = (type(exc).__name__, str(exc))
    finally:
        comm = plain
    after = call(2)
    clean = op == "send" and rank == 0 or _same(after, 2 if op != "all_gather" else 2 + (1 - rank))
    dist.barrier()  # writers unlink once their readers are done, maybe just after those return
    return {"error": error, "clean": clean, "names": names, "left": os.listdir(directory)}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("op", ["broadcast", "all_gather", "send"])
@pytest.mark.parametrize("how", ["truncate", "symlink"])
def test_tampered_segment_is_refused_and_the_group_stays_usable(shm_dir, tmp_path, how, op):
    writer, reader = get_pool(2).run(tampered_then_clean, shm_dir, str(tmp_path / "decoy"), how, op)
    assert writer["error"] is None  # the writer's call completes; the refusing reader raises alone
    assert reader["error"] is not None and reader["error"][0] == "FrameError", reader["error"]
    assert "shared-memory segment" in reader["error"][1] and "refused" in reader["error"][1]
    assert writer["clean"] and reader["clean"]
    assert writer["left"] == reader["left"] == []
    host, namespace = f"{_hosts.host_key():016x}", str(os.stat("/proc/self/ns/pid").st_ino)
    assert [name.split("-")[1:3] for name in writer["names"]] == [[host, namespace]], writer["names"]


# -- attack 3: sweep as root --------------------------------------------------------------------------
def _segment_name(pid: int, host: Optional[int] = None, namespace: Optional[int] = None) -> str:
    """A name in the documented format: objcomm-<host>-<pidns>-<token>-<pid>-<seq>-<part>."""
    host = _hosts.host_key() if host is None else host
    namespace = os.stat("/proc/self/ns/pid").st_ino if namespace is None else namespace
    return f"objcomm-{host:016x}-{namespace}-{0xABC:016x}-{pid}-1-0"


@pytest.mark.timeout(60)
def test_sweep_removes_only_our_regular_files_of_dead_writers_here(tmp_path):
    folder, elsewhere = tmp_path / "shm", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        victim = _write(str(elsewhere / "victim"), b"precious")
        stale = _segment_name(dead.pid)
        kept = {
            "live writer": _segment_name(live.pid),
            "this process": _segment_name(os.getpid()),
            "other pid namespace": _segment_name(dead.pid, namespace=os.stat("/proc/self/ns/pid").st_ino + 1),
            "other host": _segment_name(dead.pid, host=_hosts.host_key() ^ 1),
        }
        for name in [stale, *kept.values()]:
            _write(str(folder / name), b"x")
        kept["symlink"] = _segment_name(dead.pid).replace("-1-0", "-2-0")
        os.symlink(victim, folder / kept["symlink"])
        kept["directory"] = _segment_name(dead.pid).replace("-1-0", "-3-0")
        (folder / kept["directory"]).mkdir()
        if os.geteuid() == 0:
            kept["other user"] = _segment_name(dead.pid).replace("-1-0", "-4-0")
            os.chown(_write(str(folder / kept["other user"]), b"x"), NOBODY, NOBODY)
        assert _segments.sweep(str(folder)) == [stale]
        assert sorted(os.listdir(folder)) == sorted(kept.values())
        assert open(victim, "rb").read() == b"precious"
    finally:
        live.kill()
        live.wait()


@pytest.mark.timeout(60)
def test_sweep_leaves_names_that_do_not_say_host_and_pid_namespace(tmp_path):
    """Names as objcomm wrote them before (``objcomm-<token>-<pid>-<seq>-<part>``) carry no pid namespace:
    a pid dead here may live in another, so they are left alone (and a root sweep never takes other users' files)."""
    folder = tmp_path / "shm"
    folder.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = [f"objcomm-{0:016x}-{dead.pid}-{seq}-0" for seq in (1, 2, 3)]
    _write(str(folder / names[0]), b"x")  # ours, pid dead here: maybe alive in the namespace that wrote it
    os.symlink(_write(str(tmp_path / "victim"), b"precious"), folder / names[1])
    if os.geteuid() == 0:
        os.chown(_write(str(folder / names[2]), b"x"), NOBODY, NOBODY)
    else:
        names.pop()
    assert _segments.sweep(str(folder)) == []
    assert sorted(os.listdir(folder)) == names


def test_segment_names_round_trip(shm_dir):
    writer = _segments._me(0x1234)
    path = _segments._name(shm_dir, writer, 7, 3)
    assert os.path.basename(path) == _segment_name(os.getpid()).replace(f"{0xABC:016x}", f"{0x1234:016x}").replace(
        "-1-0", "-7-3"
    )
    assert _segments._parse(os.path.basename(path)) == writer
    for name in ("objcomm-0000000000000000-1-1-0", "objcomm-test-abc", "objcomm-" + "-".join(["x"] * 6), "other"):
        assert _segments._parse(name) is None


# -- found by attacking the fixes ----------------------------------------------------------------


def test_a_directory_planted_at_a_segment_name_does_not_stop_the_writer_releasing(shm_dir):
    first = _segments.SegmentBook().create(os.path.join(shm_dir, "objcomm-a"), memoryview(b"one"), [])
    second = _segments.SegmentBook().create(os.path.join(shm_dir, "objcomm-b"), memoryview(b"two"), [])
    os.unlink(first.path)
    os.mkdir(first.path)  # another process of this user replaced the file
    for segment in (first, second):
        segment.release()  # no IsADirectoryError; the next segment is still released
    assert os.path.isdir(first.path) and not os.path.exists(second.path)


def test_sweep_does_nothing_when_the_pid_namespace_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(_hosts, "pid_namespace", lambda: 0)  # /proc not mounted: pids prove nothing
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = _segments._name(str(tmp_path), _segments._me(1)._replace(pid=dead.pid, pid_namespace=0), 1, 0)
    open(stale, "wb").close()
    assert _segments.sweep(str(tmp_path)) == [] and os.path.exists(stale)


_MAIN_THREAD_EXITS = """
import ctypes, sys, threading, time
threading.Thread(target=lambda: (time.sleep(20), sys.exit(0))).start()
print("ready", flush=True)
time.sleep(0.5)
ctypes.CDLL(None).pthread_exit(None)  # the main thread leaves; the process lives on in the other
"""


def test_a_writer_whose_main_thread_exited_is_still_alive():
    proc = subprocess.Popen([sys.executable, "-c", _MAIN_THREAD_EXITS], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{proc.pid}/status") as status:
                if "State:\tZ" in status.read():
                    break
            time.sleep(0.05)
        assert _segments._alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not _segments._alive(proc.pid)
