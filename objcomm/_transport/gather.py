"""gather's rounds: every rank's frame and tensors to one rank, ``dst``.

Round 1 travels as an all_gather of slots where the wire's slot medium (the same-host channel)
carries it; through the group it is a gather of the slots to ``dst``, which then sends every rank one
word: :data:`GO` (only the rests move, each to ``dst`` point to point at its exact size) or :data:`LOOK`
(every slot follows to every rank, so that a failure, an inconsistent slot, a rank over ``dst``'s limit
or a same-host medium that may take the rest is seen, and raised, alike on every rank). The steps it
shares with all_gather and send/recv (the slot, its rest, what round 1 delivered) are
:mod:`objcomm._transport.rounds`'s, which describes the rounds.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from objcomm._device import is_cpu
from objcomm._errors import ObjcommError
from objcomm._format import limits as _limits
from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._format.slot import SlotInfo, outgoing_second_round_bytes, read_slot, read_slots
from objcomm._transport import routes
from objcomm._transport.base import INTERNAL_TAG, NOT_USED, Slot, Wire, guarded
from objcomm._transport.bytes import Batch, host_view, joined, receive_buffer, to_device
from objcomm._transport.call_clock import one_call, round_one_done
from objcomm._transport.patterns import in_rank_order
from objcomm._transport.rounds import _on_device, _rest, _round_one, _slot, _split_rest, route_of, slots_through_medium
from objcomm._transport.slot_tree import WORD, gather_up_tree, word_down_tree


@one_call
def gather(
    wire: Wire, out: Outgoing, sizes_of: SizesOf, dst: int, route: Optional[routes.CallRoute] = None
) -> Optional[Sequence[Optional[Incoming]]]:
    """Every rank's frame and tensors on group rank ``dst``; ``None`` elsewhere, unless some rank failed.

    Round 1 goes through the same-host channel as an all_gather of slots where it carries it (cheap on one host);
    through the group it is a gather of slots to ``dst``, which then sends every rank one word (:func:`_gather_slots`):
    go on, or every slot follows to every rank (a failure, an inconsistent slot, a rank over ``dst``'s limit, a
    same-host medium that may take the rest), so that every rank raises the same error in the same call. The
    rest goes to ``dst`` point to point, one message per sender at its exact size. ``route``: the group's calls'
    route (None: :func:`~objcomm._transport.rounds.route_of` the wire), which says whether the slots go to ``dst``
    up a tree (:attr:`~objcomm._transport.routes.CallRoute.up_tree`: its radix) rather than in the backend's gather,
    and whether ``dst``'s word then comes back down it (:attr:`~objcomm._transport.routes.CallRoute.word_down`).
    """
    op = "gather"
    raw = _slot(wire, out)
    got = slots_through_medium(wire, "all_gather", raw, op)
    checked: Optional[Checked] = None  # what the destination's word found of the slots (where it said go)
    if got is not NOT_USED:
        infos = [read_slot(memoryview(s)) for s in in_rank_order(got, raw, wire.rank, wire.size)]
        round_one_done()  # every rank is here: the steps after share one timeout (call_clock)
    else:
        route = route or route_of(wire)
        gathered_slots, checked = _gather_slots(wire, raw, sizes_of, dst, op, route.up_tree, route.word_down)
        round_one_done()
        if gathered_slots is None:  # dst said go: only the rests move (the strategy's, where round 1 went its way)
            if wire.rest_media.gather(wire, out, None, sizes_of, dst, op) is NOT_USED:
                _send_rest(wire, out, dst, op)
            return None
        infos = gathered_slots
    ends = checked.ends if checked is not None else _limits.round_one_ends(infos)
    if not ends:
        wire.slot_medium.agree(wire, infos, op)
    plans = checked.plans if checked is not None else _limits.plans(infos, sizes_of, op)
    if ends:  # an error report, or every slot carried its whole message: nothing moves
        return _round_one(infos)
    if checked is None:
        _check_limits(wire, infos, dst, op)
    gathered = wire.rest_media.gather(wire, out, infos, _limits.checked_sizes(sizes_of, infos), dst, op)
    if gathered is not NOT_USED:
        return gathered
    if wire.rank != dst:
        _send_rest(wire, out, dst, op)
        return None
    batch = Batch(wire._replace(tag=INTERNAL_TAG), op, together=True)
    rests = [
        batch.recv(info.second_round_bytes, r, info.piece) if info.second_round_bytes and r != dst else None
        for r, info in enumerate(infos)
    ]
    batch.wait()
    return [
        Incoming(out.frame, [to_device(t, wire) for t in out.tensors])
        if r == dst
        else _split_rest(sizes_of, info, plans[r], rests[r], r, op)
        for r, info in enumerate(infos)
    ]


GO, LOOK = 0, 1  # a gather's word from its destination after round 1


class Checked(NamedTuple):
    """What the destination's word checked of round 1, where it said go: not checked again."""

    plans: List[Optional[List[int]]]  # every sender's tensor sizes (limits.plans)
    ends: bool  # every slot carried its whole message: nothing moves


