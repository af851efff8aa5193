"""Moving bytes as uint8 tensors on a wire's device: the primitives under every transport operation.

Each takes the :class:`~objcomm._transport.base.Wire` it moves on and splits transfers into pieces of at
most ``wire.chunk`` bytes; ``drain`` receives into one scratch buffer of at most
:data:`objcomm._format.limits.SCRATCH_BYTES` (a receiver that refuses what it must still take off the
wire). Point-to-point pieces travel under the wire's data tag.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from objcomm._device import is_cpu, timeout_seconds
from objcomm._errors import CommunicationError
from objcomm._format.limits import SCRATCH_BYTES as SCRATCH
from objcomm._format.message import Outgoing
from objcomm._transport import call_clock
from objcomm._transport.base import INTERNAL_TAG, Wire, all_gather_single, guarded
from objcomm._transport.patterns import binomial


def host_view(tensor: torch.Tensor) -> memoryview:
    return tensor.cpu().numpy().data.cast("B")


def to_device(tensor: torch.Tensor, wire: Wire) -> torch.Tensor:
    return tensor if tensor.device == wire.device else tensor.to(wire.device)


def empty(length: int, wire: Wire) -> torch.Tensor:
    return torch.empty(length, dtype=torch.uint8, device=wire.device)


def zeroed(length: int, wire: Wire) -> torch.Tensor:
    """A buffer for a point-to-point receive. gloo completes a receive whose message is shorter than its buffer
    (a sender that sends less than its slot announced): the rest of the buffer must then hold zeros, never what
    this process's memory held before (a lying sender would read it back in the result of another call)."""
    if is_cpu(wire.device):
        return torch.from_numpy(_zeros(length))
    return torch.zeros(length, dtype=torch.uint8, device=wire.device)


def _zeros(length: int) -> np.ndarray:
    """``length`` zero bytes, on this thread (torch.zeros may fan out), touched only where written: numpy asks calloc,
    whose large blocks are fresh zero pages, where ``bytearray(length)`` writes every byte first (32 MiB, the slots
    of 8192 ranks: 17 ms here against 2.6 ms for the allocation and the write that fills it)."""
    return np.zeros(length, dtype=np.uint8)


def receive_buffer(length: int, wire: Wire) -> Tuple[torch.Tensor, Optional[memoryview]]:
    """A buffer of ``length`` bytes on the wire's device and, on the CPU, a view of the same bytes (so that
    small round-1 receives need no conversion afterwards); ``None`` elsewhere (use :func:`host_view`)."""
    if not is_cpu(wire.device):
        return empty(length, wire), None
    raw = _zeros(length)  # zeros: a peer that sends less leaves none of this process's memory in the result
    return torch.from_numpy(raw), raw.data


FREE_S = 1.0  # seconds a transfer runs before its Deadline asks the group for its timeout


def at_pieces(wire: Wire, piece: int) -> Wire:
    """``wire``, cutting its transfers into pieces of ``piece`` bytes: a sender's, as its slot announced
    (:func:`objcomm._format.slot.piece_size`), so that a receiver posts the pieces its sender sends whatever its own
    ``chunk_bytes`` (gloo takes a shorter message into a larger buffer without a word)."""
    return wire if piece == wire.chunk else wire._replace(chunk=piece)


def pieces(length: int, chunk: int) -> range:
    return range(0, length, chunk)


