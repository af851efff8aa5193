"""The rests of collectives on one host: through the same-host channel where it carried round 1 and below
``min(threshold, CHANNEL_MOST)`` (:class:`~objcomm._samehost.channel_rests.ChannelRest`), through shared memory from
``threshold`` (:class:`~objcomm._samehost.shm.SharedMemory`), else through the backend: the choice of
:func:`objcomm._transport.routes.rest_medium`. Each operation's pattern is
:class:`objcomm._transport.rests.PatternRests`'s; send/recv's rest goes as shared memory says (below its threshold the
channel's route takes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from objcomm._device import is_cpu
from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._format.slot import SlotInfo
from objcomm._samehost.channel_rests import ChannelRest
from objcomm._samehost.shm import SharedMemory
from objcomm._transport import routes
from objcomm._transport.base import NOT_USED, NotUsed, Route, Wire
from objcomm._transport.rests import PatternRests, RestMedium


class SharedPointToPoint(PatternRests):
    """send/recv's rest as shared memory (``shared``: None where it is off) says; else the route's normal way."""

    shared: Optional[SharedMemory]

    def send(
        self, wire: Wire, out: Outgoing, dst: int, op: str, route: Optional[Route] = None, message: int = 0
    ) -> bool:
        return self.shared is not None and self.shared.send(wire, out, dst, op, route, message)

    def recv(
        self,
        wire: Wire,
        info: SlotInfo,
        sizes_of: SizesOf,
        src: int,
        op: str,
        route: Optional[Route] = None,
        message: int = 0,
    ) -> Union[Incoming, NotUsed]:
        return NOT_USED if self.shared is None else self.shared.recv(wire, info, sizes_of, src, op, route, message)


@dataclass(frozen=True)
class SameHostRests(SharedPointToPoint):
    """A group's rests on one host: the channel, then shared memory (``shared``: None when it is off), by size."""

    threshold: int  # shm_threshold: shared memory from here (when on), the channel below it and CHANNEL_MOST
    shared: Optional[SharedMemory] = None

    def medium(self, wire: Wire, largest: int, gathered: int, op: str) -> Optional[RestMedium]:
        medium = routes.rest_after_channel(
            largest,
            cpu=is_cpu(wire.device),
            shm=self.shared is not None,
            shm_threshold=self.threshold,
            gathered=gathered,
        )
        if medium == routes.CHANNEL:  # where round 1 went through the channel (a closed one raises here, on every rank)
            found = wire.slot_medium.channel_of(wire, op)
            return None if found is None else ChannelRest(*found)
        if medium == routes.SHARED_MEMORY and self.shared is not None:
            return self.shared.medium(wire, largest, gathered, op)
        return None

    def worth(self, wire: Wire, moved: int, op: str, peer: Optional[int] = None) -> bool:
        # (the channel drains: no vote for it)
        return self.shared is not None and self.shared.worth(wire, moved, op, peer)
