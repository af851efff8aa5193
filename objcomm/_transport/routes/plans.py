"""A call's whole route (:func:`plan`), composed from the cut-offs of :mod:`objcomm._transport.routes.cutoffs`:
the steps of one call as a :class:`Plan`, from made-up numbers (no process group), for tests and
``benchmarks/scale_model.py``."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from functools import partial
from typing import List, NamedTuple, Optional, Sequence, Tuple

from objcomm._settings import DEFAULT_CHUNK_BYTES, DEFAULT_SHM_THRESHOLD, DEFAULT_SLOT_BYTES
from objcomm._transport.routes.calls import call_route
from objcomm._transport.routes.cutoffs import (
    ANNOUNCED_FROM,
    BACKEND,
    CHANNEL,
    PADDED,
    SHARED_MEMORY,
    SLOT_TREE_RADIX,
    STRIPES,
    agreement_needed,
    all_announce,
    backend_room,
    backend_whole,
    exchange_shape,
    in_place_table,
    leaders_relay_first,
    leaders_spread,
    rest_medium,
    round_one,
    shared_memory_takes,
    slots_up_tree,
    stripe_width,
    tree_piece,
    two_levels,
)


class StripeMoves(NamedTuple):
    """What one rank moves in step 1 of :func:`objcomm._transport.exchange.by_stripes`, in stream bytes ``(peer,
    start, end)``: ``sends`` (pieces of its rest, to the stripes' owners), ``receives`` (pieces of other ranks' rests
    in its stripe), ``kept`` (the pieces of its rest in its own stripe, copied); ``stripe`` its stripe's ``(start,
    end)``, clipped to the stream."""

    sends: List[Tuple[int, int, int]]
    receives: List[Tuple[int, int, int]]
    kept: List[Tuple[int, int, int]]
    stripe: Tuple[int, int]


def stripe_moves(offsets: Sequence[int], me: int, width: int) -> StripeMoves:
    """Rank ``me``'s moves when the rests lie at ``offsets`` (``[0, n_0, n_0 + n_1, ..., T]``) in stripes of
    ``width`` bytes (:func:`~objcomm._transport.routes.cutoffs.stripe_width`). Pure, O(W) at most: the stripes
    ``me``'s rest crosses, and the ranks whose rests cross ``me``'s stripe (found by bisection)."""
    world, total = len(offsets) - 1, offsets[-1]
    lo, hi = min(me * width, total), min((me + 1) * width, total)
    start, end = offsets[me], offsets[me + 1]
    mine = [] if start == end else range(start // width, -(-end // width))
    crossed = [(j, max(start, j * width), min(end, (j + 1) * width)) for j in mine]
    receives = []
    for sender in range(max(bisect.bisect_right(offsets, lo) - 1, 0), world):  # the first whose rest reaches lo
        if offsets[sender] >= hi:
            break
        first, last = max(offsets[sender], lo), min(offsets[sender + 1], hi)
        if sender != me and first < last:
            receives.append((sender, first, last))
    sends = [move for move in crossed if move[0] != me]
    return StripeMoves(sends, receives, [move for move in crossed if move[0] == me], (lo, hi))


def _up_tree(carried: int, slot: int) -> int:
    """What a slot carrying ``carried`` bytes costs up a gather's tree: its 4-byte length, then its trimmed bytes."""
    return 4 + min(carried, slot)


# -- a call's whole route -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Topology:
    """Where a group's ranks run: ``world`` ranks, ``ranks_per_host`` consecutive ranks per host, on the CPU
    (gloo) or a GPU (NCCL), and whether the same-host channel is open on it."""

    world: int
    ranks_per_host: int = 1
    device: str = "cpu"
    channel_open: bool = True

    @property
    def one_host(self) -> bool:
        return self.ranks_per_host >= self.world

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"


@dataclass(frozen=True)
class Knobs:
    """The resolved settings that pick routes (see :class:`objcomm.Settings`)."""

    slot_bytes: int = DEFAULT_SLOT_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    local: bool = True
    shm: bool = True
    shm_threshold: int = DEFAULT_SHM_THRESHOLD