class Deadline:
    """The group's timeout, counted once for a transfer of many pieces (the backend counts it per piece: a peer
    that sent each piece just within it could hold a receiver for as many timeouts as it announced pieces). A
    transfer then ends within twice the timeout: checked before each piece, and a piece waits the timeout at most.
    Nothing is asked of the group for the first :data:`FREE_S` (a transfer that ends by then costs a clock read a
    piece)."""

    __slots__ = ("wire", "op", "what", "start", "limit")

    def __init__(self, wire: Wire, op: str, what: Optional[str] = None) -> None:
        self.wire, self.op = wire, op
        self.what = what  # the transfer, as the error names it (default: its size and chunk_bytes)
        self.start = time.monotonic()
        self.limit: Optional[float] = None  # the group's timeout, once asked

    @classmethod
    def of_rest(cls, wire: Wire, op: str, sender: int, moved: int) -> Deadline:
        """One deadline for all of ``sender``'s rest of ``moved`` bytes, its frame and every tensor: a sender that
        sends each part just within the timeout holds its receivers no longer than the parts of one."""
        return cls(wire, op, f"rank {sender}'s rest ({moved:,} bytes in pieces of chunk_bytes={wire.chunk:,})")

    def left(self, done: int, total: int) -> Optional[float]:
        """Seconds left (None: the whole timeout, not asked yet), or a :class:`~objcomm.CommunicationError` once
        there are none (``done`` of ``total`` bytes moved). Once asked, also what is left of the call's one timeout
        after its round 1 (:mod:`objcomm._transport.call_clock`), where that is less."""
        now = time.monotonic()
        if now - self.start < FREE_S and self.limit is None:
            return None
        if self.limit is None:
            self.limit = timeout_seconds(self.wire.group)
        left = call_clock.until(self.start, self.limit) - now
        if left <= 0:
            what = self.what or f"a transfer of {total:,} bytes in pieces of chunk_bytes={self.wire.chunk:,}"
            raise CommunicationError(
                f"{self.op}: {what} was not done after the group's timeout of {self.limit:,.0f} s (rank "
                f"{self.wire.rank} had moved {done:,} bytes). A rank announced more than it sends, or sends too "
                "slowly for this timeout; the group may be out of step, so create a new one."
            )
        return left

    def wait(self, work: Any, done: int, total: int) -> None:
        """``work.wait()`` for what is left of the timeout (NCCL's takes no shorter one: it is checked before)."""
        left = self.left(done, total)
        if left is not None and is_cpu(self.wire.device):
            guarded(self.op, self.wire, work.wait, timedelta(seconds=left))
        else:
            guarded(self.op, self.wire, work.wait)


def broadcast_bytes(
    wire: Wire,
    data: Optional[torch.Tensor],
    length: int,
    src: int,
    op: str,
    drain: bool = False,
    tree: bool = False,
    deadline: Optional[Deadline] = None,
) -> torch.Tensor:
    """Broadcast ``length`` bytes in chunks; ``drain``: receive them into one small scratch buffer. ``tree``: each
    piece down the binomial tree rooted at ``src`` rather than in the backend's broadcast
    (:func:`objcomm._transport.routes.rest_down_tree`): a rank takes it from its parent, then sends it to its
    children, the largest subtree first (a rank that drains passes on what it drained). ``deadline``: the
    transfer's, where these bytes are one part of it (a frame and its tensors: one timeout for them all)."""
    if data is not None:
        buffer = to_device(data, wire)
    else:  # zeroed down the tree: a parent that sends less leaves zeros there, never this process's old memory
        buffer = (zeroed if tree else empty)(min(length, wire.chunk, SCRATCH) if drain else length, wire)
    deadline = deadline or Deadline(wire, op)
    if tree:
        _down_the_tree(wire, buffer, length, src, op, drain, deadline)
        return buffer
    for start, piece in _placed(buffer, length, wire.chunk, drain):
        deadline.left(start, length)  # each piece waits the group's timeout at most: the whole, once more at most
        guarded(op, wire, dist.broadcast, piece, src=wire.ranks[src], group=wire.group)
    return buffer


def _placed(buffer: torch.Tensor, length: int, chunk: int, drain: bool) -> Iterator[Tuple[int, torch.Tensor]]:
    """Each piece of ``length`` bytes in pieces of ``chunk``: its offset and where it goes (its place in ``buffer``;
    ``drain``: the front of ``buffer``, a scratch buffer of one piece)."""
    for start in pieces(length, chunk):
        yield start, buffer[: min(chunk, length - start)] if drain else buffer[start : start + chunk]


def _down_the_tree(
    wire: Wire, buffer: torch.Tensor, length: int, src: int, op: str, drain: bool, deadline: Deadline
) -> None:
    """:func:`broadcast_bytes` down the binomial tree rooted at ``src``, piece by piece."""
    edges = binomial((wire.rank - src) % wire.size, wire.size)
    parent = None if edges.parent is None else (edges.parent + src) % wire.size
    children = [(child + src) % wire.size for child in reversed(edges.children)]
    batch = Batch(wire._replace(tag=INTERNAL_TAG), op, together=True)
    for start, piece in _placed(buffer, length, wire.chunk, drain):
        deadline.left(start, length)
        if parent is not None:
            batch.recv_into(piece, parent)
            batch.wait(deadline)
        for child in children:
            batch.send(piece, child)
        batch.wait(deadline)


