"""What a :class:`~objcomm.Communicator` works out for its calls (:class:`Resolving`, its base): each call's settings
resolved into a :class:`~objcomm._api.call.Call`, kept per options object and for the calls without per-call options
(with their express path), the group and wire they use, and ranks and tags checked against the group.
"""

from __future__ import annotations

import operator
import os
import weakref
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

import torch.distributed as dist

from objcomm import _state
from objcomm._api.call import WIRES_KEPT, Call, Device, Unusable, check_tag, chosen, tagged, wire_for
from objcomm._api.express import Express
from objcomm._errors import ObjcommError, also_instance_of, shown_ranks
from objcomm._samehost.segments import SEGMENTS, SegmentBook
from objcomm._settings import CallOptions, resolve, settings_state
from objcomm._transport import routes
from objcomm._transport.base import Wire
from serializers import SerializerLike, SerializerProtocol, registry

_DISTRIBUTED = dist.is_available()
_new = tuple.__new__


_UNBUILT = object()  # the express path of _defaults, before the first send/recv or collective needs it
_NEXT = object()  # the same, after one collective: the next builds it


class Hooks(NamedTuple):
    """What objcomm's own tests change in a communicator, given once to it (``Communicator(_hooks=...)``); not API.

    Example (every rank its own host, and a segment book that counts what it writes)::

        comm = objcomm.Communicator(_hooks=Hooks(separate_hosts=True, segments=Counting()))
    """

    separate_hosts: Optional[bool] = None  # True: every rank its own host; None: OBJCOMM_FORCE_SEPARATE_HOSTS
    segments: SegmentBook = SEGMENTS  # the book that writes and opens shared-memory segments
    down_tree: bool = False  # all_reduce's result back down the reduce tree on gloo too (routes.result_down_tree)
    up_tree: bool = False  # a gather's slots up a tree at any world size (routes.slots_up_tree)
    tree_radix: int = 0  # that tree's radix (0: routes.SLOT_TREE_RADIX)
    summed: bool = False  # an all_gather's slots in one all_reduce of the table on gloo too (routes.slots_summed)
    rest_tree: bool = False  # a broadcast's rest down the tree from its source on gloo too (routes.rest_down_tree;
    # off the same-host channel only: the express path's receivers do not see it)
    rest_spread: bool = False  # each part of it as a scatter, then an all_gather, where the receivers answered first
    # (routes.rest_spread)
    limits_with_slot: bool = False  # a broadcast's round 1 brings the limits on gloo too (routes.limits_with_slot)

    @property
    def forced(self) -> routes.Forced:
        """The routes these hooks force (:class:`routes.CallRoute` carries them): on every call that takes that route
        (a broadcast's ``rest_tree``, ``rest_spread`` and ``limits_with_slot`` on all_reduce's result broadcast too)."""
        return routes.Forced(
            summed=self.summed,
            up_tree=self.up_tree,
            tree_radix=self.tree_radix,
            down_tree=self.down_tree,
            rest_tree=self.rest_tree,
            rest_spread=self.rest_spread,
            limits_with_slot=self.limits_with_slot,
        )


NO_HOOKS = Hooks()


class Worked(NamedTuple):
    """What :meth:`Resolving._call` worked out for one set of options on one group, and what it was worked out
    for: kept while those are still the ones a call has (``registry``: the serializer registry's version)."""

    options: CallOptions
    registry: int
    group: Any  # a weak reference to the group (or _no_group)
    device: Any
    serializer: SerializerProtocol
    wire: Optional[Tuple[Any, ...]]  # the wire's fields less its group


class Held(NamedTuple):
    """What a communicator's calls without per-call options use (:meth:`Resolving._defaults`): the stamp it
    was worked out under (the process-wide settings, the registry's version, the group, this communicator's
    device), then the call's options, serializer, wire less its group and
    express path (``_UNBUILT``, ``_NEXT``, None or an :class:`Express`)."""

    settings: Any
    registry: int
    group: Any  # a weak reference to the group
    device: Any
    options: CallOptions
    serializer: SerializerProtocol
    wire: Tuple[Any, ...]
    express: Any


