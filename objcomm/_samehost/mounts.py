"""Which mount a descriptor lies on, read from ``/proc/self/fdinfo`` without asking its file system.

A peer names the files a receiver opens: a sealed segment through ``/proc/<pid>/fd``, a segment file by its name in
``shm_dir``. Opening a file, or ``fstat`` and ``fstatfs`` on it, asks its file system, and a FUSE file system
that never answers holds the caller in the kernel past any timeout (a helper's find: a receiver waited as long as
the peer's FUSE server kept the open unanswered). Receivers first pin the name with ``O_PATH`` (no open reaches the
file system) and compare its mount with the one it must lie on: the kernel's own mount of memory files for sealed
segments, ``shm_dir``'s for segment files.

>>> import os
>>> folder = os.open("/proc", os.O_PATH)
>>> mount_of(folder) is None or mount_of(folder) > 0
True
>>> os.close(folder)
"""

from __future__ import annotations

import functools
import os
from typing import Optional


def mount_of(fd: int) -> Optional[int]:
    """The id of the mount that holds ``fd``'s file (``mnt_id`` of its fdinfo), or None where it cannot be learned."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as handle:
            for line in handle:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@functools.lru_cache(maxsize=1)
def memory_files() -> Optional[int]:
    """The kernel's mount of memory files (every ``memfd_create`` file lies on it), learned from one of this process's
    own, or None."""
    try:
        fd = os.memfd_create("objcomm-mount", os.MFD_CLOEXEC)
    except (OSError, AttributeError):
        return None
    try:
        return mount_of(fd)
    finally:
        os.close(fd)


def elsewhere(fd: int, mount: Optional[int]) -> bool:
    """Whether ``fd`` lies on another mount than ``mount``: False where either is unknown."""
    found = mount_of(fd)
    return mount is not None and found is not None and found != mount
