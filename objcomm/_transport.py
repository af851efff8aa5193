"""Moving variable-length frames (uint8 tensors) with torch.distributed.

Every operation is one or two rounds:

1. A fixed-size **slot** per rank travels in a single collective (or message). Its 16-byte
   prefix holds the frame length (top bit: "this is an error report") and the sender's
   ``max_bytes``; when the frame fits, it follows the prefix and the call is done.
2. Only frames that did not fit travel again, whole and at their exact size where the
   collective allows it, in pieces of at most ``chunk`` bytes.

Because everything in round 1 is seen by every rank that must act on it, all ranks take the
same decision (skip round 2 after an error, refuse a frame above a limit) and nobody waits for
a transfer that will never come. A receiver that refuses a broadcast, scattered or sent frame
still drains it through a scratch buffer of at most ``chunk`` bytes, so senders never hang.

Frames come back as CPU ``memoryview``\\ s, in group-rank order; ``None`` marks a frame that was
not transferred because the call already failed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from ._errors import CommunicationError, TooLargeError

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

PREFIX = struct.Struct("<QQ")
ERROR_BIT = 1 << 63
Frames = List[Optional[memoryview]]


@dataclass(frozen=True)
class Wire:
    """Where and how frames move: the group, this rank's place in it, and the size limits."""

    group: Any
    ranks: Sequence[int]  # global rank of each group rank
    rank: int  # this process's rank in the group
    device: torch.device
    slot: int  # bytes per rank in round 1, prefix included
    chunk: int  # largest single transfer in round 2
    max_bytes: int  # largest frame this rank accepts

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def inline_capacity(self) -> int:
        return self.slot - PREFIX.size


@dataclass(frozen=True)
class _SlotInfo:
    length: int
    error: bool
    limit: int
    inline: Optional[memoryview]


def _host_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.cpu().numpy()).cast("B")


def _fill_slot(slot: memoryview, frame: torch.Tensor, error: bool, limit: int) -> None:
    length = frame.numel()
    PREFIX.pack_into(slot, 0, length | (ERROR_BIT if error else 0), limit)
    if length <= slot.nbytes - PREFIX.size:
        slot[PREFIX.size : PREFIX.size + length] = memoryview(frame.numpy()).cast("B")


def _make_slot(wire: Wire, frame: torch.Tensor, error: bool) -> torch.Tensor:
    slot = torch.zeros(wire.slot, dtype=torch.uint8)
    _fill_slot(memoryview(slot.numpy()), frame, error, wire.max_bytes)
    return slot


def _read_slot(view: memoryview) -> _SlotInfo:
    word, limit = PREFIX.unpack_from(view, 0)
    length = word & ~ERROR_BIT
    fits = length <= view.nbytes - PREFIX.size
    return _SlotInfo(length, bool(word & ERROR_BIT), limit, view[PREFIX.size : PREFIX.size + length] if fits else None)


def _read_slots(host: memoryview, count: int, slot: int) -> List[_SlotInfo]:
    return [_read_slot(host[r * slot : (r + 1) * slot]) for r in range(count)]


def _check_limits(infos: List[_SlotInfo], receivers: Sequence[int], op: str) -> None:
    """Raise the same TooLargeError on every rank when a frame exceeds a receiver's limit."""
    limit = min(infos[r].limit for r in receivers)
    for sender, info in enumerate(infos):
        if info.inline is None and not info.error and info.length > limit:
            raise TooLargeError(
                f"{op}: rank {sender}'s frame is {info.length:,} bytes, above the receiving limit "
                f"max_bytes={limit:,}; nothing was transferred. Raise max_bytes on the receiving ranks or send less"
            )


def _to_device(tensor: torch.Tensor, wire: Wire) -> torch.Tensor:
    return tensor if tensor.device == wire.device else tensor.to(wire.device)


def _empty(length: int, wire: Wire) -> torch.Tensor:
    return torch.empty(length, dtype=torch.uint8, device=wire.device)


def _pieces(length: int, chunk: int) -> range:
    return range(0, length, chunk) if length else range(0)


def _guarded(op: str, wire: Wire, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a torch.distributed call, turning its failures into CommunicationError."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        raise CommunicationError(
            f"{op} failed on rank {wire.rank} of a group of {wire.size}: {exc}. "
            "A rank may have crashed, never called this operation, or called a different one; "
            "the group's timeout (init_process_group(timeout=...)) bounds how long ranks wait"
        ) from exc


