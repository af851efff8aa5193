"""Which way each part of a call goes: every cut-off that picks a route, as pure functions of numbers.

Nothing here moves a byte or reads a process group. The object API, the transport and the same-host media ask
these functions; :func:`plan` composes them into the whole route of one call from made-up numbers, so that tests
and ``benchmarks/scale_model.py`` can cost a call at any world size without starting a rank.

A call moves in up to two rounds. In round 1 every sender's fixed-size *slot* (``slot_bytes``: a 24-byte prefix,
then the frame when it fits, then the tensor sizes when they fit) reaches its receivers; the *rest* (a frame past
the slot, and every out-of-band tensor) moves in round 2, frame and tensors of one sender back to back.

======================  ===============================================================  ==========================
decision                cut-off                                                          function
======================  ===============================================================  ==========================
express path            default settings, no compression, the same-host channel is the   :func:`express_possible`
                        first-round medium (then: whole frame in the slot, no tensors)
round-1 medium          the same-host channel when ``local`` is on, the group lies on    :func:`round_one`
                        one host and the channel is open; else the backend
ends after round 1      an error report anywhere, or every slot carries its whole        ``limits.round_one_ends``
                        message
receivers answer first  broadcast, send/recv: sizes not listed in the slot, a piece      :func:`agreement_needed`
                        past ``SCRATCH_BYTES``, or a same-host medium may take the rest
                        (on two levels a broadcast's rest past ``SCRATCH_BYTES``: a      :func:`leaders_relay_first`
                        leader relays all of it)
                        (scatter always votes; all_gather and gather read every
                        receiver's limit in round 1 and never do)
rest medium             the channel: round 1 went through it, CPU, the largest rest      :func:`rest_medium`
                        below ``min(shm_threshold, CHANNEL_MOST)``; shared memory: on,
                        CPU, one host, the largest rest at least ``shm_threshold``;
                        else the backend
backend exchange        all_gather's rests: one padded all_gather when                   :func:`exchange_shape`
                        ``world x widest <= PADDED_WITHIN x total``, else one exchange
                        at exact sizes (an uneven all_gather on NCCL, one batch of
                        send/recv on gloo); either in rounds of ``chunk_bytes``. On
                        gloo, stripes (each rest to the ranks whose stripe holds it,
                        then their all_gather) where they save the busiest rank more
                        than W - 1 hops of ``HOP_BYTES``
all_gather's slots      on NCCL from :data:`SUMMED_SLOTS_FROM` ranks: one all_reduce (a    :func:`slots_summed`
                        sum, a tree) of the table, zeros but each rank's own slot
gather's slots          through the backend from :data:`TREE_GATHER_FROM` ranks: up a      :func:`slots_up_tree`
                        binomial tree of send/recv (ceil(log2 W) levels), each slot
                        trimmed to what it carries; below it the backend's gather
                        (every rank to the destination)
two levels              all_gather, gather, broadcast of a CPU group with ``local`` on   :func:`two_levels`
                        that spans hosts, some with two ranks or more: each host's
                        channel to its leader, the leaders on the backend, back
all_reduce's result     back down the reduce tree (send/recv, one message an edge)       :func:`result_down_tree`
                        on NCCL where a broadcast's round 1 would take the backend;
                        else that broadcast (gloo, the channel, two levels)
======================  ===============================================================  ==========================

Example::

    >>> from objcomm._transport import routes
    >>> p = routes.plan("all_gather", routes.Topology(world=8192), rests=[0] * 8190 + [1 << 20, 100 << 20])
    >>> [step.collective for step in p.steps], p.backend_calls
    (['all_gather', 'stripes', 'all_gather'], 3)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import List, Optional, Sequence, Tuple

from objcomm._format.limits import SCRATCH_BYTES
from objcomm._settings import DEFAULT_CHUNK_BYTES, DEFAULT_SHM_THRESHOLD, DEFAULT_SLOT_BYTES

CHANNEL, SHARED_MEMORY, BACKEND = "channel", "shared memory", "backend"  # the media
PADDED, EXACT, STRIPES = "padded", "exact", "stripes"  # the shapes of a backend exchange (exchange_shape)
PADDED_WITHIN = 2  # a padded all_gather moves at most this many times the bytes of an exact one
HOP_BYTES = 64 << 10  # what a rank's link moves in one hop's latency (gloo across hosts: ~50 us at ~1.25 GB/s)
# The largest rest (a gather's: all senders' together) the same-host channel takes, whatever shm_threshold says:
# what a receiver's other threads read meanwhile waits in its stash (objcomm._samehost.inbox.STASH_BYTES, 64 MiB).
CHANNEL_MOST = 16 << 20


# -- the cut-offs --------------------------------------------------------------------------------------------------
def express_possible(*, compression: bool, channel_first: bool) -> bool:
    """Whether a call with default settings may take the express path at all: no compression, and the same-host
    channel is its first-round medium (whether the channel is open, and the object small, is asked per call)."""
    return channel_first and not compression


def round_one(*, local: bool, one_host: bool, channel_open: bool) -> str:
    """The medium of round 1: the same-host channel where it is on and open on a group that lies on one host."""
    return CHANNEL if local and one_host and channel_open else BACKEND


def result_down_tree(*, cpu: bool, forced: bool = False) -> bool:
    """Whether all_reduce's result goes from group rank 0 back down its reduce tree (send/recv, ceil(log2 W) hops:
    :func:`objcomm._transport.broadcast.down_tree`) rather than in a broadcast, where a broadcast's round 1 would
    take the backend: on NCCL, whose broadcast is a ring. Not on gloo, whose broadcast is a binomial tree in C++
    (faster than Python's sends where measured: 4 ranks, 1 MB, 10-12 ms against 7-8). ``forced``: tests (Hooks)."""
    return not cpu or forced


SUMMED_SLOTS_FROM = TREE_GATHER_FROM = 64  # ranks: from here slots_summed (NCCL), slots_up_tree


def slots_summed(*, world: int, cpu: bool, forced: bool = False) -> bool:
    """Whether an all_gather's slots through the backend go in one all_reduce (a sum) of the table, zeros but each
    rank's own slot, rather than an all_gather: on NCCL from :data:`SUMMED_SLOTS_FROM` ranks, where the all_reduce
    is a tree (2 ceil(log2 W) hops, the table twice: 2 x 32 MB at 8192 ranks) and the all_gather a ring (W - 1
    hops). Not on gloo, whose all_reduce is no tree. ``forced``: objcomm's tests (Hooks)."""
    return forced or (not cpu and world >= SUMMED_SLOTS_FROM)


def slots_up_tree(*, world: int, forced: bool = False) -> bool:
    """Whether a gather's round 1 through the backend goes up a binomial tree to the destination
    (:func:`objcomm._transport.slot_tree.gather_up_tree`: lengths a level ahead of the trimmed slots) rather than in
    the backend's gather (W - 1 whole slots into it). From :data:`TREE_GATHER_FROM` ranks (or leaders): below, the
    levels cost more than the fan-in (the model: 1 KB objects near 50 ranks on NCCL, 40 on gloo). ``forced``: tests."""
    return forced or world >= TREE_GATHER_FROM


def two_levels(*, hosts: int, widest: int, cpu: bool, local: bool) -> bool:
    """Whether all_gather and broadcast on a group that spans ``hosts`` hosts (``widest``: the most ranks on one)
    go through two levels (:mod:`objcomm._samehost.two_level`): each host's channel to its leader, one collective
    of the leaders, back through the channel. On CPU wires with ``local`` on, several hosts, and some host with
    two ranks or more; NCCL builds its own hierarchy."""
    return local and cpu and hosts > 1 and widest > 1


def channel_takes(moved: int, *, limit: int, cpu: bool) -> bool:
    """Whether the same-host channel, which carried round 1, takes a rest whose largest sender moves ``moved``
    bytes (``limit``: ``min(shm_threshold, CHANNEL_MOST)``)."""
    return cpu and moved < limit


def shared_memory_takes(moved: int, *, threshold: int, cpu: bool) -> bool:
    """Whether shared memory may take a rest whose largest sender moves ``moved`` bytes, before asking where the
    ranks run (one host) and whether segments open."""
    return cpu and moved >= threshold


def rest_medium(
    moved: int,
    *,
    cpu: bool,
    round_one_medium: str,
    shm: bool = True,
    shm_threshold: int = DEFAULT_SHM_THRESHOLD,
    one_host: bool = True,
) -> str:
    """The medium of round 2 for a rest whose largest sender moves ``moved`` bytes (0: nothing moves)."""
    if moved <= 0:
        return BACKEND
    if round_one_medium == CHANNEL and channel_takes(moved, limit=min(shm_threshold, CHANNEL_MOST), cpu=cpu):
        return CHANNEL
    if shm and one_host and shared_memory_takes(moved, threshold=shm_threshold, cpu=cpu):
        return SHARED_MEMORY
    return BACKEND


def agreement_needed(*, sizes_listed: bool, largest_piece: int, medium_may_take: bool) -> bool:
    """Whether receivers answer a sender before round 2 (a vote, or a send's answer). Not when round 1 listed
    every transfer that follows and none is past the scratch size: a receiver over its limit then drains them
    through one small buffer and raises alone. Decided from the slot alone, so sender and receivers agree."""
    return not sizes_listed or largest_piece > SCRATCH_BYTES or medium_may_take


def leaders_relay_first(*, op: str, moved: int) -> bool:
    """On two levels, whether an ``op`` whose rest is ``moved`` bytes makes its receivers vote first because a leader
    holds all of it to relay it to its host: a broadcast past ``SCRATCH_BYTES`` (a refusing leader would hold it
    whole, past its own ``max_bytes``). The same answer on every rank (the slot's total)."""
    return op == "broadcast" and moved > SCRATCH_BYTES


def exchange_shape(lengths: Sequence[int], *, cpu: bool = False) -> str:
    """How the backend moves every rank's rest to every rank (``lengths``: each rank's rest, 0 for none):
    :data:`PADDED` (one all_gather of the widest) when that moves at most :data:`PADDED_WITHIN` times the bytes,
    else :data:`EXACT` (NCCL: an uneven all_gather; gloo: one batch where each rank sends its rest to every peer).
    On gloo (``cpu``), :data:`STRIPES` instead (:mod:`objcomm._transport.exchange`: each rest to the ranks whose
    stripe of the stream of rests holds it, then the stripes' all_gather) where they save the busiest rank more
    bytes (``max(n_max, c) + (W-1)c``, c = ceil(T/W), against ``(W-1) n_max`` padded, ``max((W-1) n_max, T -
    n_min)`` in a batch) than its link moves in the latency of that all_gather's W - 1 hops (:data:`HOP_BYTES`
    each): one rest that dwarfs the others, or many ranks whose rests differ. The same on every rank; O(W)."""
    world, total, widest = len(lengths), sum(lengths), max(lengths, default=0)
    shape = PADDED if world * widest <= PADDED_WITHIN * total else EXACT
    if not cpu or world < 3:
        return shape
    busiest = (world - 1) * widest if shape == PADDED else max((world - 1) * widest, total - min(lengths))
    width = stripe_width(lengths)
    return STRIPES if busiest - max(widest, width) - (world - 1) * width >= (world - 1) * HOP_BYTES else shape


def stripe_width(lengths: Sequence[int]) -> int:
    """The bytes of each rank's stripe of the stream of every rest (:mod:`objcomm._transport.exchange`): ceil(T/W)."""
    return -(-sum(lengths) // max(len(lengths), 1))


def _up_tree(carried: int, slot: int) -> int:
    """What a slot carrying ``carried`` bytes costs up a gather's tree: its 4-byte length, then its trimmed bytes."""
    return 4 + min(carried, slot)


def pieces(length: int, chunk: int) -> int:
    """How many transfers of at most ``chunk`` bytes move ``length`` bytes (0 for none)."""
    return -(-length // chunk) if length > 0 else 0


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
    ``sum``: an all_reduce of the table of slots, ``gather``, ``gather_tree``: a gather's slots up a binomial tree,
    ``broadcast``, ``all_reduce``, ``vote``: a word's maximum by recursive doubling, then rank 0's broadcast,
    ``p2p``: one batch of sends and receives to one rank, ``tree``: a binomial tree of sends toward group rank 0,
    ceil(log2 W) levels in sequence, ``down_tree``: the same tree's sends the other way); ``medium``: who runs it;
    ``nbytes``: the bytes each rank contributes, in group-rank order (a broadcast's, a tree's, a sum's: one value);
    on two levels, a host's step runs over ``ranks`` (the widest host's), a leaders' step over one rank a host."""

    collective: str
    medium: str
    nbytes: Tuple[int, ...]
    ranks: int = 0  # the ranks it runs over: 0, the group's; else one host's, or the leaders' (two levels)
    across: bool = False  # every hop crosses hosts (the leaders' steps)


@dataclass(frozen=True)
class Plan:
    """The route of one call: its steps, in order."""

    op: str
    round_one: str
    steps: Tuple[Step, ...] = field(default_factory=tuple)

    @property
    def backend_calls(self) -> int:
        """torch.distributed calls on each rank (one batch of send/recv counts once)."""
        return sum(1 for s in self.steps if s.medium == BACKEND)


def plan(
    op: str,
    topology: Topology,
    rests: Sequence[int],
    knobs: Knobs = Knobs(),
    *,
    root: int = 0,
    listed: bool = True,
    carried: Optional[Sequence[int]] = None,
) -> Plan:
    """The route of ``op`` (``all_gather``, ``gather``, ``broadcast``, ``all_reduce``, ``reduce``) when each
    rank's rest (bytes past its slot: 0 when the slot carries all of it) is ``rests`` (broadcast: the root's is
    read; all_reduce and reduce: ``rests[0]`` is the rest of the combined value, which the tree carries up and
    group rank 0 then sends on), with the tensor sizes listed in the slots (``listed``) or only in the frames.
    ``carried``: each slot's bytes up to its last nonzero one, what a gather's slots up the tree are trimmed to
    (None: whole slots). Pure: no process group, O(W)."""
    world = topology.world
    first = round_one(local=knobs.local, one_host=topology.one_host, channel_open=topology.channel_open)

    medium_of = partial(  # the medium of a rest whose largest sender moves n bytes: medium_of(n)
        rest_medium,
        cpu=topology.cpu,
        round_one_medium=first,
        shm=knobs.shm,
        shm_threshold=knobs.shm_threshold,
        one_host=topology.one_host,
    )
    slots = (knobs.slot_bytes,) * world
    steps = []
    k = min(topology.ranks_per_host, world)
    if (
        op in ("all_gather", "gather", "broadcast")
        and topology.channel_open
        and two_levels(hosts=-(-world // k), widest=k, cpu=topology.cpu, local=knobs.local)
    ):
        return Plan(op, CHANNEL, tuple(_two_level_steps(op, topology, list(rests), knobs, root, listed, carried)))
    if op == "all_gather":
        summed = first == BACKEND and slots_summed(world=world, cpu=topology.cpu)
        steps.append(Step("sum", BACKEND, (world * knobs.slot_bytes,)) if summed else Step("all_gather", first, slots))
        moved = max(rests, default=0)
        medium = medium_of(moved)
        if moved:
            steps.extend(_exchange(medium, list(rests), topology, knobs))
    elif op == "gather":
        if first == CHANNEL:
            steps.append(Step("all_gather", CHANNEL, slots))
        else:
            # the destination's word: a broadcast on gloo (a binomial tree), an all_reduce on NCCL (a tree)
            word = "broadcast" if topology.cpu else "all_reduce"
            if slots_up_tree(world=world):  # trimmed to what each carries, with its length (gather_up_tree)
                held = carried if carried is not None else slots
                steps.append(Step("gather_tree", BACKEND, tuple(_up_tree(n, knobs.slot_bytes) for n in held)))
            else:
                steps.append(Step("gather", BACKEND, slots))
            steps.append(Step(word, BACKEND, (8,)))
        total = sum(r for i, r in enumerate(rests) if i != root)
        medium = medium_of(total)
        if total:
            steps.append(Step("p2p", medium, tuple(0 if i == root else r for i, r in enumerate(rests))))
    elif op == "broadcast":  # the slot: on NCCL an all_reduce (a tree; its broadcast is a ring)
        slot_step = "all_reduce" if first == BACKEND and not topology.cpu else "broadcast"
        steps.append(Step(slot_step, first, (knobs.slot_bytes,)))
        moved = rests[root]
        if moved:
            medium = medium_of(moved)
            largest = min(moved, knobs.chunk_bytes)
            if agreement_needed(sizes_listed=listed, largest_piece=largest, medium_may_take=medium != BACKEND):
                vote = "vote" if first == BACKEND and topology.cpu else "all_reduce"  # gloo: recursive doubling
                steps.append(Step(vote, first, (4,) * world))
            steps += [
                Step("broadcast", medium, (min(knobs.chunk_bytes, moved - at),))
                for at in range(0, moved, knobs.chunk_bytes)
            ]
    elif op in ("all_reduce", "reduce"):
        # a tree of send/recv (objcomm._api.reduce.tree; each carries a slot and its rest), then all_reduce: group
        # rank 0's value or failure back down the tree or broadcast; reduce: a gather of every rank's report to the root
        steps.append(Step("tree", BACKEND, (knobs.slot_bytes + rests[0],)))
        if op == "all_reduce":
            result = plan("broadcast", topology, rests, knobs, root=0, listed=listed)
            if result.round_one == BACKEND and result_down_tree(cpu=topology.cpu):
                return Plan(op, first, (*steps, Step("down_tree", BACKEND, (knobs.slot_bytes + rests[0],))))
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
        return [Step(s.collective, s.medium, s.nbytes, len(hosts), True) for s in steps]

    def relay(n: int) -> List[Step]:  # one rank's n bytes to every rank: its host, the leaders, the other hosts
        pieces = [min(knobs.chunk_bytes, n - at) for at in range(0, n, knobs.chunk_bytes)]
        return [
            Step("broadcast", CHANNEL, (n,), k),
            *across([Step("broadcast", BACKEND, (p,)) for p in pieces]),
            Step("broadcast", CHANNEL, (n,), k),
        ]

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
            steps += [
                Step("gather", CHANNEL, tuple(max(hosts, key=sum)), k),
                *across(_exchange(BACKEND, [sum(h) for h in hosts], leaders, knobs)),
                Step("broadcast", published(sum(rests)), (sum(rests),), k),
            ]
        return steps
    if op == "gather":
        home = root // k
        if slots_up_tree(world=len(hosts)):  # the leaders' tree, each slot trimmed (with its length)
            held = list(carried) if carried is not None else [slot] * world
            trimmed = [sum(_up_tree(n, slot) for n in held[h : h + k]) for h in range(0, world, k)]
            leaders_step = Step("gather_tree", BACKEND, tuple(trimmed))
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
                *across([Step("vote", BACKEND, (4,) * len(hosts))]),
                Step("broadcast", CHANNEL, (8,), k),
            ]
        steps += relay(sent)
    return steps
