"""Moving variable-length frames (CPU uint8 tensors) and out-of-band tensors with torch.distributed.

Every operation is one or two rounds:

1. A fixed-size **slot** per rank travels in a single collective (or message). Its 24-byte prefix holds the frame
   length (top bit: "this is an error report"; next bit, in scatter: "some rank gets more than its slot"), the
   sender's ``max_bytes`` and the total bytes the sender will move (frame plus tensors). When the frame fits and
   there are no out-of-band tensors, the call is done.
2. Frames that did not fit travel again, whole and at their exact size where the collective allows it; then the
   out-of-band tensors travel as tensors (never through the host on NCCL), in the pieces the sender's slot announced.

Every rank that must act on something learns it in round 1, so all ranks decide alike (skip round 2 after an error,
refuse a payload above a receiver's limit) and none waits for a transfer that never comes. A slot lists the tensor
sizes where they fit, so round 1 tells every transfer that follows. Receivers trust no single number: the frame
length, the listed sizes, the frame's tensor table and the total must agree (:mod:`objcomm._format.limits`), else
:class:`FrameError` before anything of an announced size is allocated. Where the sender cannot know the receivers'
limits (broadcast, scatter, send/recv), a receiver over its limit drains transfers of at most 1 MiB through one
scratch buffer, then raises alone; where the sizes are not all listed (scatter always), a transfer is larger, or
shared memory may be used, the receivers answer first (a vote, or an acknowledgement), before any buffer exists.

Frames come back as CPU ``memoryview`` s in group-rank order, tensors as flat uint8 tensors on the wire's device; the
slot's layout is :mod:`objcomm._format.slot`. Round 1 goes through the wire's slot medium
(:class:`~objcomm._transport.base.SlotMedium`: the same-host channel) when it takes the slots, else through the
group; so does a send/recv's slot (:meth:`~objcomm._transport.base.SlotMedium.p2p`), whose route then carries the
receiver's answer (a few µs; it paces the sender) and, on CPU wires, the rest that shared memory does not take. After
round 1 each operation asks the rest media (:class:`~objcomm._transport.base.RestMedia`) once whether they take the
rest; on ``NOT_USED`` the transport moves it. The steps after round 1 share one timeout (:mod:`.call_clock`).

The steps every operation shares, and all_gather; send/recv: :mod:`.p2p`, gather: :mod:`.gather`, broadcast:
:mod:`.broadcast`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from objcomm._device import is_cpu
from objcomm._errors import CommunicationError, ObjcommError
from objcomm._format import limits as _limits
from objcomm._format.frame import error_frame, parse_header, read_error
from objcomm._format.message import SLOT_PREFIX_BYTES, Incoming, Outgoing, SizesOf
from objcomm._format.slot import SlotInfo, fill_slot, read_slot, read_slots
from objcomm._transport import routes
from objcomm._transport.base import BACKEND, NOT_USED, Mine, NotUsed, Slot, Wire, all_gather_single, guarded, largest_of
from objcomm._transport.bytes import at_pieces, host_view, receive_buffer, zeroed
from objcomm._transport.call_clock import one_call, round_one_done
from objcomm._transport.exchange import LaidRests, all_gather_rests
from objcomm._transport.patterns import in_rank_order, pattern

SCRATCH = _limits.SCRATCH_BYTES
REFUSE_LIMIT, REFUSE_MALFORMED = 1, 2  # a receiver's answer (0: go ahead)


def _slot(wire: Wire, out: Outgoing) -> bytearray:
    slot = bytearray(wire.slot)
    fill_slot(memoryview(slot), out, wire.max_bytes, piece=wire.chunk)
    return slot


def _on_device(wire: Wire, raw: bytearray) -> torch.Tensor:
    tensor = torch.frombuffer(raw, dtype=torch.uint8)  # on the CPU
    return tensor if is_cpu(wire.device) else tensor.to(wire.device)


def _agreement_needed(wire: Wire, info: SlotInfo, op: str, media: bool = True, peer: Optional[int] = None) -> bool:
    """Whether receivers must answer the sender before round 2 (a vote, or an acknowledgement).

    Not when round 1 listed every transfer that follows and none exceeds the scratch size: a
    receiver over its limit then drains them through one small buffer and raises alone. Yes when
    the sizes are unknown, a transfer is larger, or (``media``) this rank's rest media may take the bytes. From the
    slot and this rank's settings: a send's receiver reads the sender's decision from its message instead
    (:mod:`.p2p`), and ``media=False`` gives what the slot alone requires. ``peer``: a send's receiver, which the
    media may know to run on another host.
    """
    if info.sizes is None:
        return True
    largest = _limits.largest_piece(0 if info.inline is not None else info.length, info.sizes, info.piece)
    return routes.agreement_needed(
        sizes_listed=True,
        largest_piece=largest,
        medium_may_take=media and wire.rest_media.worth(wire, info.second_round_bytes, op, peer),
    )


def _vote_refusals(
    wire: Wire,
    refuse: int,
    info: SlotInfo,
    src: int,
    op: str,
    problem: Optional[str] = None,
    longest: Optional[int] = None,
) -> int:
    """Raise the same error on every rank if any receiver refuses ``src``'s payload (``refuse``: this rank's
    REFUSE_* code, 0 to accept). One tiny all_reduce ahead of a second round that not every receiver may take.
    ``longest`` (scatter): the root's longest second round to any rank, 0 elsewhere, which the vote carries to
    every rank (its receivers know only their own), with the largest part a receiver refused (each has its own) and
    the highest rank that refused one, which every rank's error names (two words: with several refusers they may
    be two ranks'); returned (0 without it)."""
    refused, refuser = info.total, 0
    if longest is None:
        (code,), longest = largest_of(wire, [refuse], op, torch.int32), 0
    else:  # int64: a second round may pass 2 GiB; scatter's parts differ, so the vote names who refused what
        words = [refuse, longest, info.total if refuse else 0, wire.rank + 1 if refuse else 0]
        code, longest, refused, refuser = largest_of(wire, words, op, moved_at=1)
    if code == REFUSE_MALFORMED:
        raise _limits.inconsistent(op, src, problem or "a receiving rank found the sizes in its slot inconsistent")
    if code:
        # (with several refusers, the largest part and the highest refuser may be two ranks': said so)
        if refuser:
            detail = f"the largest part refused; rank {refuser - 1} refused one"
        else:
            detail = f"this rank's max_bytes: {wire.max_bytes:,}"
        raise refused_alike(op, src, refused, detail)
    round_one_done()  # every rank voted, so every rank is here: the steps after share one timeout (call_clock)
    return longest


