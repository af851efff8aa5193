"""Every rank's rest to every rank (all_gather's second round): one exchange, whatever the spread of sizes.

:func:`all_gather_rests` takes the shape :mod:`objcomm._transport.routes` picks: one padded all_gather; exact
sizes as an uneven all_gather (NCCL); or on gloo, whose all_gather needs equal sizes, one batch of sends and
receives or :func:`by_stripes`.

**Stripes.** Laid back to back in group-rank order, the rests make one stream of ``T`` bytes. Rank ``j`` holds
its *stripe*, bytes ``[j*c, (j+1)*c)`` of the stream (``c = ceil(T / W)``: :func:`routes.stripe_width`):

1. each rank sends every piece of its rest to the rank whose stripe holds it (one batch of isend/irecv); a rest of
   ``n`` bytes goes to at most ``n/c + 2`` ranks, so a small one goes to one or two;
2. one all_gather of the stripes (equal sizes: gloo's ring, in C++) gives every rank the whole stream, in which
   each rest is a slice (no copy).

The busiest rank moves about ``max(n_max, c) + T`` bytes, where a padded all_gather moves ``(W - 1) x n_max``
through every rank, and a batch in which each rank sends its rest to every peer itself as many through the
largest rest's owner (:func:`~objcomm._transport.routes.exchange_shape` picks). A rank's Python work is O(W):
prefix sums, and the ranks whose rests cross its stripe (found by bisection): :func:`stripe_moves`, a pure function.

Example (W = 4, rests of 0, 10, 0 and 2 bytes: T = 12, c = 3): rank 1's 10 bytes go 3 to rank 0, 3 to rank 2,
1 to rank 3 (its own 3 it copies), rank 3's 2 bytes to itself; the all_gather's 12 bytes are the stream.
"""

from __future__ import annotations

import bisect
from itertools import accumulate
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from objcomm._transport import routes
from objcomm._transport.base import INTERNAL_TAG, Wire, all_gather_single, guarded
from objcomm._transport.bytes import Deadline, all_gather_equal, empty, joined, pieces, to_device, zeroed

TAG = 2 * INTERNAL_TAG  # the tag of the point-to-point pieces (of a batch, or of step 1 of stripes)


def all_gather_rests(
    wire: Wire, mine: Sequence[torch.Tensor], lengths: Sequence[int], op: str
) -> List[Optional[torch.Tensor]]:
    """Every other rank's rest on every rank, in one exchange whatever the spread of sizes: ``lengths[r]`` bytes
    from group rank ``r`` (None where it sends none, and for this rank, which holds its own ``mine``: its parts,
    back to back). The shape is :func:`objcomm._transport.routes.exchange_shape`'s: one padded all_gather of the
    widest; exact sizes, as an uneven all_gather on NCCL (torch runs it as coalesced broadcasts) or one batch of
    sends and receives on gloo (whose all_gather needs equal sizes); or on gloo :func:`by_stripes`. Transfers go
    in pieces of at most ``wire.chunk`` bytes. Point-to-point pieces travel under
    :data:`~objcomm._transport.base.INTERNAL_TAG`, which no caller's message carries."""
    me, size = wire.rank, wire.size
    # one part (a frame past the slot, no tensors): sent as it is, not copied into a new buffer first
    own = (to_device(mine[0], wire) if len(mine) == 1 else joined(mine, wire)) if lengths[me] else empty(0, wire)
    got: List[Optional[torch.Tensor]] = [None] * size
    shape = routes.exchange_shape(lengths, cpu=wire.device.type == "cpu")
    if shape == routes.STRIPES:  # gloo: each rest to the stripes holding it, then their all_gather
        return by_stripes(wire, own, lengths, op)
    if shape == routes.PADDED:
        parts = all_gather_equal(wire, own, max(lengths), op)
        for r, n in enumerate(lengths):
            if n and r != me:
                got[r] = parts[r][:n]
        return got
    if wire.device.type != "cpu":  # NCCL: uneven all_gathers, one per piece of at most chunk bytes per rank
        results = [empty(n, wire) if n and r != me else None for r, n in enumerate(lengths)]
        for start in pieces(max(lengths), wire.chunk):
            ins = [max(0, min(wire.chunk, n - start)) for n in lengths]
            outs = [empty(k, wire) for k in ins]
            outs[me] = own[start : start + ins[me]]
            guarded(op, wire, dist.all_gather, outs, outs[me], group=wire.group)
            for r, result in enumerate(results):
                if result is not None and ins[r]:
                    result[start : start + ins[r]] = outs[r]
        return results
    ops = []
    if lengths[me]:
        for r in range(size):
            if r != me:
                ops += [
                    dist.P2POp(dist.isend, own[at : at + wire.chunk], wire.ranks[r], wire.group, TAG)
                    for at in pieces(lengths[me], wire.chunk)
                ]
    for r, n in enumerate(lengths):
        if n and r != me:
            got[r] = buffer = zeroed(n, wire)
            ops += [
                dist.P2POp(dist.irecv, buffer[at : at + wire.chunk], wire.ranks[r], wire.group, TAG)
                for at in pieces(n, wire.chunk)
            ]
    posted(wire, ops, op, Deadline(wire, op, f"the second round's exchange ({sum(lengths):,} bytes in all)"))
    return got


