"""What a benchmark run produces: one :class:`Row` per payload × size × serializer × op, and the verdicts."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional


@dataclass(frozen=True)
class Row:
    """One cell of the matrix. Times are seconds (medians); ``None`` where the serializer refused.

    ``size`` is the requested size (``None`` for fixed-size payloads), ``nbytes`` the payload's
    reference size (its pickle length on rank 0), ``throughput_Bps`` is ``nbytes / latency_s``
    and ``ratio`` is ``latency_s / torch_latency_s`` (below 1: faster than torch).
    """

    payload: str
    size: Optional[int]
    nbytes: int
    serializer: str
    safe: bool
    op: str
    fidelity: str
    note: str
    encoded_bytes: Optional[int]
    encode_s: Optional[float]
    decode_s: Optional[float]
    latency_s: Optional[float]
    torch_latency_s: float
    ratio: Optional[float]
    throughput_Bps: Optional[float]
    repeats: int

    @classmethod
    def columns(cls) -> List[str]:
        return [f.name for f in fields(cls)]

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass
class Result:
    """Rows plus the run's context (``meta``: world size, backend, launcher, ranks' pids, versions)."""

    meta: Dict[str, Any]
    rows: List[Row] = field(default_factory=list)

    def recommendations(self) -> List[Recommendation]:
        """Per payload: the fastest serializer that round-trips it exactly, and the fastest safe one."""
        return [recommend(payload, [r for r in self.rows if r.payload == payload]) for payload in self.payloads()]

    def payloads(self) -> List[str]:
        return list(dict.fromkeys(r.payload for r in self.rows))


@dataclass(frozen=True)
class Choice:
    """A serializer and its speed relative to torch (geometric mean of ``ratio`` over sizes and ops)."""

    serializer: str
    vs_torch: float
    fidelity: str

    @property
    def beats_torch(self) -> bool:
        """Faster than torch.distributed's object collectives on the payload (a ratio below 1)."""
        return self.vs_torch < 1.0


@dataclass(frozen=True)
class Recommendation:
    """The fastest serializer whose every round trip was exact, and the fastest safe one that ran everywhere.

    ``torch_faster``: no serializer that carried the payload without loss beat torch.distributed on it, so the
    advice is to keep torch's object collectives for it (torch pickles: exact, not safe).
    """

    payload: str
    exact: Optional[Choice]
    safe: Optional[Choice]
    torch_faster: bool = False
    auto: Optional[Choice] = None  # serializer="auto" (not a candidate above: it picks among them)

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def recommend(payload: str, rows: List[Row]) -> Recommendation:
    """Rank the serializers that ran every cell of ``payload`` by geometric-mean ratio to torch."""
    by_serializer: Dict[str, List[Row]] = {}
    for row in rows:
        by_serializer.setdefault(row.serializer, []).append(row)
    choices = []
    auto = None
    for name, mine in by_serializer.items():
        ratios = [r.ratio for r in mine if r.ratio is not None]
        if len(ratios) < len(mine):
            continue  # refused somewhere: not a candidate for this payload
        geo = math.exp(sum(math.log(max(ratio, 1e-12)) for ratio in ratios) / len(ratios))
        if name == "auto":
            auto = Choice(name, geo, _worst(mine))
            continue
        choices.append((geo, name, _worst(mine), mine[0].safe))
    choices.sort()
    exact = next((Choice(n, g, f) for g, n, f, _ in choices if f == "exact"), None)
    safe = next((Choice(n, g, f) for g, n, f, s in choices if s and f != "lossy"), None)
    torch_faster = not any(g < 1.0 for g, _, f, _ in choices if f != "lossy")
    return Recommendation(payload, exact, safe, torch_faster, auto)


def _worst(rows: List[Row]) -> str:
    for verdict in ("lossy", "converted"):
        if any(r.fidelity == verdict for r in rows):
            return verdict
    return "exact"