@dataclass(frozen=True)
class Step:
    """One transfer of a plan. ``collective``: what runs (``all_gather``, ``all_gatherv``: exact sizes,
    ``stripes``: each rank's rest to the ranks whose stripes hold it (gloo's exact exchange, then an all_gather),
    ``sum``: an all_reduce of the table of slots, ``gather``, ``gather_tree``: a gather's slots up a tree of ``radix``,
    ``broadcast``, ``spread``: a broadcast as a scatter, then an all_gather (send/recv), ``all_reduce``, ``vote``: a
    word's maximum by recursive doubling, then rank 0's broadcast,
    ``p2p``: one batch of sends and receives to one rank, ``tree``: a binomial tree of sends toward group rank 0,
    ceil(log2 W) levels in sequence, ``down_tree``: the same tree's sends the other way); ``medium``: who runs it;
    ``nbytes``: the bytes each rank contributes, in group-rank order (a broadcast's, a tree's, a sum's: one value);
    on two levels, a host's step runs over ``ranks`` (the widest host's), a leaders' step over one rank a host."""

    collective: str
    medium: str
    nbytes: Tuple[int, ...]
    ranks: int = 0  # the ranks it runs over: 0, the group's; else one host's, or the leaders' (two levels)
    across: bool = False  # every hop crosses hosts (the leaders' steps)
    calls: int = (
        1  # torch.distributed calls on its busiest rank: a vote's (vote_calls), a tree's (tree_calls), else one
    )
    messages: int = 1  # a reduction tree's: the messages one after another on each edge (tree_messages)
    radix: int = 2  # a tree's (gather_tree, tree, down_tree): its radix (objcomm._transport.patterns.knomial)


@dataclass(frozen=True)
class Plan:
    """The route of one call: its steps, in order."""

    op: str
    round_one: str
    steps: Tuple[Step, ...] = field(default_factory=tuple)

    @property
    def backend_calls(self) -> int:
        """Steps through the backend: each a torch.distributed call on a rank (one batch of send/recv counts once), but
        a vote on gloo, which counts once here and makes :func:`vote_calls` (see :attr:`torch_calls`)."""
        return sum(1 for s in self.steps if s.medium == BACKEND)

    @property
    def torch_calls(self) -> int:
        """torch.distributed calls on the busiest rank (a batch of send/recv counts once): a rank with nothing to send
        or receive in a step skips it, so others may make fewer. Checked against the transport's calls for every
        operation (tests/transport/test_many_ranks.py)."""
        return sum(s.calls for s in self.steps if s.medium == BACKEND)


def vote_calls(ranks: int) -> int:
    """The calls of a vote on gloo over ``ranks`` ranks (:func:`objcomm._transport.base.largest_of`) on its busiest
    rank: one all_reduce up to 2 ranks; else a rank below the largest power of two P <= W takes the words of its partner
    past it (where W > P), then log2(P) pairwise exchanges, then group rank 0's answer in one broadcast."""
    if ranks <= 2:
        return 1
    below = 1 << (ranks.bit_length() - 1)
    return (ranks > below) + below.bit_length() - 1 + 1


def spread_calls(ranks: int) -> int:
    """The calls of a spread over ``ranks`` ranks (:func:`objcomm._transport.patterns.spread`) on its busiest rank, a
    relay: its blocks from its parent, its subtree's to its children, then ceil(log2 W) steps of the all_gather."""
    return 2 + (ranks - 1).bit_length()


def tree_messages(
    rest: int, *, cpu: bool, listed: bool, chunk: int, tensors: bool = False, backend: bool = True
) -> int:
    """The messages, one after another, on each edge of a binomial tree of sends (a reduction's way up, or its result's
    way down) whose message has a rest of ``rest`` bytes (``tensors``: out-of-band tensors among them): one where the
    slot carries all or the rest comes with it (:func:`~objcomm._transport.routes.cutoffs.backend_whole`); else the
    slot, the receiver's answer where one is due (sizes not listed, or pieces past ``SCRATCH_BYTES``:
    :func:`~objcomm._transport.routes.cutoffs.tree_piece`), and one batch for the rest
    (:func:`objcomm._transport.p2p.tree_send`). ``backend``: the slots go through the backend (else the same-host
    channel's route, where a GPU group's rest never comes with its slot, and its receiver always answers first: the
    rest goes through the backend)."""
    if rest == 0:
        return 1
    agreed = agreement_needed(
        sizes_listed=listed, largest_piece=min(rest, tree_piece(chunk, rest)), medium_may_take=False
    )
    agreed = agreed or not (cpu or backend)
    return 1 if backend_whole(rest, cpu=cpu, agreed=agreed, tree=backend, tensors=tensors) else 2 + agreed


