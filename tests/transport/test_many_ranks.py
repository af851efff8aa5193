"""Eight real ranks, each treated as its own host (no same-host channel, no shared memory): every collective
takes a bounded number of torch.distributed calls whatever the spread of sizes, and bad input still gets the
same clear error on every rank on these paths (issue 27).

The counts are of the calls objcomm makes on each rank: collectives (a batch of sends and receives counts once)
and blocking sends and receives. One pool serves every test here.
"""

from __future__ import annotations

import contextlib
import operator
import os
import struct
import time
from datetime import timedelta
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist
from _hostile import a_vote_relay_that_hides, result_or_error
from _ranks import get_pool

import objcomm
import serializers
from objcomm import _state
from objcomm._api.resolving import Hooks
from objcomm._format import frame as _frame
from objcomm._format import tensors as _tensors
from objcomm._format.message import SLOT_PREFIX_BYTES, Outgoing
from objcomm._format.slot import outgoing_second_round_bytes
from objcomm._samehost import shm as _shm
from objcomm._samehost import two_level_moves as _two_level
from objcomm._tools.bench.spreads import CASES, spread_of
from objcomm._transport import base as _base
from objcomm._transport import broadcast as _broadcast
from objcomm._transport import bytes as _bytes
from objcomm._transport import call_words, patterns, routes
from objcomm._transport import exchange as _exchange
from objcomm._transport import gather as _gather
from objcomm._transport import pending as _pending
from objcomm._transport import rounds as _rounds
from objcomm._transport import slot_tree as _slot_tree
from objcomm._transport.base import Wire as _Wire
from objcomm._transport.routes import cutoffs as _cutoffs

W = 8
COLLECTIVES = (
    "broadcast",
    "all_gather",
    "all_reduce",
    "reduce",
    "gather",
    "scatter",
    "all_to_all_single",
    "batch_isend_irecv",
    "barrier",
)


@contextlib.contextmanager
def calls() -> Iterator[Dict[str, int]]:
    """Count this rank's torch.distributed calls inside (``collectives``; ``blocking``: send and recv; ``p2p``: the
    batches of isend and irecv of :class:`objcomm._transport.bytes.Batch`, each once; ``posted``: sends posted eagerly,
    :mod:`objcomm._transport.pending`, one isend each)."""
    counts = {"collectives": 0, "blocking": 0, "p2p": 0, "posted": 0}
    saved = []

    def wrap(owner: Any, name: str, key: str) -> None:
        real = getattr(owner, name)
        saved.append((owner, name, real))

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return real(*args, **kwargs)

        setattr(owner, name, counted)

    try:
        for name in COLLECTIVES:
            wrap(dist, name, "collectives")
        for owner in (_base, _bytes, _rounds, _two_level, _shm):  # bound at import under its torch-version name
            wrap(owner, "all_gather_single", "collectives")
        for name in ("send", "recv"):
            wrap(dist, name, "blocking")
        wrap(_pending, "post", "posted")
        real_wait = _bytes.Batch.wait

        def waited(batch: Any, *deadline: Any) -> None:
            together = bool(batch.posts)  # (posted in one batch_isend_irecv: a batch of p2p, not a collective)
            counts["p2p"] += bool(batch.works) or together
            real_wait(batch, *deadline)
            counts["collectives"] -= together

        saved.append((_bytes.Batch, "wait", real_wait))
        _bytes.Batch.wait = waited  # type: ignore[method-assign]
        yield counts
    finally:
        for owner, name, real in reversed(saved):
            setattr(owner, name, real)


def spread(case: str, rank: int) -> Any:
    """Rank ``rank``'s object in ``case`` on the pool's :data:`W` ranks."""
    return spread_of(case, rank, W)


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return bool(got == want)


def _comm(
    up_tree: bool = False, summed: bool = False, one_host: bool = False, local: bool = False, radix: int = 0
) -> objcomm.Communicator:
    """Every rank its own host (``one_host``: all on this one, which they learn here; ``local``: with its same-host
    channel); ``up_tree``: a gather's slots go up a tree, as they do from 64 ranks on (``radix``: its radix, 0:
    routes.SLOT_TREE_RADIX, 4: among 8 ranks the destination's fifth relays for the last three); ``summed``: an
    all_gather's slots in one all_reduce of the table, as on NCCL from 64 ranks on."""
    hooks = Hooks(separate_hosts=not one_host, up_tree=up_tree, summed=summed, tree_radix=radix)
    return objcomm.Communicator(local=local, shm=False, _hooks=hooks)


def _left(a: Any, b: Any) -> Any:
    """A reduction that keeps its left operand: every message up the tree is its sender's own object."""
    return a


# the spreads a reduction's plan is checked on: its plan has one size for every message up the tree (rank 0's), which
# these keep on the same side of every cut-off (the tree's messages are each sender's own object)
TREE_CASES = ("all 1 KB", "all 1 MB", "uneven tensors")


def each_spread(
    op: str, up_tree: bool = False, one_host: bool = False, local: bool = False, radix: int = 0
) -> List[Any]:
    """``op`` on every spread (a reduction: on :data:`TREE_CASES`): (case, right result, collectives, blocking calls,
    batches of sends and receives and eager sends)."""
    comm, rank = _comm(up_tree, one_host=one_host, local=local, radix=radix), dist.get_rank()
    comm.all_gather(bytes(routes.ANNOUNCED_FROM))  # the group's hosts are learned at the first such rest (voted_rests)
    rows = []
    for case in TREE_CASES if op in ("all_reduce", "reduce") else CASES:
        obj = spread(case, rank)
        root_obj = spread(case, 1) if rank == 1 else None
        run = {
            "all_gather": lambda obj=obj: comm.all_gather(obj),
            "gather": lambda obj=obj: comm.gather(obj, dst=3),
            "broadcast": lambda root_obj=root_obj: comm.broadcast(root_obj, src=1),
            "all_reduce": lambda obj=obj: comm.all_reduce(obj, op=_left),
            "reduce": lambda obj=obj: comm.reduce(obj, op=_left, dst=3),
        }[op]
        with calls() as counts:
            got = run()
        if op == "all_gather":
            right = all(_same(g, spread(case, r)) for r, g in enumerate(got))
        elif op == "gather":
            right = all(_same(g, spread(case, r)) for r, g in enumerate(got)) if rank == 3 else got is None
        elif op == "all_reduce":
            right = _same(got, spread(case, 0))
        elif op == "reduce":
            right = _same(got, spread(case, 0)) if rank == 3 else got is None
        else:
            right = _same(got, spread(case, 1))
        rows.append((case, right, counts["collectives"], counts["blocking"], counts["p2p"] + counts["posted"]))
    return rows


def summed_slots() -> List[Any]:
    """all_gather of every spread with the slots summed (one all_reduce of the table, as NCCL's route from 64 ranks
    on): (case, right result, this rank's all_reduce and all_gather calls)."""
    comm, rank = _comm(summed=True), dist.get_rank()
    counts = {"all_reduce": 0, "all_gather_single": 0}
    real_reduce, real_gather = dist.all_reduce, _rounds.all_gather_single

    def reduced(*args: Any, **kwargs: Any) -> Any:
        counts["all_reduce"] += 1
        return real_reduce(*args, **kwargs)

    def gathered(*args: Any, **kwargs: Any) -> Any:
        counts["all_gather_single"] += 1
        return real_gather(*args, **kwargs)

    rows = []
    for case in CASES:
        counts.update(all_reduce=0, all_gather_single=0)
        dist.all_reduce, _rounds.all_gather_single = reduced, gathered  # type: ignore[assignment]
        try:
            got = comm.all_gather(spread(case, rank))
        finally:
            dist.all_reduce, _rounds.all_gather_single = real_reduce, real_gather  # type: ignore[assignment]
        right = all(_same(g, spread(case, r)) for r, g in enumerate(got))
        rows.append((case, right, counts["all_reduce"], counts["all_gather_single"]))
    return rows


def test_summed_slots_give_the_same_results():
    """The slots of an all_gather summed into one table (each rank's slot in its place, zeros elsewhere) read as the
    all_gather's would: every spread right, one all_reduce and no all_gather of slots on every rank."""
    for rank, rows in enumerate(get_pool(W).run(summed_slots, timeout=120)):
        for case, right, reduces, slot_gathers in rows:
            assert right, (rank, case)
            assert (reduces, slot_gathers) == (1, 0), (rank, case, reduces, slot_gathers)


# broadcast: its slot, a vote where a piece is past the scratch size (recursive doubling on gloo: log2(8) = 3
# exchanges, then rank 0's answer in one broadcast), its rest
def _rests(case: str) -> List[int]:
    """Every rank's rest in ``case`` (its bytes past the slot), from its object encoded here as the pool's ranks do."""
    pickle = serializers.registry.guarded("pickle")
    outs = [_frame.encode(spread(case, r), pickle, max_bytes=1 << 40) for r in range(W)]
    return [outgoing_second_round_bytes(out, objcomm.Settings().slot_bytes - SLOT_PREFIX_BYTES) for out in outs]


def planned_against_counted(op: str, one_host: bool = False, local: bool = False) -> List[Any]:
    """``op`` on every spread, as :func:`each_spread` runs it: (case, this rank's torch.distributed calls, the calls
    ``routes.plan`` gives for the same sizes on the same topology)."""
    root = {"all_gather": 0, "gather": 3, "broadcast": 1, "all_reduce": 0, "reduce": 3}[op]
    topology = routes.Topology(world=W, ranks_per_host=W if one_host else 1, device="cpu", channel_open=local)
    knobs = routes.Knobs(local=local, shm=False)
    rows = []
    for case, right, collectives, blocking, p2p in each_spread(op, one_host=one_host, local=local):
        planned = routes.plan(op, topology, _rests(case), knobs, root=root)
        steps = [s.collective for s in planned.steps]
        rows.append((case, collectives + blocking + p2p, planned.torch_calls, steps, right))
    return rows


def _planned_is_counted(op: str, every: List[Any]) -> None:
    """Every rank's result right, and the busiest rank's calls the plan's, in each spread of
    :func:`planned_against_counted`'s rows (``every``: each rank's)."""
    for index, (case, _, planned, steps, _) in enumerate(every[0]):
        counted = [rows[index][1] for rows in every]
        assert all(rows[index][4] for rows in every), f"{op}, {case}: a wrong result"
        assert max(counted) == planned, f"{op}, {case}: plan {steps} ({planned} calls), ranks made {counted}"


@pytest.mark.parametrize("op", ["all_gather", "gather", "broadcast", "all_reduce", "reduce"])
def test_the_routes_plan_is_what_the_transport_does(op):
    """routes.plan, which docs/scaling.md's model costs, gives each spread the torch.distributed calls the transport
    makes: as many as the busiest rank's (a rank with nothing to send or receive in a step skips it; a vote on gloo is
    its exchanges and a broadcast; a reduction's tree is a message from each of group rank 0's ceil(log2 W) children,
    each one call or its slot, an answer where due and a batch for its rest)."""
    _planned_is_counted(op, get_pool(W).run(planned_against_counted, op, timeout=120))