def _gather_slots(
    wire: Wire, raw: bytearray, sizes_of: SizesOf, dst: int, op: str, up_tree: int, word_tree: bool = False
) -> Tuple[Optional[List[SlotInfo]], Optional[Checked]]:
    """Round 1 of a gather through the group: every slot to ``dst``, then ``dst``'s word to every rank (back down
    the tree the slots climbed, ``up_tree`` and ``word_tree``; else a broadcast on gloo, an all_reduce on NCCL):
    :data:`GO` (the slots stay on ``dst``: returned there, with the plans its word checked, None elsewhere) or
    :data:`LOOK` (``dst`` broadcasts every slot: every rank gets them, as after an all_gather, and raises what the
    others raise)."""
    slots = wire.slot_medium.gather(wire, raw, dst, op)
    if slots is not NOT_USED:  # the slot medium's gather (two levels), then its share of the word and table
        return _gather_slots_through(wire, slots, sizes_of, dst, op)
    table: Optional[torch.Tensor] = None
    host: Optional[memoryview] = None
    if up_tree:
        tree_table = gather_up_tree(wire, raw, wire.slot, dst, op, radix=up_tree)
        if tree_table is not None:
            table, host = torch.frombuffer(tree_table, dtype=torch.uint8), memoryview(tree_table)
    else:
        mine = _on_device(wire, raw)
        if wire.rank == dst:
            table, host = receive_buffer(wire.slot * wire.size, wire)
            guarded(op, wire, dist.gather, mine, list(table.chunk(wire.size)), dst=wire.ranks[dst], group=wire.group)
        else:
            guarded(op, wire, dist.gather, mine, None, dst=wire.ranks[dst], group=wire.group)
    verdict: Optional[int] = None
    infos: List[SlotInfo] = []
    checked: Optional[Checked] = None
    if table is not None:
        infos = read_slots(host if host is not None else host_view(table), wire.size, wire.slot)
        verdict, checked = _verdict(wire, infos, sizes_of, dst, op)
    if up_tree and word_tree:  # back down the tree the slots climbed (NCCL's all_reduce of a word climbs one and back)
        verdict = word_down_tree(wire, verdict, dst, op, up_tree)
    else:
        word = torch.tensor([verdict or 0], dtype=torch.int64, device=wire.device)
        if is_cpu(wire.device):  # gloo: a binomial tree
            guarded(op, wire, dist.broadcast, word, src=wire.ranks[dst], group=wire.group)
        else:  # NCCL broadcasts along a ring; its all_reduce of a word takes a tree (every other rank adds 0)
            guarded(op, wire, dist.all_reduce, word, op=dist.ReduceOp.MAX, group=wire.group)
        verdict = int(word.item())
    if verdict == GO:
        return (infos, checked) if wire.rank == dst else (None, None)
    if table is None:  # every rank takes the slots (W of them: allocated here only, not on every call)
        table, host = receive_buffer(wire.slot * wire.size, wire)
    shared = to_device(table, wire)  # (the destination's table up the tree is host memory)
    guarded(op, wire, dist.broadcast, shared, src=wire.ranks[dst], group=wire.group)
    return read_slots(host if host is not None else host_view(shared), wire.size, wire.slot), None


def _gather_slots_through(
    wire: Wire, slots: Optional[List[Slot]], sizes_of: SizesOf, dst: int, op: str
) -> Tuple[Optional[List[SlotInfo]], Optional[Checked]]:
    """:func:`_gather_slots` where the slot medium gathered the slots (``slots``: on ``dst``): its
    :meth:`~objcomm._transport.base.SlotMedium.share` carries ``dst``'s word, and the table after a failure."""
    infos = [read_slot(memoryview(s)) for s in slots] if slots is not None else []
    verdict, checked = _verdict(wire, infos, sizes_of, dst, op) if wire.rank == dst else (GO, None)
    said = wire.slot_medium.share(wire, WORD.pack(verdict) if wire.rank == dst else None, WORD.size, dst, op)
    assert said is not NOT_USED  # the strategy that gathered shares
    if WORD.unpack(bytes(said))[0] == GO:
        return (infos, checked) if wire.rank == dst else (None, None)
    table = wire.slot_medium.share(wire, b"".join(slots) if slots else None, wire.slot * wire.size, dst, op)
    assert table is not NOT_USED
    return read_slots(memoryview(table), wire.size, wire.slot), None


def _verdict(wire: Wire, infos: List[SlotInfo], sizes_of: SizesOf, dst: int, op: str) -> Tuple[int, Optional[Checked]]:
    """:data:`LOOK` where every rank must see the slots: an error report, an inconsistent slot, a rank over
    ``dst``'s limit, or a rest that a same-host medium may take (it reads every slot); else :data:`GO`, with what
    it checked (the destination then checks nothing twice)."""
    try:  # (a slot that carries a whole frame may still list sizes its frame lacks: every rank must see that)
        plans = _limits.plans(infos, sizes_of, op)
        if _limits.round_one_ends(infos):
            return (LOOK, None) if any(info.error for info in infos) else (GO, Checked(plans, True))
        _check_limits(wire, infos, dst, op)
    except ObjcommError:
        return LOOK, None
    moved = max(0 if r == dst else info.second_round_bytes for r, info in enumerate(infos))
    return (LOOK, None) if wire.rest_media.worth(wire, moved, op) else (GO, Checked(plans, False))


def _check_limits(wire: Wire, infos: List[SlotInfo], dst: int, op: str) -> None:
    """Every sender's total against ``dst``'s limit, and against the limit of each rank that holds it on its way
    there (:meth:`~objcomm._transport.base.RestMedia.relays`: on two levels, the leaders)."""
    _limits.check_limits(infos, [dst], op, wire.inline_capacity)
    _limits.check_relays(infos, wire.rest_media.relays(wire, dst, op), dst, op, wire.inline_capacity)


def _send_rest(wire: Wire, out: Outgoing, dst: int, op: str) -> None:
    """This rank's rest (its frame past the slot, then its tensors) to ``dst``, as one message."""
    if outgoing_second_round_bytes(out, wire.inline_capacity):
        batch = Batch(wire._replace(tag=INTERNAL_TAG), op, together=True)
        batch.send(joined(_rest(wire, out), wire), dst)
        batch.wait()