def tree_calls(world: int, rest: int, *, cpu: bool, listed: bool, chunk: int, tensors: bool = False) -> int:
    """The calls of a binomial tree of sends on its busiest rank, group rank 0: ceil(log2 W) messages, each of
    :func:`tree_messages` calls."""
    return (world - 1).bit_length() * tree_messages(rest, cpu=cpu, listed=listed, chunk=chunk, tensors=tensors)


# the envelope before a slot through a CPU group's backend, or a GPU group's tree (objcomm._transport.p2p.ENVELOPE)
ENVELOPE_BYTES = 8


def tree_held(rest: int, *, slot: int, padded: bool, whole: bool) -> int:
    """The bytes a tree's edge moves for a message with a rest of ``rest`` bytes (``whole``: the rest comes with its
    slot): the slot and its rest; through a GPU group's backend (``padded``) every message is also padded to its room
    (:func:`~objcomm._transport.routes.cutoffs.backend_room`, with its 8-byte envelope)."""
    return (
        ENVELOPE_BYTES + slot + backend_room(cpu=False, tree=True) + (0 if whole else rest) if padded else slot + rest
    )


def plan(
    op: str,
    topology: Topology,
    rests: Sequence[int],
    knobs: Knobs = Knobs(),
    *,
    root: int = 0,
    listed: bool = True,
    carried: Optional[Sequence[int]] = None,
    tensors: bool = False,
) -> Plan:
    """The route of ``op`` (``all_gather``, ``gather``, ``broadcast``, ``all_reduce``, ``reduce``) when each
    rank's rest (bytes past its slot: 0 when the slot carries all of it) is ``rests`` (broadcast: the root's is
    read; all_reduce and reduce: ``rests[0]`` is the rest of the combined value, which the tree carries up and
    group rank 0 then sends on), with the tensor sizes listed in the slots (``listed``) or only in the frames.
    ``carried``: each slot's bytes up to its last nonzero one, what a gather's slots up the tree are trimmed to
    (None: whole slots); ``tensors``: the rests hold out-of-band tensors (a GPU group's tree never sends them with
    the slot). Pure: no process group, O(W)."""
    world = topology.world
    first = round_one(local=knobs.local, one_host=topology.one_host, channel_open=topology.channel_open)
    route = call_route(world=world, cpu=topology.cpu, slot=knobs.slot_bytes)  # (what the transport carries out)

    medium_of = partial(  # the medium of a rest whose largest sender moves n bytes: medium_of(n)
        rest_medium,
        cpu=topology.cpu,
        round_one_medium=first,
        shm=knobs.shm,
        shm_threshold=knobs.shm_threshold if knobs.local else max(knobs.shm_threshold, ANNOUNCED_FROM),
        one_host=topology.one_host,
    )
    slots = (knobs.slot_bytes,) * world
    steps = []
    k = min(topology.ranks_per_host, world)
    hosts = -(-world // k)  # of k consecutive ranks (the last may hold fewer)
    leveled = topology.channel_open and two_levels(hosts=hosts, widest=k, cpu=topology.cpu, local=knobs.local)
    if op in ("all_gather", "gather", "broadcast") and leveled:
        return Plan(op, CHANNEL, tuple(_two_level_steps(op, topology, list(rests), knobs, root, listed, carried)))
    # without the channel on one host (objcomm._samehost.voted_rests), every rank takes part in shared memory's
    # announcement of a collective's rest from ANNOUNCED_FROM: one all_gather of 1 + W words through the backend, where
    # it then moves (the rank declines: its settings do not take it); a gather's destination first sends every
    # rank the slots
    announced = partial(all_announce, cpu=not knobs.local and topology.cpu and topology.one_host)  # of the largest
    settled = Step("all_gather", BACKEND, (8 * (1 + world),) * world)
    if op == "all_gather":
        summed = first == BACKEND and route.summed
        steps.append(Step("sum", BACKEND, (world * knobs.slot_bytes,)) if summed else Step("all_gather", first, slots))
        moved = max(rests, default=0)
        medium = medium_of(moved)
        if moved:
            declined = announced(moved) and medium == BACKEND
            steps.extend(([settled] if declined else []) + _exchange(medium, list(rests), topology, knobs))
    elif op == "gather":
        if first == CHANNEL:
            steps.append(Step("all_gather", CHANNEL, slots))
        else:
            # the destination's word: on NCCL back down the slots' tree where they took it (route.word_down), else
            # an all_reduce (a tree up and down: its broadcast is a ring); on gloo a broadcast (a binomial tree)
            radix = route.up_tree
            if radix:  # trimmed to what each carries, with its length (gather_up_tree)
                held = carried if carried is not None else slots
                trimmed = tuple(_up_tree(n, knobs.slot_bytes) for n in held)
                steps.append(Step("gather_tree", BACKEND, trimmed, radix=radix))
            else:
                steps.append(Step("gather", BACKEND, slots))
            if route.word_down:
                relays = world > radix + 1  # (the first relay: rank 4, over rank 5)
                steps.append(Step("down_tree", BACKEND, (8,), calls=2 if relays else 1, radix=radix))
            else:
                steps.append(Step("broadcast" if topology.cpu else "all_reduce", BACKEND, (8,)))
        senders = [0 if i == root else r for i, r in enumerate(rests)]
        total = sum(senders)
        medium = medium_of(max(senders), gathered=total)
        if total:
            if announced(max(senders)):  # the destination says look: every slot to every rank, then the announcement
                look = Step("broadcast", BACKEND, (world * knobs.slot_bytes,))
                steps += [look, settled] if medium == BACKEND else [look]
            steps.append(Step("p2p", medium, tuple(0 if i == root else r for i, r in enumerate(rests))))
    elif op == "broadcast":  # the slot: on NCCL an all_reduce (a tree; its broadcast is a ring)
        nccl = first == BACKEND and not topology.cpu  # an all_reduce of its int64 words, then the receivers' limit
        slot = 8 * -(-knobs.slot_bytes // 8) + 8 if nccl else knobs.slot_bytes  # (broadcast._slot_and_limits)
        steps.append(Step("all_reduce" if nccl else "broadcast", first, (slot,)))
        moved = rests[root]
        if moved:
            medium = medium_of(moved)
            largest = min(moved, knobs.chunk_bytes)
            may_take = medium != BACKEND and knobs.local  # (without the channel: the slot decides, then the vote)
            agreed = agreement_needed(sizes_listed=listed, largest_piece=largest, medium_may_take=may_take)
            if agreed:
                if first == BACKEND and topology.cpu:  # gloo: recursive doubling, then a broadcast
                    steps.append(Step("vote", first, (4,) * world, calls=vote_calls(world)))
                elif not (first == BACKEND and route.limits_with_slot):  # (NCCL: the limits came with it)
                    steps.append(Step("all_reduce", first, (4,) * world))
            steps += [settled] if announced(moved) and medium == BACKEND else []
            # as a scatter, then an all_gather (one rest, one part: a relay takes, passes on, then ceil(log2 W) steps)
            if medium == BACKEND and route.rest_spread(moved, agreed=agreed):
                return Plan(op, first, (*steps, Step("spread", BACKEND, (moved,), calls=spread_calls(world))))
            # each piece in the backend's broadcast, or down the binomial tree from the root: then a relay takes it
            # in one batch and sends it on in another
            tree = medium == BACKEND and route.rest_down_tree(moved)
            kind, calls = ("down_tree", 2 if world > 3 else 1) if tree else ("broadcast", 1)
            steps += [
                Step(kind, medium, (min(knobs.chunk_bytes, moved - at),), calls=calls)
                for at in range(0, moved, knobs.chunk_bytes)
            ]
    elif op in ("all_reduce", "reduce"):
        # a tree of send/recv (objcomm._api.reduce.tree; each carries a slot and its rest), then all_reduce: group
        # rank 0's value or failure back down the tree or broadcast; reduce: a gather of every rank's report to the root
        # (on one host the slots take the channel's route: a GPU group's tree pads messages only through the backend)
        backend = first != CHANNEL or leveled
        edge = tree_messages(
            rests[0], cpu=topology.cpu, listed=listed, chunk=knobs.chunk_bytes, tensors=tensors, backend=backend
        )
        held = (tree_held(rests[0], slot=knobs.slot_bytes, padded=backend and not topology.cpu, whole=edge == 1),)
        calls = (world - 1).bit_length() * edge
        if leveled:  # each host's tree over its channel, then the leaders' (tree_on_two_levels: hosts consecutive)
            across = (hosts - 1).bit_length() * edge  # (a CPU group's: the leaders' tree through the backend)
            steps += [Step("tree", CHANNEL, held, k), Step("tree", BACKEND, held, hosts, True, across, edge)]
        elif first == CHANNEL and topology.cpu:  # one host: the tree's sends take the channel, as every send there
            steps.append(Step("tree", CHANNEL, held))  # (on a GPU their rests go through the backend: not drawn here)
        else:
            steps.append(Step("tree", BACKEND, held, calls=calls, messages=edge))
        if op == "all_reduce":
            if leveled and route.result_down(hosts):  # the leaders' tree, then each host's
                across_down = Step("down_tree", BACKEND, held, hosts, True, across, edge)
                return Plan(op, first, (*steps, across_down, Step("down_tree", CHANNEL, held, k)))
            result = plan("broadcast", topology, rests, knobs, root=0, listed=listed)
            if result.round_one == BACKEND and route.result_down():
                return Plan(op, first, (*steps, Step("down_tree", BACKEND, held, calls=calls, messages=edge)))
            return Plan(op, first, (*steps, *result.steps))
        sent = [rests[0] if r == 0 and root != 0 else 0 for r in range(world)]
        return Plan(op, first, (*steps, *plan("gather", topology, sent, knobs, root=root).steps))
    else:
        raise ValueError(f"plan({op!r}): plans cover all_gather, gather, broadcast, all_reduce and reduce")
    return Plan(op, first, tuple(steps))


def _exchange(medium: str, rests: List[int], topology: Topology, knobs: Knobs) -> List[Step]:
    """The steps that move every rank's rest to every rank through ``medium``."""
    if medium != BACKEND:
        return [Step("all_gatherv", medium, tuple(rests))]
    widest, chunk, shape = max(rests), knobs.chunk_bytes, exchange_shape(rests, cpu=topology.cpu)
    if shape == PADDED:
        return [Step("all_gather", BACKEND, (min(chunk, widest - at),) * len(rests)) for at in range(0, widest, chunk)]
    if shape == STRIPES:  # each rest to the stripes that hold it, then the stripes' all_gather
        width = stripe_width(rests)
        steps = [Step("all_gather", BACKEND, (min(chunk, width - at),) * len(rests)) for at in range(0, width, chunk)]
        return [Step("stripes", BACKEND, tuple(rests)), *steps]
    if topology.cpu:  # gloo: one batch of sends and receives
        return [Step("all_gatherv", BACKEND, tuple(rests))]
    return [  # NCCL: an uneven all_gather per round of at most chunk bytes per rank
        Step("all_gatherv", BACKEND, tuple(max(0, min(chunk, r - at)) for r in rests)) for at in range(0, widest, chunk)
    ]


def _two_level_steps(
    op: str,
    topology: Topology,
    rests: List[int],
    knobs: Knobs,
    root: int,
    listed: bool,
    carried: Optional[Sequence[int]] = None,
) -> List[Step]:
    """The steps of ``op`` through two levels (:mod:`objcomm._samehost.two_level`): the channel inside each host (a
    step over the widest host's ranks), the leaders across them; every host's steps run at once."""
    world, k, slot = topology.world, min(topology.ranks_per_host, topology.world), knobs.slot_bytes
    hosts = [rests[h : h + k] for h in range(0, world, k)]
    leaders = Topology(world=len(hosts), device=topology.device)

    def across(steps: List[Step]) -> List[Step]:
        return [replace(s, ranks=len(hosts), across=True) for s in steps]

    def relay(n: int, agreed: bool = False) -> List[Step]:  # one rank's n bytes to every rank: its host, the
        # leaders (after a vote, spread where leaders_spread says so), the other hosts
        pieces = [min(knobs.chunk_bytes, n - at) for at in range(0, n, knobs.chunk_bytes)]
        if leaders_spread(leaders=len(hosts), moved=n, agreed=agreed):
            leaders_steps = [Step("spread", BACKEND, (n,), calls=spread_calls(len(hosts)))]
        else:
            leaders_steps = [Step("broadcast", BACKEND, (p,)) for p in pieces]
        return [Step("broadcast", CHANNEL, (n,), k), *across(leaders_steps), Step("broadcast", CHANNEL, (n,), k)]

    def published(n: int) -> str:  # how a leader hands an all_gather's n bytes to its host: one shared file, or not
        shared = knobs.shm and shared_memory_takes(n, threshold=knobs.shm_threshold, cpu=True)
        return SHARED_MEMORY if shared else CHANNEL

    if op == "all_gather":
        table = len(hosts) * k * slot
        steps = [
            Step("gather", CHANNEL, (slot,) * k, k),
            *across([Step("all_gather", BACKEND, (k * slot,) * len(hosts))]),
            Step("broadcast", published(table), (table,), k),
        ]
        if max(rests, default=0):
            totals = [sum(h) for h in hosts]
            medium = published(sum(rests))
            # a shared file the leaders' padded all_gather wrote in place: handed over, nothing copied on the host
            copied = 0 if medium == SHARED_MEMORY and in_place_table(totals, cpu=topology.cpu) else sum(rests)
            steps += [
                Step("gather", CHANNEL, tuple(max(hosts, key=sum)), k),
                *across(_exchange(BACKEND, totals, leaders, knobs)),
                Step("broadcast", medium, (copied,), k),
            ]
        return steps
    if op == "gather":
        home = root // k
        if slots_up_tree(world=len(hosts)):  # the leaders' tree, each slot trimmed (with its length)
            held = list(carried) if carried is not None else [slot] * world
            trimmed = [sum(_up_tree(n, slot) for n in held[h : h + k]) for h in range(0, world, k)]
            leaders_step = Step("gather_tree", BACKEND, tuple(trimmed), radix=SLOT_TREE_RADIX)
        else:
            leaders_step = Step("gather", BACKEND, (k * slot,) * len(hosts))
        steps = [Step("gather", CHANNEL, (slot,) * k, k), *across([leaders_step])]
        if root % k:
            steps.append(Step("p2p", CHANNEL, (len(hosts) * k * slot,), k))
        steps += relay(8)  # the destination's word
        moved = [0 if r == root else n for r, n in enumerate(rests)]
        if sum(moved):
            totals = [sum(moved[h : h + k]) for h in range(0, world, k)]
            busiest = max(range(len(hosts)), key=lambda h: totals[h])
            steps += [
                Step("p2p", CHANNEL, tuple(moved[busiest * k : busiest * k + k]), k),
                *across([Step("p2p", BACKEND, tuple(0 if h == home else t for h, t in enumerate(totals)))]),
            ]
            if root % k:
                steps.append(Step("p2p", CHANNEL, (sum(moved),), k))
        return steps
    steps = relay(slot)  # broadcast
    sent = rests[root]
    if sent:
        relayed = leaders_relay_first(op="broadcast", moved=sent)
        if agreement_needed(sizes_listed=listed, largest_piece=min(sent, knobs.chunk_bytes), medium_may_take=relayed):
            steps += [
                Step("gather", CHANNEL, (8,) * k, k),
                *across([Step("vote", BACKEND, (4,) * len(hosts), calls=vote_calls(len(hosts)))]),
                Step("broadcast", CHANNEL, (8,), k),
            ]
        steps += relay(sent, agreed=relayed)
    return steps
