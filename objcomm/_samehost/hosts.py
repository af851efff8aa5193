"""Which ranks of a group share a host: learned once per group, through the group itself.

Each rank contributes four 64-bit words to one ``all_gather``: a key for its host (a hash of the
hostname and the kernel's boot id, so two containers with the same hostname on different machines
differ), its pid, a random token, and its pid namespace (a pid only names a process inside its
namespace). Every rank keeps rank 0's token: it names this job's shared-memory segments, so two
jobs on one host never pick the same name. Where the group's same-host channel was tried first, through the group,
its set-up's words told the same (:func:`keep`), and no rank asks again.

``separate=True`` salts the host key with the pid: every rank then looks like a host of its own,
which lets tests run the different-hosts path on one machine; ``separate=k`` (``OBJCOMM_TEST_RANKS_PER_HOST``)
makes each run of ``k`` consecutive global ranks one simulated host.
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any, List, Tuple, Union

import torch
import torch.distributed as dist

from objcomm import _state
from objcomm._transport.base import all_gather_single, guarded

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_WORDS = 4  # host key, pid, token, pid namespace
_PID_NAMESPACE = "/proc/self/ns/pid"


@dataclass(frozen=True)
class Hosts:
    """What one rank learned about its group: every rank's host key, pid and pid namespace, and the job token."""

    token: int
    keys: Tuple[int, ...]
    pids: Tuple[int, ...]
    pid_namespaces: Tuple[int, ...]

    @functools.cached_property  # (asked on every call that may take shared memory: O(W) once, not per call)
    def count(self) -> int:
        """How many hosts the group's ranks run on."""
        return len(set(self.keys))

    @property
    def one_host(self) -> bool:
        """Every rank of the group runs on this host."""
        return self.count == 1

    @functools.cached_property
    def one_pid_namespace(self) -> bool:
        """Every rank of the group runs in one known pid namespace."""
        return len(set(self.pid_namespaces)) == 1 and self.pid_namespaces[0] != 0

    def same_host(self, a: int, b: int) -> bool:
        return self.keys[a] == self.keys[b]


def host_key(separate: Union[bool, int] = False) -> int:
    """A 63-bit key equal on ranks that share a kernel (hostname + boot id). Tests only: ``separate=True``, unique
    per process; a number ``k``, equal on each run of ``k`` consecutive global ranks (simulated hosts)."""
    try:
        with open(_BOOT_ID) as handle:
            boot = handle.read().strip()
    except OSError:  # not Linux: the hostname alone
        boot = ""
    if separate is True:
        salt = str(os.getpid())
    elif separate:
        salt = f"simulated host {(dist.get_rank() if dist.is_initialized() else 0) // separate}"
    else:
        salt = ""
    return _digest(f"{socket.gethostname()}|{boot}|{salt}".encode())


def _digest(data: bytes) -> int:
    """A 63-bit one-way digest of ``data``."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def pid_namespace() -> int:
    """The inode number of this process's pid namespace (what ``ls -l /proc/self/ns/pid`` shows); 0 if unknown."""
    try:
        return os.stat(_PID_NAMESPACE).st_ino
    except OSError:
        return 0


def discover(wire: Any, separate: Union[bool, int], op: str) -> Hosts:
    """Exchange host identities over ``wire``'s group (a collective: every rank must call it); the caller
    keeps the answer (:func:`objcomm._state.group_facts`)."""
    mine = torch.tensor([host_key(separate), os.getpid(), secrets.randbits(63), pid_namespace()], dtype=torch.int64)
    everyone = torch.empty(_WORDS * wire.size, dtype=torch.int64)
    guarded(op, wire, all_gather_single, everyone, mine, group=wire.group)
    words: List[int] = everyone.tolist()
    hosts = Hosts(
        token=words[2],
        keys=tuple(words[0::_WORDS]),
        pids=tuple(words[1::_WORDS]),
        pid_namespaces=tuple(words[3::_WORDS]),
    )
    return hosts


def keep(
    group: Any, separate: Union[bool, int], keys: List[int], pids: List[int], namespaces: List[int], secret: int
) -> None:
    """Keep ``group``'s hosts, as :func:`discover` learns them, from words every rank gathered through the group at
    the same call (the same-host channel's set-up: :meth:`objcomm._samehost.channel.LocalChannel.open`), so that two
    levels and shared memory make no all_gather of their own (a ring of W - 1 steps on gloo). The job's token comes
    from group rank 0's ``secret`` through a one-way digest (not from its socket's nonce, which the socket's name
    shows every user of the host)."""
    found = Hosts(_digest(b"objcomm token %d" % secret), tuple(keys), tuple(pids), tuple(namespaces))
    _state.group_facts(group).hosts.setdefault(separate, found)
