"""objcomm._transport.patterns: who sends what to whom in each collective, checked without ranks."""

from __future__ import annotations

import pytest

from objcomm._transport import patterns
from objcomm._transport.patterns import OPS, pattern

pytestmark = pytest.mark.timeout(60)


def _roots(op: str, world: int) -> list:
    return list(range(world)) if op in ("gather", "broadcast", "scatter") else [None]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_every_send_meets_a_receive_and_every_receive_a_send(op, world):
    for root in _roots(op, world):
        parts = {me: pattern(op, me=me, world=world, root=root) for me in range(world)}
        sends = {(me, to) for me, p in parts.items() for to in p.to}
        receives = {(source, me) for me, p in parts.items() for source in p.sources}
        assert sends == receives
        assert all(me not in p.to and me not in p.sources for me, p in parts.items())


@pytest.mark.parametrize("world", [1, 4])
def test_what_each_operation_moves(world):
    others = lambda me: tuple(r for r in range(world) if r != me)  # noqa: E731
    for me in range(world):
        assert pattern("all_gather", me=me, world=world) == ("all_gather", others(me), False, others(me))
        assert pattern("all_to_all", me=me, world=world) == ("all_to_all", others(me), True, others(me))
        root = world - 1
        gather = pattern("gather", me=me, world=world, root=root)
        assert gather.sources == (others(me) if me == root else ()) and gather.to == (() if me == root else (root,))
        for op in ("broadcast", "scatter"):
            rooted = pattern(op, me=me, world=world, root=root)
            assert rooted.to == (others(me) if me == root else ())
            assert rooted.sources == (() if me == root else (root,))
            assert rooted.each == (op == "scatter")


def test_outgoing_gives_each_receiver_its_part_or_the_one_part():
    parts = ["p0", "p1", "p2", "p3"]
    assert pattern("scatter", me=1, world=4, root=1).outgoing(parts) == {0: "p0", 2: "p2", 3: "p3"}
    assert pattern("all_to_all", me=0, world=4).outgoing(parts) == {1: "p1", 2: "p2", 3: "p3"}
    assert pattern("broadcast", me=2, world=4, root=2).outgoing("x") == {0: "x", 1: "x", 3: "x"}
    assert pattern("gather", me=3, world=4, root=0).outgoing("x") == {0: "x"}
    assert pattern("gather", me=0, world=4, root=0).outgoing("x") == {}


def test_eight_thousand_ranks_stay_linear():
    world = 8192
    root = pattern("gather", me=0, world=world, root=0)
    leaf = pattern("gather", me=8191, world=world, root=0)
    assert len(root.sources) == world - 1 and root.to == () and leaf.to == (0,) and leaf.sources == ()
    assert len(pattern("all_gather", me=4096, world=world).to) == world - 1


@pytest.mark.parametrize(
    "op, root", [("reduce", None), ("gather", None), ("all_gather", 0), ("broadcast", 4), ("scatter", -1)]
)
def test_a_pattern_that_does_not_exist_is_refused(op, root):
    with pytest.raises(ValueError):
        pattern(op, me=0, world=4, root=root)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 8, 9, 64, 100, 8192])
def test_binomial_trees_hold_every_index_once_in_order(size):
    """Every index but the root has one parent, which lists it among its children; a child's subtree is the indices
    from it to its end, and a parent's children's subtrees tile its own: so a tree that combines children in order
    combines the indices in order."""
    trees = [patterns.binomial(me, size) for me in range(size)]
    assert trees[0].parent is None and trees[0].end == size
    for me, tree in enumerate(trees):
        assert tree.children == tuple(sorted(tree.children))
        if me:
            assert tree.parent is not None and me in trees[tree.parent].children
        at = me + 1
        for child, end in zip(tree.children, tree.ends):
            assert child == at and end == trees[child].end
            at = end
        assert at == tree.end
    assert max(len(t.children) for t in trees) == (size - 1).bit_length()
    with pytest.raises(ValueError):
        patterns.binomial(size, size)
