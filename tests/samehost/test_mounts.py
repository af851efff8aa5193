"""objcomm._samehost.mounts: a descriptor's mount, read without asking its file system."""

from __future__ import annotations

import doctest
import os

import pytest

from objcomm._samehost import mounts


def test_the_docstring_example_runs():
    assert doctest.testmod(mounts).failed == 0


@pytest.mark.skipif(mounts.memory_files() is None, reason="no mnt_id in /proc/self/fdinfo (Linux before 3.15)")
def test_memory_files_lie_on_one_mount_and_other_files_elsewhere():
    memory = mounts.memory_files()
    made = os.memfd_create("probe", os.MFD_CLOEXEC)
    pinned = os.open("/proc", os.O_PATH | os.O_CLOEXEC)  # procfs: never the memory files' mount
    try:
        assert mounts.mount_of(made) == memory and not mounts.elsewhere(made, memory)
        assert mounts.elsewhere(pinned, memory)
        assert not mounts.elsewhere(pinned, None)  # unknown: not told apart
    finally:
        os.close(made)
        os.close(pinned)
