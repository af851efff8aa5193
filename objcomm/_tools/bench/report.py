"""Turning a :class:`Result` into the printed table, JSON and CSV."""

from __future__ import annotations

import csv
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from objcomm._tools.bench.config import DEFAULT_OPS
from objcomm._tools.bench.measure import TORCH, TORCH_EQUIVALENT
from objcomm._tools.bench.payloads import format_size
from objcomm._tools.bench.results import Choice, Recommendation, Result, Row

_OP_WIDTH = 16


def format_time(seconds: Optional[float]) -> str:
    """``0.000123`` -> ``"123µs"``, ``0.0123`` -> ``"12.3ms"``; ``None`` -> ``"—"``."""
    if seconds is None:
        return "—"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale or unit == "µs":
            value = seconds / scale
            return f"{value:.0f}{unit}" if value >= 100 else f"{value:.3g}{unit}"
    raise AssertionError("unreachable")


def format_table(result: Result) -> str:
    """The whole report: a header, one block per payload and size, the notes and the recommendations."""
    meta = result.meta
    ops = list(meta["ops"])
    lines = [_headline(meta), *_legend(meta, ops[0] if ops else ""), ""]
    blocks: Dict[Tuple[str, Optional[int]], List[Row]] = {}
    for row in result.rows:
        blocks.setdefault((row.payload, row.size), []).append(row)
    for payload in result.payloads():
        notes: Dict[str, str] = {}
        for (name, size), rows in blocks.items():
            if name == payload:
                lines.extend(_block(name, size, rows, ops))
                lines.append("")
                for row in rows:
                    if row.note:
                        notes.setdefault(f"{row.serializer}: {row.fidelity}", row.note)
        if notes:
            lines.extend([*(f"  {who}: {note}" for who, note in notes.items()), ""])
    lines.extend(format_recommendations(result.recommendations(), ops))
    return "\n".join(lines)


def _headline(meta: Dict[str, Any]) -> str:
    where = "the launcher's process group" if meta.get("launcher") == "env" else "local, on 127.0.0.1"
    ranks = "1 rank" if meta["world_size"] == 1 else f"{meta['world_size']} ranks"
    return (
        f"objcomm bench: {ranks} ({where}, backend {meta['backend']}), "
        f"objcomm {meta['objcomm']}, torch {meta['torch']}, python {meta['python']}"
    )


def _legend(meta: Dict[str, Any], first_op: str) -> List[str]:
    repeats = f"up to {meta['repeat']}" if meta.get("adaptive_repeat") else str(meta["repeat"])
    workarounds = [
        f"          {op}: torch has none; its row is {TORCH_EQUIVALENT[op]}"
        for op in meta.get("ops", ())
        if op not in DEFAULT_OPS
    ]
    batched = meta.get("min_sample_s")
    return [
        *(
            [
                f"op cells: median latency of {repeats} interleaved runs (slowest rank, barrier to result; calls under",
                f"          {batched * 1e3:g} ms timed several back to back, per call), and",
            ]
            if batched
            else [f"op cells: median latency of {repeats} interleaved runs (slowest rank, barrier to result), and"]
        ),
        "          ×: objcomm ÷ torch.distributed's object collective in the same runs (below 1: faster)",
        *workarounds,
        f"encode/decode: rank 0, local, median; MB/s: payload's pickle size ÷ {first_op} latency",
    ]


def _block(payload: str, size: Optional[int], rows: List[Row], ops: List[str]) -> List[str]:
    first = rows[0]
    asked = f"{format_size(size)} requested, " if size is not None else "fixed size, "
    lines = [f"{payload} ({asked}{format_size(first.nbytes)} pickled)"]
    header = f"  {'serializer':<18}{'safe':<5}{'fidelity':<10}{'encoded':>9}{'encode':>9}{'decode':>9}  "
    header += "".join(f"{op:<{_OP_WIDTH}}" for op in ops) + f"{'MB/s':>7}"
    lines.append(header)
    by_serializer: Dict[str, Dict[str, Row]] = {}
    for row in rows:
        by_serializer.setdefault(row.serializer, {})[row.op] = row
    for name, cells in by_serializer.items():
        one = next(iter(cells.values()))
        line = (
            f"  {name:<18}{'yes' if one.safe else 'no':<5}{one.fidelity:<10}"
            f"{format_size(one.encoded_bytes) if one.encoded_bytes is not None else '—':>9}"
            f"{format_time(one.encode_s):>9}{format_time(one.decode_s):>9}  "
        )
        line += "".join(f"{_op_cell(cells.get(op)):<{_OP_WIDTH}}" for op in ops)
        lead = cells.get(ops[0]) if ops else None
        line += f"{_mb_per_s(lead.throughput_Bps if lead else None):>7}"
        lines.append(line)
    torch_cells = {op: next((r for r in rows if r.op == op), None) for op in ops}
    line = f"  {TORCH:<18}{'no':<5}{'(pickle)':<10}{'':>27}  "
    line += "".join(f"{format_time(r.torch_latency_s) if r else '—':<{_OP_WIDTH}}" for r in torch_cells.values())
    lead = torch_cells.get(ops[0]) if ops else None
    line += f"{_mb_per_s(lead.nbytes / lead.torch_latency_s if lead and lead.torch_latency_s else None):>7}"
    lines.append(line)
    return lines


