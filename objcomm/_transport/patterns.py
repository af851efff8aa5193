"""Who sends what to whom in each collective, seen from one rank: the one place each operation's pattern is written.

A medium that moves messages between every pair of a group's ranks (the same-host channel: its round-1 slots,
:class:`objcomm._samehost.mesh.Mesh`, and its second rounds, :class:`objcomm._samehost.channel_rests.ChannelRest`)
offers one primitive: send these parts to these ranks, receive one message from each of those. :func:`pattern`
says which, for every collective; the medium carries it out and the caller shapes the result.

======================  ====================================  =================================  ================
operation               sends to                              each gets                          receives from
======================  ====================================  =================================  ================
all_gather              every other rank                      the same part                      every other rank
gather                  the root (unless it is the root)      the same part                      root: every other
broadcast               root: every other rank                the same part                      others: the root
scatter                 root: every other rank                its own part (``parts[r]``)        others: the root
all_to_all              every other rank                      its own part (``parts[r]``)        every other rank
======================  ====================================  =================================  ================

Pure and torch-free; O(W) per pattern (the tuples of ranks), each kept once made.

>>> pattern("gather", me=2, world=4, root=0)
Pattern(op='gather', to=(0,), each=False, sources=())
>>> pattern("gather", me=0, world=4, root=0).sources
(1, 2, 3)
>>> pattern("scatter", me=0, world=3, root=0).outgoing(["a", "b", "c"])
{1: 'b', 2: 'c'}

The trees of send/recv (a reduction's way up, its result's way down, their failure reports) are one shape,
:func:`binomial`: rooted at index 0, index ``i``'s parent ``i - lowbit(i)``, its children ``i + 1, i + 2, i + 4,
...`` below ``lowbit(i)``.

>>> binomial(4, 7)
Tree(parent=0, children=(5, 6), ends=(6, 7), end=7)
"""

from __future__ import annotations

import functools
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

OPS = ("all_gather", "gather", "broadcast", "scatter", "all_to_all")
_ROOTED = {"gather", "broadcast", "scatter"}
_EACH = {"scatter", "all_to_all"}  # each receiver gets its own part


class Pattern(NamedTuple):
    """One rank's part in one collective (see the module's table)."""

    op: str
    to: Tuple[int, ...]  # the ranks this rank sends to, in group-rank order
    each: bool  # each of them gets its own part (``mine[r]``); else all get ``mine``
    sources: Tuple[int, ...]  # the ranks this rank receives one message from, in group-rank order

    def outgoing(self, mine: Any) -> Dict[int, Any]:
        """What this rank sends to each rank of :attr:`to`: ``mine[r]`` (:attr:`each`) or ``mine`` itself."""
        if self.each:
            parts: Sequence[Any] = mine
            return {r: parts[r] for r in self.to}
        return dict.fromkeys(self.to, mine)


@functools.lru_cache(maxsize=4096)  # a group's patterns repeat every call
def pattern(op: str, *, me: int, world: int, root: Optional[int] = None) -> Pattern:
    """Rank ``me``'s part in ``op`` (one of :data:`OPS`) over ``world`` ranks; ``root``: the root of gather (its
    destination), broadcast and scatter (their source)."""
    if op not in OPS:
        raise ValueError(f"no pattern for {op!r}: one of {', '.join(OPS)}")
    if (op in _ROOTED) != (root is not None) or root is not None and not 0 <= root < world:
        raise ValueError(
            f"{op} over {world} ranks needs {'a root in range' if op in _ROOTED else 'no root'}, got {root}"
        )
    if op in ("all_gather", "all_to_all"):
        others = _others(me, world)
        return Pattern(op, others, op in _EACH, others)
    assert root is not None
    if op == "gather":  # (the other ranks' tuple only on the root: O(1) elsewhere, whatever the cache holds)
        return Pattern(op, () if me == root else (root,), False, _others(me, world) if me == root else ())
    return Pattern(op, _others(me, world) if me == root else (), op in _EACH, () if me == root else (root,))


def _others(me: int, world: int) -> Tuple[int, ...]:
    return (*range(me), *range(me + 1, world))


class Tree(NamedTuple):
    """One index's edges in the binomial tree over ``size`` indices rooted at 0 (:func:`binomial`)."""

    parent: Optional[int]  # None at the root
    children: Tuple[int, ...]  # nearest first: the order the way up takes them (the way down sends farthest first)
    ends: Tuple[int, ...]  # each child's subtree: indices child .. end - 1
    end: int  # this index's subtree: indices me .. end - 1


@functools.lru_cache(maxsize=4096)  # a group's trees repeat every call
def binomial(me: int, size: int) -> Tree:
    """Index ``me``'s parent, children and subtrees in the binomial tree over ``size`` indices rooted at 0: ceil(log2
    size) levels, a parent's subtree the indices up to its next multiple of its lowest set bit."""
    if not 0 <= me < size:
        raise ValueError(f"index {me} of a tree over {size}")
    low = me & -me if me else 1 << max(size - 1, 0).bit_length()
    children = []
    step = 1
    while step < low and me + step < size:
        children.append(me + step)
        step *= 2
    return Tree(
        me - low if me else None, tuple(children), tuple(min(c + (c & -c), size) for c in children), min(me + low, size)
    )
