"""Sealed segments: second-round bytes in a sealed memory file, received as views (zero copy).

The writer puts its frame (unless round 1 carried it) and its out-of-band tensors into an anonymous
memory file (``memfd_create``), then seals it against writes, shrinking and growing
(``F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW``, and ``F_SEAL_SEAL``). It announces the descriptor
number; readers on the same host and in the same pid namespace open ``/proc/<writer pid>/fd/<fd>``
and map the file privately (``MAP_PRIVATE``, readable and writable): the tensors, numpy arrays and
the frame they get are views on that mapping, with no copy.

Why this is safe where a mapping of a ``/dev/shm`` file is not (:mod:`objcomm._segments` copies
those): the seals are checked by the reader before mapping, and once set they cannot be removed, so
the writer can neither change nor truncate what a reader holds (no SIGBUS, no data changing under a
result). A reader that writes into its result gets its own copy of that page (copy on write); the
writer and the other readers see nothing. Anything else is refused (:class:`~objcomm.FrameError`): a
descriptor that is not a regular file of this user (it is opened ``O_PATH`` first, so no device or
terminal it names is ever opened), a file without the seals or not on ordinary shared memory (huge
pages), or one whose size is not exactly what its frame lays out (checked before it is mapped).

Lifetime: the writer closes its descriptor at the end of the call; the memory lives on while any
reader still holds a view of it, and is freed when the last one goes (the views keep the mapping
alive). Nothing is ever left in a file system, whatever happens to the processes.

Layout: the frame at offset 0 (``length`` bytes, when not inline), then each non-empty tensor at
the next multiple of 64 bytes (:func:`layout`), so views of any dtype are aligned.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import mmap
import os
import stat
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ._errors import FrameError
from ._wire import Incoming

ALIGN = 64
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY  # of a regular file (see _open_regular)
TMPFS_MAGIC = 0x01021994  # statfs f_type of shared memory (memfd, /dev/shm); hugetlbfs and others are refused


class Sealed(NamedTuple):
    """Where a sealed segment is: its writer's pid and the descriptor holding it in that process."""

    pid: int
    fd: int

    @property
    def path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"


class SealedSegment:
    """A sealed memory file this process wrote; :meth:`release` closes it (readers' views keep its memory)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def layout(position: int, sizes: Sequence[int]) -> Tuple[List[int], int]:
    """Each tensor's offset when they follow ``position`` bytes, non-empty ones aligned to :data:`ALIGN`; the end."""
    offsets = []
    for size in sizes:
        if size:
            position = -(-position // ALIGN) * ALIGN
        offsets.append(position)
        position += size
    return offsets, position


def frame_parts(frame: Any) -> List[memoryview]:
    """A frame given as one buffer, as its parts, or None (round 1 carried it), as a list of byte views."""
    if frame is None:
        return []
    if isinstance(frame, (memoryview, bytes, bytearray)):
        return [memoryview(frame).cast("B")]
    return [memoryview(part).cast("B") for part in frame]


def write_sealed(name: str, frame: Any, pieces: Sequence[memoryview]) -> SealedSegment:
    """A new sealed memory file holding ``frame`` (one buffer, its parts, or None) then ``pieces`` (laid
    out by :func:`layout`).

    Plain writes, not a mapping: the kernel fills the pages without a fault per page, and the write
    seal needs no writable mapping to exist. Raises ``OSError`` where memory files are unavailable.
    """
    create = getattr(os, "memfd_create", None)
    if create is None:
        raise OSError(errno.ENOSYS, "memfd_create is not available on this platform")
    head = frame_parts(frame)
    offsets, end = layout(sum(part.nbytes for part in head), [piece.nbytes for piece in pieces])
    fd = create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, end)
        for offset, part in zip(_consecutive(head), head):
            _write_at(fd, part, offset)
        for offset, piece in zip(offsets, pieces):
            _write_at(fd, piece, offset)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return SealedSegment(fd)


def _consecutive(parts: Sequence[memoryview]) -> List[int]:
    """The offsets of ``parts`` laid back to back from 0."""
    offsets, at = [], 0
    for part in parts:
        offsets.append(at)
        at += part.nbytes
    return offsets


def _write_at(fd: int, piece: memoryview, offset: int) -> None:
    done = 0
    while done < piece.nbytes:
        done += os.pwrite(fd, piece[done:], offset + done)


class Unopenable(OSError):
    """A sealed segment this process cannot open: the writer is gone, or ``/proc/<pid>/fd`` is closed to it
    (another pid namespace, a locked-down ``/proc``). The call falls back, and the group uses files after."""


