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
prefix sums, and the ranks whose rests cross its stripe (found by bisection): :func:`routes.stripe_moves`, a pure
function the model (``benchmarks/scale_model.py``) calls too.

Example (W = 4, rests of 0, 10, 0 and 2 bytes: T = 12, c = 3): rank 1's 10 bytes go 3 to rank 0, 3 to rank 2,
1 to rank 3 (its own 3 it copies), rank 3's 2 bytes to itself; the all_gather's 12 bytes are the stream.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Iterator, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from objcomm._device import is_cpu
from objcomm._transport import routes
from objcomm._transport.base import INTERNAL_TAG, Wire, guarded
from objcomm._transport.bytes import Deadline, all_gather_table, empty, host_view, joined, pieces, to_device, zeroed

TAG = 2 * INTERNAL_TAG  # the tag of the point-to-point pieces (of a batch, or of step 1 of stripes)


class LaidRests:
    """Every rank's rest as a slice of one buffer (a padded all_gather's table, the stripes' stream): group rank
    ``r``'s ``lengths[r]`` bytes from ``starts[r]``, None where it sends none and for this rank (``me``). Each
    slice is made when asked for; :meth:`host` gives the same bytes as a memoryview, where the buffer is on the CPU,
    from one view of the whole buffer (a tensor's view costs ~1 us and its memoryview ~1.5 us more: at 8192 ranks,
    each receiving every rank's rest, 20 ms a call; a slice of one memoryview 0.2 us)."""

    __slots__ = ("buffer", "starts", "lengths", "me", "_host")

    def __init__(self, buffer: torch.Tensor, starts: Sequence[int], lengths: Sequence[int], me: int) -> None:
        self.buffer, self.starts, self.lengths, self.me = buffer, starts, lengths, me
        self._host: Optional[memoryview] = None

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, r: int) -> Optional[torch.Tensor]:
        n = self.lengths[r]
        return self.buffer[self.starts[r] : self.starts[r] + n] if n and r != self.me else None

    def __iter__(self) -> Iterator[Optional[torch.Tensor]]:
        return (self[r] for r in range(len(self.lengths)))

    def host(self, r: int) -> Optional[memoryview]:
        """Rank ``r``'s rest as a memoryview of the CPU buffer; None where :meth:`__getitem__` gives None, and on a GPU
        (copy only what must come to the host)."""
        if not self.buffer.is_cpu or not self.lengths[r] or r == self.me:
            return None
        if self._host is None:
            self._host = host_view(self.buffer)
        return self._host[self.starts[r] : self.starts[r] + self.lengths[r]]


def all_gather_rests(
    wire: Wire,
    mine: Sequence[torch.Tensor],
    lengths: Sequence[int],
    op: str,
    table: Optional[torch.Tensor] = None,
    width: int = 0,
) -> Union[List[Optional[torch.Tensor]], LaidRests]:
    """Every other rank's rest on every rank, in one exchange whatever the spread of sizes: ``lengths[r]`` bytes
    from group rank ``r`` (None where it sends none, and for this rank, which holds its own ``mine``: its parts,
    back to back). The shape is :func:`objcomm._transport.routes.exchange_shape`'s: one padded all_gather of the
    widest; exact sizes, as an uneven all_gather on NCCL (torch runs it as coalesced broadcasts) or one batch of
    sends and receives on gloo (whose all_gather needs equal sizes); or on gloo :func:`by_stripes`. Transfers go
    in pieces of at most ``wire.chunk`` bytes. Point-to-point pieces travel under
    :data:`~objcomm._transport.base.INTERNAL_TAG`, which no caller's message carries. ``width``: where the shape is
    the padded all_gather, each rank's row (at least the widest rest; the same on every rank: 0, the widest);
    ``table``: where it writes them (W rows of ``width``, this rank's own included), only where that is the shape; or
    where the shape is stripes, where their all_gather writes the stream (W stripes of
    :func:`~objcomm._transport.routes.stripe_width`: every rest back to back from 0, this rank's included)."""
    me, size = wire.rank, wire.size
    # one part (a frame past the slot, no tensors): sent as it is, not copied into a new buffer first
    own = (to_device(mine[0], wire) if len(mine) == 1 else joined(mine, wire)) if lengths[me] else empty(0, wire)
    got: List[Optional[torch.Tensor]] = [None] * size
    shape = routes.exchange_shape(lengths, cpu=is_cpu(wire.device))
    if shape == routes.STRIPES:  # gloo: each rest to the stripes holding it, then their all_gather
        if table is not None and table.numel() != size * routes.stripe_width(lengths):
            raise ValueError(f"{op}: a table of {table.numel():,} bytes for {size} stripes of {sum(lengths):,} in all")
        return by_stripes(wire, own, lengths, op, table)
    width = width or max(lengths)
    if width < max(lengths) or table is not None and (shape != routes.PADDED or table.numel() != size * width):
        raise ValueError(f"{op}: rows of {width:,} bytes (a table: {table is not None}) for a {shape} exchange")
    if shape == routes.PADDED:
        deadline = Deadline(wire, op, f"a padded all_gather of {width:,} bytes a rank")
        rows = all_gather_table(wire, own, width, op, deadline, out=table)
        return LaidRests(rows, range(0, width * size, width), lengths, me)
    if not is_cpu(wire.device):  # NCCL: uneven all_gathers, one per piece of at most chunk bytes per rank
        results = [empty(n, wire) if n and r != me else None for r, n in enumerate(lengths)]
        deadline = Deadline(wire, op, f"the second round's exchange ({sum(lengths):,} bytes in all)")
        for start in pieces(max(lengths), wire.chunk):
            deadline.left(start, max(lengths))  # one timeout for every round, once more at most
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
                ops += chunked(wire, dist.isend, own, r)
    for r, n in enumerate(lengths):
        if n and r != me:
            got[r] = buffer = zeroed(n, wire)
            ops += chunked(wire, dist.irecv, buffer, r)
    posted(wire, ops, op, Deadline(wire, op, f"the second round's exchange ({sum(lengths):,} bytes in all)"))
    return got


