"""Every rank's failure report, to every rank, along the reduce tree's edges: the failure path of an ``all_reduce``
whose result came back down the tree (:func:`objcomm._transport.broadcast.down_tree`).

Elsewhere a failure reaches every rank through a collective of the group (an ``all_gather`` of every rank's report),
which every rank enters because every rank received the same error report from group rank 0. Down the tree a rank
learns of a failure from its parent alone: a lying relay can hand its subtree an error report that no other rank
sees, and a subtree that then entered a group collective alone would meet the other ranks' *next* collective and hand
them wrong data, silently. So the reports move point to point along the same tree, up then down, and a subtree that a
relay misleads waits on that relay (the group's timeout, ``CommunicationError``) while every other rank stays in step.

A message is a bundle of the failure reports of one subtree (up) or of the whole group (down): records of
``(group rank u32, length u32, error frame)``, ranks ascending; ranks without a failure are left out. A bundle is
checked before anything is read from it: ranks inside the subtree it comes from, ascending, each report at most a slot's
frame, nothing left over. Its size is bounded before it arrives, by the ranks it may speak for. A child's bundle that
fails a check stands as one report of its own, naming that child, and the tree goes on: the other ranks still raise,
at once, with every report that could be read.
"""

from __future__ import annotations

import struct
from typing import Dict, List, Optional, Sequence

from objcomm._errors import CommunicationError, FrameError, ObjcommError
from objcomm._format.frame import error_frame
from objcomm._format.message import Incoming, Outgoing
from objcomm._transport import p2p as _p2p
from objcomm._transport.base import INTERNAL_TAG, TreeLevels, Wire
from objcomm._transport.patterns import binomial

_RECORD = struct.Struct("<II")  # group rank, report length


def reports_over_tree(
    wire: Wire, report: Outgoing, levels: Optional[TreeLevels] = None, began_here: bool = False
) -> List[Optional[Incoming]]:
    """Every rank's report (``report`` here: an error frame, or anything else for none), by group rank: ``None`` where
    a rank had no failure. Called by every rank that received an error report down the tree (honest ranks: all).
    ``levels``: the two levels the result came down (:func:`objcomm._transport.broadcast.down_tree`): up each host's
    tree and the leaders', then down the leaders' and each host's, the same edges.

    ``began_here``: this rank refused what its parent sent (a relay above hid a limit, or changed the sizes), so the
    failure began here: its parent returned the result and waits for nothing. The reports then go up to this rank
    and back down its subtree only, the ranks it passed an error report to; nothing goes to its parent (there it
    would wait, unread, for the parent's next receive from this rank, and be read as that call's message)."""
    wire = wire._replace(tag=INTERNAL_TAG)
    reports: Dict[int, bytes] = {wire.rank: bytes(report.frame)} if report.error else {}
    above = not began_here  # whether the failure came from above: then the reports go up to the parent and back
    if levels is None:
        everyone = range(wire.size)
        reports = _up(wire, wire.rank, everyone, everyone, reports, above)
        reports = _down(wire, wire.rank, everyone, reports, above)
    else:
        home = levels.home
        leader, last = levels.leaders[home], levels.lasts[home]
        host = range(leader, last + 1)
        if levels.host is not None:  # (a leader is its host's root: only a host's other ranks have a parent there)
            reports = _up(levels.host, wire.rank - leader, host, host, reports, above)
        if wire.rank == leader:
            reports = levels.lead(_up, wire, home, levels.leaders, levels.lasts, reports, above)
            reports = levels.lead(_down, wire, home, levels.leaders, reports, above)
        if levels.host is not None:
            reports = _down(levels.host, wire.rank - leader, host, reports, above)
    found: List[Optional[Incoming]] = [None] * wire.size
    for r, frame in reports.items():
        found[r] = Incoming(memoryview(frame), error=True)
    return found


def _up(
    wire: Wire, me: int, ranks: Sequence[int], lasts: Sequence[int], reports: Dict[int, bytes], to_parent: bool = True
) -> Dict[int, bytes]:
    """The reports of this rank's subtree, up a binomial tree over the group ranks ``ranks`` (this rank: ``ranks[me]``;
    ``lasts[i]``: the highest group rank ``ranks[i]`` speaks for), the reduce tree's rounds
    (:mod:`objcomm._api.reduce`): what the tree's root holds then, or what this rank sent up (``to_parent``: False,
    this rank is the root of the exchange)."""
    rank, tree = ranks[me], binomial(me, len(ranks))
    for child, end in zip(tree.children, tree.ends):
        peer = ranks[child]
        try:
            reports.update(_receive(wire, peer, peer, lasts[end - 1] + 1))
        except CommunicationError:
            raise
        except ObjcommError as exc:  # the child's reports stand for it, unread: the tree goes on without them
            unread = FrameError(f"rank {peer} sent failure reports that rank {rank} could not read: {exc}")
            reports[peer] = bytes(error_frame(unread, wire.inline_capacity).frame)
    if tree.parent is not None and to_parent:
        speaks = lasts[tree.end - 1] - rank + 1
        _p2p.send(wire._replace(max_bytes=_bound(wire, speaks)), Outgoing(_pack(reports)), ranks[tree.parent])
    return reports


def _down(
    wire: Wire, me: int, ranks: Sequence[int], reports: Dict[int, bytes], from_parent: bool = True
) -> Dict[int, bytes]:
    """Every rank's reports, from the root of the binomial tree over ``ranks`` to this rank (``ranks[me]``) and on to
    its children (:func:`objcomm._transport.broadcast.down_tree`'s edges; ``from_parent``: False, this rank is the
    root of the exchange)."""
    tree = binomial(me, len(ranks))
    if tree.parent is not None and from_parent:  # from the parent, everything
        reports = _receive(wire, ranks[tree.parent], 0, wire.size)
    bundle = Outgoing(_pack(reports))
    for child in reversed(tree.children):
        _p2p.send(wire._replace(max_bytes=_bound(wire, wire.size)), bundle, ranks[child])
    return reports


def _bound(wire: Wire, ranks: int) -> int:
    """The largest bundle ``ranks`` reports can make."""
    return ranks * (_RECORD.size + wire.inline_capacity)


def _pack(reports: Dict[int, bytes]) -> bytes:
    return b"".join(_RECORD.pack(r, len(frame)) + frame for r, frame in sorted(reports.items()))


def _receive(wire: Wire, peer: int, low: int, high: int) -> Dict[int, bytes]:
    """The bundle group rank ``peer`` sends, speaking for ranks ``low`` to ``high - 1``, checked."""
    _, got, _ = _p2p.recv(wire._replace(max_bytes=_bound(wire, high - low)), peer, lambda frame: [])
    if got.tensors:
        raise FrameError(f"all_reduce: rank {peer} sent tensors with its failure reports: a protocol error")
    view, at, last = got.frame, 0, low - 1
    reports: Dict[int, bytes] = {}
    while at < view.nbytes:
        if view.nbytes - at < _RECORD.size:
            raise FrameError(f"all_reduce: rank {peer}'s failure reports end inside a record: a protocol error")
        r, length = _RECORD.unpack_from(view, at)
        at += _RECORD.size
        if not last < r < high or length > wire.inline_capacity or length > view.nbytes - at:
            raise FrameError(
                f"all_reduce: rank {peer} sent a failure report for rank {r} of {length:,} bytes, where it speaks "
                f"for ranks {low}-{high - 1} after rank {last}, with reports of at most {wire.inline_capacity:,} "
                "bytes: a protocol error"
            )
        reports[r] = bytes(view[at : at + length])
        at, last = at + length, r
    return reports
