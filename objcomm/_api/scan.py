"""Prefix reductions of Python objects: ``scan`` (ranks ``0 .. r`` combined, on rank ``r``) and ``exscan`` (ranks
``0 .. r - 1``; ``None`` on rank 0), as mpi4py's ``comm.scan`` and ``comm.exscan``.

The partial results go up by doubling distances (:func:`objcomm._transport.patterns.prefix_steps`): ceil(log2 W)
steps of at most one send and one receive a rank, each message a point-to-point one (slot, then rest: as a
reduction's tree sends them, :func:`objcomm._transport.p2p.tree_send`), where an all_gather and a local combine move
every rank's object to every rank. ``op(a, b)`` is assumed associative, never commutative: what a rank receives
holds lower ranks, and goes on the left. A failure (encoding, decoding, ``op`` raising, a refusal) never stops a rank
from taking part: it sends an error report on in place of its partial, and one vote at the end tells every rank
whether any rank failed (then an all_gather of the reports, so that every rank raises the same
:class:`~objcomm.RemoteError`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from objcomm._api.reduce import Op, _ranks, check_op, op_error, op_flags, taking_part
from objcomm._errors import CommunicationError, ObjcommError
from objcomm._format import frame as _frame
from objcomm._format.message import Outgoing
from objcomm._transport import p2p as _p2p
from objcomm._transport.base import INTERNAL_TAG
from objcomm._transport.patterns import prefix_steps


class Scanned(NamedTuple):
    """What :func:`prefix` leaves on a rank."""

    value: Any  # the prefix (exclusive: None on group rank 0), where complete
    complete: bool  # no failure here or on a rank below that this rank heard of
    own: Optional[BaseException]  # what failed on this rank


def prefix(call: Any, obj: Any, op: Op, exclusive: bool = False) -> Scanned:
    """This rank's prefix of every rank's ``obj`` combined with ``op`` over ``call.wire``: ranks ``0 .. rank``
    (``exclusive``: ``0 .. rank - 1``, None on group rank 0)."""
    fn, own = taking_part(op)
    flags = op_flags(op)  # (each message marks the op: ranks that passed different ones fail alike)
    wire = call.wire._replace(tag=INTERNAL_TAG)
    me, complete = wire.rank, own is None
    held, before = obj, None  # ranks lowest .. me, and lowest .. me - 1 (None: no rank yet)
    lowest = me  # the lowest rank ``held`` combines
    encoded: Optional[Outgoing] = None  # ``held`` encoded, while it is unchanged
    steps = prefix_steps(me, wire.size)
    for at, step in enumerate(steps):
        out: Optional[Outgoing] = None
        if step.to is not None and complete:  # what this rank holds before the step, whichever message goes first
            if encoded is None:
                encoded, failed = call.encode(held, flags=flags)  # (an error report where it cannot be encoded)
                own, complete = own or failed, failed is None
            out = encoded
        elif step.to is not None:
            out = _frame.error_frame(own or ObjcommError("a rank below failed"), wire.inline_capacity)
        if step.send_first and out is not None and step.to is not None:  # (a refusal: its receiver knows too)
            refused = _p2p.tree_send(wire, out, step.to)  # (sent whatever this rank's own failure)
            own = own or refused
        if step.source is not None:
            try:
                _, item, is_error = _p2p.recv(wire, step.source, _frame.tensor_sizes, tree=True)
                if is_error:
                    complete = False
                elif complete:
                    theirs = call.decode(item, step.source)
                    check_op(item, flags, op, step.source)
                    start = max(0, step.source - (me - lowest))  # what the source held: as many ranks as this one
                    left = _ranks(start, step.source)
                    # an exscan combines ``theirs`` twice, where a later step sends what this rank holds: a function
                    # of the caller's may update its first argument, so it gets a second decoding (never a copy,
                    # which an object may refuse)
                    # (a rank past which nothing goes at one distance sends nothing at the larger ones either)
                    if not exclusive or (at + 1 < len(steps) and steps[at + 1].to is not None):
                        first = call.decode(item, step.source) if exclusive and not isinstance(op, str) else theirs
                        try:  # (the caller's object only ever on the right)
                            held, encoded = fn(first, held), None
                        except Exception as exc:
                            raise op_error(op, fn, exc, left, _ranks(lowest, me)) from exc
                    if exclusive:
                        try:
                            before = theirs if before is None else fn(theirs, before)
                        except Exception as exc:
                            raise op_error(op, fn, exc, left, _ranks(lowest, me - 1)) from exc
                    lowest = start
            except CommunicationError:
                raise
            except Exception as exc:  # refused, undecodable, or op raised: reported at the end
                own, complete = own or exc, False
        if not step.send_first and out is not None and step.to is not None:
            refused = _p2p.tree_send(wire, out, step.to)
            own = own or refused
    if not complete:
        return Scanned(None, False, own)
    return Scanned(before if exclusive else held, True, own)
