"""One call, resolved: its settings, serializer and wire; and what several operations share.

:class:`Call` encodes (a failure becomes an error report that still travels), decodes and raises
the failures of a call; the functions below build a call's wire (membership and device, learned
once per group; its slot medium and rest media; the tag) and check or encode per-rank inputs.
The last section speaks mpi4py's vocabulary: what a program ported from it writes (``dest=``,
``root=``, ``bcast``, ``"SUM"``) and what to write instead (``docs/from-mpi4py.md``).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, TypeVar, Union, cast

import torch
import torch.distributed as dist

from objcomm import _state
from objcomm._api import reduce as _reduce
from objcomm._device import group_backend, resolve_device
from objcomm._errors import NO_RESULT, CommunicationError, Failure, FrameError, ObjcommError, remote_error
from objcomm._format import frame as _frame
from objcomm._format.limits import too_large
from objcomm._format.message import SLOT_PREFIX_BYTES, Incoming, Outgoing
from objcomm._samehost import shm as _shm
from objcomm._samehost import two_level as _two_level
from objcomm._samehost.rests import SameHostRests
from objcomm._samehost.segments import DEFAULT_DIRECTORY, SegmentBook
from objcomm._samehost.two_level_rests import TwoLevelRests
from objcomm._settings import CallOptions
from objcomm._transport.base import BACKEND, DIRECT, INTERNAL_TAG, GroupRanks, RestMedia, SlotMedium, Wire
from serializers import AutoSerializer, Serializer, SerializerProtocol

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
        self, obj: Any, serialized: Union[None, _frame.Serialized, BaseException] = None
    ) -> tuple[Outgoing, Optional[BaseException]]:
        """``(outgoing, exception)``: a failure becomes an error report that still travels. ``serialized``:
        what serializing ``obj`` with this call's serializer gave already (:func:`objcomm._format.frame.serialize`'s
        result, or what it raised), so that it is not serialized twice."""
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

    def received(self, sender: int, item: Incoming, is_error: bool) -> Any:
        """The object of a send/recv from group rank ``sender`` (what ``rounds.recv`` returned)."""
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
            options.chunk_bytes,
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
    went so."""
    shared = None
    if options.shm:
        shared = _shm.SharedMemory(
            threshold=options.shm_threshold,
            directory=options.shm_dir or DEFAULT_DIRECTORY,
            separate=options.separate_hosts,
            zero_copy=options.shm_zero_copy,
            book=segments,
        )
    if not options.local:
        return DIRECT if shared is None else shared
    return TwoLevelRests(SameHostRests(options.shm_threshold, shared), options.shm_threshold if options.shm else None)


def slot_medium_for(options: CallOptions) -> SlotMedium:
    """Who may move a call's round-1 slots: the same-host channel when switched on (it decides per group
    whether it opens), else the group."""
    if not options.local:
        return BACKEND
    return _two_level.strategy(
        options.separate_hosts, options.local_spin_us, options.shm_threshold if options.shm else None
    )


MAX_TAG = INTERNAL_TAG - 1  # objcomm's own messages take the next (the backend carries 2 * tag + 1: Wire.data_tag)


def check_tag(tag: Any, op: str) -> None:
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        any_tag = type(tag) is int and tag == -1 and op in ("recv", "irecv")  # mpi4py's ANY_TAG
        hint = "; there is no receive from any tag (mpi4py's ANY_TAG): each names its tag" if any_tag else ""
        raise ValueError(f"{op}: tag must be an int from 0 to {MAX_TAG:,}, got {tag!r}{hint}")


def tagged(wire: Wire, tag: Any, op: str) -> Wire:
    """``wire`` for messages with ``tag``; NCCL has no tags, so only tag 0 goes there."""
    check_tag(tag, op)
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
        return [_frame.error_frame(exc, call.wire.inline_capacity)] * size, exc


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


# -- mpi4py's vocabulary (docs/from-mpi4py.md) ----------------------------------------------------------------------
FROM_MPI4PY = " (objcomm follows torch.distributed's names: see docs/from-mpi4py.md)"

# mpi4py's keyword -> the parameters that mean the same here; a function takes at most one of them
MPI4PY_KEYWORDS: Dict[str, Tuple[str, ...]] = {
    "dest": ("dst",),
    "source": ("src",),
    "root": ("src", "dst"),  # the root sends (bcast, scatter) or receives (gather, reduce)
    "sendobj": ("obj", "objs"),
    "status": ("return_sender",),
}