@pytest.mark.parametrize("op", ["all_gather", "gather", "broadcast"])
def test_the_routes_plan_is_what_the_transport_does_on_one_host_without_the_channel(op):
    """As above with every rank on one host and local=False (the backend's round 1): a collective's rest waits for
    the vote on its medium (objcomm._samehost.voted_rests), which the plan counts."""
    _planned_is_counted(op, get_pool(W).run(planned_against_counted, op, True, timeout=120))


@pytest.mark.parametrize("op", ["all_gather", "gather", "broadcast", "all_reduce", "reduce"])
def test_the_routes_plan_is_what_the_transport_does_on_one_host_with_the_channel(op):
    """As above with every rank on one host and its same-host channel open (shared memory off): round 1 and a
    reduction's tree go through the channel, and a rest the channel does not take through the backend."""
    _planned_is_counted(op, get_pool(W).run(planned_against_counted, op, True, True, timeout=120))


def a_tree_across_hosts_with_shared_memory() -> List[Any]:
    """all_reduce (and reduce to rank 3) of a 3 MiB value, past shared memory's threshold and within a tree
    message's pieces, on ranks each its own host with shared memory on, once the group's hosts are learned: (right
    results, this rank's torch.distributed calls in each, the calls the plan gives)."""
    comm, rank = objcomm.Communicator(local=False, _hooks=Hooks(separate_hosts=True)), dist.get_rank()
    comm.all_gather(bytes(routes.ANNOUNCED_FROM))  # the group's hosts are learned here (voted_rests)
    value = torch.full((3 << 20,), rank, dtype=torch.uint8)
    out = _frame.encode(value, serializers.registry.guarded("pickle"), max_bytes=1 << 40)
    rest = outgoing_second_round_bytes(out, objcomm.Settings().slot_bytes - SLOT_PREFIX_BYTES)
    topology = routes.Topology(world=W, device="cpu", channel_open=False)
    rows = []
    for op in ("all_reduce", "reduce"):
        with calls() as counts:
            got = comm.all_reduce(value, op=_left) if op == "all_reduce" else comm.reduce(value, op=_left, dst=3)
        right = got is None if op == "reduce" and rank != 3 else bool(torch.equal(got, torch.zeros_like(value)))
        planned = routes.plan(op, topology, [rest] + [0] * (W - 1), routes.Knobs(local=False), root=3).torch_calls
        rows.append((op, right, sum(counts.values()), planned))
    return rows


def test_a_trees_sends_across_hosts_ask_no_answer_of_shared_memory():
    """A tree's message to a rank known to run on another host asks for no answer, and sends no shared-memory words
    (none could take it there): its slot, then its rest, as the plan counts (four calls an edge before: the slot,
    the receiver's answer, shared memory's words declined, the rest)."""
    every = get_pool(W).run(a_tree_across_hosts_with_shared_memory, timeout=120)
    for index, (op, _, _, planned) in enumerate(every[0]):
        assert all(rows[index][1] for rows in every), f"{op}: a wrong result"
        counted = [rows[index][2] for rows in every]
        assert max(counted) == planned, f"{op}: the plan gives {planned} calls, the ranks made {counted}"


def sends_across_hosts_both_ways(learned: bool) -> List[Any]:
    """Rank 0 sends rank 1 a 3 MiB tensor, then rank 1 sends it back (pieces past 1 MiB: each sender asks for the
    receiver's answer), every rank its own host with shared memory on, on a fresh group: with its hosts ``learned``
    first (a collective), or not (rank 0 learns that rank 1 is elsewhere from its answer to the first send, rank 1
    nothing): what each of the two received is right."""
    rank = dist.get_rank()
    group = dist.new_group(list(range(W)))  # its own hosts, learned or not
    comm = objcomm.Communicator(group, local=False, _hooks=Hooks(separate_hosts=True))
    if learned:
        comm.all_gather(bytes(routes.ANNOUNCED_FROM))
    value = torch.arange(3 << 20, dtype=torch.uint8)
    got = []
    for sender, receiver in ((0, 1), (1, 0), (0, 1)):
        if rank == sender:
            comm.send(value + sender, dst=receiver)
        elif rank == receiver:
            got.append(bool(torch.equal(comm.recv(src=sender), value + sender)))
    dist.destroy_process_group(group)
    return got


@pytest.mark.parametrize("learned", [True, False], ids=["hosts learned", "hosts not learned"])
def test_a_receiver_that_knows_its_sender_elsewhere_waits_for_no_shared_memory_words(learned):
    """A reviewer's find: a receiver that knew its sender ran on another host answered that shared memory would not
    take the rest, then waited for shared memory's words all the same, and read the rest's first piece as them."""
    got = get_pool(W).run(sends_across_hosts_both_ways, learned, timeout=120)
    assert got[0] == [True] and got[1] == [True, True] and got[2:] == [[]] * (W - 2)


