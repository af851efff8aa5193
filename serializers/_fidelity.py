"""Which Python types each serializer round-trips exactly, converts, or refuses.

The table is measured, not declared: every probe value is encoded and decoded for real.

>>> fidelity("json")["tuple"].verdict
'converted'
"""

from __future__ import annotations

import datetime as _dt
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._errors import ObjcommError
from ._protocol import SerializerProtocol
from ._registry import SerializerLike, registry


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


def _numpy_array() -> Any:
    import numpy as np

    return np.arange(6, dtype=np.float32).reshape(2, 3)


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (NaN equals NaN, arrays compare by dtype/shape/data)."""
    if type(a) is not type(b):
        return False
    if type(a).__module__ == "numpy":
        import numpy as np

        return bool(a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if callable(a) and not isinstance(a, type):
        return bool(a(3) == b(3))
    return bool(a == b)


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
    """Round-trip ``value`` through ``serializer`` and judge the result."""
    try:
        back = serializer.loads(serializer.dumps(value))
    except ObjcommError:
        return Verdict("refused")
    except Exception as exc:  # a user serializer raising its own errors
        return Verdict("refused", type(exc).__name__)
    if _same(value, back):
        return Verdict("exact")
    try:
        equal = bool(back == value) or bool(back == type(back)(value))
    except Exception:
        equal = False
    note = f"{type(value).__name__} → {type(back).__name__}"
    return Verdict("converted" if equal else "lossy", note)


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
