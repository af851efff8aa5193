"""A group's global ranks in group-rank order (:class:`GroupRanks`), as a :class:`~objcomm._transport.base.Wire` carries
them: one lookup from a global rank to its group rank, where every send/recv names its peer by global rank."""

from __future__ import annotations

import functools
from typing import Any, Dict


class GroupRanks(tuple):  # type: ignore[type-arg]
    """A group's global ranks in group-rank order, whose :meth:`index` (a global rank's group rank) and ``in`` take
    one lookup, not a scan of W ranks: every send/recv names its peer by global rank.

    >>> ranks = GroupRanks((4, 9, 2))
    >>> ranks.index(2), 9 in ranks, 5 in ranks, ranks[1]
    (2, True, False, 9)
    """

    @functools.cached_property
    def places(self) -> Dict[int, int]:
        """Global rank -> group rank, built once (a group's GroupRanks is kept with its facts: ``call.membership``)."""
        return {rank: place for place, rank in enumerate(self)}

    def index(self, rank: Any, *args: Any) -> int:
        try:
            found = None if args else self.places.get(rank)
        except TypeError:  # (unhashable)
            found = None
        return super().index(rank, *args) if found is None else found  # a miss: a tuple's answer, or its error

    def __contains__(self, rank: object) -> bool:
        try:
            if rank in self.places:
                return True
        except TypeError:  # (unhashable)
            pass
        return super().__contains__(rank)  # a miss: a tuple's answer (what compares equal to a member)