def a_peer_learnt_elsewhere_meanwhile() -> List[Any]:
    """Rank 0 sends rank 1 4 MiB twice on one host (shared memory takes it), as if another of its threads learnt
    between its decision and shared memory's send that rank 1 runs elsewhere (added to what it remembers just before
    each send): what rank 1 received is right."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(local=False)
    real = _shm.SharedMemory.send

    learnt = []

    def learnt_meanwhile(memory: Any, wire: Any, out: Any, dst: int, *args: Any) -> Any:
        remembered = _state.group_facts(wire.group).remote_peers
        remembered.add((dst, memory.separate))
        learnt.append((remembered, (dst, memory.separate)))
        return real(memory, wire, out, dst, *args)

    payload, got = bytes(range(256)) * (4 << 12), []
    try:
        _shm.SharedMemory.send = learnt_meanwhile  # type: ignore[method-assign]
        for _ in range(2):
            if rank == 0:
                comm.send(payload, dst=1)
            elif rank == 1:
                got.append(comm.recv(src=0) == payload)
    finally:
        _shm.SharedMemory.send = real  # type: ignore[method-assign]
        for remembered, peer in learnt:  # (the pool's ranks run on, on one host)
            remembered.discard(peer)
    return got


def test_shared_memorys_decision_is_made_once_a_send():
    """A reviewer's find: shared memory's send and receive judged the peer again after p2p had, so a peer learnt to
    be elsewhere meanwhile (by another thread's send) made the sender skip the words its receiver waited for (gloo
    aborted the receiver: a 4 MiB piece where 48 bytes were posted)."""
    got = get_pool(W).run(a_peer_learnt_elsewhere_meanwhile, timeout=120)
    assert got[1] == [True, True] and got[0] == [] and got[2:] == [[]] * (W - 2)


@pytest.mark.parametrize("op, most", [("all_gather", 3), ("gather", 3), ("broadcast", 2 + 3 + 1)])
def test_bounded_calls_whatever_the_spread(op, most):
    for rank, rows in enumerate(get_pool(W).run(each_spread, op, timeout=120)):
        for case, right, collectives, blocking, _ in rows:
            assert right, f"{op}, {case}: a wrong result on rank {rank}"
            assert collectives <= most, f"{op}, {case}: {collectives} collectives on rank {rank}"
            assert blocking == 0, f"{op}, {case}: {blocking} blocking sends/receives on rank {rank}"


@pytest.mark.parametrize("radix", [0, 8], ids=["SLOT_TREE_RADIX", "radix 8"])
def test_a_gathers_slots_up_a_tree_give_the_same_results(radix):
    """gather with its slots up a tree (routes.slots_up_tree, from 64 ranks; forced here), to rank 3: right on every
    spread; no collective at all (the destination's word comes back down the same tree: NCCL's route,
    routes.word_down_tree, forced with the slots' tree here); each rank
    takes its children's lengths in one batch and their bytes in another, then sends both to its parent in one, takes
    the word from its parent in one and passes it to its children in one, the rests in one more batch (at most 6: a
    relay with a rest). Radix 4 (SLOT_TREE_RADIX) at W = 8: rank 3's children are 4, 5, 6 and 7, a relay over 0, 1
    and 2; radix 8: every rank is rank 3's child."""
    for rank, rows in enumerate(get_pool(W).run(each_spread, "gather", True, False, False, radix, timeout=120)):
        for case, right, collectives, blocking, batches in rows:
            assert right, f"{case}: a wrong result on rank {rank}"
            assert collectives == 0, f"{case}: {collectives} collectives on rank {rank}"
            assert blocking == 0, f"{case}: {blocking} blocking sends/receives on rank {rank}"
            assert 1 <= batches <= 6, f"{case}: {batches} batches of sends and receives on rank {rank}"


def broadcast_rests_down_the_tree() -> List[Any]:
    """broadcast from rank 1 of every spread, of a value past the scratch size (its receivers vote first), of a
    tensor, and of 300 KB in 64 KB pieces that rank 5 refuses (over its max_bytes; no vote: it drains them and raises
    alone), each with its rest down the binomial tree from the source (routes.rest_down_tree: NCCL's route from 64
    ranks, forced here) and through the backend's broadcast: (what this rank got of each, its collectives and batches
    of sends and receives of each, and its blocking calls)."""
    rank = dist.get_rank()
    values = [spread(case, 1) for case in CASES] + [b"m" * 3_000_000, torch.arange(300_000.0), b"d" * 300_000]
    rows = []
    for rest_tree in (True, False):
        hooks = Hooks(separate_hosts=True, rest_tree=rest_tree)
        comm = objcomm.Communicator(local=False, shm=False, _hooks=hooks)
        drains = objcomm.Communicator(local=False, shm=False, _hooks=hooks, chunk_bytes=1 << 16)
        for i, value in enumerate(values):
            refusing = i == len(values) - 1
            with calls() as counts:
                try:
                    on = drains if refusing else comm
                    got = on.broadcast(
                        value if rank == 1 else None, src=1, max_bytes=100_000 if rank == 5 and refusing else None
                    )
                    outcome: Any = _same(got, value)
                except objcomm.TooLargeError:
                    outcome = "TooLargeError"
            rows.append((rest_tree, outcome, counts["collectives"], counts["p2p"], counts["blocking"]))
    return rows


def test_a_broadcasts_rest_goes_down_the_tree():
    """With its rest down the binomial tree from the source (forced), broadcast gives every rank what the backend's
    broadcast gives, refusals included (rank 5, a relay, drains each piece and still passes it on to its subtree,
    ranks 6 and 7); each piece of the rest is a batch on the source and on a leaf, two on a relay (take, pass on),
    where the backend's broadcast was one collective each, and no other call changes."""
    results = get_pool(W).run(broadcast_rests_down_the_tree, timeout=120)
    for rank, rows in enumerate(results):
        tree, plain = rows[: len(rows) // 2], rows[len(rows) // 2 :]
        relay = bool(patterns.binomial((rank - 1) % W, W).children) and rank != 1
        for (_, got, t_calls, t_batches, t_blocking), (_, want, p_calls, p_batches, _) in zip(tree, plain):
            assert got == want and got in (True, "TooLargeError"), (rank, tree, plain)
            assert p_batches == 0 and t_blocking == 0, (rank, tree, plain)
            assert t_batches == (p_calls - t_calls) * (2 if relay else 1), (rank, tree, plain)
        assert [row[1] for row in tree[-1:]] == ["TooLargeError" if rank == 5 else True], (rank, tree)
        assert tree[0][3] == 0 and tree[1][3] > 0, (rank, tree[:2])  # all 1 KB: in the slot; all 1 MB: a rest


def broadcasts_spread() -> List[Any]:
    """broadcast from ranks 1 and 6 of values whose receivers vote first (a 3 MB frame, a 4 MB tensor, a dict of
    several parts, one that rank 5 refuses) and of one they do not (300 KB in 64 KB pieces, which rank 5 refuses and
    drains), each part of the rest as a scatter, then an all_gather (routes.rest_spread: NCCL's route from 64 ranks,
    forced here), and through the backend's broadcast: (what this rank got, its dist.broadcast calls, its batches)."""
    rank = dist.get_rank()
    mixed = {"a": torch.arange(300_000.0), "b": b"z" * 2_000_000, "c": list(range(1000)), "d": torch.ones(3)}
    values = [b"m" * 3_000_000, torch.arange(1_000_000.0), mixed, b"r" * 3_000_000, b"d" * 300_000]
    rows = []
    broadcasts, real = [0], dist.broadcast

    def counted(*args: Any, **kwargs: Any) -> Any:
        broadcasts[0] += 1
        return real(*args, **kwargs)

    for forced in (True, False):
        hooks = Hooks(separate_hosts=True, rest_spread=forced)
        comm = objcomm.Communicator(local=False, shm=False, _hooks=hooks)
        drains = objcomm.Communicator(local=False, shm=False, _hooks=hooks, chunk_bytes=1 << 16)
        for root in (1, 6):
            for i, value in enumerate(values):
                refused = i >= len(values) - 2
                on = drains if i == len(values) - 1 else comm
                broadcasts[0] = 0
                dist.broadcast = counted
                try:
                    with calls() as counts:
                        limit = 100_000 if rank == 5 and refused else None
                        got = on.broadcast(value if rank == root else None, src=root, max_bytes=limit)
                        outcome: Any = _same(got, value)
                except objcomm.TooLargeError:
                    outcome = "TooLargeError"
                finally:
                    dist.broadcast = real
                rows.append((forced, root, i, outcome, broadcasts[0], counts["collectives"] - broadcasts[0]))
    return rows


def test_a_broadcasts_rest_spread_over_every_rank():
    """With each part of its rest as a scatter, then an all_gather (forced where the receivers voted), broadcast gives
    every rank what the backend's broadcast gives, from either root, refusals included: the slot's and the vote's
    dist.broadcast are the only ones left, the parts take batches of sends and receives instead (at most
    2 ceil(log2 W) a part); a rest no vote preceded (rank 5 drains it) still takes the backend's broadcast."""
    results = get_pool(W).run(broadcasts_spread, timeout=180)
    levels = (W - 1).bit_length()
    for rank, rows in enumerate(results):
        forced, plain = rows[: len(rows) // 2], rows[len(rows) // 2 :]
        for (_, root, i, got, f_bcasts, f_batches), (_, _, _, want, p_bcasts, p_batches) in zip(forced, plain):
            case = (rank, root, i)
            assert got == want, (case, forced, plain)
            assert got is True or (got == "TooLargeError" and i >= 3 and (i == 3 or rank == 5)), (case, got)
            if i < 4:  # voted: the slot's broadcast and the vote's; the parts spread
                parts = 3 if i == 2 else 1  # the dict: its frame past the slot and two tensors
                assert f_bcasts == 2 and p_bcasts > 2 if i < 3 else f_bcasts == 2, (case, f_bcasts, p_bcasts)
                assert f_batches <= p_batches + parts * 2 * levels, (case, f_batches, p_batches)
            else:  # no vote: the backend's broadcast, as without the hook
                assert (f_bcasts, f_batches) == (p_bcasts, p_batches), (case, forced, plain)


def a_liar_in_the_spread(lie: str) -> List[Any]:
    """broadcast of 3 MB from rank 1 as a scatter, then an all_gather (forced, after the vote); rank 3 lies in every
    block it sends: ``short``, it sends none of a span's bytes but its first piece's half; ``zeros``, zeros in their
    place. Then two all_gathers: what this rank got of each (the broadcast: whether it is the source's bytes, else how
    many of its bytes differ from them, and whether those are all zeros)."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(local=False, shm=False, _hooks=Hooks(separate_hosts=True, rest_spread=True))
    real, real_empty = _broadcast.chunked, _bytes.empty
    if rank == 3:

        def lying(wire: Any, kind: Any, data: torch.Tensor, peer: int) -> List[Any]:
            if kind is dist.isend:
                data = data[: data.numel() // 2] if lie == "short" else torch.zeros_like(data)
            return real(wire, kind, data, peer)

        _broadcast.chunked = lying
    _bytes.empty = lambda length, wire: torch.full((length,), 0xAA, dtype=torch.uint8)  # old bytes, not zeros
    value = b"x" * 3_000_000
    try:
        got = comm.broadcast(value if rank == 1 else None, src=1)
    finally:
        _broadcast.chunked, _bytes.empty = real, real_empty
    if got != value:
        wrong = [i for i, (a, b) in enumerate(zip(got, value)) if a != b]
        got = (len(wrong), all(got[i] == 0 for i in wrong), len(got))
    return [got == value or got, comm.all_gather(rank), comm.all_gather(rank)]


@pytest.mark.parametrize("lie", ["short", "zeros"])
def test_a_liar_in_the_spread_changes_the_blocks_it_passes_on_to_zeros_never_old_memory(lie):
    """Each rank relays blocks in the spread unchecked (docs/security.md): a lying rank changes the blocks it passes
    on, for the ranks that get them from it, where a short send leaves zeros (never the receiver's old memory: every
    uninitialized buffer holds 0xAA here); its own result and the source's are right, and the group stays in step."""
    outcomes = get_pool(W).run(a_liar_in_the_spread, lie, timeout=120)
    misled = 0
    for rank, (got, *after) in enumerate(outcomes):
        assert after == [list(range(W))] * 2, (rank, after)
        if rank in (1, 3):
            assert got is True, (rank, got)
        elif got is not True:
            wrong, zeros, length = got
            assert zeros and length == 3_000_000 and 0 < wrong < length, (rank, lie, got)
            misled += 1
    assert misled, f"no rank got rank 3's lie ({lie})"


def a_liar_down_the_broadcast_tree(lie: str) -> List[Any]:
    """broadcast of 300 KB from rank 1, its rest down the tree (forced); rank 3 relays it to rank 4 and lies:
    ``short``, it sends the first half of each piece; ``zeros``, zeros in their place. Then two all_gathers: what this
    rank got of each (the broadcast: whether it is the source's bytes, else what it is)."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(local=False, shm=False, _hooks=Hooks(separate_hosts=True, rest_tree=True))
    real, real_empty = _bytes.Batch.send, _bytes.empty
    if rank == 3:

        def lying_send(batch: Any, data: torch.Tensor, dst: int) -> None:
            real(batch, data[: data.numel() // 2] if lie == "short" else torch.zeros_like(data), dst)

        _bytes.Batch.send = lying_send  # type: ignore[method-assign]
    # every buffer that may be left uninitialized holds old bytes (as reused memory would), not the OS's zeros
    _bytes.empty = lambda length, wire: torch.full((length,), 0xAA, dtype=torch.uint8)
    try:
        got = comm.broadcast(b"x" * 300_000 if rank == 1 else None, src=1)
    finally:
        _bytes.Batch.send, _bytes.empty = real, real_empty  # type: ignore[method-assign]
    return [got == b"x" * 300_000 or got, comm.all_gather(rank), comm.all_gather(rank)]


@pytest.mark.parametrize("lie", ["short", "zeros"])
def test_a_liar_down_the_broadcast_tree_changes_its_subtrees_bytes_only(lie):
    """A relay passes its subtree the pieces unchecked (docs/security.md): it can change what its subtree receives,
    and where it sends less than a piece its child reads zeros there, never its own old memory (every uninitialized
    buffer holds 0xAA here); every other rank gets the source's bytes, and the group stays in step."""
    outcomes = get_pool(W).run(a_liar_down_the_broadcast_tree, lie, timeout=120)
    misled = b"x" * 150_000 + bytes(150_000) if lie == "short" else bytes(300_000)
    for rank, (got, *after) in enumerate(outcomes):
        assert got is True if rank != 4 else got == misled, (rank, lie, got if got is True else len(got))
        assert after == [list(range(W))] * 2, (rank, after)


def a_lying_source(rest_tree: bool) -> List[Any]:
    """Rank 1 broadcasts a frame past its 128-byte slot whose tensor table announces 2**40 bytes for its one tensor
    of 1,000 (its slot lists 1,000), its rest down the tree or through gloo's broadcast; then one all_gather: what
    each rank got of both (the source: whether it sent)."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(
        local=False, shm=False, slot_bytes=128, _hooks=Hooks(separate_hosts=True, rest_tree=rest_tree)
    )
    try:
        if rank == 1:
            call = comm._call({})
            call_words.enter("broadcast", 1)  # (the honest call's word, as the object API sets it)
            _broadcast.broadcast(call.wire, _forged_table(1 << 40), _frame.tensor_sizes, 1, route=comm._route(call)[0])
            got: Any = "sent"
        else:
            got = comm.broadcast(None, src=1)
    except objcomm.ObjcommError as exc:
        got = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return [got, comm.all_gather(rank)]


@pytest.mark.parametrize("rest_tree", [True, False], ids=["down the tree", "gloo's broadcast"])
def test_a_lying_source_gets_the_same_clear_error_on_every_receiver(rest_tree):
    outcomes = get_pool(W).run(a_lying_source, rest_tree, timeout=120)
    says = "FrameError: the frame announces 1,099,511,627,776 bytes for out-of-band tensor #0, 1,000 arrived"
    assert [got for got, _ in outcomes] == [says, "sent", *[says] * (W - 2)], outcomes
    assert [after for _, after in outcomes] == [list(range(W))] * W, outcomes


def gather_up_a_tree_in_subgroups() -> List[bool]:
    """gather with its slots up the tree on groups of 3, 5, 6 and 7 ranks (not powers of two) to each rank in turn,
    one object past the slot (rank 1's): every object on the destination, in group-rank order; None elsewhere."""
    rank, seen = dist.get_rank(), []
    for size in (3, 5, 6, 7):
        group = dist.new_group(list(range(size)))
        if rank >= size:
            continue
        hooks = Hooks(separate_hosts=True, up_tree=True)
        comm = objcomm.Communicator(group, local=False, shm=False, _hooks=hooks)
        objs = [(r, "x" * (5000 if r == 1 else 10)) for r in range(size)]
        for dst in range(size):
            got = comm.gather(objs[rank], dst=dst)
            seen.append(got == objs if rank == dst else got is None)
        dist.destroy_process_group(group)
    return seen


def test_a_gathers_slots_up_a_tree_of_any_size_reach_any_destination():
    for rank, seen in enumerate(get_pool(W).run(gather_up_a_tree_in_subgroups, timeout=120)):
        assert seen == [True] * sum(size for size in (3, 5, 6, 7) if rank < size), (rank, seen)


def lying_children_up_the_tree(lie: str) -> List[int]:
    """The binomial tree (radix 2) of a gather's slots (64 bytes each) to rank 0, rank 3 (a leaf under rank 2) lying:
    ``short``, its lengths announce 64 bytes and it sends 8 (its relay, rank 2, freed memory full of 0xAB just before);
    ``long``, its lengths announce 1,000 bytes, past the slot. Every other rank's slot is 64 bytes of its rank + 1. The
    destination's table, as lists of each rank's slot."""
    rank, width = dist.get_rank(), 64
    wire = _Wire(dist.group.WORLD, list(range(W)), rank, torch.device("cpu"), width, 1 << 20, 1 << 30)
    if rank == 3:  # its own two messages to its parent, rank 2
        batch = _bytes.Batch(wire._replace(tag=_base.INTERNAL_TAG), "gather")
        batch.send(torch.tensor([64 if lie == "short" else 1000], dtype=torch.int32).view(torch.uint8), 2)
        batch.send(torch.full((8 if lie == "short" else 64,), 4, dtype=torch.uint8), 2)
        batch.wait()
        return []
    if rank == 2:
        for _ in range(50):
            held = torch.full((2 * width,), 0xAB, dtype=torch.uint8)
            del held
    table = _slot_tree.gather_up_tree(wire, bytearray([rank + 1] * width), width, 0, "gather", radix=2)
    return [] if table is None else [list(table[r * width : (r + 1) * width]) for r in range(W)]


@pytest.mark.parametrize("lie", ["short", "long"])
def test_a_lying_child_up_the_tree_changes_its_own_slot_only(lie):
    """A child that sends less than its lengths announced: its relay passes on zeros after what came (never what
    the relay's process held before: 171 = 0xAB with an uninitialised buffer). A child whose lengths are past the
    slot size: its subtree arrives empty (zeros), its bytes taken and dropped. Every other slot arrives whole."""
    table = get_pool(W).run(lying_children_up_the_tree, lie, timeout=60)[0]
    three = [4] * 8 + [0] * 56 if lie == "short" else [0] * 64
    assert table == [three if r == 3 else [r + 1] * 64 for r in range(W)]


def gathers_whose_roots_cut_in_small_pieces() -> List[Any]:
    """gather with its slots up the tree (forced), the destination's word back down it, where the destination's own
    chunk_bytes is 4 (the word is 8 bytes): each call's outcome on this rank, a refusal (LOOK) among them."""
    rank = dist.get_rank()
    rows: List[Any] = []
    for dst in (0, 3):
        chunk = 4 if rank == dst else None
        hooks = Hooks(separate_hosts=True, up_tree=True)
        comm = objcomm.Communicator(local=False, shm=False, _hooks=hooks, **({"chunk_bytes": chunk} if chunk else {}))
        for call in range(4):
            refusing = call == 1  # the destination refuses rank 5's object: every rank raises alike
            try:
                got = comm.gather(
                    b"x" * (20_000 if rank == 5 and refusing else 10) + bytes([rank]),
                    dst=dst,
                    max_bytes=10_000 if refusing and rank == dst else None,
                )
                right = [g[-1] for g in got] == list(range(W)) if rank == dst else got is None
                rows.append((dst, call, right))
            except objcomm.ObjcommError as exc:
                rows.append((dst, call, type(exc).__name__))
    return rows


def test_the_destination_s_word_comes_down_whole_whatever_its_chunk_bytes():
    """A reviewer's find: the word went down the tree in pieces of the rank's own chunk_bytes; a destination with 4
    cut it in two, and the second half became its child's word in the next call (a refusal read as go on there)."""
    expected = [(dst, call, "TooLargeError" if call == 1 else True) for dst in (0, 3) for call in range(4)]
    assert get_pool(W).run(gathers_whose_roots_cut_in_small_pieces, timeout=120) == [expected] * W


def a_child_that_stalls_each_message(up_tree: bool) -> Any:
    """Ranks 0-5 in a group with a 4 s timeout gather to rank 0, its slots up the tree; rank 1 (a leaf under rank 0)
    holds back each of its two messages 3 s, each within the timeout, both together past it. What this rank's call
    came to: returned, or the error's type (None on ranks 6 and 7, outside the group)."""
    rank = dist.get_rank()
    group = dist.new_group(list(range(6)), timeout=timedelta(seconds=4))
    if rank >= 6:
        return None
    real = _slot_tree.Batch
    if rank == 1:

        class Slow(_bytes.Batch):
            def send(self, data: Any, dst: int) -> None:
                time.sleep(3)
                super().send(data, dst)

        _slot_tree.Batch = Slow  # type: ignore[misc]
    comm = objcomm.Communicator(group, local=False, shm=False, _hooks=Hooks(separate_hosts=True, up_tree=up_tree))
    try:
        comm.gather(("obj", rank), dst=0)
        outcome = "returned"
    except objcomm.CommunicationError:
        outcome = "CommunicationError"
    finally:
        _slot_tree.Batch = real  # type: ignore[misc]
    dist.destroy_process_group(group)
    return outcome


def _all_gather_ranks() -> Any:
    return _comm().all_gather(dist.get_rank())


def test_a_child_that_stalls_each_message_within_the_timeout_leaves_every_honest_rank_alike():
    """The tree's waits on a rank share one deadline: the destination gives up within the group's timeout, as the
    ranks waiting for its word do, so every honest rank raises (with a deadline per wait, the destination waited 6 s
    in two waits of 3 s and returned every object while ranks 3 and 5 had timed out waiting for its word)."""
    outcomes = get_pool(W).run(a_child_that_stalls_each_message, True, timeout=120)
    honest = [outcomes[r] for r in (0, 2, 3, 4, 5)]
    assert honest == ["CommunicationError"] * 5, outcomes
    assert outcomes[6:] == [None, None]
    assert get_pool(W).run(_all_gather_ranks) == [list(range(W))] * W  # the pool's own group is in step after


def outlier_sends() -> List[Any]:
    """all_gather with one 20 MB object (rank 1's), then also a 2 MB one (rank 5's), among 1 KB ones: the bytes this
    rank posts in batches of sends, its broadcasts and collectives, and whether every object arrived."""
    comm, rank = _comm(), dist.get_rank()
    sent = {"bytes": 0}
    real_batch = dist.batch_isend_irecv

    def batch(ops: List[Any]) -> Any:
        sent["bytes"] += sum(o.tensor.numel() for o in ops if o.op is dist.isend)
        return real_batch(ops)

    rows = []
    for big in ({1: 20 << 20}, {1: 20 << 20, 5: 2 << 20}):
        objs = [b"o" * big.get(r, 1000) for r in range(W)]
        sent["bytes"] = 0
        with calls() as counts:
            dist.batch_isend_irecv = batch
            try:
                got = comm.all_gather(objs[rank])
            finally:
                dist.batch_isend_irecv = real_batch
        rows.append((got == objs, sent["bytes"], counts["collectives"]))
    return rows


def test_rests_that_dwarf_the_others_go_by_stripes():
    """gloo's exchange at exact sizes: each rest goes to the ranks whose stripe of the stream of rests holds it, then
    one all_gather of the stripes. The 20 MB object leaves its owner once (7/8 of it, to 7 stripes), not to each of
    its 7 peers (140 MB); the 2 MB one lies in rank 7's stripe and goes there alone; no broadcast, 3 calls a rank."""
    for rank, ((alone, sent_alone, calls_alone), (two, sent_two, calls_two)) in enumerate(
        get_pool(W).run(outlier_sends, timeout=120)
    ):
        assert alone and two, rank
        assert calls_alone <= 3 and calls_two <= 3, (rank, calls_alone, calls_two)  # slots, the batch, the stripes
        if rank == 1:  # its frame is its 20 MB and a header: all but its own stripe (one eighth) leaves
            assert 7 * (20 << 20) // 8 <= sent_alone < 7 * ((20 << 20) + 4096) // 8 + 8, sent_alone
            two_stripes = ((20 << 20) + (2 << 20)) // 8  # 2.75 MB; its frame: the first 20 MB of the stream
            assert (20 << 20) - two_stripes <= sent_two < (20 << 20) + 4096 - two_stripes + 8, sent_two
        elif rank == 5:  # its 2 MB (with its frame's header) to rank 7, whose stripe holds all of it
            assert sent_alone == 0 and (2 << 20) <= sent_two < (2 << 20) + 4096, (sent_alone, sent_two)
        else:  # the others fit their slots
            assert sent_alone == sent_two == 0, (rank, sent_alone, sent_two)


def stripes_at_every_offset(chunk: int) -> List[Any]:
    """``by_stripes`` straight on the pool's wire, in pieces of ``chunk`` bytes, for rests that start and end inside,
    at and across stripe edges (zeros among them, one rank alone, every rank alike): whether each rank got every
    other rank's bytes, and none of its own."""
    rank = dist.get_rank()
    wire = _Wire(None, list(range(W)), rank, torch.device("cpu"), slot=4096, chunk=chunk, max_bytes=1 << 30)
    rows = []
    for lengths in (
        [0, 10, 0, 2, 0, 0, 0, 0],
        [1, 2, 3, 4, 5, 6, 7, 8],
        [0] * 7 + [1000],
        [999, 0, 0, 0, 0, 0, 0, 1],
        [5000, 1, 0, 77, 3000, 0, 12, 4096],
    ):
        own = torch.arange(lengths[rank], dtype=torch.int64).add_(rank * 31).remainder_(251).to(torch.uint8)
        got = _exchange.by_stripes(wire, own, lengths, "all_gather")
        want = [
            None if r == rank or not n else torch.arange(n, dtype=torch.int64).add_(r * 31).remainder_(251)
            for r, n in enumerate(lengths)
        ]
        rows.append(
            all(
                (g is None and w is None) or (g is not None and w is not None and torch.equal(g.long(), w))
                for g, w in zip(got, want)
            )
        )
    return rows


@pytest.mark.parametrize("chunk", [1 << 20, 7])
def test_stripes_put_every_rest_on_every_rank(chunk):
    for rank, rows in enumerate(get_pool(W).run(stripes_at_every_offset, chunk, timeout=120)):
        assert all(rows), (rank, rows)


def tensors_by_stripes(k: int = 1) -> List[Any]:
    """all_gather of tensors at odd offsets of the stream (rank 3's 1 MB of float64 among small float32 and int16
    ones, each rank's frame before its tensor): whether stripes carried them, and whether every value arrived.
    ``k`` > 1: hosts of ``k`` ranks, whose leaders' stripes write the stream into the file their hosts map (shared
    memory from 256 KiB, in place from 512 KiB): also the files this rank mapped and the copies it wrote into one."""
    if k > 1:
        with ranks_per_host(k):
            comm, rank = objcomm.Communicator(shm_threshold=256 << 10), dist.get_rank()
            comm.all_gather(rank)  # the set-up
            mapped, written = [], []
            real_map, real_write = _two_level.map_parts, _two_level.write_sealed
            _two_level.map_parts = lambda *args: mapped.append(1) or real_map(*args)  # type: ignore[assignment]
            _two_level.write_sealed = lambda *args: written.append(1) or real_write(*args)  # type: ignore[assignment]
            in_place_from, _cutoffs.IN_PLACE_FROM = _cutoffs.IN_PLACE_FROM, 512 << 10
            try:
                return [*_tensors_by_stripes(comm, rank), len(mapped), len(written)]
            finally:
                _two_level.map_parts, _two_level.write_sealed = real_map, real_write  # type: ignore[assignment]
                _cutoffs.IN_PLACE_FROM = in_place_from
    return _tensors_by_stripes(_comm(), dist.get_rank())


def _tensors_by_stripes(comm: objcomm.Communicator, rank: int) -> List[Any]:
    count = {"stripes": 0}
    real = _exchange.by_stripes

    def counted(*args: Any) -> Any:
        count["stripes"] += 1
        return real(*args)

    def obj(r: int) -> Any:
        if r == 3:
            return {"big": torch.arange(131_073, dtype=torch.float64) * 0.5, "r": r}
        return {"small": torch.arange(r + 2, dtype=torch.float32 if r % 2 else torch.int16), "r": r}

    _exchange.by_stripes = counted  # type: ignore[assignment]
    try:
        got = comm.all_gather(obj(rank))
    finally:
        _exchange.by_stripes = real  # type: ignore[assignment]
    return [count["stripes"], all(_same(g, obj(r)) for r, g in enumerate(got))]


def test_tensors_at_any_offset_of_the_stream_arrive_whole():
    """Stripes hand back each rest as a slice of one stream, so a rank's tensors start at any byte offset there."""
    assert get_pool(W).run(tensors_by_stripes, timeout=60) == [[1, True]] * W


def test_the_leaders_stripes_write_the_hosts_file_in_place():
    """Hosts of three (3 + 3 + 2): the three leaders' stripes write the stream of every host's rests straight into
    the shared file their hosts map (routes.in_place_table), which no leader copies into; tensors at any offset of
    it arrive whole on every rank."""
    got = get_pool(W).run(tensors_by_stripes, 3, timeout=120)
    assert got == [[1, True, 0, 0] if r in (0, 3, 6) else [0, True, 1, 0] for r in range(W)], got


def stripes_with_a_liar(lie: str) -> List[Any]:
    """``by_stripes`` with one lying rank: ``short``, rank 4 sends the first half of each piece of its 1,000 bytes;
    ``relay``, rank 2 flips the bytes of its stripe (pieces of other ranks' rests) before the stripes' all_gather.
    Each rank's view of every other rank's rest, as bytes."""
    rank = dist.get_rank()
    wire = _Wire(dist.group.WORLD, list(range(W)), rank, torch.device("cpu"), 4096, 1 << 20, 1 << 30)
    lengths = [300, 0, 500, 0, 1000, 0, 700, 100]
    own = torch.full((lengths[rank],), rank + 1, dtype=torch.uint8)
    real_gather, real_batch = _bytes.all_gather_single, dist.batch_isend_irecv
    if lie == "relay" and rank == 2:

        def forged(out: torch.Tensor, stripe: torch.Tensor, **kwargs: Any) -> Any:
            return real_gather(out, stripe.bitwise_not(), **kwargs)

        _bytes.all_gather_single = forged  # type: ignore[assignment]
    if lie == "short" and rank == 4:

        def halves(ops: List[Any]) -> Any:
            return real_batch(
                [dist.P2POp(o.op, o.tensor[: o.tensor.numel() // 2], o.peer, o.group, o.tag) for o in ops]
            )

        dist.batch_isend_irecv = halves
    try:
        got = _exchange.by_stripes(wire, own, lengths, "all_gather")
    finally:
        _bytes.all_gather_single, dist.batch_isend_irecv = real_gather, real_batch
    return [None if g is None else bytes(g.numpy()) for g in got]


@pytest.mark.parametrize("lie", ["short", "relay"])
def test_a_liar_in_the_stripes_changes_the_stream_alike_for_every_rank(lie):
    """A rank that sends less than its slot announced, or changes the pieces its stripe relays, changes bytes of the
    stream, never a size or a route, and every rank sees the same stream (gloo's all_gather forwards one stripe to
    all): ``short`` zeros the liar's own tail; ``relay`` changes only the bytes in the liar's stripe."""
    views = get_pool(W).run(stripes_with_a_liar, lie, timeout=60)
    lengths = [300, 0, 500, 0, 1000, 0, 700, 100]
    width = -(-sum(lengths) // W)  # 325: rank 2's stripe holds bytes 650-975 of the stream
    stream: List[bytes] = []
    for r, n in enumerate(lengths):
        seen = {views[viewer][r] for viewer in range(W) if viewer != r}
        assert len(seen) == 1, (r, seen)  # alike on every rank
        stream.append(seen.pop() or b"")
        assert len(stream[r]) == n
    honest = b"".join(bytes([r + 1]) * n for r, n in enumerate(lengths))
    if lie == "short":  # its pieces for stripes 2, 3 and 5 (175, 325, 175 bytes) half sent; its own stripe intact
        pieces = [(0, 175), (175, 500), (825, 1000)]
        want = bytearray(bytes([5]) * 1000)
        for start, end in pieces:
            want[start + (end - start) // 2 : end] = bytes(end - start - (end - start) // 2)
        assert stream[4] == bytes(want)
        assert [stream[r] for r in (0, 2, 6, 7)] == [bytes([r + 1]) * lengths[r] for r in (0, 2, 6, 7)]
    else:
        got = b"".join(stream)
        changed = [i for i in range(len(got)) if got[i] != honest[i]]
        assert changed and set(changed) <= set(range(2 * width, 3 * width)), (changed[:3], changed[-3:])
        assert all(got[i] == 255 - honest[i] for i in range(2 * width, 3 * width))


def reductions() -> List[Any]:
    """all_reduce and reduce of a small and a large value: results and this rank's calls."""
    comm, rank = _comm(), dist.get_rank()
    rows = []
    for value in (rank + 1, {"b": b"r" * (300_000 + rank)}):
        plus = (lambda a, b: a + b) if isinstance(value, int) else (lambda a, b: {"b": a["b"] + b["b"][:1]})
        with calls() as counts:
            got = comm.all_reduce(value, plus)
            red = comm.reduce(value, plus, dst=2)
        rows.append((got, red, counts["collectives"]))
    return rows


def test_reductions_end_without_an_all_gather_of_slots():
    results = get_pool(W).run(reductions, timeout=120)
    want_big = {"b": b"r" * (300_000 + 3)}  # the tree combines log2(8) = 3 times on group rank 0
    for rank, ((small, small_red, small_calls), (big, big_red, big_calls)) in enumerate(results):
        assert small == sum(range(1, W + 1)) and big == want_big
        assert (small_red, big_red) == ((sum(range(1, W + 1)), want_big) if rank == 2 else (None, None))
        # all_reduce: one broadcast (its value in the slot) or a broadcast and its rest; reduce: a gather of
        # slots and dst's word, then (a value past the slot) one batch; the tree's sends are point to point
        assert small_calls <= 3 and big_calls <= 6, (rank, small_calls, big_calls)


def down_the_tree(k: int = 1) -> List[Any]:
    """all_reduce off the channel by NCCL's route (the result back down the reduce tree, taken on gloo here): values
    in the slot, past it, past the 1 MiB scratch size (its receivers answer first) and a tensor (out of band); then
    the result over a leaf's max_bytes, and an op that raises on one rank; then gloo's own route (a broadcast).
    ``k`` > 1: hosts of ``k`` ranks, whose trees (up, and down as gloo's two levels take it from 64 leaders) climb
    each host's channel and the leaders'."""
    if k > 1:
        with ranks_per_host(k):
            objcomm.Communicator().all_gather(dist.get_rank())  # the set-up
            return _down_the_tree(objcomm.Communicator(_hooks=Hooks(down_tree=True)))
    return _down_the_tree(
        objcomm.Communicator(local=False, shm=False, _hooks=Hooks(separate_hosts=True, down_tree=True))
    )


def _down_the_tree(comm: objcomm.Communicator) -> List[Any]:
    rank = dist.get_rank()
    rows: List[Any] = []
    for value in (rank + 1, b"r" * (300_000 + rank), b"m" * (3_000_000 + rank), torch.full((50_000,), float(rank))):
        plus = (lambda a, b: a + b[:1]) if isinstance(value, bytes) else operator.add
        with calls() as counts:
            got = comm.all_reduce(value, plus)
        rows.append((got, counts["collectives"], counts["blocking"] + counts["p2p"]))
    failing = []  # this rank's torch.distributed calls in each failing call
    for case in ("over a leaf's limit", "op raises on rank 6"):
        with calls() as counts:
            try:
                if case == "over a leaf's limit":
                    comm.all_reduce(b"x" * 20_000, operator.add, max_bytes=100_000 if rank == 7 else None)  # 160 KB
                else:
                    comm.all_reduce(rank, lambda a, b: a + b if rank != 6 else a + None)
                rows.append((case, "returned"))
            except objcomm.RemoteError as exc:
                rows.append((case, exc.failures and {r: t for r, (t, _) in exc.failures.items()}))
        failing.append(sum(counts.values()))
    rows.append(comm.all_reduce(1, "sum"))  # in step afterwards
    with calls() as counts:
        rows.append((_comm().all_reduce(rank, "sum"), counts["collectives"]))
    rows.append(failing)
    rows.append((comm.scan(str(rank), "sum"), comm.exscan(b"e" * (5000 + rank), "sum")))  # (past the slot)
    return rows


@pytest.mark.parametrize("k", [1, 4, 3])
def test_all_reduce_returns_down_the_tree(k):
    """Off the channel on NCCL, all_reduce's result goes back down the reduce tree: no collective when nothing fails
    (log2(8) = 3 levels of send/recv each way); a result over one leaf's max_bytes is refused once, by group rank 0,
    for every rank alike (the leaf's limit came up the tree); a failure in the tree reaches every rank. With hosts
    of ``k`` (gloo's two levels from 64 leaders, forced here): the same results and errors, and inside a host only
    the channel (a leaf: one message up, one down)."""
    results = get_pool(W).run(down_the_tree, k, timeout=120)
    combined = (k - 1).bit_length() + (-(-W // k) - 1).bit_length()  # on rank 0: its host's levels, the leaders'
    for rank, rows in enumerate(results):
        (small, small_c, small_p2p), (big, big_c, big_p2p), (huge, huge_c, _), (tensor, tensor_c, _) = rows[:4]
        assert small == sum(range(1, W + 1)), (rank, small)
        assert big == b"r" * (300_000 + combined) and huge == b"m" * (3_000_000 + combined), (rank, combined)
        assert torch.equal(tensor, torch.full((50_000,), float(sum(range(W)))))
        assert (small_c, big_c, huge_c, tensor_c) == (0, 0, 0, 0), (rank, rows[:4])
        if k == 1:  # a leaf (odd rank) sends once up and receives once down; rank 0 receives 3 and sends 3
            assert small_p2p <= (2 if rank % 2 else 6), (rank, small_p2p)
        elif rank % k:  # inside a host the channel alone, failures' reports too (along the same two trees)
            assert small_p2p == big_p2p == 0 and rows[8] == [0, 0], (k, rank, rows[:2], rows[8])
        assert rows[4] == ("over a leaf's limit", {0: "TooLargeError"}), (rank, rows[4])
        assert rows[5] == ("op raises on rank 6", {6: "TypeError"}), (rank, rows[5])
        assert rows[6] == W
        assert rows[7] == (sum(range(W)), 1), rows[7]  # gloo's own route: the slot in gloo's broadcast
        # a scan's messages take the channel inside a host and the backend between hosts, as the trees' do
        want = b"e" * sum(5000 + q for q in range(rank)) or None
        assert rows[9] == ("".join(map(str, range(rank + 1))), want), (k, rank, rows[9][0])


def _forged_table(nbytes: int) -> Outgoing:
    """A frame with one 1,000-byte out-of-band tensor whose table entry announces ``nbytes`` (a lying sender)."""
    out = _frame.encode(
        {"t": torch.ones(1000, dtype=torch.uint8)}, serializers.get("pickle"), max_bytes=1 << 30, inline_tensor_bytes=0
    )
    frame = bytearray(out.frame)
    entry = _frame.HEADER.size + len(_frame.parse_header(memoryview(frame)).serializer)
    struct.pack_into("<Q", frame, entry + 8, nbytes)  # the entry's byte count
    struct.pack_into("<q", frame, entry + _tensors.ENTRY.size, nbytes)  # its one dimension, so the entry agrees
    return Outgoing(memoryview(frame), out.tensors)


def bad_input(case: str, up_tree: bool = False) -> str:
    """What each rank raises when one rank misbehaves on the paths above (``up_tree``: a gather's slots up a tree, where
    8 ranks have a relay, and an all_gather's summed)."""
    comm, rank = _comm(up_tree, summed=up_tree), dist.get_rank()
    try:
        if case == "over the destination's limit":
            comm.gather(b"x" * ((1 << 20) if rank == 6 else 10), dst=3, max_bytes=(1 << 19) if rank == 3 else None)
        elif case == "over a receiver's limit":
            comm.all_gather(b"x" * ((1 << 20) if rank == 6 else 10), max_bytes=(1 << 19) if rank == 2 else None)
        elif case == "a failing encode (gather)":
            comm.gather(object() if rank == 5 else rank, dst=0, serializer="json")
        elif case == "a failing encode (all_gather)":
            comm.all_gather(object() if rank == 5 else b"x" * 100_000, serializer="json")
        elif case == "a lying sender":
            if rank == 4:
                call_words.enter("gather", 0)  # (the honest call's word, as the object API sets it)
                _gather.gather(
                    comm._call({}).wire, _forged_table(1 << 40), _frame.tensor_sizes, 0, comm._route(comm._call({}))[0]
                )
            else:
                comm.gather({"t": torch.ones(1000, dtype=torch.uint8)}, dst=0)
        return "no error"
    except objcomm.ObjcommError as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"


BAD_INPUT = [
    "over the destination's limit",
    "over a receiver's limit",
    "a failing encode (gather)",
    "a failing encode (all_gather)",
    "a lying sender",
]
ON_GATHER = ["over the destination's limit", "a failing encode (gather)", "a lying sender"]
ON_SUMMED = ["over a receiver's limit", "a failing encode (all_gather)"]


@pytest.mark.parametrize(
    "case, up_tree",
    [(case, False) for case in BAD_INPUT] + [(case, True) for case in ON_GATHER + ON_SUMMED],
    ids=[*BAD_INPUT, *(f"{case}, slots up a tree" for case in ON_GATHER), *(f"{c}, slots summed" for c in ON_SUMMED)],
)
def test_bad_input_gets_the_same_error_on_every_rank(case, up_tree):
    outcomes = get_pool(W).run(bad_input, case, up_tree, timeout=120)
    assert len(set(outcomes)) == 1, outcomes
    assert outcomes[0] != "no error"
    expected = {
        "over the destination's limit": "TooLargeError",
        "over a receiver's limit": "TooLargeError",
        "a failing encode (gather)": "RemoteError",
        "a failing encode (all_gather)": "RemoteError",
        "a lying sender": "FrameError",
    }[case]
    assert outcomes[0].startswith(expected), outcomes[0]


@contextlib.contextmanager
def ranks_per_host(k: int) -> Iterator[None]:
    """Simulated hosts of ``k`` consecutive ranks (``OBJCOMM_TEST_RANKS_PER_HOST``) inside."""
    os.environ["OBJCOMM_TEST_RANKS_PER_HOST"] = str(k)
    previous = objcomm.configure()
    try:
        yield
    finally:
        del os.environ["OBJCOMM_TEST_RANKS_PER_HOST"]
        objcomm.restore(previous)


def leaders_spread_a_broadcast() -> List[Any]:
    """Hosts of two (four leaders): broadcasts from ranks 1 and 6 (a leader's host, not a leader) of a 3 MB frame, a
    4 MB tensor, a dict of several parts (each past the scratch size: the receivers vote, and the leaders hold it all)
    and one rank 7 refuses, with the leaders' step spread (routes.leaders_spread, which from 5 leaders picks it, made
    to say yes wherever a vote ran) and as gloo's broadcast: (what this rank got, its dist.broadcast calls)."""
    rank = dist.get_rank()
    mixed = {"a": torch.arange(400_000.0), "b": b"z" * 2_000_000, "c": list(range(1000))}
    values = [b"m" * 3_000_000, torch.arange(1_000_000.0), mixed, b"r" * 3_000_000]
    rows = []
    real_spread, real_broadcast = routes.leaders_spread, dist.broadcast
    broadcasts = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        broadcasts[0] += 1
        return real_broadcast(*args, **kwargs)

    with ranks_per_host(2):
        comm = objcomm.Communicator()
        comm.all_gather(rank)  # the set-up
        for spread_it in (True, False):
            if spread_it:
                routes.leaders_spread = lambda *, leaders, moved, agreed: agreed  # type: ignore[assignment]
            dist.broadcast = counted
            try:
                for root in (1, 6):
                    for i, value in enumerate(values):
                        broadcasts[0] = 0
                        limit = 1 << 20 if rank == 7 and i == 3 else None
                        try:
                            got: Any = _same(
                                comm.broadcast(value if rank == root else None, src=root, max_bytes=limit), value
                            )
                        except objcomm.TooLargeError:
                            got = "TooLargeError"
                        rows.append((spread_it, root, i, got, broadcasts[0]))
            finally:
                routes.leaders_spread, dist.broadcast = real_spread, real_broadcast
        rows.append(comm.all_gather(rank))
    return rows


def test_the_leaders_spread_a_broadcasts_rest():
    """On two levels, the leaders' step of a broadcast's rest as a scatter, then an all_gather among them (forced
    where the receivers voted) gives every rank what gloo's broadcast among them gives, from a leader's host and from
    a rank that is no leader, refusals alike (rank 7 over its max_bytes: every rank raises): the rest takes no
    dist.broadcast on any rank (the slot's and the vote's stay), and the group stays in step."""
    results = get_pool(W).run(leaders_spread_a_broadcast, timeout=180)
    for rank, rows in enumerate(results):
        *calls, after = rows
        assert after == list(range(W)), (rank, after)
        spread, plain = calls[: len(calls) // 2], calls[len(calls) // 2 :]
        for (_, root, i, got, s_bcasts), (_, _, _, want, p_bcasts) in zip(spread, plain):
            assert got == want == (True if i < 3 else "TooLargeError"), (rank, root, i, got, want)
            if rank % 2 == 0 and i < 3:  # a leader: gloo's broadcast of the rest among the leaders is gone
                assert s_bcasts < p_bcasts, (rank, root, i, s_bcasts, p_bcasts)
            else:
                assert s_bcasts <= p_bcasts, (rank, root, i, s_bcasts, p_bcasts)


IN_PLACE_HERE = 1 << 20  # routes.IN_PLACE_FROM on the ranks of two_levels() (32 MiB: past these results)


def two_levels(k: int) -> List[Any]:
    """all_gather and broadcast of every spread with hosts of ``k`` ranks: right or not, and this rank's
    torch.distributed calls; then a group inside one simulated host, which takes its channel alone."""
    with ranks_per_host(k):
        rank, comm = dist.get_rank(), objcomm.Communicator()
        comm.all_gather(rank)  # the set-up: hosts, node and leaders' groups, channels
        rows: List[Any] = []
        cases = CASES if k == 4 else ["all 1 KB", "one 20 MB", "uneven tensors"]  # (hosts of 3: the uneven ones)
        mapped = []  # an all_gather's ranks map their leader's file from shm_threshold (2 MiB) on: one copy a host
        real_map, real_write = _two_level.map_parts, _two_level.write_sealed
        _two_level.map_parts = lambda *args: mapped.append(1) or real_map(*args)  # type: ignore[assignment]
        written = []  # a leader copies its host's result into a file unless its exchange wrote the file in place
        _two_level.write_sealed = lambda *args: written.append(1) or real_write(*args)  # type: ignore[assignment]
        in_place_from, _cutoffs.IN_PLACE_FROM = _cutoffs.IN_PLACE_FROM, IN_PLACE_HERE
        try:
            for case in cases:
                with calls() as gathered:
                    before, copied = len(mapped), len(written)
                    got = comm.all_gather(spread(case, rank))
                    shared, copied = len(mapped) - before, len(written) - copied
                with calls() as broadcast:
                    root = comm.broadcast(spread(case, 6) if rank == 6 else None, src=6)
                with calls() as to_one:
                    at_five = comm.gather(spread(case, rank), dst=5)
                right = all(_same(g, spread(case, r)) for r, g in enumerate(at_five)) if rank == 5 else at_five is None
                rows.append(
                    (
                        case,
                        all(_same(g, spread(case, r)) for r, g in enumerate(got)),
                        gathered["collectives"],
                        gathered["blocking"],
                        _same(root, spread(case, 6)),
                        broadcast["collectives"],
                        right,
                        to_one["collectives"] + to_one["p2p"],
                        shared,
                        copied,
                    )
                )
            with calls() as reduced:
                total = comm.all_reduce(rank + 1, "sum")
            rows.append((total == sum(range(1, W + 1)), reduced["collectives"]))
            before = len(mapped)  # the table of slots (32 KB) in a shared file too, from a lower shm_threshold
            ranks = objcomm.Communicator(shm_threshold=16 << 10).all_gather(rank)
            rows.append((ranks == list(range(W)), len(mapped) - before))
        finally:
            _two_level.map_parts, _two_level.write_sealed = real_map, real_write  # type: ignore[assignment]
            _cutoffs.IN_PLACE_FROM = in_place_from
        if k == 4:
            hosts = [dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5, 6, 7])]  # every rank makes both, in order
            inside = objcomm.Communicator(group=hosts[rank // 4])
            inside.all_gather(rank)
            with calls() as counts:
                got = inside.all_gather(rank)
            rows.append((got, counts["collectives"]))
        return rows


def two_level_plans(k: int) -> List[Any]:
    """all_gather, broadcast and gather of every spread (all_reduce and reduce of :data:`TREE_CASES`) with hosts of
    ``k`` ranks: this rank's torch.distributed calls and what ``routes.plan`` gives for the same sizes on the same
    topology."""
    topology = routes.Topology(world=W, ranks_per_host=k, device="cpu")
    rows = []
    with ranks_per_host(k):
        rank, comm = dist.get_rank(), objcomm.Communicator()
        comm.all_gather(rank)  # the set-up: hosts, node and leaders' groups, channels
        for case in CASES:
            rests = _rests(case)
            reductions = (  # (their plan has one size for every message up the tree: see TREE_CASES)
                ("all_reduce", 0, lambda case=case: comm.all_reduce(spread(case, rank), op=_left)),
                ("reduce", 5, lambda case=case: comm.reduce(spread(case, rank), op=_left, dst=5)),
            )
            for op, root, run in (
                ("all_gather", 0, lambda case=case: comm.all_gather(spread(case, rank))),
                ("broadcast", 6, lambda case=case: comm.broadcast(spread(case, 6) if rank == 6 else None, src=6)),
                ("gather", 5, lambda case=case: comm.gather(spread(case, rank), dst=5)),
                *(reductions if case in TREE_CASES else ()),
            ):
                with calls() as counts:
                    run()
                planned = routes.plan(op, topology, rests, root=root)
                rows.append(
                    (case, op, sum(counts.values()), planned.torch_calls, [s.collective for s in planned.steps])
                )
    return rows


@pytest.mark.parametrize("k", [4, 3])
def test_the_routes_plan_is_what_two_levels_do(k):
    """As test_the_routes_plan_is_what_the_transport_does, with hosts of ``k`` ranks: the plan's calls are the busiest
    leader's."""
    every = get_pool(W).run(two_level_plans, k, timeout=180)
    for index, (case, op, _, planned, steps) in enumerate(every[0]):
        counted = [rows[index][2] for rows in every]
        assert max(counted) == planned, f"{op}, {case}, hosts of {k}: plan {steps} ({planned} calls), ranks {counted}"


@pytest.mark.parametrize("k", [4, 3])
def test_two_levels_only_leaders_call_the_backend(k, monkeypatch):
    """Hosts of four (two hosts) and of three (3 + 3 + 2): every result right; inside a host, only its leader (its
    lowest rank) calls torch.distributed (and copies an all_gather's result into a shared file only where the leaders'
    exchange did not write it in place), at most 3 times an all_gather (slots, one exchange of the rests: by
    stripes, a batch and an all_gather, where one host's rests dwarf the others') and a
    broadcast its slot, its rest and the vote of the leaders (recursive doubling: 1 exchange for two leaders,
    3 for three)."""
    votes = {4: 1, 3: 3}[k]
    monkeypatch.setattr(_cutoffs, "IN_PLACE_FROM", IN_PLACE_HERE)  # as two_levels() sets it on the ranks
    for rank, rows in enumerate(get_pool(W).run(two_levels, k, timeout=180)):
        leader = rank % k == 0
        done = len(CASES) if k == 4 else 3
        for (
            case,
            gathered,
            gathered_calls,
            blocking,
            broadcast,
            broadcast_calls,
            at_five,
            gather_calls,
            shared,
            copied,
        ) in rows[:done]:
            assert gathered and broadcast and at_five, (k, rank, case, rows)
            assert shared == (case != "all 1 KB" and not leader), (k, rank, case, shared)  # 2.3 MB and more
            # the leaders' padded all_gather (hosts' bundles within 2x), or their stripes' (hosts of 3: one 20 MB and
            # log-normal), writes the shared file in place; else a copy
            rests = _rests(case)
            in_place = routes.in_place_table([sum(rests[h : h + k]) for h in range(0, W, k)], cpu=True)
            assert in_place == (case != "all 1 KB"), (k, case)
            assert copied == (leader and case != "all 1 KB" and not in_place), (k, rank, case, copied)
            assert blocking == 0
            if leader:  # a gather: the slots, dst's word, the rests (one batch)
                assert 1 <= gathered_calls <= 3 and 1 <= broadcast_calls <= 2 + votes, (k, rank, case, rows)
                assert 2 <= gather_calls <= 3, (k, rank, case, rows)
            else:
                assert gathered_calls == broadcast_calls == gather_calls == 0, (k, rank, case, rows)
        reduced, reduced_calls = rows[done]
        assert reduced and (leader or reduced_calls == 0), rows[done]  # the tree's sends are point to point
        assert rows[done + 1] == (True, 0 if leader else 1), rows[done + 1]
        if k == 4:
            got, collectives = rows[-1]
            assert got == [r for r in range(W) if r // 4 == rank // 4] and collectives == 0, (rank, rows[-1])


def _raises_on_five(a: Any, b: Any) -> Any:
    """Concatenation, which raises where the right operand holds rank 5's object."""
    if 5 in b:
        raise ValueError("rank 5's object")
    return a + b


def reductions_right_and_wrong(comm: objcomm.Communicator, rank: int) -> List[Any]:
    """all_reduce and reduce, right and wrong, on ``comm``: each call's result, or its error's type and first line,
    with this rank's torch.distributed calls in it."""
    calls_of = {
        "in order": lambda: comm.all_reduce([rank], "sum"),  # concatenation: the order of ranks shows
        "reduce in order": lambda: comm.reduce([rank], "sum", dst=5),
        "1 MB each": lambda: comm.all_reduce(bytes([rank]) * (1 << 20), op=_left),  # rests over the channel
        "tensors": lambda: comm.all_reduce(torch.full((1000,), float(rank)), "sum"),
        "op raises": lambda: comm.all_reduce([rank], op=_raises_on_five),
        "refused up the tree": lambda: comm.all_reduce(
            b"x" * 200_000, "sum", max_bytes=300_000 if rank == 4 else None
        ),  # rank 4 takes rank 6's 400 KB: over its limit
        "result over a limit": lambda: comm.all_reduce(b"x" * 200_000, "sum", max_bytes=1 << 20 if rank == 2 else None),
        "a failing encode": lambda: comm.all_reduce(object() if rank == 5 else 1, "sum", serializer="json"),
    }
    rows = []
    for case, run in calls_of.items():
        with calls() as counts:
            try:
                got = run()
                outcome = got.tolist() if isinstance(got, torch.Tensor) else got
                outcome = (len(outcome), outcome[:1]) if isinstance(outcome, bytes) else outcome
            except objcomm.ObjcommError as exc:
                outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        rows.append((case, outcome, sum(counts.values())))
        assert comm.all_gather(rank) == list(range(W))  # the group is in step after the error
    return rows


def reductions_flat_and_on_two_levels(k: int) -> List[Any]:
    """:func:`reductions_right_and_wrong` every rank its own host, then with hosts of ``k`` ranks (after an
    all_gather that sets the two levels up)."""
    rank = dist.get_rank()
    flat = reductions_right_and_wrong(_comm(), rank)
    with ranks_per_host(k):
        comm = objcomm.Communicator()
        comm.all_gather(rank)
        return [flat, reductions_right_and_wrong(comm, rank)]


@pytest.mark.parametrize("k", [4, 3])
def test_reductions_on_two_levels(k):
    """With hosts of ``k`` consecutive ranks a reduction's tree climbs each host's channel, then the leaders'
    (routes.tree_on_two_levels): every result is the flat path's (ranks combined in order), and only leaders call
    torch.distributed. Every rank raises the same error as the others; with hosts of four (a power of two) the tree
    is the flat one, and each error is the flat path's word for word (ranks named by group rank: a host's channel
    numbers them from its leader); with hosts of three the tree combines other pairs, but the error is the same."""
    every = get_pool(W).run(reductions_flat_and_on_two_levels, k, timeout=180)
    for index, (case, _, _) in enumerate(every[0][1]):
        flat = [rows[0][index][1] for rows in every]
        levels = [rows[1][index][1] for rows in every]
        leveled_calls = [rows[1][index][2] for rows in every]
        assert all(levels[r] == levels[0] for r in range(W) if r != 5), (case, levels)  # (reduce: only dst has it)
        if k == 4 or not isinstance(flat[0], str):
            assert levels == flat, (case, flat, levels)
        else:
            assert levels[0].split(":")[0] == flat[0].split(":")[0], (case, flat[0], levels[0])
        assert all(calls == 0 for r, calls in enumerate(leveled_calls) if r % k), (case, k, leveled_calls)
    rows = every[0][1]
    assert rows[0][1] == list(range(W)) and rows[3][1] == [float(sum(range(W)))] * 1000, rows[:4]
    assert [every[r][1][1][1] for r in range(W)] == [None] * 5 + [list(range(W))] + [None] * 2
    assert rows[4][1].startswith("RemoteError") and "b from group rank 5" in rows[4][1], rows[4]
    assert all("TooLargeError" in row[1] for row in rows[5:7]), rows[5:7]  # (rank 0 says which rank refused)
    assert rows[7][1].startswith("RemoteError"), rows[7]


def lone_and_wide() -> List[Any]:
    """Hosts of seven (ranks 0-6, and rank 7 alone: its leader has no host channel, no file to write): all_gather of
    rests whose hosts' totals are no multiple of 64, into the shared file in place (from 1 MiB here); then, in hosts
    of three, all_gather and all_reduce with 128 KiB slots (above a channel message: no host's channel takes them)."""
    rank, rows = dist.get_rank(), []
    with ranks_per_host(7):
        comm = objcomm.Communicator(shm_threshold=256 << 10)
        comm.all_gather(rank)  # the set-up
        in_place_from, _cutoffs.IN_PLACE_FROM = _cutoffs.IN_PLACE_FROM, 1 << 20
        try:
            for n in (200_001, 200_002):  # (totals 7 bytes apart: not both multiples of 64)
                rows.append(comm.all_gather(b"x" * (n + rank)) == [b"x" * (n + r) for r in range(W)])
        finally:
            _cutoffs.IN_PLACE_FROM = in_place_from
    with ranks_per_host(3):
        objcomm.Communicator().all_gather(rank)  # the set-up, with the default slots
        wide = objcomm.Communicator(slot_bytes=128 << 10)
        rows.append(wide.all_gather(rank) == list(range(W)))
        rows.append(wide.all_reduce([rank], "sum") == list(range(W)))
    return rows


def test_every_leader_takes_the_same_rows_and_wide_slots_take_the_flat_path():
    """A leader whose host holds only it pads the leaders' all_gather to the same rows as the leaders that write a
    file in place (they once differed where the largest host's bundle was no multiple of 64: a collective of two
    sizes); slots wider than a channel message take the flat path on every rank, reductions too."""
    assert get_pool(W).run(lone_and_wide, timeout=120) == [[True] * 4] * W


def leaders_up_a_tree(k: int) -> List[Any]:
    """gather of every spread with hosts of ``k`` ranks, the leaders' step up their tree (TREE_GATHER_FROM lowered
    to 2 leaders here), to rank 5 then rank 0: right or not, and whether this rank called the backend's gather; then
    a rank over the destination's limit and a failing encode: the error on this rank."""
    with ranks_per_host(k):
        rank, comm = dist.get_rank(), objcomm.Communicator()
        comm.all_gather(rank)  # the set-up: hosts, node and leaders' groups, channels
        rows: List[Any] = []
        real_gather, real_from = dist.gather, _cutoffs.TREE_GATHER_FROM
        backend_gathers = []
        dist.gather = lambda *args, **kwargs: backend_gathers.append(1) or real_gather(*args, **kwargs)
        _cutoffs.TREE_GATHER_FROM = 2  # where slots_up_tree reads it
        try:
            for case in CASES:
                for dst in (5, 0):
                    got = comm.gather(spread(case, rank), dst=dst)
                    right = all(_same(g, spread(case, r)) for r, g in enumerate(got)) if rank == dst else got is None
                    rows.append((case, dst, right))
            for bad in ("over the destination's limit", "a failing encode"):
                try:
                    if bad == "a failing encode":
                        comm.gather(object() if rank == 6 else b"x" * 100, dst=5, serializer="json")
                    else:
                        comm.gather(
                            b"x" * ((1 << 20) if rank == 7 else 10), dst=5, max_bytes=(1 << 19) if rank == 5 else None
                        )
                    rows.append((bad, "no error"))
                except objcomm.ObjcommError as exc:
                    rows.append((bad, type(exc).__name__))
                assert comm.all_gather(rank) == list(range(W))  # the group is in step after the error
        finally:
            dist.gather, _cutoffs.TREE_GATHER_FROM = real_gather, real_from
        rows.append(("backend gathers", len(backend_gathers)))
        return rows


@pytest.mark.parametrize("k", [4, 2, 3])
def test_two_levels_leaders_gather_up_a_tree(k):
    """Hosts of four (two leaders), of two (four leaders) and of three (3 + 3 + 2: three leaders, hosts of unequal
    sizes; after hosts of two, ranks 6 and 7 make a host's group again, under another name: with one name the second
    group met the first one's rendezvous and the set-up failed): from
    TREE_GATHER_FROM leaders, the leaders' step of a gather goes up their tree with each slot trimmed
    (objcomm._transport.slot_tree), never the backend's gather; every object arrives, to a destination that leads its
    host and to one that does not; bad input raises the same error on every rank."""
    for rank, rows in enumerate(get_pool(W).run(leaders_up_a_tree, k, timeout=180)):
        *gathers, (limit, limit_error), (encode, encode_error), (_, backend) = rows
        assert all(right for _, _, right in gathers), (k, rank, gathers)
        assert (limit_error, encode_error) == ("TooLargeError", "RemoteError"), (k, rank, rows[-3:])
        assert backend == 0, (k, rank, backend)


def bad_input_on_two_levels(case: str) -> str:
    """:func:`bad_input` with the whole group's calls through two levels (hosts of three: 3 + 3 + 2)."""
    with ranks_per_host(3):
        comm, rank = objcomm.Communicator(), dist.get_rank()
        try:
            if case == "over a receiver's limit":
                comm.all_gather(b"x" * ((1 << 20) if rank == 6 else 10), max_bytes=(1 << 19) if rank == 4 else None)
            elif case == "a failing encode":
                comm.all_gather(object() if rank == 5 else b"x" * 100_000, serializer="json")
            elif case == "a receiver refuses a broadcast":
                comm.broadcast(
                    b"y" * (3 << 20) if rank == 1 else None, src=1, max_bytes=(1 << 20) if rank == 7 else None
                )
            elif case == "over a relaying leader's limit":  # rank 7's rest goes through its leader, 6, to rank 1
                comm.gather(b"x" * ((1 << 20) if rank == 7 else 10), dst=1, max_bytes=(1 << 19) if rank == 6 else None)
            elif case == "over the destination's leader's limit":  # rank 0 takes every host's rests for rank 1
                comm.gather(b"x" * ((1 << 20) if rank == 4 else 10), dst=1, max_bytes=(1 << 19) if rank == 0 else None)
            elif case == "a lying sender":
                if rank == 4:  # (its host's channel messages carry the honest call's word, as the object API's do)
                    call_words.enter("all_gather")
                    _rounds.all_gather(comm._call({}).wire, _forged_table(1 << 40), _frame.tensor_sizes)
                else:
                    comm.all_gather({"t": torch.ones(1000, dtype=torch.uint8)})
            return "no error"
        except objcomm.ObjcommError as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
        finally:
            assert comm.all_gather(rank) == list(range(W))  # the group is in step after the error


@pytest.mark.parametrize(
    "case, expected",
    [
        ("over a receiver's limit", "TooLargeError"),
        ("a failing encode", "RemoteError"),
        ("a receiver refuses a broadcast", "TooLargeError"),
        # a gather's leaders hold its rests on their way: their max_bytes counts as a receiver's (hosts 0-2, 3-5, 6-7)
        (
            "over a relaying leader's limit",
            "TooLargeError: gather: rank 7 sends 1,048,711 bytes, above the max_bytes=524,288 of rank 6,",
        ),
        (
            "over the destination's leader's limit",
            "TooLargeError: gather: rank 4 sends 1,048,711 bytes, above the max_bytes=524,288 of rank 0,",
        ),
        ("a lying sender", "FrameError"),
    ],
)
def test_bad_input_on_two_levels_gets_the_same_error_on_every_rank(case, expected):
    outcomes = get_pool(W).run(bad_input_on_two_levels, case, timeout=120)
    assert len(set(outcomes)) == 1, outcomes
    assert outcomes[0].startswith(expected), outcomes[0]


def votes_off_a_power_of_two() -> Any:
    """A broadcast that votes first (its rest is past the scratch size), through the group of a world that is no
    power of two: the vote's recursive doubling hands the extra ranks' words over and back; a receiver over its
    limit makes every rank raise."""
    comm, rank = _comm(), dist.get_rank()
    got = comm.broadcast(b"x" * (3 << 20) if rank == 1 else None, src=1)
    try:
        comm.broadcast(b"y" * (3 << 20) if rank == 1 else None, src=1, max_bytes=(1 << 20) if rank == 2 else None)
        refused = "no error"
    except objcomm.ObjcommError as exc:
        refused = type(exc).__name__
    return got == b"x" * (3 << 20), refused


def test_votes_on_a_world_that_is_no_power_of_two():
    assert get_pool(3).run(votes_off_a_power_of_two, timeout=60) == [(True, "TooLargeError")] * 3


def lying_in_a_vote() -> Any:
    """Rank 1 lies in the recursive doubling of a vote (objcomm._transport.base._largest_by_doubling): "refuse" to
    its first partner (rank 0), "accept" to the others (ranks 3 and 5), then takes part in the broadcast as any
    rank does. Every honest rank must act on one answer (before the broadcast, ranks 3, 5 and 7 read "accept" and
    the others "refuse": they would have parted ways)."""
    rank = dist.get_rank()
    wire = _comm()._call({}).wire
    if rank != 1:
        return _base.largest_of(wire, [0], "a vote")
    mine, theirs = torch.tensor([1]), torch.empty(1, dtype=torch.int64)
    for partner in (0, 3, 5):
        ops = [
            dist.P2POp(dist.isend, mine.clone(), partner, wire.group, 2 * _base.INTERNAL_TAG + 1),
            dist.P2POp(dist.irecv, theirs, partner, wire.group, 2 * _base.INTERNAL_TAG + 1),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        mine[0] = 0  # "accept" from now on
    dist.broadcast(mine, src=0)
    return None


def test_a_rank_that_lies_in_a_vote_cannot_split_the_honest_ones():
    got = get_pool(W).run(lying_in_a_vote, timeout=60)
    assert got[1] is None and [got[r] for r in range(W) if r != 1] == [[1]] * (W - 1), got


def a_hidden_refusal(op: str) -> Any:
    """A group of the 8 ranks with a 3 s timeout. Rank 3 (max_bytes 100,000) is sent 3 MB by rank 0 (a broadcast's
    or scatter's part, an all_to_all's), above its limit: it votes to refuse, but rank 2, which relays its words to
    rank 0 in the vote's recursive doubling, drops them (:func:`_hostile.a_vote_relay_that_hides`), and rank 0's
    broadcast of the answer says nobody refused. What each rank got: its part's length, or the error it raised."""
    sub = dist.new_group(list(range(W)), timeout=timedelta(seconds=3))
    rank, big = dist.get_rank(), b"x" * (3 << 20)
    limit = 100_000 if rank == 3 else None
    comm = objcomm.Communicator(sub, local=False, shm=False, max_bytes=limit, _hooks=Hooks(separate_hosts=True))
    parts = [big if r == 3 else b"small" for r in range(W)]
    calls = {
        "broadcast": lambda: comm.broadcast(big if rank == 0 else None, src=0),
        "scatter": lambda: comm.scatter(parts if rank == 0 else None, src=0),
        "all_to_all": lambda: comm.all_to_all(parts if rank == 0 else [b"small"] * W)[0],
    }
    with a_vote_relay_that_hides(0, rank == 2):
        got = result_or_error(lambda: len(calls[op]()), message=True)
    dist.destroy_process_group(sub)
    return got


@pytest.mark.parametrize("op", ["broadcast", "scatter", "all_to_all"])
def test_a_refusal_dropped_from_the_vote_is_raised_by_the_refuser(op):
    """A relay of the vote can drop an honest rank's refusal (an attacker's find: rank 3 then took 30 MB past its
    max_bytes of 100,000 in a scatter or all_to_all, and a broadcast's 3 MB frame aborted it inside gloo, where it
    drained 1 MiB pieces that the source, told nobody refused, sent whole). The refuser finds the answer below its
    own words and raises before anything moves to it; the others fail at their timeout where they wait for it, or
    return what reached them."""
    outcomes = get_pool(W).run(a_hidden_refusal, op, timeout=120)
    assert isinstance(outcomes[3], list) and outcomes[3][0] == "CommunicationError", outcomes  # (not 3 MB taken)
    assert "the group's vote came back below rank 3's own words" in outcomes[3][1], outcomes[3]
    for rank, got in enumerate(outcomes):  # nobody else took more than its limit; the rest fail or return
        assert got in (5, 3 << 20) or got[0] == "CommunicationError", (rank, outcomes)
