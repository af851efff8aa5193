"""A shared-memory call's parts: what a rank writes, where it is, and how a reader gets it back. A writer puts one
part per receiver into a segment, sealed (:mod:`objcomm._samehost.sealed`) or a file
(:mod:`objcomm._samehost.segments`): its frame unless round 1 carried it inline, then its out-of-band tensors, written
part by part and never joined (:func:`_part`). It announces where the segment is in one control word
(:func:`_where`); a reader knows it as a :data:`Source` and gets it with :func:`fetch` (mapped when sealed: views, no
copy; else read into fresh memory). The collectives of :mod:`objcomm._samehost.shm` and send/recv
(:mod:`objcomm._samehost.shm_p2p`) share these.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, Union

import torch

from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._samehost.sealed import Sealed, SealedSegment, map_sealed
from objcomm._samehost.segments import SegmentFile, _Segment, read_segment

Source = Union[SegmentFile, Sealed]  # a segment file's path and identity, or where a sealed segment is
SourceOf = Callable[[int, int], Source]  # (writer's group rank, part) -> where that segment is
Part = Tuple[Optional[Sequence[Any]], Sequence[torch.Tensor]]  # a frame's parts (None: round 1 carried it), tensors


def _where(segment: Union[_Segment, SealedSegment]) -> int:
    """The control word that says where a segment is: the descriptor of a sealed one (> 0), or minus the
    identity of a file (< 0; :func:`objcomm._samehost.segments.identity`), which readers check the file they open
    against."""
    return segment.fd if isinstance(segment, SealedSegment) else -segment.identity


def _part(out: Optional[Outgoing], frame_inline: bool) -> Part:
    assert out is not None
    return (None if frame_inline else out.parts), out.tensors  # written part by part: never joined for this


def fetch(source: Source, size: int, inline: Optional[memoryview], length: int, sizes_of: SizesOf) -> Incoming:
    """A writer's segment: mapped when sealed (views, no copy), else read into fresh memory."""
    if isinstance(source, Sealed):
        return map_sealed(source, size, inline, length, sizes_of)
    return read_segment(source.path, size, inline, length, sizes_of, expected=source.identity)
