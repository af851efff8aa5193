"""The route a group's calls take through the backend (:class:`CallRoute`): made once per group, slot setting and
forced routes (:func:`call_route`), before any round 1; the transport carries it out, and :func:`~.plans.plan`
costs the same object.

What a call can know before its round 1 (the world size, the device, the slot) is decided here once: whether an
all_gather's slots go in one all_reduce, the tree a gather's slots go up, whether a broadcast's round 1 brings the
receivers' limits, each part's slot of a scatter. What depends on what round 1 brings (a rest's size, the
receivers' vote, the leaders two levels found) its methods answer, pure functions of those numbers. The cut-offs'
constants are read when the route is made: a test that changes one on live ranks clears the routes its groups keep
(``group_facts(group).routes``), or uses a new group.

Example::

    >>> r = call_route(world=8192, cpu=False, slot=4096)
    >>> r.summed, r.up_tree, r.word_down, r.part_slot, r.limits_with_slot
    (True, 4, True, 512, True)
    >>> r.rest_down_tree(1 << 20), r.rest_spread(1 << 20, agreed=True), r.result_down()
    (True, True, True)
    >>> call_route(world=2, cpu=True, slot=4096).summed
    False
"""

from __future__ import annotations

from typing import NamedTuple

from objcomm._transport.routes.cutoffs import (
    BACKEND,
    SLOT_TREE_RADIX,
    limits_with_slot,
    part_slot,
    rest_down_tree,
    rest_spread,
    result_down_tree,
    slots_summed,
    slots_up_tree,
    word_down_tree,
)


class Forced(NamedTuple):
    """Routes objcomm's own tests take at any size (a communicator's ``Hooks``): each true one forces its cut-off's
    way; ``tree_radix`` gives the gather tree's radix (0: :data:`SLOT_TREE_RADIX`)."""

    summed: bool = False  # slots_summed
    up_tree: bool = False  # slots_up_tree and word_down_tree
    tree_radix: int = 0
    down_tree: bool = False  # result_down_tree
    rest_tree: bool = False  # rest_down_tree
    rest_spread: bool = False  # rest_spread
    limits_with_slot: bool = False  # limits_with_slot


NOT_FORCED = Forced()


class CallRoute(NamedTuple):
    """How the calls of a group of ``world`` ranks on the CPU (gloo) or a GPU (NCCL) go where round 1 takes the
    backend (:func:`call_route` makes it, for one slot setting: the settings' ``slot_bytes``)."""

    world: int
    cpu: bool
    forced: Forced
    summed: bool  # all_gather: the slots in one all_reduce of the table (slots_summed)
    up_tree: int  # gather: the radix of the tree its slots go up (0: the backend's gather; slots_up_tree)
    word_down: bool  # gather: its destination's word back down that tree (word_down_tree)
    limits_with_slot: bool  # broadcast: round 1 brings every receiver's max_bytes (limits_with_slot)
    part_slot: int  # scatter, all_to_all: each part's slot (part_slot)

    def result_down(self, leaders: int = 0) -> bool:
        """all_reduce: its result back down the reduce tree (``leaders``: the hosts its tree climbed on two levels,
        0 on one): :func:`~.cutoffs.result_down_tree`."""
        return result_down_tree(cpu=self.cpu, forced=self.forced.down_tree, leaders=leaders)

    def rest_down_tree(self, moved: int) -> bool:
        """broadcast: a rest of ``moved`` bytes down the binomial tree from its source
        (:func:`~.cutoffs.rest_down_tree`)."""
        return rest_down_tree(world=self.world, moved=moved, cpu=self.cpu, forced=self.forced.rest_tree)

    def rest_spread(self, part: int, *, agreed: bool) -> bool:
        """broadcast: one part of its rest as a scatter, then an all_gather, where the receivers answered first
        (``agreed``): :func:`~.cutoffs.rest_spread`."""
        return rest_spread(world=self.world, part=part, cpu=self.cpu, agreed=agreed, forced=self.forced.rest_spread)


def call_route(*, world: int, cpu: bool, slot: int, forced: Forced = NOT_FORCED) -> CallRoute:
    """The route of a group's calls through the backend: pure, O(1)."""
    up = slots_up_tree(world=world, forced=forced.up_tree)
    return CallRoute(
        world=world,
        cpu=cpu,
        forced=forced,
        summed=slots_summed(world=world, cpu=cpu, forced=forced.summed),
        up_tree=(forced.tree_radix or SLOT_TREE_RADIX) if up else 0,
        word_down=up and word_down_tree(cpu=cpu, forced=forced.up_tree),
        limits_with_slot=forced.limits_with_slot or limits_with_slot(cpu=cpu, slot_medium=BACKEND),
        part_slot=part_slot(world=world, slot=slot),
    )
