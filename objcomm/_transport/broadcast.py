"""Broadcast's rounds over the backend (:mod:`objcomm._transport.rounds` tells the two rounds): the source's slot to
every rank, the receivers' vote where they must answer first, then the rest, asking the wire's strategies first.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from objcomm._format import limits as _limits
from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._format.slot import SlotInfo, read_slot
from objcomm._transport.base import NOT_USED, Wire, guarded
from objcomm._transport.bytes import broadcast_bytes, host_view, receive_buffer
from objcomm._transport.rounds import REFUSE_LIMIT, _agreement_needed, _on_device, _slot, _vote_refusals


# -- broadcast -------------------------------------------------------------------------------
def broadcast(wire: Wire, out: Optional[Outgoing], sizes_of: SizesOf, src: int) -> Incoming:
    """``src``'s frame and tensors on every rank (``out`` is ignored elsewhere)."""
    op = "broadcast"
    raw = (_slot(wire, out) if out is not None else bytearray(wire.slot)) if wire.rank == src else None
    got = wire.first_round.broadcast(wire, raw, src, op)
    if got is NOT_USED and wire.device.type != "cpu":
        # NCCL broadcasts along a ring (W - 1 hops); the all_reduce (MAX) of a slot takes a tree: the others'
        # zeros leave the source's bytes (a rank that sends other bytes spoils the slot alike for every rank)
        zeros = torch.zeros(wire.slot, dtype=torch.uint8, device=wire.device)
        slot = _on_device(wire, raw) if raw is not None else zeros
        guarded(op, wire, dist.all_reduce, slot, op=dist.ReduceOp.MAX, group=wire.group)
        got = host_view(slot)
    elif got is NOT_USED:
        if raw is None:
            slot, host = receive_buffer(wire.slot, wire)
        else:  # the source reads its own slot
            slot, host = _on_device(wire, raw), memoryview(raw)
        guarded(op, wire, dist.broadcast, slot, src=wire.ranks[src], group=wire.group)
        got = host if host is not None else host_view(slot)
    return broadcast_rest(wire, out, read_slot(memoryview(got)), sizes_of, src)


def broadcast_rest(wire: Wire, out: Optional[Outgoing], info: SlotInfo, sizes_of: SizesOf, src: int) -> Incoming:
    """:func:`broadcast` once round 1 has delivered ``src``'s slot (``info``), by either route."""
    op = "broadcast"
    if not _limits.round_one_ends([info]):
        wire.first_round.agree(wire, [info], op)
    sizes, problem = _limits.plan(info, sizes_of)
    if problem:  # every rank holds the same slot: all raise alike
        raise _limits.inconsistent(op, src, problem)
    if info.error or _limits.complete(info):
        assert info.inline is not None
        return Incoming(info.inline, error=info.error)
    refuse = wire.rank != src and info.total > wire.max_bytes
    if _agreement_needed(wire, info, op):
        _vote_refusals(wire, REFUSE_LIMIT if refuse else 0, info, src, op)
    # asked after any vote; without one a receiver may still refuse, which the strategy then drains (the channel)
    taken = wire.second_round.broadcast(wire, out, info, _limits.checked_sizes(sizes_of, [info]), src, op)
    if taken is not NOT_USED:
        return taken
    mine = out if wire.rank == src else None
    frame = info.inline
    if frame is None:
        data = broadcast_bytes(wire, mine.frame_tensor() if mine else None, info.length, src, op, drain=bool(refuse))
        frame = None if refuse else host_view(data)
    if sizes is None:  # only the frame lists them; every rank has it now (and nobody refused: there was a vote)
        assert frame is not None
        sizes = _limits.frame_sizes(sizes_of, frame, info, src, op)
    tensors = [
        broadcast_bytes(wire, mine.tensors[i] if mine else None, n, src, op, drain=refuse) for i, n in enumerate(sizes)
    ]
    if refuse:
        raise _limits.refused(op, src, wire, info.total, None, drained=True)
    assert frame is not None
    return Incoming(frame, tensors)