class Batch:
    """Point-to-point transfers posted together (isend/irecv), then waited on together: one round trip
    for a frame and its tensors instead of one per message. Pieces from one sender match in order.

    ``together``: a collective's transfers, after its round 1 (a collective of the whole group), all posted in one
    ``batch_isend_irecv`` at :meth:`wait`. On NCCL they then run on the group's own communicator, where an isend or
    irecv alone makes (once) a communicator of its two ranks: a gather's destination made one per sender, thousands
    in sequence at 8192 ranks, each set up through the store and holding GPU memory. Both ends of a transfer must
    agree (an end alone on its pair's communicator never meets the other): a collective's ends are each a
    ``together`` batch (or :func:`recv_bytes` with ``together``); a send/recv's stay alone on both ends, since a
    group's first call may be one, where a batch would wait for every rank to set the group's communicator up. On
    gloo ``batch_isend_irecv`` posts each alone: the same transfers either way."""

    def __init__(self, wire: Wire, op: str, together: bool = False) -> None:
        self.wire, self.op, self.together = wire, op, together
        self.works: List[Any] = []  # (work, its bytes)
        self.posts: List[Tuple[Any, int]] = []  # (P2POp, its bytes), posted at wait() where together
        self.buffers: List[torch.Tensor] = []  # kept alive until the transfers finish

    def _post(self, kind: Any, piece: torch.Tensor, peer: int) -> None:
        wire = self.wire
        if self.together:
            self.posts.append((dist.P2POp(kind, piece, wire.ranks[peer], wire.group, wire.data_tag), piece.numel()))
            return
        work = guarded(self.op, wire, kind, piece, wire.ranks[peer], group=wire.group, tag=wire.data_tag)
        self.works.append((work, piece.numel()))

    def send(self, data: torch.Tensor, dst: int) -> None:
        buffer = to_device(data, self.wire)
        self.buffers.append(buffer)
        for start in pieces(buffer.numel(), self.wire.chunk):
            self._post(dist.isend, buffer[start : start + self.wire.chunk], dst)

    def recv(self, length: int, src: int, chunk: Optional[int] = None) -> torch.Tensor:
        return self.recv_into(zeroed(length, self.wire), src, chunk)

    def recv_into(self, buffer: torch.Tensor, src: int, chunk: Optional[int] = None) -> torch.Tensor:
        """Receive into ``buffer`` (bytes on the wire's device, contiguous), returned; in pieces of ``chunk`` bytes
        (the sender's, where its slot said; default: the wire's)."""
        length, chunk = buffer.numel(), chunk or self.wire.chunk
        for start in pieces(length, chunk):
            self._post(dist.irecv, buffer[start : start + chunk], src)
        return buffer

    def send_rest(self, out: Outgoing, dst: int) -> None:
        """The part of ``out`` round 1 did not carry: an overflowing frame, then the tensors."""
        if out.frame_nbytes > self.wire.inline_capacity:
            self.send(out.frame_tensor(), dst)
        for tensor in out.tensors:
            self.send(tensor, dst)

    def wait(self, deadline: Optional[Deadline] = None) -> None:
        """Wait for every transfer posted since the last wait, within the group's timeout counted from ``deadline``'s
        start (default: now; one deadline for several batches bounds them all together)."""
        if self.posts:  # together: one batch (on NCCL one work may stand for all of it)
            works = guarded(self.op, self.wire, dist.batch_isend_irecv, [o for o, _ in self.posts])
            sizes = [n for _, n in self.posts]
            self.works += zip(works, sizes) if len(works) == len(sizes) else [(w, 0) for w in works]
            self.posts = []
        deadline, done, total = deadline or Deadline(self.wire, self.op), 0, sum(n for _, n in self.works)
        for work, n in self.works:
            deadline.wait(work, done, total)
            done += n
        self.works, self.buffers = [], []


def recv_bytes(
    wire: Wire,
    length: int,
    src: int,
    op: str,
    drain: bool = False,
    deadline: Optional[Deadline] = None,
    together: bool = False,
) -> torch.Tensor:
    """Receive ``length`` bytes in chunks; ``drain``: into one small scratch buffer; ``deadline``: as in
    :func:`broadcast_bytes`; ``together``: a collective's, whose sender posts a ``together`` :class:`Batch`."""
    buffer = zeroed(min(length, wire.chunk, SCRATCH) if drain else length, wire)
    deadline = deadline or Deadline(wire, op)
    for start, piece in _placed(buffer, length, wire.chunk, drain):
        deadline.left(start, length)  # as in broadcast_bytes
        if together:  # a piece at a time, as dist.recv takes them, each a batch of its own
            batch = Batch(wire, op, together=True)
            batch.recv_into(piece, src)
            batch.wait(deadline)
        else:
            guarded(op, wire, dist.recv, piece, src=wire.ranks[src], group=wire.group, tag=wire.data_tag)
    return buffer


