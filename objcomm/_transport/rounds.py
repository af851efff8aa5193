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

The steps every operation shares, all_gather, send/recv; gather: :mod:`.gather`, broadcast: :mod:`.broadcast`.
"""

from __future__ import annotations

import struct
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from objcomm._errors import CommunicationError, FrameError
from objcomm._format import limits as _limits
from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._format.rest import incoming, pieces
from objcomm._format.slot import SlotInfo, fill_slot, read_slot, read_slots
from objcomm._transport import pair_locks, routes
from objcomm._transport import pending as _pending
from objcomm._transport.base import NOT_USED, WHOLE, Lease, Route, Wire, all_gather_single, guarded, largest_of
from objcomm._transport.bytes import Batch, Deadline, at_pieces, host_view, receive_buffer, recv_bytes, zeroed
from objcomm._transport.call_clock import one_call, round_one_done
from objcomm._transport.exchange import all_gather_rests

SCRATCH = _limits.SCRATCH_BYTES
REFUSE_LIMIT, REFUSE_MALFORMED = 1, 2  # a receiver's answer (0: go ahead)
TAKES = 0x10  # bit of a go-ahead answer: the receiver's shared memory takes the rest (by its settings)
ENVELOPE = struct.Struct("<ii")  # before a send's slot through a CPU backend: its slot_bytes, the rest's bytes after it

Received = Tuple[int, Incoming, bool]  # (sender, what it sent, whether that is its error report)


def _slot(wire: Wire, out: Outgoing) -> bytearray:
    slot = bytearray(wire.slot)
    fill_slot(memoryview(slot), out, wire.max_bytes, piece=wire.chunk)
    return slot


def _on_device(wire: Wire, raw: bytearray) -> torch.Tensor:
    tensor = torch.frombuffer(raw, dtype=torch.uint8)  # on the CPU
    return tensor if wire.device.type == "cpu" else tensor.to(wire.device)


def _agreement_needed(wire: Wire, info: SlotInfo, op: str) -> bool:
    """Whether receivers must answer the sender before round 2 (a vote, or an acknowledgement).

    Not when round 1 listed every transfer that follows and none exceeds the scratch size: a
    receiver over its limit then drains them through one small buffer and raises alone. Yes when
    the sizes are unknown, a transfer is larger, or the rest media may take the bytes.
    Decided from the slot alone, so sender and receivers agree.
    """
    if info.sizes is None:
        return True
    largest = _limits.largest_piece(0 if info.inline is not None else info.length, info.sizes, info.piece)
    return routes.agreement_needed(
        sizes_listed=True,
        largest_piece=largest,
        medium_may_take=wire.rest_media.worth(wire, info.second_round_bytes, op),
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
    every rank (its receivers know only their own), with the largest part a receiver refused (each has its own);
    returned (0 without it)."""
    refused = info.total
    if longest is None:
        (code,), longest = largest_of(wire, [refuse], op, torch.int32), 0
    else:  # int64: a second round may pass 2 GiB
        code, longest, refused = largest_of(wire, [refuse, longest, info.total if refuse else 0], op, moved_at=1)
    if code == REFUSE_MALFORMED:
        raise _limits.inconsistent(op, src, problem or "a receiving rank found the sizes in its slot inconsistent")
    if code:
        raise _limits.too_large(
            f"{op}: rank {src} sends {refused:,} bytes to a rank whose max_bytes it exceeds "
            f"(this rank's max_bytes: {wire.max_bytes:,})",
            where="there",
        )
    round_one_done()  # every rank voted, so every rank is here: the steps after share one timeout (call_clock)
    return longest


# -- all_gather ------------------------------------------------------------------------------
def all_gather(
    wire: Wire, out: Outgoing, sizes_of: SizesOf, op: str = "all_gather", summed: bool = False
) -> Sequence[Optional[Incoming]]:
    """Every rank's frame and tensors, on every rank. ``None`` marks frames not moved after an error. ``summed``:
    the slots through the backend in one all_reduce of the table (:func:`routes.slots_summed`)."""
    return all_gather_rest(wire, out, _exchange_slots(wire, out, op, summed), sizes_of, op)


