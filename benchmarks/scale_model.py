"""What objcomm's routes cost at 8 to 8192 ranks, under an alpha-beta model: no rank is started.

    python benchmarks/scale_model.py                      # every op, case, W and parameter set: a markdown table
    python benchmarks/scale_model.py --world 8192         # one world size
    python benchmarks/scale_model.py --case log-normal    # one spread of sizes, across W
    python benchmarks/scale_model.py --json               # rows {op, case, W, params, objcomm_s, ideal_s, torch_s}
    python benchmarks/scale_model.py --flat               # no same-host channel: gloo's routes without two levels
    python benchmarks/scale_model.py --check              # exit 1, listing the W=8192 rows that miss the target
    python benchmarks/scale_model.py --radix-table        # a gather tree's climb per radix and CPU cost a message

For each op (all_gather, gather, all_reduce, broadcast), each spread of per-rank payload sizes (:data:`CASES`),
each world size (:data:`WORLDS`) and each parameter set (:data:`NCCL`, :data:`GLOO`), the script asks the real
:func:`objcomm._transport.routes.plan` for the route of the call, with synthetic sizes, and costs every step of it
(the round-1 slot steps too) with the formulas below. It costs two references next to it:

* ``ideal``: the best known collective of the same payloads at exact sizes, with no second round
  (all_gather: one ring allgatherv; gather: a binomial-tree gather; all_reduce: a tree reduce and a pipelined tree
  broadcast of the value; broadcast: a pipelined tree broadcast);
* ``torch``: torch.distributed's object collectives as they are written (``all_gather_object``: an all_gather of
  the sizes, then an all_gather padded to the largest; ``gather_object``: the same sizes all_gather, then a gather
  padded to the largest; ``broadcast_object_list``: a broadcast of the size, then of the payload). torch has no
  object all_reduce: the model charges what users write instead, an ``all_gather_object`` of every rank's value
  followed by a local reduce (the local reduce is not charged).

The target (the project issue): at W=8192, every all_gather, gather and all_reduce within 1.5x of ``ideal`` and
never above ``torch``. ``--check`` lists the rows that miss it. ``docs/scaling.md`` shows the output and says
what bounds each case. Absolute times mean little: the model has no congestion, no contention between steps, no
connection set-up and no serialization cost; it ranks routes against each other.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass, replace
from itertools import accumulate
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

try:
    import objcomm  # noqa: F401
except ImportError:  # run from a checkout without PYTHONPATH=.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from objcomm._format.message import SLOT_PREFIX_BYTES  # noqa: E402
from objcomm._transport import routes  # noqa: E402
from objcomm._transport.patterns import knomial  # noqa: E402

KB, MB, GB = 1 << 10, 1 << 20, 1 << 30

# -- parameters ------------------------------------------------------------------------------------------------
RANKS_PER_NODE = 8  # consecutive ranks per host; a group of more spans hosts, and every hop then pays alpha_inter


def _frame_overhead() -> int:
    """The bytes objcomm's frame adds to a pickled payload, measured on this code: the encoded frame of a dict of
    1,000 numbers (pickle) less that dict's pickle (46 bytes: the frame's header and the serializer's name)."""
    import pickle

    from objcomm._format import frame
    from serializers import registry

    payload = {"values": list(range(1000))}
    out = frame.encode(payload, registry.guarded("pickle"), max_bytes=1 << 30)
    return out.total - len(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))


