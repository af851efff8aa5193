"""One call, resolved: its settings, serializer and wire; and what several operations share.

:class:`Call` encodes (a failure becomes an error report that still travels), decodes and raises
the failures of a call; the functions below build a call's wire (membership and device, learned
once per group; its slot medium and rest media; the tag) and check or encode per-rank inputs.
mpi4py's vocabulary (what a ported program writes, and what to write instead) is :mod:`objcomm._api.mpi4py_names`.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from objcomm import _state
from objcomm._device import group_backend, is_cpu, resolve_device
from objcomm._errors import NO_RESULT, CommunicationError, Failure, FrameError, ObjcommError, remote_error
from objcomm._format import frame as _frame
from objcomm._format.limits import too_large
from objcomm._format.message import SLOT_PREFIX_BYTES, Incoming, Outgoing
from objcomm._format.plain_slot import plain_frame, plain_payload
from objcomm._format.slot import piece_size
from objcomm._samehost import shm as _shm
from objcomm._samehost import two_level as _two_level
from objcomm._samehost.rests import SameHostRests
from objcomm._samehost.segments import DEFAULT_DIRECTORY, SegmentBook
from objcomm._samehost.two_level_rests import TwoLevelRests
from objcomm._samehost.voted_rests import VotedRests
from objcomm._settings import CallOptions
from objcomm._transport.base import BACKEND, INTERNAL_TAG, RestMedia, SlotMedium, Wire
from objcomm._transport.group_ranks import GroupRanks
from objcomm._transport.patterns import Pattern, pattern, row_of
from serializers import AutoSerializer, Serializer, SerializerProtocol, registry

Device = Union[str, torch.device, None]


def chosen(serializer: SerializerProtocol, accept: Any) -> SerializerProtocol:
    """The serializer a call uses: ``serializer``, or for ``"auto"`` the chooser limited to this rank's ``accept``
    list (only safe serializers it names: what this rank would decode, a peer with the same list decodes)."""
    return serializer.within(accept) if isinstance(serializer, AutoSerializer) else serializer


class Unusable(Serializer):
    """The serializer of a call whose own settings failed on this rank (a serializer name not registered here, a
    ``max_bytes`` out of range, a compression library missing): the rank still takes part in the operation, with
    its communicator's settings, so that the group stays in step. What it sends is the failure's report (the
    other ranks raise :class:`~objcomm.RemoteError` naming it, as for an object that cannot be encoded); once the
    operation is over, it raises the failure itself, as it was raised."""

    name, description = "unusable", "this rank's settings for the call failed"

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def dumps(self, obj: Any, /, **_: Any) -> bytes:
        raise self.error

    def loads(self, data: Any, /, **_: Any) -> Any:
        raise self.error

    def __repr__(self) -> str:
        return f"Unusable({self.error!r})"


class Call(NamedTuple):
    """One call, resolved: its settings, the serializer object and the wire (None: no group). A call whose settings
    failed on this rank carries the failure as its serializer (:class:`Unusable`)."""

    options: CallOptions
    serializer: SerializerProtocol
    wire: Optional[Wire]

    @property
    def device(self) -> torch.device:
        """Where received tensors go: ``map_location``, else the transport device, else the CPU."""
        if self.options.map_location is not None:
            return torch.device(self.options.map_location)
        return self.wire.device if self.wire is not None else torch.device("cpu")

    def encode(
        self, obj: Any, serialized: Union[None, _frame.Serialized, BaseException] = None, flags: int = 0
    ) -> tuple[Outgoing, Optional[BaseException]]:
        """``(outgoing, exception)``: a failure becomes an error report that still travels. ``serialized``:
        what serializing ``obj`` with this call's serializer gave already (:func:`objcomm._format.frame.serialize`'s
        result, or what it raised), so that it is not serialized twice; ``flags``: the frame header's."""
        try:
            if isinstance(serialized, BaseException):
                raise serialized
            self.usable()
            out = _frame.encode(
                obj,
                self.serializer,
                max_bytes=self.options.max_bytes,
                inline_tensor_bytes=self.options.inline_tensor_bytes,
                compression=self.options.compression,
                serialized=serialized,
                flags=flags,
            )
            return out, None
        except Exception as exc:
            limit = self.wire.inline_capacity if self.wire is not None else 1 << 16
            return _frame.error_frame(exc, limit), exc

    @staticmethod
    def failures(incoming: Sequence[Optional[Incoming]]) -> Dict[int, Failure]:
        found, unread, read = {}, None, False
        for rank, item in enumerate(incoming):
            if item is not None and item.error:
                try:
                    found[rank], read = _frame.read_error(item.frame, _frame.parse_header(item.frame)), True
                except FrameError as exc:  # an unreadable report hides none of the others
                    found[rank], unread = ("FrameError", f"its failure report could not be read: {exc}"), exc
        if unread is not None and not read:
            raise unread  # nothing else to tell: a malformed frame, as anywhere else
        return found

    def raise_failures(
        self, op: str, incoming: Sequence[Optional[Incoming]], local: Optional[BaseException], outcome: str = NO_RESULT
    ) -> None:
        """Raise :class:`~objcomm.RemoteError` (``outcome``: which ranks went without a result) if any of ``incoming``
        is an error report."""
        for item in incoming:  # looked for here first: most calls have no failure to read
            if item is not None and item.error:
                self.usable()  # this rank's own settings failed: that, as it was raised
                raise remote_error(op, self.failures(incoming), local, outcome) from local

    def usable(self) -> Call:
        """This call, or what failed in its settings on this rank (:class:`Unusable`) raised: before a receive,
        which leaves the message for the next one, and after an operation this rank took part in."""
        if type(self.serializer) is Unusable:
            raise self.serializer.error
        return self

    def refuses_nothing(self) -> bool:
        """Whether decoding a frame of this rank's own cannot refuse it: where its serializer runs whatever a payload
        says (not ``safe``: pickle, cloudpickle) and its ``accept`` takes it. A broadcast's source within
        :func:`source_keeps_its_own` then decodes no copy; otherwise (``weights_only=True``'s restricted-pickle,
        an ``accept`` without it) it still decodes one, and drops it: a refusal raises there as on the receivers."""
        serializer, accept = self.serializer, self.options.accept
        return not serializer.safe and (accept is None or serializer.name in accept)

    def decode(self, item: Optional[Incoming], sender: int, own: bool = False) -> Any:
        self.usable()  # a receiver's own settings failed: it took part, and raises now
        if item is None:
            raise CommunicationError(f"no frame arrived from rank {sender}")
        return _frame.decode(
            item,
            sender=sender,
            accept=self.options.accept,
            device=self.device,
            max_bytes=self.options.max_bytes,
            own=own,
        )

    def decode_all(self, incoming: Sequence[Optional[Incoming]], own: int = -1) -> List[Any]:
        """:meth:`decode` of every rank's item, in group-rank order (``own``: the rank whose item is this rank's own
        input, decoded with ``own=True``): the settings read once, not once a rank (W of them on an all_gather), and
        once a plain frame (no tensors, no compression) decoded, each next plain frame of its serializer straight to
        that serializer (:func:`~objcomm._format.plain_slot.plain_payload`: what :func:`_frame.decode` checks of it,
        without a header built; its name already passed ``accept``) while the registry is unchanged, where more than
        :data:`PLAIN_AHEAD` frames follow (finding the serializer costs about two decodes' framing)."""
        self.usable()
        accept, device, limit, decode = self.options.accept, self.device, self.options.max_bytes, _frame.decode
        objects: List[Any] = []
        last = len(incoming) - PLAIN_AHEAD  # from here on, no serializer is looked for
        plain: Optional[Tuple[bytes, str, SerializerProtocol, int]] = None  # that serializer: its name's bytes, name,
        for sender, item in enumerate(incoming):  # itself, and the registry's version when it was looked up
            if item is None:
                raise CommunicationError(f"no frame arrived from rank {sender}")
            if plain is not None and plain[3] == registry.version:
                payload = plain_payload(item.frame, plain[0])
                if payload is not None:
                    objects.append(_frame.loads_payload(plain[2], plain[1], payload, sender))
                    continue
            objects.append(
                decode(item, sender=sender, accept=accept, device=device, max_bytes=limit, own=sender == own)
            )
            if (plain is None or plain[3] != registry.version) and sender < last:
                plain = _plain_serializer(item.frame)
        return objects

    def received(self, sender: int, item: Incoming, is_error: bool) -> Any:
        """The object of a send/recv from group rank ``sender`` (what ``p2p.recv`` returned)."""
        if is_error:
            assert self.wire is not None
            self.raise_failures("send/recv", only(sender, item, self.wire.size), None)
        return self.decode(item, sender)

    def own(self, out: Outgoing, return_sender: bool = False) -> Any:
        """The object of message ``out``, which this rank sent itself (:mod:`objcomm._api.requests`), judged as a peer's
        with this call's settings: an error report raises ``RemoteError``, a payload past the slot and above
        ``max_bytes`` ``TooLargeError`` (dropped, as a peer's would be), a serializer ``accept`` lacks
        ``ContentRefusedError``. ``return_sender``: ``(this rank's global rank, object)``."""
        rank, size = (0, 1) if self.wire is None else (self.wire.rank, self.wire.size)
        item = Incoming(out.frame, list(out.tensors), error=out.error)
        if out.error:
            self.raise_failures("send/recv", only(rank, item, size), None)
        inline = self.wire.inline_capacity if self.wire is not None else self.options.slot_bytes - SLOT_PREFIX_BYTES
        limit = self.options.max_bytes
        if out.total > limit and (out.tensors or out.frame_nbytes > inline):
            raise too_large(
                f"recv: rank {rank} (this rank, to itself) sends {out.total:,} bytes, above this rank's "
                f"max_bytes={limit:,}",
                outcome="the message was dropped",
                where="here",
            )
        obj = self.decode(item, rank)
        return ((0 if self.wire is None else self.wire.ranks[rank]), obj) if return_sender else obj

    def roundtrip(self, obj: Any) -> Any:
        """What a group of one returns: the object encoded and decoded, so failures match."""
        out, error = self.encode(obj)
        if error is not None:
            raise error
        return self.decode(Incoming(out.frame, list(out.tensors)), 0, own=True)