def posted(wire: Wire, ops: List[Any], op: str, deadline: Deadline) -> None:
    """``ops`` (isend/irecv) posted in one batch, each waited on within ``deadline`` (gloo already counts a posted
    receive's timeout from its post; the deadline says in its error how far the transfer got)."""
    if not ops:
        return
    total, done = sum(o.tensor.numel() for o in ops), 0
    for work, o in zip(guarded(op, wire, dist.batch_isend_irecv, ops), ops):
        deadline.wait(work, done, total)
        done += o.tensor.numel()


class StripeMoves(NamedTuple):
    """What one rank moves in step 1 of :func:`by_stripes`, in stream bytes ``(peer, start, end)``: ``sends`` (pieces
    of its rest, to the stripes' owners), ``receives`` (pieces of other ranks' rests in its stripe), ``kept`` (the
    pieces of its rest in its own stripe, copied); ``stripe`` its stripe's ``(start, end)``, clipped to the stream."""

    sends: List[Tuple[int, int, int]]
    receives: List[Tuple[int, int, int]]
    kept: List[Tuple[int, int, int]]
    stripe: Tuple[int, int]


def stripe_moves(offsets: Sequence[int], me: int) -> StripeMoves:
    """Rank ``me``'s moves when the rests lie at ``offsets`` (``[0, n_0, n_0 + n_1, ..., T]``). Pure, O(W) at most:
    the stripes ``me``'s rest crosses, and the ranks whose rests cross ``me``'s stripe (found by bisection)."""
    world, total = len(offsets) - 1, offsets[-1]
    width = -(-total // max(world, 1))
    lo, hi = min(me * width, total), min((me + 1) * width, total)
    start, end = offsets[me], offsets[me + 1]
    mine = [] if start == end else range(start // width, -(-end // width))
    crossed = [(j, max(start, j * width), min(end, (j + 1) * width)) for j in mine]
    receives = []
    for sender in range(max(bisect.bisect_right(offsets, lo) - 1, 0), world):  # the first whose rest reaches lo
        if offsets[sender] >= hi:
            break
        first, last = max(offsets[sender], lo), min(offsets[sender + 1], hi)
        if sender != me and first < last:
            receives.append((sender, first, last))
    sends = [move for move in crossed if move[0] != me]
    return StripeMoves(sends, receives, [move for move in crossed if move[0] == me], (lo, hi))


def by_stripes(wire: Wire, own: torch.Tensor, lengths: Sequence[int], op: str) -> List[Optional[torch.Tensor]]:
    """Every other rank's rest on every rank (``lengths[r]``: group rank ``r``'s; ``own``: this rank's, its bytes),
    None where a rank sends none and for this rank. The same ``lengths`` on every rank (round 1's slots)."""
    me, world = wire.rank, wire.size
    offsets = [0, *accumulate(lengths)]
    total, width = offsets[-1], routes.stripe_width(lengths)
    moves = stripe_moves(offsets, me)
    lo = moves.stripe[0]
    stripe = zeroed(width, wire)  # zeros past the stream's end, and where a lying sender sent less
    for _, start, end in moves.kept:
        stripe[start - lo : end - lo] = own[start - offsets[me] : end - offsets[me]]
    ops = []
    for owner, start, end in moves.sends:
        piece = own[start - offsets[me] : end - offsets[me]]
        for at in pieces(end - start, wire.chunk):
            ops.append(dist.P2POp(dist.isend, piece[at : at + wire.chunk], wire.ranks[owner], wire.group, TAG))
    for sender, start, end in moves.receives:
        view = stripe[start - lo : end - lo]
        for at in pieces(end - start, wire.chunk):
            ops.append(dist.P2POp(dist.irecv, view[at : at + wire.chunk], wire.ranks[sender], wire.group, TAG))
    deadline = Deadline(wire, op, f"the second round's stripes ({total:,} bytes in all)")
    posted(wire, ops, op, deadline)
    stream = empty(width * world, wire)
    if width <= wire.chunk:
        guarded(op, wire, all_gather_single, stream, stripe, group=wire.group)
    else:  # in rounds of at most chunk bytes a rank
        rows = stream.view(world, width)
        for at in pieces(width, wire.chunk):
            part = min(wire.chunk, width - at)
            received = empty(part * world, wire)
            deadline.left(at * world, total)
            guarded(op, wire, all_gather_single, received, stripe[at : at + part], group=wire.group)
            rows[:, at : at + part] = received.view(world, part)
    return [stream[offsets[r] : offsets[r + 1]] if n and r != me else None for r, n in enumerate(lengths)]