def refused_alike(op: str, src: int, refused: int, detail: str) -> ObjcommError:
    """The error every rank raises where a receiver refused ``src``'s ``refused`` bytes (``detail``: which limit)."""
    return _limits.too_large(
        f"{op}: rank {src} sends {refused:,} bytes to a rank whose max_bytes it exceeds ({detail})",
        where="on the receiving ranks",
    )


# -- all_gather ------------------------------------------------------------------------------
class SlotMemory:
    """The slots that the last two all_gathers (or broadcasts) on one group, with the settings' slot ``base``,
    suggested for the next (:func:`routes.slot_after`; ``most``: what the slots of one call may hold together;
    ``narrow``: a narrower slot for frames that all passed ``base``, 0: none), where their slots went through the
    backend: the next takes the smaller where both were wider, the wider where both were narrower, else ``base``
    (:attr:`slot`). Every rank reads the same slots
    in round 1, so every rank's memory holds the same; each is kept with its group
    (:func:`objcomm._state.group_facts`). Only a call that passed every check of round 1 teaches it; one that
    fails them (sizes that disagree, an all_gather's payload past a receiver's ``max_bytes``, a broadcast's refused in
    the receivers' vote) fails on every rank alike, and every rank's memory forgets the wider slot (:meth:`forget`).

    >>> memory = SlotMemory(4096)
    >>> memory.slot
    4096
    """

    __slots__ = ("base", "most", "narrow", "last")

    def __init__(self, base: int, most: int = routes.LEARNED_TABLE_MOST, narrow: int = 0) -> None:
        self.base, self.most, self.narrow, self.last = base, most, narrow, (base, base)

    @property
    def slot(self) -> int:
        low, high = min(self.last), max(self.last)
        return low if low >= self.base else high if high < self.base else self.base

    def applied(self, wire: Wire, wider: bool = True) -> Tuple[Wire, Optional[SlotMemory]]:
        """``wire`` with the slot this memory says (not wider than the settings' unless ``wider``), and the memory its
        call teaches (None: a memory of another slot setting, which ``wire``'s call neither takes nor teaches)."""
        if self.base != wire.slot:
            return wire, None
        slot = self.slot
        slot = slot if wider or slot < self.base else self.base
        return (wire if slot == wire.slot else wire._replace(slot=slot)), self

    def learn(self, infos: Sequence[SlotInfo], slot: int, ended: bool = False) -> None:
        """Remember what a call's slots (``infos``, every rank's, each ``slot`` bytes) suggest: the settings' slot
        where a frame overflowed a wider one (objects that grow past it would otherwise move an empty table a call).
        O(W); nothing to read where round 1 ``ended`` the call in the settings' slot (every message fit it, or an
        error report came: the common small call), nor where no wider slot's table fits ``most`` and no narrower slot
        pays (:func:`routes.narrow_pays`; a broadcast's memory has none)."""
        world = len(infos)
        if world * (self.base + 1) > self.most and not routes.narrow_pays(
            world=world, base=self.base, narrow=self.narrow
        ):
            self.last = (self.base, self.base)
            return
        if ended and slot == self.base:  # (what slot_after would say, read from every slot)
            self.last = (self.last[1], self.base)
            return
        tensors, piece, inline, frames = False, 1 << 62, True, []
        # one loop over SlotInfo's fields unpacked (length, error, round2, limit, total, inline, sizes, piece): 8192
        # slots in ~2 ms; an error report or tensors settle it (the settings' slot)
        for length, error, _, _, total, its_inline, _, its_piece in infos:
            if error or total != length:
                tensors = True  # (an error report: the call failed; keep the settings' slot)
                break
            piece = min(piece, its_piece)
            inline = inline and its_inline is not None
            frames.append(length)
        if tensors or slot > self.base and not inline:
            suggested = self.base
        else:
            suggested = routes.slot_after(
                frames, tensors=tensors, base=self.base, piece=piece, most=self.most, narrow=self.narrow
            )
        self.last = (self.last[1], suggested)

    def forget(self) -> None:
        """After a call every rank refused: the settings' slot, until two calls alike teach a wider one again."""
        self.last = (self.base, self.base)


