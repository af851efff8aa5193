"""restricted-pickle: pickle whose payloads can name only vetted constructors, whatever the bytes say.

How a hostile payload is kept harmless (``docs/security.md`` states the guarantee):

1. **The opcode scan** (``_pickle_scan.scan``) runs pickle's stack machine on summaries of the
   values: it checks every declared length, memo index and text number against the bytes present,
   bounds tuple nesting and hashing work, keeps globals out of values, and refuses opcodes objcomm
   never writes — before the C unpickler allocates or hashes anything. Plain data (no global,
   call or state; tuples only of the scalars just before them) is recognised first by a fast walk
   (``_pickle_plain``; in C where it was built), which checks the one rule such a payload can break:
   declared lengths. Such a payload is loaded by ``pickle.loads`` in a namespace whose
   ``__import__`` refuses (``_plain_load``: the backstop should the fast walk ever be wrong, as the C
   unpickler imports every global it looks up by name), so no constructor runs in it.
2. **Guards, not globals.** ``find_class`` never imports or returns what the payload names. It
   returns a *guard*: a class (so NEWOBJ accepts it) whose metaclass routes a call (REDUCE, OBJ,
   INST) to a validating constructor, whose ``__new__`` routes NEWOBJ likewise, and whose
   ``__setstate__`` refuses BUILD on the global itself. Constructors take only values built from
   the payload (lists, tuples, dicts, bytes) and bound every size by them: ``bytearray(10**9)``,
   ``set(range(10**9))`` or ``Fraction("1e30000000")`` are refused. Pickle's memo lets a payload
   pass one value to many calls for a few bytes each, so no call is paid for by its arguments'
   size: each is charged to a budget proportional to the payload (``WORK_PER_BYTE``) what it costs,
   whatever its arguments: the guard charges its fixed cost (``units`` in ``_SPECS``) and the size
   of what it returned, the constructor what it copies, hashes or builds beyond that (a structured
   dtype's fields). stdlib types are built by ``_stdlib_rebuild``; numpy and torch values are
   rebuilt by ``_rebuild`` from dtype, shape and the bytes present; numpy's and torch's own
   reconstructors are never reachable. The allow-list is checked before any import.
3. **The probe pass.** BUILD (``__setstate__`` or attribute updates) is allowed only on instances
   of classes the user allowed, APPEND/SETITEM only on the containers that take them. When one of
   those opcodes acts on anything but a list, dict or set the payload's own opcodes built (which
   the scan's model of pickle's stack and memo tells exactly, ``_pickle_scan._target``), the
   payload is first run through the C unpickler with every guard returning an inert *probe* that
   knows only what kind of value it stands for; a BUILD, APPEND or SETITEM on a probe of the wrong
   kind refuses the payload. Pickle is straight-line code, so the real pass that follows applies
   BUILD only where the probe pass allowed it. Both passes run at C speed.
4. **Classes travel only as constructors.** The scan refuses a global used as anything but a
   callable or a direct argument of a call; guards refuse guards as arguments (but for a
   defaultdict's factory).
"""

from __future__ import annotations

import collections
import datetime
import importlib
import io
import pickle
import types
from io import BytesIO
from sys import getsizeof
from typing import Any, Callable, Dict, Iterable, Optional, Set, Tuple, Union

from serializers import _rebuild
from serializers._errors import ContentRefusedError, DecodeError, ObjcommError, decode_error
from serializers._pickle import EXTERNAL, PROTOCOL, PickleSerializer, external_ref
from serializers._protocol import Buffer, Restore
from serializers._restricted.plain import is_plain, is_plain_python
from serializers._restricted.scan import ScanError, full_walk, full_walk_python
from serializers._restricted.stdlib import (
    _bytearray,
    _collection,
    _complex,
    _counter,
    _datetime,
    _decimal,
    _defaultdict,
    _deque,
    _fraction,
    _frozenset,
    _ints_or_none,
    _no_args,
    _object,
    _odict,
    _refused,
)

