"""The object API, :class:`Communicator`: encode, move frames and tensors, decode; failures raised on every rank alike.

This module holds its public calls (their settings, the express path, async submission); what a communicator is as a
handle (copies, pickling) is :mod:`objcomm._api.copies`, what a call works out :mod:`objcomm._api.resolving`, what it
does then :mod:`objcomm._api.operations`.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, Optional, Sequence

import torch.distributed as dist

from objcomm._api import reduce as _reduce
from objcomm._api import requests as _requests
from objcomm._api.call import Device
from objcomm._api.copies import Copies
from objcomm._api.handles import Request
from objcomm._api.mpi4py_names import mpi4py_keywords, named_op, no_attribute
from objcomm._api.point_to_point import PointToPoint
from objcomm._api.resolving import NO_HOOKS, Held, Hooks, Worked
from objcomm._errors import ObjcommError
from objcomm._samehost import channel_slots as _channel_slots
from objcomm._settings import KNOBS, call_kwargs, check, given
from objcomm._transport import call_words
from serializers import SerializerLike


class Communicator(Copies, PointToPoint):
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
    check_calls:
        Debugging: every collective first checks that each rank called the same one with the same root, reduction
        and round-shaping settings, and raises naming which ranks differ (one small collective a call).

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

    @mpi4py_keywords  # a misspelt keyword (serialiser=) gets the closest one
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
        check_calls: Optional[bool] = None,
        _hooks: Hooks = NO_HOOKS,
    ) -> None:
        if isinstance(group, (list, tuple, set, frozenset, range, int, str)):  # torch would say "unhashable type"
            if group == _NOT_A_MEMBER and type(group) is int:
                raise ObjcommError(
                    f"this rank is not a member of the group: dist.new_group gives the ranks it leaves out "
                    f"GroupMember.NON_GROUP_MEMBER ({_NOT_A_MEMBER}) in its place; call the group's collectives on its "
                    "members only (e.g. under `if group != dist.GroupMember.NON_GROUP_MEMBER:`)"
                )
            raise TypeError(
                f"group must be a process group, got {type(group).__name__} {group!r:.80}: make one from a list of "
                "ranks with dist.new_group(ranks) (on every rank), then pass it"
            )
        self.group = group
        self.serializer = serializer
        if device is not None:
            check("device", device)  # where it is given, as map_location (before: at the first call, on that rank)
        self.device = device
        scope = locals()  # the settings' own arguments, those given (a module-level call on a group makes one a call)
        self._given = given(
            map_location=map_location, **{name: scope[name] for name in KNOBS if scope[name] is not None}
        )
        self._hooks = _hooks  # objcomm's own tests only (see Hooks)
        self._calls: Dict[int, Worked] = {}  # id(options) -> what _call() worked out for them (see _remember)
        self._held: Optional[Held] = None  # what calls without per-call options use (see _defaults)

    def __repr__(self) -> str:
        return f"Communicator(group={self.group!r}, serializer={self.serializer!r}, device={self.device!r})"

    if not TYPE_CHECKING:  # type checkers keep refusing unknown attributes

        def __getattr__(self, name: str) -> Any:
            """Only for names this class lacks: mpi4py's (``bcast``, ``allreduce``, ``Get_rank``) say what to write."""
            raise no_attribute("'Communicator' object", "Communicator", name)

    # -- collectives ---------------------------------------------------------------------------
    def connect(self) -> bool:
        """Open this group's same-host channel now, with send/recv on it: a collective (every rank of the group
        calls it, with no send/recv of its in flight). Returns whether send/recv now take the channel: the same
        answer on every rank; False where its ranks are not all on one host, ``local`` is off, or without a group.

        A program whose first calls are send/recv may call it once, after ``init_process_group``, so that its first
        message takes the channel: otherwise the channel opens in the background from each rank's first call on
        the group, and send/recv take it after their first few messages (``docs/same-host.md``).

        Example::

            dist.init_process_group("gloo")
            objcomm.connect()               # every rank
            objcomm.send(obj, dst=1)        # through the same-host channel, from the first message
        """
        call = self._resolved({})
        wire = call.wire
        call_words.leave()  # (no collective of the object API: the word of none, whatever this thread called last)
        if wire is None or not isinstance(wire.slot_medium, _channel_slots.ChannelSlots):
            return False
        return wire.slot_medium.connect(wire)

    @mpi4py_keywords
    def all_gather(
        self,
        obj: Any,
        *,
        serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
        map_location: Device = None,
        compression: Optional[str] = None,
        async_op: bool = False,
    ) -> Any:
        """Every rank's object, on every rank, in group-rank order: ``[obj_0, ..., obj_{n-1}]``.
        ``async_op=True``: a :class:`~objcomm.Request` at once, as for every collective
        (:mod:`objcomm._api.requests`)."""
        if async_op:
            return self._submit("all_gather", Communicator.all_gather, obj, **call_kwargs(locals()))
        express, serialized = None, None
        if serializer is None and accept is None and max_bytes is None and map_location is None and compression is None:
            express, held, group = self._express_found(now=False)
            if express is not None:
                done, serialized = express.all_gather(obj, self._group)
                if done:
                    return serialized
            call = self._held_call(held, group)
        else:
            call = self._given_call(call_kwargs(locals()))
        return self._all_gather_call(call, obj, serialized, express)

    @mpi4py_keywords
    def gather(
        self,
        obj: Any,
        dst: int = 0,
        *,
        serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
        map_location: Device = None,
        compression: Optional[str] = None,
        async_op: bool = False,
    ) -> Any:
        """Every rank's object on global rank ``dst`` (a list in group-rank order); ``None`` elsewhere."""
        if async_op:
            return self._submit("gather", Communicator.gather, obj, dst, **call_kwargs(locals()))
        call = self._call(call_kwargs(locals()))
        return self._gather_call(call, obj, dst)

    @mpi4py_keywords
    def broadcast(
        self,
        obj: Any = None,
        src: int = 0,
        *,
        serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
        map_location: Device = None,
        compression: Optional[str] = None,
        async_op: bool = False,
    ) -> Any:
        """Global rank ``src``'s object, on every rank (``obj`` is ignored on the others)."""
        if async_op:
            return self._submit("broadcast", Communicator.broadcast, obj, src, **call_kwargs(locals()))
        express, serialized = None, None
        if serializer is None and accept is None and max_bytes is None and map_location is None and compression is None:
            express, held, group = self._express_found(now=False)
            if express is not None:
                done, serialized = express.broadcast(obj, src, self._group)
                if done:
                    return serialized
            call = self._held_call(held, group)
        else:
            call = self._given_call(call_kwargs(locals()))
        return self._broadcast_call(call, obj, src, serialized, express)

    @mpi4py_keywords
    def scatter(
        self,
        objs: Optional[Sequence[Any]] = None,
        src: int = 0,
        *,
        serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
        map_location: Device = None,
        compression: Optional[str] = None,
        async_op: bool = False,
    ) -> Any:
        """Element ``r`` of ``objs`` (given on global rank ``src``, one per group rank) on group rank ``r``."""
        if async_op:
            return self._submit("scatter", Communicator.scatter, objs, src, **call_kwargs(locals()))
        call = self._call(call_kwargs(locals()))
        return self._scatter_call(call, objs, src)

    @mpi4py_keywords
    def all_to_all(
        self,
        objs: Sequence[Any],
        *,
        serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
        map_location: Device = None,
        compression: Optional[str] = None,
        async_op: bool = False,
    ) -> Any:
        """``objs[j]`` to group rank ``j``; element ``i`` of the result came from group rank ``i``."""
        if async_op:
            return self._submit("all_to_all", Communicator.all_to_all, objs, **call_kwargs(locals()))
        call = self._call(call_kwargs(locals()))
        return self._all_to_all_call(call, objs)

    @mpi4py_keywords
    def reduce(
        self,
        obj: Any,
        op: _reduce.Op,
        dst: int = 0,
        *,
        serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
        map_location: Device = None,
        compression: Optional[str] = None,
        async_op: bool = False,
    ) -> Any:
        """Every rank's object combined with ``op`` in group-rank order, on global rank ``dst``; ``None`` elsewhere."""
        op = named_op(op)
        if async_op:
            return self._submit("reduce", Communicator.reduce, obj, op, dst, **call_kwargs(locals()))
        call = self._call(call_kwargs(locals()))
        return self._reduce_call(call, obj, op, dst)

    @mpi4py_keywords
    def all_reduce(
        self,
        obj: Any,
        op: _reduce.Op,
        *,
        serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
        map_location: Device = None,
        compression: Optional[str] = None,
        async_op: bool = False,
    ) -> Any:
        """Every rank's object combined with ``op`` in group-rank order, on every rank."""
        op = named_op(op)
        if async_op:
            return self._submit("all_reduce", Communicator.all_reduce, obj, op, **call_kwargs(locals()))
        call = self._call(call_kwargs(locals()))
        return self._all_reduce_call(call, obj, op)

    @mpi4py_keywords
    def scan(
        self,
        obj: Any,
        op: _reduce.Op,
        *,
        serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
        map_location: Device = None,
        compression: Optional[str] = None,
        async_op: bool = False,
    ) -> Any:
        """The objects of group ranks ``0 .. r`` combined with ``op`` in group-rank order, on group rank ``r``."""
        op = named_op(op)
        if async_op:
            return self._submit("scan", Communicator.scan, obj, op, **call_kwargs(locals()))
        return self._scan_call(self._call(call_kwargs(locals())), obj, op, exclusive=False)

    @mpi4py_keywords
    def exscan(
        self,
        obj: Any,
        op: _reduce.Op,
        *,
        serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
        map_location: Device = None,
        compression: Optional[str] = None,
        async_op: bool = False,
    ) -> Any:
        """The objects of group ranks ``0 .. r - 1`` combined with ``op`` in group-rank order, on group rank ``r``;
        ``None`` on group rank 0."""
        op = named_op(op)
        if async_op:
            return self._submit("exscan", Communicator.exscan, obj, op, **call_kwargs(locals()))
        return self._scan_call(self._call(call_kwargs(locals())), obj, op, exclusive=True)

    def _submit(self, op: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Request:
        """Issue ``method(<this communicator on the group's shadow>, *args, **kwargs)`` as an async collective."""
        return _requests.collective(self.group, op, lambda group: method(self._on(group), *args, **kwargs))


# what dist.new_group returns on the ranks it leaves out (-100), as objcomm.compat's shims test it
_NOT_A_MEMBER = dist.GroupMember.NON_GROUP_MEMBER if dist.is_available() else None
_SIGNATURE = inspect.signature(Communicator)
Communicator.__signature__ = _SIGNATURE.replace(  # type: ignore[attr-defined]  # help() and IDEs: no test hook shown
    parameters=[p for p in _SIGNATURE.parameters.values() if p.name != "_hooks"]
)