PLAIN_AHEAD = 8  # frames: where fewer follow a plain one, Call.decode_all decodes them the usual way


def _plain_serializer(frame: memoryview) -> Optional[Tuple[bytes, str, SerializerProtocol, int]]:
    """Where ``frame``, just decoded, is plain: its serializer's name (bytes, then str), the serializer as the registry
    gives it now, and the registry's version (see :meth:`Call.decode_all`); else None, as where the name is no longer
    registered (the serializer's own ``loads`` may change the registry)."""
    read = plain_frame(frame)
    if read is None:
        return None
    version, name = registry.version, read[1].serializer
    try:
        return name.encode("ascii"), name, registry.guarded(name), version
    except ObjcommError:
        return None


def membership(group: Any, device: Device) -> Tuple[Tuple[int, ...], int, torch.device]:
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
            GroupRanks(dist.get_process_group_ranks(group)),
            rank,
            resolve_device(group_backend(group), group, device),
        )
    return found


WIRES_KEPT = 16  # wires kept per group: one per set of options in use


def wire_for(group: Any, device: Device, options: CallOptions, segments: SegmentBook) -> Wire:
    """The wire of a call on ``group`` with ``options``. All but the group is worked out once per group,
    device, options object (:func:`objcomm._settings.resolve` hands repeated calls the same one) and
    segment book, and kept without the group, so that the group's facts never keep the group alive."""
    known = _state.group_facts(group).wires
    key = (device, id(options), id(segments))
    found = known.get(key)
    if found is None or found[0] is not options or found[1] is not segments:  # the ids are of live objects
        ranks, rank, transport_device = membership(group, device)
        rest = (
            ranks,
            rank,
            transport_device,
            options.slot_bytes,
            piece_size(options.chunk_bytes),  # (a power of two, which a slot announces)
            options.max_bytes,
            rest_media_for(options, segments),
            slot_medium_for(options),
        )
        if len(known) >= WIRES_KEPT:
            known.clear()
        found = known[key] = (options, segments, rest)
    return Wire(group, *found[2])  # Wire's fields in order: the group, then the rest