FRAME_OVERHEAD = _frame_overhead()  # bytes objcomm's frame adds to a pickled payload
TENSOR_FRAME = 140  # the frame of a message that is one tensor sent out of band (its table, no data): 135 measured
SIZE_WORD = 8  # torch's object collectives exchange each payload's size as one int64
# A rank that posts messages to (or takes them from) m peers at once pays alpha * ceil(m / P2P_CONCURRENCY): the
# messages' wire latencies overlap, but each still costs its sender and receiver a start-up (a syscall on gloo's
# TCP pairs, a proxy-thread slot on NCCL). 8 is an assumption, not a measurement; it applies alike to objcomm's
# batches of send/recv and to the backends' flat gathers, so it moves both sides of a comparison.
P2P_CONCURRENCY = 8
# Same-host media (only when the whole group is on one host, which at RANKS_PER_NODE = 8 is W = 8 alone): a memory
# copy at SAME_HOST_BANDWIDTH, and each hand-over of a segment or a socket message costs the intra-node alpha.
SAME_HOST_BANDWIDTH = 10e9
WORLDS = (8, 64, 512, 4096, 8192)
CHECKED_OPS = ("all_gather", "gather", "all_reduce")
CHECK_WORLD = 8192
TARGET_RATIO = 1.5  # objcomm at most this many times ideal at CHECK_WORLD
SEED = 20240611


@dataclass(frozen=True)
class Params:
    """One backend's alpha-beta figures and the algorithms it runs for a broadcast and a small all_reduce."""

    name: str
    device: str  # the Topology device: "cuda" runs NCCL's routes, "cpu" gloo's
    alpha_inter: float  # seconds per message hop across nodes
    alpha_intra: float  # seconds per message hop inside a node
    bandwidth: float  # bytes per second per rank, each direction
    # "ring": NCCL's only broadcast algorithm; "binomial": gloo/broadcast.cc (the whole buffer at each level);
    # "tree": a pipelined tree (no backend here runs one; ``--nccl-broadcast tree`` shows what it would change)
    broadcast: str
    vote: str  # a one-word all_reduce: "tree" (NCCL's tree for small messages) or "ring" (gloo)

    def alpha(self, world: int) -> float:
        """The per-hop latency of a group of ``world`` ranks: across nodes as soon as it spans more than one."""
        return self.alpha_intra if world <= RANKS_PER_NODE else self.alpha_inter


NCCL = Params("nccl", "cuda", alpha_inter=20e-6, alpha_intra=5e-6, bandwidth=25e9, broadcast="ring", vote="tree")
GLOO = Params(
    "gloo", "cpu", alpha_inter=50e-6, alpha_intra=10e-6, bandwidth=1.25e9, broadcast="binomial", vote="ring"
)  # 10 GbE-class TCP
PARAMS = {p.name: p for p in (NCCL, GLOO)}


# -- the cost formulas ---------------------------------------------------------------------------------------------
def levels(world: int, radix: int = 2) -> int:
    """ceil(log_radix W): the levels of a binomial tree over W ranks (radix 2), or of a k-nomial tree."""
    depth, reach = 0, 1
    while reach < world:
        depth, reach = depth + 1, reach * radix
    return depth


def level_latency(radix: int, a: float) -> float:
    """One level of a k-nomial tree: a rank's radix - 1 messages of the level at once, a * ceil((k-1)/c)."""
    return a * math.ceil((radix - 1) / P2P_CONCURRENCY)


def ring_all_gather(world: int, n: int, a: float, b: float) -> float:
    """Ring all_gather of n bytes per rank: (W-1)*a + (W-1)*n/B."""
    return (world - 1) * a + (world - 1) * n / b


def ring_all_gatherv(sizes: Sequence[int], a: float, b: float) -> float:
    """Ring (pipelined) allgatherv: (W-1)*a + max(sum(n) - min(n), max(n))/B (the least sender receives most)."""
    total = sum(sizes)
    return (len(sizes) - 1) * a + max(total - min(sizes), max(sizes)) / b


def direct_all_gatherv(sizes: Sequence[int], a: float, b: float) -> float:
    """One batch of send/recv, all to all: max over r of max((W-1)*n_r, sum(n) - n_r)/B + a*ceil(peers_r/c).

    peers_r: W-1 when rank r sends (it sends its rest to every peer itself), else the ranks that send to it;
    c: :data:`P2P_CONCURRENCY`. Sending and receiving overlap (full duplex)."""
    world, total = len(sizes), sum(sizes)
    senders = sum(1 for n in sizes if n)
    worst = 0.0
    for n in sizes:
        peers = world - 1 if n else senders
        worst = max(worst, max((world - 1) * n, total - n) / b + a * math.ceil(peers / P2P_CONCURRENCY))
    return worst