SEALED, MAPPING, SEQUENCE, USER = "sealed", "mapping", "sequence", "user"
# The work constructors may do, in units per payload byte. A unit is about one byte copied, eight
# bytes of memory built or 20 ns of CPU (a tuple element hashed: 8), so what constructors build stays
# within 256 bytes and a few µs per payload byte (the bounds docs/security.md states and
# tests/test_restricted_constructor_work.py enforces for every constructor below).
WORK_PER_BYTE = 32
_WORK_FLOOR = 1 << 20
_MEMORY_SHIFT = 3  # a call is charged the size of what it returns, at a unit per 8 bytes
CALL_UNITS = 64  # a call of a class or function allowed with ``allow`` (about 1 µs)


# -- the allow-list: what each named global builds (stdlib types: ``_stdlib_rebuild``) ----------


def _torch_size(sizes: Any = ()) -> Any:
    import torch

    # a tuple only: hashing a Size hashes every size again, each use as a key (the walk charges that for
    # a tuple's items, not for a list's)
    if type(sizes) is not tuple or any(type(s) is not int or not 0 <= s < 2**63 for s in sizes):
        raise _refused("torch.Size() of anything but a tuple of sizes")
    _rebuild.charge(8 * len(sizes), "torch.Size")
    return torch.Size(sizes)


def _torch_device(kind: Any, index: Any = None) -> Any:
    import torch

    if type(kind) is not str or len(kind) > 32 or (index is not None and (type(index) is not int or index < 0)):
        raise _refused("torch.device() of anything but a short name and an index")
    device = torch.device(kind) if index is None else torch.device(kind, index)
    if index is not None and device.index != index:
        raise _refused(f"torch.device index {_rebuild.brief(index)}")
    return device


# (module, name) -> (call, NEWOBJ, kind of the result, the real class for defaultdict factories,
# units: what each call is charged besides the size of its result and what the constructor charges
# itself; its CPU at the least, at about 20 ns a unit, measured by tests/test_restricted_constructor_work.py)
_Spec = Tuple[Optional[Callable[..., Any]], Optional[Callable[..., Any]], str, Optional[type], int]
_SPECS: Dict[Tuple[str, str], _Spec] = {
    ("builtins", "set"): (_collection(set), None, SEALED, set, 32),
    ("builtins", "frozenset"): (_frozenset, None, SEALED, frozenset, 32),
    ("builtins", "complex"): (_complex, None, SEALED, complex, 32),
    ("builtins", "bytearray"): (_bytearray, None, SEALED, bytearray, 32),
    ("builtins", "slice"): (_ints_or_none("slice", slice, 3), None, SEALED, None, 32),
    ("builtins", "range"): (_ints_or_none("range", range, 3), None, SEALED, None, 32),
    ("builtins", "object"): (_object, _object, SEALED, object, 32),
    **{("builtins", t.__name__): (_no_args(t), None, SEALED, t, 32)
       for t in (list, dict, tuple, int, float, str, bytes, bool)},
    ("collections", "OrderedDict"): (_odict, None, MAPPING, collections.OrderedDict, 64),
    ("collections", "Counter"): (_counter, None, MAPPING, collections.Counter, 192),
    ("collections", "defaultdict"): (_defaultdict, None, MAPPING, None, 64),
    ("collections", "deque"): (_deque, None, SEQUENCE, collections.deque, 32),
    **{("datetime", t.__name__): (_datetime(t), None, SEALED, None, 256)
       for t in (datetime.datetime, datetime.date, datetime.time, datetime.timedelta, datetime.timezone)},
    ("decimal", "Decimal"): (_decimal, None, SEALED, None, 64),
    ("fractions", "Fraction"): (_fraction, None, SEALED, None, 192),
    ("torch", "Size"): (_torch_size, None, SEALED, None, 64),
    ("torch", "device"): (_torch_device, None, SEALED, None, 64),
    **{("serializers._rebuild", f.__name__): (f, None, SEALED, None, units)
       for f, units in ((_rebuild.ndarray, 256), (_rebuild.numpy_scalar, 256), (_rebuild.numpy_dtype, 64),
                        (_rebuild.tensor, 512), (_rebuild.parameter, 384), (_rebuild.uuid, 128))},
}
_NUMPY_OWN = {"_reconstruct", "scalar", "_frombuffer", "ndarray", "dtype"}


# -- guards and probes -------------------------------------------------------------------------


