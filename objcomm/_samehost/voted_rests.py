"""The rests of collectives where round 1 goes through the backend (``local=False``): shared memory where every
rank's settings take it, the backend where some rank's do not.

With the same-host channel, every rank echoes the medium its ``shm`` and ``shm_threshold`` pick for a rest before it
moves (:mod:`objcomm._samehost.channel_checks`). Without it nothing told the ranks each other's settings: a rank with
shared memory on went into its announcement (an all_gather of words), one with it off into the backend's exchange of
the bytes, and gloo, handed collectives of different sizes, aborted a process (``local=False``, ``shm=False`` on one
rank, a 3 MiB all_gather of two ranks: SIGABRT on the other). Here, on a CPU group that lies on one host, every rank
takes part in shared memory's announcement (:meth:`~objcomm._samehost.shm.SharedMemory._collective`) before a
collective's rest of :data:`~objcomm._transport.routes.VOTED_FROM` (2 MiB, the default ``shm_threshold``) or more
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
from typing import Optional, Union

from objcomm import _state
from objcomm._samehost import hosts as _hosts
from objcomm._samehost.rests import SharedPointToPoint
from objcomm._samehost.segments import sweep
from objcomm._samehost.shm import SharedMemory, SharedRest
from objcomm._transport import routes
from objcomm._transport.base import Wire
from objcomm._transport.rests import RestMedium

_P2P = ("send", "recv")


@dataclass(frozen=True)
class VotedRests(SharedPointToPoint):
    """A group's rests without the same-host channel: ``shared`` (None where ``shm`` is off) where every rank's
    settings take it, else the transport."""

    threshold: int  # this rank's shm_threshold
    shared: Optional[SharedMemory] = None
    separate: Union[bool, int] = False  # tests: every rank its own host (True), or hosts of k ranks
    memory: Optional[SharedMemory] = None  # where shm is off: its announcement's machinery, to decline in it

    def _hosts(self, wire: Wire, op: str) -> _hosts.Hosts:
        """The group's hosts: learned at the first call that asks, on every rank alike."""
        known = _state.group_facts(wire.group).hosts
        found = known.get(self.separate)
        if found is None:
            found = known[self.separate] = _hosts.discover(wire, self.separate, op)
            if self.shared is not None:
                sweep(self.shared.directory)  # a new job on this host: clear what dead jobs left
        return found

    def worth(self, wire: Wire, moved: int, op: str) -> bool:
        """send/recv: whether this rank's shared memory may take the rest (the receiver's answer settles the pair).
        A gather's destination (``op`` "gather": its word after round 1) says look wherever some rank's settings
        might take the rest, a CPU group not known to span hosts: every rank then reads every slot and announces
        alike in :meth:`medium`, where otherwise the destination would announce alone. Else False: a broadcast's
        receivers answer first only where its slot requires it, so that ranks whose settings differ still take the
        same steps up to the announcement."""
        if op in _P2P:
            return self.shared is not None and self.shared.worth(wire, moved, op)
        if op != "gather" or not routes.medium_voted(moved, cpu=wire.device.type == "cpu"):
            return False
        known = _state.group_facts(wire.group).hosts.get(self.separate)
        return known is None or known.one_host

    def medium(self, wire: Wire, largest: int, gathered: int, op: str) -> Optional[RestMedium]:
        if not routes.medium_voted(largest, cpu=wire.device.type == "cpu"):
            return None  # (below VOTED_FROM the backend, on every rank whatever its settings)
        hosts = self._hosts(wire, op)
        if not hosts.one_host:
            return None
        takes = self.shared is not None and routes.shared_memory_takes(largest, threshold=self.threshold, cpu=True)
        memory = self.shared if self.shared is not None else self.memory
        assert memory is not None, "rest_media_for gives every VotedRests its shared memory's machinery"
        return SharedRest(memory, hosts, declines=not takes)  # its announcement is the vote
