"""The rests of collectives where round 1 goes through the backend (``local=False``): shared memory where every
rank's settings take it, the backend where some rank's do not.

With the same-host channel, every rank echoes the medium its ``shm`` and ``shm_threshold`` pick for a rest before it
moves (:mod:`objcomm._samehost.channel_checks`). Without it nothing told the ranks each other's settings: a rank with
shared memory on went into its announcement (an all_gather of words), one with it off into the backend's exchange of
the bytes, and gloo, handed collectives of different sizes, aborted a process (``local=False``, ``shm=False`` on one
rank, a 3 MiB all_gather of two ranks: SIGABRT on the other). Here, on a CPU group that lies on one host, every rank
takes part in shared memory's announcement (:meth:`~objcomm._samehost.shm.SharedMemory._collective`) before a
collective's rest of :data:`~objcomm._transport.routes.ANNOUNCED_FROM` (2 MiB, the default ``shm_threshold``) or more
moves, whatever its settings: a rank whose settings take the rest writes and announces it, one whose settings do
not announces -1 (as a rank that could not write does), and then every rank moves it the normal way. So ranks whose
settings differ agree, with no collective more than the default settings take. A smaller rest takes the backend on
every rank, whatever ``shm_threshold`` says (an announcement would cost it up to a third of its time). Whether the
group lies on one host every rank learns at its first collective with such a rest (one all_gather per group,
:func:`objcomm._samehost.hosts.discover`); a group that spans hosts never announces (shared memory takes no
collective's rest there). send/recv go as shared memory says: their own protocol settles ranks whose settings differ
(:mod:`objcomm._transport.p2p`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from objcomm._device import is_cpu
from objcomm._samehost.rests import SharedPointToPoint
from objcomm._samehost.shm import SharedMemory, SharedRest
from objcomm._transport import routes
from objcomm._transport.base import Wire
from objcomm._transport.rests import RestMedium

_P2P = ("send", "recv")


@dataclass(frozen=True)
class VotedRests(SharedPointToPoint):
    """A group's rests without the same-host channel: shared memory (``memory``, whose settings are this rank's)
    where every rank's settings take a rest, else the transport."""

    memory: SharedMemory  # this rank's shared memory, whose announcement it takes part in where ``shm`` is off too
    shm: bool = True

    @property
    def shared(self) -> Optional[SharedMemory]:  # type: ignore[override]  # (derived: None where shm is off)
        return self.memory if self.shm else None

    def worth(self, wire: Wire, moved: int, op: str, peer: Optional[int] = None) -> bool:
        """send/recv: whether this rank's shared memory may take the rest (the receiver's answer settles the pair).
        A gather's destination (``op`` "gather": its word after round 1) says look wherever some rank's settings
        might take the rest, a CPU group not known to span hosts: every rank then reads every slot and announces
        alike in :meth:`medium`, where otherwise the destination would announce alone. Else False: a broadcast's
        receivers answer first only where its slot requires it, so that ranks whose settings differ still take the
        same steps up to the announcement."""
        if op in _P2P:
            return self.shm and self.memory.worth(wire, moved, op, peer)
        if op != "gather" or not routes.all_announce(moved, cpu=is_cpu(wire.device)):
            return False
        known = self.memory.learned_hosts(wire)
        return known is None or known.one_host

    def medium(self, wire: Wire, largest: int, gathered: int, op: str) -> Optional[RestMedium]:
        if not routes.all_announce(largest, cpu=is_cpu(wire.device)):
            return None  # (below ANNOUNCED_FROM the backend, on every rank whatever its settings)
        hosts = self.memory.hosts(wire, op)
        if not hosts.one_host:
            return None
        takes = self.shm and routes.shared_memory_takes(largest, threshold=self.memory.threshold, cpu=True)
        return SharedRest(self.memory, hosts, declines=not takes)  # its announcement is the vote
