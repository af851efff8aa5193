"""objcomm._transport.group_ranks without ranks: GroupRanks, the group's global ranks a wire carries."""

from __future__ import annotations

import doctest

import pytest

from objcomm._transport import group_ranks
from objcomm._transport.group_ranks import GroupRanks

pytestmark = pytest.mark.timeout(30)


def test_the_docstrings_run():
    found = doctest.testmod(group_ranks)
    assert found.attempted and found.failed == 0


def test_group_ranks_are_the_tuple_with_lookups_by_global_rank():
    """A group of ranks 8190, 3, 8191 of a world of 8192: its group ranks found by one lookup, as tuple.index would
    find them; a rank that is not a member is not in it, and its index raises as a tuple's does."""
    ranks = GroupRanks([8190, 3, 8191])
    assert ranks == (8190, 3, 8191) and hash(ranks) == hash((8190, 3, 8191)) and ranks[2] == 8191
    assert [ranks.index(r) for r in (8190, 3, 8191)] == [0, 1, 2]
    assert 3 in ranks and 4 not in ranks and "3" not in ranks and [3] not in ranks
    with pytest.raises(ValueError):
        ranks.index(4)
    with pytest.raises(ValueError):
        ranks.index(3, 2)  # from a position on: as a tuple's
    with pytest.raises(ValueError):
        ranks.index([3])  # unhashable: no member, as a tuple says
    world = GroupRanks(range(8192))
    assert world.index(8191) == 8191 and list(world) == list(range(8192))
