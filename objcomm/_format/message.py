"""A message as the layers below the object API see it: what one rank sends (:class:`Outgoing`: a frame
and tensors) and what arrived from one rank (:class:`Incoming`).

Bytes and tensors only, no process group: the frame (:mod:`objcomm._format.frame`), the round-1 slot
(:mod:`objcomm._format.slot`), the transport (:mod:`objcomm._transport`) and the same-host media all pass these.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Protocol, Sequence, Union

import torch

SLOT_PREFIX_BYTES = 24  # frame length word, sender's max_bytes, sender's total (see objcomm._format.slot)
SizesOf = Callable[[memoryview], List[int]]  # tensor byte sizes announced in a frame
CopyOut = Callable[[int, type], Union[bytes, bytearray]]  # (out-of-band index, bytes or bytearray) -> a new one


class HasCapacity(Protocol):
    """What :meth:`Outgoing.complete` reads of a wire (:class:`objcomm._transport.base.Wire`)."""

    @property
    def inline_capacity(self) -> int: ...


JOIN_BELOW = 1 << 16  # frames up to this many bytes are joined to be copied (Outgoing.copy_frame_into)


class Outgoing:
    """What one rank sends: a frame (host memory) and flat uint8 tensors (on any device).

    The frame may be given whole (``frame``) or as the ``parts`` it is made of, back to back (a
    header and the serializer's own output): they are joined into one buffer only where one is
    needed (:attr:`frame`), so that paths that write parts where they go (a slot, a shared-memory
    segment) never copy the payload just to glue it to its header.
    """

    __slots__ = ("parts", "tensors", "error", "frame_nbytes", "_frame")

    def __init__(
        self,
        frame: Any = None,
        tensors: Sequence[torch.Tensor] = (),
        error: bool = False,
        *,
        parts: Sequence[Any] = (),
        nbytes: Optional[int] = None,
    ) -> None:
        if frame is not None:
            frame = memoryview(frame)
            parts = (frame,)
            nbytes = frame.nbytes
        self.parts: Sequence[Any] = parts
        self.tensors = tensors
        self.error = error
        # nbytes: the parts' length when the caller knows it (the encoder does), so they need not be measured
        self.frame_nbytes = sum(memoryview(p).nbytes for p in parts) if nbytes is None else nbytes
        self._frame: Optional[memoryview] = frame

    @property
    def frame(self) -> memoryview:
        """The frame as one buffer (its parts joined on first use: the one copy a frame may take)."""
        if self._frame is None:
            parts = self.parts  # joined into writable memory: frame_tensor() views it
            one = len(parts) == 1 and not memoryview(parts[0]).readonly
            self._frame = memoryview(parts[0]) if one else memoryview(bytearray().join(parts))
        return self._frame

    @property
    def total(self) -> int:
        if not self.tensors:  # the common small case, without summing nothing
            return self.frame_nbytes
        return self.frame_nbytes + sum(t.numel() for t in self.tensors)

    def complete(self, wire: HasCapacity) -> bool:
        """Round 1 carries all of it: the frame fits the slot and there are no tensors."""
        return self.frame_nbytes <= wire.inline_capacity and not self.tensors

    def frame_tensor(self) -> torch.Tensor:
        """The frame as a uint8 tensor sharing its memory (for the second round)."""
        return torch.frombuffer(self.frame, dtype=torch.uint8)

    def copy_frame_into(self, view: memoryview) -> None:
        """Write the frame's bytes at the start of ``view``: a small frame joined first (one C call, not a
        loop over its parts), a large one part after part (never a second copy of all of it in memory)."""
        if self._frame is not None or self.frame_nbytes <= JOIN_BELOW:
            view[: self.frame_nbytes] = self._frame if self._frame is not None else b"".join(self.parts)
            return
        at = 0
        for part in self.parts:
            n = memoryview(part).nbytes
            view[at : at + n] = part
            at += n

    def __repr__(self) -> str:
        return f"Outgoing({self.frame_nbytes:,}-byte frame, {len(self.tensors)} tensors, error={self.error})"


class Incoming:
    """What arrived from one rank: its frame (CPU) and its tensors (on the wire's device).

    ``copy_out``, where set, builds out-of-band buffer ``i`` as a new ``bytes`` or ``bytearray`` straight
    from where it lies (a sealed segment: ``pread``), so that a result that must own its memory is copied
    once without faulting the pages of a view on top of the copy (see :class:`objcomm._samehost.sealed.Buffers`).
    ``sender_limit``: a send/recv's, the max_bytes its slot announced (the reduce tree: its subtree's lowest);
    ``relayed``: it came down the reduce tree, relayed by peers (:func:`objcomm._transport.broadcast.down_tree`);
    ``refused``: down the tree, why this rank refused what its parent sent (``error`` is set). A class with slots:
    an all_gather makes one a rank (8192 of them on 8192 ranks), each without a dict of its own.
    """

    __slots__ = ("frame", "tensors", "error", "copy_out", "sender_limit", "relayed", "refused")

    def __init__(
        self,
        frame: memoryview,
        tensors: Sequence[torch.Tensor] = (),
        error: bool = False,  # the frame is an error report
        copy_out: Optional[CopyOut] = None,
        sender_limit: int = 0,
        relayed: bool = False,
        refused: Optional[Exception] = None,
    ) -> None:
        self.frame = frame
        self.tensors = tensors  # (no list of its own where none came: one object less a rank to collect)
        self.error = error
        self.copy_out = copy_out
        self.sender_limit = sender_limit
        self.relayed = relayed
        self.refused = refused

    def __repr__(self) -> str:
        return f"Incoming({self.frame.nbytes:,}-byte frame, {len(self.tensors)} tensors, error={self.error})"
