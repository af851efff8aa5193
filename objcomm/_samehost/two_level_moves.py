"""What two levels move, and how (:mod:`objcomm._samehost.two_level` tells when): every rank's fixed-size bytes
(:func:`all_gather_fixed`), every rank's on one (:func:`gather_fixed`), one rank's on every rank (:func:`relay`),
the largest of every rank's words (:func:`largest_in_levels`); and the steps they share: a host's ranks to their
leader and back through the host's channel, a leader's backend step (:func:`as_leader`: where it fails, its host's
channel fails too, so that the host's ranks raise as well).
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, TypeVar, Union, cast

import torch
import torch.distributed as dist

from objcomm._errors import CommunicationError, FrameError
from objcomm._format.slot import read_slot
from objcomm._format.tensors import bytes_tensor
from objcomm._samehost.channel import LocalChannel
from objcomm._samehost.channel_checks import echo
from objcomm._samehost.channel_rests import CHUNK, all_received, checked, chunks, in_time, streamed
from objcomm._samehost.inbox import REST
from objcomm._samehost.sealed import Sealed, SealedSegment, map_parts, write_sealed
from objcomm._transport import routes
from objcomm._transport.base import Slot, Wire, all_gather_single, guarded, largest_of
from objcomm._transport.broadcast import spread_bytes
from objcomm._transport.bytes import Deadline, host_view
from objcomm._transport.patterns import pattern
from objcomm._transport.slot_tree import gather_up_tree

T = TypeVar("T")


@dataclass(frozen=True)
class Levels:
    """A group's hosts as this rank learned them, and the groups that carry its two levels (this rank's)."""

    hosts: Tuple[Tuple[int, ...], ...]  # each host's group ranks, ascending; hosts in the order of their lowest rank
    host_of: Tuple[int, ...]  # group rank -> the index of its host
    place: Tuple[int, ...]  # group rank -> its index among its host's ranks (0: the host's leader)
    widest: int  # the most ranks on one host
    node: Any  # this rank's host's group (None: the host's only rank)
    node_ranks: Tuple[int, ...]  # its global ranks
    leaders: Any  # the leaders' group, on the leaders (None elsewhere)
    leader_ranks: Tuple[int, ...]  # its global ranks, one per host
    # what a gather's round 1 told a leader, for its round 2 (a group's collectives run one at a time): its host's
    # rests ("host"), and on the destination's leader every host's total ("totals"); the destination's is 0
    memo: Dict[str, List[int]] = field(default_factory=dict, compare=False)

    @functools.cached_property
    def ends(self) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        """Each host's lowest and highest group rank, where the reductions' tree takes the two levels
        (:func:`~objcomm._transport.routes.tree_on_two_levels`: every host holds consecutive ranks); else None."""
        if not routes.tree_on_two_levels(self.hosts):
            return None
        return tuple(host[0] for host in self.hosts), tuple(host[-1] for host in self.hosts)


class Here(NamedTuple):
    """One call's view of the two levels on this rank."""

    levels: Levels
    channel: Optional[LocalChannel]  # this host's channel (None: this rank is its host's only one)
    spin: Optional[float]
    leader: Optional[Wire]  # the leaders' wire, on a leader (None on the other ranks)
    host: int  # this rank's host
    place: int  # this rank's index in its host


