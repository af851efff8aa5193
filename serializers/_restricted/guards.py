"""restricted-pickle's guards: what ``find_class`` returns instead of a global (a class whose calls run a validating
constructor and are charged to the work budget), the probes of the probe pass, and the unpicklers that look globals
up through them (see the package's docstring, points 2 to 4).
"""

from __future__ import annotations

import importlib
import pickle
from sys import getsizeof
from typing import Any, Callable, Dict, Optional, Set, Tuple

from serializers import _budget, _rebuild
from serializers._pickle import EXTERNAL, external_ref
from serializers._protocol import Restore
from serializers._restricted.allowlist import (
    _MEMORY_SHIFT,
    _SPECS,
    CALL_UNITS,
    MAPPING,
    SEALED,
    SEQUENCE,
    USER,
    _why_refused,
)
from serializers._restricted.stdlib import NESTING, _refused

# -- guards and probes -------------------------------------------------------------------------


class _GuardMeta(type):
    """The type of every guard: calling a guard runs its validating constructor and charges what it built."""

    # each guard's own, from _guard()'s namespace
    _call: Callable[..., Any]
    _units: int  # None on a probe (_ProbeMeta), which never reads it
    _what: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:  # REDUCE, OBJ, INST
        built = cls._call(*args, **kwargs)
        _budget.charge(cls._units + (getsizeof(built) >> _MEMORY_SHIFT), cls._what)
        return built

    def __setstate__(cls, state: Any) -> None:  # BUILD on the global itself
        raise _refused(f"setting state on the global {cls.__name__}")


