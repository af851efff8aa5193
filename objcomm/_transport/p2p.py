"""send/recv: a slot, then, where the sender asks, the receiver's answer, then the rest.

The sender decides from its slot and its own settings whether it waits for an answer before the rest (its sizes not
listed, a piece past the scratch size, or its shared memory may take the rest: :func:`_agreement_needed`) and says
so in its message: a route's message id carries :data:`~objcomm._transport.base.ASKS`, a CPU backend's
:data:`ENVELOPE` announces :data:`ASKED` in place of a rest. The receiver answers exactly when asked (on a GPU
wire's route: always, as its sender always waits there), so ranks whose settings differ never wait for each other
(a review's find: a ``shm_threshold`` between 60 KiB and 1 MiB on one rank left both waiting for the timeout, or
failed the channel), and refuses a slot that needs an answer but did not ask for one. Its answer says whether its
shared memory takes the rest (:data:`TAKES`); the rest goes there only when the sender's settings say so too, else
a sender declines in shared memory's own words (:func:`decline_shared`) and both move it the normal way.

The slot goes through the wire's route (:meth:`~objcomm._transport.base.SlotMedium.p2p`: the same-host channel)
where there is one, else through the group; the rest through shared memory, the route (CPU) or the group.
"""

from __future__ import annotations

import struct
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from objcomm._device import is_cpu
from objcomm._errors import CommunicationError, FrameError, ObjcommError
from objcomm._format import limits as _limits
from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._format.rest import incoming, pieces
from objcomm._format.slot import SlotInfo, outgoing_second_round_bytes, read_slot
from objcomm._transport import pair_locks, routes
from objcomm._transport import pending as _pending
from objcomm._transport.base import ASKS, NOT_USED, WHOLE, Lease, Route, Wire, guarded
from objcomm._transport.bytes import Batch, Deadline, at_pieces, host_view, recv_bytes, zeroed
from objcomm._transport.call_clock import one_call, round_one_done
from objcomm._transport.rounds import REFUSE_LIMIT, REFUSE_MALFORMED, _agreement_needed, _on_device, _slot

TAKES = 0x10  # bit of a go-ahead answer: the receiver's shared memory takes the rest (by its settings)
ENVELOPE = struct.Struct("<ii")  # before a send's slot through a CPU backend: its slot_bytes, the rest's bytes after it
ASKED = -1  # ENVELOPE's rest bytes where nothing follows the slot and the sender waits for the receiver's answer
# shared memory's words before a send's rest (objcomm._samehost.shm_p2p): its sequence number (-1: nothing written,
# the rest follows the normal way), pid, token, host key, pid namespace, where the segment is
SHARED_WORDS = 6
# tests: a CPU group's messages through the group take a GPU group's rules (:func:`_cpu_rules`), so that gloo runs
# what NCCL runs there
GPU_RULES_ON_CPU = False

Received = Tuple[int, Incoming, bool]  # (sender, what it sent, whether that is its error report)


def send_words(wire: Wire, words: Sequence[int], dst: int, op: str, route: Optional[Route], message: int) -> None:
    """Shared memory's int64 ``words`` about message ``message`` to group rank ``dst``: through ``route`` when the
    slot went there, else through the group."""
    if route is not None:
        route.send_words(wire, words, dst, message)
    else:
        status = torch.tensor(words, dtype=torch.int64)
        guarded(op, wire, dist.send, status, dst=wire.ranks[dst], group=wire.group, tag=wire.data_tag)


def decline_shared(wire: Wire, dst: int, op: str, route: Optional[Route], message: int) -> None:
    """Tell group rank ``dst``, whose answer said its shared memory takes the rest, that this rank's does not:
    shared memory's words with no segment; both then move the rest the normal way."""
    send_words(wire, [-1] + [0] * (SHARED_WORDS - 1), dst, op, route, message)


def _cpu_rules(wire: Wire) -> bool:
    """Whether a message through the group takes a CPU group's rules (gloo: an envelope, and a receive buffer with
    room for a rest that comes with its slot, :func:`objcomm._transport.routes.backend_whole`), else a GPU group's
    (NCCL moves exact sizes: a tree's message, :func:`tree_send`, is padded to its room, any other is the slot
    alone)."""
    return is_cpu(wire.device) and not GPU_RULES_ON_CPU


def _framing(wire: Wire, tree: bool) -> Tuple[bool, bool, int]:
    """How a message through the group is laid out, alike on its sender and its receiver: ``(rules, framed, room)``,
    whether a CPU group's rules apply (:func:`_cpu_rules`), whether an :data:`ENVELOPE` comes before the slot (a CPU
    group's messages, a GPU group's tree's), and the room after the slot
    (:func:`objcomm._transport.routes.backend_room`)."""
    rules = _cpu_rules(wire)
    return rules, rules or tree, routes.backend_room(cpu=rules, tree=tree)


