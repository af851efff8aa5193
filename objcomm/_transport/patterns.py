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
...`` below ``lowbit(i)``; a gather's slots and word take its wider form, :func:`knomial`.

>>> binomial(4, 7)
Tree(parent=0, children=(5, 6), ends=(6, 7), end=7)

A scan's partial results go up by doubling distances, :func:`prefix_steps`.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple


class Row(NamedTuple):
    """How one collective's :class:`Pattern` is made, as :data:`ROWS` holds it: each rank's receivers and sources,
    functions of ``(me, world, root)`` (``root``: -1 where the collective has none) that give other ranks of the
    group, each once, in increasing order (one message a pair)."""

    root: str  # the keyword that names its root ("src": its parts leave from there; "dst": they arrive there), or ""
    each: bool  # each receiver gets its own part
    to: Callable[[int, int, int], Tuple[int, ...]]
    sources: Callable[[int, int, int], Tuple[int, ...]]


def _everyone(me: int, world: int, root: int) -> Tuple[int, ...]:
    return _others(me, world)


def _the_root(me: int, world: int, root: int) -> Tuple[int, ...]:
    return () if me == root else (root,)


def _from_the_root(me: int, world: int, root: int) -> Tuple[int, ...]:  # (the other ranks' tuple only on the root:
    return _others(me, world) if me == root else ()  # O(1) elsewhere, whatever the cache holds)


# Every collective's row (the module's table); a collective added since (:func:`add_row`) runs as its pattern alone
# (``Communicator._pattern_call``; docs/internals.md, "Adding a collective").
ROWS: Dict[str, Row] = {
    "all_gather": Row("", False, _everyone, _everyone),
    "gather": Row("dst", False, _the_root, _from_the_root),
    "broadcast": Row("src", False, _from_the_root, _the_root),
    "scatter": Row("src", True, _from_the_root, _the_root),
    "all_to_all": Row("", True, _everyone, _everyone),
}
OPS = ("all_gather", "gather", "broadcast", "scatter", "all_to_all")  # the built-in rows (rounds of their own besides)
REDUCTIONS = ("reduce", "all_reduce", "scan", "exscan")  # the built-in collectives that have no row
_ADDING = threading.Lock()


def add_row(op: str, row: Row) -> None:
    """Add collective ``op``'s row to :data:`ROWS`, on every rank (its method calls ``self._pattern_call(call, op,
    ...)``). Adding an equal row again does nothing; another row under a name that has one, or a built-in
    collective's name, is refused (:func:`remove_row` first).

    >>> add_row("to_next", Row("", False, lambda me, w, root: ((me + 1) % w,), lambda me, w, root: ((me - 1) % w,)))
    >>> pattern("to_next", me=3, world=4)
    Pattern(op='to_next', to=(0,), each=False, sources=(2,))
    >>> remove_row("to_next")
    """
    if row.root not in ("", "src", "dst"):
        raise ValueError(f"a row's root is 'src', 'dst' or '' (none), got {row.root!r}")
    if op in OPS or op in REDUCTIONS:
        raise ValueError(f"{op!r} is a built-in collective: a row added is one of its own name")
    with _ADDING:
        if ROWS.get(op, row) != row:
            raise ValueError(f"{op!r} has another row already: remove_row({op!r}) first, on every rank")
        ROWS[op] = row


def remove_row(op: str) -> None:
    """Remove the row :func:`add_row` added as ``op`` (a test's, a notebook's that defines it again), and the patterns
    made from it; a built-in one is refused."""
    if op in OPS:
        raise ValueError(f"{op!r} is a built-in collective's row")
    with _ADDING:
        ROWS.pop(op, None)
        for key in [key for key in _KEPT if key[0] == op]:
            _KEPT.pop(key, None)


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


PATTERNS_KEPT = 4096  # patterns kept (a group's repeat every call); past it, they are made again
_KEPT: Dict[Tuple[str, int, int, Optional[int]], Pattern] = {}


def pattern(op: str, *, me: int, world: int, root: Optional[int] = None) -> Pattern:
    """Rank ``me``'s part in ``op`` (a row of :data:`ROWS`) over ``world`` ranks; ``root``: the root of gather (its
    destination), broadcast and scatter (their source). Kept once made: a dict lookup, ~0.2 µs a call where an
    ``lru_cache`` called with keywords cost ~0.35 (every round 1 asks)."""
    found = _KEPT.get((op, me, world, root))
    if found is None:
        if len(_KEPT) >= PATTERNS_KEPT:
            _KEPT.clear()
        found = _KEPT[op, me, world, root] = _made(op, me, world, root)
    return found