def stripes_exchange(sizes: Sequence[int], a: float, b: float) -> float:
    """Each rest to the ranks whose stripe of the stream of rests holds it (objcomm._transport.exchange; each rank's
    moves are :func:`objcomm._transport.routes.stripe_moves`'s), one batch of send/recv: max over r of max(sent_r,
    received_r)/B + a*ceil(peers_r/c) (peers_r: the more of the ranks r sends to and the ranks that send to r; c:
    :data:`P2P_CONCURRENCY`)."""
    offsets, width = [0, *accumulate(sizes)], routes.stripe_width(sizes)
    worst = 0.0
    for r in range(len(sizes)):
        moves = routes.stripe_moves(offsets, r, width)
        sent, received = (sum(end - start for _, start, end in m) for m in (moves.sends, moves.receives))
        peers = max(len(moves.sends), len(moves.receives))
        worst = max(worst, max(sent, received) / b + a * math.ceil(peers / P2P_CONCURRENCY))
    return worst


def flat_gather(sizes: Sequence[int], root: int, a: float, b: float) -> float:
    """Every sender straight to the root (gloo's and NCCL's gather): a*ceil(m/c) + (sum(n) - n_root)/B, m senders."""
    senders = sum(1 for r, n in enumerate(sizes) if n and r != root)
    return a * math.ceil(senders / P2P_CONCURRENCY) + (sum(sizes) - sizes[root]) / b


def tree_gather(sizes: Sequence[int], root: int, a: float, b: float, radix: int = 2) -> float:
    """Binomial-tree gather: ceil(log2 W)*a + (sum(n) - n_root)/B (the root takes in every byte once); a k-nomial
    tree (``radix``): ceil(log_k W) levels of :func:`level_latency`."""
    return levels(len(sizes), radix) * level_latency(radix, a) + (sum(sizes) - sizes[root]) / b


def ring_broadcast(world: int, n: int, a: float, b: float) -> float:
    """Pipelined ring (chain) broadcast, NCCL's: (W-1)*a + n/B."""
    return (world - 1) * a + n / b


def binomial_broadcast(world: int, n: int, a: float, b: float) -> float:
    """Binomial-tree broadcast of the whole buffer per level, gloo's: ceil(log2 W)*(a + n/B)."""
    return levels(world) * (a + n / b)


def tree_broadcast(world: int, n: int, a: float, b: float) -> float:
    """Pipelined tree broadcast (the best known, for the ideal): ceil(log2 W)*a + n/B."""
    return levels(world) * a + n / b


def scatter_all_gather(world: int, n: int, a: float, b: float) -> float:
    """A broadcast as a binomial scatter of W blocks, then Bruck's all_gather of them (objcomm's ``spread``):
    2*ceil(log2 W)*a + 2*n*(W-1)/W/B."""
    return 2 * levels(world) * a + 2 * n * (world - 1) / world / b


def ring_vote(world: int, a: float) -> float:
    """All_reduce of one word on a ring, gloo's: 2*(W-1)*a."""
    return 2 * (world - 1) * a


def tree_vote(world: int, a: float) -> float:
    """All_reduce of one word on a tree, NCCL's small-message algorithm: 2*ceil(log2 W)*a."""
    return 2 * levels(world) * a


def table_sum(params: Params, world: int, n: int, a: float, b: float) -> float:
    """An all_reduce of n bytes (the table of slots, summed): a vote's hops (NCCL's pipelined tree, 2*ceil(log2 W)*a;
    gloo's ring, 2*(W-1)*a), and the table twice, 2n/B."""
    return vote_cost(params, world, a) + 2 * n / b


def doubling_vote(world: int, a: float) -> float:
    """objcomm's vote on gloo: recursive doubling (floor(log2 W) exchanges, one hand-over more where W is no power
    of two), then rank 0's answer in a binomial broadcast (ceil(log2 W) steps): (floor + extra + ceil)*a."""
    below = world.bit_length() - 1
    return (below + (0 if world & (world - 1) == 0 else 1) + levels(world)) * a