def all_gather(
    wire: Wire,
    out: Outgoing,
    sizes_of: SizesOf,
    op: str = "all_gather",
    route: Optional[routes.CallRoute] = None,
    memory: Optional[SlotMemory] = None,
) -> Sequence[Optional[Incoming]]:
    """Every rank's frame and tensors, on every rank. ``None`` marks frames not moved after an error. ``route``: the
    group's calls' route (None: :func:`route_of` the wire), which says whether the slots through the
    backend go in one all_reduce of the table (:attr:`routes.CallRoute.summed`). ``memory``: the group's
    :class:`SlotMemory` for its all_gathers, where their slots go through the backend (then the slot it says, never
    wider where summed, and this call's slots remembered)."""
    wire, infos, memory = _exchange_slots(wire, out, op, (route or route_of(wire)).summed, memory)
    return all_gather_rest(wire, out, infos, sizes_of, op, memory)


def agree_on_round_one(wire: Wire, op: str, check_calls: bool = False, fingerprint: int = 0) -> bool:
    """Raise :class:`~objcomm.CommunicationError` on every rank where the group's ranks differ in what shapes round 1:
    their slot size (``slot_bytes``: round 1 moves one slot from each rank, and gloo aborts a process that receives
    another size, ``terminate called ... EnforceNotMet``, as a rank with another ``slot_bytes`` did at the group's
    first all_gather through the backend before 2026-12-07) or whether the same-host channel may take it (``local``:
    a rank with it tried to open the channel while one without it moved the slots through the group, and both raised
    at the group's timeout, saying nothing of why). One vote of eight words through the group's backend (a doubling
    on gloo, an all_reduce on NCCL), at a group's first collective and where it first takes this slot through the
    backend (``Operations._route``: once per group, slot, device and ``local``). The vote also carries
    whether this rank has ``check_calls`` and, where it does, its call's ``fingerprint``
    (:mod:`objcomm._api.call_checks` votes so every call): ranks whose ``check_calls`` differ meet in votes of one
    shape and all raise, where gloo aborted a process that took the other's words. True where every rank has
    ``check_calls`` and their fingerprints differ (the same on every rank)."""
    if wire.size == 1:
        return False
    slot, local, check = wire.slot, int(wire.slot_medium is not BACKEND), int(check_calls)
    words = [slot, -slot, local, -local, check, -check, fingerprint, -fingerprint]
    most, least, on, off, checking, not_checking, largest, smallest = largest_of(
        wire._replace(slot_medium=BACKEND), words, op
    )
    if checking != -not_checking:
        raise CommunicationError(
            f"{op}: check_calls (OBJCOMM_CHECK_CALLS) is {'on' if check else 'off'} on this rank and "
            f"{'off' if check else 'on'} on another: turn it on on every rank alike (the variable in every rank's "
            "environment, or objcomm.configure(check_calls=True) on every rank before the group's first call); "
            "nothing was moved"
        )
    if check and largest != -smallest:
        return True  # (what differs, slot_bytes and local among it, the caller gathers and says)
    if most != -least:
        raise CommunicationError(
            f"{op}: the ranks of this group use different slot sizes: slot_bytes={slot:,} on this rank, "
            f"from {-least:,} to {most:,} among them. Give every rank the same slot_bytes (objcomm.configure("
            "slot_bytes=...) or Communicator(slot_bytes=...) on every rank); nothing was moved"
        )
    if on != -off:
        raise CommunicationError(
            f"{op}: the ranks of this group do not agree on the same-host channel: local={bool(local)} on this rank, "
            f"local={not local} on another. Give every rank the same local= (objcomm.configure(local=...), "
            "Communicator(local=...) or OBJCOMM_LOCAL on every rank); nothing was moved"
        )
    return False


