"""The object API: encode, move frames and tensors, decode — failures raised on every rank alike."""

from __future__ import annotations

import copy
import functools
import operator
import weakref
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence

import torch.distributed as dist

from objcomm._api import reduce as _reduce
from objcomm._api import requests as _requests
from objcomm._api.call import (
    WIRES_KEPT,
    Call,
    Device,
    check_tag,
    chosen,
    encode_each,
    final_report,
    mpi4py_keywords,
    named_op,
    no_attribute,
    only,
    per_rank,
    tagged,
    wire_for,
)
from objcomm._api.express import NOT_TAKEN, Express
from objcomm._api.requests import Request
from objcomm._errors import ObjcommError, with_original_type
from objcomm._format import frame as _frame
from objcomm._samehost import channel_slots as _channel_slots
from objcomm._samehost.segments import SEGMENTS, SegmentBook
from objcomm._settings import CallOptions, call_kwargs, given, resolve, settings_state
from objcomm._transport import pending as _pending
from objcomm._transport import rounds as _rounds
from objcomm._transport.rounds import Outgoing
from serializers import SerializerLike, registry

_DISTRIBUTED = dist.is_available()
_new = tuple.__new__


_UNBUILT = object()  # the express path of _defaults, before the first send/recv or collective needs it
_NEXT = object()  # the same, after one collective: the next builds it


def _no_group() -> None:
    """What :meth:`Communicator._remember` holds for "no group", called like a weak reference."""
    return None