def all_gather_table(
    wire: Wire,
    data: torch.Tensor,
    width: int,
    op: str,
    deadline: Optional[Deadline] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """All ranks send ``width`` bytes (``data`` shorter is zero-padded); return every rank's, back to back in group-rank
    order, in one buffer (``out``, where given: ``width`` x W bytes on the wire's device). Past ``wire.chunk`` bytes a
    rank, in rounds of at most that many, each checked against ``deadline`` where one is given (one timeout for them
    all)."""
    length, size = data.numel(), wire.size
    table = empty(width * size, wire) if out is None else out
    if width <= wire.chunk:
        padding = torch.zeros(width - length, dtype=torch.uint8, device=data.device)
        send = data if length == width else torch.cat([data, padding])
        guarded(op, wire, all_gather_single, table, to_device(send, wire), group=wire.group)
        return table
    rows, source = table.view(size, width), to_device(data, wire)
    for start in pieces(width, wire.chunk):  # extra memory bounded by size * chunk
        piece = min(wire.chunk, width - start)
        send = torch.zeros(piece, dtype=torch.uint8, device=wire.device)
        valid = max(0, min(piece, length - start))
        send[:valid] = source[start : start + valid]
        recv = empty(piece * size, wire)
        if deadline is not None:
            deadline.left(start * size, width * size)
        guarded(op, wire, all_gather_single, recv, send, group=wire.group)
        rows[:, start : start + piece] = recv.view(size, piece)
    return table


def all_to_all_bytes(
    wire: Wire, streams: Sequence[Sequence[torch.Tensor]], lengths: Sequence[int], longest: int, op: str
) -> List[torch.Tensor]:
    """Send ``streams[j]`` (flat uint8 parts, back to back) to group rank ``j`` and receive ``lengths[i]``
    bytes from rank ``i``, at exact sizes; the parts are copied once, into the send buffer.

    ``longest`` is the longest stream of any pair, the same on every rank: transfers go in rounds of at
    most ``wire.chunk`` bytes per pair, so every rank runs the same number of collectives. No rank can
    check that number (it is a vote over streams between other ranks), and each round completes, so
    the group's timeout would never end a vote inflated by a lying rank: the rounds stop, with a
    ``CommunicationError``, once they have taken longer than that timeout.
    """
    sent = [sum(p.numel() for p in parts) for parts in streams]
    own = max(max(sent, default=0), max(lengths, default=0))
    if own > longest:  # a vote below this rank's own streams: forged on its way here (a relay), or out of step
        raise CommunicationError(
            f"{op}: the ranks voted {longest:,} bytes for the longest stream of any pair, below this rank's own "
            f"{own:,}: a rank relayed the vote wrongly, or the ranks are at different calls. The group may be out "
            "of step, so create a new one."
        )
    if longest <= wire.chunk:  # the common case: one collective, straight into one buffer
        received = empty(sum(lengths), wire)
        send = joined([p for parts in streams for p in parts], wire)
        guarded(
            op,
            wire,
            dist.all_to_all_single,
            received,
            send,
            output_split_sizes=list(lengths),
            input_split_sizes=sent,
            group=wire.group,
        )
        return list(received.split(list(lengths)))
    results = [empty(n, wire) for n in lengths]
    rounds = -(-longest // wire.chunk)
    deadline = Deadline(
        wire,
        op,
        f"the second round, voted at {longest:,} bytes for the longest pair ({rounds:,} rounds of "
        f"chunk_bytes={wire.chunk:,}),",
    )
    for start in pieces(longest, wire.chunk):  # extra memory bounded by size * chunk
        deadline.left(start, longest)
        outs = [max(0, min(wire.chunk, n - start)) for n in sent]
        ins = [max(0, min(wire.chunk, n - start)) for n in lengths]
        send = joined([p for parts, k in zip(streams, outs) for p in _window(parts, start, k)], wire)
        received = empty(sum(ins), wire)
        guarded(
            op,
            wire,
            dist.all_to_all_single,
            received,
            send,
            output_split_sizes=ins,
            input_split_sizes=outs,
            group=wire.group,
        )
        for result, part, k in zip(results, received.split(ins), ins):
            result[start : start + k] = part
    return results


def joined(parts: Sequence[torch.Tensor], wire: Wire) -> torch.Tensor:
    """``parts`` back to back in one new buffer on the wire's device."""
    return torch.cat([to_device(p, wire) for p in parts]) if parts else empty(0, wire)


def _window(parts: Sequence[torch.Tensor], start: int, length: int) -> List[torch.Tensor]:
    """Bytes ``start`` to ``start + length`` of ``parts`` laid back to back, as views on them."""
    window, at = [], 0
    for part in parts:
        n = part.numel()
        lo, hi = max(start - at, 0), min(start + length - at, n)
        if lo < hi:
            window.append(part[lo:hi])
        at += n
    return window
