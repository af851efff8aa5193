"""Which Python types each serializer round-trips exactly, converts, or refuses.

The table is measured, not declared: every probe value is encoded and decoded for real, and
:func:`judge` (which ``objcomm bench`` uses too) says what came back.

>>> fidelity("json")["tuple"].verdict
'converted'
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import sys
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

from serializers._errors import ObjcommError
from serializers._protocol import SerializerProtocol
from serializers._registry import SerializerLike, registry

_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


@dataclass(frozen=True)
class Point:
    """A user-defined class, importable, for the 'class instance' probe."""

    x: int
    y: int


@dataclass(frozen=True)
class Verdict:
    """One cell of the table: ``exact``, ``converted`` (to ``note``), ``lossy`` or ``refused``."""

    verdict: str
    note: str = ""

    def __str__(self) -> str:
        return f"{self.verdict} ({self.note})" if self.note else self.verdict


def judge(sent: Any, got: Any) -> Tuple[str, str]:
    """Judge a round trip: ``("exact", "")``, ``("converted", what)`` if only types changed, else ``("lossy", where)``.

    ``what`` and ``where`` name the first difference (``"tuple → list at $['a']"``). The one judge
    for :func:`fidelity` and ``objcomm bench``: arrays and tensors compare by dtype, shape (and
    device) and values, and NaN equals NaN.
    """
    difference = _difference(sent, got, "$")
    if difference is None:
        return "exact", ""
    return ("converted" if _loosely_equal(sent, got) else "lossy"), difference


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down."""
    return _difference(a, b, "$") is None


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only where torch was imported: never import it here
    return torch is not None and isinstance(value, torch.Tensor)


def _plain(value: Any) -> str:
    return str(tuple(value)) if type(value).__name__ == "Size" else str(value).replace("torch.", "")


def _tensors_equal(a: Any, b: Any) -> bool:
    torch = sys.modules["torch"]
    return bool(a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b))


def _same_scalar_types(a: Any, b: Any) -> bool:
    """Whether two iterables hold scalars only, of the same types in the same order (at C speed)."""
    types = list(map(type, a))
    return types == list(map(type, b)) and _SCALARS.issuperset(types)


def _difference(a: Any, b: Any, path: Any) -> Optional[str]:
    """Where ``b`` first differs from ``a`` in type or value (``None``: exactly the same). ``path``: ``"$"``, or a
    ``(parent path, key)`` pair, made into text only where something differs (a path built at every level would
    cost as much as the keys are long, at every level)."""
    if type(a) is not type(b):
        return f"{type(a).__name__} → {type(b).__name__} at {_where(path)}"
    if _is_tensor(a):
        if _tensors_equal(a, b):
            return None
        for what in ("dtype", "shape", "device"):
            if getattr(a, what) != getattr(b, what):
                return f"tensor {what} {_plain(getattr(a, what))} → {_plain(getattr(b, what))} at {_where(path)}"
        return f"tensor values changed at {_where(path)}"
    if isinstance(a, dict):
        if list(a) != list(b) or list(map(type, a)) != list(map(type, b)):  # keys, and their types (an IntEnum → int)
            return f"keys changed at {_where(path)}"
        if _same_scalar_types(a, b) and _same_scalar_types(a.values(), b.values()) and a == b:
            return None  # a fast path for flat dicts; NaN values fall through to the slow one
        for key in a:
            found = _difference(a[key], b[key], (path, key))
            if found is not None:
                return found
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"length {len(a)} → {len(b)} at {_where(path)}"
        if _same_scalar_types(a, b) and a == b:
            return None
        for index, (x, y) in enumerate(zip(a, b)):
            found = _difference(x, y, (path, index))
            if found is not None:
                return found
        return None
    if isinstance(a, (set, frozenset)):  # members, and their types ({1} == {True})
        return None if {(type(x), x) for x in a} == {(type(y), y) for y in b} else f"members changed at {_where(path)}"
    return None if _same_leaf(a, b) else f"value changed at {_where(path)}"


def _where(path: Any) -> str:
    """``$['a'][0]`` from ``(("$", "a"), 0)``."""
    keys = []
    while isinstance(path, tuple):
        path, key = path
        keys.append(f"[{key!r}]" if not isinstance(key, int) or isinstance(key, bool) else f"[{key}]")
    return cast(str, path) + "".join(reversed(keys))  # the root's name


