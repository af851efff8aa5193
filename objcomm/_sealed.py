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
writer and the other readers see nothing. Anything else is refused: a descriptor that is not a
regular file of this user, a file without the seals, or one shorter than its layout needs.

Lifetime: the writer closes its descriptor at the end of the call; the memory lives on while any
reader still holds a view of it, and is freed when the last one goes (the views keep the mapping
alive). Nothing is ever left in a file system, whatever happens to the processes.

Layout: the frame at offset 0 (``length`` bytes, when not inline), then each non-empty tensor at
the next multiple of 64 bytes (:func:`layout`), so views of any dtype are aligned.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ._errors import FrameError
from ._wire import Incoming

ALIGN = 64
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # /proc/<pid>/fd/<n> is a link to follow


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


def write_sealed(name: str, frame: Optional[memoryview], pieces: Sequence[memoryview]) -> SealedSegment:
    """A new sealed memory file holding ``frame`` then ``pieces`` (laid out by :func:`layout`).

    Plain writes, not a mapping: the kernel fills the pages without a fault per page, and the write
    seal needs no writable mapping to exist. Raises ``OSError`` where memory files are unavailable.
    """
    create = getattr(os, "memfd_create", None)
    if create is None:
        raise OSError(errno.ENOSYS, "memfd_create is not available on this platform")
    start = frame.nbytes if frame is not None else 0
    offsets, end = layout(start, [piece.nbytes for piece in pieces])
    fd = create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, end)
        if frame is not None:
            _write_at(fd, frame, 0)
        for offset, piece in zip(offsets, pieces):
            _write_at(fd, piece, offset)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return SealedSegment(fd)


def _write_at(fd: int, piece: memoryview, offset: int) -> None:
    done = 0
    while done < piece.nbytes:
        done += os.pwrite(fd, piece[done:], offset + done)


def map_sealed(
    where: Sealed, size: int, inline: Optional[memoryview], length: int, sizes_of: Callable[[memoryview], List[int]],
) -> Incoming:
    """The frame (unless round 1 carried it ``inline``; ``length`` bytes) and tensors a writer sealed at
    ``where``, as views on a private mapping. ``size``: the bytes the sender announced (frame and
    tensors, without alignment). Raises ``FrameError`` for a file to refuse (see the module
    docstring), ``OSError`` for one that cannot be opened (the writer is gone, /proc is not there)."""
    fd = os.open(where.path, _OPEN_FLAGS)
    try:
        held = _check_sealed(fd, where).st_size
        # Tensors need at most ALIGN - 1 bytes of padding each, and each takes bytes of the frame's table.
        most = size + ALIGN * (length + 1)
        if not size <= held <= most or (inline is None and length > size):
            raise FrameError(f"sealed segment {where.path} holds {held:,} bytes for the {size:,} the sender "
                             "announced; refused")
        mapping = mmap.mmap(fd, held, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) if held else None
    finally:
        os.close(fd)
    whole = memoryview(mapping if mapping is not None else b"")
    frame = inline if inline is not None else whole[:length]
    position = 0 if inline is not None else length
    sizes = sizes_of(frame)
    if sum(sizes) != size - position:
        raise FrameError(f"sealed segment {where.path}: its frame announces {sum(sizes):,} bytes of tensors, "
                         f"the sender announced {size - position:,}; refused")
    offsets, end = layout(position, sizes)
    if end != held:
        raise FrameError(f"sealed segment {where.path} holds {held:,} bytes, its layout needs {end:,}; refused")
    tensors = [torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=o) if n  # type: ignore[arg-type]
               else torch.empty(0, dtype=torch.uint8) for o, n in zip(offsets, sizes)]
    return Incoming(frame, tensors)


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
    if problem:
        raise FrameError(f"sealed segment {where.path} {problem}; refused")
    return found