def as_leader(here: Here, op: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """A leader's backend step: where it fails, this host's channel fails too, so that the host's ranks, waiting for
    their leader, raise as well."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        if here.channel is not None and not here.channel.closed:
            with contextlib.suppress(CommunicationError):
                here.channel.fail(op, f"the leader of this host failed: {exc}", exc)
        raise


def among_leaders(here: Here, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A collective of torch.distributed (``fn``) on the leaders' group, :func:`guarded`, as :func:`as_leader`."""
    leader = here.leader
    assert leader is not None
    return as_leader(here, op, guarded, op, leader, fn, *args, group=leader.group, **kwargs)


def to_leader(here: Here, data: Slot, op: str) -> Optional[List[Slot]]:
    """Every rank of this host's ``data`` (each at most one channel message), in host order, on the leader; None
    on the others."""
    if here.channel is None:
        return [data]
    if here.place:
        here.channel.gather(data, 0, here.spin, op)
        return None
    got = here.channel.gather(None, 0, here.spin, op)
    return [data, *(got[i] for i in range(1, len(here.levels.hosts[here.host])))]


def publish(here: Here, views: Sequence[memoryview], total: int, op: str) -> None:
    """``views`` (``total`` bytes back to back) from this rank to every other rank of its host (:func:`take`)."""
    assert here.channel is not None
    at = pattern("broadcast", me=here.place, world=here.channel.size, root=here.place)
    streamed(here.channel, at, chunks(list(views)), (), total, True, here.spin, op)
    all_received(here.channel, total, here.spin, op)


def cut(data: memoryview, sizes: Sequence[int]) -> List[memoryview]:
    """``data`` cut into consecutive parts of ``sizes`` bytes."""
    parts, at = [], 0
    for n in sizes:
        parts.append(data[at : at + n])
        at += n
    return parts


def take(here: Here, total: int, src: int, op: str, keep: bool = True) -> Optional[bytearray]:
    """What host rank ``src`` publishes (``total`` bytes, :func:`publish`); ``keep=False``: read and dropped."""
    assert here.channel is not None
    members = here.levels.hosts[here.host]
    at = pattern("broadcast", me=here.place, world=here.channel.size, root=src)
    got = streamed(here.channel, at, None, [total] * len(members), total, keep, here.spin, op, names=members)[src]
    all_received(here.channel, total, here.spin, op)
    if not keep:
        return None
    return bytearray() if got is None else cast(bytearray, got)  # (a buffer of its own: no views were given)


def publish_shared(
    here: Here, views: Sequence[memoryview], op: str, sealed: Optional[SealedSegment] = None, width: int = 0
) -> None:
    """The leader: ``views`` to every rank of its host in one sealed memory file (:mod:`objcomm._samehost.sealed`):
    one copy on the host, which its ranks map (:func:`take_shared`); a rank that cannot open it says so, and gets
    them through the channel instead. ``sealed``: the file, sealed already, laid out by
    :func:`~objcomm._samehost.sealed.table_layout` with ``width`` (a :class:`~objcomm._samehost.sealed.SealedTable`
    the leaders' exchange wrote in place: no copy on the host at all); ``views`` then are views of it."""
    assert here.channel is not None
    segment = sealed
    try:
        if segment is None:
            segment = write_sealed("objcomm-two-levels", None, list(views))
        where = _WHERE.pack(os.getpid(), segment.fd, width)
    except OSError:  # no memory files here: every rank takes the channel
        where = b""
    try:
        here.channel.broadcast(where, 0, here.spin, op)
        answers = here.channel.gather(None, 0, here.spin, op)  # once every rank mapped it, or gave up
    finally:
        if segment is not None:
            segment.release()
    for place in sorted(answers):
        if answers[place]:
            send_within(here, place, views)


def take_shared(here: Here, sizes: Sequence[int], op: str) -> List[memoryview]:
    """What the leader publishes with :func:`publish_shared` (parts of ``sizes`` bytes), as views on its file."""
    assert here.channel is not None
    where = here.channel.broadcast(None, 0, here.spin, op)
    parts = None
    if len(where) == _WHERE.size:
        try:
            pid, fd, width = _WHERE.unpack(where)
            parts = map_parts(Sealed(pid, fd), sizes, width)
        except (OSError, FrameError):  # (another pid namespace, a file to refuse): the channel instead
            parts = None
    elif where:
        here.channel.fail(op, f"the leader sent {len(where):,} bytes where a shared file's name was due")
    here.channel.gather(b"" if parts is not None else b"\x01", 0, here.spin, op)
    if parts is not None:
        return parts
    return cut(memoryview(receive_within(here, 0, sum(sizes), op)), sizes)


# a sealed file's writer pid and descriptor, and its layout's width (sealed.table_layout; 0: packed parts)
_WHERE = struct.Struct("<qqq")


def all_gather_fixed(
    here: Here, wire: Wire, data: Slot, width: int, op: str, shared_from: Optional[int] = None
) -> List[memoryview]:
    """Every rank's ``data`` (``width`` bytes each), in group-rank order: to the leaders, one all_gather of the
    leaders (each host's, padded to the widest host), back to every rank (in one shared file from ``shared_from``
    bytes on: a table of 4 KiB slots reaches 2 MiB at 512 ranks)."""
    levels = here.levels
    total = len(levels.hosts) * levels.widest * width
    shared = shared_from is not None and total >= shared_from
    mine = to_leader(here, data, op)
    if mine is None:
        everyone: Union[bytearray, memoryview, None] = (
            take_shared(here, [total], op)[0] if shared else take(here, total, 0, op)
        )
        assert everyone is not None
    else:
        bundle = bundle_of(here, mine, width, op)
        everyone = bytearray(total)
        assert here.leader is not None
        among_leaders(
            here,
            op,
            all_gather_single,
            torch.frombuffer(everyone, dtype=torch.uint8),
            torch.frombuffer(bundle, dtype=torch.uint8),
        )
        if here.channel is not None and shared:
            publish_shared(here, [memoryview(everyone)], op)
        elif here.channel is not None:
            publish(here, [memoryview(everyone)], total, op)
    view = memoryview(everyone)
    return [view[(h * levels.widest + i) * width :][:width] for h, i in zip(levels.host_of, levels.place)]


def bundle_of(here: Here, items: Sequence[Slot], width: int, op: str) -> bytearray:
    """The leader: its host's ``items`` (``width`` bytes each) back to back, padded to the widest host."""
    levels = here.levels
    bundle = bytearray(levels.widest * width)
    for i, item in enumerate(items):
        if len(item) != width:
            assert here.channel is not None
            here.channel.fail(
                op,
                f"rank {levels.hosts[here.host][i]} sent {len(item):,} bytes where {width:,} were "
                "due: every rank of a group must use the same slot_bytes",
            )
        bundle[i * width : (i + 1) * width] = item
    return bundle


def gather_fixed(here: Here, wire: Wire, data: Slot, width: int, dst: int, op: str) -> Optional[List[Slot]]:
    """Every rank's ``data`` (slots: ``width`` bytes each) on group rank ``dst``, in group-rank order (None
    elsewhere): to the leaders, one gather of the leaders to the leader of ``dst``'s host (from
    :data:`~objcomm._transport.routes.TREE_GATHER_FROM` leaders up a tree of them, each slot trimmed to what it
    carries: :func:`~objcomm._transport.slot_tree.gather_up_tree`), on to ``dst``. Each
    leader notes its host's rests, and ``dst``'s leader every host's total (:attr:`Levels.memo`), for round 2."""
    levels = here.levels
    mine = to_leader(here, data, op)
    home = levels.host_of[dst]
    table: Optional[bytearray] = None
    if mine is not None:
        packed = bundle_of(here, mine, width, op)  # (checks every length first)
        levels.memo["host"] = [
            0 if r == dst else read_slot(memoryview(item)).second_round_bytes
            for r, item in zip(levels.hosts[here.host], mine)
        ]
        assert here.leader is not None
        if routes.slots_up_tree(world=len(levels.hosts)):  # up a tree of the leaders, each slot trimmed
            table = as_leader(here, op, gather_up_tree, here.leader, packed, width, home, op, levels.widest)
        else:  # the backend's gather of every host's slots, padded to the widest host
            parts = None
            if here.host == home:
                table = bytearray(len(levels.hosts) * levels.widest * width)
                parts = list(torch.frombuffer(table, dtype=torch.uint8).chunk(len(levels.hosts)))
            bundle = torch.frombuffer(packed, dtype=torch.uint8)
            among_leaders(here, op, dist.gather, bundle, parts, dst=here.leader.ranks[home])
    if here.host == home and levels.place[dst]:  # the leader hands the table to dst
        if here.place == 0:
            assert table is not None
            send_within(here, levels.place[dst], [memoryview(table)])
        elif wire.rank == dst:
            table = receive_within(here, 0, len(levels.hosts) * levels.widest * width, op)
    if table is None or wire.rank != dst and here.place:
        return None
    view = memoryview(table)
    slots: List[Slot] = [view[(h * levels.widest + i) * width :][:width] for h, i in zip(levels.host_of, levels.place)]
    if here.place == 0:
        moved = [0 if r == dst else read_slot(memoryview(slot)).second_round_bytes for r, slot in enumerate(slots)]
        levels.memo["totals"] = [sum(moved[r] for r in host) for host in levels.hosts]
    return slots if wire.rank == dst else None


# a stream from one rank of a host to another (objcomm._samehost.mesh's parts of a send, under an id of its own)
_STREAM = 0xFFFFFFFF


def send_within(here: Here, to: int, views: Sequence[memoryview]) -> None:
    """``views``, back to back, to host rank ``to`` through the channel, in messages of :data:`CHUNK` bytes."""
    assert here.channel is not None
    for chunk in chunks(list(views)):
        here.channel.send_part(REST, chunk, to, 0, _STREAM)


def receive_within(here: Here, source: int, total: int, op: str, start: Optional[float] = None) -> bytearray:
    """The ``total`` bytes host rank ``source`` sends this rank with :func:`send_within`, within the group's timeout
    from ``start`` (default: now; a leader taking several ranks' streams gives them one), once more at most."""
    into = bytearray(total)
    receive_into(here, source, memoryview(into), op, start)
    return into


def receive_into(here: Here, source: int, into: memoryview, op: str, start: Optional[float] = None) -> None:
    """:func:`receive_within` into ``into`` (its length: the bytes due), where the caller holds the room already."""
    assert here.channel is not None
    total = len(into)
    start = time.monotonic() if start is None else start
    for index in range(-(-total // CHUNK)):
        in_time(here.channel, start, index, total, op)
        got = here.channel.recv_part(REST, source, 0, _STREAM, here.spin)
        at = checked(here.channel, got, index, total, here.levels.hosts[here.host][source], op)
        into[at : at + len(got)] = got


def relay(
    here: Here, wire: Wire, data: Optional[memoryview], length: int, src: int, op: str, keep: bool, agreed: bool = False
) -> Optional[memoryview]:
    """Group rank ``src``'s ``length`` bytes (``data`` there) on every rank: through its host's channel to its host,
    through the leaders' group (broadcasts of ``wire.chunk`` bytes, or of one channel message where that is more; or,
    after the receivers' vote, ``agreed``, as a scatter then an all_gather where :func:`routes.leaders_spread` says
    so) to the other leaders, through their channels to their hosts. ``keep=False``: this rank reads them and drops
    them (None); a leader still forwards each piece to its host before it reads the next."""
    levels = here.levels
    source_host = levels.host_of[src]
    got: Optional[memoryview] = None
    if wire.rank == src:
        assert data is not None
        if here.channel is not None:
            publish(here, [data], length, op)
        got = data
    elif here.host == source_host and here.channel is not None:  # the leader keeps them: it forwards them next
        taken = take(here, length, levels.place[src], op, keep=keep or here.place == 0)
        got = None if taken is None else memoryview(taken)
    if here.leader is not None:  # the leaders: from the source's host's leader, piece by piece
        got = leaders_broadcast(here, got, length, source_host, op, keep, agreed)
    elif here.host != source_host:
        taken = take(here, length, 0, op, keep=keep)
        got = None if taken is None else memoryview(taken)
    return got if keep else None


def leaders_broadcast(
    here: Here, got: Optional[memoryview], length: int, source_host: int, op: str, keep: bool, agreed: bool = False
) -> Optional[memoryview]:
    """A leader's part of :func:`relay`: the source host's leader broadcasts ``got`` to the other leaders, which
    forward each piece of ``chunk_bytes`` to their host as it arrives (kept only where ``keep``); where the receivers
    voted (``agreed``) and :func:`routes.leaders_spread` says so, the leaders spread it instead (a scatter, then an
    all_gather: :func:`objcomm._transport.broadcast.spread_bytes`), each then forwarding it to its host."""
    leader = here.leader
    assert leader is not None
    deadline = Deadline(leader, op, f"a relay of {length:,} bytes among the leaders")  # once for every piece
    # pieces of whole channel messages (powers of two both), which each leader forwards to its host as they come
    step = max(leader.chunk, CHUNK)
    if routes.leaders_spread(leaders=leader.size, moved=length, agreed=agreed):
        source = bytes_tensor(got) if here.host == source_host else None
        spread = as_leader(here, op, spread_bytes, leader, source, length, source_host, op, deadline)
        if here.host == source_host:
            return got  # (the source's host has it from the source)
        whole = host_view(spread)
        if here.channel is not None:
            publish(here, [whole], length, op)  # (whole: as the source's host has it from the source)
        return whole if keep else None
    if here.host == source_host:
        assert got is not None
        for at in range(0, length, step):
            deadline.left(at, length)
            sent = bytes_tensor(got[at : at + step])  # (read-only where it came from the caller's bytes)
            among_leaders(here, op, dist.broadcast, sent, src=leader.ranks[source_host])
        return got
    into = bytearray(length) if keep else bytearray(min(length, step))
    for at in range(0, length, step):
        n = min(step, length - at)
        piece = memoryview(into)[at : at + n] if keep else memoryview(into)[:n]
        deadline.left(at, length)
        among_leaders(
            here, op, dist.broadcast, torch.frombuffer(piece, dtype=torch.uint8), src=leader.ranks[source_host]
        )
        if here.channel is not None:
            for chunk in chunks([piece]):
                here.channel.broadcast(chunk, 0, here.spin, op)
    if here.channel is not None:
        all_received(here.channel, length, here.spin, op)
    return memoryview(into) if keep else None


def largest_in_levels(here: Here, values: Sequence[int], op: str) -> List[int]:
    """The element-wise maximum of every rank's ``values``: each host's on its leader, the leaders' by
    :func:`objcomm._transport.base.largest_of` (recursive doubling), back to the host, which checks that every rank
    read the same."""
    packing = struct.Struct(f"<{len(values)}q")
    rows = to_leader(here, packing.pack(*values), op)
    if rows is None:
        assert here.channel is not None
        got = here.channel.broadcast(None, 0, here.spin, op)
        if len(got) != packing.size:
            here.channel.fail(op, f"the leader sent {len(got):,} bytes where {packing.size} were due: a protocol error")
        result = list(packing.unpack(got))
    else:
        for i, row in enumerate(rows):
            if len(row) != packing.size:
                assert here.channel is not None
                here.channel.fail(
                    op,
                    f"rank {here.levels.hosts[here.host][i]} sent {len(row):,} bytes of words "
                    f"where {packing.size} were due (the ranks are at different calls, or a protocol "
                    "error)",
                )
        mine = [max(column) for column in zip(*(packing.unpack(row) for row in rows))]
        assert here.leader is not None
        result = as_leader(here, op, largest_of, here.leader, mine, op)
        if here.channel is not None:
            here.channel.broadcast(packing.pack(*result), 0, here.spin, op)
    if here.channel is not None:
        echo(here.channel, packing.pack(*result), here.spin, op, "votes")
    return result