def tree_reduce(world: int, n: int, a: float, b: float, messages: int = 1, radix: int = 2) -> float:
    """objcomm's reduce tree (send/recv toward rank 0, one level after another), each edge ``messages`` messages one
    after another (its slot, an answer where one is due, its rest: routes.tree_messages): ceil(log2 W)*(m*a + n/B);
    a k-nomial tree (``radix``, a gather's word down): a level's k - 1 edges at once, ceil(log_k W)*(m *
    level_latency + (k-1)*n/B)."""
    return levels(world, radix) * (messages * level_latency(radix, a) + (radix - 1) * n / b)


def tree_climb(world: int, radix: int, a: float, cpu_cost: float) -> float:
    """When the root of a gather's tree of ``radix`` (patterns.knomial, as routes.SLOT_TREE_RADIX's) holds its
    subtrees' short messages (the lengths), where each message also costs its receiver ``cpu_cost`` seconds one after
    another (posting it, then taking it: not in the rest of this model) and a hop ``a``: each rank first posts its
    children's receives, then its parent's message leaves once the last child's has come (``--radix-table``).
    O(W): the ranks from the last, children before parents."""
    done = [0.0] * world
    for me in range(world - 1, -1, -1):
        children = knomial(me, world, radix).children
        arrived = max((done[c] + a for c in children), default=0.0)
        done[me] = max(len(children) * cpu_cost, arrived) + cpu_cost
    return done[0]


RADIX_TABLE = ((2, 3, 4, 8), (0.0, 2.5e-6, 5e-6, 10e-6, 20e-6, 40e-6))  # the radixes, the CPU costs of a message


def radix_table(world: int = 8192, a: float = NCCL.alpha_inter) -> str:
    """The gather tree's climb (:func:`tree_climb`) for each radix and per-message CPU cost: why
    routes.SLOT_TREE_RADIX is 4."""
    radixes, costs = RADIX_TABLE
    lines = [
        f"| CPU a message (W = {world}, {a * 1e6:g} us a hop) | " + " | ".join(f"radix {r}" for r in radixes) + " |",
        "|---:|" + "---:|" * len(radixes),
    ]
    for cost in costs:
        cells = " | ".join(fmt_time(tree_climb(world, r, a, cost)) for r in radixes)
        lines.append(f"| {cost * 1e6:g} us | {cells} |")
    return "\n".join(lines)


def shared_memory_exchange(sizes: Sequence[int], a: float) -> float:
    """A same-host shared-memory step: 2*a + max(n)/SAME_HOST_BANDWIDTH (each sender copies once, receivers map)."""
    return 2 * a + max(sizes) / SAME_HOST_BANDWIDTH


def direct_broadcast(world: int, n: int, a: float, b: float) -> float:
    """The root sends to every peer itself (the same-host channel): a*ceil((W-1)/c) + (W-1)*n/B."""
    return a * math.ceil((world - 1) / P2P_CONCURRENCY) + (world - 1) * n / b


def direct_vote(world: int, a: float) -> float:
    """One word to rank 0 and the verdict back, each peer directly (the same-host channel): 2*a*ceil((W-1)/c)."""
    return 2 * a * math.ceil((world - 1) / P2P_CONCURRENCY)


_BROADCASTS = {"ring": ring_broadcast, "binomial": binomial_broadcast, "tree": tree_broadcast}


def broadcast_cost(params: Params, world: int, n: int, a: Optional[float] = None) -> float:
    """A backend broadcast of n bytes with this backend's algorithm (``a``: the hop latency, else the group's)."""
    return _BROADCASTS[params.broadcast](world, n, params.alpha(world) if a is None else a, params.bandwidth)


def vote_cost(params: Params, world: int, a: Optional[float] = None) -> float:
    """A backend all_reduce of one word with this backend's algorithm."""
    a = params.alpha(world) if a is None else a
    return ring_vote(world, a) if params.vote == "ring" else tree_vote(world, a)


