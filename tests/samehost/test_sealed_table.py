"""A sealed table (objcomm._samehost.sealed.SealedTable): a memory file a collective writes in place, then sealed and
mapped by readers in rows (map_parts with a width), as two levels' leaders hand an all_gather's result to their host."""

from __future__ import annotations

import fcntl
import os

import pytest
import torch

from objcomm import FrameError
from objcomm._samehost import sealed as _sealed
from objcomm._samehost.sealed import Sealed, SealedTable

pytestmark = pytest.mark.timeout(60)


def test_a_table_written_in_place_is_sealed_and_read_in_rows():
    table = SealedTable("objcomm-test", 3 * 100)
    assert table.tensor is not None
    rows = table.tensor.view(3, 100)
    for i in range(3):
        rows[i] = i + 1  # what an all_gather into it writes
    del rows
    segment = table.seal()
    try:
        seals = fcntl.fcntl(segment.fd, fcntl.F_GET_SEALS)
        assert seals & _sealed.SEALS == _sealed.SEALS and seals & fcntl.F_SEAL_SEAL
        parts = _sealed.map_parts(Sealed(os.getpid(), segment.fd), [100, 40, 0], 100)
        assert [bytes(p) for p in parts] == [b"\x01" * 100, b"\x02" * 40, b""]
        with pytest.raises(OSError):
            os.pwrite(segment.fd, b"x", 0)  # the writer cannot change what readers hold
    finally:
        segment.release()


def test_a_table_with_a_view_left_is_not_sealed():
    table = SealedTable("objcomm-test", 64)
    view = table.tensor[:8] if table.tensor is not None else None
    with pytest.raises(BufferError):
        table.seal(settle=0.01)  # a view of the writable mapping is alive: sealing against writes would fail
    del view
    table.release()
    assert table.fd is None


@pytest.mark.parametrize(
    "sizes, width, why",
    [
        ([100, 100, 100], 99, "in rows of"),  # a part longer than its row
        ([100, 100], 100, "holds 300 bytes"),  # rows that are not the file's
        ([100, 100, 100], 101, "holds 300 bytes"),
        ([10, 10, 10], -100, "in rows of"),  # a width from a hostile leader
    ],
)
def test_rows_that_are_not_the_files_are_refused(sizes, width, why):
    table = SealedTable("objcomm-test", 300)
    segment = table.seal()
    try:
        with pytest.raises(FrameError, match=why):
            _sealed.map_parts(Sealed(os.getpid(), segment.fd), sizes, width)
    finally:
        segment.release()


def test_an_empty_table_is_not_made():
    with pytest.raises(OSError):
        SealedTable("objcomm-test", 0)  # the caller falls back to its own buffers


def test_a_collectives_output_lands_in_the_table():
    table = SealedTable("objcomm-test", 2 * 16)
    assert table.tensor is not None
    source = torch.arange(32, dtype=torch.uint8)
    table.tensor.copy_(source)  # (a gloo all_gather writes the same way: into the tensor's memory)
    segment = table.seal()
    try:
        parts = _sealed.map_parts(Sealed(os.getpid(), segment.fd), [16, 10], 16)
        assert bytes(parts[0]) == bytes(range(16)) and bytes(parts[1]) == bytes(range(16, 26))
    finally:
        segment.release()


def test_a_table_that_cannot_be_sealed_gives_its_rows_copied():
    table = SealedTable("objcomm-test", 2 * 8)
    assert table.tensor is not None
    table.tensor.copy_(torch.arange(16, dtype=torch.uint8))
    kept = table.tensor[:1]  # a view left behind
    with pytest.raises(BufferError):
        table.seal(settle=0.01)
    rows = table.copy_rows([8, 3])
    del kept
    table.release()
    assert [bytes(r) for r in rows] == [bytes(range(8)), bytes(range(8, 11))]


def test_a_view_another_thread_drops_just_after_is_waited_for():
    import threading

    table = SealedTable("objcomm-test", 64)
    held = [table.tensor[:8] if table.tensor is not None else None]  # as a backend's worker holds a collective's output
    threading.Timer(0.05, held.clear).start()
    segment = table.seal(settle=5.0)
    segment.release()
    assert not held
