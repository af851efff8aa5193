"""A segment file swapped for another file of the same user, mode and size, or rewritten in place, is refused,
not decoded.

A process of the same user may rename a file of its own over a segment's name between the writer
creating it and a reader opening it, or open the segment itself (mode 0600 lets its owner) and change its bytes.
Everything the reader checked before (a regular file of this user, 0600, the announced size) holds for that file:
only its identity (a digest of its device, inode and bytes, which the writer announces with the segment) gives it
away. Applies to segment *files* (``shm_zero_copy=False``, or where sealed memory files cannot be used, which any
rank can claim); sealed segments cannot be changed.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from _ranks import get_pool

import objcomm
from objcomm._api.resolving import Hooks
from objcomm._samehost import segments as _segments

THRESHOLD = 4096
REFUSAL = "is not what its writer wrote"


def _swap(path: str) -> None:
    """Rename over ``path`` a private file of the same size whose last byte differs: what a hostile process
    of this user can do, and whose content would decode (the last byte is tensor or blob data)."""
    with open(path, "rb") as handle:
        content = bytearray(handle.read())
    content[-1] ^= 0xFF
    forged = path + ".forged"
    fd = os.open(forged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, bytes(content))
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    os.rename(forged, path)


def _rewrite(path: str) -> None:
    """Flip the last byte of ``path`` in place: the same file (device, inode, size, mode), other bytes."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        last = os.pread(fd, 1, size - 1)
        os.pwrite(fd, bytes([last[0] ^ 0xFF]), size - 1)
    finally:
        os.close(fd)


TAMPER = {"renamed over": _swap, "rewritten in place": _rewrite}


def _big(tag: int) -> Dict[str, Any]:
    return {"tag": tag, "blob": bytes([tag]) * 4 * THRESHOLD, "t": torch.arange(5000, dtype=torch.float32) + tag}


def _same(got: Any, tag: int) -> bool:
    return got["tag"] == tag and got["blob"] == bytes([tag]) * 4 * THRESHOLD and torch.equal(got["t"], _big(tag)["t"])


def swapped_then_clean(directory: str, op: str, tamper: str = "renamed over") -> Dict[str, Any]:
    """One call in which rank 0 swaps each segment file it wrote for a forged one (or changes it in place: ``tamper``),
    then a clean call."""
    rank = dist.get_rank()
    files = dict(shm_threshold=THRESHOLD, shm_dir=directory, shm_zero_copy=False)
    comm = plain = objcomm.Communicator(**files)
    swapped: List[str] = []

    def call(tag: int) -> Any:  # what rank 1 receives from rank 0 (None on rank 0, unless it receives too)
        if op == "broadcast":
            return comm.broadcast(_big(tag) if rank == 0 else None, src=0)
        if op == "all_gather":
            return comm.all_gather(_big(tag))[0]
        if op == "scatter":
            return comm.scatter([_big(tag), _big(tag)] if rank == 0 else None, src=0)
        if op == "all_to_all":
            return comm.all_to_all([_big(tag), _big(tag)])[0]
        if rank == 0:
            return comm.send(_big(tag), 1)
        return comm.recv(0)

    class Swapping(_segments.SegmentBook):
        def create(self, path: str, frame: Optional[memoryview], tensors: Any) -> Any:
            segment = super().create(path, frame, tensors)
            TAMPER[tamper](path)
            swapped.append(os.path.basename(path))
            return segment

    error: Optional[Tuple[str, str]] = None
    forged_decoded = False
    if rank == 0:
        comm = objcomm.Communicator(**files, _hooks=Hooks(segments=Swapping()))  # call() uses it
    try:
        got = call(1)
        forged_decoded = rank == 1 and not _same(got, 1)  # what the bug did: the forged bytes, decoded
    except objcomm.ObjcommError as exc:
        error = (type(exc).__name__, str(exc))
    finally:
        comm = plain
    after = call(2)
    clean = op == "send" and rank == 0 or _same(after, 2)
    dist.barrier()  # writers unlink once their readers are done, maybe just after those return
    return {
        "error": error,
        "forged decoded": forged_decoded,
        "clean": clean,
        "swapped": swapped,
        "left": sorted(os.listdir(directory)),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tamper", list(TAMPER))
@pytest.mark.parametrize("op", ["broadcast", "all_gather", "scatter", "all_to_all", "send"])
def test_swapped_segment_file_is_refused_and_the_group_stays_usable(shm_dir, op, tamper):
    writer, reader = get_pool(2).run(swapped_then_clean, shm_dir, op, tamper)
    assert writer["swapped"], "rank 0 wrote no segment file: the test no longer reaches the file path"
    assert not reader["forged decoded"], "the reader decoded the forged file's content"
    assert writer["error"] is None, writer["error"]  # the writer's call completes; the refusing reader raises alone
    assert reader["error"] is not None and reader["error"][0] == "FrameError", reader["error"]
    assert "shared-memory segment" in reader["error"][1] and REFUSAL in reader["error"][1], reader["error"]
    assert writer["clean"] and reader["clean"]  # a refused frame leaves the group usable: the next call works
    assert writer["left"] == reader["left"] == []


# -- the reader's check itself ------------------------------------------------------------------------
@pytest.mark.parametrize("tamper", list(TAMPER))
def test_reader_checks_the_identity_of_the_file_it_opened(shm_dir, tamper):
    data = bytes(range(256)) * 64
    book = _segments.SegmentBook()
    segment = book.create(os.path.join(shm_dir, "objcomm-swap"), memoryview(data), [])
    try:
        assert segment.identity > 0
        got = _segments.read_segment(
            segment.path, len(data), None, len(data), lambda view: [], expected=segment.identity
        )
        assert bytes(got.frame) == data
        TAMPER[tamper](segment.path)  # same user, mode 0600, same size: only the identity differs
        with pytest.raises(objcomm.FrameError, match=REFUSAL):
            _segments.read_segment(segment.path, len(data), None, len(data), lambda view: [], expected=segment.identity)
    finally:
        segment.release()
    assert os.listdir(shm_dir) == []


def test_writer_holds_its_file_until_release_so_no_other_file_takes_its_identity(shm_dir):
    """Unlinked and recreated at once, a file could get the freed inode (ext4 reuses them): the writer keeps
    its file open, so the inode cannot be freed while readers may still check it."""
    path = os.path.join(shm_dir, "objcomm-held")
    segment = _segments.SegmentBook().create(path, memoryview(b"x" * 100), [])
    try:
        os.unlink(path)
        recreated = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(recreated, b"x" * 100)  # the same bytes: only the inode could tell them apart
            assert _segments.identity(os.fstat(recreated), [b"x" * 100]) != segment.identity
        finally:
            os.close(recreated)
        assert os.fstat(segment.fd).st_nlink == 0  # the writer's descriptor still holds the unlinked original
    finally:
        segment.release()
    assert segment.fd == -1


def test_identity_is_what_the_wire_format_page_says(shm_dir):
    found = os.stat(shm_dir)
    digest = hashlib.sha256(struct.pack("<QQ", found.st_dev, found.st_ino) + b"frame" + b"tensor").digest()[:8]
    assert _segments.identity(found, [b"frame", memoryview(b"tensor")]) == (int.from_bytes(digest, "little") >> 1 or 1)
    assert 0 < _segments.identity(found) < 1 << 63  # one positive int64 word
