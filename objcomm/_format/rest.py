"""A message's *rest* as one stream of bytes: what follows its slot when the slot could not carry it all.

The layout is the same on every medium that moves a rest as bytes (a segment file, the same-host channel's messages,
two levels' bundles, a send's one message through a CPU group's backend): the frame unless the slot carried it
(``inline``), then each out-of-band tensor's bytes, back to back. :func:`pieces` lays out what a rank sends;
:func:`incoming` reads what arrived, checked against the sender's slot.

>>> import torch
>>> from objcomm._format.message import Outgoing
>>> out = Outgoing(parts=[b"frame"], tensors=[torch.arange(3, dtype=torch.uint8)], nbytes=5)
>>> b"".join(pieces(out, inline=False))
b'frame\\x00\\x01\\x02'
"""

from __future__ import annotations

from typing import List, Union

import torch

from objcomm._errors import FrameError
from objcomm._format import limits as _limits
from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._format.slot import SlotInfo


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """``tensor``'s bytes in host memory, flat (a copy only where it is not a contiguous CPU tensor)."""
    # the ignore below: numpy's stubs give ndarray no buffer protocol (__buffer__) before Python 3.12
    return memoryview(tensor.detach().reshape(-1).cpu().contiguous().numpy()).cast("B")  # type: ignore[arg-type]


def pieces(out: Outgoing, inline: bool) -> List[memoryview]:
    """What a rank moves after round 1, as byte views: its frame's parts unless the slot carried it (``inline``),
    then its tensors' bytes (in host memory)."""
    frame = [] if inline else [memoryview(p).cast("B") for p in out.parts]
    return [p for p in frame + [host_bytes(t) for t in out.tensors] if p.nbytes]


def incoming(data: Union[bytearray, memoryview], info: SlotInfo, sizes_of: SizesOf, sender: int, op: str) -> Incoming:
    """``sender``'s frame (unless round 1 carried it) and tensors from its rest's bytes ``data`` (writable), read as a
    segment is (:func:`objcomm._samehost.segments.read_segment`); the tensors are views of ``data``. The frame's tensor
    table must agree with the slot (:class:`~objcomm.FrameError` if not, as on every path)."""
    view = memoryview(data)
    position = 0
    frame = info.inline
    if frame is None:
        if info.length > len(view):
            raise FrameError(
                f"{op}: rank {sender}'s slot announces a {info.length:,}-byte frame in a second round of "
                f"{len(view):,} bytes; refused"
            )
        frame, position = view[: info.length], info.length
    # against its own sender's slot, as the backend's path checks it (not :class:`objcomm._format.limits.CheckedSizes`,
    # whose OSError sends shared memory back to the backend: these bytes have moved)
    sizes, problem = _limits.table_sizes(getattr(sizes_of, "raw", sizes_of), frame)
    problem = problem or _limits.table_problem(info.length, info.total, sizes, info.sizes)
    if problem:  # (the frame and its table make the slot's total: the rest of ``data`` is the tensors)
        raise _limits.inconsistent(op, sender, problem)
    if not sizes:
        return Incoming(frame, [])
    whole = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
    tensors = []
    for n in sizes:  # views at their offset in ``whole``: the restorer copies one its dtype cannot start at
        tensors.append(whole[position : position + n])
        position += n
    return Incoming(frame, tensors)
