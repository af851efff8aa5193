"""A sealed table (objcomm._samehost.sealed.SealedTable): a memory file a collective writes in place, then sealed and
mapped by readers in rows (map_parts with a width), as two levels' leaders hand an all_gather's result to their host.
No view of the table may outlive its mapping: the kernel refuses the write seal while one is mapped."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time

import pytest
import torch

from objcomm import FrameError
from objcomm._samehost import sealed as _sealed
from objcomm._samehost.sealed import Sealed, SealedTable

pytestmark = pytest.mark.timeout(60)


def _filled(rows: int, width: int) -> SealedTable:
    table = SealedTable("objcomm-test", rows * width)
    assert table.tensor is not None
    table.tensor.view(rows, width).copy_(torch.arange(1, rows + 1, dtype=torch.uint8).view(rows, 1).expand(rows, width))
    return table  # (an all_gather into it writes the same way: into the tensor's memory)


def test_a_table_written_in_place_is_sealed_and_read_in_rows():
    segment = _filled(3, 128).seal()
    try:
        seals = fcntl.fcntl(segment.fd, fcntl.F_GET_SEALS)
        assert seals & _sealed.SEALS == _sealed.SEALS and seals & fcntl.F_SEAL_SEAL
        parts = _sealed.map_parts(Sealed(os.getpid(), segment.fd), [100, 40, 0], 128)  # what the host's ranks read
        assert [bytes(p) for p in parts] == [b"\x01" * 100, b"\x02" * 40, b""]
        own = _sealed.map_rows(segment.fd, [100, 40, 0], 128)  # what the leader reads
        assert [bytes(p) for p in own] == [bytes(p) for p in parts] and not own[0].readonly
        with pytest.raises(OSError):
            os.pwrite(segment.fd, b"x", 0)  # the writer cannot change what readers hold
    finally:
        segment.release()


def test_a_stream_of_stripes_written_in_place_is_read_back_to_back():
    """A negative width: the parts lie back to back from 0 in rows of that many bytes (the stream a by_stripes
    exchange writes in place), the rest of the last row zeros."""
    table = SealedTable("objcomm-test", 3 * 64)
    assert table.tensor is not None
    table.tensor[:150].copy_(torch.tensor([1] * 100 + [2] * 40 + [3] * 10, dtype=torch.uint8))
    segment = table.seal()
    try:
        parts = _sealed.map_parts(Sealed(os.getpid(), segment.fd), [100, 40, 0, 10], -48)  # 4 rows of 48: 192 bytes
        assert [bytes(p) for p in parts] == [b"\x01" * 100, b"\x02" * 40, b"", b"\x03" * 10]
        own = _sealed.map_rows(segment.fd, [100, 40, 0, 10], -48)
        assert [bytes(p) for p in own] == [bytes(p) for p in parts]
    finally:
        segment.release()
    kept = SealedTable("objcomm-test", 2 * 64)
    assert kept.tensor is not None
    kept.tensor[:70].fill_(7)
    view = kept.tensor[:1]  # left behind: not sealed, copied instead
    assert [bytes(r) for r in kept.copy_rows([30, 40], -64)] == [b"\x07" * 30, b"\x07" * 40]
    kept.release()
    del view


def test_a_table_with_a_view_left_is_not_sealed_and_gives_its_rows_copied():
    table = _filled(2, 64)
    kept = table.tensor[:8] if table.tensor is not None else None  # a view left behind
    with pytest.raises(OSError) as refused:
        table.seal(settle=0.01)  # mapped writable by that view: the kernel refuses the write seal
    assert refused.value.errno == errno.EBUSY and kept is not None and int(kept[0]) == 1  # the view's memory is intact
    rows = table.copy_rows([64, 3], 64)
    assert [bytes(r) for r in rows] == [b"\x01" * 64, b"\x02" * 3] and not rows[0].readonly  # writable, as rests are
    fd = table.fd
    table.release()
    assert table.fd is None
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
    del kept


def test_a_view_another_thread_drops_just_after_is_waited_for():
    table = _filled(1, 64)
    held = [table.tensor[:8] if table.tensor is not None else None]  # as a backend's worker holds a collective's output
    threading.Timer(0.05, held.clear).start()
    segment = table.seal(settle=5.0)
    segment.release()
    assert not held


def test_a_forked_child_does_not_keep_the_table_mapped():
    table = _filled(1, 64)
    pid = os.fork()
    if pid == 0:  # the child: alive while the parent seals
        time.sleep(0.5)
        os._exit(0)
    try:
        table.seal(settle=0.05).release()  # MADV_DONTFORK: the child holds no writable mapping of it
    finally:
        os.waitpid(pid, 0)


def test_a_table_dropped_unsealed_closes_its_file():
    table = _filled(1, 64)
    fd = table.fd
    assert fd is not None
    del table
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.parametrize(
    "sizes, width, why",
    [
        ([100, 100, 100], 99, "in rows of"),  # a part longer than its row
        ([100, 100], 100, "holds 300 bytes"),  # rows that are not the file's
        ([100, 100, 100], 101, "holds 300 bytes"),
        ([200, 100, 1], -100, "in rows of"),  # a stream longer than its rows
        ([10, 10, 10], -99, "holds 300 bytes"),  # a stream's rows that are not the file's
        ([10, 10, 10], 1 << 62, "holds 300 bytes"),  # widths from a hostile leader
        ([10, 10, 10], -(1 << 62), "holds 300 bytes"),
    ],
)
def test_rows_that_are_not_the_files_are_refused(sizes, width, why):
    segment = SealedTable("objcomm-test", 300).seal()
    try:
        with pytest.raises(FrameError, match=why):
            _sealed.map_parts(Sealed(os.getpid(), segment.fd), sizes, width)
    finally:
        segment.release()


def test_an_empty_table_is_not_made():
    with pytest.raises(OSError):
        SealedTable("objcomm-test", 0)  # the caller falls back to its own buffers
