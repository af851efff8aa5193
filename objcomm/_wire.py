"""What every layer under the object API shares: where frames go and what moves.

A leaf module (torch only): the transport (:mod:`objcomm._transport`), the same-host path
(:mod:`objcomm._shm`, :mod:`objcomm._segments`), host discovery (:mod:`objcomm._hosts`) and the
frame format (:mod:`objcomm._framing`) all import from here and never from each other's
private names, so there is no import cycle among them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from ._errors import CommunicationError

if TYPE_CHECKING:  # a type only: the same-host settings live with the same-host path
    from ._shm import ShmConfig

SLOT_PREFIX_BYTES = 24  # frame length word, sender's max_bytes, sender's total (see _transport)
SizesOf = Callable[[memoryview], List[int]]  # tensor byte sizes announced in a frame

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Wire(NamedTuple):
    """Where and how frames move: the group, this rank's place in it, and the size limits."""

    group: Any
    ranks: Sequence[int]  # global rank of each group rank
    rank: int  # this process's rank in the group
    device: torch.device
    slot: int  # bytes per rank in round 1, prefix included
    chunk: int  # largest single transfer in round 2
    max_bytes: int  # largest payload (frame plus tensors) this rank accepts
    shm: Optional[ShmConfig] = None  # same-host fast path (objcomm/_shm.py); None: off

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def inline_capacity(self) -> int:
        return self.slot - SLOT_PREFIX_BYTES


@dataclass
class Outgoing:
    """What one rank sends: a frame (bytes-like, host memory) and flat uint8 tensors (on any device)."""

    frame: memoryview
    tensors: Sequence[torch.Tensor] = ()
    error: bool = False

    @property
    def total(self) -> int:
        return self.frame.nbytes + sum(t.numel() for t in self.tensors)

    def complete(self, wire: Wire) -> bool:
        """Round 1 carries all of it: the frame fits the slot and there are no tensors."""
        return self.frame.nbytes <= wire.inline_capacity and not self.tensors

    def frame_tensor(self) -> torch.Tensor:
        """The frame as a uint8 tensor sharing its memory (for the second round)."""
        return torch.frombuffer(self.frame, dtype=torch.uint8)


@dataclass
class Incoming:
    """What arrived from one rank: its frame (CPU) and its tensors (on the wire's device)."""

    frame: memoryview
    tensors: List[torch.Tensor] = field(default_factory=list)
    error: bool = False  # the frame is an error report


def guarded(what: str, wire: Wire, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a torch.distributed call, turning its failures into CommunicationError."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        raise CommunicationError(
            f"{what} failed on rank {wire.rank} of a group of {wire.size}: {exc}. "
            "A rank may have crashed, never called this operation, or called a different one; "
            "the group's timeout (init_process_group(timeout=...)) bounds how long ranks wait"
        ) from exc
