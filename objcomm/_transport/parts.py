"""The rounds of the operations that send each rank its own part (:mod:`objcomm._transport.rounds` tells the two
rounds): scatter (a root's part for each rank) and all_to_all (every rank's part for each rank), over the backend,
asking the wire's media first.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch.distributed as dist

from objcomm._errors import FrameError
from objcomm._format import limits as _limits
from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._format.slot import fill_slot, outgoing_second_round_bytes, read_slot, read_slots
from objcomm._transport.base import NOT_USED, Wire, guarded, largest_of
from objcomm._transport.bytes import (
    Batch,
    Deadline,
    all_to_all_bytes,
    at_pieces,
    empty,
    host_view,
    receive_buffer,
    recv_bytes,
    to_device,
)
from objcomm._transport.call_clock import one_call, round_one_done
from objcomm._transport.patterns import in_rank_order
from objcomm._transport.rounds import (
    REFUSE_LIMIT,
    REFUSE_MALFORMED,
    _on_device,
    _rest,
    _round_one,
    _vote_refusals,
    slots_through_medium,
)


# -- scatter ---------------------------------------------------------------------------------
@one_call
def scatter(wire: Wire, outs: Optional[Sequence[Outgoing]], sizes_of: SizesOf, src: int) -> Incoming:
    """``src``'s ``outs[r]`` on group rank ``r``."""
    op = "scatter"
    table = None
    if wire.rank == src:
        assert outs is not None
        table = _slot_table(wire, outs)
    parts = None if table is None else _per_rank(wire, table)
    came = slots_through_medium(wire, op, parts, op, src)
    got = came if came is NOT_USED else parts[src] if parts is not None else came[src]
    if got is NOT_USED:
        recv, host = receive_buffer(wire.slot, wire)
        scatter_list = None if table is None else list(_on_device(wire, table).chunk(wire.size))
        guarded(op, wire, dist.scatter, recv, scatter_list, src=wire.ranks[src], group=wire.group)
        got = host if host is not None else host_view(recv)
    info = read_slot(memoryview(got))
    wire = at_pieces(wire, info.piece)  # the root's pieces (its own, on the root)
    sizes, problem = _limits.plan(info, sizes_of)
    if info.error or not info.round2:
        if not (problem or info.error or _limits.complete(info)):
            problem = "its slot does not carry the whole frame, yet it announced no second round"
        if problem:
            raise _limits.inconsistent(op, src, problem)
        assert info.inline is not None
        return Incoming(info.inline, error=info.error)
    in_slot = _limits.accepted(info, wire.inline_capacity)  # (a part that came whole in its slot)
    over = wire.rank != src and not in_slot and info.total > wire.max_bytes
    refuse = REFUSE_MALFORMED if problem else REFUSE_LIMIT if over else 0
    capacity = wire.inline_capacity  # the root's longest second round: its receivers know only their own
    sent = [outgoing_second_round_bytes(o, capacity) for r, o in enumerate(outs or ()) if r != src]
    longest = _vote_refusals(wire, refuse, info, src, op, problem, longest=max(sent, default=0))
    taken = wire.rest_media.scatter(wire, outs, info, _limits.checked_sizes(sizes_of, [info]), src, longest, op)
    if taken is not NOT_USED:
        return taken
    if wire.rank == src:
        assert outs is not None
        batch = Batch(wire, op, together=True)  # (its receivers' recv_bytes: together too)
        for r, o in enumerate(outs):
            if r != src:
                batch.send_rest(o, r)
        batch.wait()
        mine = outs[src]
        return Incoming(mine.frame, [to_device(t, wire) for t in mine.tensors])
    deadline = Deadline.of_rest(wire, op, src, info.second_round_bytes)  # one for the frame and every tensor
    frame = (
        info.inline
        if info.inline is not None
        else host_view(recv_bytes(wire, info.length, src, op, False, deadline, True))
    )
    sizes = sizes if sizes is not None else _limits.frame_sizes(sizes_of, frame, info, src, op)
    return Incoming(frame, [recv_bytes(wire, n, src, op, False, deadline, True) for n in sizes])


