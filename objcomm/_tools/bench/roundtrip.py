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
import time
from dataclasses import dataclass
from typing import Any, Optional

from objcomm._format import frame as _frame
from objcomm._format.message import Incoming
from objcomm._settings import resolve
from serializers import ObjcommError, SerializerProtocol
from serializers._fidelity import judge

_NO_LIMIT = 1 << 62

_NOTE_CHARS = 90
MIN_REPEAT = 3


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
            out = _frame.encode(
                obj,
                serializer,
                max_bytes=_NO_LIMIT,
                inline_tensor_bytes=options.inline_tensor_bytes,
                compression=options.compression,
            )
            encode_times.append(time.perf_counter() - start)
        while len(decode_times) < _repeats(repeat, decode_times, budget_s):
            start = time.perf_counter()
            back = _frame.decode(Incoming(out.frame, list(out.tensors)), sender=0, accept=None, own=True)
            decode_times.append(time.perf_counter() - start)
    except ObjcommError as exc:
        return RoundTrip("refused", _short(str(exc)))
    except Exception as exc:  # not the serializer's (it raises objcomm errors only): the framing's, a tensor's
        return RoundTrip("refused", _short(f"{type(exc).__name__}: {exc}"))
    verdict, note = judge(obj, back)
    return RoundTrip(verdict, note, out.total, statistics.median(encode_times), statistics.median(decode_times))


def _repeats(repeat: int, done: list[float], budget_s: Optional[float]) -> int:
    if budget_s is None or not done:
        return repeat
    return min(repeat, max(MIN_REPEAT, math.ceil(budget_s / max(done[0], 1e-9))))


def _short(text: str) -> str:
    text = text.split("; ")[0].replace("\n", " ")
    return text if len(text) <= _NOTE_CHARS else text[: _NOTE_CHARS - 1] + "…"