def route_of(wire: Wire) -> routes.CallRoute:
    """The route a group's calls take by its size, device and slot, none forced (:func:`routes.call_route`): where
    a caller gives none."""
    return routes.call_route(world=wire.size, cpu=is_cpu(wire.device), slot=wire.slot)


@one_call  # (the express path calls it too, after its own round 1)
def all_gather_rest(
    wire: Wire,
    out: Outgoing,
    infos: List[SlotInfo],
    sizes_of: SizesOf,
    op: str = "all_gather",
    memory: Optional[SlotMemory] = None,
) -> Sequence[Optional[Incoming]]:
    """:func:`all_gather` once round 1 has delivered every rank's slot (``infos``), by either route (``memory``:
    where round 1 went through the backend, :func:`all_gather`'s, which this call's slots teach)."""
    round_one_done()  # every rank is here: the steps after share one timeout (call_clock)
    ends = _limits.round_one_ends(infos)
    if not ends:  # a second round or a refusal follows: only on slots every rank read alike
        wire.slot_medium.agree(wire, infos, op)
    settings_slot = memory.base if memory is not None else wire.slot
    capacity, wider = settings_slot - SLOT_PREFIX_BYTES, wire.slot > settings_slot
    try:
        plans = _limits.plans(infos, sizes_of, op)
        failed = wider and _long_reports(infos, capacity, op)
        # every payload against every receiver's max_bytes (a frame alone within the settings' slot is taken whatever
        # the limit, limits.accepted), unless round 1 ended the call: an error report ends it first, and in the
        # settings' slot or a narrower one every payload came whole
        if not ends or (wider and not failed):
            _limits.check_limits(infos, range(wire.size), op, capacity)
    except ObjcommError:  # (every rank raises here alike: the group's next all_gather takes the settings' slot)
        if memory is not None:
            memory.forget()
        raise
    if memory is not None:  # (only a call that passed every check teaches the memory)
        memory.learn(infos, wire.slot, ends)
    if ends:  # after an error, or in the common small case: one collective, done
        return _round_one(infos)
    wire = at_pieces(wire, _limits.common_piece(infos, op))  # every rank read every slot: the same on all
    taken = wire.rest_media.all_gather(wire, out, infos, _limits.checked_sizes(sizes_of, infos), op)
    if taken is not NOT_USED:
        return taken
    # every rank's rest (its frame past the slot, then its tensors) in one exchange, whatever the spread
    rests = all_gather_rests(wire, _rest(wire, out), [info.second_round_bytes for info in infos], op)
    laid = rests if isinstance(rests, LaidRests) else None  # (its frames from one view of the buffer)
    incoming: List[Optional[Incoming]] = []
    for r, info in enumerate(infos):
        if r == wire.rank:  # its own, as copies: a result never aliases the input
            own = out.frame if info.inline is None else info.inline
            incoming.append(Incoming(own, [t.to(wire.device, copy=True) for t in out.tensors]))
            continue
        host = laid.host(r) if laid is not None and info.inline is None else None
        # the rest as a tensor only where its tensors lie in it, or it is not in host memory
        rest = rests[r] if host is None or plans[r] != [] else None
        incoming.append(_split_rest(sizes_of, info, plans[r], rest, r, op, host))
    return incoming