@one_call  # (the express path calls it too, after its own round 1)
def all_gather_rest(
    wire: Wire, out: Outgoing, infos: List[SlotInfo], sizes_of: SizesOf, op: str = "all_gather"
) -> Sequence[Optional[Incoming]]:
    """:func:`all_gather` once round 1 has delivered every rank's slot (``infos``), by either route."""
    round_one_done()  # every rank is here: the steps after share one timeout (call_clock)
    ends = _limits.round_one_ends(infos)
    if not ends:  # a second round or a refusal follows: only on slots every rank read alike
        wire.slot_medium.agree(wire, infos, op)
    plans = _limits.plans(infos, sizes_of, op)
    if ends:  # after an error, or in the common small case: one collective, done
        return _round_one(infos)
    _limits.check_limits(infos, range(wire.size), op)
    wire = at_pieces(wire, _limits.common_piece(infos, op))  # every rank read every slot: the same on all
    taken = wire.rest_media.all_gather(wire, out, infos, _limits.checked_sizes(sizes_of, infos), op)
    if taken is not NOT_USED:
        return taken
    # every rank's rest (its frame past the slot, then its tensors) in one exchange, whatever the spread
    rests = all_gather_rests(wire, _rest(wire, out), [info.second_round_bytes for info in infos], op)
    incoming: List[Optional[Incoming]] = []
    for r, info in enumerate(infos):
        if r == wire.rank:  # its own, as copies: a result never aliases the input
            own = out.frame if info.inline is None else info.inline
            incoming.append(Incoming(own, [t.to(wire.device, copy=True) for t in out.tensors]))
            continue
        incoming.append(_split_rest(sizes_of, info, plans[r], rests[r], r, op))
    return incoming


def _split_rest(
    sizes_of: SizesOf, info: SlotInfo, sizes: Optional[List[int]], rest: Optional[torch.Tensor], sender: int, op: str
) -> Incoming:
    """What ``sender`` sent, from its slot (``info``) and its rest (its frame past the slot, then its tensors, back
    to back; ``sizes``: the tensor sizes its slot listed, None: its frame lists them, checked here)."""
    frame, at = info.inline, 0
    if frame is None:
        assert rest is not None
        frame, at = host_view(rest[: info.length]), info.length
    if sizes is None:
        sizes = _limits.frame_sizes(sizes_of, frame, info, sender, op)
    return Incoming(frame, list(rest[at:].split(sizes)) if sizes and rest is not None else [])


def _round_one(infos: List[SlotInfo]) -> Sequence[Optional[Incoming]]:
    """What round 1 delivered: the frames that fit (error reports always do)."""
    return [Incoming(i.inline, error=i.error) if i.inline is not None else None for i in infos]


def _exchange_slots(wire: Wire, out: Outgoing, op: str, summed: bool = False) -> List[SlotInfo]:
    raw = _slot(wire, out)
    slots = wire.slot_medium.all_gather(wire, raw, op)
    if slots is not NOT_USED:
        return [read_slot(memoryview(s)) for s in slots]
    if summed:  # the table, zeros but this rank's slot, summed: every slot in its place (a tree on NCCL, not a ring)
        recv = zeroed(wire.slot * wire.size, wire)
        recv[wire.rank * wire.slot : (wire.rank + 1) * wire.slot] = _on_device(wire, raw)
        guarded(op, wire, dist.all_reduce, recv, op=dist.ReduceOp.SUM, group=wire.group)
        return read_slots(host_view(recv), wire.size, wire.slot)
    recv, host = receive_buffer(wire.slot * wire.size, wire)
    guarded(op, wire, all_gather_single, recv, _on_device(wire, raw), group=wire.group)
    return read_slots(host if host is not None else host_view(recv), wire.size, wire.slot)


# -- point to point --------------------------------------------------------------------------
@one_call
def send(wire: Wire, out: Outgoing, dst: int, eager: bool = True) -> None:
    """Send to group rank ``dst``: a slot, then the rest (after ``dst`` agreed, where it must). ``eager``: a
    message that nothing follows may return before its receiver takes it (see :func:`_post`)."""
    lease = wire.slot_medium.p2p(wire, "send", dst)
    with lease as route:
        if route is not None:
            return _send(wire, out, dst, route, eager, lease)
        with pair_locks.sending(wire.group, dst, wire.tag):  # its parts together, whatever other threads send
            _send(wire, out, dst, None, eager, lease)