def chunked(wire: Wire, kind: Any, data: torch.Tensor, peer: int) -> List[Any]:
    """``data`` sent to (``kind``: ``dist.isend``) or received from (``dist.irecv``) group rank ``peer``, in pieces of
    at most ``wire.chunk`` bytes, as the ops of one batch."""
    return [
        dist.P2POp(kind, data[at : at + wire.chunk], wire.ranks[peer], wire.group, TAG)
        for at in pieces(data.numel(), wire.chunk)
    ]


def posted(wire: Wire, ops: List[Any], op: str, deadline: Deadline) -> None:
    """``ops`` (isend/irecv) posted in one batch, each waited on within ``deadline`` (gloo already counts a posted
    receive's timeout from its post; the deadline says in its error how far the transfer got)."""
    if not ops:
        return
    total, done = sum(o.tensor.numel() for o in ops), 0
    for work, o in zip(guarded(op, wire, dist.batch_isend_irecv, ops), ops):
        deadline.wait(work, done, total)
        done += o.tensor.numel()


def by_stripes(
    wire: Wire, own: torch.Tensor, lengths: Sequence[int], op: str, table: Optional[torch.Tensor] = None
) -> Union[List[Optional[torch.Tensor]], LaidRests]:
    """Every other rank's rest on every rank (``lengths[r]``: group rank ``r``'s; ``own``: this rank's, its bytes),
    None where a rank sends none and for this rank. The same ``lengths`` on every rank (round 1's slots). ``table``:
    where the stripes' all_gather writes the stream (W stripes), which the rests are views of."""
    me = wire.rank
    offsets = [0, *accumulate(lengths)]
    total, width = offsets[-1], routes.stripe_width(lengths)
    moves = routes.stripe_moves(offsets, me, width)
    lo = moves.stripe[0]
    stripe = zeroed(width, wire)  # zeros past the stream's end, and where a lying sender sent less
    for _, start, end in moves.kept:
        stripe[start - lo : end - lo] = own[start - offsets[me] : end - offsets[me]]
    ops = []
    for owner, start, end in moves.sends:
        ops += chunked(wire, dist.isend, own[start - offsets[me] : end - offsets[me]], owner)
    for sender, start, end in moves.receives:
        ops += chunked(wire, dist.irecv, stripe[start - lo : end - lo], sender)
    deadline = Deadline(wire, op, f"the second round's stripes ({total:,} bytes in all)")
    posted(wire, ops, op, deadline)
    stream = all_gather_table(wire, stripe, width, op, deadline, out=table)
    return LaidRests(stream, offsets, lengths, me)