def _same_leaf(a: Any, b: Any) -> bool:
    """Two values of one type, not containers: equal (NaN equals NaN, arrays by dtype, shape and data)."""
    if type(a).__module__ == "numpy":
        import numpy as np

        return bool(a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (_dt.datetime, _dt.time)):  # aware ones compare equal across time zones: the zone must match
        # too, its kind and name (timezone's == ignores the name), and fold (== ignores it: msgpack lost both)
        same_zone = type(a.tzinfo) is type(b.tzinfo) and a.tzinfo == b.tzinfo and a.tzname() == b.tzname()
        return bool(a == b and same_zone and a.fold == b.fold)
    if isinstance(a, types.FunctionType):  # never called: the same code, defaults and captured values
        return bool(a.__code__ == b.__code__ and a.__defaults__ == b.__defaults__ and _cells(a) == _cells(b))
    return bool(a == b)


def _cells(fn: Any) -> List[Any]:
    """What a function's closure holds."""
    return [c.cell_contents for c in fn.__closure__ or ()]


def _loosely_equal(a: Any, b: Any) -> bool:
    """Equal values, allowing container types to change (tuple → list, set → list, OrderedDict → dict, a dataclass
    → a dict of its fields)."""
    if _is_tensor(a) or _is_tensor(b):
        return _is_tensor(a) and _is_tensor(b) and bool((a.shape == b.shape) and (a == b).all())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_loosely_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_loosely_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, (set, frozenset)) and isinstance(b, (list, tuple)):  # the same items, in some order
        return len(a) == len(b) and all(_loosely_equal(x, y) for x, y in zip(sorted(a, key=repr), sorted(b, key=repr)))
    if _is_dataclass_instance(a) and isinstance(b, dict):  # its fields, by name
        return _loosely_equal({f.name: getattr(a, f.name) for f in dataclasses.fields(a)}, b)
    if type(a).__module__ == "numpy" or type(b).__module__ == "numpy":
        import numpy as np

        try:
            return bool(np.shape(a) == np.shape(b) and np.array_equal(a, b))
        except TypeError:  # values numpy will not compare (a structured array with bare bytes): not equal
            return False
    try:
        return bool(a == b)
    except Exception:
        return False


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _numpy_array() -> Any:
    import numpy as np

    return np.arange(6, dtype=np.float32).reshape(2, 3)


# (label, factory) pairs; factories so numpy is imported only when the table is asked for.
PROBES: List[Tuple[str, Callable[[], Any]]] = [
    ("None", lambda: None),
    ("bool", lambda: True),
    ("int", lambda: -42),
    ("int beyond 64 bits", lambda: 2**80),
    ("float", lambda: 0.1),
    ("float nan/inf", lambda: float("inf")),
    ("complex", lambda: 1 + 2j),
    ("str", lambda: "héllo ✓"),
    ("bytes", lambda: b"\x00\xff"),
    ("bytearray", lambda: bytearray(b"ab")),
    ("list", lambda: [1, "a", None]),
    ("tuple", lambda: (1, "a")),
    ("dict, str keys", lambda: {"a": 1, "b": [2]}),
    ("dict, int keys", lambda: {0: 1, 2: 1}),
    ("set", lambda: {1, 2, 3}),
    ("frozenset", lambda: frozenset({1, 2})),
    ("OrderedDict", lambda: OrderedDict([("b", 1), ("a", 2)])),
    ("datetime", lambda: _dt.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=_dt.timezone.utc)),
    ("numpy.ndarray", _numpy_array),
    ("class instance", lambda: Point(1, 2)),
    ("lambda", lambda: lambda x: x + 1),
]


def probe(serializer: SerializerProtocol, value: Any) -> Verdict:
    """Round-trip ``value`` through ``serializer`` and :func:`judge` the result."""
    try:
        choose = getattr(serializer, "choose", None)  # "auto": the serializer it picks for this value
        if choose is not None:
            serializer = registry.guarded(choose(value))
        back = serializer.loads(serializer.dumps(value))
    except ObjcommError:
        return Verdict("refused")
    except Exception as exc:  # a user serializer raising its own errors
        return Verdict("refused", type(exc).__name__)
    verdict, note = judge(value, back)
    return Verdict(verdict, note.removesuffix(" at $"))  # a table cell: "tuple → list"


def fidelity(serializer: Optional[SerializerLike] = None) -> Dict[str, Any]:
    """The measured fidelity of one serializer (``{probe: Verdict}``), or of every registered one."""
    if serializer is not None:
        s = registry.get(serializer)
        return {label: probe(s, make()) for label, make in PROBES}
    return {name: fidelity(name) for name in registry.available()}


def fidelity_table(names: Optional[List[str]] = None) -> str:
    """The fidelity of ``names`` (default: every registered serializer) as a Markdown table."""
    names = names or registry.available()
    columns = {name: fidelity(name) for name in names}
    lines = ["| type | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, _ in PROBES:
        cells = [str(columns[n][label]) for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