def _split_rest(
    sizes_of: SizesOf,
    info: SlotInfo,
    sizes: Optional[List[int]],
    rest: Optional[torch.Tensor],
    sender: int,
    op: str,
    host: Optional[memoryview] = None,
) -> Incoming:
    """What ``sender`` sent, from its slot (``info``) and its rest (its frame past the slot, then its tensors, back
    to back; ``sizes``: the tensor sizes its slot listed, None: its frame lists them, checked here). ``host``: the
    rest's bytes as a memoryview, where the caller has one (a CPU rest; ``rest`` is then needed only where it carries
    tensors)."""
    frame, at = info.inline, 0
    if frame is None:
        if host is None:
            assert rest is not None
            # on the CPU a view of the whole rest, then a slice (cheaper than a tensor's slice first); else the frame
            host = host_view(rest) if rest.is_cpu else host_view(rest[: info.length])
        frame, at = host[: info.length], info.length
    if sizes is None:
        sizes = _limits.frame_sizes(sizes_of, frame, info, sender, op)
    return Incoming(frame, list(rest[at:].split(sizes)) if sizes and rest is not None else [])


def long_report(info: SlotInfo, capacity: int) -> Optional[str]:
    """What is wrong with an error report in a slot wider than the settings' (:class:`SlotMemory`), whose slots carry
    ``capacity`` bytes after the prefix: one longer than that is a liar's (an honest one fits the settings' slot)."""
    if info.error and info.length > capacity:
        return f"an error report of {info.length:,} bytes, past its slot_bytes' {capacity:,}"
    return None


