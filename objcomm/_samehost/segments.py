"""Shared-memory segment files: writing, reading, naming, and clearing what dead writers left.

A segment is one file in the shared-memory directory (``/dev/shm``) holding a sender's second-round
bytes: its frame (unless round 1 carried it inline), then its out-of-band tensors, back to back. Its
writer creates it (:class:`_Segment`), readers copy it into fresh memory (:func:`read_segment`), and
the writer unlinks it. When and for whom segments are written is :mod:`objcomm._samehost.shm`'s business.

The file system is not trusted. Writers create segments with ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode
0600, and announce the file's identity (:func:`identity`: a digest of its device, inode and bytes) with its
sequence number; they keep the file open until they unlink it, so no other file can get that inode meanwhile.
Readers open with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO cannot block them) and refuse a link, a file
that is not regular, is another user's, is writable by group or others, or is not the announced size
(``fstat`` of the opened descriptor: a file renamed over the name, even at the last moment, is caught), and
what they read when it is not what was written (its identity, over the bytes read: another file at the name, or
bytes a process of the same user changed in place after they were written). Nothing is mapped, so a file
truncated while read gives a short read (refused), never SIGBUS.

Names are ``objcomm-<host>-<pidns>-<token>-<pid>-<seq>-<part>``: ``host``, 16 hex digits, is
:func:`objcomm._samehost.hosts.host_key` of the writer's host; ``pidns`` the decimal inode number of its pid
namespace (``/proc/self/ns/pid``, 0 if unknown); ``token``, 16 hex digits, is per job (learnt with the group's
hosts: :mod:`objcomm._samehost.hosts`; for send/recv, per sending process); ``pid`` the writer's, in that
namespace; ``seq`` a counter per writer; ``part`` the receiving rank for scatter, else 0.

Segments are unlinked by their writer (:meth:`_Segment.release`, which callers run in a ``finally``)
and at interpreter exit. A :class:`SegmentBook` keeps what a process needs for that (the paths it
owns, its sequence counter and token); the process's own is :data:`SEGMENTS`, and
tests pass their own. Those of writers that died (SIGKILL) are removed by :func:`sweep`: regular
files (links are never followed) of this user, named with this host's key and this pid namespace
(elsewhere a pid proves nothing), whose writer pid is dead. Anything else, older objcomm names
included, it leaves alone.

This module imports neither :mod:`objcomm._samehost.shm` nor :mod:`objcomm._transport.rounds`: what it shares with
them (``Incoming``) comes from the leaf :mod:`objcomm._transport.base`.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import itertools
import logging
import os
import re
import secrets
import stat
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Set

import torch

from objcomm._errors import FrameError
from objcomm._format.message import Incoming
from objcomm._format.rest import host_bytes
from objcomm._samehost import hosts as _hosts
from objcomm._samehost import mounts
from objcomm._samehost.sealed import SealedSegment, foreign, frame_parts, write_sealed

log = logging.getLogger("objcomm")

DEFAULT_DIRECTORY = "/dev/shm"
PREFIX = "objcomm-"

_NAME = re.compile(re.escape(PREFIX) + r"([0-9a-f]{16})-([0-9]{1,20})-([0-9a-f]{16})-([0-9]{1,10})-[0-9]+-[0-9]+")
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_PARALLEL_PIECE = 4 << 20  # reads of this many bytes per thread, at least


# -- writing and reading ------------------------------------------------------------------------
class SegmentBook:
    """What one process keeps about the segments it writes: the paths not unlinked yet (removed at
    exit), a sequence counter and a random token for names. Subclass it to watch or tamper in tests."""

    def __init__(self) -> None:
        self.token = secrets.randbits(63)  # names send/recv segments (no group-wide agreement there)
        self._owned: Set[str] = set()
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._at_exit = False

    def next_seq(self) -> int:
        return next(self._seq)

    def create(self, path: str, frame: Any, tensors: Sequence[torch.Tensor]) -> _Segment:
        """Write ``frame`` (one buffer, its parts, or None) then ``tensors`` into a new file. Plain writes,
        not a mapping: a full filesystem raises ENOSPC here instead of SIGBUS, and the kernel fills pages
        faster than faults do. ``O_EXCL | O_NOFOLLOW``: whatever already sits at the name (a planted
        link) makes this fail."""
        head = frame_parts(frame)
        size = sum(part.nbytes for part in head) + sum(t.numel() for t in tensors)
        _check_space(os.path.dirname(path), size)
        fd = os.open(path, _CREATE_FLAGS, 0o600)
        self._track(path)
        try:
            pieces = head + [host_bytes(t) for t in tensors if t.numel()]
            for piece in pieces:
                while piece.nbytes:
                    piece = piece[os.write(fd, piece) :]
            return _Segment(path, self, fd, identity(os.fstat(fd), pieces))  # keeps fd: see the module docstring
        except BaseException:
            os.close(fd)
            self.unlink(path)
            raise

    def create_sealed(self, frame: Any, tensors: Sequence[torch.Tensor]) -> SealedSegment:
        """Write ``frame`` then ``tensors`` into a new sealed memory file (:mod:`objcomm._samehost.sealed`); nothing to
        track: the file has no name, and goes when its writer closes it and the last reader drops its views."""
        return write_sealed(f"{PREFIX}{self.token:016x}", frame, [host_bytes(t) for t in tensors])

    def unlink(self, path: str) -> None:
        """Remove a segment this process wrote; whatever another process put at its name stays (and is logged)."""
        with self._lock:
            self._owned.discard(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # e.g. a directory planted at the name: not ours any more
            log.warning("objcomm shm: could not remove segment %s: %s", path, exc)

    def unlink_all(self) -> None:
        with self._lock:
            owned = list(self._owned)
        for path in owned:
            self.unlink(path)

    def _track(self, path: str) -> None:
        with self._lock:
            self._owned.add(path)
            if not self._at_exit:
                atexit.register(self.unlink_all)
                self._at_exit = True


class _Segment:
    """One file in the shared-memory directory, written with ``write(2)`` by its owner, who unlinks it.
    ``identity``: what readers check the file they open against (:func:`identity`). The owner keeps ``fd``
    open until :meth:`release`: while it is, no other file can take the inode, so the identity stays unique."""

    def __init__(self, path: str, book: SegmentBook, fd: int, identity: int) -> None:
        self.path, self.book, self.fd, self.identity = path, book, fd, identity

    def release(self) -> None:
        try:
            self.book.unlink(self.path)
        finally:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


class SegmentFile(NamedTuple):
    """Where a segment file is, and the identity its writer announced (:func:`identity`)."""

    path: str
    identity: int


def identity(found: os.stat_result, content: Sequence[Any] = ()) -> int:
    """A segment's identity as one positive int64 word (never 0): 63 bits of a SHA-256 of its device, its inode and
    its bytes (``content``: buffers, back to back), so that a reader refuses another file at the name and bytes
    changed in place after they were written alike."""
    digest = _Digest(found)
    for piece in content:
        digest.update(piece)
    return digest.word()


class _Digest:
    """:func:`identity`, fed piece by piece as a reader reads."""

    def __init__(self, found: os.stat_result) -> None:
        self._hash = hashlib.sha256(struct.pack("<QQ", found.st_dev, found.st_ino))

    def update(self, piece: Any) -> None:
        self._hash.update(piece)

    def word(self) -> int:
        return int.from_bytes(self._hash.digest()[:8], "little") >> 1 or 1


def read_segment(
    path: str,
    size: int,
    inline: Optional[memoryview],
    length: int,
    sizes_of: Callable[[memoryview], List[int]],
    expected: Optional[int] = None,
) -> Incoming:
    """The frame (unless round 1 carried it ``inline``; ``length`` bytes) and tensors a writer put at ``path``,
    copied into fresh memory. ``size``: the bytes the sender announced; ``expected``: the identity it announced
    (None: not checked). Raises ``FrameError`` for a segment to refuse (see the module docstring), ``OSError``
    for one that cannot be opened (e.g. it is gone)."""
    fd = _opened(path)
    try:
        digest = _Digest(_check_segment(fd, path, size))
        position = 0
        if inline is None:
            frame = memoryview(bytearray(length))
            _read_exactly(fd, frame, 0, path, size)
            digest.update(frame)
            position = length
        else:
            frame = inline
        sizes = sizes_of(frame)
        if sum(sizes) != size - position:
            raise FrameError(
                f"shared-memory segment {path}: its frame announces {sum(sizes):,} bytes of tensors, "
                f"the sender announced {size - position:,}; refused"
            )
        tensors = []
        for n in sizes:
            tensor = torch.empty(n, dtype=torch.uint8)
            if n:
                _read_exactly(fd, tensor.numpy().data, position, path, size)
                digest.update(tensor.numpy().data)
            tensors.append(tensor)
            position += n
    finally:
        os.close(fd)
    if expected is not None and digest.word() != expected:
        raise FrameError(
            f"shared-memory segment {path} is not what its writer wrote (another file was put at its name, or its "
            "bytes were changed after they were written: the digest of its device, inode and bytes differs from the "
            "one the writer announced); refused"
        )

    return Incoming(frame, tensors)


def _opened(path: str) -> int:
    """``path`` opened for reading, once it is known to lie on its directory's mount and not to be a symbolic link
    (else ``FrameError``): pinned with ``O_PATH`` first, so that nothing asks the file system of a mount put at its
    name (:mod:`objcomm._samehost.mounts`)."""
    pinned = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        folder = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if mounts.elsewhere(pinned, mounts.mount_of(folder)):
                raise FrameError(f"shared-memory segment {path} lies on another mount than its directory; refused")
        finally:
            os.close(folder)
        if stat.S_ISLNK(os.fstat(pinned).st_mode):
            raise FrameError(f"shared-memory segment {path} is a symbolic link; refused")
        try:
            return os.open(f"/proc/self/fd/{pinned}", _READ_FLAGS & ~os.O_NOFOLLOW)
        except FileNotFoundError:  # no /proc (a chroot): by its name, as before (nor could its mount be read)
            return os.open(path, _READ_FLAGS)
    finally:
        os.close(pinned)


def _check_segment(fd: int, path: str, size: int) -> os.stat_result:
    """Refuse what a writer of this user could not have made (see :func:`read_segment`); what ``fstat`` found."""
    found = os.fstat(fd)  # of what was opened: a file renamed over the name after this cannot slip in
    problem = foreign(found)
    if not problem and found.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(found.st_mode):04o})"
    if not problem and found.st_size != size:
        problem = f"holds {found.st_size:,} bytes, the sender announced {size:,}"
    if problem:
        raise FrameError(f"shared-memory segment {path} {problem}; refused")
    return found


def _read_exactly(fd: int, view: memoryview, offset: int, path: str, size: int) -> None:
    """Fill ``view`` from ``offset``; big reads in pieces on several threads, as torch's own copies run."""
    pieces = min(torch.get_num_threads(), view.nbytes // _PARALLEL_PIECE)
    if pieces < 2:
        return _read_piece(fd, view, offset, path, size)
    step = -(-view.nbytes // pieces)
    with ThreadPoolExecutor(pieces) as pool:  # os.preadv releases the GIL
        list(
            pool.map(
                lambda start: _read_piece(fd, view[start : start + step], offset + start, path, size),
                range(0, view.nbytes, step),
            )
        )


def _read_piece(fd: int, view: memoryview, offset: int, path: str, size: int) -> None:
    done = 0
    while done < view.nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:  # the file shrank after the size check: a short read, where a mapping would SIGBUS
            raise FrameError(
                f"shared-memory segment {path} ended at byte {offset + done:,} of the {size:,} the "
                "sender announced: it was truncated while being read; refused"
            )
        done += got


def _check_space(directory: str, size: int) -> None:
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    if size > free:
        raise OSError(f"{directory} has {free:,} bytes free, {size:,} are needed")


# -- names -------------------------------------------------------------------------------------
class _Writer(NamedTuple):  # who wrote a segment, as its name says
    host: int
    pid_namespace: int
    token: int
    pid: int


@functools.lru_cache(maxsize=1)
def _this_host() -> int:
    return _hosts.host_key()


def _pid_namespace() -> int:
    return _hosts.pid_namespace()


def _name(directory: str, writer: _Writer, seq: int, part: int) -> str:
    host, namespace, token, pid = writer
    return os.path.join(directory, f"{PREFIX}{host:016x}-{namespace}-{token:016x}-{pid}-{seq}-{part}")


def _me(token: int) -> _Writer:
    return _Writer(_this_host(), _pid_namespace(), token, os.getpid())


def _parse(name: str) -> Optional[_Writer]:
    """The writer a segment name carries, or None for anything else (other files, older objcomm names)."""
    found = _NAME.fullmatch(name)
    return _Writer(int(found[1], 16), int(found[2]), int(found[3], 16), int(found[4])) if found else None


_PF_EXITING = 0x4  # a task's flag (the ninth field of /proc/<pid>/task/<tid>/stat) from the start of its exit


def _alive(pid: int) -> bool:
    """Whether process ``pid`` lives: not once every thread of it has begun to exit. A killed but unreaped process
    (a zombie) is dead, and so is one on its way out, which closes its sockets (what its peers see when they raise
    and sweep) before it is a zombie: a helper's find, a SIGKILLed writer's file outlived that sweep in 9 runs of 10.
    A main thread that exits alone while others run is not the process's end: every thread is looked at."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return False  # gone meanwhile
    except OSError:
        return True
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/stat") as handle:
                after_name = handle.read().rsplit(")", 1)[1].split()  # (the name, in parentheses, may hold spaces)
            if not int(after_name[6]) & _PF_EXITING:
                return True
        except (FileNotFoundError, ProcessLookupError):
            continue  # that thread is gone, or going (its stat reads ESRCH while it is reaped)
        except (OSError, ValueError, IndexError):
            return True
    return False


def sweep(directory: str = DEFAULT_DIRECTORY) -> List[str]:
    """Unlink the segments of this user, host and pid namespace whose writing process is gone; return their names.

    Links are never followed, and files of other users, hosts or pid namespaces (whose pids say
    nothing here) are left alone, even when run as root.
    """
    removed: List[str] = []
    if _pid_namespace() == 0:  # unknown (no /proc): a pid here may name another namespace's process
        return removed
    try:
        folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return removed
    try:
        here = (_this_host(), _pid_namespace())
        for name in os.listdir(folder):
            writer = _parse(name)
            if writer is None or (writer.host, writer.pid_namespace) != here or writer.pid == os.getpid():
                continue
            try:
                found = os.stat(name, dir_fd=folder, follow_symlinks=False)
                if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid() or _alive(writer.pid):
                    continue
                os.unlink(name, dir_fd=folder)
                removed.append(name)
            except OSError:
                pass
    finally:
        os.close(folder)
    if removed:
        log.debug("objcomm shm: removed %d stale segment(s) of dead processes from %s", len(removed), directory)
    return removed


# The segments this process wrote and has not unlinked yet (removed at exit), with the counter and token that name
# them: the process's own book (a Communicator may be given another, for tests).
SEGMENTS = SegmentBook()