def _op_cell(row: Optional[Row]) -> str:
    if row is None or row.latency_s is None:
        return "—"
    return f"{format_time(row.latency_s)} ×{row.ratio:.2f}"


def _mb_per_s(bps: Optional[float]) -> str:
    if bps is None:
        return "—"
    value = bps / (1 << 20)
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def format_recommendations(recommendations: List[Recommendation], ops: Sequence[str] = ()) -> List[str]:
    """One line per payload: the fastest exact serializer and the fastest safe one, each with its time relative to
    torch's; where torch.distributed was faster, the line says so and to keep torch's collective (``ops``: the
    ops measured, to name it)."""
    lines = ["recommendations (× is the geometric mean over sizes and ops):"]
    torch_names = _torch_names(ops)
    cells = [(rec.payload, _exact_cell(rec.exact, torch_names), _safe_cell(rec.safe)) for rec in recommendations]
    width = max((len(c[0]) for c in cells), default=0)
    exact_width = max((len(c[1]) for c in cells), default=0)
    for (payload, exact, safe), rec in zip(cells, recommendations):
        lines.append(f"  {payload:<{width}}  {exact:<{exact_width}}  {safe}{_auto_cell(rec)}")
    return lines


def _auto_cell(rec: Recommendation) -> str:
    """serializer="auto" against the fastest exact serializer (its target: within 1.1×), where both ran."""
    if rec.auto is None or rec.exact is None:
        return ""
    return f"  auto: {rec.auto.vs_torch / rec.exact.vs_torch:.2f}× the fastest exact ({rec.auto.fidelity})"


def _torch_names(ops: Sequence[str]) -> str:
    """What torch.distributed calls the object collective of ``ops``: ``all_gather_object``; for several, all."""
    names = list(
        dict.fromkeys(TORCH_EQUIVALENT[op].split(",")[0].split(" ")[0] for op in ops if op in TORCH_EQUIVALENT)
    )
    return names[0] if len(names) == 1 else "its object collectives"


def _exact_cell(choice: Optional[Choice], torch_names: str) -> str:
    if choice is None:
        return "fastest exact: none round-trips it exactly"
    if choice.beats_torch:
        return f"fastest exact: {_choice(choice)}"
    # torch round-trips everything pickle does: an exact serializer slower than it is no advice
    return f"torch.distributed is faster here (fastest exact: {_choice(choice)}): keep {torch_names} for this payload"


def _safe_cell(choice: Optional[Choice]) -> str:
    if choice is None:
        return "no safe serializer carries it"
    if choice.beats_torch:
        return f"fastest safe: {_choice(choice, with_fidelity=True)}"
    # torch is faster, but it unpickles: whoever needs a safe decoder pays this much for it
    return f"fastest safe: {_choice(choice, with_fidelity=True)}, slower than torch, whose pickle is not safe"


def _choice(choice: Choice, with_fidelity: bool = False) -> str:
    detail = f"{choice.fidelity}, " if with_fidelity else ""
    return f"{choice.serializer} ({detail}{choice.vs_torch:.2f}× torch)"


def to_json(result: Result) -> Dict[str, Any]:
    """The whole result as plain JSON data: ``meta``, ``rows`` and ``recommendations``."""
    return {
        "meta": result.meta,
        "rows": [row.as_dict() for row in result.rows],
        "recommendations": [rec.as_dict() for rec in result.recommendations()],
    }


def write_json(result: Result, path: str) -> None:
    """Write :func:`to_json` to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_json(result), f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_csv(result: Result, path: str) -> None:
    """Write one CSV line per row, with a header of :meth:`Row.columns`; empty cells where refused."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=Row.columns())
        writer.writeheader()
        for row in result.rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.as_dict().items()})
