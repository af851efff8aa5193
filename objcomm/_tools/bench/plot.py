"""``--plot``: each serializer's time as a ratio of torch's, one panel per op and payload (needs matplotlib)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from objcomm._tools.bench.measure import TORCH
from objcomm._tools.bench.results import Result

MISSING = "--plot needs matplotlib, which is not installed; install it with: pip install matplotlib"


def require_matplotlib() -> None:
    """Raise ``ImportError`` with the install hint when matplotlib is missing (check before a long run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(MISSING) from exc


def plot(result: Result, path: str) -> None:
    """Write a PNG that answers "faster than torch?" at a glance: one panel per op (rows) and payload (columns),
    x = payload size (pickled bytes), y = each serializer's median time as a ratio of torch's object collective
    on the same payload (log scale; below the line at 1, objcomm is faster). Refused cells are left out."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    ops = list(result.meta["ops"])
    serializers = list(result.meta["serializers"])
    payloads = result.payloads()
    colours = {name: f"C{i % 10}" for i, name in enumerate(serializers)}
    fig, axes = plt.subplots(
        len(ops),
        len(payloads),
        figsize=(3.6 * len(payloads) + 1.6, 2.4 * len(ops)),
        squeeze=False,
        sharex="col",
        sharey=True,
    )
    ratios = {op: _ratios(result, op) for op in ops}
    values = [y for series in ratios.values() for points in series.values() for _, y in points] or [1.0]
    low, high = min(min(values), 1.0) / 1.5, max(max(values), 1.0) * 1.5  # torch's line always in view
    for r, op in enumerate(ops):
        series = ratios[op]
        for c, payload in enumerate(payloads):
            ax = axes[r][c]
            ax.set_ylim(low, high)
            ax.axhspan(low, 1.0, color="tab:green", alpha=0.06)
            ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
            for serializer in serializers:
                points = sorted(series.get((serializer, payload), []))
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, color=colours[serializer], marker="o", markersize=3, linewidth=1.2)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.grid(True, which="major", alpha=0.3)
            if r == 0:
                ax.set_title(payload, fontsize="medium")
            if c == 0:
                ax.set_ylabel(f"{op}\ntime / torch's")
            if r == len(ops) - 1:
                ax.set_xlabel("payload size (pickled bytes)")
    handles = [Line2D([], [], color=colours[s], marker="o", markersize=3, label=s) for s in serializers]
    handles.append(Line2D([], [], color="black", linestyle="--", label=f"{TORCH} (= 1)"))
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small", frameon=False)
    meta = result.meta
    fig.suptitle(
        f"objcomm bench: time as a ratio of torch's object collectives (below 1: faster), "
        f"{meta['world_size']} ranks, {meta['backend']}",
        fontsize="medium",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


def _ratios(result: Result, op: str) -> Dict[Tuple[str, str], List[Tuple[int, float]]]:
    """``{(serializer, payload): [(nbytes, latency / torch's latency), ...]}`` for one op."""
    ratios: Dict[Tuple[str, str], List[Tuple[int, float]]] = {}
    series = _series(result, op)
    for (serializer, payload), points in series.items():
        if serializer == TORCH:
            continue
        torch_at = dict(series.get((TORCH, payload), []))
        ratios[(serializer, payload)] = [(n, t / torch_at[n]) for n, t in points if torch_at.get(n)]
    return ratios


def _series(result: Result, op: str) -> Dict[Tuple[str, str], List[Tuple[int, float]]]:
    """``{(serializer or TORCH, payload): [(nbytes, latency), ...]}`` for one op; refused cells left out."""
    series: Dict[Tuple[str, str], Any] = {}
    torch_seen = set()
    for row in result.rows:
        if row.op != op:
            continue
        if row.latency_s is not None:
            series.setdefault((row.serializer, row.payload), []).append((row.nbytes, row.latency_s))
        if (row.payload, row.size) not in torch_seen:
            torch_seen.add((row.payload, row.size))
            series.setdefault((TORCH, row.payload), []).append((row.nbytes, row.torch_latency_s))
    return series
