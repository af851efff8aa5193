"""The express path of small calls (send/recv, all_gather, broadcast): from the call to the same-host
channel in one straight line.

Most traffic between the ranks of one host is small (per-step metrics, stop/continue decisions, work
items, replies) and sent with a communicator's defaults. Through a group's same-host channel
(:mod:`objcomm._samehost.channel_slots`) such a call is one slot per rank, and the general path's work around it
(resolving the call's settings, routing, building an :class:`~objcomm._transport.base.Outgoing`, filling and
reading slots, its layers of checks) is most of its cost: ~25 µs of Python a call against a channel
hop of ~6 µs. :class:`Express` holds what that work decides, worked out once per communicator,
settings and group (:meth:`objcomm.Communicator._express` keeps it fresh; built on a communicator's
first send/recv or second collective, so that a communicator made for one call never pays for it),
and does the rest per call.

What a peer receives is the general path's slot, byte for byte, less the zeros after the frame
(:func:`objcomm._format.plain_slot.small_slot`; a receiver on either path reads such a *trimmed* slot as the
whole one, :func:`objcomm._samehost.channel_checks.trimmed`; pinned by ``tests/api/test_express.py``): a 4 KiB
slot for a 100-byte frame was most of the bytes a small message allocated, copied and moved. A receiver checks
what the general path checks, then decodes as it does: a plain frame of this rank's own serializer
with that serializer itself where the registry gives it for its name (under ``"auto"``: of any serializer it
may choose; :func:`_decoders`, worked out once per registry version; :func:`objcomm._format.plain_slot.plain_named`),
any other frame through
:func:`objcomm._format.frame.decode_parsed`; the same errors, word for word. A sender takes only the plainest
case and hands everything else to the general path *before anything has moved*: a call with
per-call options, an argument the general path would refuse (it says why), an object with tensors or
past the slot or failing to encode (what serializing it gave goes along, so that nothing is
serialized twice, and a failure becomes the general path's error report), compression, an
``isend``/``irecv`` in flight on the group (send/recv), a channel that is not open or, for send/recv
and all_gather, does not carry send/recv yet (until then an all_gather carries this rank's vote).
Once slots have arrived, a slot that is not a whole plain frame (an error report, tensors, a second
round) hands the call to the general path's own steps from the slots on, with the same outcome on
every rank as if it had taken the general path throughout.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, cast

from objcomm import _state
from objcomm._api.call import MAX_TAG, SOURCE_KEEPS_ITS_OWN, Call, only
from objcomm._api.own_box import AnySourceWait
from objcomm._device import is_cpu
from objcomm._errors import CommunicationError, UnknownSerializerError
from objcomm._format import frame as _frame
from objcomm._format import plain_slot as _plain_slot
from objcomm._format.message import Incoming
from objcomm._format.slot import DEFAULT_PIECE, read_slot
from objcomm._samehost import channel_checks as _channel_checks
from objcomm._samehost import channel_slots as _channel_slots
from objcomm._samehost import mesh as _mesh
from objcomm._samehost import p2p_state as _p2p_state
from objcomm._transport import any_source, call_words, routes
from objcomm._transport.base import WHOLE, Wire
from objcomm._transport.broadcast import broadcast_rest
from objcomm._transport.group_ranks import GroupRanks
from objcomm._transport.p2p import received
from objcomm._transport.rounds import all_gather_rest
from serializers import AutoSerializer, SerializerProtocol, registry

NOT_TAKEN = object()  # what Express.recv returns when the general path must receive


class Express:
    """What a default-option send/recv on one group works out once: valid for the settings, registry,
    group and communicator it was built for (the caller checks that); holds no reference to the group."""

    __slots__ = (
        "call",
        "rest",
        "state",
        "facts",
        "ranks",
        "rank",
        "index",
        "name",
        "slot",
        "limit",
        "spin",
        "cpu",
        "whole_bytes",
        "whole_frames",
        "accept",
        "device",
        "decoders",
        "version",
    )

    def __init__(self, call: Call, strategy: _channel_slots.ChannelSlots, state: _p2p_state.SameHost) -> None:
        wire, options = call.wire, call.options
        assert wire is not None
        self.call = call._replace(wire=None)  # the settings and serializer, without the group
        self.rest = tuple(wire)[1:]  # the wire less its group: rebuilt with it where the general path takes over
        self.state = state  # the group's same-host state: its channel now (a failed one is replaced)
        self.facts = _state.group_facts(wire.group)  # its requests: none in flight, or the general path
        self.ranks = wire.ranks  # group rank -> global rank
        self.rank = wire.rank  # this rank's group rank
        # global rank -> group rank: the group's own dict (an Express built per call, as a Communicator made for one
        # send builds it, once built two dicts of W entries: ~1 ms a send at 8192 ranks)
        self.index = wire.ranks.places if isinstance(wire.ranks, GroupRanks) else GroupRanks(wire.ranks).places
        self.name = call.serializer.name.encode("ascii")  # "auto" never names a frame: the one it chose does
        self.slot, self.limit, self.spin = wire.slot, wire.max_bytes, strategy.spin
        self.cpu = is_cpu(wire.device)  # tags and recv(src=None) need a backend with tags (gloo)
        self.whole_bytes = options.inline_tensor_bytes  # bytes past this travel out of band
        self.whole_frames = _whole_frames(wire, self.cpu)  # frames past the slot up to this go with it, in one message
        self.accept, self.device = options.accept, call.device
        self.version = registry.version  # the registry as self.decoders were found in it
        self.decoders = _decoders(call.serializer, options.accept)

    @staticmethod
    def of(call: Call) -> Optional[Express]:
        """The express path of ``call``'s settings, or None where it can never apply (no same-host
        channel strategy, compression, one rank)."""
        wire = call.wire
        if wire is None or not isinstance(wire.slot_medium, _channel_slots.ChannelSlots):
            return None  # the same-host channel is not this call's slot medium
        if call.options.check_calls:
            return None  # every collective votes on its call first (objcomm._api.call_checks)
        if not routes.express_possible(compression=call.options.compression is not None, channel_first=True):
            return None
        if wire.chunk != DEFAULT_PIECE:  # its slots announce the default pieces (objcomm._format.slot.piece_bits)
            return None
        state = wire.slot_medium.state(wire)
        return None if state is None else Express(call, wire.slot_medium, state)

    def _channel(self, tag: Any) -> Any:
        """The channel, if it carries send/recv under ``tag`` now and no request of this rank is in flight."""
        channel = self.state.channel
        if channel is None or not channel.p2p or channel.closed or type(tag) is not int or not 0 <= tag <= MAX_TAG:
            return None
        if tag and not self.cpu:
            return None
        requests = self.facts.requests
        return None if requests is not None and requests.busy else channel

    def _slot(self, obj: Any, whole: bool = False) -> Any:
        """``(obj's trimmed slot, what serializing obj gave)``: the result of :func:`objcomm._format.frame.serialize`,
        or the exception it raised, which the general path then does not do again. The slot is None where the
        general path takes over, nothing having moved: a failure, tensors, a frame past the slot. ``whole``
        (send): a frame past the slot of at most :attr:`whole_frames` bytes gives a list instead, the untrimmed slot
        and the frame's parts, which travel in one message (as ``ChannelRoute.send_whole`` sends them)."""
        try:
            serialized = _frame.serialize(obj, self.call.serializer, self.whole_bytes)
        except Exception as exc:  # the general path sends the error report
            return None, exc
        if serialized[1].tensors:
            return None, serialized
        try:
            used = serialized[2]  # "auto" chose it, per object; else this call's serializer
            name = self.name if used is self.call.serializer else used.name.encode("ascii")
            slot = _plain_slot.small_slot(name, serialized[0], self.slot, self.limit)
            if slot is None and whole:
                return _plain_slot.medium_slot(
                    name, serialized[0], self.slot, self.limit, self.whole_frames
                ), serialized
            return slot, serialized
        except Exception:  # a payload that is no buffer: encode() raises it again, on the general path
            return None, serialized

    def send(self, obj: Any, dst: Any, tag: Any) -> Any:
        """Send ``obj`` to global rank ``dst``: True once sent. Anything else is what the general path takes
        over, nothing having moved: None (nothing done), or what serializing ``obj`` gave (see :meth:`_slot`)."""
        peer = self.index.get(dst) if type(dst) is int else None
        peer = None if peer == self.rank else peer
        channel = self._channel(tag)
        owed = self.state.owed  # sends this rank still makes through the group (objcomm._samehost.p2p_state)
        if peer is None or channel is None or (owed and (peer, tag) in owed):
            return None
        slot, serialized = self._slot(obj, whole=self.whole_frames > 0)
        if slot is None:
            return serialized
        if type(slot) is list:  # the slot and its frame, in one message
            channel.send(_channel_checks.whole_message(slot[0], slot[1:]), peer, tag, channel.new_message() | WHOLE)
        else:
            channel.send(slot, peer, tag)
        return True

    def all_gather(self, obj: Any, group: Callable[[], Any]) -> Any:
        """``(True, every rank's object in group-rank order)``, or ``(False, what the general path takes
        over)``, nothing having moved (see :meth:`send`). Only once send/recv are on the channel (until then
        an all_gather carries this rank's vote). Once the slots have arrived, slots that are not all plain
        frames (an error report, tensors, a second round) are finished by the general path's steps."""
        channel = self.state.channel
        if channel is None or not channel.p2p or channel.closed or not self.state.agreed:
            return False, None
        slot, serialized = self._slot(obj)
        if slot is None:
            return False, serialized
        slots = _round_one(channel, slot, None, self.spin)
        if slots is REJOIN:
            return False, serialized
        size = self.slot
        decoders = self.decoders if self.version == registry.version else None
        if decoders:  # every slot a plain frame of a serializer this rank holds, whole or trimmed: decoded as they are
            payloads = []  # (serializer, payload) of each, found before any is decoded (a loop: no frames)
            for got in slots:
                named = _plain_slot.plain_named(got, size)
                decoder = None if named is None else decoders.get(named[0])
                if decoder is None or named is None:
                    break
                payloads.append((decoder, named[1]))
            else:
                return True, [_frame.loads_payload(d, d.name, p, r) for r, (d, p) in enumerate(payloads)]
        self._judge(slots, channel, group, 0, "all_gather")
        plains = [_plain_slot.plain_in_slot(got) for got in slots]
        if None not in plains:
            return True, [self._decode(plain, r) for r, plain in enumerate(plains)]
        wire = self.wire(group(), 0)  # the general path's steps, from the slots on
        call = self.call._replace(wire=wire)
        out, local = call.encode(obj, serialized)
        incoming = all_gather_rest(wire, out, [read_slot(memoryview(s)) for s in slots], _frame.tensor_sizes)
        call.raise_failures("all_gather", incoming, local)
        return True, call.decode_all(incoming)

    def broadcast(self, obj: Any, src: Any, group: Callable[[], Any]) -> Any:
        """``(True, global rank src's object)`` or ``(False, what the general path takes over)``, as
        :meth:`all_gather`. The root takes it only for a plain frame; a receiver hands a slot that is not one
        to the general path's steps."""
        root = self.index.get(src) if type(src) is int else None
        channel = self.state.channel
        if root is None or channel is None or channel.closed or not self.state.agreed:
            return False, None
        if root == self.rank:
            slot, serialized = self._slot(obj)
            if slot is None:
                return False, serialized
            if _round_one(channel, slot, root, self.spin) is REJOIN:
                return False, serialized
            if SOURCE_KEEPS_ITS_OWN.get():  # objcomm.compat's, which keeps its list: decoded only where it may refuse
                if not self.call.refuses_nothing():
                    self._plain(slot, root)
                return True, None
            return True, self._plain(slot, root)  # a copy of its own object
        got = _round_one(channel, None, root, self.spin)
        if got is REJOIN:
            return False, None
        value = self._received(got, root, channel, group, 0, "broadcast")
        if value is not NOT_TAKEN:
            return True, value
        wire = self.wire(group(), 0)  # the general path's steps, from the slot on
        call = self.call._replace(wire=wire)
        item = broadcast_rest(wire, None, read_slot(memoryview(got)), _frame.tensor_sizes, root)
        if item.error:
            call.raise_failures("broadcast", only(root, item, wire.size), None)
        return True, call.decode(item, root)

    def _received(self, got: Any, sender: int, channel: Any, group: Callable[[], Any], tag: int, op: str) -> Any:
        """The object in the slot ``got`` that group rank ``sender`` sent this rank if it holds a plain frame, else
        :data:`NOT_TAKEN`; a message that is neither a slot nor one trimmed raises, as the general path does."""
        value = self._named(got, sender)
        if value is NOT_TAKEN:
            self._judge([got], channel, group, tag, op)
            value = self._framed(got, sender)
        return value

    def _judge(self, slots: Any, channel: Any, group: Callable[[], Any], tag: int, op: str) -> None:
        """Raise, as the general path does (the channel fails), where a message of ``slots`` is neither a slot of
        this rank's ``slot_bytes`` nor one trimmed after its frame (``channel_checks.trimmed``)."""
        size = self.slot
        for got in slots:
            if len(got) != size and not _channel_checks.trimmed(got, size):
                _channel_checks._checked(self.wire(group(), tag), channel, slots, op)

    def _named(self, slot: Any, sender: int) -> Any:
        """The object in ``slot`` from group rank ``sender`` where it is a slot or one trimmed and holds a plain frame
        of a serializer this rank holds (:func:`objcomm._format.plain_slot.plain_named`), else :data:`NOT_TAKEN`."""
        if self.decoders and self.version == registry.version:
            named = _plain_slot.plain_named(slot, self.slot)
            if named is not None:
                decoder = self.decoders.get(named[0])
                if decoder is not None:  # a serializer this rank holds: decoded with it, as decode_parsed finds it
                    return _frame.loads_payload(decoder, decoder.name, named[1], sender)
        return NOT_TAKEN

    def _plain(self, slot: Any, sender: int) -> Any:
        """The object in ``slot`` from group rank ``sender`` if it holds a plain frame (its length judged by the
        caller), else :data:`NOT_TAKEN`."""
        value = self._named(slot, sender)
        return self._framed(slot, sender) if value is NOT_TAKEN else value

    def _framed(self, slot: Any, sender: int) -> Any:
        """The object of the plain frame in ``slot`` as the general path reads it (any serializer ``accept`` takes;
        its length judged by the caller), else :data:`NOT_TAKEN`."""
        plain = _plain_slot.plain_in_slot(slot)
        return NOT_TAKEN if plain is None else self._decode(plain, sender)

    def _plain_rest(self, slot: Any, rest: Any, sender: int) -> Any:
        """The object of a plain frame that came after its slot in one message (:meth:`send`), within this rank's
        ``max_bytes``, else :data:`NOT_TAKEN` (the general path then reads, judges or refuses it)."""
        plain = _plain_slot.plain_rest(slot, rest) if len(rest) <= self.limit else None
        if plain is None:
            return NOT_TAKEN
        if self.decoders and self.version == registry.version:
            frame, header = plain
            decoder = self.decoders.get(header.serializer.encode("ascii"))
            if decoder is not None:  # as _plain does
                payload = frame[header.payload_offset : header.payload_offset + header.payload_len]
                return _frame.loads_payload(decoder, decoder.name, payload, sender)
        return self._decode(plain, sender)

    def _decode(self, plain: Any, sender: int) -> Any:
        """The object of a plain frame (``(frame, header)`` of ``plain_slot.plain_in_slot``) from ``sender``."""
        frame, header = plain
        return _frame.decode_parsed(
            frame, header, Incoming(frame), sender, self.accept, self.device, self.limit, own=sender == self.rank
        )

    def recv(self, src: Any, tag: Any, group: Callable[[], Any]) -> Any:
        """``(sender's global rank, object)`` from global rank ``src`` (None: any) under ``tag``, or
        :data:`NOT_TAKEN` (nothing received) where the general path must receive. ``group()``: the group,
        asked for only where the general path takes over."""
        if src is None:
            peer = None
            if not self.cpu:
                return NOT_TAKEN
        else:
            peer = self.index.get(src) if type(src) is int else None
            if peer is None or peer == self.rank:
                return NOT_TAKEN
        channel = self._channel(tag)
        if channel is None:
            return NOT_TAKEN
        try:
            if peer is None:  # a message this rank sends itself meanwhile stops its wait: the general path takes it
                with AnySourceWait(self.facts, tag):
                    sender, got, message = channel.recv(None, tag, self.spin)
            else:
                sender, got, message = channel.recv(peer, tag, self.spin)
        except any_source.OwnMessage:
            return NOT_TAKEN
        folded = bytearray()
        if message & WHOLE:  # a slot and the rest that follows it, in one message (ChannelRoute.send_whole)
            got, folded = _channel_checks.cut_whole(channel, got, self.slot, sender, "recv", self.cpu)
        if not folded:
            obj = self._received(got, sender, channel, group, tag, "recv")
        else:
            self._judge([got], channel, group, tag, "recv")
            obj = self._plain_rest(got, folded, sender)
        if obj is NOT_TAKEN:  # anything else: the general path's steps, from the slot on
            wire = self.wire(group(), tag)
            incoming = received(
                wire,
                sender,
                read_slot(memoryview(got)),
                _frame.tensor_sizes,
                _channel_slots.ChannelRoute(channel, self.spin, folded),
                message,
            )
            return self.ranks[sender], self.call._replace(wire=wire).received(*incoming)
        return self.ranks[sender], obj

    def wire(self, group: Any, tag: int) -> Wire:
        """The wire of a send/recv on ``group`` under ``tag``, as the general path builds it."""
        return Wire(group, *self.rest)._replace(tag=tag)


def _whole_frames(wire: Wire, cpu: bool) -> int:
    """The longest frame past the slot that a send of ``wire``'s settings moves in one channel message with its slot,
    as the general path decides it (``p2p._send``: no answer needed, one message of the channel); 0: none."""
    room = _mesh.MAX_PAYLOAD - _channel_checks.whole_size(b"", 0) - wire.slot
    if not cpu or room <= 0:
        return 0
    medium = wire.rest_media.worth(wire, room, "send")  # grows with the bytes: if not at room, nowhere below
    return 0 if routes.agreement_needed(sizes_listed=True, largest_piece=room, medium_may_take=medium) else room


REJOIN = object()  # what _round_one returns where the general path must open a new channel


def _round_one(channel: Any, slot: Any, root: Optional[int], spin: Optional[float]) -> Any:
    """Round 1 on ``channel``: the all_gather of ``slot`` (``root`` None) or ``root``'s broadcast of it (None
    elsewhere); :data:`REJOIN` where it failed because a peer had failed the channel before this call (the general
    path then opens a new one at this call, as that peer does: :meth:`objcomm._samehost.mesh.Mesh.rejoins_after`),
    nothing having been taken."""
    channel.rounds += 1  # a call's first round, as ChannelSlots counts them
    op = "all_gather" if root is None else "broadcast"  # its word, as the general path's (Operations: enter)
    call_words.WORD.set(call_words.WORDS.get((op, root)) or call_words.word_of(op, root))
    start = channel.sequence
    try:
        return channel.all_gather(slot, spin) if root is None else channel.broadcast(slot, root, spin)
    except CommunicationError:
        if channel.rejoins_after(start):
            return REJOIN
        raise


def _decoders(serializer: SerializerProtocol, accept: Any) -> Dict[bytes, SerializerProtocol]:
    """By name (ASCII bytes): the serializers whose frames are decoded as they are, each what
    :func:`objcomm._format.frame.decode_parsed` finds in the registry for its name, and each taken by ``accept``:
    ``serializer`` itself, or under ``"auto"`` every one it may choose (frames name the one chosen, never "auto")."""
    auto = isinstance(serializer, AutoSerializer)
    names = cast(AutoSerializer, serializer).names() if auto else [serializer.name]
    found: Dict[bytes, SerializerProtocol] = {}
    for name in names:
        if accept is not None and name not in accept:
            continue
        try:
            held = registry.guarded(name)
        except UnknownSerializerError:  # not registered: its frames are refused where they arrive (the general path)
            continue
        if held is serializer or auto:
            found[name.encode("ascii")] = held
    return found