def rest_media_for(options: CallOptions, segments: SegmentBook) -> RestMedia:
    """Who may move a call's second round: shared memory on one host when switched on, else the transport;
    below ``shm_threshold``, the same-host channel where it carried round 1 (``local``), on two levels where round 1
    went so; without the channel, shared memory where every rank's settings take the rest (each says so in its
    announcement)."""
    memory = _shm.SharedMemory(
        threshold=options.shm_threshold,
        directory=options.shm_dir or DEFAULT_DIRECTORY,
        separate=options.separate_hosts,
        zero_copy=options.shm_zero_copy,
        book=segments,
    )
    if not options.local:  # no echo of round 1: every rank takes part in shared memory's announcement, or declines
        return VotedRests(memory, options.shm)
    shared = memory if options.shm else None
    return TwoLevelRests(SameHostRests(options.shm_threshold, shared), options.shm_threshold if options.shm else None)


def slot_medium_for(options: CallOptions) -> SlotMedium:
    """Who may move a call's round-1 slots: the same-host channel when switched on (it decides per group
    whether it opens), else the group."""
    if not options.local:
        return BACKEND
    return _two_level.strategy(options.separate_hosts, options.local_spin_us, options.shm, options.shm_threshold)


MAX_TAG = INTERNAL_TAG - 1  # objcomm's own messages take the next (the backend carries 2 * tag + 1: Wire.data_tag)


