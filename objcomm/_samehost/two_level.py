"""Two levels for a group whose ranks span hosts: the same-host channel inside each host, one leader per host
across them (issue 27).

When the ranks of a CPU (gloo) group run on several hosts and some host holds two or more of them, round 1 of
``all_gather``, ``gather`` and ``broadcast`` (and of the reductions, which end in a gather or a broadcast), the
votes of their calls and their second rounds move in three steps instead of one collective over every rank:

1. inside each host, what its ranks send goes to the host's *leader* (its lowest group rank) through the host's
   same-host channel (:mod:`objcomm._samehost.channel`);
2. the leaders exchange the hosts' bundles through a process group of their own: one collective of the leaders
   (round 2 of an all_gather at exact sizes, :func:`objcomm._transport.exchange.all_gather_rests`): the only backend
   calls, on one rank per host;
3. each leader hands what its host needs to its ranks through the channel. What decides the call (round 1's
   slots, a vote's answer) the host's ranks check, in one more hop of the channel, against what their leader read
   (:func:`objcomm._samehost.channel_checks.agree_on`), so that a leader cannot send its ranks down different
   routes. The bytes of a second round are not checked (a digest of gigabytes would cost more than moving them):
   a host's ranks trust their leader with other hosts' objects, as flat ranks trust gloo's forwarding; a lying
   leader can change what its own host's ranks receive, and what the other hosts receive from them (it speaks for
   them), not how many of the group's collectives another host's ranks take part in (docs/security.md).

Every rank ends with the bytes the group's backend would have given it, so the transport's checks, limits and
errors are those of the flat path, alike on every rank. A leader whose backend call fails fails its host's
channel, so that its ranks raise too. A broadcast receiver over its ``max_bytes`` drops what it receives and
raises alone, as on the flat path; a leader forwards it to its host first, one piece of ``chunk_bytes`` at a time
(its memory stays bounded by that piece).

Set up once per group, at its first all_gather, gather or broadcast that finds the group spans hosts (every rank reaches
it at the same call): which ranks share a host (from the group's own channel set-up, where it went through the group
at that call, else one all_gather through the group: :func:`objcomm._samehost.hosts.discover`), each host's *node
group* (made by its ranks alone) and the *leaders' group* (made by the leaders alone), both by
:func:`objcomm._transport.groups.sibling`, the channel of each node group (its set-up), and one vote through the
group (:func:`objcomm._transport.base.largest_of`), so that every rank takes two levels only where every host's
channel opened. Groups with one rank per host keep the flat path, as do NCCL groups (NCCL builds its own
rings and trees over NVLink and the network), scatter, all_to_all and send/recv. The reductions' tree takes the two
levels once they are set up, where every host holds consecutive ranks (:meth:`TwoLevel.tree_levels`): each host's
ranks up a tree of messages over the host's channel to the leader, then the leaders' tree through the group.

Example (four hosts of eight ranks)::

    objcomm.all_gather(obj)   # ranks 1-7 of each host: channel only; the four leaders: one all_gather each
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union, cast

from objcomm import _state
from objcomm._device import is_cpu
from objcomm._errors import CommunicationError
from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._format.slot import DEFAULT_PIECE, SlotInfo
from objcomm._samehost import hosts as _hosts
from objcomm._samehost.channel import LocalChannel
from objcomm._samehost.channel_checks import agree_on, echo, medium_of
from objcomm._samehost.channel_slots import ChannelRoute, ChannelSlots
from objcomm._samehost.mesh import MAX_PAYLOAD
from objcomm._samehost.two_level_moves import (
    Here,
    Levels,
    all_gather_fixed,
    as_leader,
    gather_fixed,
    largest_in_levels,
    relay,
)
from objcomm._settings import DEFAULT_SHM_THRESHOLD
from objcomm._transport import groups as _groups
from objcomm._transport import routes
from objcomm._transport.base import BACKEND, DIRECT, NOT_USED, Lease, Mine, NotUsed, Slot, TreeLevels, Wire, largest_of
from objcomm._transport.patterns import Pattern

# Operations whose second round moves through the whole group's backend, not two levels: their votes do too, so
# that a leader who tells its host another outcome than the leaders' cannot send its host's ranks into a different
# number of the group's collectives than the other hosts' (they would meet the others' next call)
FLAT_SECOND_ROUNDS = frozenset({"scatter", "all_to_all"})


@dataclass(frozen=True)
class TwoLevel(ChannelSlots):
    """The same-host channel's slot medium (:class:`ChannelSlots`), which on a group that spans hosts
    moves the slots of all_gather, gather and broadcast, and the votes of a call, through two levels."""

    def here(self, wire: Wire, op: str, set_up: bool = False) -> Optional[Here]:
        """This call's two levels, or None where the flat path moves it (the same answer on every rank).
        ``set_up``: learn the group's hosts first if they are not known yet (round 1 of a collective only)."""
        if not is_cpu(wire.device) or wire.size < 3 or wire.slot > MAX_PAYLOAD:
            return None  # (slots above a channel message: no host's channel takes them, on every rank alike)
        known: Dict[Any, Optional[Levels]] = _state.group_facts(wire.group).levels
        if self.separate not in known:
            if not set_up:
                return None
            known[self.separate] = _set_up(self, wire, op)
        levels = known[self.separate]
        if levels is None:
            return None
        me = wire.rank
        channel = None
        if levels.node is not None:
            node_wire = wire._replace(
                group=levels.node,
                ranks=levels.node_ranks,
                rank=levels.place[me],
                slot_medium=BACKEND,
                rest_media=DIRECT,
                tag=0,
            )
            # round 1 opens it again after a failure (a collective of the host's ranks, all at this call)
            channel = self.channel(node_wire, op, True) if set_up else _open(self.channel_of(node_wire, op))
            if channel is None:
                raise CommunicationError(f"{op}: this host's same-host channel did not reopen")
        leader = None
        if levels.leaders is not None:
            leader = wire._replace(
                group=levels.leaders,
                ranks=levels.leader_ranks,
                rank=levels.host_of[me],
                slot_medium=BACKEND,
                rest_media=DIRECT,
                tag=0,
            )
        return Here(levels, channel, self.spin, leader, levels.host_of[me], levels.place[me])

    def exchange(self, wire: Wire, at: Pattern, mine: Mine, op: str) -> Union[Dict[int, Slot], NotUsed]:
        """The channel's, on one host; across hosts an all_gather's and a broadcast's round 1 on two levels (not a
        gather's: it keeps its gather of slots to the destination, :meth:`gather`), the rest through the group."""
        got = super().exchange(wire, at, mine, op)
        if got is not NOT_USED or at.op not in ("all_gather", "broadcast") or op == "gather":
            return got
        wire = wire._replace(chunk=DEFAULT_PIECE)  # round 1: in pieces no rank's settings change (so below)
        here = self.here(wire, op, set_up=True)
        if here is None:
            return NOT_USED
        slot = cast(Optional[Slot], mine)
        if at.op == "broadcast":
            src = at.sources[0] if at.sources else wire.rank
            received = relay(here, wire, None if slot is None else memoryview(slot), wire.slot, src, op, keep=True)
            assert received is not None
            return {src: received} if at.sources else {}
        assert slot is not None
        slots = all_gather_fixed(here, wire, slot, wire.slot, op, self.threshold if self.shm else None)
        return {r: slots[r] for r in at.sources}

    def gather(self, wire: Wire, slot: Slot, dst: int, op: str) -> Union[Optional[List[Slot]], NotUsed]:
        wire = wire._replace(chunk=DEFAULT_PIECE)
        here = self.here(wire, op, set_up=True)
        return NOT_USED if here is None else gather_fixed(here, wire, slot, wire.slot, dst, op)

    def share(self, wire: Wire, data: Optional[Slot], length: int, src: int, op: str) -> Union[Slot, NotUsed]:
        wire = wire._replace(chunk=DEFAULT_PIECE)
        here = self.here(wire, op)  # a gather's round 1 set it up
        if here is None:
            return NOT_USED
        got = relay(here, wire, None if data is None else memoryview(data), length, src, op, keep=True)
        assert got is not None
        if here.channel is not None:  # a decision (the destination's word, the table after a failure): every rank of
            echo(here.channel, bytes(got), here.spin, op, "shared words")  # a host must act on what its leader read
        return got

    def tree_levels(self, wire: Wire, op: str) -> Optional[TreeLevels]:
        """Two levels for a reduction's tree where a collective of the group set them up (round 1 of an all_gather,
        gather or broadcast: the same on every rank) and every host holds consecutive ranks; the host's channel
        reopened first if it failed (a collective of the host's ranks, all in this call)."""
        levels = _state.group_facts(wire.group).levels.get(self.separate)
        ends = None if levels is None else levels.ends
        if ends is None:
            return None
        here = self.here(wire, op, set_up=True)
        if here is None:
            return None
        leaders, lasts = ends
        host = None
        if here.channel is not None:
            host = wire._replace(slot_medium=HostEdges(here.channel, self.spin, leaders[here.host]), rest_media=DIRECT)
        return TreeLevels(host, here.host, leaders, lasts, functools.partial(as_leader, here, op))

    def largest(
        self, wire: Wire, values: Sequence[int], op: str, moved_at: Optional[int] = None
    ) -> Union[List[int], NotUsed]:
        got = super().largest(wire, values, op, moved_at)
        if got is not NOT_USED or op in FLAT_SECOND_ROUNDS:
            return got
        here = self.here(wire, op)
        return NOT_USED if here is None else largest_in_levels(here, values, op)

    def agree(self, wire: Wire, infos: Sequence[SlotInfo], op: str) -> None:
        super().agree(wire, infos, op)
        here = self.here(wire, op)
        # (a gather's round 1 went through the group: its slots only to the destination, unless one failed)
        if op != "gather" and here is not None and here.channel is not None:  # the leaders read alike: the backend
            agree_on(here.channel, here.spin, infos, op, medium_of(infos, op, self.shm, self.threshold, True))


