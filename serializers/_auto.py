"""``serializer="auto"``: per object, the fastest serializer that carries it exactly.

What it knows comes from ``objcomm bench`` and :func:`serializers.fidelity`:

- **JSON-like data** (:meth:`AutoSerializer.exact_leader`): msgspec encodes it two to ten times faster than
  pickle and decodes it as fast, but converts tuples, sets and class instances silently. One walk in C
  (:func:`serializers._exact_tree.carried_exactly`) says an object holds nothing it would change; such an object
  goes to msgspec, unjudged, before anything else is worked out (where msgspec is a candidate).
- **Order** (:data:`SPEED_ORDER`), for everything else: pickle first. In ``objcomm bench`` it is the fastest of
  the serializers that are exact by construction (restricted-pickle writes the same bytes and reads them a
  little slower).
- **The leader** (:data:`LEADERS`): pickle carries exactly whatever it takes and refuses the rest when encoding,
  so where it is the first candidate an object goes to it at once (:meth:`leader`), and ``auto`` costs what it
  costs. An object it refuses sends its type through the steps below. cloudpickle is not judged either (functions
  and classes by value: the judge cannot compare all it carries), though it writes a few objects pickle refuses
  as something else (a memoryview as bytes, an open file as a StringIO: docs/choosing-a-serializer.md).
- **Fidelity**: every candidate's first object of each type signature (below), but a leader's, is decoded on the
  sender and checked by the fidelity judge ``objcomm bench`` uses; after that, a serializer whose measured fidelity
  table holds only ``exact`` and ``refused`` (the pickle family) is trusted with objects of that signature. One that
  converts some types (msgpack: bytearray → bytes; msgspec, json: tuples...) is judged on every object: the cost
  of a decode and a Python walk, paid only where the faster candidates refused the object.

Candidates are the registered ones in that order (others after them, by name) that this rank may use: every one
by default; with ``safe=True``, or inside objcomm under an ``accept=`` list, only safe ones, and only those
listed. Each object goes to the first candidate that takes it; a candidate that refuses an object is tried last
for later objects of the same *type signature* (the types met in a bounded, breadth-first sample of the object),
so the probe costs one failed attempt per signature, not per value. The frame records the serializer chosen, so
receivers need nothing to know about ``auto``, and their own ``accept=`` still rules.

>>> import serializers
>>> serializers.get("auto").choose({"kernel": (3, 3)})
'pickle'
>>> serializers.AutoSerializer(safe=True).choose({"kernel": (3, 3)})
'restricted-pickle'
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
from itertools import compress
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Set, Tuple

from serializers._errors import DecodeError, EncodeError, ObjcommError
from serializers._exact_tree import carried_exactly
from serializers._protocol import Buffer, Lift, Restore, Serializer, SerializerProtocol
from serializers._registry import SerializerRegistry, registry

EXACT_LEADER = "msgspec"  # where an object holds only what it carries exactly (JSON-like data): first of all
SPEED_ORDER = ("pickle", "restricted-pickle", "cloudpickle", "msgspec", "json", "msgpack")
LEADERS = frozenset({"pickle", "cloudpickle"})  # exact or refused, and refused when encoding: never judged
SAMPLE = 128  # values of an object the type signature looks at, breadth first
KEPT = 1024  # type signatures remembered per AutoSerializer
Signature = Tuple[type, FrozenSet[type]]


def signature(obj: Any) -> Signature:
    """The object's type and the types met in its first :data:`SAMPLE` values, breadth first (in C:
    ``gc.get_referents`` expands a level of containers at once; other values, a tensor or an instance of a class,
    say what they are by their type)."""
    seen: Set[type] = set()
    level = [obj]
    count = 0
    try:
        while level and count < SAMPLE:
            level = level[: SAMPLE - count]
            count += len(level)
            kinds = list(map(type, level))
            seen.update(kinds)
            level = gc.get_referents(*compress(level, map(_OPEN.__contains__, kinds)))
        return type(obj), frozenset(seen)
    except Exception:  # a class whose metaclass cannot be hashed (or hashes by running code that raises)
        return UNSIGNED


UNSIGNED: Signature = (object, frozenset())  # the signature of objects whose types cannot be hashed
_OPEN = frozenset({dict, list, tuple, set, frozenset})  # what the sample looks into; the rest is known by its type


class AutoSerializer(Serializer):
    """Chooses per object (see the module docstring); objcomm records the serializer chosen in each frame.

    ``safe``: only serializers whose loads cannot run code; ``accept``: only these names (objcomm passes a
    call's ``accept=`` list, which implies ``safe``).
    """

    name = "auto"
    supports_external = True
    _raises_own_errors = True

    def __init__(
        self, *, safe: bool = False, accept: Optional[FrozenSet[str]] = None, registry: SerializerRegistry = registry
    ) -> None:
        self.safe = safe or accept is not None
        self.accept = accept
        self.description = (
            "per object, the fastest "
            + ("safe " if self.safe else "")
            + "serializer that carries it exactly (objcomm records the one chosen)"
        )
        self._registry = registry
        self._refused: Dict[Signature, FrozenSet[str]] = {}  # by signature: the candidates that refused one
        self._verified: Set[Tuple[Signature, str]] = set()  # a candidate gave back an object of the signature exactly
        self._trusted: Dict[Signature, SerializerProtocol] = {}  # by signature: the trusted one that took the last
        self._led_astray: Set[Any] = set()  # top-level types whose last object the leader refused (see _top)
        self._narrowed: Dict[FrozenSet[str], AutoSerializer] = {}
        self._lock = threading.Lock()
        # (registry version, candidate names then, msgspec guarded where it is one of them)
        self._known: Tuple[int, List[str], Optional[SerializerProtocol]] = (-1, [], None)

    def within(self, accept: Optional[FrozenSet[str]]) -> AutoSerializer:
        """This chooser limited to ``accept`` (None: itself), kept for the next call with the same list."""
        if accept is None:
            return self
        found = self._narrowed.get(accept)
        if found is None:
            found = self._narrowed.setdefault(accept, AutoSerializer(accept=accept, registry=self._registry))
        return found

    def exact_leader(self, obj: Any) -> Optional[SerializerProtocol]:
        """msgspec, where it is a candidate and ``obj`` holds only what it carries exactly
        (:func:`serializers._exact_tree.carried_exactly`: JSON-like data, tensors); else None. Tried before
        :meth:`leader`: on such data msgspec encodes two to ten times faster than pickle and decodes as fast."""
        fast = self._current()[2]
        if fast is None or carried_exactly is None:
            return None
        leaves, array = _leaves()
        inline = getattr(fast, "in_band_array_bytes", 0)
        return fast if carried_exactly(obj, leaves, array, inline, LIFTED_ARRAY_DTYPES) else None

    def leader(self, obj: Any) -> Optional[SerializerProtocol]:
        """The first candidate, to try before anything is worked out about ``obj``, where it is one whose loads takes
        whatever its dumps wrote, exactly (:data:`LEADERS`) and it did not refuse the last object of ``obj``'s type;
        else None. Most calls end here: auto then costs what its leader costs."""
        names = self._names()
        if not names or names[0] not in LEADERS or _top(obj) in self._led_astray:
            return None
        return self._registry.guarded(names[0])

    def leader_refused(self, obj: Any) -> None:
        """The leader refused ``obj``: objects of its type go through the signature's candidates from now on."""
        with self._lock:
            if len(self._led_astray) >= KEPT:
                self._led_astray.clear()
            self._led_astray.add(_top(obj))

    def trusted(self, obj: Any) -> Tuple[Signature, Optional[SerializerProtocol]]:
        """``obj``'s signature, and the serializer that last took an object of it and is trusted with it (exact or
        refused by its fidelity table, judged exact on one such object): the one to try first, unjudged."""
        sig = signature(obj)
        return sig, self._trusted.get(sig)

    def candidates(
        self, obj: Any, sig: Optional[Signature] = None, refused: Tuple[str, ...] = ()
    ) -> Iterator[Tuple[SerializerProtocol, bool, Callable[[bool], None]]]:
        """``(serializer, whether its result must be decoded and judged exact, what to call with the outcome)``,
        fastest first; candidates that refused an object of ``obj``'s signature before come last. A serializer
        is judged on the first object of each signature (restricted-pickle, for one, refuses what it does not
        allow only when decoding), and on every object where its fidelity table shows conversions. ``sig``:
        ``obj``'s signature where the caller has it; ``refused``: names that refused ``obj`` itself already (the
        leader, the trusted one), remembered as such and not tried again."""
        if sig is None:
            sig = signature(obj)
        for name in refused:
            self._outcome(sig, name, False)
        skip = self._refused.get(sig)
        names = [n for n in self._names() if n not in refused]
        if skip:
            names = [n for n in names if n not in skip] + [n for n in names if n in skip]
        guarded, verified = self._registry.guarded, self._verified
        for name in names:  # (a leader, exact whatever it takes, is never judged: the judge cannot compare all)
            judged = name not in LEADERS and ((sig, name) not in verified or not _exact_or_refuse(name))
            yield guarded(name), judged, functools.partial(self._outcome, sig, name)

    def choose(self, obj: Any) -> str:
        """The name of the serializer this chooser gives ``obj`` (its payload thrown away): for a look, or tests."""
        fast = self.exact_leader(obj)
        if fast is not None:
            try:
                fast.dumps(obj, lift=_lift_tensors)  # objcomm lifts tensors out of the payload, whoever encodes
                return fast.name
            except ObjcommError:
                pass
        for serializer, judged, outcome in self.candidates(obj):
            try:
                data = serializer.dumps(obj)
                took = not judged or exact(obj, serializer.loads(data))
            except ObjcommError:  # refused to encode, or to decode what it wrote (restricted-pickle)
                took = False
            outcome(took)
            if took:
                return serializer.name
        raise no_candidate(self, obj)

    def dumps(self, obj: Any, /, *, lift: Lift | None = None) -> Buffer:
        raise EncodeError(
            "serializer 'auto' chooses per object inside objcomm, which records its choice in the "
            "frame; outside objcomm, call serializers.get('auto').choose(obj) and use that serializer"
        )

    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any:
        raise DecodeError("no payload is encoded by 'auto': frames name the serializer it chose")

    def names(self) -> List[str]:
        """The serializers this chooser may pick, fastest first (msgspec leads only for what it carries exactly)."""
        return list(self._names())

    def _names(self) -> List[str]:
        """The candidates' names, fastest first."""
        return self._current()[1]

    def _current(self) -> Tuple[int, List[str], Optional[SerializerProtocol]]:
        """``(registry version, candidate names, msgspec where it leads JSON-like data)``: worked out again only when
        the registry changed."""
        version = self._registry.version
        if self._known[0] != version:
            known = self._registry.available()
            names = [n for n in SPEED_ORDER if n in known] + sorted(n for n in known if n not in SPEED_ORDER)
            usable = [
                n
                for n in names
                if (self.accept is None or n in self.accept)
                and (not self.safe or self._registry.get(n).safe)
                and not isinstance(self._registry.get(n), AutoSerializer)
            ]
            fast = (
                self._registry.guarded(EXACT_LEADER)
                if EXACT_LEADER in usable and _untyped_msgspec(self._registry.get(EXACT_LEADER))
                else None
            )
            self._known = (version, usable, fast)
        return self._known

    def _outcome(self, sig: Signature, name: str, took: bool) -> None:
        """Remember that ``name`` took (and gave back exactly) or refused an object of signature ``sig``."""
        with self._lock:
            if len(self._refused) + len(self._verified) >= KEPT:
                self._refused.clear()
                self._verified.clear()
                self._trusted.clear()
            if took:
                self._verified.add((sig, name))
                if _exact_or_refuse(name):
                    self._trusted[sig] = self._registry.guarded(name)
            elif self._trusted.get(sig) is not None and self._trusted[sig].name == name:
                del self._trusted[sig]
            else:
                self._refused[sig] = self._refused.get(sig, frozenset()) | {name}


def _leaves() -> Tuple[Tuple[type, ...], Optional[type]]:
    """What :func:`carried_exactly` takes as it is: ``torch.Tensor``, and ``numpy.ndarray`` past msgspec's
    ``in_band_array_bytes`` of a dtype in :data:`LIFTED_ARRAY_DTYPES` (objcomm lifts both out of every serializer's
    payload alike; msgspec writes other arrays in its payload, and reads small ones through Python, slower than
    pickle), once imported: serializers itself imports neither."""
    global _LEAVES
    if _LEAVES[0] == () or _LEAVES[1] is None:
        tensor = getattr(sys.modules.get("torch"), "Tensor", None)
        array = getattr(sys.modules.get("numpy"), "ndarray", None)
        _LEAVES = ((tensor,) if isinstance(tensor, type) else (), array if isinstance(array, type) else None)
    return _LEAVES


_LEAVES: Tuple[Tuple[type, ...], Optional[type]] = ((), None)
# The numpy dtypes objcomm lifts out of band (native byte order, shared with torch): objcomm._format.tensors sets
# them (lift_arrays_of); until then, and outside objcomm, no array goes to msgspec unjudged.
LIFTED_ARRAY_DTYPES: Tuple[Any, ...] = ()


def lift_arrays_of(dtypes: Tuple[Any, ...]) -> None:
    """Tell ``auto`` which numpy dtypes (the dtype objects themselves) objcomm lifts out of band."""
    global LIFTED_ARRAY_DTYPES
    LIFTED_ARRAY_DTYPES = tuple(dtypes)


def _lift_tensors(value: Any) -> Optional[int]:
    """A ``lift=`` that takes what :func:`_leaves` takes as it is, tensors, as objcomm does (its keys are not used:
    the payload is thrown away)."""
    return 0 if type(value) in _leaves()[0] else None


def _untyped_msgspec(serializer: Any) -> bool:
    """Whether ``serializer`` is the built-in msgspec backend decoding into ``Any`` (one registered under the name
    with ``replace=True`` and a type would refuse, on the receiver, what the lane sends it)."""
    from serializers._msgspec import MsgspecSerializer

    return type(serializer) is MsgspecSerializer and serializer.type is Any


def _top(obj: Any) -> Any:
    """``obj``'s type, as a key: the type where it can be hashed, else its name."""
    kind = type(obj)
    try:
        hash(kind)
    except Exception:
        return f"unhashable {kind.__qualname__}"
    return kind


_MEASURED: Dict[str, bool] = {}


def _exact_or_refuse(name: str) -> bool:
    """Whether ``name``'s measured fidelity table (:func:`serializers.fidelity`) holds only exact and refused, so that
    whatever it accepts comes back exactly; measured once per name."""
    found = _MEASURED.get(name)
    if found is None:
        from serializers._fidelity import fidelity

        found = _MEASURED[name] = all(v.verdict in ("exact", "refused") for v in fidelity(name).values())
    return found


def exact(sent: Any, got: Any) -> bool:
    """Whether ``got`` is ``sent`` exactly, by the judge ``objcomm bench`` and the fidelity table use (a comparison
    that raises, as a user class's ``__eq__`` may: not exact), with the same objects shared in the same places: a
    list held twice must come back as one list (a helper's find: msgspec, msgpack and json, judged only by value,
    gave two where step 1 had declined the object for another reason)."""
    from serializers._fidelity import judge

    try:
        return judge(sent, got)[0] == "exact" and _sharing(sent) == _sharing(got)
    except Exception:
        return False


def _sharing(obj: Any) -> List[int]:
    """For each mutable container (list, dict, set, bytearray, numpy array) met walking ``obj`` depth first in order,
    the index of the first one it is: two objects give the same list exactly where they share alike. Goes into
    lists, tuples and dicts' values, the containers whose copies a converting serializer makes (the judge checked
    the rest); each container once, so cycles end."""
    numpy = sys.modules.get("numpy")
    arrays = (numpy.ndarray,) if numpy is not None else ()
    seen: Dict[int, int] = {}
    order: List[int] = []
    stack = [obj]
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind in (list, dict, set, bytearray) or (arrays and isinstance(value, arrays)):
            first = seen.setdefault(id(value), len(seen))
            order.append(first)
            if first < len(seen) - 1:
                continue  # met before: its contents were walked then
        if kind is list or kind is tuple:
            stack.extend(reversed(value))
        elif kind is dict:
            stack.extend(reversed(list(value.values())))
    return order


def no_candidate(chooser: AutoSerializer, obj: Any) -> EncodeError:
    names = ", ".join(chooser._names()) or "none"
    return EncodeError(
        f"serializer 'auto' found no serializer that carries this {type(obj).__name__} exactly "
        f"among those it may use ({names}); name one, or register a codec with "
        "serializers.register_type()"
    )