def map_sealed(
    where: Sealed, size: int, inline: Optional[memoryview], length: int, sizes_of: Callable[[memoryview], List[int]],
) -> Incoming:
    """The frame (unless round 1 carried it ``inline``; ``length`` bytes) and tensors a writer sealed at
    ``where``, as views on a private mapping. ``size``: the bytes the sender announced (frame and
    tensors, without alignment). Raises ``FrameError`` for a file to refuse (see the module
    docstring), :class:`Unopenable` for one that cannot be opened, ``OSError`` from ``sizes_of``.

    What the announced descriptor names is first opened ``O_PATH`` (no driver is opened: a terminal
    cannot become this process's controlling terminal) and must be a regular file before it is
    opened for reading, through that pinned descriptor. Nothing is mapped before the file's size is
    known to be exactly what the frame lays out; the frame is parsed from a mapping of its own bytes."""
    fd = _open_regular(where)
    try:
        held = _check_sealed(fd, where).st_size
        position = 0 if inline is not None else length
        if held < size or position > size or (inline is None and not length):
            raise FrameError(f"sealed segment {where.path} holds {held:,} bytes for the {size:,} (frame: "
                             f"{length:,}) the sender announced; refused")
        if inline is None:
            prefix = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
            sizes = sizes_of(memoryview(prefix))
            del prefix  # unmapped when the last view of it goes (sizes_of keeps none)
        else:
            sizes = sizes_of(inline)
        if sum(sizes) != size - position:
            raise FrameError(f"sealed segment {where.path}: its frame announces {sum(sizes):,} bytes of tensors, "
                             f"the sender announced {size - position:,}; refused")
        offsets, end = layout(position, sizes)
        if end != held:
            raise FrameError(f"sealed segment {where.path} holds {held:,} bytes, its layout needs {end:,}; refused")
        mapping = mmap.mmap(fd, held, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) if held else None
    finally:
        os.close(fd)
    frame = inline if inline is not None else memoryview(mapping)[:length]  # type: ignore[arg-type]
    tensors = [torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=o) if n  # type: ignore[arg-type]
               else torch.empty(0, dtype=torch.uint8) for o, n in zip(offsets, sizes)]
    return Incoming(frame, tensors)


def _open_regular(where: Sealed) -> int:
    """``where`` opened for reading, once it is known to be a regular file of this user (else FrameError)."""
    try:
        pinned = os.open(where.path, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise Unopenable(exc.errno, f"cannot open sealed segment {where.path}: {exc.strerror}") from exc
    try:
        problem = foreign(os.fstat(pinned))
        if problem:
            raise FrameError(f"sealed segment {where.path} {problem}; refused")
        try:
            return os.open(f"/proc/self/fd/{pinned}", _OPEN_FLAGS)
        except OSError as exc:
            raise Unopenable(exc.errno, f"cannot open sealed segment {where.path}: {exc.strerror}") from exc
    finally:
        os.close(pinned)


def foreign(found: os.stat_result) -> str:
    """What makes a segment's file one this user's writer could not have made: not a regular file, or
    another user's; "" when neither."""
    if not stat.S_ISREG(found.st_mode):
        return "is not a regular file"
    if found.st_uid != os.geteuid():
        return f"belongs to uid {found.st_uid}, not to this process's uid {os.geteuid()}"
    return ""


def _check_sealed(fd: int, where: Sealed) -> os.stat_result:
    """Refuse what is not a sealed memory file of this user (its mode says nothing: the seals forbid writes)."""
    found = os.fstat(fd)
    problem = foreign(found)
    if not problem:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if seals & SEALS != SEALS:
            problem = "is not sealed against writing and resizing"
        elif _filesystem(fd) != TMPFS_MAGIC:  # e.g. huge pages: a private mapping would draw on their pool
            problem = "is not ordinary shared memory (a memory file of huge pages, ...)"
    if problem:
        raise FrameError(f"sealed segment {where.path} {problem}; refused")
    return found


class _StatFs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 256)]  # only the type is read


@functools.lru_cache(maxsize=1)
def _fstatfs() -> Optional[Callable[..., int]]:
    try:
        call = ctypes.CDLL(None, use_errno=True).fstatfs
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.POINTER(_StatFs)]
    return call  # type: ignore[no-any-return]


def _filesystem(fd: int) -> Optional[int]:
    """The ``f_type`` of the file system holding ``fd`` (``fstatfs``), or None where it cannot be learned."""
    call, found = _fstatfs(), _StatFs()
    if call is None or call(fd, ctypes.byref(found)) != 0:
        return None
    return found.f_type & 0xFFFFFFFF