def row_of(op: str) -> Row:
    """Collective ``op``'s row; a ValueError that names the rows where it has none."""
    row = ROWS.get(op)
    if row is None:
        raise ValueError(f"no pattern for {op!r}: one of {', '.join(ROWS)} (patterns.add_row adds one)")
    return row


def _made(op: str, me: int, world: int, root: Optional[int]) -> Pattern:
    row = row_of(op)
    if bool(row.root) != (root is not None) or root is not None and not 0 <= root < world:
        raise ValueError(f"{op} over {world} ranks needs {'a root in range' if row.root else 'no root'}, got {root}")
    at = -1 if root is None else root
    to = tuple(row.to(me, world, at))  # (one tuple where a row's sources are its receivers: all_gather's W - 1)
    made = Pattern(op, to, row.each, to if row.sources is row.to else tuple(row.sources(me, world, at)))
    for ranks in (made.to, made.sources) if op not in OPS else ():  # an added row's, once (it is kept): O(W)
        if not all(type(r) is int and 0 <= r < world and r != me for r in ranks) or not all(
            a < b for a, b in zip(ranks, ranks[1:])
        ):
            raise ValueError(
                f"the row of {op!r} gives rank {me} of {world} the ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''}: "
                "a row's ranks are other ranks of the group, each once, in increasing order"
            )
    return made


def in_rank_order(got: Dict[int, Any], own: Any, me: int, world: int) -> List[Any]:
    """What an all_gather's or all_to_all's pattern brought from every other rank (``got``, by rank), in group-rank
    order, this rank's own (``own``) in its place."""
    return [own if r == me else got[r] for r in range(world)]


def _others(me: int, world: int) -> Tuple[int, ...]:
    return (*range(me), *range(me + 1, world))


class Tree(NamedTuple):
    """One index's edges in a tree over ``size`` indices rooted at 0 (:func:`binomial`, :func:`knomial`)."""

    parent: Optional[int]  # None at the root
    children: Tuple[int, ...]  # nearest first: the order the way up takes them (the way down sends farthest first)
    ends: Tuple[int, ...]  # each child's subtree: indices child .. end - 1
    end: int  # this index's subtree: indices me .. end - 1


def binomial(me: int, size: int) -> Tree:
    """Index ``me``'s parent, children and subtrees in the binomial tree over ``size`` indices rooted at 0: ceil(log2
    size) levels, a parent's subtree the indices up to its next multiple of its lowest set bit (:func:`knomial`, 2)."""
    return knomial(me, size, 2)


@functools.lru_cache(maxsize=4096)  # a group's trees repeat every call
def knomial(me: int, size: int, radix: int) -> Tree:
    """Index ``me``'s edges in the ``radix``-nomial tree over ``size`` indices rooted at 0, the binomial tree's
    generalisation (radix 2): with ``p`` the place of ``me``'s lowest nonzero digit in base ``radix`` and ``d`` that
    digit, its parent is ``me - d * radix**p`` and its children ``me + j * radix**i`` for ``i < p`` and ``j`` from 1
    to ``radix - 1`` (the root: every ``i`` with ``radix**i < size``), each child's subtree the ``radix**i`` indices
    from it. ceil(log_radix size) levels, at most ``radix - 1`` children a level: a wider radix takes fewer
    latencies where each level's messages are short enough to go at once (a gather's slots and word:
    :data:`objcomm._transport.routes.SLOT_TREE_RADIX`).

    >>> knomial(4, 7, 2)
    Tree(parent=0, children=(5, 6), ends=(6, 7), end=7)
    >>> knomial(8, 20, 4)
    Tree(parent=0, children=(9, 10, 11), ends=(10, 11, 12), end=12)
    """
    if not 0 <= me < size or radix < 2:
        raise ValueError(f"index {me} of a tree over {size} with radix {radix}")
    low = 1  # radix ** p: me's lowest nonzero digit's place value (the root: past size)
    while me and me // low % radix == 0:
        low *= radix
    if not me:
        while low < size:
            low *= radix
    children, ends = [], []
    step = 1
    while step < low:
        for j in range(1, radix):
            child = me + j * step
            if child >= size:
                break
            children.append(child)
            ends.append(min(child + step, size))
        step *= radix
    parent = me - me // low % radix * low if me else None
    return Tree(parent, tuple(children), tuple(ends), min(me + low, size))


class PrefixStep(NamedTuple):
    """One rank's step of :func:`prefix_steps`: its partial to ``to`` (None: none past it), one from ``source``
    (None: none before it), the send first where ``send_first``."""

    to: Optional[int]
    source: Optional[int]
    send_first: bool