@dataclass(frozen=True)
class HostEdges:
    """The slot medium of a reduction's tree inside a host (:meth:`TwoLevel.tree_levels`): the group's
    wire, whose send/recv between the host's ranks (group ranks ``base`` on) take the host's channel; nothing else
    runs on it."""

    channel: LocalChannel
    spin: Optional[float]
    base: int  # the host's lowest group rank: its place 0 on the channel

    def p2p(self, wire: Wire, op: str, peer: Optional[int]) -> Lease:
        return HostRoute(self.channel, self.spin, self.base)

    def exchange(self, *args: Any) -> NotUsed:
        return NOT_USED

    gather = share = gather_words = largest = exchange

    def agree(self, wire: Wire, infos: Sequence[Any], op: str) -> None:
        pass

    def tree_levels(self, wire: Wire, op: str) -> None:
        return None

    def channel_of(self, wire: Wire, op: str) -> None:
        return None

    def checks_slots(self, wire: Wire) -> bool:
        return True  # no collective runs on it; a send's envelope names its slot size


class HostRoute(ChannelRoute):
    """:class:`ChannelRoute` over a host's channel, its peers named by group rank (``base`` on: place 0), so that the
    transport's messages and errors name them as on every other path (the route's own protocol errors, about a peer
    that breaks the protocol, name its place on the host)."""

    __slots__ = ("base",)

    def __init__(self, channel: LocalChannel, spin: Optional[float], base: int) -> None:
        super().__init__(channel, spin)
        self.base = base

    def send(self, wire: Wire, slot: Slot, dst: int, asks: bool = False) -> int:
        return super().send(wire, slot, dst - self.base, asks)

    def send_whole(self, wire: Wire, slot: Slot, out: Outgoing, info: SlotInfo, dst: int) -> bool:
        return super().send_whole(wire, slot, out, info, dst - self.base)

    def recv(self, wire: Wire, src: Optional[int], op: str) -> Tuple[int, Slot, int]:
        sender, slot, message = super().recv(wire, None if src is None else src - self.base, op)
        return sender + self.base, slot, message

    def answer(self, wire: Wire, dst: int, message: int, code: int) -> None:
        super().answer(wire, dst - self.base, message, code)

    def answer_of(self, wire: Wire, src: int, message: int, op: str) -> int:
        return super().answer_of(wire, src - self.base, message, op)

    def send_words(self, wire: Wire, words: Sequence[int], dst: int, message: int) -> None:
        super().send_words(wire, words, dst - self.base, message)

    def recv_words(self, wire: Wire, count: int, src: int, message: int, op: str) -> List[int]:
        return super().recv_words(wire, count, src - self.base, message, op)

    def send_rest(self, wire: Wire, out: Outgoing, info: SlotInfo, dst: int, message: int) -> None:
        super().send_rest(wire, out, info, dst - self.base, message)

    def recv_rest(
        self, wire: Wire, info: SlotInfo, sizes_of: SizesOf, src: int, message: int, op: str, drain: bool = False
    ) -> Incoming:
        return super().recv_rest(wire, info, sizes_of, src - self.base, message, op, drain)