def _comes_whole(info: SlotInfo, agreed: bool, rules: bool, tree: bool) -> bool:
    """Whether the rest comes in one message with its slot through the group
    (:func:`objcomm._transport.routes.backend_whole`), read from the slot alike by sender and receiver: whether
    tensors follow by the slot's total against its frame's length (a frame's table may list a tensor of 0 bytes,
    which moves nothing)."""
    moved, tensors = info.second_round_bytes, info.total != info.length
    return routes.backend_whole(moved, cpu=rules, agreed=agreed, tree=tree, tensors=tensors)


@one_call
def send(wire: Wire, out: Outgoing, dst: int, eager: bool = True, tree: bool = False) -> None:
    """Send to group rank ``dst``: a slot, then the rest (after ``dst`` agreed, where it must). ``eager``: a
    message that nothing follows may return before its receiver takes it (see :func:`_post`). ``tree``: a message of
    a reduction's tree or a scan, which its receiver receives with ``tree`` too (:func:`tree_send`)."""
    lease = wire.slot_medium.p2p(wire, "send", dst)
    with lease as route:
        if route is not None:
            return _send(wire, out, dst, route, eager, lease, tree)
        with pair_locks.sending(wire.group, dst, wire.tag):  # its parts together, whatever other threads send
            _send(wire, out, dst, None, eager, lease, tree)


def tree_send(wire: Wire, out: Outgoing, dst: int) -> Optional[ObjcommError]:
    """:func:`send` of a message of a reduction's tree or a scan: its rest in the pieces of
    :func:`objcomm._transport.routes.tree_piece`, which its slot announces to the receiver, and through a GPU
    group's backend a rest of its frame alone up to :data:`~objcomm._transport.routes.BACKEND_WHOLE_BYTES` with its
    slot (:func:`objcomm._transport.routes.backend_whole`): the receiver calls :func:`recv` with ``tree``. Returns
    the receiver's refusal (it raises, and its failure reaches every rank along the call's own way) rather than
    raising it; a :class:`CommunicationError` raises."""
    rest = outgoing_second_round_bytes(out, wire.inline_capacity)
    try:
        send(wire._replace(chunk=routes.tree_piece(wire.chunk, rest)), out, dst, tree=True)
    except CommunicationError:
        raise
    except ObjcommError as exc:
        return exc
    return None


def _send(
    wire: Wire, out: Outgoing, dst: int, route: Optional[Route], eager: bool, lease: Lease, tree: bool = False
) -> None:
    op = "send"
    raw = _slot(wire, out)
    info = read_slot(memoryview(raw))  # decide from the slot, as the receiver does (no device round trip)
    problem = _limits.slot_problem_of(info)
    ends = bool(info.error) or _limits.complete(info)
    agreed = not ends and not problem and _agreement_needed(wire, info, op, peer=dst)
    cpu = is_cpu(wire.device)
    at_once = route is not None and not ends and not problem and not agreed and cpu
    if at_once and route is not None and route.send_whole(wire, raw, out, info, dst):
        return  # the slot and the rest that follows it at once, in one message of the route
    rules, framed, room = _framing(wire, tree)  # through the group
    length = ENVELOPE.size + len(raw) + room if framed and not rules else None  # a GPU group's tree: all this long
    if route is None and not ends and not problem and _comes_whole(info, agreed, rules, tree):
        _post(wire, _enveloped(raw, pieces(out, info.inline is not None)), dst, op, eager, lease, length)
        return
    message = 0  # (the receiver answers exactly when asked: agreed says so in the message)
    if route is not None:
        message = route.send(wire, raw, dst, asks=agreed)
    else:
        _post(wire, _enveloped(raw, [], asks=agreed) if framed else raw, dst, op, eager and ends, lease, length)
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
            return  # refused unasked (a GPU wire's route always answers): the receiver raises alone
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
    if medium:  # the receiver waits for shared memory's words: a segment where this rank's settings take it too
        if not wire.rest_media.worth(wire, info.second_round_bytes, op, dst):
            decline_shared(wire, dst, op, route, message)  # (settings that differ: the rest goes the normal way)
        elif wire.rest_media.send(wire, out, dst, op, route, message):
            return
    if route is not None and is_cpu(wire.device):  # shared memory did not take it (below its threshold: never):
        route.send_rest(wire, out, info, dst, message)  # the route, not the group, whose transfers concurrent sends
        return  # under one tag would mix
    batch = Batch(wire, op)
    batch.send_rest(out, dst)
    batch.wait()