class Communicator:
    """Object collectives over one process group, holding per-group defaults.

    Parameters
    ----------
    group:
        A ``torch.distributed`` process group; ``None`` is the default group.
    serializer:
        Registered name or serializer object used when a call names none (default ``"pickle"``).
    device:
        Where byte tensors live; default: the current CUDA device for NCCL, the CPU otherwise.
    accept:
        Serializer names this rank will decode; frames naming others raise ``ContentRefusedError``.
    map_location:
        Where received tensors are placed; default: the transport device (never the sender's).
    compression:
        ``None``, ``"zstd"``, ``"lz4"`` or ``"auto"`` for what this rank sends.
    max_bytes, slot_bytes, chunk_bytes, inline_tensor_bytes:
        Size limits (see :class:`objcomm.Settings`); ``None`` uses the process-wide default.
    shm, shm_threshold, shm_dir, shm_zero_copy:
        Same-host shared memory for payloads of at least ``shm_threshold`` bytes, received as views
        unless ``shm_zero_copy=False`` (see :class:`objcomm.Settings`).
    local, local_spin_us:
        Same-host channel for the first round of collectives, and how long its waits poll before they
        sleep (see :class:`objcomm.Settings`).

    Every argument left ``None`` falls back to :func:`objcomm.configure`, then the environment, then
    the default; a call's own arguments beat these (see :mod:`objcomm._settings`). Values are checked
    here, with the same messages as :func:`objcomm.configure`.

    ``copy.copy`` and ``copy.deepcopy`` (of a model or config that holds one) give a communicator on the same
    group with the same settings; one on the default group (``group=None``) can also be pickled, e.g. to a
    spawned process, where it uses that process's default group.

    Example::

        comm = objcomm.Communicator(serializer="msgpack", accept=["msgpack"])
        everyone = comm.all_gather({"rank": rank, "loss": 0.25})
    """

    def __init__(
        self,
        group: Any = None,
        serializer: Optional[SerializerLike] = None,
        device: Device = None,
        *,
        accept: Optional[Collection[str]] = None,
        map_location: Device = None,
        compression: Optional[str] = None,
        max_bytes: Optional[int] = None,
        slot_bytes: Optional[int] = None,
        chunk_bytes: Optional[int] = None,
        inline_tensor_bytes: Optional[int] = None,
        shm: Optional[bool] = None,
        shm_threshold: Optional[int] = None,
        shm_dir: Optional[str] = None,
        shm_zero_copy: Optional[bool] = None,
        local: Optional[bool] = None,
        local_spin_us: Optional[int] = None,
    ) -> None:
        self.group = group
        self.serializer = serializer
        self.device = device
        self._given = given(
            serializer=serializer, accept=accept, map_location=map_location, compression=compression,
            max_bytes=max_bytes, slot_bytes=slot_bytes, chunk_bytes=chunk_bytes,
            inline_tensor_bytes=inline_tensor_bytes, shm=shm, shm_threshold=shm_threshold, shm_dir=shm_dir,
            shm_zero_copy=shm_zero_copy, local=local, local_spin_us=local_spin_us,
        )
        # Tests only: True treats every rank as on its own host; None follows OBJCOMM_FORCE_SEPARATE_HOSTS.
        self._separate_hosts: Optional[bool] = None
        self._segments: SegmentBook = SEGMENTS  # tests only: their own, to watch or tamper with segments
        self._calls: Dict[int, tuple] = {}  # id(options) -> what _call() worked out for them (see _remember)
        self._held: Optional[tuple] = None  # what calls without per-call options use (see _defaults)

    def __repr__(self) -> str:
        return f"Communicator(group={self.group!r}, serializer={self.serializer!r}, device={self.device!r})"

    if not TYPE_CHECKING:  # type checkers keep refusing unknown attributes

        def __getattr__(self, name: str) -> Any:
            """Only for names this class lacks: mpi4py's (``bcast``, ``allreduce``, ``Get_rank``) say what to write."""
            raise no_attribute("'Communicator' object", "Communicator", name)

    # -- copies: a handle on a group, with settings; a copy, shallow or deep, shares both and not what the
    # calls worked out (the next call works it out again); a pickle carries the settings alone -------------
    def __copy__(self) -> Communicator:
        twin = object.__new__(Communicator)
        twin.__dict__.update(self.__dict__, _calls={}, _held=None)
        return twin

    def __deepcopy__(self, memo: Dict[int, Any]) -> Communicator:
        twin = memo[id(self)] = self.__copy__()  # the settings are checked values, shared as the group is
        return twin

    def __getstate__(self) -> Dict[str, Any]:
        if self.group is not None:
            raise TypeError(
                "a Communicator on an explicit group cannot be pickled: a process group belongs to its process. "
                "Make the Communicator in the receiving process (its settings can travel: serializer=, max_bytes=, ...)"
            )
        return {**self.__dict__, "_calls": {}, "_held": None, "_segments": None}  # the receiver's own segment book

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state, _segments=SEGMENTS if state["_segments"] is None else state["_segments"])

    # -- resolution ----------------------------------------------------------------------------
    def _call(self, kwargs: Mapping[str, Any]) -> Call:
        """Resolve one call from its per-call keyword arguments (see :func:`objcomm._settings.resolve`).

        A call that gives none (most calls) takes what :meth:`_defaults` keeps, without resolving anything.
        """
        for value in kwargs.values():
            if value is not None:
                return self._resolved(kwargs)
        group = self._group()
        held = self._defaults(group)
        if held is None:  # no group, or one that cannot be held weakly
            return self._resolved(kwargs)
        # tuple.__new__: the named tuples' own __new__ is a Python function, one more call on every call
        return _new(Call, (held[6], held[7], _new(_rounds.Wire, (group, *held[8]))))

    def _resolved(self, kwargs: Mapping[str, Any]) -> Call:
        """:meth:`_call` by resolving ``kwargs``. What follows from the options (the serializer object, the
        wire less its group) is kept per options object, as long as the registry, the group, the device and
        the segment book are the ones it was worked out for; the group is held weakly, so that the default
        group can go when it is destroyed."""
        layer = self._given if self._separate_hosts is None else {**self._given, "separate_hosts": self._separate_hosts}
        options = resolve(kwargs, layer)
        group = self._group()
        found = self._calls.get(id(options))
        if (found is None or found[0] is not options or found[1] != registry.version or found[2]() is not group
                or found[3] is not self.device or found[4] is not self._segments):
            found = self._remember(options, group)
        wire = None if group is None else _new(_rounds.Wire, (group, *found[6]))
        return _new(Call, (options, found[5], wire))

    def _remember(self, options: CallOptions, group: Any) -> tuple:
        """What :meth:`_call` keeps for ``options`` on ``group`` (kept only where the group is weakly referable)."""
        version = registry.version  # before the lookup: a registration meanwhile then makes the entry stale
        serializer, wire = chosen(registry.guarded(options.serializer), options.accept), self._wire(options)
        try:
            held = _no_group if group is None else weakref.ref(group)
        except TypeError:
            held = None
        found = (options, version, held, self.device, self._segments, serializer,
                 None if wire is None else tuple(wire)[1:])
        if held is not None:
            if len(self._calls) >= WIRES_KEPT:
                self._calls.clear()
            self._calls[id(options)] = found
        return found

    def _defaults(self, group: Any) -> Optional[tuple]:
        """What a call without per-call options on ``group`` uses: ``(stamps..., options, serializer, the wire
        less its group, the express path or ``_UNBUILT``/``_NEXT``)``, kept while the process-wide settings, the
        registry, the group and this communicator's fields are the ones it was worked out for (the checks
        of :meth:`_resolved`, without resolving a call). None without a group, or for one that cannot be
        held weakly."""
        if group is None:  # first: a kept group that was collected reads as None too
            return None
        held = self._held
        if (held is not None and held[0] is settings_state() and held[1] == registry.version and held[2]() is group
                and held[3] is self.device and held[4] is self._segments and held[5] is self._separate_hosts):
            return held
        stamp = (settings_state(), registry.version)  # before the work: a change meanwhile makes it stale
        call = self._resolved({})
        assert call.wire is not None
        try:
            held = (*stamp, weakref.ref(group), self.device, self._segments, self._separate_hosts,
                    call.options, call.serializer, tuple(call.wire)[1:], _UNBUILT)
        except TypeError:
            return None
        self._held = held
        return held

    def _express(self, now: bool = True) -> Optional[Express]:
        """The express path of this communicator's default-option calls (:mod:`objcomm._api.express`), or None;
        built on the first send/recv, or the second collective (``now=False``: a communicator made for one
        collective, as ``objcomm.all_gather(obj, group=...)`` makes, never pays for it)."""
        group = self._group()
        held = self._defaults(group)
        if held is None:
            return None
        express = held[9]
        if express is _UNBUILT and not now:
            self._held = (*held[:9], _NEXT)
            return None
        if express is _UNBUILT or express is _NEXT:
            express = Express.of(_new(Call, (held[6], held[7], _new(_rounds.Wire, (group, *held[8])))))
            self._held = (*held[:9], express)
        return express

    def _group(self) -> Any:
        """The group this communicator's calls use; None when torch.distributed is not initialised."""
        world = dist.group.WORLD if _DISTRIBUTED else None  # None: not initialised (dist.is_initialized())
        if world is None:
            if self.group is not None:
                raise ObjcommError(
                    "a group was given but torch.distributed is not initialised; call init_process_group()"
                )
            return None
        return self.group if self.group is not None else world

    def _wire(self, options: CallOptions) -> Optional[_rounds.Wire]:
        group = self._group()
        return None if group is None else wire_for(group, self.device, options, self._segments)

    @staticmethod
    def _group_rank(wire: _rounds.Wire, global_rank: Any, what: str) -> int:
        try:  # an int, or what stands for one (numpy's integers), as torch takes them; never a bool
            rank = None if isinstance(global_rank, bool) else operator.index(global_rank)
        except TypeError:
            rank = None
        if rank is None:
            raise TypeError(f"{what} must be an int rank, got {global_rank!r}")
        if rank not in wire.ranks:
            raise ValueError(f"{what}={rank} is not a rank of this group (its ranks: {list(wire.ranks)})")
        return wire.ranks.index(rank)

    # -- collectives ---------------------------------------------------------------------------
    def connect(self) -> bool:
        """Open this group's same-host channel now, with send/recv on it: a collective (every rank of the group
        calls it, with no send/recv of its in flight). Returns whether send/recv now take the channel: the same
        answer on every rank; False where its ranks are not all on one host, ``local`` is off, or without a group.

        A program whose first calls are send/recv calls it once, after ``init_process_group``: otherwise the
        channel opens at the group's first collective, and send/recv before it go through the group's backend.

        Example::

            dist.init_process_group("gloo")
            objcomm.connect()               # every rank
            objcomm.send(obj, dst=1)        # through the same-host channel, from the first message
        """
        call = self._resolved({})
        wire = call.wire
        if wire is None or not isinstance(wire.first_round, _channel_slots.SameHostSlots):
            return False
        channel = wire.first_round.channel(wire, "connect")
        return bool(channel is not None and channel.p2p and not channel.closed)

    @mpi4py_keywords
    def all_gather(
        self, obj: Any, *, serializer: Optional[SerializerLike] = None, accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None, map_location: Device = None, compression: Optional[str] = None,
        async_op: bool = False,
    ) -> Any:
        """Every rank's object, on every rank, in group-rank order: ``[obj_0, ..., obj_{n-1}]``.
        ``async_op=True``: a :class:`~objcomm.Request` at once, as for every collective
        (:mod:`objcomm._api.requests`)."""
        if async_op:
            return self._submit("all_gather", Communicator.all_gather, obj, **call_kwargs(locals()))
        express, serialized = None, None
        if serializer is None and accept is None and max_bytes is None and map_location is None and compression is None:
            express = self._express(now=False)
            if express is not None:
                done, serialized = express.all_gather(obj, self._group)
                if done:
                    return serialized
        call = self._call(call_kwargs(locals()))
        if call.wire is None:
            return [call.roundtrip(obj)]
        out, local = call.encode(obj, _still(serialized, express, call))
        incoming = _rounds.all_gather(call.wire, out, _frame.tensor_sizes)
        call.raise_failures("all_gather", incoming, local)
        return [call.decode(item, r) for r, item in enumerate(incoming)]

    @mpi4py_keywords
    def gather(
        self, obj: Any, dst: int = 0, *, serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None, max_bytes: Optional[int] = None, map_location: Device = None,
        compression: Optional[str] = None, async_op: bool = False,
    ) -> Any:
        """Every rank's object on global rank ``dst`` (a list in group-rank order); ``None`` elsewhere."""
        if async_op:
            return self._submit("gather", Communicator.gather, obj, dst, **call_kwargs(locals()))
        call = self._call(call_kwargs(locals()))
        if call.wire is None:
            self._check_single(dst, "dst")
            return [call.roundtrip(obj)]
        root = self._group_rank(call.wire, dst, "dst")
        out, local = call.encode(obj)
        incoming = _rounds.gather(call.wire, out, _frame.tensor_sizes, root)
        if incoming is None:
            return None
        call.raise_failures("gather", incoming, local)
        if call.wire.rank != root:
            return None
        return [call.decode(item, r, own=r == root) for r, item in enumerate(incoming)]

    @mpi4py_keywords
    def broadcast(
        self, obj: Any = None, src: int = 0, *, serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None, max_bytes: Optional[int] = None, map_location: Device = None,
        compression: Optional[str] = None, async_op: bool = False,
    ) -> Any:
        """Global rank ``src``'s object, on every rank (``obj`` is ignored on the others)."""
        if async_op:
            return self._submit("broadcast", Communicator.broadcast, obj, src, **call_kwargs(locals()))
        express, serialized = None, None
        if serializer is None and accept is None and max_bytes is None and map_location is None and compression is None:
            express = self._express(now=False)
            if express is not None:
                done, serialized = express.broadcast(obj, src, self._group)
                if done:
                    return serialized
        call = self._call(call_kwargs(locals()))
        if call.wire is None:
            self._check_single(src, "src")
            return call.roundtrip(obj)
        root = self._group_rank(call.wire, src, "src")
        out, local = call.encode(obj, _still(serialized, express, call)) if call.wire.rank == root else (None, None)
        item = _rounds.broadcast(call.wire, out, _frame.tensor_sizes, root)
        if item.error:  # the root's error report (its own encode failure among them)
            call.raise_failures("broadcast", only(root, item, call.wire.size), local)
        return call.decode(item, root, own=call.wire.rank == root)

    @mpi4py_keywords
    def scatter(
        self, objs: Optional[Sequence[Any]] = None, src: int = 0, *, serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None, max_bytes: Optional[int] = None, map_location: Device = None,
        compression: Optional[str] = None, async_op: bool = False,
    ) -> Any:
        """Element ``r`` of ``objs`` (given on global rank ``src``, one per group rank) on group rank ``r``."""
        if async_op:
            return self._submit("scatter", Communicator.scatter, objs, src, **call_kwargs(locals()))
        call = self._call(call_kwargs(locals()))
        if call.wire is None:
            self._check_single(src, "src")
            return call.roundtrip(per_rank(objs, 1, "scatter")[0])
        wire = call.wire
        root = self._group_rank(wire, src, "src")
        outs: Optional[List[Outgoing]] = None
        local: Optional[BaseException] = None
        if wire.rank == root:
            outs, local = encode_each(call, objs, wire.size, "scatter")
        item = _rounds.scatter(wire, outs, _frame.tensor_sizes, root)
        call.raise_failures("scatter", only(root, item, wire.size), local)
        return call.decode(item, root, own=wire.rank == root)

    @mpi4py_keywords
    def all_to_all(
        self, objs: Sequence[Any], *, serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None, max_bytes: Optional[int] = None, map_location: Device = None,
        compression: Optional[str] = None, async_op: bool = False,
    ) -> Any:
        """``objs[j]`` to group rank ``j``; element ``i`` of the result came from group rank ``i``."""
        if async_op:
            return self._submit("all_to_all", Communicator.all_to_all, objs, **call_kwargs(locals()))
        call = self._call(call_kwargs(locals()))
        if call.wire is None:
            return [call.roundtrip(per_rank(objs, 1, "all_to_all")[0])]
        outs, local = encode_each(call, objs, call.wire.size, "all_to_all")
        incoming = _rounds.all_to_all(call.wire, outs, _frame.tensor_sizes)
        call.raise_failures("all_to_all", incoming, local)
        return [call.decode(item, r, own=r == call.wire.rank) for r, item in enumerate(incoming)]

    @mpi4py_keywords
    def reduce(
        self, obj: Any, op: _reduce.Op, dst: int = 0, *, serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None, max_bytes: Optional[int] = None, map_location: Device = None,
        compression: Optional[str] = None, async_op: bool = False,
    ) -> Any:
        """Every rank's object combined with ``op`` in group-rank order, on global rank ``dst``; ``None`` elsewhere."""
        op = named_op(op)
        if async_op:
            return self._submit("reduce", Communicator.reduce, obj, op, dst, **call_kwargs(locals()))
        call = self._call(call_kwargs(locals()))
        if call.wire is None:
            self._check_single(dst, "dst")
            _reduce.resolve(op)
            return call.roundtrip(obj)
        root = self._group_rank(call.wire, dst, "dst")
        value, complete, own = _reduce.tree(call, obj, op)
        out, local = final_report(call, value, complete, own, carries=root != 0)  # root 0 holds the result
        incoming = _rounds.gather(call.wire, out, _frame.tensor_sizes, root)
        if incoming is None:
            return None
        call.raise_failures("reduce", incoming, local)
        if call.wire.rank != root:
            return None
        return value if root == 0 else call.decode(incoming[0], 0)  # group rank 0 combined it: no decoding

    @mpi4py_keywords
    def all_reduce(
        self, obj: Any, op: _reduce.Op, *, serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None, max_bytes: Optional[int] = None, map_location: Device = None,
        compression: Optional[str] = None, async_op: bool = False,
    ) -> Any:
        """Every rank's object combined with ``op`` in group-rank order, on every rank."""
        op = named_op(op)
        if async_op:
            return self._submit("all_reduce", Communicator.all_reduce, obj, op, **call_kwargs(locals()))
        call = self._call(call_kwargs(locals()))
        if call.wire is None:
            _reduce.resolve(op)
            return call.roundtrip(obj)
        value, complete, own = _reduce.tree(call, obj, op)
        wire = call.wire
        out, local = final_report(call, value, complete, own) if wire.rank == 0 else (None, None)
        if out is not None and not complete and local is None:  # a rank below failed: say so to every rank
            out = _frame.error_frame(ObjcommError("a rank below group rank 0 failed"), wire.inline_capacity)
        result = _rounds.broadcast(wire, out, _frame.tensor_sizes, 0)  # group rank 0 combined it
        if result.error:  # a rank failed (rank 0 knows that much): every rank's own report, to all
            report, failed = final_report(call, None, False, own or local)
            incoming = _rounds.all_gather(wire, report, _frame.tensor_sizes)
            call.raise_failures("all_reduce", incoming, failed)
            call.raise_failures("all_reduce", only(0, result, wire.size), failed)
        return value if wire.rank == 0 else call.decode(result, 0)

    @mpi4py_keywords
    def send(
        self, obj: Any, dst: int, tag: int = 0, *, serializer: Optional[SerializerLike] = None,
        max_bytes: Optional[int] = None, compression: Optional[str] = None,
    ) -> None:
        """Send ``obj`` to global rank ``dst``, which calls :meth:`recv` with the same ``tag``.

        Messages with different tags between the same two ranks never mix. If encoding fails, the
        receiver gets the error report (and raises ``RemoteError``) and this rank raises the original
        error: nobody is left waiting. A small message (one that fits the slot: no second round) is sent
        eagerly on every path: this returns before its receiver takes it, within a bound per group
        (:mod:`objcomm._transport.pending`); a large one returns once its receiver took it. Through an NCCL group's
        backend every send waits for its receiver. ``dst`` may be this rank itself (and is, without a process
        group): the message waits here, encoded, until this rank receives it, and this returns at once.
        """
        express, serialized = None, None
        if serializer is None and max_bytes is None and compression is None:
            express = self._express()
            if express is not None:
                serialized = express.send(obj, dst, tag)
                if serialized is True:
                    return
        call = self._call(call_kwargs(locals()))
        wire, peer = self._destination(call, dst, tag, "send")
        if wire is None or peer == wire.rank:
            local = self._send_own(call, wire, obj, tag, _still(serialized, express, call))
            if local is not None:
                raise with_original_type(local)
            return
        _requests.check_blocking(wire.group, "send", dst, tag)
        out, local = call.encode(obj, _still(serialized, express, call))
        self._deliver(wire, out, local, peer)

    @staticmethod
    def _deliver(wire: _rounds.Wire, out: Outgoing, local: Optional[BaseException], peer: int,
                 eager: bool = True) -> None:
        """Send what encoding gave (``local``: its failure, whose report ``out`` is) to group rank ``peer``."""
        _pending.check(wire.group, "send")
        _rounds.send(wire, out, peer, eager)
        if local is not None:
            raise with_original_type(local)

    def _destination(self, call: Call, dst: Any, tag: Any, op: str) -> tuple[Optional[_rounds.Wire], int]:
        """``(the wire of a send to global rank dst under tag, dst's group rank)``; raises for a bad tag or dst.
        Without a process group: ``(None, 0)``, for ``dst=0``, the only rank."""
        if call.wire is None:
            check_tag(tag, op)
            self._only_rank(dst, "dst", op)
            return None, 0
        wire = tagged(call.wire, tag, op)
        return wire, self._group_rank(wire, dst, "dst")

    def _source(self, call: Call, src: Any, tag: Any, op: str) -> tuple[Optional[_rounds.Wire], Optional[int]]:
        """``(the wire of a receive from global rank src under tag, src's group rank)``: None for ``src=None`` (any
        rank), this rank's own in a group of one (and ``(None, 0)`` without a process group); raises for a bad tag or
        src."""
        if call.wire is None:
            check_tag(tag, op)
            if src is not None:
                self._only_rank(src, "src", op)
            return None, 0
        wire = tagged(call.wire, tag, op)
        if src is None:
            return wire, (wire.rank if wire.size == 1 else None)
        return wire, self._group_rank(wire, src, "src")

    # -- messages to oneself: held by objcomm._api.requests._OwnBox, encoded, until this rank receives them
    # -------------
    @staticmethod
    def _send_own(call: Call, wire: Optional[_rounds.Wire], obj: Any, tag: int,
                  serialized: Any = None) -> Optional[BaseException]:
        """Send ``obj`` to this rank itself under ``tag``: encoded as for a peer (a failure: its report, which the
        receive raises as ``RemoteError``), and owning its bytes, tensors included, so that the receiver decodes a
        copy of ``obj`` as it was now. Returns the encoding's failure, for the caller to raise."""
        if wire is not None:
            _pending.check(wire.group, "send")
        out, local = call.encode(obj, serialized)
        _requests.own_box(None if wire is None else wire.group).post(tag, _pending.captured(out))
        return local

    @mpi4py_keywords
    def recv(
        self, src: Optional[int] = None, tag: int = 0, *, accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None, map_location: Device = None, return_sender: bool = False,
    ) -> Any:
        """Receive the object global rank ``src`` sends with ``tag``; ``src=None`` takes it from any rank
        (gloo only). ``return_sender=True`` returns ``(sender's global rank, object)``.

        ``src`` may be this rank itself (and is, without a process group or with ``src=None`` in a group of one):
        the oldest message it sent itself under ``tag``; when there is none, this raises ``ObjcommError`` at once,
        since nothing could arrive while it blocks. ``src=None`` takes a message this rank sent itself, where one
        waits, before it waits for the other ranks.
        """
        if accept is None and max_bytes is None and map_location is None:
            express = self._express()
            if express is not None and (src is not None or (express.peers and not _requests.own_waiting(
                    express.facts, tag))):
                got = express.recv(src, tag, self._group)
                if got is not NOT_TAKEN:
                    return got if return_sender else got[1]
        call = self._call(call_kwargs(locals()))
        wire, peer = self._source(call, src, tag, "recv")
        if wire is not None:
            if peer is None and wire.device.type != "cpu":
                raise ValueError(
                    f"recv(src=None) needs a backend that can receive from any rank (gloo); this group moves bytes on "
                    f"{wire.device} — pass the sender's rank as src"
                )
            _requests.check_blocking(wire.group, "recv", src, tag)
            _pending.check(wire.group, "recv")
        if wire is None or peer is None or peer == wire.rank:  # this rank's own message, where one waits
            message = _requests.own_message(None if wire is None else wire.group, tag)
            if message is not _requests.NOTHING:
                return call.own(message, return_sender)
            if wire is None or peer is not None:
                raise _requests.nothing_waiting("recv", src, tag)
        sender, item, is_error = _rounds.recv(wire, peer, _frame.tensor_sizes)
        obj = call._replace(wire=wire).received(sender, item, is_error)
        return (wire.ranks[sender], obj) if return_sender else obj

    # -- non-blocking (see objcomm._api.requests) --------------------------------------------------------
    @mpi4py_keywords
    def isend(
        self, obj: Any, dst: int, tag: int = 0, *, serializer: Optional[SerializerLike] = None,
        max_bytes: Optional[int] = None, compression: Optional[str] = None,
    ) -> Request:
        """Non-blocking :meth:`send`: a :class:`~objcomm.Request` whose ``wait()`` returns ``None`` once sent.

        ``obj`` is encoded here, in the caller's thread, and what shares memory with it is copied (its tensors and
        arrays among them: :func:`objcomm._transport.pending.captured`), so it may change as soon as this returns. A bad
        ``dst`` or ``tag`` raises here, as :meth:`send` does; an object that cannot be encoded fails as there: the
        receiver gets the error report and ``wait()`` raises the original error. To this rank itself (and without a
        process group), the message is delivered here, and the handle comes back completed.
        """
        kwargs = call_kwargs(locals())
        _requests.issuable(self.group, "isend")  # raises on NCCL
        call = self._call(kwargs)
        wire, peer = self._destination(call, dst, tag, "isend")
        if wire is None or peer == wire.rank:
            local = self._send_own(call, wire, obj, tag)
            return _requests.completed("isend", functools.partial(_raise, local))
        out, local = call.encode(obj)
        out = _pending.captured(out)
        # not eager: wait() returns once the receiver took it, as before (a later blocking send on its dst and tag,
        # refused while it is outstanding, can then never overtake it)
        return _requests.point_to_point(self.group, "send", dst, tag,
                                        lambda: self._deliver(wire, out, local, peer, eager=False))

    @mpi4py_keywords
    def irecv(
        self, src: Optional[int] = None, tag: int = 0, *, accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None, map_location: Device = None, return_sender: bool = False,
    ) -> Request:
        """Non-blocking :meth:`recv`: a :class:`~objcomm.Request` whose ``wait()`` returns the object. A bad ``src``
        or ``tag`` raises here, as :meth:`recv` does. From this rank itself (and without a process group, or with
        ``src=None`` in a group of one), it completes with the oldest message this rank sent itself under ``tag``:
        one waiting now, else the next one sent (in the sending thread; ``wait(timeout)`` to wait for another
        thread's)."""
        kwargs = call_kwargs(locals())
        _requests.issuable(self.group, "irecv")  # raises on NCCL
        call = self._call(kwargs)
        wire, peer = self._source(call, src, tag, "irecv")
        if wire is None or peer == wire.rank:
            return _requests.receive_own(None if wire is None else wire.group, src, tag,
                                         lambda out: call.own(out, return_sender))
        return _requests.point_to_point(
            self.group, "recv", src, tag, lambda: self.recv(src, tag, return_sender=return_sender, **kwargs)
        )

    def _submit(self, op: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Request:
        """Issue ``method(<this communicator on the group's shadow>, *args, **kwargs)`` as an async collective."""
        return _requests.collective(self.group, op, lambda group: method(self._on(group), *args, **kwargs))

    def _on(self, group: Any) -> Communicator:
        other = copy.copy(self)  # nothing worked out: that was for this communicator's group
        other.group = group
        return other

    @staticmethod
    def _only_rank(rank: Any, what: str, op: str) -> None:
        """Raise unless ``rank`` is 0, the only rank there is without a process group."""
        try:  # as _group_rank judges it
            index = None if isinstance(rank, bool) else operator.index(rank)
        except TypeError:
            index = None
        if index is None:
            raise TypeError(f"{what} must be an int rank, got {rank!r}")
        if index != 0:
            raise ObjcommError(f"{op}({what}={rank}) needs an initialised process group with that rank; without one "
                               "this process is the only rank, 0: call init_process_group()")

    @staticmethod
    def _check_single(rank: Any, what: str) -> None:
        if rank != 0:
            raise ValueError(f"{what}={rank}, but there is no process group: the only rank is 0")


def _raise(error: Optional[BaseException]) -> None:
    if error is not None:
        raise with_original_type(error)


def _still(serialized: Any, express: Optional[Express], call: Call) -> Any:
    """What the express path serialized, for the general path to encode, unless the settings changed
    meanwhile (another thread): then None, to serialize again."""
    return None if express is None or call.serializer is not express.call.serializer else serialized
