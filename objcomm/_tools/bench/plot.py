"""``--plot``: latency against payload size, one panel per op, log axes (needs matplotlib)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from objcomm._tools.bench.measure import TORCH
from objcomm._tools.bench.results import Result

MISSING = "--plot needs matplotlib, which is not installed; install it with: pip install 'objcomm[bench]'"
_MARKERS = "os^Dv<>pXh*"


def require_matplotlib() -> None:
    """Raise ``ImportError`` with the install hint when matplotlib is missing (check before a long run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(MISSING) from exc


def plot(result: Result, path: str) -> None:
    """Write a PNG: colour = serializer (torch dashed black), marker = payload, x = pickle size, y = latency."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    ops = list(result.meta["ops"])
    serializers = list(result.meta["serializers"])
    payloads = result.payloads()
    colours = {name: f"C{i % 10}" for i, name in enumerate(serializers)}
    colours[TORCH] = "black"
    markers = {name: _MARKERS[i % len(_MARKERS)] for i, name in enumerate(payloads)}
    ncols = min(3, len(ops))
    nrows = -(-len(ops) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.6 * nrows), squeeze=False, sharey=True)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(ops):]:
        ax.set_visible(False)
    for ax, op in zip(flat, ops):
        for (serializer, payload), points in _series(result, op).items():
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, color=colours[serializer], marker=markers[payload], markersize=4, linewidth=1,
                    linestyle="--" if serializer == TORCH else "-", alpha=0.85)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("payload size (pickled bytes)")
        ax.grid(True, which="major", alpha=0.3)
    for row in axes:
        row[0].set_ylabel("latency (s, median)")
    handles = [Line2D([], [], color=colours[s], label=s, linestyle="--" if s == TORCH else "-")
               for s in [*serializers, TORCH]]
    handles += [Line2D([], [], color="grey", marker=markers[p], linestyle="", label=p) for p in payloads]
    if len(ops) < nrows * ncols:  # the legend takes the empty panel's place
        flat[-1].legend(handles=handles, loc="center", fontsize="small", frameon=False)
        flat[-1].set_visible(True)
        flat[-1].axis("off")
    else:
        fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small", frameon=False)
    meta = result.meta
    fig.suptitle(f"objcomm bench: {meta['world_size']} ranks, {meta['backend']}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


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