def step_cost(step: routes.Step, params: Params, world: int, root: int = 0) -> float:
    """The cost of one step of a plan (``world``: the group's size; ``root``: of a gather or a p2p step). A step of
    two levels runs over its own ranks (``step.ranks``: a host's, or the leaders', whose hops cross hosts)."""
    sizes = step.nbytes
    if step.ranks:
        world, root = step.ranks, 0
    if step.medium == routes.SHARED_MEMORY:
        return shared_memory_exchange(sizes, params.alpha_intra)
    if step.medium == routes.CHANNEL:  # Unix sockets between the ranks of one host: direct sends at memory speed
        a, b = params.alpha_intra, SAME_HOST_BANDWIDTH
        if step.collective in ("all_gather", "all_gatherv"):
            return direct_all_gatherv(sizes, a, b)
        if step.collective in ("gather", "p2p"):
            return flat_gather(sizes, root, a, b)
        if step.collective == "broadcast":
            return direct_broadcast(world, sizes[0], a, b)
        if step.collective == "all_reduce":
            return direct_vote(world, a)
        if step.collective in ("tree", "down_tree"):  # a host's reduce tree (two levels), one message an edge
            return tree_reduce(world, sizes[0], a, b)
        raise ValueError(f"no cost for {step}")
    a, b = params.alpha_inter if step.across else params.alpha(world), params.bandwidth
    if step.collective == "all_gather":
        return ring_all_gather(world, max(sizes), a, b)
    if step.collective == "all_gatherv":
        return direct_all_gatherv(sizes, a, b) if params.device == "cpu" else ring_all_gatherv(sizes, a, b)
    if step.collective in ("gather", "p2p"):
        return flat_gather(sizes, root, a, b)
    if step.collective == "sum":  # the table of slots in one all_reduce
        return table_sum(params, world, sizes[0], a, b)
    if step.collective == "stripes":  # then the stripes' all_gather, a step of its own
        return stripes_exchange(sizes, a, b)
    if step.collective == "gather_tree":  # a gather's slots up a tree of step.radix (routes.slots_up_tree): the
        return a + tree_gather(sizes, root, a, b, step.radix)  # lengths climb a level a latency, the slots behind
    if step.collective == "broadcast":
        return broadcast_cost(params, world, sizes[0], a)
    if step.collective == "spread":
        return scatter_all_gather(world, sizes[0], a, b)
    if step.collective == "all_reduce":
        return vote_cost(params, world, a)
    if step.collective == "vote":
        return doubling_vote(world, a)
    if step.collective in ("tree", "down_tree"):  # the same edges, one way or the other
        return tree_reduce(world, sizes[0], a, b, step.messages, step.radix)
    raise ValueError(f"no cost for {step}")


def plan_cost(plan: routes.Plan, params: Params, world: int, root: int = 0) -> float:
    """The cost of a whole plan: its steps one after another."""
    return sum(step_cost(step, params, world, root) for step in plan.steps)


# -- the spreads of sizes ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """One case at one W: each rank's payload (what torch would pickle and ideal moves) and objcomm's rest."""

    payloads: Tuple[int, ...]
    rests: Tuple[int, ...]
    value: int  # all_reduce's value: the median payload (every rank contributes one of this size)
    value_rest: int
    broadcast: int  # broadcast's value: the largest payload, on the root
    broadcast_rest: int
    carried: Tuple[int, ...] = ()  # what each rank's slot holds: its prefix, the frame where it fits, sizes listed
    tensors: bool = False  # the rests are out-of-band tensors


def pickled_rest(size: int, slot_bytes: int = routes.Knobs().slot_bytes) -> int:
    """objcomm's rest of a pickled payload of ``size`` bytes: its whole frame unless the frame fits in the slot."""
    frame = size + FRAME_OVERHEAD
    return 0 if frame <= slot_bytes - SLOT_PREFIX_BYTES else frame


def slot_carries(size: int, tensor: bool, slot_bytes: int = routes.Knobs().slot_bytes) -> int:
    """The bytes of a slot up to its last nonzero one, for a payload of ``size`` bytes: the 24-byte prefix, then the
    frame where it fits (a tensor's frame, TENSOR_FRAME bytes, then its listed size: a count and one u64), else the
    count of listed sizes (none)."""
    if tensor:
        return SLOT_PREFIX_BYTES + TENSOR_FRAME + 4 + 8
    return SLOT_PREFIX_BYTES + (4 if pickled_rest(size, slot_bytes) else size + FRAME_OVERHEAD)


