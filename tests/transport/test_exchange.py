"""objcomm._transport.routes.stripe_moves, the plan of objcomm._transport.exchange.by_stripes: who sends which bytes
of the stream of rests to whom, with made-up sizes (no ranks; tests/transport/test_many_ranks.py runs the exchange
itself on 8 real ranks)."""

from __future__ import annotations

import itertools
import random
from itertools import accumulate
from typing import Dict, List, Sequence, Tuple

import pytest

from objcomm._transport import routes
from objcomm._transport.routes import stripe_moves

Ranges = Dict[Tuple[int, int], Tuple[int, int]]


def _check(lengths: Sequence[int]) -> List[int]:
    """Every rank's moves for ``lengths``: each send meets the receive its peer posts (the same bytes), each stripe is
    covered once by what its owner keeps and receives, each rest leaves its owner once; returns each rank's count of
    posted transfers (sends and receives)."""
    world = len(lengths)
    offsets = [0, *accumulate(lengths)]
    total, width = offsets[-1], routes.stripe_width(lengths)
    sent: Ranges = {}
    received: Ranges = {}
    posted = []
    for me in range(world):
        moves = stripe_moves(offsets, me, width)
        assert moves.stripe == (min(me * width, total), min((me + 1) * width, total))
        covered = []
        for owner, start, end in moves.sends + moves.kept:
            assert offsets[me] <= start < end <= offsets[me + 1]
            assert owner * width <= start and end <= (owner + 1) * width
            assert (owner == me) == ((owner, start, end) in moves.kept)
            if owner != me:
                sent[(me, owner)] = (start, end)
        for sender, start, end in moves.receives:
            assert sender != me and offsets[sender] <= start < end <= offsets[sender + 1]
            assert (sender, me) not in received  # one piece a pair
            received[(sender, me)] = (start, end)
            covered.append((start, end))
        covered += [(start, end) for _, start, end in moves.kept]
        lo, hi = moves.stripe
        assert sorted(b for a, z in covered for b in range(a, z)) == list(range(lo, hi))  # each byte once
        pieces_of_rest = sorted((s, e) for _, s, e in moves.sends + moves.kept)
        assert sum(e - s for s, e in pieces_of_rest) == lengths[me]
        posted.append(len(moves.sends) + len(moves.receives))
    assert sent == received
    return posted


def test_the_docstring_example():
    """W = 4, rests of 0, 10, 0, 2 bytes: stripes of 3; rank 1 sends 3 to rank 0, 3 to rank 2, 1 to rank 3."""
    offsets = [0, 0, 10, 10, 12]
    one = stripe_moves(offsets, 1, 3)
    assert one.sends == [(0, 0, 3), (2, 6, 9), (3, 9, 10)] and one.kept == [(1, 3, 6)]
    assert one.receives == [] and one.stripe == (3, 6)
    three = stripe_moves(offsets, 3, 3)
    assert three.kept == [(3, 10, 12)] and three.receives == [(1, 9, 10)] and three.sends == []
    assert _check([0, 10, 0, 2]) == [1, 3, 1, 1]


def test_every_small_spread():
    """Every list of rests of 0 to 4 bytes on 1 to 5 ranks: rests at, inside and across stripe edges, zeros, the
    stream shorter than the world (stripes past its end)."""
    for world in range(1, 6):
        for lengths in itertools.product(range(5), repeat=world):
            _check(lengths)


@pytest.mark.parametrize("seed", range(20))
def test_random_spreads(seed):
    rng = random.Random(seed)
    world = rng.randint(2, 64)
    kind = seed % 4
    if kind == 0:  # sparse
        lengths = [rng.choice([0, 0, 0, rng.randint(1, 5000)]) for _ in range(world)]
    elif kind == 1:  # one dwarfs the others
        lengths = [rng.randint(0, 50) for _ in range(world)]
        lengths[rng.randrange(world)] = 1_000_000
    elif kind == 2:  # log-normal-like
        lengths = [int(rng.lognormvariate(5, 2)) for _ in range(world)]
    else:  # near equal
        lengths = [1000 + rng.randint(-100, 100) for _ in range(world)]
    _check(lengths)


def test_a_rank_posts_transfers_for_its_own_bytes_only():
    """At 8192 ranks: one 100 MB rest goes to 8191 stripes (its owner's sends); each other rank posts one receive;
    8191 one-byte rests piled into one stripe: its owner posts a receive from each, the others one send each."""
    outlier = [0] * 8191 + [100 << 20]
    offsets, width = [0, *accumulate(outlier)], routes.stripe_width(outlier)
    assert len(stripe_moves(offsets, 8191, width).sends) == 8191
    assert all(len(stripe_moves(offsets, r, width).receives) == 1 for r in (0, 1, 4096, 8190))
    piled = [1] * 8191 + [67_100_000]  # stripes of 8,192 bytes: stripe 0 holds ranks 0-8190 and 1 byte of 8191's
    offsets = [0, *accumulate(piled)]
    assert routes.stripe_width(piled) == 8192
    assert len(stripe_moves(offsets, 0, 8192).receives) == 8191
    assert [stripe_moves(offsets, r, 8192).sends for r in (1, 8190)] == [[(0, 1, 2)], [(0, 8190, 8191)]]