# mpi4py's names (of its Comm methods and MPI module) -> what to write instead; {on}: "objcomm" or "Communicator"
MPI4PY_NAMES: Dict[str, str] = {
    "bcast": "did you mean {on}.broadcast?",
    "allgather": "did you mean {on}.all_gather?",
    "allreduce": "did you mean {on}.all_reduce?",
    "alltoall": "did you mean {on}.all_to_all?",
    "sendrecv": "there is no sendrecv: {on}.isend(obj, dst, tag) then {on}.recv(src, tag) does what it does",
    "scan": "there is no scan: {on}.all_gather(obj) gives every rank's object, to combine those up to this rank's",
    "exscan": "there is no exscan: {on}.all_gather(obj) gives every rank's object, to combine those before this rank's",
    "probe": "there is no probe: {on}.irecv(src, tag) gives a Request; its is_completed() says whether it arrived",
    "iprobe": "there is no iprobe: {on}.irecv(src, tag) gives a Request; its is_completed() says whether it arrived",
    "barrier": "use torch.distributed.barrier(group)",
    "Barrier": "use torch.distributed.barrier(group)",
    "Get_rank": "use torch.distributed.get_rank(group)",
    "Get_size": "use torch.distributed.get_world_size(group)",
    "rank": "use torch.distributed.get_rank(group)",
    "size": "use torch.distributed.get_world_size(group)",
    "COMM_WORLD": "every call takes group=None, the default group (objcomm.Communicator() holds settings for one)",
    "ANY_SOURCE": "pass src=None to receive from any rank",
    "ANY_TAG": "there is no receive from any tag: each recv names its tag",
    "Status": "recv(..., return_sender=True) returns (sender's global rank, obj)",
    "SUM": 'pass op="sum"',
    "PROD": 'pass op="prod"',
    "MIN": 'pass op="min"',
    "MAX": 'pass op="max"',
    "LAND": "pass op=lambda a, b: a and b",
    "LOR": "pass op=lambda a, b: a or b",
    "MAXLOC": "all_reduce((value, rank), lambda a, b: b if b[0] > a[0] else a)",
    "MINLOC": "all_reduce((value, rank), lambda a, b: b if b[0] < a[0] else a)",
    "PROC_NULL": "there is no PROC_NULL: skip the call where there is no peer",
    "ssend": "there is no synchronous send: {on}.send returns once a small message is posted, a large one once taken",
    "issend": "there is no synchronous send: {on}.isend's wait() returns once a small message is posted",
    "Split": "use torch.distributed.new_group(ranks), then group=group in each call",
    "Create_group": "use torch.distributed.new_group(ranks), then group=group in each call",
    "waitall": "[request.wait() for request in requests]",
    "waitany": "concurrent.futures.wait([r.get_future() for r in requests], return_when=FIRST_COMPLETED)",
    "testall": "all(request.is_completed() for request in requests)",
    # mpi4py's buffer (upper-case) calls: objcomm moves objects, tensors inside them included
    **{
        name: f"objcomm moves objects: {{on}}.{ours}(...) (tensors inside them travel as tensors)"
        for name, ours in (
            ("Bcast", "broadcast"),
            ("Scatter", "scatter"),
            ("Gather", "gather"),
            ("Allgather", "all_gather"),
            ("Alltoall", "all_to_all"),
            ("Reduce", "reduce"),
            ("Allreduce", "all_reduce"),
            ("Send", "send"),
            ("Recv", "recv"),
            ("Isend", "isend"),
            ("Irecv", "irecv"),
        )
    },
}

F = TypeVar("F", bound=Callable[..., Any])


def keyword_hint(name: str, params: Sequence[str], function: str) -> Optional[str]:
    """What to say about keyword ``name``, which ``function`` (with parameters ``params``) does not take; None:
    nothing better than Python's own message."""
    for meant in MPI4PY_KEYWORDS.get(name, ()):
        if meant == "return_sender" and meant in params:
            return "did you mean return_sender=True? It returns (sender's global rank, obj)" + FROM_MPI4PY
        if meant in params:
            return f"did you mean {meant}=?" + FROM_MPI4PY
    if name == "root":
        return f"{function}() has no root: every rank takes part and gets the result" + FROM_MPI4PY
    if name == "buf":
        return "objcomm allocates what it receives: leave buf out" + FROM_MPI4PY
    close = difflib.get_close_matches(name, [p for p in params if p != "self"], n=1, cutoff=0.8)
    return f"did you mean {close[0]}=?" if close else None


def mpi4py_keywords(fn: F) -> F:
    """``fn``, whose unexpected keyword arguments (mpi4py's ``dest=``, ``source=``, ``root=``, a misspelt one) raise a
    TypeError that says what to write instead. A call that binds pays nothing but this frame: the names are looked at
    only once Python refused them."""
    params = tuple(inspect.signature(fn).parameters)
    function = fn.__qualname__

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TypeError:
            unknown = [key for key in kwargs if key not in params]  # none: the TypeError came from inside fn
            hint = keyword_hint(unknown[0], params, function) if unknown else None
            if hint is None:
                raise
            raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}; {hint}") from None

    return cast(F, checked)


def no_attribute(owner: str, on: str, name: str) -> AttributeError:
    """The AttributeError for ``name``, which ``owner`` (``"module 'objcomm'"``) lacks: for mpi4py's names, it says
    what to write instead (``on``: what the calls are made on, ``"objcomm"`` or ``"Communicator"``)."""
    hint = MPI4PY_NAMES.get(name)
    message = f"{owner} has no attribute {name!r}"
    if hint is not None:
        message += "; " + hint.format(on=on) + FROM_MPI4PY
    return AttributeError(message)


def named_op(op: Any) -> Any:
    """``op``, with a named op spelt in another case (``"SUM"``, ``"Max"``: mpi4py's ``MPI.SUM`` written as a string) as
    objcomm names it, so that every rank reduces with the same function whatever case each wrote."""
    if type(op) is str and op not in _reduce.NAMED_OPS:
        lower = op.lower()
        if lower in _reduce.NAMED_OPS:
            return lower
    return op
