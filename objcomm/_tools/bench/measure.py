"""Timing object collectives on live ranks: objcomm against torch's object collectives, interleaved.

Reusable from benchmark scripts running on an initialised process group (every rank calls the
same functions with the same arguments)::

    import torch.distributed as dist
    from objcomm._tools.bench.measure import compare_op, interleaved

    timings = compare_op("all_gather", lambda r: {"rank": r, "data": list(range(1000))},
                         serializers=["pickle", "msgpack"], repeat=20)
    timings["msgpack"].median_s / timings[TORCH].median_s      # < 1: faster than torch

    # any callables, e.g. a raw collective of the same bytes as a floor
    raw = torch.zeros(4096, dtype=torch.uint8)
    out = torch.empty(4096 * dist.get_world_size(), dtype=torch.uint8)
    interleaved({"raw": lambda: dist.all_gather_into_tensor(out, raw)}, repeat=20)

A sample is the time from leaving a barrier to having the result, on the *slowest* rank of the
round; a timing is the median of its samples. Candidates run interleaved (one call each per
round, in an order of the round's own, garbage collected before each) so that machine noise hits them alike.
"""

from __future__ import annotations

import functools
import gc
import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from objcomm._api.communicator import Communicator
from objcomm._device import group_backend, resolve_device
from objcomm._tools.bench.config import OPS

TORCH = "torch.distributed"  # the key of torch's own object collective in compare_op's result
MIN_REPEAT = 3
MAX_BATCH = 20  # calls per sample at most, where interleaved() chooses (min_sample_s)
TORCH_EQUIVALENT = {
    "all_gather": "all_gather_object",
    "gather": "gather_object",
    "broadcast": "broadcast_object_list",
    "scatter": "scatter_object_list",
    "send/recv": "send_object_list/recv_object_list",
    "all_to_all": "all_gather_object, then each rank keeps the parts sent to it",
    "all_reduce": "all_gather_object, then functools.reduce locally (op: keep the first; moving, not combining)",
    "iall_gather": "all_gather_object (blocking)",
}


def _keep_first(a: Any, b: Any) -> Any:
    return a


Make = Callable[[int], Any]


@dataclass(frozen=True)
class Timing:
    """The median of ``samples_s``: per round, the slowest rank's seconds from barrier to result."""

    median_s: float
    samples_s: Tuple[float, ...]

    @property
    def repeats(self) -> int:
        return len(self.samples_s)


def interleaved(
    candidates: Mapping[str, Callable[[], Any]],
    *,
    repeat: int = 5,
    warmup: int = 1,
    group: Any = None,
    budget_s: Optional[float] = None,
    batch: int = 1,
    min_sample_s: Optional[float] = None,
) -> Dict[str, Timing]:
    """Time each callable on every rank, interleaved, and return ``{name: Timing}`` (same on every rank).

    Parameters
    ----------
    candidates:
        Named zero-argument callables; every rank passes the same names in the same order, and
        each call must be a collective matching the other ranks' call (or a no-op).
    repeat:
        Timed rounds; each round calls every candidate once, each after a barrier, in an order of
        its own (see :func:`_round`).
    warmup:
        Untimed rounds first (lazy imports, first-call allocations).
    budget_s:
        When given, use fewer rounds (at least 3) if ``repeat`` rounds would take longer than
        this; the decision uses the slowest rank's warm-up, so every rank agrees.
    batch:
        Calls per sample, back to back after the barrier; a sample is their time divided by
        ``batch``. For calls of tens of microseconds: how far apart ranks leave a barrier (on a
        small machine, tens to hundreds of microseconds) would otherwise be most of every sample.
        With ``batch`` above 1, one more call runs untimed right after the barrier: a call that waits
        for the other ranks absorbs their lead, as the warm-up iterations of MPI's latency tests do.
    min_sample_s:
        When given (with a warm-up), ``batch`` is chosen instead: enough calls (at most :data:`MAX_BATCH`) that
        the fastest candidate's sample lasts this long, from the slowest rank's warm-up, so every rank agrees.
        Calls of a few hundred microseconds are then timed a few milliseconds at a time, where the lead of one
        rank leaving a barrier first is a small part of the sample, not half of it.
    """
    if repeat < 1 or batch < 1:
        raise ValueError(f"repeat and batch must be at least 1, got {repeat} and {batch}")
    names = list(candidates)
    for index in range(warmup):
        warm = _round(candidates, names, index, group, batch)
    if (budget_s is not None or min_sample_s is not None) and warmup:
        warm_max = reduce_max(torch.tensor(warm, dtype=torch.float64), group)  # per call, the slowest rank's
        if min_sample_s is not None:
            batch = min(MAX_BATCH, max(1, math.ceil(min_sample_s / max(min(warm_max), 1e-9))))
        if budget_s is not None:
            repeat = min(repeat, max(MIN_REPEAT, math.ceil(budget_s / max(sum(warm_max) * batch, 1e-9))))
    rows = [_round(candidates, names, index, group, batch) for index in range(repeat)]
    slowest_rows = reduce_max(torch.tensor(rows, dtype=torch.float64), group)
    return {
        name: Timing(statistics.median(r[i] for r in slowest_rows), tuple(r[i] for r in slowest_rows))
        for i, name in enumerate(names)
    }