# -- all_to_all ------------------------------------------------------------------------------
@one_call
def all_to_all(wire: Wire, outs: Sequence[Outgoing], sizes_of: SizesOf) -> Sequence[Optional[Incoming]]:
    """``outs[j]`` to group rank ``j``; element ``i`` of the result came from rank ``i``.

    Round 1 is one all_to_all of slots. A sender sets ROUND2_BIT in every slot it sends when any
    of its parts needs a second round, so every rank learns whether one follows (and every failure:
    a failing rank sends its report to all). Before a second round one all_reduce votes on refusals
    and carries the longest stream of any pair; then each pair's rest (an overflowing frame, then
    its tensors) moves as one stream at its exact size, through the rest media or one
    uneven all_to_all per ``chunk``. ``None`` marks frames not moved after an error.
    """
    op = "all_to_all"
    table = _slot_table(wire, outs)
    parts = _per_rank(wire, table)
    got = slots_through_medium(wire, op, parts, op)
    if got is not NOT_USED:
        infos = [read_slot(memoryview(s)) for s in in_rank_order(got, parts[wire.rank], wire.rank, wire.size)]
    else:
        received = empty(wire.size * wire.slot, wire)
        guarded(op, wire, dist.all_to_all_single, received, _on_device(wire, table), group=wire.group)
        infos = read_slots(host_view(received), wire.size, wire.slot)
    round_one_done()  # every rank is here: the steps after share one timeout (call_clock)
    if any(info.error for info in infos):
        return _round_one(infos)
    plans = [_limits.plan(info, sizes_of) for info in infos]
    problems = [(r, problem) for r, (_, problem) in enumerate(plans) if problem]
    if not any(info.round2 for info in infos):  # nobody sends more: a rank that finds a problem raises alone
        problems += [
            (r, "its slot does not carry the whole frame, yet it announced no second round")
            for r, info in enumerate(infos)
            if not _limits.complete(info)
        ]
        if problems:
            raise _limits.inconsistent(op, *problems[0])
        return _round_one(infos)
    over = [  # (a part that came whole in its slot is taken whatever the limit)
        r
        for r, info in enumerate(infos)
        if r != wire.rank and not _limits.accepted(info, wire.inline_capacity) and info.total > wire.max_bytes
    ]
    refuse = REFUSE_MALFORMED if problems else REFUSE_LIMIT if over else 0
    mine = [0 if r == wire.rank else outgoing_second_round_bytes(o, wire.inline_capacity) for r, o in enumerate(outs)]
    # with the refusals and the longest stream, the smallest piece announced to any rank (each read only the slots
    # sent to it: its column), as its negation, so that every rank moves the streams in the same pieces
    # and which rank refused whose part, as one word ((refuser + 1) x (W + 1) + sender + 1: the last refuser's)
    who = (wire.rank + 1) * (wire.size + 1) + over[0] + 1 if refuse == REFUSE_LIMIT else 0
    words = [refuse, max(mine), -min(info.piece for info in infos), who]
    code, longest, least, who = largest_of(wire, words, op, moved_at=1)
    if code == REFUSE_MALFORMED:
        raise (
            _limits.inconsistent(op, *problems[0])
            if problems
            else FrameError(
                f"{op}: a receiving rank found the sizes in its slots inconsistent; nothing more was transferred"
            )
        )
    if code:
        refuser, sender = divmod(who, wire.size + 1)
        raise (
            _limits.refused(op, over[0], wire, infos[over[0]].total, None)
            if over
            else _limits.too_large(
                f"{op}: rank {sender - 1} sends rank {refuser - 1} more than its max_bytes", where="there"
            )
            if who
            else _limits.too_large(f"{op}: a rank sends a receiving rank more than its max_bytes", where="there")
        )
    problem = _limits.pieces_problem(longest, -least, "the longest rest")
    if problem:  # (the same on every rank: voted)
        raise FrameError(f"{op}: a rank announced pieces of {-least:,} bytes: {problem}")
    wire = at_pieces(wire, -least)
    taken = wire.rest_media.all_to_all(wire, outs, infos, _limits.checked_sizes(sizes_of, infos), longest, op)
    if taken is not NOT_USED:
        return taken
    streams = [_rest(wire, o) if mine[r] else [] for r, o in enumerate(outs)]
    lengths = [0 if r == wire.rank else info.second_round_bytes for r, info in enumerate(infos)]
    moved = all_to_all_bytes(wire, streams, lengths, longest, op)
    incoming: List[Optional[Incoming]] = []
    for r, info in enumerate(infos):
        if r == wire.rank:
            incoming.append(Incoming(outs[r].frame, [to_device(t, wire) for t in outs[r].tensors]))
            continue
        stream = moved[r]
        frame = info.inline if info.inline is not None else host_view(stream[: info.length])
        rest = stream if info.inline is not None else stream[info.length :]
        sizes = plans[r][0]
        if sizes is None:  # only the frame lists them; everything has moved, so this rank may raise alone
            sizes = _limits.frame_sizes(sizes_of, frame, info, r, op)
        incoming.append(Incoming(frame, list(rest.split(sizes)) if sizes else []))
    return incoming


def _slot_table(wire: Wire, outs: Sequence[Outgoing]) -> bytearray:
    """One slot per receiving rank (scatter, all_to_all); ROUND2_BIT in each when any part needs a second round."""
    table = bytearray(wire.size * wire.slot)
    round2 = any(not o.complete(wire) for o in outs)
    for o, slot in zip(outs, _per_rank(wire, table)):
        fill_slot(slot, o, wire.max_bytes, round2, wire.chunk)
    return table


def _per_rank(wire: Wire, table: bytearray) -> List[memoryview]:
    view = memoryview(table)
    return [view[r * wire.slot : (r + 1) * wire.slot] for r in range(wire.size)]