@functools.lru_cache(maxsize=4096)
def prefix_steps(me: int, world: int) -> Tuple[PrefixStep, ...]:
    """Rank ``me``'s steps in a scan over ``world`` ranks (Hillis and Steele's): at distance ``d = 1, 2, 4, ...``
    below ``world`` each rank sends what it holds (ranks ``max(0, me - 2d + 1) .. me`` combined) to ``me + d`` and
    takes what ``me - d`` holds, to combine on its left: after ceil(log2 W) steps a rank holds ranks ``0 .. me``.
    So that no chain of blocking sends forms, a rank in an even block of ``d`` ranks sends first and one in an odd
    block receives first: every message waits for one other at most, two a step.

    >>> [tuple(s) for s in prefix_steps(2, 4)]
    [(3, 1, True), (None, 0, False)]
    """
    steps, distance = [], 1
    while distance < world:
        to = me + distance if me + distance < world else None
        source = me - distance if me >= distance else None
        steps.append(PrefixStep(to, source, (me // distance) % 2 == 0))
        distance *= 2
    return tuple(steps)


Span = Tuple[int, int, int]  # (group rank, start, end): bytes [start, end) of a stream, to or from that rank


class Batch(NamedTuple):
    """What one rank sends and receives at once in one step of :func:`spread` (each list in the order both ends post
    it)."""

    sends: Tuple[Span, ...]
    receives: Tuple[Span, ...]


def spread(me: int, world: int, root: int, length: int) -> Tuple[Batch, ...]:
    """Rank ``me``'s steps in a broadcast of ``length`` bytes from ``root`` as a scatter, then an all_gather: the
    stream cut into ``world`` blocks of ``c = ceil(length / world)`` bytes, block ``j`` for the rank ``j`` places
    after the root. The blocks go down :func:`binomial` from the root, each rank's subtree's blocks to it (a receive,
    then a batch of sends: ceil(log2 W) levels); then, ``d = 1, 2, 4, ...`` below ``world``, every rank sends the
    ``min(d, world - d)`` blocks from its own onwards to the rank ``d`` places before it, and receives as many from
    the rank ``d`` places after it (Bruck's all_gather: ceil(log2 W) steps), less the blocks the receiver holds
    already (its subtree's: the root receives none). Each rank moves at most about ``2 x length`` bytes, where down
    the binomial tree the root sends ``ceil(log2 W) x length`` (and NCCL's broadcast, a ring, takes W - 1 hops); a
    rank's peers are the ranks ``2**k`` places from it, whatever the root. Pure, O(log W) spans.

    >>> [s.sends for s in spread(0, 4, 0, 8)]  # the root: blocks 2-3 to rank 2, block 1 to rank 1; then the others'
    [((2, 4, 8), (1, 2, 4)), ((3, 0, 2),), ((2, 0, 4),)]
    >>> [s.receives for s in spread(3, 4, 0, 8)]  # a leaf: its block from rank 2, then the others' in two steps
    [((2, 6, 8),), ((0, 0, 2),), ((1, 2, 6),)]
    """
    if not 0 <= root < world or not 0 <= me < world:
        raise ValueError(f"rank {me} and root {root} of a group of {world}")
    width, rel = -(-length // world), (me - root) % world

    def spans(peer: int, first: int, count: int) -> Tuple[Span, ...]:
        """Blocks ``first .. first + count - 1`` (relative, cyclic) as byte ranges, to or from ``peer`` (relative)."""
        rank, first, found = (peer + root) % world, first % world, []
        for lo, hi in ((first, min(first + count, world)), (0, first + count - world)):
            start, end = min(lo * width, length), min(hi * width, length)
            if start < end:
                found.append((rank, start, end))
        return tuple(found)

    def missing(holder: int, d: int) -> Tuple[int, int]:
        """The blocks ``holder`` (relative) takes at the all_gather's step ``d``: the first after those it holds (its
        subtree's, and ``d`` from its own on), and how many."""
        held = max(d, binomial(holder, world).end - holder)
        return holder + held, max(0, d + min(d, world - d) - held)

    steps = []
    tree = binomial(rel, world)
    if tree.parent is not None:  # this rank's subtree's blocks, from its parent
        steps.append(Batch((), spans(tree.parent, rel, tree.end - rel)))
    children = reversed(list(zip(tree.children, tree.ends)))  # the farthest (the largest subtree) first
    steps.append(Batch(tuple(s for child, end in children for s in spans(child, child, end - child)), ()))
    d = 1
    while d < world:
        before, after = (rel - d) % world, (rel + d) % world
        steps.append(Batch(spans(before, *missing(before, d)), spans(after, *missing(rel, d))))
        d *= 2
    return tuple(s for s in steps if s.sends or s.receives)