def _no_group() -> None:
    """What :meth:`Resolving._remember` holds for "no group", called like a weak reference."""
    return None


class Resolving:
    """The base of :class:`~objcomm.Communicator`: how it resolves each call (its fields are set there)."""

    group: Any
    serializer: Optional[SerializerLike]
    device: Device
    _given: Dict[str, Any]
    _hooks: Hooks  # fixed for the communicator's life: nothing kept below depends on them changing
    _calls: Dict[int, Worked]
    _held: Optional[Held]

    # -- resolution ----------------------------------------------------------------------------
    def _call(self, kwargs: Mapping[str, Any]) -> Call:
        """Resolve one call from its per-call keyword arguments (see :func:`objcomm._settings.resolve`).

        A call that gives none (most calls) takes what :meth:`_defaults` keeps, without resolving anything.
        """
        for value in kwargs.values():
            if value is not None:
                return self._given_call(kwargs)
        return self._default_call()

    def _default_call(self) -> Call:
        """:meth:`_call` for a call that gives no per-call option (most calls; a public method that checked that
        already calls this directly): what :meth:`_defaults` keeps, nothing resolved."""
        group = self._group()
        return self._held_call(self._defaults(group), group)

    def _held_call(self, held: Optional[Held], group: Any) -> Call:
        """The call of what :meth:`_defaults` gave for ``group`` (``held``; None: resolved now)."""
        if held is None:  # no group, or one that cannot be held weakly
            return self._resolved({})
        # tuple.__new__: the named tuples' own __new__ is a Python function, one more call on every call
        return _new(Call, (held.options, held.serializer, _new(Wire, (group, *held.wire))))

    def _given_call(self, kwargs: Mapping[str, Any]) -> Call:
        """:meth:`_call` for a call that gives settings. Where they fail on this rank alone (a serializer name
        registered on other ranks only, a compression library missing here, a ``max_bytes`` computed out of range),
        raising here would leave the others' operation to pair with this rank's next one: the rank takes part with
        its communicator's settings instead, carrying the failure (:class:`~objcomm._api.call.Unusable`), which
        every rank then raises (a sender's as its error report, a receiver's after the operation)."""
        try:
            return self._resolved(kwargs)
        except Exception as exc:
            try:
                fallback = self._resolved({})
            except Exception:
                raise exc from None  # the communicator's own settings fail too: nothing to take part with
            return fallback._replace(serializer=Unusable(exc))

    def _resolved(self, kwargs: Mapping[str, Any]) -> Call:
        """:meth:`_call` by resolving ``kwargs``. What follows from the options (the serializer object, the
        wire less its group) is kept per options object, as long as the registry, the group and the device are
        the ones it was worked out for; the group is held weakly, so that the default
        group can go when it is destroyed."""
        separate = self._hooks.separate_hosts
        layer = self._given if separate is None else {**self._given, "separate_hosts": separate}
        options = resolve(kwargs, layer)
        group = self._group()
        found = self._calls.get(id(options))
        if (
            found is None
            or found.options is not options
            or found.registry != registry.version
            or found.group() is not group
            or found.device is not self.device
        ):
            found = self._remember(options, group)
        wire = None if group is None or found.wire is None else _new(Wire, (group, *found.wire))
        return _new(Call, (options, found.serializer, wire))

    def _remember(self, options: CallOptions, group: Any) -> Worked:
        """What :meth:`_call` keeps for ``options`` on ``group`` (kept only where the group is weakly referable)."""
        version = registry.version  # before the lookup: a registration meanwhile then makes the entry stale
        serializer, wire = chosen(registry.guarded(options.serializer), options.accept), self._wire(options)
        try:
            held = _no_group if group is None else weakref.ref(group)
        except TypeError:
            held = None
        found = Worked(options, version, held, self.device, serializer, None if wire is None else tuple(wire)[1:])
        if held is not None:
            if len(self._calls) >= WIRES_KEPT:
                self._calls.clear()
            self._calls[id(options)] = found
        return found

    def _defaults(self, group: Any) -> Optional[Held]:
        """What a call without per-call options on ``group`` uses (:class:`Held`), kept while the process-wide
        settings, the registry, the group and this communicator's fields are the ones it was worked out for (the
        checks of :meth:`_resolved`, without resolving a call). None without a group, or for one that cannot be
        held weakly."""
        if group is None:  # first: a kept group that was collected reads as None too
            return None
        held = self._held
        if (  # (self._current(held, group), inline: every call without per-call options asks)
            held is not None
            and held.settings is settings_state()
            and held.registry == registry.version
            and held.group() is group
            and held.device is self.device
        ):
            return held
        shared = self._shared(group)  # what a communicator made alike worked out: a module-level call's is made anew
        if shared is not None and self._current(shared, group):
            # (its device equal, maybe not the same object: torch.device("cpu") given anew each call)
            self._held = shared if shared.device is self.device else shared._replace(device=self.device)
            return self._held
        stamp = (settings_state(), registry.version)  # before the work: a change meanwhile makes it stale
        call = self._resolved({})
        assert call.wire is not None
        try:
            held = Held(
                *stamp, weakref.ref(group), self.device, call.options, call.serializer, tuple(call.wire)[1:], _UNBUILT
            )
        except TypeError:
            return None
        self._hold(held, group)
        return held

    def _current(self, held: Held, group: Any) -> bool:
        """Whether ``held`` was worked out under the process-wide settings and registry of now, for ``group`` and a
        device equal to this communicator's."""
        return (
            held.settings is settings_state()
            and held.registry == registry.version
            and held.group() is group
            and (held.device is self.device or held.device == self.device)
        )

    def _shared_key(self) -> Any:
        """What makes two communicators' calls without per-call options on a group alike: the settings each was given
        and its hooks (None where one of them cannot be a key)."""
        key = (self.serializer, self.device, self._hooks, tuple(self._given.items()))
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def _shared(self, group: Any) -> Optional[Held]:
        """What :meth:`_hold` left for ``group`` under this communicator's :meth:`_shared_key`, if anything."""
        key = self._shared_key()
        return None if key is None else _state.group_facts(group).held.get(key)

    def _hold(self, held: Held, group: Any) -> None:
        """Keep ``held`` here, and for the communicators made alike on ``group`` (:meth:`_shared`): so that the one a
        module-level call on a group makes for that call finds its express path built (it took ~75 µs a small call
        on the general path, where a kept communicator took ~25)."""
        self._held = held
        key = self._shared_key()
        if key is not None:
            shared = _state.group_facts(group).held
            if len(shared) >= WIRES_KEPT:
                shared.clear()
            shared[key] = held

    def _express(self, now: bool = True) -> Optional[Express]:
        """The express path of this communicator's default-option calls (:mod:`objcomm._api.express`), or None;
        built on the first send/recv, or the second collective (``now=False``: a communicator made for one
        collective, as ``objcomm.all_gather(obj, group=...)`` makes, never pays for it)."""
        return self._express_found(now)[0]

    def _express_found(self, now: bool = True) -> Tuple[Optional[Express], Optional[Held], Any]:
        """``(`` :meth:`_express` ``, what _defaults gave, the group)``: a call the express path does not take builds
        its call from the last two (:meth:`_held_call`) without looking them up again."""
        group = self._group()
        held = self._defaults(group)
        if held is None:
            return None, held, group
        express: Optional[Express] = held.express  # or _UNBUILT, _NEXT: replaced or returned below
        if express is _UNBUILT and not now:
            self._hold(held._replace(express=_NEXT), group)
            return None, held, group
        if express is _UNBUILT or express is _NEXT:
            express = Express.of(_new(Call, (held.options, held.serializer, _new(Wire, (group, *held.wire)))))
            self._hold(held._replace(express=express), group)
        return express, held, group

    def _group(self) -> Any:
        """The group this communicator's calls use; None when torch.distributed is not initialised."""
        world = dist.group.WORLD if _DISTRIBUTED else None  # None: not initialised (dist.is_initialized())
        if world is None:
            if self.group is not None:
                raise _NOT_INITIALISED(
                    "a group was given but torch.distributed is not initialised; call init_process_group()"
                )
            for variable, launcher in _LAUNCHERS:  # a launcher started this process among others
                launched = os.environ.get(variable, "1")
                if launched.strip() not in ("", "0", "1"):
                    raise _NOT_INITIALISED(
                        f"torch.distributed is not initialised, but this process is one of {variable}={launched} "
                        f"ranks ({launcher} set it): call dist.init_process_group() first, or every call would act "
                        f"as a world of one on each rank.{'' if variable == 'WORLD_SIZE' else _MPI_HINT} (Unset "
                        f"{variable} to run a plain process.)"
                    )
            return None
        return self.group if self.group is not None else world

    def _wire(self, options: CallOptions) -> Optional[Wire]:
        group = self._group()
        return None if group is None else wire_for(group, self.device, options, self._hooks.segments)

    @staticmethod
    def _group_rank(wire: Wire, global_rank: Any, what: str, p2p: bool = False) -> int:
        try:  # an int, or what stands for one (numpy's integers), as torch takes them; never a bool
            rank = None if isinstance(global_rank, bool) else operator.index(global_rank)
        except TypeError:
            rank = None
        if rank is None:
            raise TypeError(f"{what} must be an int rank, got {global_rank!r}")
        if rank not in wire.ranks:
            hint = _rank_hint(wire, rank, what, p2p)
            raise ValueError(f"{what}={rank} is not a rank of this group (its ranks: {shown_ranks(wire.ranks)}){hint}")
        return wire.ranks.index(rank)

    def _destination(self, call: Call, dst: Any, tag: Any, op: str) -> tuple[Optional[Wire], int]:
        """``(the wire of a send to global rank dst under tag, dst's group rank)``; raises for a bad tag or dst.
        Without a process group: ``(None, 0)``, for ``dst=0``, the only rank."""
        if call.wire is None:
            check_tag(tag, op)
            self._only_rank(dst, "dst", op)
            return None, 0
        wire = tagged(call.wire, tag, op)
        return wire, self._group_rank(wire, dst, "dst", p2p=True)

    def _source(self, call: Call, src: Any, tag: Any, op: str) -> tuple[Optional[Wire], Optional[int]]:
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
        return wire, self._group_rank(wire, src, "src", p2p=True)

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
            raise ObjcommError(
                f"{op}({what}={rank}) needs an initialised process group with that rank; without one "
                "this process is the only rank, 0: call init_process_group()"
            )

    @staticmethod
    def _check_single(rank: Any, what: str) -> None:
        if rank != 0:
            raise ValueError(f"{what}={rank}, but there is no process group: the only rank is 0")