class _GuardMeta(type):
    """The type of every guard: calling a guard runs its validating constructor and charges what it built."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:  # REDUCE, OBJ, INST
        built = cls._call(*args, **kwargs)  # type: ignore[attr-defined]
        _rebuild.charge(cls._units + (getsizeof(built) >> _MEMORY_SHIFT), cls._what)  # type: ignore[attr-defined]
        return built

    def __setstate__(cls, state: Any) -> None:  # BUILD on the global itself
        raise _refused(f"setting state on the global {cls.__name__}")


class _ProbeMeta(_GuardMeta):
    """The type of probe guards: what they build is an inert probe, charged nothing."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls._call(*args, **kwargs)  # type: ignore[attr-defined]


def _guard(
    label: str, call: Optional[Callable[..., Any]], newobj: Optional[Callable[..., Any]], factory: Any,
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
            _rebuild.charge(units + (getsizeof(built) >> _MEMORY_SHIFT), f"creating {label}")
        return built

    namespace = {"__slots__": (), "__new__": __new__, "_call": staticmethod(call or refuse_call), "_factory": factory,
                 "_units": units, "_what": f"calling {label}"}
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


def _probe_guard(label: str, kind: str, newobj: bool, factory: Any, cls: Optional[type] = None) -> type:
    def make(*args: Any, **kwargs: Any) -> _Probe:
        return _Probe(kind, cls)

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
            self.probe[key] = _probe_guard(label, kind, newobj is not None, factory)
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


def _why_refused(module: str, name: str) -> str:
    where = f"global {module}.{name}"
    if module.split(".")[0] == "numpy" and name in _NUMPY_OWN or module.startswith("torch") and "rebuild" in name:
        return (
            f"{where}: numpy's and torch's own reconstructors can forge memory; restricted-pickle decodes arrays "
            "and tensors only in the form its own encoder writes (serializers._rebuild)"
        )
    return (
        f"to load {where}: it is not on the allow-list. If you trust it, allow it with "
        f"serializers.get('restricted-pickle').allow('{module}.{name}')"
    )


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


def _refuse_import(name: str, *args: Any, **kwargs: Any) -> Any:
    raise _refused(f"importing {name} for a payload the fast walk showed plain")


def _plain_load(raw: bytes) -> Any:
    return _loads(raw)  # type: ignore[name-defined]  # noqa: F821 - from the namespace given below


# The load of a payload the fast walk showed plain: ``pickle.loads`` over the bytes (no file, no
# Unpickler object), called from a function whose builtins hold only an ``__import__`` that refuses.
# The C unpickler resolves every global it looks up by name through ``PyImport_Import``, which calls
# the ``__import__`` of the calling frame's builtins: should the fast walk ever be wrong, a global
# in a "plain" payload is refused before anything is imported or looked up (the backstop), so no
# constructor runs in a plain load, which is why it needs no work budget. (Not so an extension code
# an application registered with ``copyreg`` and loaded once: answered from copyreg's cache. Neither
# walk accepts EXT1/2/4.) ``pickle.loads`` over bytes reads a FRAME's contents as the opcodes
# after it, which parses alike: the fast walk showed every frame begins and ends between opcodes. Checked at
# import (``_backstop_holds``): where a Python resolved a global another way, plain payloads load
# through ``_PlainUnpickler``, whose ``find_class`` refuses.
_plain_load = types.FunctionType(
    _plain_load.__code__, {"__builtins__": {"__import__": _refuse_import}, "_loads": pickle.loads}, "_plain_load"
)


class _PlainUnpickler(pickle.Unpickler):
    """The load of a plain payload where :func:`_plain_load`'s backstop does not hold: it refuses every global."""

    __slots__ = ()

    def find_class(self, module: str, name: str) -> Any:
        raise _refused(f"the global {module}.{name} in a payload the fast walk showed plain")


def _backstop_holds() -> bool:
    try:
        _plain_load(pickle.dumps(len, protocol=PROTOCOL))
    except ContentRefusedError:
        return True
    return False  # pragma: no cover - a Python whose unpickler resolves globals without __import__


if not _backstop_holds():  # pragma: no cover
    _plain_load = lambda raw: _PlainUnpickler(BytesIO(raw)).load()  # noqa: E731


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


# -- the serializer ----------------------------------------------------------------------------


class _SafePickler(pickle.Pickler):
    """Writes numpy, torch and UUID values as calls to ``serializers._rebuild``."""

    def reducer_override(self, obj: Any) -> Any:
        reduced = _rebuild.reduce_any(obj)
        return NotImplemented if reduced is None else reduced


class python_walks:
    """Inside ``with python_walks():``, restricted-pickle runs both walks in pure Python, as an install
    without a compiler does (for tests and benchmarks; it swaps this module's globals, so not for
    threads that decode meanwhile)."""

    def __enter__(self) -> None:
        global is_plain, full_walk
        self._saved = is_plain, full_walk
        is_plain, full_walk = is_plain_python, full_walk_python

    def __exit__(self, *exc: Any) -> None:
        global is_plain, full_walk
        is_plain, full_walk = self._saved


_BASE_ALLOWED: Set[Tuple[str, str]] = set()


class RestrictedPickleSerializer(PickleSerializer):
    """Pickle whose loads builds only vetted types, so no payload can run code or forge memory.

    Built: builtin containers and scalars, ``collections``/``datetime``/``decimal``/``fractions``
    types, numpy arrays and scalars, dense torch tensors and Parameters, UUIDs, plus what you allow::

        serializers.get("restricted-pickle").allow(MyRecord, "mypkg.types.Other")

    Allowing a class lets a payload create instances with any attribute values (and call the class
    with any arguments): allow only classes that are harmless whatever their fields hold.
    """

    name = "restricted-pickle"
    safe = True
    description = "pickle whose loads only builds vetted types (containers, numpy, torch, yours); no code runs"
    _raises_own_errors = True
    hint = "restricted-pickle carries builtins, numpy, dense tensors and allowed classes; pickle carries more"
    _reusable = True  # _SafePickler keeps no state between pickles but its memo

    def __init__(self) -> None:
        self._allowed: Set[Tuple[str, str]] = set(_BASE_ALLOWED)
        self._guards = _Guards(self._allowed)

    def _pickler_base(self) -> type:
        return _SafePickler

    def _dumps_plain(self, obj: Any) -> Buffer:
        file = io.BytesIO()
        _SafePickler(file, protocol=PROTOCOL).dump(obj)
        return file.getbuffer()

    def allow(self, *globals_: Union[type, str]) -> None:
        """Allow classes (or ``"module.Name"`` strings) to be loaded."""
        for item in globals_:
            if isinstance(item, str):
                module, _, name = item.rpartition(".")
                if not module:
                    raise ValueError(f"expected 'module.Name', got {item!r}")
            else:
                module, name = item.__module__, item.__qualname__
            self._allowed.add((module, name))
        self._guards = _Guards(self._allowed)

    def allowed(self) -> Iterable[str]:
        """Everything a payload may name, as ``module.Name`` strings, sorted."""
        return sorted({f"{m}.{n}" for m, n in (*_SPECS, *self._allowed)})

    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any:
        try:
            raw = data if type(data) is bytes else bytes(data)
            plain = is_plain(raw)
            needs_probe = not plain and full_walk(raw)
        except Exception as exc:
            if isinstance(exc, ScanError) and "class or function" in str(exc):
                raise ContentRefusedError(f"{self.name} refused the payload: {exc}; nothing was run") from None
            raise DecodeError(f"{self.name} refused a malformed payload: {type(exc).__name__}: {exc}") from None
        if plain:
            # No global, call or state: the plain load refuses every global, so no constructor runs
            # (no work budget is needed) and no out-of-band reference can occur (restore unused).
            try:
                return _plain_load(raw)
            except ObjcommError:
                raise
            except Exception as exc:
                raise decode_error(self.name, data, exc) from exc
        guards = self._guards
        # What ``with decoding(...), work_budget(...)`` does, without two context managers per load.
        # BytesIO over bytes shares them: neither pass copies the payload again.
        outer = _rebuild.start_budget(WORK_PER_BYTE * len(raw) + _WORK_FLOOR)
        try:
            if needs_probe:
                guards.probe_unpickler(io.BytesIO(raw)).load()
            if restore is None:
                return guards.unpickler(io.BytesIO(raw)).load()
            return _RestoringUnpickler(io.BytesIO(raw), guards, restore).load()
        except ObjcommError:
            raise
        except Exception as exc:
            raise decode_error(self.name, data, exc) from exc
        finally:
            _rebuild.end_budget(outer)