def _send(wire: Wire, out: Outgoing, dst: int, route: Optional[Route], eager: bool, lease: Lease) -> None:
    op = "send"
    raw = _slot(wire, out)
    info = read_slot(memoryview(raw))  # decide from the slot, as the receiver does (no device round trip)
    problem = _limits.slot_problem_of(info)
    ends = bool(info.error) or _limits.complete(info)
    agreed = not ends and not problem and _agreement_needed(wire, info, op)
    cpu = wire.device.type == "cpu"
    at_once = route is not None and not ends and not problem and not agreed and cpu
    if at_once and route is not None and route.send_whole(wire, raw, out, info, dst):
        return  # the slot and the rest that follows it at once, in one message of the route
    if (
        route is None
        and not ends
        and not problem
        and routes.backend_whole(info.second_round_bytes, cpu=cpu, agreed=agreed)
    ):
        _post(wire, _enveloped(raw, pieces(out, info.inline is not None)), dst, op, eager, lease)
        return
    message = 0
    if route is not None:
        message = route.send(wire, raw, dst)
    else:
        _post(wire, _enveloped(raw, []) if cpu else raw, dst, op, eager and ends, lease)
    if problem:  # the receiver finds the same and raises too
        raise _limits.inconsistent(op, wire.rank, problem)
    if ends:
        return
    answer: Optional[int] = None
    if at_once and route is not None:  # eager: the rest follows at once, paced by the channel's credit; a refusing
        route.send_rest(wire, out, info, dst, message)  # receiver drains it alone
        return
    if route is not None:  # the receiver answers on the route (a few µs) where it must agree first
        answer = route.answer_of(wire, dst, message, op)
    elif agreed:
        reply = zeroed(1, wire)
        guarded(op, wire, dist.recv, reply, src=wire.ranks[dst], group=wire.group, tag=wire.answer_tag)
        answer = int(reply.item())
    round_one_done()  # the receiver is here (it answered): the rest shares one timeout (call_clock)
    medium = False  # whether the receiver's shared memory takes the rest, by its settings (TAKES)
    if answer is not None:
        medium, answer = bool(answer & TAKES), answer & ~TAKES
        if answer and not agreed:
            return  # refused where the group's path sends without asking: there the receiver drains and raises alone
    if answer == REFUSE_MALFORMED:
        raise FrameError(
            f"send: rank {dst} refused this frame: its tensor table disagrees with the sizes in its slot; "
            "nothing more was sent"
        )
    if answer:
        raise _limits.too_large(
            f"send: rank {dst} refused {out.total:,} bytes as above its max_bytes",
            outcome="nothing more was sent",
            where="on the receiver",
        )
    if answer is not None and medium != wire.rest_media.worth(wire, info.second_round_bytes, op):
        raise CommunicationError(
            f"send: rank {dst} {'reads' if medium else 'does not read'} this message's "
            f"{info.second_round_bytes:,}-byte rest through shared memory, where this rank's settings say it "
            f"{'does not' if medium else 'does'}: the "
            "two ranks' shm or shm_threshold differ; every rank of a group must use the same. Nothing more was sent "
            f"(rank {dst} raises at its timeout)"
        )
    if answer is not None and wire.rest_media.send(wire, out, dst, op, route, message):
        return
    if route is not None and wire.device.type == "cpu":  # shared memory did not take it (below its threshold: never):
        route.send_rest(wire, out, info, dst, message)  # the route, not the group, whose transfers concurrent sends
        return  # under one tag would mix
    batch = Batch(wire, op)
    batch.send_rest(out, dst)
    batch.wait()


def _enveloped(slot: bytearray, rest: Sequence[memoryview]) -> bytearray:
    """A send's message through a CPU group's backend, owned (it may be posted eagerly): :data:`ENVELOPE` (the
    sender's ``slot_bytes``, the bytes of the rest that follow its slot here), the slot, then that rest."""
    return bytearray().join([ENVELOPE.pack(len(slot), sum(piece.nbytes for piece in rest)), slot, *rest])


def _post(wire: Wire, message: bytearray, dst: int, op: str, eager: bool, lease: Lease) -> None:
    """Send a slot (with its rest, where :func:`objcomm._transport.routes.backend_whole` says so) through the group.
    gloo's send waits until its receiver posts the receive, where the channel's returns once the kernel holds the
    bytes: so that small sends return at once on every path, a message that nothing follows (its slot carries the
    whole message or an error report, or its rest came with it) is posted and left to
    :mod:`objcomm._transport.pending` (``eager``, on CPU groups; bounded per group). A slot that a second round follows,
    and every slot on NCCL, wait for the receiver as before."""
    data = _on_device(wire, message)
    if eager and wire.device.type == "cpu":
        _pending.post(wire, data, dst, op)
    else:
        guarded(op, wire, dist.send, data, dst=wire.ranks[dst], group=wire.group, tag=wire.data_tag)
    lease.posted()  # the route counts the slots posted through the group (SlotMedium.p2p)