# -- all_gather ------------------------------------------------------------------------------
def all_gather(wire: Wire, frame: torch.Tensor, error: bool, op: str = "all_gather") -> Frames:
    """Every rank's frame, on every rank."""
    infos = _exchange_slots(wire, frame, error, op)
    return _all_gather_rest(wire, frame, infos, op, receivers=range(wire.size))


def _exchange_slots(wire: Wire, frame: torch.Tensor, error: bool, op: str) -> List[_SlotInfo]:
    send = _to_device(_make_slot(wire, frame, error), wire)
    recv = _empty(wire.slot * wire.size, wire)
    _guarded(op, wire, _all_gather_single, recv, send, group=wire.group)
    return _read_slots(_host_view(recv), wire.size, wire.slot)


def _all_gather_rest(wire: Wire, frame: torch.Tensor, infos: List[_SlotInfo], op: str, receivers: Any) -> Frames:
    frames: Frames = [info.inline for info in infos]
    if any(info.error for info in infos):
        return frames
    _check_limits(infos, receivers, op)
    over = [r for r, info in enumerate(infos) if info.inline is None]
    if not over:
        return frames
    lengths = [infos[r].length for r in over]
    widest = max(lengths)
    if wire.size * widest <= 2 * sum(lengths):  # similar sizes: one padded all_gather
        gathered = _padded_all_gather(wire, frame, widest, op)
        for r in over:
            frames[r] = gathered[r][: infos[r].length]
    else:  # one rank far bigger than the rest: each big frame is broadcast at its exact size
        for r in over:
            frames[r] = _broadcast_frame(wire, frame if r == wire.rank else None, infos[r].length, r, op)
    return frames


def _padded_all_gather(wire: Wire, frame: torch.Tensor, width: int, op: str) -> List[memoryview]:
    length = frame.numel()
    if width <= wire.chunk:
        send = frame if length == width else torch.cat([frame, torch.zeros(width - length, dtype=torch.uint8)])
        recv = _empty(width * wire.size, wire)
        _guarded(op, wire, _all_gather_single, recv, _to_device(send, wire), group=wire.group)
        host = _host_view(recv)
        return [host[r * width : (r + 1) * width] for r in range(wire.size)]
    results = [torch.empty(width, dtype=torch.uint8) for _ in range(wire.size)]
    for start in _pieces(width, wire.chunk):
        piece = min(wire.chunk, width - start)
        send = torch.zeros(piece, dtype=torch.uint8)
        valid = max(0, min(piece, length - start))
        send[:valid] = frame[start : start + valid]
        recv = _empty(piece * wire.size, wire)
        _guarded(op, wire, _all_gather_single, recv, _to_device(send, wire), group=wire.group)
        host = recv.cpu()
        for r in range(wire.size):
            results[r][start : start + piece] = host[r * piece : (r + 1) * piece]
    return [memoryview(t.numpy()) for t in results]


# -- gather ----------------------------------------------------------------------------------
def gather(wire: Wire, frame: torch.Tensor, error: bool, dst: int) -> Optional[Frames]:
    """Every rank's frame on group rank ``dst``; ``None`` elsewhere, unless some rank failed.

    Round 1 is an all_gather of slots so that every rank learns of a failure anywhere and
    raises in the same call (after a failure every rank gets the round-1 frames, error reports
    among them); frames that overflow go to ``dst`` point to point at their exact size.
    """
    infos = _exchange_slots(wire, frame, error, "gather")
    frames: Frames = [info.inline for info in infos]
    if any(info.error for info in infos):
        return frames
    _check_limits(infos, [dst], "gather")
    over = [r for r, info in enumerate(infos) if info.inline is None]
    if wire.rank == dst:
        for r in over:
            frames[r] = _host_view(frame) if r == dst else _recv_frame(wire, infos[r].length, r, "gather")
        return frames
    if wire.rank in over:
        _send_frame(wire, frame, dst, "gather")
    return None


# -- broadcast -------------------------------------------------------------------------------
def broadcast(wire: Wire, frame: Optional[torch.Tensor], error: bool, src: int) -> memoryview:
    """``src``'s frame on every rank (``frame`` is ignored elsewhere)."""
    slot = _make_slot(wire, frame, error) if wire.rank == src and frame is not None else torch.zeros(wire.slot, dtype=torch.uint8)
    slot = _to_device(slot, wire)
    _guarded("broadcast", wire, dist.broadcast, slot, src=wire.ranks[src], group=wire.group)
    info = _read_slot(_host_view(slot))
    if info.inline is not None:
        return info.inline
    if wire.rank == src:
        assert frame is not None
        _broadcast_frame(wire, frame, info.length, src, "broadcast")
        return _host_view(frame)
    return _broadcast_frame(wire, None, info.length, src, "broadcast")