class _ProbeMeta(_GuardMeta):
    """The type of probe guards: what they build is an inert probe, charged nothing."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls._call(*args, **kwargs)


def _guard(
    label: str,
    call: Optional[Callable[..., Any]],
    newobj: Optional[Callable[..., Any]],
    factory: Any,
    units: Optional[int] = None,
) -> type:
    """A guard for ``label``; ``units``: what each call is charged besides its result's size (None: a probe's)."""

    def refuse_call(*args: Any, **kwargs: Any) -> Any:
        raise _refused(f"calling {label}")

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:  # NEWOBJ
        if newobj is None:
            raise _refused(f"creating {label} without its constructor (NEWOBJ)")
        built = newobj(*args, **kwargs)
        if units is not None:
            _budget.charge(units + (getsizeof(built) >> _MEMORY_SHIFT), f"creating {label}")
        return built

    namespace = {
        "__slots__": (),
        "__new__": __new__,
        "_call": staticmethod(call or refuse_call),
        "_factory": factory,
        "_units": units,
        "_what": f"calling {label}",
    }
    return (_ProbeMeta if units is None else _GuardMeta)(label, (), namespace)


class _Probe:
    """Stands in for every value a guard would build during the probe pass; knows only its kind."""

    __slots__ = ("kind", "cls")

    def __init__(self, kind: str, cls: Optional[type] = None) -> None:
        self.kind = kind
        self.cls = cls

    def _require(self, kind: str, opcode: str) -> None:
        if self.kind != USER and self.kind != kind:
            raise _refused(f"{opcode} on a {self.kind} value (only allowed classes take state or items)")

    def __setstate__(self, state: Any) -> None:
        self._require(USER, "BUILD")
        if self.cls is not None and getattr(self.cls, "__setstate__", None) is not None:
            return  # the allowed class decides what state it accepts
        parts = state if type(state) is tuple and len(state) == 2 else (state,)
        for part in parts:
            if part is None:
                continue
            if type(part) is not dict:
                raise _refused(f"BUILD with a {type(part).__name__} as state")
            for key in part:
                if type(key) is not str or (key.startswith("__") and key.endswith("__")):
                    raise _refused(f"BUILD setting attribute {_rebuild.brief(key)}")

    def append(self, value: Any) -> None:
        self._require(SEQUENCE, "APPEND")

    def extend(self, values: Any) -> None:
        self._require(SEQUENCE, "APPENDS")

    def __setitem__(self, key: Any, value: Any) -> None:
        self._require(MAPPING, "SETITEM")

    def add(self, value: Any) -> None:
        self._require(USER, "ADDITEMS")


RISE_UNITS = 4  # what each holder a nesting probe's rise looks at costs the load's budget (8 a payload byte)


class _NestingProbe(_Probe):
    """The probe of a deque or defaultdict (``stdlib.NESTING``): it follows how deep a chain of those, each inside
    the one before, runs, through the calls that build them and the APPEND(S) and SETITEM(S) that fill them, and
    refuses one past :data:`~serializers._budget.MAX_NESTED` before the real pass builds it (freeing a deep one
    recurses in C). A cycle of two or more deepens without end and is refused too (a deque holding itself is no
    chain)."""

    __slots__ = ("label", "depth", "parents", "load")

    def __init__(self, kind: str, label: str, holds: Any) -> None:
        self.kind, self.cls, self.label, self.depth = kind, None, label, 1
        self.parents: Any = None  # the probe that holds this one, or a list of those that do (None: none yet)
        self.load = _budget.state()
        self.load[5] += 1  # the nesting probes of this load: with one, there is none for it to hold
        if self.load[5] > 1 and holds:
            # each child looked at, as the real call's copy is: the memo lets a payload pass one long list to many
            # calls for a few bytes each (an attacker's find: 130 KB took 25 s here, before the real pass's charges)
            _budget.charge(RISE_UNITS * len(holds), label)
            self._took(holds)

    def _took(self, children: Any) -> None:
        """``children`` are now held directly: this probe, and every probe above it, is at least one deeper than each
        (each probe's depth rises at most MAX_NESTED times before it is refused)."""
        for child in children:
            if type(child) is not _NestingProbe or child is self:  # (holding itself is no chain)
                continue
            held_by = child.parents
            if held_by is None:
                child.parents = self
            elif type(held_by) is list:
                if held_by[-1] is not self:  # (in place: a copy per holder was quadratic, a reviewer's find)
                    held_by.append(self)
            elif held_by is not self:
                child.parents = [held_by, self]
            if child.depth >= self.depth:
                self._deepen(child.depth + 1)

    def _deepen(self, depth: int) -> None:
        """This probe is now ``depth`` deep: so is each holder one deeper, up the chains; each holder looked at is
        charged to the load's budget (a probe held by many rises with all of them, at most MAX_NESTED times; one held
        by the same holder many times, through the memo, was looked at as often for free: a reviewer's find)."""
        rising = [(self, depth)]
        while rising:
            probe, depth = rising.pop()
            _budget.charge(RISE_UNITS, probe.label)
            if depth <= probe.depth:
                continue
            if depth > _budget.MAX_NESTED:
                raise _budget.too_deep(probe.label)
            probe.depth = depth
            held_by = probe.parents
            if type(held_by) is list:
                rising.extend((parent, depth + 1) for parent in held_by)
            elif held_by is not None:
                rising.append((held_by, depth + 1))

    def append(self, value: Any) -> None:
        self._require(SEQUENCE, "APPEND")
        if type(value) is _NestingProbe:
            self._took((value,))

    def extend(self, values: Any) -> None:
        self._require(SEQUENCE, "APPENDS")
        if self.load[5] > 1:  # (with one, there is none for it to hold: its items go unread)
            self._took(values)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._require(MAPPING, "SETITEM")
        if type(value) is _NestingProbe:
            self._took((value,))


def _probe_guard(
    label: str, kind: str, newobj: bool, factory: Any, cls: Optional[type] = None, holds: Any = None
) -> type:
    """``holds``: for a call in ``stdlib.NESTING``, what a call with given arguments holds (its probe follows it)."""

    def make(*args: Any, **kwargs: Any) -> _Probe:
        return _Probe(kind, cls) if holds is None else _NestingProbe(kind, label, holds(*args, **kwargs))

    return _guard(label, make, make if newobj else None, factory)


_EXTERNAL_PROBE = _probe_guard("external", SEALED, False, None)


class _Guards:
    """The guards of one allow-list, real and probing, built once and reused."""

    def __init__(self, allowed: Set[Tuple[str, str]]) -> None:
        self.real: Dict[Tuple[str, str], Any] = {}
        self.probe: Dict[Tuple[str, str], Any] = {}
        for key, (call, newobj, kind, factory, units) in _SPECS.items():
            label = ".".join(key)
            self.real[key] = _guard(label, call, newobj, factory, units)
            self.probe[key] = _probe_guard(label, kind, newobj is not None, factory, holds=NESTING.get(key))
        self._allowed = allowed
        # built once: a load without restore= constructs one with C's __init__ only
        self.unpickler = _unpickler_class(self, False)
        self.probe_unpickler = _unpickler_class(self, True)

    def lookup(self, module: str, name: str, probing: bool) -> Any:
        key = (module, name)
        table = self.probe if probing else self.real
        guard = table.get(key)
        if guard is not None:
            return guard
        if module == "torch" and name in _rebuild._TORCH_DTYPES:
            return _rebuild.torch_dtype(name)  # a dtype is a plain value: no call, no state
        if key in self._allowed:
            self._add_allowed(key)
            return table[key]
        raise _refused(_why_refused(module, name))

    def _add_allowed(self, key: Tuple[str, str]) -> None:
        module, name = key
        target: Any = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
        label = ".".join(key)
        if isinstance(target, type):
            cls = target
            call, newobj = _no_guard_args(label, cls), _no_guard_args(label, lambda *a, **k: cls.__new__(cls, *a, **k))
            self.real[key] = _guard(label, call, newobj, None, CALL_UNITS)
            self.probe[key] = _probe_guard(label, USER, True, None, cls)
        else:
            self.real[key] = _guard(label, _no_guard_args(label, target), None, None, CALL_UNITS)
            self.probe[key] = _probe_guard(label, SEALED, False, None)


def _no_guard_args(label: str, call: Callable[..., Any]) -> Callable[..., Any]:
    """``call``, refusing guards (classes named by the payload) among its arguments."""

    def checked(*args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, _GuardMeta) for a in (*args, *kwargs.values())):
            raise _refused(f"passing a class or function to {label}")
        return call(*args, **kwargs)

    return checked


def _unpickler_class(guards: _Guards, probing: bool) -> type:
    """An Unpickler subclass whose ``find_class`` answers from ``guards`` (no ``restore=``)."""
    lookup = guards.lookup
    external = _EXTERNAL_PROBE if probing else external_ref

    def find_class(self: Any, module: str, name: str) -> Any:
        if (module, name) == EXTERNAL:
            return external
        return lookup(module, name, probing)

    kind = "Probing" if probing else "Guarded"
    return type(f"_{kind}Unpickler", (pickle.Unpickler,), {"__slots__": (), "find_class": find_class})


class _RestoringUnpickler(pickle.Unpickler):
    """The real pass of a load with ``restore=``: out-of-band references resolve to ``restore``."""

    def __init__(self, file: Any, guards: _Guards, restore: Restore) -> None:
        super().__init__(file)
        self._guards = guards
        self._restore = restore

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == EXTERNAL:
            return self._restore
        return self._guards.lookup(module, name, False)