def check_tag(tag: Any, op: str) -> None:
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        any_tag = (tag is None or type(tag) is int and tag == -1) and op in ("recv", "irecv")  # mpi4py's ANY_TAG
        hint = "; there is no receive from any tag (mpi4py's ANY_TAG): each names its tag" if any_tag else ""
        raise ValueError(f"{op}: tag must be an int from 0 to {MAX_TAG:,}, got {tag!r}{hint}")


def tagged(wire: Wire, tag: Any, op: str) -> Wire:
    """``wire`` for messages with ``tag``; NCCL has no tags, so only tag 0 goes there."""
    check_tag(tag, op)
    if tag and not is_cpu(wire.device):
        raise ValueError(
            f"{op}(tag={tag}): this group moves bytes on {wire.device} (NCCL), which ignores tags and would mix "
            "messages; use tag=0 there, or a gloo group (e.g. dist.new_group(backend='gloo')) for tagged messages"
        )
    return wire._replace(tag=tag) if tag else wire


SOURCE_KEEPS_ITS_OWN: ContextVar[bool] = ContextVar("objcomm_source_keeps_its_own", default=False)


@contextlib.contextmanager
def source_keeps_its_own() -> Iterator[None]:
    """Within it, a broadcast's source returns None, not a copy decoded from what it sent (the other ranks get the
    object as ever): torch's ``broadcast_object_list`` leaves the source's list alone, and a copy nobody reads cost
    that source one decode of the object a call (``objcomm.compat``). Where that decode could refuse the object, the
    source still runs it, and returns None (:meth:`Call.refuses_nothing`)."""
    token = SOURCE_KEEPS_ITS_OWN.set(True)
    try:
        yield
    finally:
        SOURCE_KEEPS_ITS_OWN.reset(token)


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
        return [_frame.error_frame(exc, call.wire.inline_capacity)] * size, exc


def encode_pattern(
    call: Call, op: str, root: Optional[int], mine: Any
) -> Tuple[Optional[Pattern], List[Outgoing], Any]:
    """This rank's part in row ``op`` of :data:`objcomm._transport.patterns.ROWS` (``root``: its group rank, or None)
    and one frame per rank for the all_to_all that carries it (``Communicator._pattern_call``): ``mine`` encoded once
    (with the row's ``each``, each rank's own part) for every rank the pattern sends to, an empty frame (no part) for
    the others; or, when the row or the encoding fails here (or ``mine`` is not one object per rank where it must
    be), no pattern and one error report for all, so that every rank raises it."""
    wire = call.wire
    assert wire is not None
    try:
        at = pattern(op, me=wire.rank, world=wire.size, root=root)
        parts = per_rank(mine, wire.size, op) if at.each and sends(op, wire.rank, root) else mine
        outs, out = [Outgoing(b"")] * wire.size, None
        for r in at.to:
            if at.each or out is None:
                out, local = call.encode(parts[r] if at.each else parts)
                if local is not None:
                    raise local
            outs[r] = out
        return at, outs, None
    except Exception as exc:
        return None, [_frame.error_frame(exc, wire.inline_capacity)] * wire.size, exc


def sends(op: str, rank: int, root: Optional[int]) -> bool:
    """Whether group rank ``rank`` gives its objects in row ``op`` (``root``: the row's root): every rank where the
    row has no root, the root where its parts leave from it (``src``), the others where they arrive there (``dst``)."""
    where = row_of(op).root
    return not where or (where == "src") == (rank == root)


def final_report(
    call: Call, value: Any, complete: bool, own: Optional[BaseException], carries: bool = True
) -> Tuple[Outgoing, Any]:
    """What a rank contributes to a reduction's last collective: group rank 0 the result where another rank
    needs it (``carries``; not when group rank 0 is the reduce's destination), every rank its own failure if it
    had one, the others a tiny frame."""
    assert call.wire is not None
    if own is not None:
        return _frame.error_frame(own, call.wire.inline_capacity), own
    return call.encode(value if complete and carries and call.wire.rank == 0 else None)