def _enveloped(slot: bytearray, rest: Sequence[memoryview], asks: bool = False) -> bytearray:
    """A send's message through a CPU group's backend (or a GPU group's tree), owned (it may be posted eagerly):
    :data:`ENVELOPE` (the sender's ``slot_bytes``, the bytes of the rest that follow its slot here, or :data:`ASKED`:
    the sender waits for the receiver's answer), the slot, then that rest."""
    following = ASKED if asks else sum(piece.nbytes for piece in rest)
    return bytearray().join([ENVELOPE.pack(len(slot), following), slot, *rest])


def _post(
    wire: Wire, message: bytearray, dst: int, op: str, eager: bool, lease: Lease, length: Optional[int] = None
) -> None:
    """Send a slot (with its rest, where :func:`objcomm._transport.routes.backend_whole` says so) through the group.
    gloo's send waits until its receiver posts the receive, where the channel's returns once the kernel holds the
    bytes: so that small sends return at once on every path, a message that nothing follows (its slot carries the
    whole message or an error report, or its rest came with it) is posted and left to
    :mod:`objcomm._transport.pending` (``eager``, on CPU groups; bounded per group). A slot that a second round follows,
    and every slot on NCCL, wait for the receiver as before. ``length``: the message's length on the wire, zeros after
    ``message`` (a GPU group's tree: NCCL receives exact sizes; only ``message`` is copied to the device)."""
    if length is None:
        data = _on_device(wire, message)
    else:
        data = zeroed(length, wire)
        data[: len(message)].copy_(torch.frombuffer(message, dtype=torch.uint8))
    if eager and is_cpu(wire.device):
        _pending.post(wire, data, dst, op)
    else:
        guarded(op, wire, dist.send, data, dst=wire.ranks[dst], group=wire.group, tag=wire.data_tag)
    lease.posted()  # the route counts the slots posted through the group (SlotMedium.p2p)


def recv(wire: Wire, src: Optional[int], sizes_of: SizesOf, tree: bool = False) -> Received:
    """Receive from group rank ``src`` (``None``: any); return ``(sender, incoming, is_error)``. ``tree``: a message
    of a reduction's tree or a scan (:func:`tree_send`)."""
    lease = wire.slot_medium.p2p(wire, "recv", src)
    with lease as route:
        if route is not None:
            return _recv(wire, src, sizes_of, route, lease, tree)
        with pair_locks.receiving(wire.group, src, wire.tag):  # its parts together, whatever other threads receive
            return _recv(wire, src, sizes_of, None, lease, tree)


def _recv(
    wire: Wire, src: Optional[int], sizes_of: SizesOf, route: Optional[Route], lease: Lease, tree: bool = False
) -> Received:
    op = "recv"
    if route is not None:
        sender, got, message = route.recv(wire, src, op)
        return received(wire, sender, read_slot(memoryview(got)), sizes_of, route, message)
    # an envelope, and room for a rest that comes with its slot (routes.backend_whole): a CPU group's, a GPU's tree's
    _, framed, room = _framing(wire, tree)
    head = ENVELOPE.size if framed else 0
    buffer = zeroed(head + wire.slot + room, wire)
    peer = None if src is None else wire.ranks[src]
    waited = f"{op} from {'any rank' if src is None else f'rank {src}'} under tag {wire.tag} (no other tag matches it)"
    sender_global = guarded(waited, wire, dist.recv, buffer, src=peer, group=wire.group, tag=wire.data_tag)
    sender = wire.ranks.index(sender_global) if src is None else src  # (GroupRanks: one lookup)
    lease.took(sender)  # the route counts the slots taken, by sender (SlotMedium.p2p)
    part: Callable[[slice], memoryview]
    if is_cpu(wire.device):  # a view of the buffer (no copy), sliced
        whole = host_view(buffer)
        front, part = whole[: head + wire.slot], lambda at: whole[at]
    else:  # a GPU's: the envelope and slot copied to the host, then the rest that came with it, if any
        front, part = host_view(buffer[: head + wire.slot]), lambda at: host_view(buffer[at])
    after, asked = _opened(wire, front, part, sender, op) if framed else (None, False)
    slot = read_slot(front[head:])
    return received(wire, sender, slot, sizes_of, after=after, asked=asked, tree=tree)


def _opened(
    wire: Wire, front: memoryview, part: Callable[[slice], memoryview], sender: int, op: str
) -> Tuple[memoryview, bool]:
    """The rest that came with a slot in its message through the group (empty for none; ``front``: the message's
    envelope and slot, ``part(slice)``: the message's bytes there, on the host), once its envelope
    (:func:`_enveloped`) says the sender's slot is this rank's size and the rest fits the message; and whether the
    sender waits for this rank's answer (:data:`ASKED`)."""
    theirs, following = ENVELOPE.unpack_from(front)
    if theirs != wire.slot:
        raise CommunicationError(
            f"{op}: rank {sender} sent a slot of {theirs:,} bytes where this rank uses slot_bytes={wire.slot:,}: "
            "every rank of a group must use the same slot_bytes (objcomm.configure, the Communicator or the call); "
            "or that rank did not send with objcomm (torch's own send_object_list, where only some ranks called "
            "objcomm.compat.patch())"
        )
    if following == ASKED:
        return front[:0], True
    if not 0 <= following <= routes.BACKEND_WHOLE_BYTES:
        raise FrameError(
            f"{op}: rank {sender}'s message announces {following:,} bytes after its slot, where at most "
            f"{routes.BACKEND_WHOLE_BYTES:,} may follow it; refused"
        )
    start = ENVELOPE.size + wire.slot
    return (part(slice(start, start + following)) if following else front[:0]), False


