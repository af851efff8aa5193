"""Sealed segments: second-round bytes in a sealed memory file, received as views (zero copy).

The writer puts its frame (unless round 1 carried it) and its out-of-band tensors into an anonymous
memory file (``memfd_create``), then seals it against writes, shrinking and growing
(``F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW``, and ``F_SEAL_SEAL``). It announces the descriptor
number; readers on the same host and in the same pid namespace open ``/proc/<writer pid>/fd/<fd>``
and map the file privately (``MAP_PRIVATE``, readable and writable): the tensors and numpy arrays
they get are views on that mapping, with no copy. A ``bytes`` or ``bytearray`` result must own its
memory, so it is copied, with ``pread`` from the file (:class:`Buffers`): copied from the mapping,
the pages it reads would count in the reader's resident set on top of the copy. A small frame is
read the same way; a large one is mapped on its own.

Why this is safe where a mapping of a ``/dev/shm`` file is not (:mod:`objcomm._samehost.segments` copies
those): the seals are checked by the reader before mapping, and once set they cannot be removed, so
the writer can neither change nor truncate what a reader holds (no SIGBUS, no data changing under a
result). A reader that writes into its result gets its own copy of that page (copy on write); the
writer and the other readers see nothing. Anything else is refused (:class:`~objcomm.FrameError`): a
descriptor that is not a regular file of this user (it is opened ``O_PATH`` first, so no device or
terminal it names is ever opened), a file without the seals or not on ordinary shared memory (huge
pages), or one whose size is not exactly what its frame lays out (checked before it is mapped).

Lifetime: the writer closes its descriptor at the end of the call; the memory lives on while any
reader still holds a view of it, and is freed when the last one goes (the views keep the mapping
alive; a reader's :class:`Buffers` keeps its descriptor until what it received is dropped, after
decoding). Nothing is ever left in a file system, whatever happens to the processes.

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
import time
import weakref
from itertools import accumulate
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Union, cast

import torch

from objcomm._errors import FrameError
from objcomm._format.message import Incoming, SizesOf
from objcomm._samehost.mounts import elsewhere, memory_files

ALIGN = 64
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY  # of a regular file (see _open_regular)
MAX_READ = 0x7FFFF000  # the most one read(2) moves on Linux (MAX_RW_COUNT)
READ_FRAME = 1 << 20  # frames up to this size are read, not mapped (see _frame)
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


def table_layout(sizes: Sequence[int], width: int) -> Tuple[List[int], int]:
    """Where each part of a table of ``len(sizes)`` rows of ``abs(width)`` bytes lies, and the table's size: ``width``
    > 0, part ``i`` at the start of row ``i`` (a padded all_gather's); ``width`` < 0, the parts back to back from 0 (a
    stream of stripes', :func:`objcomm._transport.exchange.by_stripes`); 0, :func:`layout`'s (no table). Raises
    ``FrameError`` where the parts do not fit the rows."""
    if not width:
        return layout(0, sizes)
    end = abs(width) * len(sizes)
    if width > 0 and max(sizes, default=0) > width or width < 0 and sum(sizes) > end:
        largest = max(sizes, default=0)
        raise FrameError(f"parts of {sum(sizes):,} bytes (the largest {largest:,}) in rows of {abs(width):,}; refused")
    offsets = [i * width for i in range(len(sizes))] if width > 0 else [0, *accumulate(sizes)][:-1]
    return offsets, end


def frame_parts(frame: Any) -> List[memoryview]:
    """A frame given as one buffer, as its parts, or None (round 1 carried it), as a list of byte views."""
    if frame is None:
        return []
    if isinstance(frame, (memoryview, bytes, bytearray)):
        return [memoryview(frame).cast("B")]
    return [memoryview(part).cast("B") for part in frame]


class SealedTable:
    """A new memory file of ``size`` bytes, mapped writable here so that a collective writes its output into it in
    place (:attr:`tensor`), then sealed (:meth:`seal`) and read as :func:`write_sealed`'s files are: the copy
    :func:`write_sealed` makes of a buffer is never made. Pages are populated at mapping (``MAP_POPULATE``), not
    faulted in one by one, and a forked child does not inherit the mapping (``MADV_DONTFORK``). The mapping is never
    closed by hand: the last view of :attr:`tensor` unmaps it, and the kernel refuses the write seal while it is
    mapped, so no view can outlive its memory. Raises ``OSError`` where memory files are unavailable."""

    def __init__(self, name: str, size: int) -> None:
        create = getattr(os, "memfd_create", None)
        if create is None or not size:
            raise OSError(errno.ENOSYS, "memfd_create is not available on this platform" if size else "empty")
        fd = create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            if hasattr(mmap, "MADV_DONTFORK"):
                mapping.madvise(mmap.MADV_DONTFORK)
        except BaseException:
            os.close(fd)
            raise
        self.fd: Optional[int] = fd
        self._closer = weakref.finalize(self, os.close, fd)  # unless seal() hands the file on
        self.tensor: Optional[torch.Tensor] = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping

    def seal(self, settle: float = 0.5) -> SealedSegment:
        """The file, sealed, once :attr:`tensor` and every view of it are gone, within ``settle`` seconds (a backend's
        worker thread may drop its reference to a collective's output just after the collective returned). Raises
        ``OSError`` (``EBUSY``) if a view is left then; the file stays open here (:meth:`copy_rows`)."""
        assert self.fd is not None
        self.tensor = None
        deadline = time.monotonic() + settle
        while True:
            try:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
                break
            except OSError as exc:  # EBUSY: still mapped writable here, by a view of the table
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.0002)
        self._closer.detach()
        fd, self.fd = self.fd, None
        return SealedSegment(fd)

    def copy_rows(self, sizes: Sequence[int], width: int) -> List[memoryview]:
        """Part ``i`` of ``sizes[i]`` bytes (laid out by :func:`table_layout`), copied from the file into buffers of
        their own (writable, as every rest reaches its decoder): where :meth:`seal` failed."""
        assert self.fd is not None
        rows = []
        for i, (n, at) in enumerate(zip(sizes, table_layout(sizes, width)[0])):
            row = bytearray(n)
            view, done = memoryview(row), 0
            while done < n:
                got = os.preadv(self.fd, [view[done:]], at + done)
                if not got:
                    raise OSError(errno.EIO, f"the table ended within part {i}")
                done += got
            rows.append(memoryview(row))
        return rows

    def release(self) -> None:
        """Close the file unsealed (a failure on the way): the mapping goes with the last view of it."""
        self.tensor = None
        self._closer()
        self.fd = None


def map_rows(fd: int, sizes: Sequence[int], width: int) -> List[memoryview]:
    """The parts of a sealed table this process wrote (``fd``; laid out by :func:`table_layout`), as views on one
    private mapping: the leader's own view of what it hands its host, without :func:`map_parts`' checks of a file
    another process wrote."""
    offsets, end = table_layout(sizes, width)
    whole = memoryview(_private(fd, end)) if end else memoryview(b"")
    return [whole[at : at + n] for at, n in zip(offsets, sizes)]


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
    where: Sealed, size: int, inline: Optional[memoryview], length: int, sizes_of: Callable[[memoryview], List[int]]
) -> Incoming:
    """The frame (unless round 1 carried it ``inline``; ``length`` bytes) and tensors a writer sealed at
    ``where``, as views on a private mapping. ``size``: the bytes the sender announced (frame and
    tensors, without alignment). Raises ``FrameError`` for a file to refuse (see the module
    docstring), :class:`Unopenable` for one that cannot be opened, ``OSError`` from ``sizes_of``.

    What the announced descriptor names is first opened ``O_PATH`` (no driver is opened: a terminal
    cannot become this process's controlling terminal) and must be a regular file before it is
    opened for reading, through that pinned descriptor. Nothing is mapped before the file's size is
    known to be exactly what the frame lays out (the frame itself is read, or mapped on its own when
    large). The descriptor stays open in the result's :class:`Buffers`: ``bytes`` values are read from
    it, never through the mapping."""
    buffers = Buffers(_open_regular(where), where)  # the descriptor's one owner from here: closed once
    try:
        incoming = _map_checked(buffers, size, inline, length, sizes_of)
    except BaseException:
        buffers.close()
        raise
    if incoming.copy_out is None:  # nothing out of band: no descriptor to keep
        buffers.close()
    return incoming


def map_parts(where: Sealed, sizes: Sequence[int], width: int = 0) -> List[memoryview]:
    """The parts of ``sizes`` bytes a writer sealed at ``where`` (:func:`write_sealed` with no frame; ``width`` not 0:
    a :class:`SealedTable` laid out by :func:`table_layout`), as views on one private mapping (their memory lives
    while a view does). ``FrameError``: a file to refuse (its size is not exactly what ``sizes`` lay out, among the
    rest: see the module docstring); :class:`Unopenable`: one that cannot be opened."""
    try:
        offsets, end = table_layout(sizes, width)
    except FrameError as exc:
        raise FrameError(f"sealed segment {where.path}: {exc}") from None
    fd = _open_regular(where)
    try:
        held = _check_sealed(fd, where).st_size
        if held != end:
            raise FrameError(f"sealed segment {where.path} holds {held:,} bytes, its layout needs {end:,}; refused")
        whole = memoryview(_private(fd, held)) if held else memoryview(b"")
    finally:
        os.close(fd)  # the mapping keeps the memory
    return [whole[o : o + n] for o, n in zip(offsets, sizes)]


def _map_checked(buffers: Buffers, size: int, inline: Optional[memoryview], length: int, sizes_of: SizesOf) -> Incoming:
    """:func:`map_sealed` on the opened descriptor of ``buffers``, which the result keeps (when any)."""
    fd, where = buffers.fd, buffers.where
    held = _check_sealed(fd, where).st_size
    position = 0 if inline is not None else length
    if held < size or position > size or (inline is None and not length):
        raise FrameError(
            f"sealed segment {where.path} holds {held:,} bytes for the {size:,} (frame: "
            f"{length:,}) the sender announced; refused"
        )
    frame = inline if inline is not None else _frame(fd, where, length)
    sizes = sizes_of(frame)
    if sum(sizes) != size - position:
        raise FrameError(
            f"sealed segment {where.path}: its frame announces {sum(sizes):,} bytes of tensors, "
            f"the sender announced {size - position:,}; refused"
        )
    offsets, end = layout(position, sizes)
    if end != held:
        raise FrameError(f"sealed segment {where.path} holds {held:,} bytes, its layout needs {end:,}; refused")
    if not any(sizes):
        return Incoming(frame, [torch.empty(0, dtype=torch.uint8) for _ in sizes])
    # tensors and arrays are views on a mapping of the whole file (its frame pages stay untouched there)
    mapping = _private(fd, held)
    tensors = [
        torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=o) if n else torch.empty(0, dtype=torch.uint8)
        for o, n in zip(offsets, sizes)
    ]
    buffers.spans = list(zip(offsets, sizes))
    return Incoming(frame, tensors, copy_out=buffers)


def _frame(fd: int, where: Sealed, length: int) -> memoryview:
    """The frame at the start of the file: read when small (a mapping costs more, and holds a descriptor
    of its own: ``mmap`` keeps a duplicate), else a view on a mapping of its own bytes alone (which a
    ``bytes`` value after it never enters beyond the frame's last page)."""
    if length <= READ_FRAME:
        return memoryview(read_at(fd, where, length, 0, bytearray))
    return memoryview(_private(fd, length))


def _private(fd: int, length: int) -> mmap.mmap:
    """The first ``length`` bytes of ``fd``, mapped privately (copy on write: writes stay in this process)."""
    return mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def read_at(fd: int, where: Sealed, size: int, offset: int, kind: type) -> Union[bytes, bytearray]:
    """``size`` bytes of ``fd`` from ``offset``, as a new ``kind`` (``bytes``: one copy, straight from the
    file, up to :data:`MAX_READ`); every byte or ``FrameError`` (the seals forbid shrinking: only a
    lying file reads short)."""
    if kind is bytes and size <= MAX_READ:
        data = os.pread(fd, size, offset)
        _whole(len(data), size, offset, where)
        return data
    out = bytearray(size)  # a read(2) moves at most MAX_READ bytes: larger ones in pieces (bytes: then a copy)
    view = memoryview(out)
    for start in range(0, size, MAX_READ):
        piece = view[start : start + MAX_READ]
        _whole(os.preadv(fd, [piece], offset + start), piece.nbytes, offset + start, where)
    return out if kind is bytearray else bytes(out)


def _whole(got: int, wanted: int, offset: int, where: Sealed) -> None:
    if got != wanted:
        raise FrameError(
            f"sealed segment {where.path}: {got:,} of the {wanted:,} bytes at offset {offset:,} could be read; refused"
        )


class Buffers:
    """The out-of-band buffers of a mapped sealed segment, copied out with ``pread`` on request
    (:attr:`objcomm._transport.base.Incoming.copy_out`).

    A ``bytes`` result must own its memory: copied from the mapping, the pages it reads would also
    count in this process's resident set for as long as the mapping lives (twice the value's size);
    read from the file, they are never mapped. Reads use the descriptor :func:`map_sealed` checked, at
    the offsets and sizes of the layout it checked, and must return every byte (else ``FrameError``).
    The descriptor is closed once: by :meth:`close`, or when this object goes (the ``Incoming`` holding
    it), whichever comes first; an exception anywhere after the open cannot close it twice (a second
    ``close`` of a number could close whatever reused it)."""

    def __init__(self, fd: int, where: Sealed, spans: Sequence[Tuple[int, int]] = ()) -> None:
        self.fd, self.where, self.spans = fd, where, list(spans)  # spans: (offset, size) of each buffer
        self.close = weakref.finalize(self, os.close, fd)

    def __call__(self, index: int, kind: type) -> Union[bytes, bytearray]:
        """Buffer ``index`` as a new ``kind`` (``bytes`` or ``bytearray``)."""
        offset, size = self.spans[index]
        return read_at(self.fd, self.where, size, offset, kind)


def _open_regular(where: Sealed) -> int:
    """``where`` opened for reading, once it is known to be a regular file of this user (else FrameError)."""
    try:
        pinned = os.open(where.path, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise Unopenable(exc.errno, f"cannot open sealed segment {where.path}: {exc.strerror}") from exc
    try:
        if elsewhere(pinned, memory_files()):  # before anything asks its file system (a FUSE one may never answer)
            raise FrameError(
                f"sealed segment {where.path} is not a regular file of the kernel's memory files (it lies on another "
                "mount); refused"
            )
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
    return call


def _filesystem(fd: int) -> Optional[int]:
    """The ``f_type`` of the file system holding ``fd`` (``fstatfs``), or None where it cannot be learned."""
    call, found = _fstatfs(), _StatFs()
    if call is None or call(fd, ctypes.byref(found)) != 0:
        return None
    return cast(int, found.f_type) & 0xFFFFFFFF  # a field ctypes makes from _fields_
