"""Put per-rank evaluation results back into dataset order (what ``collect_results_gpu`` meant to do).

Two layouts are understood:

- **Strided** (no ``indices``): rank ``r`` of ``W`` holds the results of items ``r, r+W, r+2W, ...``,
  which is what ``DistributedSampler(shuffle=False)`` hands out. Results are interleaved round
  robin, so parts whose lengths differ by one (an unpadded ``dataset[rank::W]`` shard) lose nothing,
  unlike ``zip(*parts)``.
- **Indexed** (``indices=``): each result comes with the dataset index it was computed for, e.g.
  ``indices=sampler`` for a ``DistributedSampler`` with ``shuffle=True``, whose shards are slices of
  a permutation and so not in dataset order at all. Results are sorted by index; an index seen more
  than once (the sampler's padding repeats a few) is kept once.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any, Dict, List, Optional, Tuple

from objcomm._api.communicator import Communicator
from objcomm._errors import remote_error, shown_ranks, shown_values
from serializers import SerializerLike

_OP = "collect_results"


def collect_results(
    part: Iterable[Any],
    size: Optional[int] = None,
    dst: Optional[int] = 0,
    *,
    indices: Optional[Iterable[int]] = None,
    group: Any = None,
    serializer: Optional[SerializerLike] = None,
) -> Optional[List[Any]]:
    """Collect every rank's results, in dataset order, on global rank ``dst`` (every rank if ``dst=None``).

    Parameters
    ----------
    part:
        This rank's results, one per item, in the order the rank processed its items.
    size:
        The dataset length. Without ``indices`` the merged list is cut to ``size`` items, which
        drops the duplicates ``DistributedSampler`` pads the last round with; with ``indices``
        every index must be below ``size``.
    dst:
        Global rank that receives the list; ``None``: every rank does.
    indices:
        The dataset index of each element of ``part`` (same length), e.g. ``indices=sampler`` or
        ``indices=list(sampler)``. Needed whenever the shard is not ``r, r+W, r+2W, ...`` —
        in particular with ``DistributedSampler(shuffle=True)``. Give it on every rank or on none.
    group:
        Process group (default: the default group); ranks are interleaved in group-rank order.
    serializer:
        How results travel (default ``"pickle"``); it must carry lists of ints as well.

    Returns
    -------
    On ``dst`` (or everywhere with ``dst=None``): the results ordered by dataset index. Without
    ``indices`` and with ``size``: ``size`` results at most. With ``indices``: one result per
    distinct index, ascending (items a ``drop_last=True`` sampler skipped are absent). Elsewhere:
    ``None``. Without a process group: this rank's results, ordered the same way.

    Raises
    ------
    RemoteError:
        On every rank, when a rank's own input is unusable (``part`` not a sequence of results,
        ``len(part) != len(indices)``, a negative index or one ``>= size``, a bad ``size``);
        ``.failures`` names the rank and the problem, and that rank's error is the ``__cause__``.
        Without a process group the ``ValueError``/``TypeError`` itself is raised.
    ValueError:
        On every rank, when the ranks disagree: ``indices`` given on some ranks only, ``size`` not the
        same everywhere, or (without ``indices``) part lengths that cannot come from a strided shard or
        a ``size`` that would drop results (more than a sampler's padding).

    Example::

        sampler = DistributedSampler(dataset, shuffle=True)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        part = [p for batch in loader for p in model(batch).tolist()]
        results = objcomm.collect_results(part, len(dataset), indices=sampler)   # on rank 0
    """
    items, index_list, problem = _prepare(part, indices, size)
    comm = Communicator(group)
    # Round 1, small: a summary of every rank's shape, combined up a tree and back (a few words a rank, whatever W),
    # so that every rank learns whether all is well; only if not, each rank's own shape and problem reach every rank
    # (an all_gather), so that all raise the same error, naming the ranks.
    mine = [len(items), index_list is not None, _describe(problem), size]
    summary = comm.all_reduce(_summary(mine), _combine, serializer=serializer)
    if not _all_well(summary):
        _check_agreement(comm.all_gather(mine, serializer=serializer), problem)
    payload = [items, index_list]
    if dst is None:
        shards: Optional[List[Any]] = comm.all_gather(payload, serializer=serializer)
    else:
        shards = comm.gather(payload, dst, serializer=serializer)
    if shards is None:
        return None
    if index_list is not None:
        return _by_index(shards)
    return _round_robin([shard[0] for shard in shards], size)


def _prepare(
    part: Any, indices: Optional[Iterable[Any]], size: Any
) -> Tuple[List[Any], Optional[List[int]], Optional[Exception]]:
    """This rank's results and indices as lists, or the reason they are unusable."""
    if size is not None:
        try:
            if isinstance(size, bool) or operator.index(size) < 0:
                raise TypeError
        except TypeError:
            return [], None, ValueError(f"size must be a non-negative int or None, got {size!r}")
    if isinstance(part, (str, bytes, bytearray, Mapping)) or not isinstance(part, Iterable):
        return [], None, TypeError(f"part must be a sequence of per-item results (a list), got {type(part).__name__}")
    items = list(part)
    if indices is None:
        return items, None, None
    try:
        index_list = [operator.index(i) for i in indices]
    except TypeError as exc:
        return items, None, TypeError(f"indices must be an iterable of ints (e.g. the sampler): {exc}")
    if len(index_list) != len(items):
        return (
            items,
            None,
            ValueError(
                f"part has {len(items)} results but indices has {len(index_list)} entries; they must pair up "
                "one to one (a DataLoader with drop_last=True, or a loop that stopped early, breaks the pairing)"
            ),
        )
    bad = [i for i in index_list if i < 0 or (size is not None and i >= size)]
    if bad:
        limit = f" and below size={size}" if size is not None else ""
        return items, None, ValueError(f"indices must be >= 0{limit}; got {bad[:5]}")
    return items, index_list, None


# A summary of consecutive group ranks' shapes: [ranks, failed, with indices, size (the first rank's, an int or
# None), one size for all, first length, last length, lengths never rising, total length]. Lists of ints, bools
# and None, which every serializer that carries collect_results' lists of ints carries (msgpack and JSON included).
_RANKS, _FAILED, _INDEXED, _SIZE, _ONE_SIZE, _FIRST, _LAST, _FALLING, _TOTAL = range(9)


def _summary(meta: List[Any]) -> List[Any]:
    """One rank's summary of its ``[length, indexed, problem, size]``: ``size`` as an int (a numpy or torch integer
    passed ``_prepare``'s check), or None where it is None or this rank has a problem (which the summary's
    failure then reports: a size that failed the check need not compare)."""
    length, indexed, problem, size = meta
    size = None if problem is not None or size is None else operator.index(size)
    return [1, problem is not None, int(indexed), size, True, length, length, True, length]


def _combine(low: List[Any], high: List[Any]) -> List[Any]:
    """The summary of two runs of consecutive ranks, ``low``'s before ``high``'s (all_reduce combines in group-rank
    order)."""
    return [
        low[_RANKS] + high[_RANKS],
        bool(low[_FAILED] or high[_FAILED]),
        low[_INDEXED] + high[_INDEXED],
        low[_SIZE],
        bool(low[_ONE_SIZE] and high[_ONE_SIZE] and low[_SIZE] == high[_SIZE]),
        low[_FIRST],
        high[_LAST],
        bool(low[_FALLING] and high[_FALLING] and low[_LAST] >= high[_FIRST]),
        low[_TOTAL] + high[_TOTAL],
    ]


def _all_well(summary: List[Any]) -> bool:
    """Whether the group's summary passes every check of :func:`_check_agreement` (which then would not raise)."""
    ranks, size = summary[_RANKS], summary[_SIZE]
    if summary[_FAILED] or not summary[_ONE_SIZE] or summary[_INDEXED] not in (0, ranks):
        return False
    if summary[_INDEXED]:
        return True
    strided = summary[_FALLING] and summary[_FIRST] - summary[_LAST] <= 1
    return bool(strided and (size is None or summary[_TOTAL] - size < ranks))


def _describe(problem: Optional[Exception]) -> Optional[List[str]]:
    return None if problem is None else [type(problem).__name__, str(problem)]


def _check_agreement(meta: List[Any], problem: Optional[Exception]) -> None:
    """Raise the same error on every rank when any rank's input, or their combination, is unusable."""
    failures: Dict[int, Tuple[str, str]] = {r: (m[2][0], m[2][1]) for r, m in enumerate(meta) if m[2] is not None}
    if failures:
        if len(meta) == 1 and problem is not None:
            raise problem  # a group of one: the caller's own mistake, as is
        raise remote_error(_OP, failures, problem) from problem
    with_indices = [r for r, m in enumerate(meta) if m[1]]
    if with_indices and len(with_indices) != len(meta):
        without = [r for r, m in enumerate(meta) if not m[1]]
        raise ValueError(
            f"collect_results: indices= was given on ranks {shown_ranks(with_indices)} but not on ranks "
            f"{shown_ranks(without)}; "
            "give it on every rank or on none"
        )
    sizes = [m[3] for m in meta]
    if sizes != [sizes[0]] * len(meta):
        raise ValueError(
            f"collect_results: size by rank is {shown_values(sizes)}; every rank must pass the same size (the "
            "dataset's length), or None"
        )
    if not with_indices:
        lengths = [m[0] for m in meta]
        strided = all(a >= b for a, b in zip(lengths, lengths[1:])) and lengths[0] - lengths[-1] <= 1
        if not strided:
            raise ValueError(
                f"collect_results: part lengths by rank are {shown_values(lengths)}, which a strided shard (rank r "
                "holds items r, r+W, r+2W, ...) cannot produce; pass indices= with each result's dataset index"
            )
        size = sizes[0]
        if size is not None and sum(lengths) - size >= len(meta):  # padding adds fewer than W items
            raise ValueError(
                f"collect_results: the ranks hold {sum(lengths)} results but size={size}, so "
                f"{sum(lengths) - size} would be dropped, and a sampler pads at most {len(meta) - 1}; pass the "
                "dataset's length (len(dataset), not len(sampler))"
            )


def _round_robin(parts: List[List[Any]], size: Optional[int]) -> List[Any]:
    longest = max((len(p) for p in parts), default=0)
    merged = [p[i] for i in range(longest) for p in parts if i < len(p)]
    return merged if size is None else merged[:size]


def _by_index(shards: List[Any]) -> List[Any]:
    found: Dict[int, Any] = {}
    for items, index_list in shards:
        for index, item in zip(index_list, items):
            found.setdefault(index, item)  # padding repeats an index: keep the first copy
    return [found[i] for i in sorted(found)]
