"""The benchmark program every rank runs: build payloads, round-trip them, time every op, collect rows."""

from __future__ import annotations

import gc
import os
import platform
import socket
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch
import torch.distributed as dist

import serializers
from objcomm._api.communicator import Communicator
from objcomm._device import group_backend
from objcomm._tools.bench.config import BenchConfig, import_modules
from objcomm._tools.bench.measure import TORCH, compare_op, reduce_max
from objcomm._tools.bench.payloads import Payload, format_size, reference_size, resolve_payload
from objcomm._tools.bench.results import Result, Row
from objcomm._tools.bench.roundtrip import RoundTrip, check

_WARM_UP = {"warm": [1, 2.5, "up", None, True]}
Progress = Callable[[int, int, str], None]
Send = Callable[[Any], None]


def bench_task(config: BenchConfig, send: Send) -> Optional[Result]:
    """Entry point for a launched rank: run the matrix, reporting progress through ``send``."""
    return run_matrix(config, progress=lambda done, total, label: send(("progress", done, total, label)))


def run_matrix(config: BenchConfig, progress: Optional[Progress] = None, group: Any = None) -> Optional[Result]:
    """Run every payload × size × serializer × op on the ranks of ``group``; rank 0 gets the :class:`Result`.

    Every rank of the group must call this with the same ``config``; the others return ``None``.
    """
    import_modules(config.imports)
    payloads = [resolve_payload(name) for name in config.payloads]
    for name in config.serializers:  # lazy imports (orjson, cloudpickle) must not count as encode time
        check(serializers.registry.guarded(name), _WARM_UP, repeat=1)
    gc.collect()
    gc.freeze()  # what is alive now (torch's own ~180k objects) is not scanned by every full collection from here
    me = dist.get_rank(group)
    meta = _meta(config, group)
    cells = [(p, size) for p in payloads for size in (config.sizes if p.scalable else (None,))]
    total, done = len(cells) * (1 + len(config.ops)), 0
    rows: List[Row] = []
    for payload, size in cells:
        objects = _Objects(payload, size or 0)
        label = f"{payload.name} {format_size(size) if size else ''}".strip()
        trips = {
            name: check(
                serializers.registry.guarded(name),
                objects(me),
                repeat=config.repeat,
                budget_s=0.05 if config.adaptive else None,
            )
            for name in config.serializers
        }
        refused = _refused_anywhere(trips, config.serializers, group)
        nbytes = reference_size(objects(me))
        done += 1
        _report(progress, me, done, total, f"{label}: round trips")
        for op in config.ops:
            timings = compare_op(
                op,
                objects,
                [n for n in config.serializers if n not in refused],
                repeat=config.repeat,
                group=group,
                budget_s=config.cell_budget_s if config.adaptive else None,
                min_sample_s=config.min_sample_s or None,
            )
            torch_s = timings[TORCH].median_s
            for name in config.serializers:
                rows.append(
                    _row(
                        payload.name,
                        size,
                        nbytes,
                        name,
                        op,
                        trips[name],
                        name in refused,
                        timings.get(name),
                        torch_s,
                        timings[TORCH].repeats,
                    )
                )
            done += 1
            _report(progress, me, done, total, f"{label}: {op}")
        del objects
    return Result(meta, rows) if me == 0 else None


class _Objects:
    """``make(rank)`` memoised for one payload and size: each rank's object is built once."""

    def __init__(self, payload: Payload, size: int) -> None:
        self._payload, self._size = payload, size
        self._made: Dict[int, Any] = {}

    def __call__(self, rank: int) -> Any:
        if rank not in self._made:
            self._made[rank] = self._payload.make(rank, self._size)
        return self._made[rank]


def _refused_anywhere(trips: Dict[str, RoundTrip], names: Sequence[str], group: Any) -> Set[str]:
    """The serializers that refused this payload on any rank (so every rank skips the same ops)."""
    flags = reduce_max(torch.tensor([1 if trips[n].refused else 0 for n in names], dtype=torch.int32), group)
    return {n for n, flag in zip(names, flags) if flag}


def _row(
    payload: str,
    size: Optional[int],
    nbytes: int,
    name: str,
    op: str,
    trip: RoundTrip,
    refused: bool,
    timing: Any,
    torch_s: float,
    repeats: int,
) -> Row:
    verdict, note = trip.verdict, trip.note
    if refused and not trip.refused:
        verdict, note = "refused", "refused on another rank"
    latency = timing.median_s if timing is not None else None
    return Row(
        payload=payload,
        size=size,
        nbytes=nbytes,
        serializer=name,
        safe=bool(serializers.get(name).safe),
        op=op,
        fidelity=verdict,
        note=note,
        encoded_bytes=trip.encoded_bytes,
        encode_s=trip.encode_s,
        decode_s=trip.decode_s,
        latency_s=latency,
        torch_latency_s=torch_s,
        ratio=latency / torch_s if latency is not None and torch_s > 0 else None,
        throughput_Bps=nbytes / latency if latency else None,
        repeats=timing.repeats if timing is not None else repeats,
    )


def _report(progress: Optional[Progress], me: int, done: int, total: int, label: str) -> None:
    if progress is not None and me == 0:
        progress(done, total, label)


def _meta(config: BenchConfig, group: Any) -> Dict[str, Any]:
    from objcomm import __version__

    here = {"rank": dist.get_rank(), "pid": os.getpid(), "ppid": os.getppid(), "host": socket.gethostname()}
    ranks = Communicator(group, serializer="msgpack").all_gather(here)
    return {
        "world_size": dist.get_world_size(group),
        "backend": group_backend(group),
        "ranks": ranks,
        "objcomm": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "repeat": config.repeat,
        "adaptive_repeat": config.adaptive,
        "min_sample_s": config.min_sample_s,
        "sizes": list(config.sizes),
        "serializers": list(config.serializers),
        "payloads": list(config.payloads),
        "ops": list(config.ops),
    }