# torch raises ValueError where no process group is initialised: code catching it catches objcomm's too
_NOT_INITIALISED = also_instance_of(ObjcommError, ValueError)

# The variables launchers set to the number of processes they started: one above 1 without a process group means
# this process is one rank among several (mpiexec with objcomm ran each as a world of one, silently: a port's find).
_LAUNCHERS = (
    ("WORLD_SIZE", "a launcher such as torchrun"),
    ("PMI_SIZE", "an MPI launcher: mpiexec of MPICH or Intel MPI"),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
    ("MV2_COMM_WORLD_SIZE", "MVAPICH2's mpirun"),
)
_MPI_HINT = (  # (every launcher's but torchrun's)
    " Under an MPI launcher, give torch its rank and world size first (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT:"
    ' docs/from-mpi4py.md, "Launching"), or start the ranks with torchrun.'
)


def _rank_hint(wire: Wire, rank: int, what: str, p2p: bool) -> str:
    """What a rank outside the group may have meant: mpi4py's constants (send/recv), or a rank of the group counted
    from 0."""
    if rank < 0 and p2p:  # (-1 is PROC_NULL under MPICH and ANY_SOURCE under Open MPI; -2 the other way round)
        any_source = "; to receive from any rank pass src=None (mpi4py's ANY_SOURCE)" if what == "src" else ""
        return any_source + "; there is no PROC_NULL: skip the call where there is no peer"
    if rank < wire.size and list(wire.ranks) != list(range(wire.size)):
        meant = wire.ranks[rank]
        return f"; ranks are global ranks, as in torch.distributed: this group's rank {rank} is global rank {meant}"
    return ""
