"""Round 1 through the same-host channel: the slots of collectives between the processes of one host.

:class:`SameHostSlots` is a first-round strategy (:class:`objcomm._wire.FirstRound`): when every rank
of a group runs on this host, the slots of ``all_gather``/``gather``, ``broadcast``, ``scatter`` and
``all_to_all`` (and of the reductions, which end in one of these) move through a
:class:`objcomm._local.LocalChannel` and never touch the group's backend. Everything after round 1
(votes, second rounds, shared memory) is unchanged, and so is every failure: a slot carries an
error report as before, and a dead peer or a wait past the group's timeout raises
:class:`~objcomm.CommunicationError` (the channel then closes, so the others raise at once too).

When the channel is used (the same answer on every rank, decided without talking to the others):
``local`` is on, the group has two ranks or more, its bytes move on the CPU (not NCCL) and a slot
fits one channel message. The first such call on a group opens the channel, a collective over the
group itself (:meth:`LocalChannel.open`: one ``all_gather`` of identities, one ``all_reduce``); a
group whose ranks are not all on this host gets ``None``, kept too, so later calls go straight to
the backend. The channel is kept in :func:`objcomm._state.group_facts` and closed when the group is
collected or at exit. Not routed here: ``send``/``recv`` (their slots may come from several threads
at once, ``isend``/``irecv`` lanes, and the channel takes one thread at a time). Async collectives run on
the group's shadow (:mod:`objcomm._requests`), a group of its own, with a channel of its own.
"""

from __future__ import annotations

import datetime
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from . import _local, _state
from ._device import group_timeout
from ._errors import CommunicationError
from ._wire import NOT_USED, NotUsed, Slot, Wire


@dataclass(frozen=True)
class SameHostSlots:
    """Round-1 slots through the group's same-host channel, opened on the first call that may use it."""

    separate: bool = False  # tests: every rank looks like a host of its own (the channel never opens)

    def channel(self, wire: Wire, op: str) -> Optional[_local.LocalChannel]:
        """The group's channel, or None (the backend moves the slots): the same answer on every rank."""
        if wire.size < 2 or wire.device.type != "cpu" or wire.slot > _local.MAX_PAYLOAD:
            return None
        try:
            weakref.ref(wire.group)
        except TypeError:  # nowhere to keep a channel: it would be opened again on every call
            return None
        known = _state.group_facts(wire.group).local
        if self.separate not in known:
            channel = _local.LocalChannel.open(wire, timeout=_seconds(group_timeout(wire.group)),
                                               separate=self.separate, op=f"{op} (opening the same-host channel)")
            known[self.separate] = channel
            if channel is not None:  # also runs at exit
                weakref.finalize(wire.group, channel.close)
        return known[self.separate]

    def all_gather(self, wire: Wire, slot: Slot, op: str) -> Union[Sequence[Slot], NotUsed]:
        channel = self.channel(wire, op)
        if channel is None:
            return NOT_USED
        return _checked(wire, channel, channel.all_gather(slot), op)

    def broadcast(self, wire: Wire, slot: Optional[Slot], src: int, op: str) -> Union[Slot, NotUsed]:
        channel = self.channel(wire, op)
        if channel is None:
            return NOT_USED
        return _checked(wire, channel, [channel.broadcast(slot, src)], op)[0]

    def scatter(self, wire: Wire, slots: Optional[Sequence[Slot]], src: int, op: str) -> Union[Slot, NotUsed]:
        channel = self.channel(wire, op)
        if channel is None:
            return NOT_USED
        return _checked(wire, channel, [channel.scatter(slots, src)], op)[0]

    def all_to_all(self, wire: Wire, slots: Sequence[Slot], op: str) -> Union[Sequence[Slot], NotUsed]:
        channel = self.channel(wire, op)
        if channel is None:
            return NOT_USED
        return _checked(wire, channel, channel.all_to_all(slots), op)

    def __repr__(self) -> str:
        return f"SameHostSlots(separate={self.separate})"


SAME_HOST = {False: SameHostSlots(False), True: SameHostSlots(True)}  # built once: one per call would do


def _seconds(timeout: Any) -> float:
    if isinstance(timeout, datetime.timedelta):
        return max(timeout.total_seconds(), 0.001)
    return _local.DEFAULT_TIMEOUT


def _checked(wire: Wire, channel: _local.LocalChannel, slots: Sequence[Slot], op: str) -> Sequence[Slot]:
    """``slots``, each ``wire.slot`` bytes long; else ranks disagree on ``slot_bytes`` (the backend would fail
    too): the channel closes, so that the others raise as well."""
    for slot in slots:
        if len(slot) != wire.slot:
            channel.close()
            raise CommunicationError(
                f"{op}: rank {wire.rank} received a {len(slot):,}-byte slot over the same-host channel but uses "
                f"slot_bytes={wire.slot:,}; every rank of a group must use the same slot_bytes"
            )
    return slots