def recv(wire: Wire, src: Optional[int], sizes_of: SizesOf) -> Received:
    """Receive from group rank ``src`` (``None``: any); return ``(sender, incoming, is_error)``."""
    lease = wire.slot_medium.p2p(wire, "recv", src)
    with lease as route:
        if route is not None:
            return _recv(wire, src, sizes_of, route, lease)
        with pair_locks.receiving(wire.group, src, wire.tag):  # its parts together, whatever other threads receive
            return _recv(wire, src, sizes_of, None, lease)


def _recv(wire: Wire, src: Optional[int], sizes_of: SizesOf, route: Optional[Route], lease: Lease) -> Received:
    op = "recv"
    if route is not None:
        sender, got, message = route.recv(wire, src, op)
        return received(wire, sender, read_slot(memoryview(got)), sizes_of, route, message)
    cpu = wire.device.type == "cpu"  # an envelope, and room for a rest that comes with its slot (routes.backend_whole)
    head = ENVELOPE.size if cpu else 0
    buffer = zeroed(head + wire.slot + (routes.BACKEND_WHOLE_BYTES if cpu else 0), wire)
    peer = None if src is None else wire.ranks[src]
    sender_global = guarded(op, wire, dist.recv, buffer, src=peer, group=wire.group, tag=wire.data_tag)
    sender = wire.ranks.index(sender_global) if src is None else src  # (GroupRanks: one lookup)
    lease.took(sender)  # the route counts the slots taken, by sender (SlotMedium.p2p)
    view = host_view(buffer)
    after = _opened(wire, view, sender, op) if cpu else None
    return received(wire, sender, read_slot(view[head : head + wire.slot]), sizes_of, after=after)


def _opened(wire: Wire, view: memoryview, sender: int, op: str) -> memoryview:
    """The rest that came with a slot in its message of a CPU group's backend (empty for none), once its envelope
    (:func:`_enveloped`) says the sender's slot is this rank's size and the rest fits the message."""
    theirs, following = ENVELOPE.unpack_from(view)
    if theirs != wire.slot:
        raise CommunicationError(
            f"{op}: rank {sender} sent a slot of {theirs:,} bytes where this rank uses slot_bytes={wire.slot:,}: "
            "every rank of a group must use the same slot_bytes (objcomm.configure, the Communicator or the call)"
        )
    if not 0 <= following <= routes.BACKEND_WHOLE_BYTES:
        raise FrameError(
            f"{op}: rank {sender}'s message announces {following:,} bytes after its slot, where at most "
            f"{routes.BACKEND_WHOLE_BYTES:,} may follow it; refused"
        )
    start = ENVELOPE.size + wire.slot
    return view[start : start + following]


@one_call  # (the express path calls it too, after its own round 1)
def received(
    wire: Wire,
    sender: int,
    info: SlotInfo,
    sizes_of: SizesOf,
    route: Optional[Route] = None,
    message: int = 0,
    after: Optional[memoryview] = None,
) -> Received:
    """The rest of a receive from group rank ``sender`` once its slot (``info``) arrived, through the group or
    ``route`` (which carried the slot of message ``message``); the incoming keeps the limit the slot announced.
    ``after``: what followed the slot in its message of a CPU group (:func:`_enveloped`; empty: nothing)."""
    round_one_done()  # the sender is here (its slot came): the rest shares one timeout (call_clock)
    got = _received(wire, sender, info, sizes_of, route, message, after)
    got[1].sender_limit = info.limit
    return got


