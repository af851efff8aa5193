"""objcomm._transport.patterns: who sends what to whom in each collective, checked without ranks."""

from __future__ import annotations

import doctest

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


@pytest.mark.parametrize("radix", [2, 3, 8])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 8, 9, 64, 65, 100, 8192])
def test_knomial_trees_hold_every_index_once_in_order(size, radix):
    """Every index but the root has one parent, which lists it among its children; a child's subtree is the indices
    from it to its end, and a parent's children's subtrees tile its own: so a tree that combines children in order
    combines the indices in order. The deepest index is ceil(log_radix size) edges from the root at most, and a
    rank's children number radix - 1 a level."""
    trees = [patterns.knomial(me, size, radix) for me in range(size)]
    assert trees[0].parent is None and trees[0].end == size
    depth = [0] * size
    for me, tree in enumerate(trees):
        assert tree.children == tuple(sorted(tree.children))
        if me:
            assert tree.parent is not None and tree.parent < me and me in trees[tree.parent].children
            depth[me] = depth[tree.parent] + 1
        at = me + 1
        for child, end in zip(tree.children, tree.ends):
            assert child == at and end == trees[child].end
            at = end
        assert at == tree.end
    levels = 0
    while radix**levels < size:
        levels += 1
    assert max(depth) <= levels and max(len(t.children) for t in trees) <= (radix - 1) * levels
    if radix == 2:  # the binomial tree: its deepest index is exactly ceil(log2 size) edges down (size a power of 2)
        assert [patterns.binomial(me, size) for me in range(size)] == trees
        assert max(len(t.children) for t in trees) == (size - 1).bit_length()
    if size == 8192 and radix == 8:
        assert max(depth) == 5  # where the binomial tree takes 13
    with pytest.raises(ValueError):
        patterns.knomial(size, size, radix)
    with pytest.raises(ValueError):
        patterns.knomial(0, size, 1)


def _run_spread(world: int, root: int, length: int) -> list:
    """Every rank's steps of patterns.spread carried out on made-up bytes, messages queued per (sender, receiver):
    each send must hold bytes its sender has, each receive take the next message its sender queued for it with the
    same span; returns each rank's bytes at the end (None where a byte never arrived)."""
    source = [i % 251 for i in range(length)]
    held = [list(source) if r == root else [None] * length for r in range(world)]
    steps = [list(patterns.spread(r, world, root, length)) for r in range(world)]
    queues: dict = {}
    posted = [False] * world
    while any(steps):
        progressed = False
        for r in range(world):
            if not steps[r]:
                continue
            batch = steps[r][0]
            if not posted[r]:
                for peer, start, end in batch.sends:
                    assert None not in held[r][start:end], (world, root, length, r, peer, start, end)
                    queues.setdefault((r, peer), []).append((start, end, held[r][start:end]))
                posted[r] = True
            peers = [peer for peer, _, _ in batch.receives]
            if all(len(queues.get((p, r), [])) >= peers.count(p) for p in set(peers)):  # a peer's spans in order
                for peer, start, end in batch.receives:
                    got_start, got_end, data = queues[(peer, r)].pop(0)
                    assert (got_start, got_end) == (start, end), (world, root, length, r, peer)
                    held[r][start:end] = data
                steps[r].pop(0)
                posted[r] = False
                progressed = True
        assert progressed, f"spread({world}, root {root}, {length} bytes) waits for good"
    assert not any(queues.values()), "a message nobody received"
    return held


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64])
def test_spread_gives_every_rank_every_byte(world):
    """A broadcast by scatter, then all_gather (patterns.spread): every rank ends with the root's bytes, whatever the
    root and however the length divides into blocks (fewer bytes than ranks included), and no rank sends a byte it
    does not hold yet."""
    for root in sorted({0, 1 % world, world // 2, world - 1}):
        for length in (0, 1, world - 1, world, 3 * world + 1, 1000):
            source = [i % 251 for i in range(length)]
            assert _run_spread(world, root, length) == [source] * world, (world, root, length)


def test_spread_moves_about_twice_the_bytes_per_rank_in_log_steps():
    """What makes it the route of a large broadcast on many ranks: 2 ceil(log2 W) steps at most, each rank sends at
    most about 2x the bytes and receives at most 1x (the root none), where down the binomial tree the root sends
    them ceil(log2 W) times; a rank talks to ranks 2**k places away only (so few NCCL pairs, whatever the root);
    O(log W) spans at 8192 ranks."""
    world, length = 8192, 100 << 20
    levels = (world - 1).bit_length()
    for me in (0, 1, 2, 4095, 4096, 8191):
        for root in (0, 5):
            steps = patterns.spread(me, world, root, length)
            assert len(steps) <= 2 * levels + 1, (me, root, len(steps))
            sent = sum(end - start for s in steps for _, start, end in s.sends)
            got = sum(end - start for s in steps for _, start, end in s.receives)
            assert got <= length and sent <= 2 * length + 2 * world, (me, root, sent, got)
            if me == root:
                assert got == 0, (me, got)
            gaps = {(peer - me) % world for s in steps for peer, _, _ in s.sends + s.receives}
            assert all(g & (g - 1) == 0 or (world - g) & (world - g - 1) == 0 for g in gaps), gaps


def test_the_examples_in_the_docstrings_hold():
    assert doctest.testmod(patterns).failed == 0
