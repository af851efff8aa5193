"""Broadcast's rounds over the backend (:mod:`objcomm._transport.rounds` tells the two rounds): the source's slot to
every rank (on NCCL with every receiver's ``max_bytes``), the receivers' vote where they must answer first and their
limits did not come with the slot, then the rest, asking the wire's media first.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from objcomm._errors import CommunicationError, ObjcommError
from objcomm._format import limits as _limits
from objcomm._format.frame import error_frame
from objcomm._format.message import SLOT_PREFIX_BYTES, Incoming, Outgoing, SizesOf
from objcomm._format.slot import SlotInfo, read_slot
from objcomm._transport import p2p as _p2p
from objcomm._transport import routes
from objcomm._transport.base import INTERNAL_TAG, NOT_USED, TreeLevels, Wire, guarded
from objcomm._transport.bytes import Deadline, at_pieces, broadcast_bytes, host_view, receive_buffer, to_device, zeroed
from objcomm._transport.call_clock import one_call, round_one_done
from objcomm._transport.exchange import chunked, posted
from objcomm._transport.patterns import binomial, spread
from objcomm._transport.rounds import (
    REFUSE_LIMIT,
    SlotMemory,
    _agreement_needed,
    _on_device,
    _slot,
    _vote_refusals,
    long_report,
    refused_alike,
    route_of,
    slots_through_medium,
)


# -- broadcast -------------------------------------------------------------------------------
def broadcast(
    wire: Wire,
    out: Optional[Outgoing],
    sizes_of: SizesOf,
    src: int,
    *,
    tree: bool = False,
    levels: Optional[TreeLevels] = None,
    route: Optional[routes.CallRoute] = None,
    memory: Optional[SlotMemory] = None,
) -> Incoming:
    """``src``'s frame and tensors on every rank (``out`` is ignored elsewhere). ``memory``: the group's
    :class:`~objcomm._transport.rounds.SlotMemory` for its broadcasts, where their slots go through the backend (then
    the slot it says, and this call's slot remembered). ``tree`` (all_reduce's result, from
    group rank 0, whose reduce tree has just run, where :func:`objcomm._transport.routes.result_down_tree` says so):
    where round 1 would go through the group, or through two levels (``levels``: the reduce tree's), the frame goes
    down that tree's edges instead (:func:`down_tree`). ``route``: the group's calls' route
    (:class:`~objcomm._transport.routes.CallRoute`; None: the one its size, device and slot give), which says whether
    round 1 through the backend brings every receiver's ``max_bytes`` with the slot (as on NCCL), and how a rest
    through the backend goes (:func:`broadcast_rest`)."""
    op = "broadcast"
    if tree and levels is not None:
        assert src == 0, "the reduce tree ends on group rank 0"
        return down_tree(wire, out, sizes_of, levels)
    raw = (_slot(wire, out) if out is not None else bytearray(wire.slot)) if wire.rank == src else None
    came = slots_through_medium(wire, op, raw, op, src)
    got = came if came is NOT_USED else raw if raw is not None else came[src]
    if got is NOT_USED and tree:
        assert src == 0, "the reduce tree ends on group rank 0"
        return down_tree(wire, out, sizes_of)
    if got is not NOT_USED:
        memory = None  # (the same-host channel, or two levels: the settings' slot)
    elif memory is not None:  # the slot the last two broadcasts suggested
        wire, memory = memory.applied(wire)
        if raw is not None and len(raw) != wire.slot:
            raw = _slot(wire, out) if out is not None else bytearray(wire.slot)
    smallest_limit: Optional[int] = None  # the smallest receiver's max_bytes, where round 1 brought them
    if got is NOT_USED and (route or route_of(wire)).limits_with_slot:
        got, smallest_limit = _slot_and_limits(wire, raw, src, op)
    elif got is NOT_USED:
        if raw is None:
            slot, host = receive_buffer(wire.slot, wire)
        else:  # the source reads its own slot
            slot, host = _on_device(wire, raw), memoryview(raw)
        guarded(op, wire, dist.broadcast, slot, src=wire.ranks[src], group=wire.group)
        got = host if host is not None else host_view(slot)
    info = read_slot(memoryview(got))
    return broadcast_rest(wire, out, info, sizes_of, src, route, memory, smallest_limit)


_LEAST = -(1 << 63)


def _slot_and_limits(wire: Wire, raw: Optional[bytearray], src: int, op: str) -> Tuple[memoryview, int]:
    """Round 1 of a broadcast as one all_reduce (MAX) of int64 words, where the backend's broadcast is a ring (NCCL:
    W - 1 hops) and its all_reduce a tree: ``src``'s slot, which every other rank fills with the least word (a rank
    that sends larger ones spoils the slot alike for every rank), then one word, each receiver's ``-max_bytes``
    (``src``'s the least), whose maximum gives every rank the smallest receiver's limit (a rank that lies there can
    only lower it: every rank then refuses alike, as a vote it spoils would). The slot's bytes and that limit."""
    words = -(-wire.slot // 8)
    if raw is not None:  # the source: its slot (the memory's width: remade where it changed), zero-padded
        assert len(raw) == wire.slot, (len(raw), wire.slot)
        mine = torch.full((words + 1,), _LEAST, dtype=torch.int64)
        mine[:words] = 0
        mine[:words].view(torch.uint8)[: wire.slot] = torch.frombuffer(raw, dtype=torch.uint8)
        both = mine.to(wire.device)
    else:  # a receiver: the least word where the slot lies (made where it moves), then its -max_bytes
        both = torch.full((words + 1,), _LEAST, dtype=torch.int64, device=wire.device)
        both[words] = -wire.max_bytes
    guarded(op, wire, dist.all_reduce, both, op=dist.ReduceOp.MAX, group=wire.group)
    host = both.cpu()
    return host_view(host[:words].view(torch.uint8)[: wire.slot]), -int(host[words])


@one_call  # (the express path calls it too, after its own round 1)
def broadcast_rest(
    wire: Wire,
    out: Optional[Outgoing],
    info: SlotInfo,
    sizes_of: SizesOf,
    src: int,
    route: Optional[routes.CallRoute] = None,
    memory: Optional[SlotMemory] = None,
    smallest_limit: Optional[int] = None,
) -> Incoming:
    """:func:`broadcast` once round 1 has delivered ``src``'s slot (``info``), by either route (``memory``: where
    round 1 went through the backend, :func:`broadcast`'s, which this call's slot teaches; ``smallest_limit``: the
    smallest receiver's ``max_bytes``, where round 1 brought every receiver's: then no vote, its answer being known).
    ``route``: the group's calls' route, which says how a rest through the backend goes: down the binomial tree
    from ``src`` (:meth:`~objcomm._transport.routes.CallRoute.rest_down_tree`), each part as a scatter, then an
    all_gather (:meth:`~objcomm._transport.routes.CallRoute.rest_spread`), else in the backend's broadcast."""
    op, wire = "broadcast", at_pieces(wire, info.piece)  # the source's pieces (its own, on the source)
    ends = _limits.round_one_ends([info])  # an error report, or the whole message in the slot
    if not ends:
        wire.slot_medium.agree(wire, [info], op)
    sizes, problem = _limits.plan(info, sizes_of)
    capacity = 0 if memory is None else memory.base - SLOT_PREFIX_BYTES  # (the settings' slot's, past the prefix)
    if not problem and memory is not None and wire.slot > memory.base:
        problem = long_report(info, capacity)
    if problem:  # every rank holds the same slot: all raise alike (and forget a wider slot)
        if memory is not None:
            memory.forget()
        raise _limits.inconsistent(op, src, problem)
    if memory is not None:  # (before a receiver refuses alone: every rank's memory learns alike)
        memory.learn([info], wire.slot, ends)
    if ends:  # (info.error or limits.complete(info), for one slot)
        assert info.inline is not None
        in_slot = memory is None or info.error or _limits.accepted(info, capacity)  # (as check_limits' rule)
        if not in_slot and wire.rank != src and info.total > wire.max_bytes:
            # a frame past the settings' slot, in a wider one: refused alone, as a rest it would drain is
            raise _limits.refused(op, src, wire, info.total, None, drained=True, into="round 1's slot")
        return Incoming(info.inline, error=info.error)
    refuse = wire.rank != src and info.total > wire.max_bytes
    agreed = _agreement_needed(wire, info, op)
    if agreed:  # (a receiver that refused raised: none drains what follows)
        try:
            if smallest_limit is None:
                _vote_refusals(wire, REFUSE_LIMIT if refuse else 0, info, src, op)
            elif info.total > smallest_limit:  # the vote's answer, which every rank knows
                raise refused_alike(op, src, info.total, f"the smallest receiver's max_bytes: {smallest_limit:,}")
            else:
                round_one_done()  # every rank took part in round 1's all_reduce: as after a vote
        except ObjcommError:  # every rank refused it alike: a wider slot is forgotten, as an all_gather's refusal does
            if memory is not None:
                memory.forget()
            raise
    # asked after any answer; without one a receiver may still refuse, which the strategy then drains (the channel)
    taken = wire.rest_media.broadcast(wire, out, info, _limits.checked_sizes(sizes_of, [info]), src, op)
    if taken is not NOT_USED:
        return taken
    mine = out if wire.rank == src else None
    route, moved = route or route_of(wire), info.second_round_bytes
    tree = route.rest_down_tree(moved)
    deadline = Deadline.of_rest(wire, op, src, moved)  # one for the frame and every tensor

    def part(data: Optional[torch.Tensor], length: int) -> torch.Tensor:
        if route.rest_spread(length, agreed=agreed):
            return spread_bytes(wire, data, length, src, op, deadline)
        return broadcast_bytes(wire, data, length, src, op, refuse, tree, deadline)

    frame = info.inline
    if frame is None:
        data = part(mine.frame_tensor() if mine else None, info.length)
        frame = None if refuse else host_view(data)
    if sizes is None:  # only the frame lists them; every rank has it now (nobody refused: the receivers answered)
        assert frame is not None
        sizes = _limits.frame_sizes(sizes_of, frame, info, src, op)
    tensors = [part(mine.tensors[i] if mine else None, n) for i, n in enumerate(sizes)]
    if refuse:
        raise _limits.refused(op, src, wire, info.total, None, drained=True)
    assert frame is not None
    return Incoming(frame, tensors)


def spread_bytes(
    wire: Wire, data: Optional[torch.Tensor], length: int, src: int, op: str, deadline: Deadline
) -> torch.Tensor:
    """``src``'s ``length`` bytes (``data`` there) on every rank as a scatter, then an all_gather
    (:func:`objcomm._transport.patterns.spread`): each step one batch of sends and receives, in pieces of at most
    ``wire.chunk`` bytes, straight into the buffer the bytes end in. Every rank relays blocks, so only after the
    receivers' vote (none drains); a rank that sends less than a block leaves zeros there (a lying relay changes the
    blocks it passes on, for every rank that gets them from it: docs/security.md)."""
    buffer = to_device(data, wire) if data is not None else zeroed(length, wire)
    for step in spread(wire.rank, wire.size, src, length):  # (chunked: under the exchange's internal tag)
        ops = [o for peer, start, end in step.sends for o in chunked(wire, dist.isend, buffer[start:end], peer)]
        ops += [o for peer, start, end in step.receives for o in chunked(wire, dist.irecv, buffer[start:end], peer)]
        posted(wire, ops, op, deadline)
    return buffer


def down_tree(wire: Wire, out: Optional[Outgoing], sizes_of: SizesOf, levels: Optional[TreeLevels] = None) -> Incoming:
    """Group rank 0's frame and tensors (``out`` there) on every rank, along the edges of the binomial tree that
    :func:`objcomm._api.reduce.tree` climbs, the other way: a rank takes the whole message (slot and rest, one
    send/recv, the rest in pieces of :func:`objcomm._transport.routes.tree_piece`) from its parent
    ``rank - lowbit(rank)`` and passes it on to its children ``rank + 2**k`` for every ``2**k`` below
    ``lowbit(rank)``, the largest subtree first. ceil(log2 W) hops in sequence on every backend,
    where NCCL's broadcast is a ring of W - 1, and no vote: group rank 0 already refused, for every rank alike, a
    result above the smallest ``max_bytes`` that came up the tree (:class:`objcomm._api.reduce.Reduced`).

    The result is marked ``relayed`` on every rank. A rank that refuses what its parent sends anyway (a lying rank
    announced a larger limit for its subtree, or sizes that disagree) passes its children an error report in its place
    and returns one itself, with why it refused (``refused``: the failure began there, and its reports stop there,
    :func:`~objcomm._transport.tree_reports.reports_over_tree`'s ``began_here``). A failure learnt this way is reported
    along the same tree (:func:`objcomm._transport.tree_reports.reports_over_tree`), never in a collective of the
    group: a subtree that a lying relay misleads waits on it until the group's timeout, and the other ranks stay in
    step (docs/security.md, "Decisions every rank must share").

    On two levels (``levels``: the reduce tree's, :meth:`~objcomm._transport.base.SlotMedium.tree_levels`) the
    leaders' tree first, through the group, then each host's tree over its channel, from its leader."""
    if levels is None:
        ranks = range(wire.size)
        return _descend(wire, wire.rank, ranks, out, sizes_of)[0]
    home = levels.home
    leader = levels.leaders[home]
    got: Optional[Incoming] = None
    forward = out
    if wire.rank == leader:  # the leaders' tree, rooted at group rank 0
        got, forward = levels.lead(_descend, wire, home, levels.leaders, out, sizes_of)
    if levels.host is not None:  # the host's, rooted at its leader
        ranks = range(leader, levels.lasts[home] + 1)
        got, forward = _descend(levels.host, wire.rank - leader, ranks, forward, sizes_of, got)
    assert got is not None
    return got


def _descend(
    wire: Wire,
    me: int,
    ranks: Sequence[int],
    forward: Optional[Outgoing],
    sizes_of: SizesOf,
    got: Optional[Incoming] = None,
) -> Tuple[Incoming, Outgoing]:
    """One binomial tree rooted at ``ranks[0]`` over the group ranks ``ranks`` of ``wire`` (this rank:
    ``ranks[me]``), the reduce tree's edges the other way: what this rank took (the root: ``got``, or a view of
    ``forward``, what it holds) and what it passed on."""
    wire = wire._replace(tag=INTERNAL_TAG)  # as the reduce tree (its sends go the other way: higher to lower ranks)
    tree = binomial(me, len(ranks))
    if tree.parent is None:
        assert forward is not None
        if got is None:  # the root decodes only a failure
            got = Incoming(forward.frame if forward.error else memoryview(b""), error=forward.error)
    else:
        try:
            _, got, _ = _p2p.recv(wire, ranks[tree.parent], sizes_of, tree=True)
            small = got.frame.nbytes <= wire.inline_capacity  # a slot's view: copied, as a route may reuse its buffer
            forward = Outgoing(bytes(got.frame) if small else got.frame, got.tensors, error=got.error)
        except CommunicationError:
            raise
        except ObjcommError as exc:  # refused (drained): the children learn it from an error report
            forward = error_frame(exc, wire.inline_capacity)
            got = Incoming(forward.frame, error=True, refused=exc)
    for child in reversed(tree.children):  # the largest subtree first; a child that refuses it raises, and its subtree
        _p2p.tree_send(wire, forward, ranks[child])  # hears of it from it
    got.relayed = True
    return got, forward