def _round(
    candidates: Mapping[str, Callable[[], Any]], names: Sequence[str], index: int, group: Any, batch: int = 1
) -> List[float]:
    """Seconds per call per name, in ``names`` order. Round ``index`` calls them in an order of its own (the same
    on every rank), so that none always goes first or always follows the same one; and the young garbage earlier
    calls left is collected before each sample, untimed (torch's object collectives leave the most: whichever call came
    next used to pay for collecting it, about 15% of a small call)."""
    order = list(range(len(names)))
    random.Random(index).shuffle(order)
    seconds = [0.0] * len(names)
    for position in order:
        call = candidates[names[position]]
        gc.collect(1)  # the young garbage: cheap (a full collection, with torch loaded, takes 0.2 s)
        dist.barrier(group=group)
        if batch > 1:
            call()  # untimed: it absorbs how far apart the ranks left the barrier
        start = time.perf_counter()
        for _ in range(batch):
            call()
        seconds[position] = (time.perf_counter() - start) / batch
    return seconds


def reduce_max(local: torch.Tensor, group: Any = None) -> List[Any]:
    """Element-wise maximum of ``local`` over the ranks of ``group``, as a (nested) list."""
    device = resolve_device(group_backend(group), group)
    values = local.to(device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values.cpu().tolist()


def compare_op(
    op: str,
    make: Make,
    serializers: Sequence[str] = ("pickle",),
    *,
    repeat: int = 5,
    warmup: int = 1,
    group: Any = None,
    root: int = 0,
    torch_baseline: bool = True,
    budget_s: Optional[float] = None,
    min_sample_s: Optional[float] = None,
) -> Dict[str, Timing]:
    """Time ``op`` through objcomm with each serializer, and torch's equivalent, interleaved.

    Parameters
    ----------
    op:
        One of :data:`OPS`. ``send/recv`` sends from ``root`` to the next group rank; the others idle.
    make:
        ``make(group_rank)`` returns the object that rank contributes; the scatter root calls it
        for every rank. Called once per rank per object, before timing.
    serializers:
        Registered serializer names; results are keyed by them, and torch's by :data:`TORCH`.
    root:
        The group rank that is ``dst`` of gather, ``src`` of broadcast, scatter and send.

    Returns ``{name: Timing}``, identical on every rank. Raises ``ValueError`` for an unknown op,
    or ``send/recv`` in a group of one.
    """
    candidates = {name: objcomm_call(op, make, name, group=group, root=root) for name in serializers}
    if torch_baseline:
        candidates[TORCH] = torch_call(op, make, group=group, root=root)
    return interleaved(
        candidates, repeat=repeat, warmup=warmup, group=group, budget_s=budget_s, min_sample_s=min_sample_s
    )


@dataclass(frozen=True)
class _Place:
    me: int
    size: int
    root: int  # group rank
    root_global: int
    peer: int  # group rank receiving send/recv
    peer_global: int


def _place(op: str, group: Any, root: int) -> _Place:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    size = dist.get_world_size(group)
    if not 0 <= root < size:
        raise ValueError(f"root={root} is not a rank of a group of {size}")
    if op == "send/recv" and size < 2:
        raise ValueError("send/recv needs at least 2 ranks")
    peer = (root + 1) % size
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return _Place(dist.get_rank(group), size, root, to_global(root), peer, to_global(peer))


def objcomm_call(op: str, make: Make, serializer: str, *, group: Any = None, root: int = 0) -> Callable[[], Any]:
    """A zero-argument callable doing ``op`` once through objcomm with ``serializer``."""
    at = _place(op, group, root)
    comm = Communicator(group, serializer=serializer)
    obj = make(at.me)
    if op == "all_gather":
        return lambda: comm.all_gather(obj)
    if op == "gather":
        return lambda: comm.gather(obj, dst=at.root_global)
    if op == "broadcast":
        mine = obj if at.me == at.root else None
        return lambda: comm.broadcast(mine, src=at.root_global)
    if op == "scatter":
        objs = [obj if r == at.me else make(r) for r in range(at.size)] if at.me == at.root else None
        return lambda: comm.scatter(objs, src=at.root_global)
    if op == "all_to_all":
        parts = [obj] * at.size
        return lambda: comm.all_to_all(parts)
    if op == "all_reduce":
        return lambda: comm.all_reduce(obj, _keep_first)
    if op == "iall_gather":
        return lambda: comm.all_gather(obj, async_op=True).wait()
    if at.me == at.root:
        return lambda: comm.send(obj, dst=at.peer_global)
    if at.me == at.peer:
        return lambda: comm.recv(src=at.root_global)
    return lambda: None


def torch_call(op: str, make: Make, *, group: Any = None, root: int = 0) -> Callable[[], Any]:
    """A zero-argument callable doing ``op`` once with torch.distributed's object collective (pickle)."""
    at = _place(op, group, root)
    obj = make(at.me)
    if op in ("all_gather", "iall_gather"):
        return lambda: dist.all_gather_object([None] * at.size, obj, group=group)
    if op == "all_to_all":
        return lambda: _pick_own(at, [obj] * at.size, group)
    if op == "all_reduce":
        return lambda: _gather_and_reduce(at, obj, group)
    if op == "gather":
        return lambda: dist.gather_object(
            obj, [None] * at.size if at.me == at.root else None, dst=at.root_global, group=group
        )
    if op == "broadcast":
        mine = obj if at.me == at.root else None
        return lambda: dist.broadcast_object_list([mine], src=at.root_global, group=group)
    if op == "scatter":
        objs = [obj if r == at.me else make(r) for r in range(at.size)] if at.me == at.root else None
        return lambda: dist.scatter_object_list([None], objs, src=at.root_global, group=group)
    if at.me == at.root:
        return lambda: dist.send_object_list([obj], dst=at.peer_global, group=group)
    if at.me == at.peer:
        return lambda: dist.recv_object_list([None], src=at.root_global, group=group)
    return lambda: None


def _pick_own(at: _Place, parts: List[Any], group: Any) -> List[Any]:
    """What users write without an object all-to-all: gather every rank's whole list, keep one's own parts."""
    everything: List[Any] = [None] * at.size
    dist.all_gather_object(everything, parts, group=group)
    return [row[at.me] for row in everything]


def _gather_and_reduce(at: _Place, obj: Any, group: Any) -> Any:
    """What users write without an object reduction: gather everything, reduce locally."""
    everything: List[Any] = [None] * at.size
    dist.all_gather_object(everything, obj, group=group)
    return functools.reduce(_keep_first, everything)