_STRATEGIES: Dict[Tuple[Union[bool, int], Optional[int], bool, int], TwoLevel] = {}


def strategy(
    separate: Union[bool, int], spin_us: Optional[int], shm: bool = False, threshold: int = DEFAULT_SHM_THRESHOLD
) -> TwoLevel:
    """The slot medium for these settings, built once (the wire of every call holds one)."""
    key = (separate, spin_us, shm, threshold)
    found = _STRATEGIES.get(key)
    if found is None:
        found = _STRATEGIES.setdefault(key, TwoLevel(separate, spin_us, shm, threshold))
    return found


# -- set-up --------------------------------------------------------------------------------------------------------
def _set_up(slots: TwoLevel, wire: Wire, op: str) -> Optional[Levels]:
    """The group's levels (a collective of every rank), or None where the flat path stays: one host (the channel
    of the group itself has it), one rank per host, or a host whose channel did not open."""
    known = _state.group_facts(wire.group).hosts  # shared memory's too: it then knows the group spans hosts
    found = known.get(slots.separate)
    if found is None:
        found = known[slots.separate] = _hosts.discover(wire, slots.separate, op)
    keys = found.keys
    by_host: Dict[int, List[int]] = {}
    for r, key in enumerate(keys):
        by_host.setdefault(key, []).append(r)
    hosts = tuple(tuple(ranks) for ranks in by_host.values())
    if not routes.two_levels(hosts=len(hosts), widest=max(len(h) for h in hosts), cpu=True, local=True):
        return None
    host_of, place = [0] * wire.size, [0] * wire.size
    for h, members in enumerate(hosts):
        for i, r in enumerate(members):
            host_of[r], place[r] = h, i
    mine = hosts[host_of[wire.rank]]
    node_ranks = tuple(wire.ranks[r] for r in mine)
    leader_ranks = tuple(wire.ranks[h[0]] for h in hosts)
    node = leaders = levels = None
    works = 1
    try:  # each host's ranks make its group, then the leaders theirs: no rank waits on another host's
        if len(mine) > 1:
            node = _sibling(wire.group, f"objcomm-host-{slots.separate}", node_ranks)
        if place[wire.rank] == 0:
            leaders = _sibling(wire.group, f"objcomm-leaders-{slots.separate}", leader_ranks)
        levels = Levels(
            hosts, tuple(host_of), tuple(place), max(len(h) for h in hosts), node, node_ranks, leaders, leader_ranks
        )
        if node is not None:
            node_wire = wire._replace(
                group=node, ranks=node_ranks, rank=place[wire.rank], slot_medium=BACKEND, rest_media=DIRECT, tag=0
            )
            works = int(slots.channel(node_wire, f"{op} (opening this host's channel)", True) is not None)
    except CommunicationError:
        works = 0
    # whether every host's works: a vote of "failed" (the maximum: recursive doubling, then a broadcast, 2 log2 W
    # steps on gloo, where an all_reduce is a ring of 2(W - 1): 0.8 s at 8192 ranks across hosts)
    [failed] = largest_of(wire._replace(slot_medium=BACKEND), [1 - works], f"{op} (agreeing on two levels)")
    return None if failed else levels


def _sibling(group: Any, kind: str, ranks: Tuple[int, ...]) -> Any:
    """A gloo group of ``ranks`` (global) of ``group``, destroyed with it; named after ``kind`` (which names the
    hosts' setting, ``separate``) and the ranks, so that every subset has a name of its own: a group's rendezvous
    keys in the store are its name's, and a second group of one name would meet the first one's (a test's simulated
    hosts of another size can make the same subset again, e.g. ranks 6 and 7 in hosts of two and of three)."""
    members = hashlib.blake2b(repr(ranks).encode(), digest_size=8).hexdigest()
    try:
        made = _groups.sibling(group, f"{kind}-{members}", "gloo", ranks=ranks)
    except Exception as exc:  # torch's private helper differs: the flat path stays, on every rank
        raise CommunicationError(f"could not make the group of ranks {list(ranks)}: {exc}") from exc
    weakref.finalize(group, _groups.forget, made).atexit = False
    return made


def _open(found: Optional[Tuple[LocalChannel, Optional[float]]]) -> Optional[LocalChannel]:
    return None if found is None else found[0]
