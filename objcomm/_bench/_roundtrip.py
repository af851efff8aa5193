"""Local round trips through objcomm's framing: encoded size, encode and decode time, fidelity.

Objects go through the same path a collective uses (tensors lifted out of band where the
serializer allows it), so the verdicts are what a user of objcomm gets, not of the bare serializer.

>>> import serializers
>>> check(serializers.get("json"), {"shape": (2, 3)}, repeat=1).verdict
'converted'
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

from serializers import ObjcommError, SerializerProtocol
from serializers._fidelity import _same

from .. import _framing
from .._settings import resolve
from .._transport import Incoming

_NO_LIMIT = 1 << 62

_NOTE_CHARS = 90
MIN_REPEAT = 3
_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


@dataclass(frozen=True)
class RoundTrip:
    """One object through one serializer: ``verdict`` is exact, converted, lossy or refused.

    ``note`` says what changed (``"tuple → list at $['shape']"``) or why it was refused; the
    sizes and times are ``None`` when refused. Times are medians in seconds.
    """

    verdict: str
    note: str = ""
    encoded_bytes: Optional[int] = None
    encode_s: Optional[float] = None
    decode_s: Optional[float] = None

    @property
    def refused(self) -> bool:
        return self.verdict == "refused"


def check(serializer: SerializerProtocol, obj: Any, *, repeat: int, budget_s: Optional[float] = None) -> RoundTrip:
    """Encode and decode ``obj`` ``repeat`` times each; return the medians and the verdict.

    Encoding honours :func:`objcomm.configure` (compression, inline tensor size); only ``max_bytes``
    is lifted, so sizes are reported rather than refused. With ``budget_s``, slow objects get fewer
    repeats (at least 3) so each side takes about that long.
    """
    options = resolve({}, {})  # compression and inline tensor size as a collective here would use them
    encode_times: list[float] = []
    decode_times: list[float] = []
    try:
        while len(encode_times) < _repeats(repeat, encode_times, budget_s):
            start = time.perf_counter()
            out = _framing.encode(
                obj, serializer, max_bytes=_NO_LIMIT, inline_tensor_bytes=options.inline_tensor_bytes,
                compression=options.compression,
            )
            encode_times.append(time.perf_counter() - start)
        while len(decode_times) < _repeats(repeat, decode_times, budget_s):
            start = time.perf_counter()
            back = _framing.decode(Incoming(out.frame, list(out.tensors)), sender=0, accept=None, own=True)
            decode_times.append(time.perf_counter() - start)
    except ObjcommError as exc:
        return RoundTrip("refused", _short(str(exc)))
    except Exception as exc:  # a user serializer's own exception
        return RoundTrip("refused", _short(f"{type(exc).__name__}: {exc}"))
    verdict, note = judge(obj, back)
    return RoundTrip(verdict, note, out.total, statistics.median(encode_times), statistics.median(decode_times))


def _repeats(repeat: int, done: list[float], budget_s: Optional[float]) -> int:
    if budget_s is None or not done:
        return repeat
    return min(repeat, max(MIN_REPEAT, math.ceil(budget_s / max(done[0], 1e-9))))


def judge(sent: Any, got: Any) -> tuple[str, str]:
    """``("exact", "")``, ``("converted", what)`` when only types changed, or ``("lossy", where)``."""
    difference = _difference(sent, got, "$")
    if difference is None:
        return "exact", ""
    return ("converted" if _loosely_equal(sent, got) else "lossy"), difference


def _short(text: str) -> str:
    text = text.split("; ")[0].replace("\n", " ")
    return text if len(text) <= _NOTE_CHARS else text[: _NOTE_CHARS - 1] + "…"


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _plain(value: Any) -> str:
    return str(tuple(value)) if type(value).__name__ == "Size" else str(value).replace("torch.", "")


def _tensors_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b))


def _same_scalar_types(a: Any, b: Any) -> bool:
    """Whether two iterables hold scalars only, of the same types in the same order (at C speed)."""
    types = list(map(type, a))
    return types == list(map(type, b)) and _SCALARS.issuperset(types)


def _difference(a: Any, b: Any, path: str) -> Optional[str]:
    """Where ``b`` first differs from ``a`` in type or value (``None``: exactly the same)."""
    if type(a) is not type(b):
        return f"{type(a).__name__} → {type(b).__name__} at {path}"
    if _is_tensor(a):
        if _tensors_equal(a, b):
            return None
        for what in ("dtype", "shape", "device"):
            if getattr(a, what) != getattr(b, what):
                return f"tensor {what} {_plain(getattr(a, what))} → {_plain(getattr(b, what))} at {path}"
        return f"tensor values changed at {path}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"keys changed at {path}"
        if _same_scalar_types(a, b) and _same_scalar_types(a.values(), b.values()) and a == b:
            return None  # a fast path for flat dicts; NaN values fall through to the slow one
        for key in a:
            found = _difference(a[key], b[key], f"{path}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"length {len(a)} → {len(b)} at {path}"
        if _same_scalar_types(a, b) and a == b:
            return None
        for index, (x, y) in enumerate(zip(a, b)):
            found = _difference(x, y, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    return None if _same(a, b) else f"value changed at {path}"


def _loosely_equal(a: Any, b: Any) -> bool:
    """Equal values, allowing container types to change (tuple → list, OrderedDict → dict)."""
    if _is_tensor(a) or _is_tensor(b):
        return _is_tensor(a) and _is_tensor(b) and bool((a.shape == b.shape) and (a == b).all())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_loosely_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_loosely_equal(x, y) for x, y in zip(a, b))
    if type(a).__module__ == "numpy" or type(b).__module__ == "numpy":
        import numpy as np

        return bool(np.shape(a) == np.shape(b) and np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:
        return False