def _received(
    wire: Wire,
    sender: int,
    info: SlotInfo,
    sizes_of: SizesOf,
    route: Optional[Route],
    message: int,
    after: Optional[memoryview],
) -> Received:
    op, wire = "recv", at_pieces(wire, info.piece)  # (its slot says in what pieces the sender sends its rest)
    problem = _limits.slot_problem_of(info)
    if problem:  # the sender finds the same in its slot and raises too
        raise _limits.inconsistent(op, sender, problem)
    if info.error or _limits.complete(info):
        assert info.inline is not None
        if after:
            raise FrameError(
                f"{op}: rank {sender} sent {len(after):,} bytes after a slot that nothing follows; refused"
            )
        if route is not None and message & WHOLE:  # nothing may follow such a slot: the route fails on what did
            route.recv_rest(wire, info, sizes_of, sender, message, op, drain=True)
        return sender, Incoming(info.inline, error=info.error), info.error
    sizes, problem = _limits.plan(info, sizes_of)
    refuse = REFUSE_MALFORMED if problem else REFUSE_LIMIT if info.total > wire.max_bytes else 0
    agreed = _agreement_needed(wire, info, op)
    moved = info.second_round_bytes
    if after:  # the sender sent its rest with its slot (routes.backend_whole, by its settings): no answer waits
        if len(after) != moved:
            raise FrameError(
                f"{op}: rank {sender} sent {len(after):,} bytes with its slot where the slot announces a rest of "
                f"{moved:,}; refused"
            )
        if refuse:
            raise _limits.refused(op, sender, wire, info.total, problem, drained=True, into="its message")
        return sender, incoming(bytearray(after), info, sizes_of, sender, op), False
    if after is not None and routes.backend_whole(moved, cpu=True, agreed=agreed):
        raise CommunicationError(
            f"{op}: rank {sender} sent the slot of a {moved:,}-byte rest without it, so it waits for this rank's "
            "answer, which this rank's settings say it need not give: the two ranks' settings differ (shm, "
            "shm_threshold, local); every rank of a group must use the same. The sender fails at its timeout"
        )
    at_once = not agreed or message & WHOLE  # WHOLE: the sender did not ask (the rest came with its slot)
    if route is not None and at_once and wire.device.type == "cpu":  # the rest came right after the slot
        got = route.recv_rest(wire, info, sizes_of, sender, message, op, drain=bool(refuse))
        if refuse:
            raise _limits.refused(op, sender, wire, info.total, problem, drained=True)
        return sender, got, False
    if route is not None or agreed:  # a route answers: a few µs there
        takes = not refuse and wire.rest_media.worth(wire, info.second_round_bytes, op)
        code = refuse | (TAKES if takes else 0)  # the sender checks the medium against its own settings
        if route is not None:
            route.answer(wire, sender, message, code)
        else:
            answer = torch.tensor([code], dtype=torch.uint8, device=wire.device)
            guarded(op, wire, dist.send, answer, dst=wire.ranks[sender], group=wire.group, tag=wire.answer_tag)
        if refuse:
            raise _limits.refused(op, sender, wire, info.total, problem)
        taken = wire.rest_media.recv(wire, info, _limits.checked_sizes(sizes_of, [info]), sender, op, route, message)
        if taken is not NOT_USED:
            return sender, taken, False
        if route is not None and wire.device.type == "cpu":  # as the sender does
            return sender, route.recv_rest(wire, info, sizes_of, sender, message, op), False
    if sizes is not None and not refuse:  # every size known: post all receives at once
        batch = Batch(wire, op)
        data = batch.recv(info.length, sender) if info.inline is None else None
        tensors = [batch.recv(n, sender) for n in sizes]
        batch.wait()
        frame = info.inline if data is None else host_view(data)
        assert frame is not None
        return sender, Incoming(frame, tensors), False
    frame, deadline = info.inline, Deadline.of_rest(wire, op, sender, moved)  # one for the frame and every tensor
    if frame is None:
        drained = recv_bytes(wire, info.length, sender, op, bool(refuse), deadline)
        frame = None if refuse else host_view(drained)
    if sizes is None:  # only the frame lists them (and this rank agreed: it did not refuse)
        assert frame is not None
        sizes = _limits.frame_sizes(sizes_of, frame, info, sender, op)
    tensors = [recv_bytes(wire, n, sender, op, bool(refuse), deadline) for n in sizes]
    if refuse:
        raise _limits.refused(op, sender, wire, info.total, problem, drained=True)
    assert frame is not None
    return sender, Incoming(frame, tensors), False


def _rest(wire: Wire, out: Outgoing) -> List[torch.Tensor]:
    """What a sender moves after round 1, as the parts of one stream: an overflowing frame, then its tensors."""
    frame = [out.frame_tensor()] if out.frame_nbytes > wire.inline_capacity else []
    return frame + list(out.tensors)