def _long_reports(infos: Sequence[SlotInfo], capacity: int, op: str) -> bool:
    """Round 1 of an all_gather in a slot wider than the settings' (``capacity`` bytes after the prefix in theirs):
    no error report past it (:func:`long_report`; the same on every rank), and whether any came. A frame past
    ``capacity`` then meets every receiver's ``max_bytes`` as a second round's does (:func:`all_gather_rest`)."""
    failed = False
    for sender, info in enumerate(infos):
        problem = long_report(info, capacity)
        if problem:
            raise _limits.inconsistent(op, sender, problem)
        failed = failed or info.error
    return failed


def _round_one(infos: List[SlotInfo]) -> Sequence[Optional[Incoming]]:
    """What round 1 delivered: the frames that fit (error reports always do)."""
    return [Incoming(i.inline, error=i.error) if i.inline is not None else None for i in infos]


def slots_through_medium(
    wire: Wire, kind: str, mine: Mine, op: str, root: Optional[int] = None
) -> Union[Dict[int, Slot], NotUsed]:
    """Round 1 of ``op`` through the wire's slot medium: :meth:`~objcomm._transport.base.SlotMedium.exchange` over the
    pattern of ``kind`` (a gather's on one host: an all_gather's; each kept once made), or :data:`NOT_USED`."""
    return wire.slot_medium.exchange(wire, pattern(kind, me=wire.rank, world=wire.size, root=root), mine, op)


def _exchange_slots(
    wire: Wire, out: Outgoing, op: str, summed: bool = False, memory: Optional[SlotMemory] = None
) -> Tuple[Wire, List[SlotInfo], Optional[SlotMemory]]:
    """Round 1 of an all_gather: the wire the call goes on with (its slot ``memory``'s, where that applies), every
    rank's slot, and the memory this call teaches (None where its slots did not go through the backend)."""
    raw = _slot(wire, out)
    got = slots_through_medium(wire, "all_gather", raw, op)
    if got is not NOT_USED:
        return wire, [read_slot(memoryview(s)) for s in in_rank_order(got, raw, wire.rank, wire.size)], None
    if memory is not None:  # the slot the last two all_gathers suggested (a summed table's: never wider)
        wire, memory = memory.applied(wire, wider=not summed)
        if len(raw) != wire.slot:
            raw = _slot(wire, _fitted(out, wire))
    if summed:  # the table, zeros but this rank's slot, summed: every slot in its place (a tree on NCCL, not a ring)
        recv = zeroed(wire.slot * wire.size, wire)
        recv[wire.rank * wire.slot : (wire.rank + 1) * wire.slot] = _on_device(wire, raw)
        guarded(op, wire, dist.all_reduce, recv, op=dist.ReduceOp.SUM, group=wire.group)
        return wire, read_slots(host_view(recv), wire.size, wire.slot), memory
    recv, host = receive_buffer(wire.slot * wire.size, wire)
    guarded(op, wire, all_gather_single, recv, _on_device(wire, raw), group=wire.group)
    return wire, read_slots(host if host is not None else host_view(recv), wire.size, wire.slot), memory


def _fitted(out: Outgoing, wire: Wire) -> Outgoing:
    """``out``, or where it is this rank's error report, cut for the settings' slot, past a narrower one
    (:class:`SlotMemory`'s), the same report cut to fit it: an honest report always fits its slot."""
    if not out.error or out.frame_nbytes <= wire.inline_capacity:
        return out
    view = memoryview(out.frame)
    return error_frame(read_error(view, parse_header(view)), wire.inline_capacity)


def _rest(wire: Wire, out: Outgoing) -> List[torch.Tensor]:
    """What a sender moves after round 1, as the parts of one stream: an overflowing frame, then its tensors."""
    frame = [out.frame_tensor()] if out.frame_nbytes > wire.inline_capacity else []
    return frame + list(out.tensors)