@one_call  # (the express path calls it too, after its own round 1)
def received(
    wire: Wire,
    sender: int,
    info: SlotInfo,
    sizes_of: SizesOf,
    route: Optional[Route] = None,
    message: int = 0,
    after: Optional[memoryview] = None,
    asked: bool = False,
    tree: bool = False,
) -> Received:
    """The rest of a receive from group rank ``sender`` once its slot (``info``) arrived, through the group or
    ``route`` (which carried the slot of message ``message``); the incoming keeps the limit the slot announced.
    ``after``: what followed the slot in its message of a CPU group or a GPU group's tree (``tree``;
    :func:`_enveloped`; empty: nothing), ``asked``: whether that message's envelope said the sender waits for an
    answer."""
    round_one_done()  # the sender is here (its slot came): the rest shares one timeout (call_clock)
    got = _received(wire, sender, info, sizes_of, route, message, after, asked, tree)
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
    asked: bool,
    tree: bool,
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
    moved = info.second_round_bytes
    required = _agreement_needed(wire, info, op, media=False)  # what the slot alone asks for, read alike by both
    # whether the sender waits for an answer, as its message says (its settings decide); NCCL's backend: from the slot
    agreed = bool(message & ASKS) if route is not None else asked if after is not None else required
    if required and not agreed:
        raise FrameError(
            f"{op}: rank {sender} sent the slot of a {moved:,}-byte rest without waiting for this rank's answer, "
            "where its slot requires one (its sizes not listed, or a piece past 1 MiB): a protocol error; refused"
        )
    # whether the rest comes with the slot: by the sender's settings on a CPU group (it says so in its envelope), by
    # the slot on a GPU group's tree (a rest of its frame alone: tensors never leave the GPU)
    whole = _comes_whole(info, agreed, _cpu_rules(wire), tree)
    if after:  # the sender sent its rest with its slot (routes.backend_whole, by its settings): no answer waits
        if len(after) != moved:
            raise FrameError(
                f"{op}: rank {sender} sent {len(after):,} bytes with its slot where the slot announces a rest of "
                f"{moved:,}; refused"
            )
        if not whole:
            raise FrameError(
                f"{op}: rank {sender} sent a {moved:,}-byte rest with its slot where tensors must follow it on their "
                "own (a GPU group's tree: they stay on the GPU): a protocol error; refused"
            )
        if refuse:
            raise _limits.refused(op, sender, wire, info.total, problem, drained=True, into="its message")
        return sender, incoming(bytearray(after), info, sizes_of, sender, op), False
    if after is not None and whole:
        raise FrameError(
            f"{op}: rank {sender} sent the slot of a {moved:,}-byte rest with neither the rest nor a request for "
            "this rank's answer: a protocol error; refused"
        )
    at_once = not agreed or message & WHOLE  # WHOLE: the sender did not ask (the rest came with its slot)
    if route is not None and at_once and is_cpu(wire.device):  # the rest came right after the slot
        got = route.recv_rest(wire, info, sizes_of, sender, message, op, drain=bool(refuse))
        if refuse:
            raise _limits.refused(op, sender, wire, info.total, problem, drained=True)
        return sender, got, False
    if route is not None or agreed:  # a route answers: a few µs there
        takes = not refuse and wire.rest_media.worth(wire, info.second_round_bytes, op, sender)
        code = refuse | (TAKES if takes else 0)  # shared memory takes it where the sender's settings say so too
        if route is not None:
            route.answer(wire, sender, message, code)
        else:
            answer = torch.tensor([code], dtype=torch.uint8, device=wire.device)
            guarded(op, wire, dist.send, answer, dst=wire.ranks[sender], group=wire.group, tag=wire.answer_tag)
        if refuse:
            raise _limits.refused(op, sender, wire, info.total, problem)
        # shared memory's words follow exactly where this rank answered that it takes the rest (TAKES)
        checked = _limits.checked_sizes(sizes_of, [info])
        taken = wire.rest_media.recv(wire, info, checked, sender, op, route, message) if takes else NOT_USED
        if taken is not NOT_USED:
            return sender, taken, False
        if route is not None and is_cpu(wire.device):  # as the sender does
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
