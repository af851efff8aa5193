"""The express path of a small send/recv: from the call to the same-host channel in one straight line.

Most point-to-point traffic on one host is small (per-step metrics, work items, replies) and sent
with a communicator's defaults. Once a group's same-host channel carries send/recv
(:mod:`objcomm._first`), such a message is one slot through the channel, and the general path's
work around it (resolving the call's settings, routing, building an :class:`~objcomm._wire.Outgoing`,
reading the slot back, its layers of checks) is most of its cost: ~25 µs of Python a call against a
channel hop of ~6 µs. :class:`Express` holds what that work decides, worked out once per
communicator, settings and group (:meth:`objcomm.Communicator._express` keeps it fresh), and does
the rest per call.

What a peer receives is the general path's slot, byte for byte, less the zeros after the frame
(:func:`objcomm._framing.small_slot`; a receiver on either path reads such a *trimmed* slot as the
whole one, :func:`objcomm._first.trimmed`; pinned by ``tests/test_express.py``): a 4 KiB slot for a
100-byte frame was most of the bytes a small message allocated, copied and moved. A receive checks
what the general path checks, then decodes with the same function. It takes only the
plainest case and hands everything else to the general path *before anything has moved*: a send
with per-call options, an argument the general path would refuse (it says why), an object with
tensors or past the slot or failing to encode (what serializing it gave goes along, so that nothing
is serialized twice, and a failure becomes the general path's error report), compression, an
``isend``/``irecv`` in flight on the group, a channel that does not carry send/recv (yet, or any
more). A receive hands over once its slot has arrived when the slot is not the whole message (an
error report, tensors, a second round): the general path's own steps finish it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from . import _first, _framing, _state
from ._call import MAX_TAG, Call
from ._slots import read_slot
from ._transport import Incoming, Wire, received

NOT_TAKEN = object()  # what Express.recv returns when the general path must receive


class Express:
    """What a default-option send/recv on one group works out once: valid for the settings, registry,
    group and communicator it was built for (the caller checks that); holds no reference to the group."""

    __slots__ = ("call", "rest", "state", "facts", "ranks", "peers", "name", "slot", "limit", "spin", "cpu",
                 "whole_bytes", "accept", "device")

    def __init__(self, call: Call, strategy: _first.SameHostSlots, state: _first.SameHost) -> None:
        wire, options = call.wire, call.options
        assert wire is not None
        self.call = call._replace(wire=None)  # the settings and serializer, without the group
        self.rest = tuple(wire)[1:]  # the wire less its group: rebuilt with it where the general path takes over
        self.state = state  # the group's same-host state: its channel now (a failed one is replaced)
        self.facts = _state.group_facts(wire.group)  # its requests: none in flight, or the general path
        self.ranks = wire.ranks  # group rank -> global rank
        self.peers = {g: r for r, g in enumerate(wire.ranks) if r != wire.rank}  # global rank -> group rank
        self.name = call.serializer.name.encode("ascii")
        self.slot, self.limit, self.spin = wire.slot, wire.max_bytes, strategy.spin
        self.cpu = wire.device.type == "cpu"  # tags and recv(src=None) need a backend with tags (gloo)
        self.whole_bytes = options.inline_tensor_bytes  # bytes past this travel out of band
        self.accept, self.device = options.accept, call.device

    @staticmethod
    def of(call: Call) -> Optional[Express]:
        """The express path of ``call``'s settings, or None where it can never apply (no same-host
        channel strategy, compression, one rank)."""
        wire = call.wire
        if wire is None or call.options.compression is not None:
            return None
        if not isinstance(wire.first_round, _first.SameHostSlots):
            return None
        state = wire.first_round.state(wire)
        return None if state is None else Express(call, wire.first_round, state)

    def _channel(self, tag: Any) -> Any:
        """The channel, if it carries send/recv under ``tag`` now and no request of this rank is in flight."""
        channel = self.state.channel
        if channel is None or not channel.p2p or channel.closed or type(tag) is not int or not 0 <= tag <= MAX_TAG:
            return None
        if tag and not self.cpu:
            return None
        requests = self.facts.requests
        return None if requests is not None and requests.busy else channel

    def send(self, obj: Any, dst: Any, tag: Any) -> Any:
        """Send ``obj`` to global rank ``dst``: True once sent. Anything else is what the general path takes
        over, nothing having moved: None (nothing done), or what serializing ``obj`` gave (the result of
        :func:`objcomm._framing.serialize`, or the exception it raised), which it then does not do again."""
        peer = self.peers.get(dst) if type(dst) is int else None
        channel = self._channel(tag)
        if peer is None or channel is None:
            return None
        try:
            serialized = _framing.serialize(obj, self.call.serializer, self.whole_bytes)
        except Exception as exc:  # the general path sends the error report
            return exc
        if serialized[1].tensors:
            return serialized
        try:
            slot = _framing.small_slot(self.name, serialized[0], self.slot, self.limit)
        except Exception:  # a payload that is no buffer: encode() raises it again, on the general path
            return serialized
        if slot is None:
            return serialized
        channel.send(slot, peer, tag)
        return True

    def recv(self, src: Any, tag: Any, group: Callable[[], Any]) -> Any:
        """``(sender's global rank, object)`` from global rank ``src`` (None: any) under ``tag``, or
        :data:`NOT_TAKEN` (nothing received) where the general path must receive. ``group()``: the group,
        asked for only where the general path takes over."""
        if src is None:
            peer = None
            if not self.cpu:
                return NOT_TAKEN
        else:
            peer = self.peers.get(src) if type(src) is int else None
            if peer is None:
                return NOT_TAKEN
        channel = self._channel(tag)
        if channel is None:
            return NOT_TAKEN
        sender, got = channel.recv(peer, tag, self.spin)
        if len(got) != self.slot and not _first.trimmed(got, self.slot):
            _first._checked(self.wire(group(), tag), channel, [got], "recv")  # raises, as the general path does
        plain = _framing.plain_in_slot(got)
        if plain is None:  # anything else: the general path's steps, from the slot on
            wire = self.wire(group(), tag)
            incoming = received(wire, sender, read_slot(memoryview(got)), _framing.tensor_sizes)
            return self.ranks[sender], self.call._replace(wire=wire).received(*incoming)
        frame, header = plain
        obj = _framing.decode_parsed(frame, header, Incoming(frame), sender, self.accept, self.device, self.limit)
        return self.ranks[sender], obj

    def wire(self, group: Any, tag: int) -> Wire:
        """The wire of a send/recv on ``group`` under ``tag``, as the general path builds it."""
        return Wire(group, *self.rest)._replace(tag=tag)