def _broadcast_frame(wire: Wire, frame: Optional[torch.Tensor], length: int, src: int, op: str) -> memoryview:
    """Broadcast ``length`` bytes from group rank ``src`` in chunks; receivers over their limit drain them."""
    if frame is not None:
        data = _to_device(frame, wire)
        for start in _pieces(length, wire.chunk):
            piece = data[start : start + wire.chunk]
            _guarded(op, wire, dist.broadcast, piece, src=wire.ranks[src], group=wire.group)
        return _host_view(frame)
    refuse = length > wire.max_bytes
    target = _empty(min(length, wire.chunk) if refuse else length, wire)
    for start in _pieces(length, wire.chunk):
        piece = min(wire.chunk, length - start)
        into = target[:piece] if refuse else target[start : start + piece]
        _guarded(op, wire, dist.broadcast, into, src=wire.ranks[src], group=wire.group)
    if refuse:
        raise _refused(op, src, length, wire)
    return _host_view(target)


def _refused(op: str, sender: int, length: int, wire: Wire) -> TooLargeError:
    return TooLargeError(
        f"{op}: rank {sender} sent a {length:,}-byte frame, above this rank's max_bytes={wire.max_bytes:,}; "
        "it was received into a bounded scratch buffer and dropped. Raise max_bytes here or send less"
    )


# -- scatter ---------------------------------------------------------------------------------
def scatter(wire: Wire, frames: Optional[Sequence[torch.Tensor]], error: bool, src: int) -> memoryview:
    """Frame ``r`` of ``src``'s list on group rank ``r``."""
    recv = _empty(wire.slot, wire)
    scatter_list = None
    if wire.rank == src:
        assert frames is not None
        table = torch.zeros(wire.size * wire.slot, dtype=torch.uint8)
        view = memoryview(table.numpy())
        for r, frame in enumerate(frames):
            _fill_slot(view[r * wire.slot : (r + 1) * wire.slot], frame, error, wire.max_bytes)
        scatter_list = list(_to_device(table, wire).chunk(wire.size))
    _guarded("scatter", wire, dist.scatter, recv, scatter_list, src=wire.ranks[src], group=wire.group)
    info = _read_slot(_host_view(recv))
    if wire.rank == src:
        assert frames is not None
        for r, frame in enumerate(frames):
            if r != src and frame.numel() > wire.inline_capacity:
                _send_frame(wire, frame, r, "scatter")
        return info.inline if info.inline is not None else _host_view(frames[src])
    if info.inline is not None:  # error reports always fit
        return info.inline
    return _recv_frame(wire, info.length, src, "scatter")


# -- point to point --------------------------------------------------------------------------
def send(wire: Wire, frame: torch.Tensor, error: bool, dst: int) -> None:
    """Send one frame to group rank ``dst``: a slot, then the whole frame if it did not fit."""
    slot = _to_device(_make_slot(wire, frame, error), wire)
    _guarded("send", wire, dist.send, slot, dst=wire.ranks[dst], group=wire.group)
    if frame.numel() > wire.inline_capacity:
        _send_frame(wire, frame, dst, "send")


def recv(wire: Wire, src: Optional[int]) -> tuple[int, memoryview, bool]:
    """Receive one frame from group rank ``src`` (``None``: any); return ``(sender, frame, is_error)``."""
    slot = _empty(wire.slot, wire)
    sender_global = _guarded(
        "recv", wire, dist.recv, slot, src=None if src is None else wire.ranks[src], group=wire.group
    )
    sender = list(wire.ranks).index(sender_global) if src is None else src
    info = _read_slot(_host_view(slot))
    if info.inline is not None:
        return sender, info.inline, info.error
    return sender, _recv_frame(wire, info.length, sender, "recv"), info.error


def _send_frame(wire: Wire, frame: torch.Tensor, dst: int, op: str) -> None:
    data = _to_device(frame, wire)
    for start in _pieces(frame.numel(), wire.chunk):
        _guarded(op, wire, dist.send, data[start : start + wire.chunk], dst=wire.ranks[dst], group=wire.group)


def _recv_frame(wire: Wire, length: int, src: int, op: str) -> memoryview:
    refuse = length > wire.max_bytes
    target = _empty(min(length, wire.chunk) if refuse else length, wire)
    for start in _pieces(length, wire.chunk):
        piece = min(wire.chunk, length - start)
        into = target[:piece] if refuse else target[start : start + piece]
        _guarded(op, wire, dist.recv, into, src=wire.ranks[src], group=wire.group)
    if refuse:
        raise _refused(op, src, length, wire)
    return _host_view(target)