def tensor_rest(size: int) -> int:
    """objcomm's rest of a message that is one tensor of ``size`` bytes: the tensor (its frame, a few hundred
    bytes, and its size fit in the slot)."""
    return size


def _spread(k: int, world: int) -> List[int]:
    """k ranks spread over the group, never the root (rank 0) unless k = W."""
    return sorted({world - 1 - (i * world) // k for i in range(k)})


def payloads_for(case: str, world: int) -> List[int]:
    """Each rank's payload in bytes for ``case`` (seeded where random)."""
    rng = random.Random(SEED * 100_003 + world)
    if case == "equal-small":
        return [1 * KB] * world
    if case == "equal-large":
        return [1 * MB] * world
    if case == "one-outlier":
        return [1 * KB] * (world - 1) + [100 * MB]
    if case == "10pct-large":
        sizes = [1 * KB] * world
        for r in _spread(max(1, round(world / 10)), world):
            sizes[r] = 16 * MB
        return sizes
    if case == "log-normal":
        return [min(GB, int(rng.lognormvariate(math.log(32 * KB), 2.0))) for _ in range(world)]
    if case == "uneven-tensors":
        return [int(MB * rng.uniform(0.9, 1.1)) // 4 * 4 for _ in range(world)]
    raise ValueError(f"unknown case {case!r}")


# equal-small: 1 KB pickled objects (they fit in the slot: no rest); equal-large: 1 MB each; one-outlier: the
# last rank 100 MB, the others 1 KB; 10pct-large: round(W/10) ranks (at least one, never rank 0) 16 MB, the others
# 1 KB; log-normal: median 32 KB, sigma 2, capped at 1 GB, seeded per W; uneven-tensors: one tensor per rank of
# 1 MB +-10% (uniform, seeded per W), sent out of band. All payloads but the tensors are pickled objects.
CASES = ("equal-small", "equal-large", "one-outlier", "10pct-large", "log-normal", "uneven-tensors")
OPS = ("all_gather", "gather", "all_reduce", "broadcast")


def sizes_for(case: str, world: int) -> Sizes:
    """The payloads and rests of ``case`` at ``world`` ranks."""
    payloads = payloads_for(case, world)
    rest = tensor_rest if case == "uneven-tensors" else pickled_rest
    value = sorted(payloads)[world // 2]
    largest = max(payloads)
    tensor = case == "uneven-tensors"
    carried = tuple(slot_carries(n, tensor) for n in payloads)
    rests = tuple(rest(n) for n in payloads)
    return Sizes(tuple(payloads), rests, value, rest(value), largest, rest(largest), carried, tensor)


# -- objcomm, ideal, torch -----------------------------------------------------------------------------------------
def topology(params: Params, world: int, two_levels: bool = True) -> routes.Topology:
    """RANKS_PER_NODE ranks per host with their same-host channel (gloo groups across hosts then take two levels:
    objcomm._samehost.two_level); ``two_levels=False``: the channel closed, every route flat (``--flat``)."""
    return routes.Topology(world=world, ranks_per_host=RANKS_PER_NODE, device=params.device, channel_open=two_levels)


def objcomm_plan(op: str, params: Params, world: int, sizes: Sizes, two_levels: bool = True) -> routes.Plan:
    """The route routes.plan picks for ``op`` on these sizes (root 0; ``two_levels``: see :func:`topology`)."""
    if op in ("all_gather", "gather"):
        rests: Sequence[int] = sizes.rests
    elif op == "all_reduce":
        rests = [sizes.value_rest] + [0] * (world - 1)
    elif op == "broadcast":
        rests = [sizes.broadcast_rest] + [0] * (world - 1)
    else:
        raise ValueError(f"unknown op {op!r}")
    carried = sizes.carried if op == "gather" else None
    where = topology(params, world, two_levels)
    return routes.plan(op, where, rests, root=0, listed=True, carried=carried, tensors=sizes.tensors)


def objcomm_cost(op: str, params: Params, world: int, sizes: Sizes) -> float:
    """objcomm's time for ``op``: the cost of its plan."""
    return plan_cost(objcomm_plan(op, params, world, sizes), params, world, root=0)


def ideal_cost(op: str, params: Params, world: int, sizes: Sizes) -> float:
    """The best known collective of the same payloads at exact sizes, in one round."""
    a, b = params.alpha(world), params.bandwidth
    if op == "all_gather":
        return ring_all_gatherv(sizes.payloads, a, b)
    if op == "gather":
        return tree_gather(sizes.payloads, 0, a, b)
    if op == "all_reduce":
        return 2 * levels(world) * a + 2 * sizes.value / b
    if op == "broadcast":
        return tree_broadcast(world, sizes.broadcast, a, b)
    raise ValueError(f"unknown op {op!r}")


def torch_cost(op: str, params: Params, world: int, sizes: Sizes) -> float:
    """torch's object collective: the sizes, then the payloads padded to the largest (all_reduce: all_gather_object)."""
    a, b = params.alpha(world), params.bandwidth
    if op == "all_gather":
        return ring_all_gather(world, SIZE_WORD, a, b) + ring_all_gather(world, max(sizes.payloads), a, b)
    if op == "gather":
        padded = [max(sizes.payloads)] * world
        return ring_all_gather(world, SIZE_WORD, a, b) + flat_gather(padded, 0, a, b)
    if op == "all_reduce":
        return ring_all_gather(world, SIZE_WORD, a, b) + ring_all_gather(world, sizes.value, a, b)
    if op == "broadcast":
        return broadcast_cost(params, world, SIZE_WORD) + broadcast_cost(params, world, sizes.broadcast)
    raise ValueError(f"unknown op {op!r}")


_CODES = {
    "all_gather": "AG",
    "all_gatherv": "AGV",
    "stripes": "S",
    "sum": "AR",
    "gather": "G",
    "gather_tree": "GT",
    "broadcast": "B",
    "spread": "SG",
    "all_reduce": "V",
    "vote": "D",
    "p2p": "P",
    "tree": "T",
    "down_tree": "TD",
}
_MEDIA = {routes.BACKEND: "", routes.CHANNEL: "(ch)", routes.SHARED_MEMORY: "(shm)"}


def route_code(plan: routes.Plan) -> str:
    """A compact route: AG all_gather, AR the table of slots in one all_reduce, AGV exact-size exchange, S stripes
    (gloo's exact exchange, then AG), G gather, SG a broadcast as a scatter, then an all_gather,
    GT a gather up a binomial tree, B broadcast, V all_reduce vote, D doubling vote, P p2p, T tree, TD the tree back
    down."""
    codes: List[str] = []
    for step in plan.steps:
        code = _CODES[step.collective] + _MEDIA[step.medium]
        if codes and codes[-1].split("x")[0] == code:
            head, _, times = codes[-1].partition("x")
            codes[-1] = f"{head}x{int(times or 1) + 1}"
        else:
            codes.append(code)
    return "+".join(codes)


def rows(
    ops: Sequence[str] = OPS,
    cases: Sequence[str] = CASES,
    worlds: Sequence[int] = WORLDS,
    params: Sequence[Params] = (NCCL, GLOO),
    two_levels: bool = True,
) -> List[Dict[str, object]]:
    """Every row {op, case, W, params, objcomm_s, ideal_s, torch_s, route}: O(W) Python work each."""
    out: List[Dict[str, object]] = []
    for world in worlds:
        for case in cases:
            sizes = sizes_for(case, world)
            for p in params:
                for op in ops:
                    plan = objcomm_plan(op, p, world, sizes, two_levels)
                    out.append(
                        {
                            "op": op,
                            "case": case,
                            "W": world,
                            "params": p.name,
                            "objcomm_s": plan_cost(plan, p, world),
                            "ideal_s": ideal_cost(op, p, world, sizes),
                            "torch_s": torch_cost(op, p, world, sizes),
                            "route": route_code(plan),
                        }
                    )
    return out


def misses(table: Sequence[Dict[str, object]]) -> List[Dict[str, object]]:
    """The rows of CHECKED_OPS at CHECK_WORLD where objcomm > TARGET_RATIO x ideal or objcomm > torch."""
    return [
        r
        for r in table
        if r["op"] in CHECKED_OPS
        and r["W"] == CHECK_WORLD
        and (r["objcomm_s"] > TARGET_RATIO * r["ideal_s"] or r["objcomm_s"] > r["torch_s"])
    ]


def fmt_time(seconds: float) -> str:
    """Seconds, in us, ms or s."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def markdown(table: Sequence[Dict[str, object]]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| op | case | W | params | route | objcomm | ideal | torch | objcomm/ideal | objcomm/torch |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        o, i, t = (float(r[k]) for k in ("objcomm_s", "ideal_s", "torch_s"))  # type: ignore[arg-type]
        lines.append(
            f"| {r['op']} | {r['case']} | {r['W']} | {r['params']} | {r['route']} | {fmt_time(o)} | "
            f"{fmt_time(i)} | {fmt_time(t)} | {o / i:.2f} | {o / t:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", action="append", choices=OPS, help="only this op (repeatable)")
    parser.add_argument("--case", action="append", choices=CASES, help="only this case (repeatable)")
    parser.add_argument("--world", action="append", type=int, help="only this world size (repeatable)")
    parser.add_argument("--params", action="append", choices=sorted(PARAMS), help="only this parameter set")
    parser.add_argument(
        "--nccl-broadcast",
        choices=sorted(_BROADCASTS),
        default=NCCL.broadcast,
        help="the algorithm charged for an NCCL broadcast (default: ring, NCCL's only one); "
        "another renames the parameter set nccl-<algorithm>-bcast",
    )
    parser.add_argument(
        "--flat",
        action="store_true",
        help="no same-host channel: every route flat (gloo groups across hosts take no two levels)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows instead of the table")
    parser.add_argument(
        "--radix-table",
        action="store_true",
        help="only the gather tree's climb at 8192 ranks for each radix and CPU cost of a message",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 listing each {'/'.join(CHECKED_OPS)} row at W={CHECK_WORLD} above "
        f"{TARGET_RATIO}x ideal or above torch",
    )
    args = parser.parse_args(argv)
    if args.radix_table:
        print(radix_table())
        return 0
    chosen = [PARAMS[n] for n in (args.params or ("nccl", "gloo"))]
    if args.nccl_broadcast != NCCL.broadcast:
        other = replace(NCCL, name=f"nccl-{args.nccl_broadcast}-bcast", broadcast=args.nccl_broadcast)
        chosen = [other if p is NCCL else p for p in chosen]
    table = rows(args.op or OPS, args.case or CASES, args.world or WORLDS, chosen, not args.flat)
    if args.json:
        keys = ("op", "case", "W", "params", "objcomm_s", "ideal_s", "torch_s")
        print(json.dumps([{k: r[k] for k in keys} for r in table], indent=1))
    else:
        print(markdown(table))
    if not args.check:
        return 0
    missed = misses(table)
    out = sys.stderr if args.json else sys.stdout
    print(
        f"\n{len(missed)} of {sum(1 for r in table if r['op'] in CHECKED_OPS and r['W'] == CHECK_WORLD)} "
        f"checked rows at W={CHECK_WORLD} miss the target (objcomm <= {TARGET_RATIO}x ideal and <= torch):",
        file=out,
    )
    for r in missed:
        o, i, t = (float(r[k]) for k in ("objcomm_s", "ideal_s", "torch_s"))  # type: ignore[arg-type]
        why = [f"{o / i:.2f}x ideal"] if o > TARGET_RATIO * i else []
        why += [f"{o / t:.3f}x torch"] if o > t else []
        print(f"  {r['op']} {r['case']} {r['params']}: {', '.join(why)}", file=out)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
