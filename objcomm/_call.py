"""One call, resolved: its settings, serializer and wire; and what several operations share.

:class:`Call` encodes (a failure becomes an error report that still travels), decodes and raises
the failures of a call; the functions below build a call's wire (membership and device, learned
once per group; the first- and second-round strategies; the tag) and check or encode per-rank inputs.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from serializers import SerializerProtocol

from . import _first, _framing, _reduce, _shm, _state, _transport
from ._channel_round import MOST as CHANNEL_MOST
from ._channel_round import ChannelRounds
from ._device import group_backend, resolve_device
from ._errors import CommunicationError, Failure, ObjcommError, remote_error
from ._segments import SegmentBook
from ._settings import CallOptions
from ._transport import Incoming, Outgoing
from ._wire import BACKEND, DIRECT, FirstRound, SecondRound

Device = Union[str, torch.device, None]


class Call(NamedTuple):
    """One call, resolved: its settings, the serializer object and the wire (None: no group)."""

    options: CallOptions
    serializer: SerializerProtocol
    wire: Optional[_transport.Wire]

    @property
    def device(self) -> torch.device:
        """Where received tensors go: ``map_location``, else the transport device, else the CPU."""
        if self.options.map_location is not None:
            return torch.device(self.options.map_location)
        return self.wire.device if self.wire is not None else torch.device("cpu")

    def encode(self, obj: Any, serialized: Union[None, _framing.Serialized, BaseException] = None,
               ) -> tuple[Outgoing, Optional[BaseException]]:
        """``(outgoing, exception)``: a failure becomes an error report that still travels. ``serialized``:
        what serializing ``obj`` with this call's serializer gave already (:func:`objcomm._framing.serialize`'s
        result, or what it raised), so that it is not serialized twice."""
        try:
            if isinstance(serialized, BaseException):
                raise serialized
            out = _framing.encode(
                obj, self.serializer, max_bytes=self.options.max_bytes,
                inline_tensor_bytes=self.options.inline_tensor_bytes, compression=self.options.compression,
                serialized=serialized,
            )
            return out, None
        except Exception as exc:
            limit = self.wire.inline_capacity if self.wire is not None else 1 << 16
            return _framing.error_frame(exc, limit), exc

    @staticmethod
    def failures(incoming: Sequence[Optional[Incoming]]) -> Dict[int, Failure]:
        found = {}
        for rank, item in enumerate(incoming):
            if item is not None and item.error:
                found[rank] = _framing.read_error(item.frame, _framing.parse_header(item.frame))
        return found

    def raise_failures(self, op: str, incoming: Sequence[Optional[Incoming]], local: Optional[BaseException]) -> None:
        for item in incoming:  # looked for here first: most calls have no failure to read
            if item is not None and item.error:
                raise remote_error(op, self.failures(incoming), local) from local

    def decode(self, item: Optional[Incoming], sender: int, own: bool = False) -> Any:
        if item is None:
            raise CommunicationError(f"no frame arrived from rank {sender}")
        return _framing.decode(
            item, sender=sender, accept=self.options.accept, device=self.device, max_bytes=self.options.max_bytes,
            own=own,
        )

    def received(self, sender: int, item: Incoming, is_error: bool) -> Any:
        """The object of a send/recv from group rank ``sender`` (what :func:`objcomm._transport.recv` returned)."""
        if is_error:
            assert self.wire is not None
            self.raise_failures("send/recv", only(sender, item, self.wire.size), None)
        return self.decode(item, sender)

    def roundtrip(self, obj: Any) -> Any:
        """What a group of one returns: the object encoded and decoded, so failures match."""
        out, error = self.encode(obj)
        if error is not None:
            raise error
        return self.decode(Incoming(out.frame, list(out.tensors)), 0, own=True)


def membership(group: Any, device: Device) -> tuple:
    """``(global ranks, this rank's group rank, transport device)`` for ``group``, learned once per group."""
    known = _state.group_facts(group).membership
    found = known.get(device)
    if found is None:
        rank = dist.get_rank(group)
        if rank < 0:
            raise ObjcommError(
                f"this rank (global rank {dist.get_rank()}) is not a member of the group it was asked to use; "
                "only call objcomm with groups this rank belongs to"
            )
        found = known[device] = (
            tuple(dist.get_process_group_ranks(group)), rank, resolve_device(group_backend(group), group, device)
        )
    return found


WIRES_KEPT = 16  # wires kept per group: one per set of options in use


def wire_for(group: Any, device: Device, options: CallOptions, segments: SegmentBook) -> _transport.Wire:
    """The wire of a call on ``group`` with ``options``. All but the group is worked out once per group,
    device, options object (:func:`objcomm._settings.resolve` hands repeated calls the same one) and
    segment book, and kept without the group, so that the group's facts never keep the group alive."""
    known = _state.group_facts(group).wires
    key = (device, id(options), id(segments))
    found = known.get(key)
    if found is None or found[0] is not options or found[1] is not segments:  # the ids are of live objects
        ranks, rank, transport_device = membership(group, device)
        rest = (ranks, rank, transport_device, options.slot_bytes, options.chunk_bytes, options.max_bytes,
                second_round_for(options, segments), first_round_for(options))
        if len(known) >= WIRES_KEPT:
            known.clear()
        found = known[key] = (options, segments, rest)
    return _transport.Wire(group, *found[2])  # Wire's fields in order: the group, then the rest


def second_round_for(options: CallOptions, segments: SegmentBook) -> SecondRound:
    """Who may move a call's second round: shared memory on one host when switched on, else the transport;
    below ``shm_threshold``, the same-host channel where it carried round 1 (``local``; all_gather and broadcast)."""
    shared: SecondRound = DIRECT
    if options.shm:
        shared = _shm.SharedMemory(threshold=options.shm_threshold, directory=options.shm_dir or _shm.DEFAULT_DIRECTORY,
                                   separate=options.separate_hosts, zero_copy=options.shm_zero_copy, book=segments)
    if not options.local:
        return shared
    return ChannelRounds(shared, min(options.shm_threshold, CHANNEL_MOST))


def first_round_for(options: CallOptions) -> FirstRound:
    """Who may move a call's round-1 slots: the same-host channel when switched on (it decides per group
    whether it opens), else the group."""
    return _first.same_host(options.separate_hosts, options.local_spin_us) if options.local else BACKEND


MAX_TAG = _reduce.REDUCE_TAG - 1  # the backend carries 2 * tag + 1 (see objcomm._wire.Wire.data_tag)


def tagged(wire: _transport.Wire, tag: Any, op: str) -> _transport.Wire:
    """``wire`` for messages with ``tag``; NCCL has no tags, so only tag 0 goes there."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        raise ValueError(f"{op}: tag must be an int from 0 to {MAX_TAG:,}, got {tag!r}")
    if tag and wire.device.type != "cpu":
        raise ValueError(
            f"{op}(tag={tag}): this group moves bytes on {wire.device} (NCCL), which ignores tags and would mix "
            "messages; use tag=0 there, or a gloo group (e.g. dist.new_group(backend='gloo')) for tagged messages"
        )
    return wire._replace(tag=tag) if tag else wire


def only(rank: int, item: Incoming, size: int) -> List[Optional[Incoming]]:
    items: List[Optional[Incoming]] = [None] * size
    items[rank] = item
    return items


def per_rank(objs: Optional[Sequence[Any]], size: int, op: str) -> Sequence[Any]:
    """``objs`` checked to hold one object per group rank."""
    where = " on the source rank" if op == "scatter" else ""
    if objs is None or isinstance(objs, (str, bytes)) or not hasattr(objs, "__len__"):
        raise TypeError(f"{op} needs a sequence of {size} objects{where}, got {type(objs).__name__}")
    if len(objs) != size:
        raise ValueError(f"{op} needs exactly one object per rank: got {len(objs)} for a group of {size}")
    return objs


def encode_each(call: Call, objs: Optional[Sequence[Any]], size: int, op: str) -> Tuple[List[Outgoing], Any]:
    """One frame per rank, or, when any fails (or ``objs`` is not one per rank), one error report for all."""
    try:
        outs = []
        for item in per_rank(objs, size, op):
            out, local = call.encode(item)
            if local is not None:
                raise local
            outs.append(out)
        return outs, None
    except Exception as exc:
        assert call.wire is not None
        return [_framing.error_frame(exc, call.wire.inline_capacity)] * size, exc


def final_report(call: Call, value: Any, complete: bool, own: Optional[BaseException],
                 carries: bool = True) -> Tuple[Outgoing, Any]:
    """What a rank contributes to a reduction's last collective: group rank 0 the result where another rank
    needs it (``carries``; not when group rank 0 is the reduce's destination), every rank its own failure if it
    had one, the others a tiny frame."""
    assert call.wire is not None
    if own is not None:
        return _framing.error_frame(own, call.wire.inline_capacity), own
    return call.encode(value if complete and carries and call.wire.rank == 0 else None)
