"""objcomm._transport.routes: every route cut-off, called with made-up numbers at any world size (no ranks)."""

from __future__ import annotations

import doctest
import random

import pytest

from objcomm._format.limits import SCRATCH_BYTES
from objcomm._transport import patterns, routes
from objcomm._transport.routes import BACKEND, CHANNEL, EXACT, PADDED, SHARED_MEMORY, STRIPES, Knobs, Topology, plan

MB = 1 << 20


def test_the_docstring_example_runs():
    assert doctest.testmod(routes).failed == 0
    assert doctest.testmod(routes.calls).failed == 0


@pytest.mark.parametrize("world", [1, 2, 63, 64, 1024, 1025, 8192, 100_000])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("slot", [128, 4096, 1 << 16])
def test_a_groups_call_route_is_its_cut_offs_at_any_world_size(world, device, slot):
    cpu = device == "cpu"
    route = routes.call_route(world=world, cpu=cpu, slot=slot)
    assert route.forced == routes.NOT_FORCED
    assert route.summed == routes.slots_summed(world=world, cpu=cpu)
    tree = routes.slots_up_tree(world=world)
    assert route.up_tree == (routes.SLOT_TREE_RADIX if tree else 0)
    assert route.word_down == (tree and routes.word_down_tree(cpu=cpu))
    assert route.limits_with_slot == routes.limits_with_slot(cpu=cpu, slot_medium=BACKEND)
    assert route.part_slot == routes.part_slot(world=world, slot=slot)
    for leaders in (0, 63, 64, 1024):
        assert route.result_down(leaders) == routes.result_down_tree(cpu=cpu, leaders=leaders)
    for moved in (0, 1, 77_000, MB, 45 * MB, 600 * MB):
        assert route.rest_down_tree(moved) == routes.rest_down_tree(world=world, moved=moved, cpu=cpu)
        for agreed in (False, True):
            got = route.rest_spread(moved, agreed=agreed)
            assert got == routes.rest_spread(world=world, part=moved, cpu=cpu, agreed=agreed)


def test_forced_routes_take_their_way_at_any_size_and_only_theirs():
    plain = routes.call_route(world=2, cpu=True, slot=4096)
    assert (plain.summed, plain.up_tree, plain.word_down, plain.limits_with_slot) == (False, 0, False, False)
    assert not plain.result_down() and not plain.rest_down_tree(MB) and not plain.rest_spread(MB, agreed=True)
    each = {
        "summed": lambda r: r.summed,
        "up_tree": lambda r: r.up_tree == routes.SLOT_TREE_RADIX and r.word_down,
        "down_tree": lambda r: r.result_down(),
        "rest_tree": lambda r: r.rest_down_tree(MB),
        "rest_spread": lambda r: r.rest_spread(MB, agreed=True) and not r.rest_spread(MB, agreed=False),
        "limits_with_slot": lambda r: r.limits_with_slot,
    }
    for name, took in each.items():
        route = routes.call_route(world=2, cpu=True, slot=4096, forced=routes.Forced(**{name: True}))
        assert took(route), name
        assert [other for other, t in each.items() if other != name and t(route)] == [], name
    radix = routes.call_route(world=2, cpu=True, slot=4096, forced=routes.Forced(up_tree=True, tree_radix=2))
    assert radix.up_tree == 2


@pytest.mark.parametrize(
    "lengths, shape",
    [
        ([MB] * 8, PADDED),  # equal
        ([MB, MB // 2] * 4, PADDED),  # within 2x
        ([100 * MB] + [0] * 8191, EXACT),  # one outlier among thousands
        ([0] * 8, PADDED),  # nothing moves: nothing is padded either
        ([2 * MB if r < 2 else 1000 for r in range(16)], EXACT),
    ],
)
def test_exchange_shape(lengths, shape):
    assert routes.exchange_shape(lengths) == shape


def test_rest_medium_cut_offs():
    threshold = 2 * MB
    kw = dict(cpu=True, shm=True, shm_threshold=threshold, one_host=True)
    assert routes.rest_medium(0, round_one_medium=CHANNEL, **kw) == BACKEND  # nothing moves
    assert routes.rest_medium(threshold - 1, round_one_medium=CHANNEL, **kw) == CHANNEL
    assert routes.rest_medium(threshold, round_one_medium=CHANNEL, **kw) == SHARED_MEMORY
    assert routes.rest_medium(threshold - 1, round_one_medium=BACKEND, **kw) == BACKEND  # the channel took no round 1
    assert routes.rest_medium(threshold, round_one_medium=BACKEND, **{**kw, "one_host": False}) == BACKEND
    assert routes.rest_medium(threshold, round_one_medium=BACKEND, **{**kw, "cpu": False}) == BACKEND
    assert routes.rest_medium(threshold, round_one_medium=BACKEND, **{**kw, "shm": False}) == BACKEND
    big = dict(kw, shm_threshold=1 << 30)  # the channel never takes more than CHANNEL_MOST, whatever shm_threshold
    assert routes.rest_medium(routes.CHANNEL_MOST, round_one_medium=CHANNEL, **big) == BACKEND
    assert routes.rest_medium(routes.CHANNEL_MOST - 1, round_one_medium=CHANNEL, **big) == CHANNEL


def test_the_rest_after_the_channel_is_rest_medium_by_one_ranks_settings_and_the_channel_where_nothing_moves():
    """What a rank moves the rest by after round 1 on the channel (SameHostRests.medium) and what it echoes
    (channel_checks.medium_of) are one function: ranks whose settings differ only where nothing moves agree."""
    for moved in (1, 60 << 10, MB, 2 * MB - 1, 2 * MB, routes.CHANNEL_MOST, 1 << 30):
        for shm in (True, False):
            for threshold in (0, 1, MB, 2 * MB, 1 << 30):
                kw = dict(cpu=True, shm=shm, shm_threshold=threshold)
                expected = routes.rest_medium(moved, round_one_medium=CHANNEL, one_host=True, **kw)
                assert routes.rest_after_channel(moved, **kw) == expected
    for shm, threshold in ((True, 0), (False, 0), (True, 2 * MB), (False, 1 << 30)):
        assert routes.rest_after_channel(0, cpu=True, shm=shm, shm_threshold=threshold) == CHANNEL
    assert routes.rest_after_channel(0, cpu=False, shm=True, shm_threshold=0) == BACKEND


def test_a_gathers_rests_go_by_the_largest_sender_and_the_channel_takes_at_most_channel_most_of_them():
    """The transport's rule for a gather (objcomm._samehost.rests.SameHostRests), the plan's alike: the medium by the
    largest sender's rest, the channel only while all of them together fit CHANNEL_MOST (its root's stash)."""
    kw = dict(cpu=True, round_one_medium=CHANNEL, shm=True, shm_threshold=2 * MB, one_host=True)
    assert routes.rest_medium(MB, gathered=routes.CHANNEL_MOST, **kw) == CHANNEL
    assert routes.rest_medium(MB, gathered=routes.CHANNEL_MOST + 1, **kw) == BACKEND  # below shm_threshold too
    assert routes.rest_medium(2 * MB, gathered=routes.CHANNEL_MOST + 1, **kw) == SHARED_MEMORY
    one_host = Topology(world=8, ranks_per_host=8, channel_open=True)
    assert plan("gather", one_host, rests=[MB] * 8).steps[-1].medium == CHANNEL  # 7 MB in all: was shared memory
    assert plan("gather", one_host, rests=[MB] * 8, knobs=Knobs(shm_threshold=MB)).steps[-1].medium == SHARED_MEMORY
    assert plan("gather", one_host, rests=[3 * MB] * 8).steps[-1].medium == SHARED_MEMORY


def test_agreement_needed():
    assert not routes.agreement_needed(sizes_listed=True, largest_piece=SCRATCH_BYTES, medium_may_take=False)
    assert routes.agreement_needed(sizes_listed=True, largest_piece=SCRATCH_BYTES + 1, medium_may_take=False)
    assert routes.agreement_needed(sizes_listed=False, largest_piece=0, medium_may_take=False)
    assert routes.agreement_needed(sizes_listed=True, largest_piece=0, medium_may_take=True)
    # on two levels a leader holds a broadcast's whole rest to relay it: past the scratch size its receivers vote
    assert routes.leaders_relay_first(op="broadcast", moved=SCRATCH_BYTES + 1)
    assert not routes.leaders_relay_first(op="broadcast", moved=SCRATCH_BYTES)
    assert not routes.leaders_relay_first(op="all_gather", moved=SCRATCH_BYTES + 1)  # every rank's limit in round 1


def test_a_sends_medium_rest_goes_with_its_slot_through_a_cpu_backend():
    whole = routes.BACKEND_WHOLE_BYTES
    assert routes.backend_whole(1, cpu=True, agreed=False)
    assert routes.backend_whole(whole, cpu=True, agreed=False)
    assert not routes.backend_whole(whole + 1, cpu=True, agreed=False)  # two messages: the slot, then the rest
    assert not routes.backend_whole(0, cpu=True, agreed=False)  # nothing follows the slot
    assert not routes.backend_whole(100, cpu=True, agreed=True)  # the receiver answers first
    assert not routes.backend_whole(100, cpu=False, agreed=False)  # NCCL: every send waits for its receiver


def test_a_vote_on_gloo_counts_its_exchanges_and_its_broadcast():
    # (a rank below the largest power of two that takes a partner's words first, log2 of it exchanges, a broadcast)
    assert [routes.vote_calls(w) for w in (1, 2, 3, 4, 5, 8, 9, 8192, 8193)] == [1, 1, 3, 3, 4, 4, 5, 14, 15]
    with_vote = plan("broadcast", Topology(world=8), [1 << 21] * 8, routes.Knobs(shm=False))
    assert [s.collective for s in with_vote.steps][:2] == ["broadcast", "vote"]
    assert with_vote.torch_calls == with_vote.backend_calls + routes.vote_calls(8) - 1


def test_round_one_and_express():
    assert routes.round_one(local=True, one_host=True, channel_open=True) == CHANNEL
    assert routes.round_one(local=True, one_host=False, channel_open=True) == BACKEND
    assert routes.round_one(local=False, one_host=True, channel_open=True) == BACKEND
    assert routes.express_possible(compression=False, channel_first=True)
    assert not routes.express_possible(compression=True, channel_first=True)
    assert not routes.express_possible(compression=False, channel_first=False)


def _spreads(world: int) -> dict:
    """The issue's spreads: each rank's rest (bytes past its slot; 0: its slot carries it)."""
    rng = random.Random(7)
    return {
        "all small": [0] * world,
        "all 1 MB": [MB] * world,
        "one outlier": [100 * MB] + [0] * (world - 1),
        "10% large": [16 * MB if r % 10 == 0 else 0 for r in range(world)],
        "log-normal": [int(min(32_000 * rng.lognormvariate(0, 2), 1 << 30)) for _ in range(world)],
        "uneven tensors": [int(MB * rng.uniform(0.9, 1.1)) for _ in range(world)],
    }


@pytest.mark.parametrize("world", [2, 8, 512, 8192])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_collectives_stay_bounded_at_any_world_size(world, device):
    topology = Topology(world=world, device=device)
    for case, rests in _spreads(world).items():
        for op in ("all_gather", "gather", "broadcast", "all_reduce", "reduce"):
            got = plan(op, topology, rests)
            # all_gather: round 1 and one exchange (NCCL: one more per 256 MiB of the widest rest; gloo: a broadcast
            # of a rest that dwarfs the others first); never one collective per rank
            most = {"all_gather": 3, "gather": 3, "broadcast": 3, "all_reduce": 4, "reduce": 4}[op]
            assert got.backend_calls <= most + (max(rests) >> 28), (op, case, world, got)
            assert all(len(step.nbytes) in (1, world) for step in got.steps)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_all_reduce_returns_down_its_tree_where_round_one_takes_the_backend(device):
    """On NCCL off the channel (across hosts, or local off), all_reduce's result goes back down the reduce tree: two
    backend steps of ceil(log2 W) hops each, whatever the value's size, no ring, no vote; through the channel (one
    host) it stays a broadcast; on gloo a broadcast too (binomial already)."""
    assert routes.result_down_tree(cpu=False) and routes.result_down_tree(cpu=True, forced=True)
    assert not routes.result_down_tree(cpu=True)  # gloo's own broadcast is a binomial tree already
    for rest in (0, 3 * MB, 600 * MB):
        flat = [
            Topology(world=8192, device=device),  # one rank a host
            Topology(world=8192, device=device, ranks_per_host=8, channel_open=False),
        ]
        if device == "cuda":
            flat.append(Topology(world=8192, device=device, ranks_per_host=8))  # NCCL takes no two levels
        for topology in flat:
            got = plan("all_reduce", topology, [rest] * topology.world)
            if device == "cpu":
                assert [s.collective for s in got.steps][:2] == ["tree", "broadcast"]
                continue
            held = 8 + 4096 + routes.BACKEND_WHOLE_BYTES + rest  # (a GPU group's tree message: padded to its room)
            assert [(s.collective, s.medium, s.nbytes) for s in got.steps] == [
                ("tree", BACKEND, (held,)),
                ("down_tree", BACKEND, (held,)),
            ], (topology, rest)
            assert got.backend_calls == 2
    one_host = plan("all_reduce", Topology(world=8, ranks_per_host=8, device=device), [0] * 8)
    assert [s.collective for s in one_host.steps] == ["tree", "broadcast"]
    if device == "cpu":
        two_level = plan("all_reduce", Topology(world=64, ranks_per_host=8), [0] * 64)
        assert two_level.round_one == BACKEND and "down_tree" not in [s.collective for s in two_level.steps]


def test_a_broadcasts_rest_goes_down_the_tree_on_nccl_from_64_ranks_while_it_beats_the_ring():
    """NCCL's broadcast is a ring (W - 1 hops); down the binomial tree the source sends the rest ceil(log2 W) = L
    times: the tree where (L - 1) x the rest costs less than W - 1 - L hops of HOP_BYTES. Not on gloo (binomial)."""
    assert not routes.rest_down_tree(world=8192, moved=MB, cpu=True)
    assert routes.rest_down_tree(world=8, moved=600 * MB, cpu=True, forced=True)
    assert not routes.rest_down_tree(world=63, moved=1, cpu=False)
    for world in (64, 512, 8192):
        hops = (world - 1).bit_length()
        most = (world - 1 - hops) * routes.HOP_BYTES // (hops - 1)  # 0.75 MB at 64 ranks, 44.7 MB at 8192
        assert routes.rest_down_tree(world=world, moved=most, cpu=False), world
        assert not routes.rest_down_tree(world=world, moved=most + 1, cpu=False), world
    nccl = Topology(world=8192, device="cuda")
    for rest, steps, calls in [
        (MB, ["all_reduce", "down_tree"], 3),  # the slot, then the rest (within the scratch size: no vote)
        # the slot with every receiver's limit (no vote: routes.limits_with_slot), the rest: rest_spread
        (40 * MB, ["all_reduce", "spread"], 16),
        (600 * MB, ["all_reduce", "broadcast", "broadcast", "broadcast"], 4),  # past both: the ring
    ]:
        got = plan("broadcast", nccl, [rest] * 8192)
        assert [s.collective for s in got.steps] == steps, rest
        assert got.torch_calls == calls, rest  # a relay down the tree: take, then pass on; spread: 2 + 13 steps
    assert "down_tree" not in [s.collective for s in plan("broadcast", Topology(world=8192), [MB] * 8192).steps]


def test_a_broadcasts_receivers_limits_come_with_its_slot_on_nccls_backend_only():
    """routes.limits_with_slot: NCCL's round 1 through the backend is an all_reduce of the slot, which carries every
    receiver's max_bytes, so no vote follows; gloo's (a broadcast) and the channel's do not, and their votes stay."""
    assert routes.limits_with_slot(cpu=False, slot_medium=BACKEND)
    assert not routes.limits_with_slot(cpu=True, slot_medium=BACKEND)
    assert not routes.limits_with_slot(cpu=False, slot_medium=CHANNEL)
    rest = 2 * MB  # past the scratch size: the receivers answer first
    for topology, steps in [
        (Topology(world=16, device="cuda"), ["all_reduce", "broadcast"]),
        (Topology(world=16), ["broadcast", "vote", "broadcast"]),
        (Topology(world=8, ranks_per_host=8, device="cuda"), ["broadcast", "all_reduce", "broadcast"]),  # channel
    ]:
        assert [s.collective for s in plan("broadcast", topology, [rest] * topology.world).steps] == steps, topology
    # what NCCL's round 1 moves: the slot as int64 words (broadcast._slot_and_limits), then the receivers' limit
    for slot, moved in [(4096, 4104), (1001, 1016)]:
        first = plan("broadcast", Topology(world=16, device="cuda"), [rest] * 16, Knobs(slot_bytes=slot)).steps[0]
        assert first.nbytes == (moved,), (slot, first)


def test_a_broadcasts_rest_spreads_on_nccl_from_64_ranks_where_it_costs_the_least():
    """Each part of a broadcast's rest, after the receivers voted, as a scatter then an all_gather (2L hops, each
    rank moving the part about twice) where that beats both the ring ((W - 1) hops, the part once) and the binomial
    tree (L hops, the source sending it L times), in hops of HOP_BYTES; never without a vote (every rank relays
    blocks: none may drain), never on gloo unless forced, never below 64 ranks."""
    hop = routes.HOP_BYTES
    for world in (64, 512, 8192):
        levels = (world - 1).bit_length()
        low = levels * hop // (levels - 2)  # from here it beats the tree
        high = (world - 1 - 2 * levels) * hop  # and up to here the ring
        assert not routes.rest_spread(world=world, part=low, cpu=False, agreed=True), world
        assert routes.rest_spread(world=world, part=low + 1, cpu=False, agreed=True), world
        assert routes.rest_spread(world=world, part=high - 1, cpu=False, agreed=True), world
        assert not routes.rest_spread(world=world, part=high, cpu=False, agreed=True), world
        assert not routes.rest_spread(world=world, part=low + 1, cpu=False, agreed=False), world
        assert not routes.rest_spread(world=world, part=low + 1, cpu=True, agreed=True), world
    assert not routes.rest_spread(world=63, part=MB, cpu=False, agreed=True)
    assert routes.rest_spread(world=2, part=1, cpu=True, agreed=True, forced=True)
    assert not routes.rest_spread(world=8, part=MB, cpu=True, agreed=False, forced=True)  # a receiver may drain
    assert not routes.rest_spread(world=8192, part=0, cpu=False, agreed=True, forced=True)


def test_two_levels_leaders_spread_a_broadcasts_rest_from_five_of_them_after_the_vote():
    """On gloo's two levels the leaders spread a voted rest (a scatter, then an all_gather among them) where it beats
    gloo's binomial broadcast among them (the source's leader sending it L times): never below 5 leaders (L <= 2),
    past L x HOP_BYTES / (L - 2) from 5 on, never without the vote; the plan says so as ``spread`` across hosts."""
    hop = routes.HOP_BYTES
    assert not routes.leaders_spread(leaders=4, moved=1 << 40, agreed=True)
    for leaders in (5, 8, 1024):
        levels = (leaders - 1).bit_length()
        low = levels * hop // (levels - 2)
        assert not routes.leaders_spread(leaders=leaders, moved=low, agreed=True), leaders
        assert routes.leaders_spread(leaders=leaders, moved=low + 1, agreed=True), leaders
        assert not routes.leaders_spread(leaders=leaders, moved=1 << 40, agreed=False), leaders
    gloo = Topology(world=8192, ranks_per_host=8)
    got = plan("broadcast", gloo, [100 * MB] + [0] * 8191)
    spread = [s for s in got.steps if s.collective == "spread"]
    assert len(spread) == 1 and spread[0].across and spread[0].ranks == 1024 and spread[0].calls == 12, got.steps
    small = plan("broadcast", gloo, [MB] + [0] * 8191)  # within the scratch size: no vote, gloo's broadcast
    assert "spread" not in [s.collective for s in small.steps] and "vote" not in [s.collective for s in small.steps]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_gathers_slots_go_up_a_tree_from_64_ranks(device):
    """Through the backend a gather's slots go up a binomial tree from TREE_GATHER_FROM ranks (the backend's gather,
    every rank to the destination, below it), each trimmed to what it carries plus its 4-byte length (whole slots
    where the plan is not told); through the channel (one host) they stay its all_gather; on two levels the leaders
    take their tree from as many leaders."""
    assert routes.TREE_GATHER_FROM == 64
    assert not routes.slots_up_tree(world=63) and routes.slots_up_tree(world=64)
    assert routes.slots_up_tree(world=2, forced=True)  # objcomm's tests: at any size
    for world, first in ((16, "gather"), (63, "gather"), (64, "gather_tree"), (8192, "gather_tree")):
        got = plan("gather", Topology(world=world, device=device, channel_open=False), [0] * world)
        assert [(s.collective, s.medium) for s in got.steps][0] == (first, BACKEND), (world, got.steps[0])
        assert got.steps[0].nbytes == (4096 if first == "gather" else 4 + 4096,) * world
        trimmed = plan(
            "gather", Topology(world=world, device=device, channel_open=False), [0] * world, carried=[100] * world
        )
        assert trimmed.steps[0].nbytes == (4096 if first == "gather" else 4 + 100,) * world
    one_host = plan("gather", Topology(world=8, ranks_per_host=8, device=device), [0] * 8)
    assert one_host.steps[0].collective == "all_gather" and one_host.steps[0].medium == CHANNEL
    if device == "cpu":  # two levels: the leaders' step up their tree from TREE_GATHER_FROM leaders, a host's slots
        for hosts, step in ((63, "gather"), (64, "gather_tree")):  # trimmed (with a 4-byte length each)
            two_level = plan(
                "gather", Topology(world=8 * hosts, ranks_per_host=8), [0] * 8 * hosts, carried=[50] * 8 * hosts
            )
            leaders = [s for s in two_level.steps if s.across][0]
            assert leaders.collective == step and leaders.medium == BACKEND, (hosts, leaders)
            assert leaders.nbytes == ((8 * 4096,) if step == "gather" else (8 * (4 + 50),)) * hosts
            assert leaders.radix == (routes.SLOT_TREE_RADIX if step == "gather_tree" else 2)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_gathers_tree_has_radix_4_and_its_word_comes_down_it_on_nccl(device):
    """The slots' tree and, on NCCL, the word's way down take SLOT_TREE_RADIX (patterns.knomial: 7 levels at 8192
    ranks, not 13); the word's relays take it and pass it on, two calls (from radix + 2 ranks: rank 4 over rank 5)."""
    assert routes.SLOT_TREE_RADIX == 4
    assert not patterns.knomial(4, 5, 4).children and patterns.knomial(4, 6, 4).children == (5,)
    for world in (64, 8192):
        got = plan("gather", Topology(world=world, device=device, channel_open=False), [0] * world)
        steps = {s.collective: s for s in got.steps}
        assert steps["gather_tree"].radix == routes.SLOT_TREE_RADIX
        if device == "cuda":
            assert steps["down_tree"].radix == routes.SLOT_TREE_RADIX and steps["down_tree"].calls == 2
        else:  # gloo: its own broadcast (a binomial tree in C++)
            assert "down_tree" not in steps and steps["broadcast"].nbytes == (8,)


@pytest.mark.parametrize(
    "lengths, shape",
    [
        ([0] * 8191 + [100 * MB], STRIPES),  # one outlier: its owner sends it once, not to each of 8191 peers
        ([1000] * 15 + [20 * MB], STRIPES),
        ([0] * 14 + [2 * MB] * 2, STRIPES),  # 6 MB through the busiest rank, against 30 MB in a batch
        ([0] * 7 + [16 << 10], EXACT),  # 82 KB saved, less than an all_gather's 7 hops of HOP_BYTES: the batch
        ([0, 100 * MB], PADDED),  # two ranks: never stripes (here W x widest <= 2T: padded)
        ([0, MB, 100 * MB], STRIPES),  # three: 101 + 67 MB through the busiest, against 200 MB
        ([MB] * 8, PADDED),  # equal: stripes would add a collective and move more
        ([MB, int(1.1 * MB)] * 4, PADDED),  # within 10%: a few hundred KB saved at most
        ([MB, int(1.1 * MB)] * 512, PADDED),  # within 10% on 1024 ranks: 50 MB saved, 64 MB of hops
        ([MB, int(1.5 * MB)] * 512, STRIPES),  # within 50%: 254 MB saved through every rank
        ([0] * 8, PADDED),
    ],
)
def test_gloo_takes_stripes_where_they_save_more_than_their_all_gathers_hops(lengths, shape):
    """On gloo, an exchange goes by stripes (each rest to the ranks whose stripe holds it, then an all_gather of
    the stripes) where that saves the busiest rank more bytes than W - 1 hops of HOP_BYTES; NCCL never does."""
    assert routes.exchange_shape(lengths, cpu=True) == shape
    assert routes.exchange_shape(lengths) != STRIPES
    steps = plan("all_gather", Topology(world=len(lengths)), lengths).steps
    if shape == STRIPES:
        width = routes.stripe_width(lengths)
        assert [(s.collective, s.nbytes) for s in steps[1:]] == [
            ("stripes", tuple(lengths)),
            ("all_gather", (width,) * len(lengths)),
        ]
        assert width == -(-sum(lengths) // len(lengths))


def test_an_all_gather_at_exact_sizes_moves_no_padding():
    rests = [0] * 8190 + [100 * MB] * 2
    for device, collective in (("cuda", "all_gatherv"), ("cpu", "stripes")):
        step = [
            s for s in plan("all_gather", Topology(world=8192, device=device), rests).steps if s.nbytes == tuple(rests)
        ]
        assert [s.collective for s in step] == [collective]


def test_one_host_takes_the_same_host_media():
    one_host = Topology(world=8, ranks_per_host=8)
    assert [s.medium for s in plan("all_gather", one_host, [MB] * 8).steps] == [CHANNEL, CHANNEL]
    assert [s.medium for s in plan("all_gather", one_host, [4 * MB] * 8).steps] == [CHANNEL, SHARED_MEMORY]
    off = Knobs(local=False, shm=False)
    assert {s.medium for s in plan("all_gather", one_host, [4 * MB] * 8, off).steps} == {BACKEND}


def test_nccl_exchange_goes_in_rounds_of_chunk_bytes():
    rests = [600 * MB] + [0] * 63
    steps = plan("all_gather", Topology(world=64, device="cuda"), rests).steps
    assert [s.collective for s in steps] == ["sum"] + ["all_gatherv"] * 3  # the slots; 256 + 256 + 88 MiB
    assert sum(s.nbytes[0] for s in steps[1:]) == 600 * MB


def test_nccl_sums_an_all_gathers_slots_from_64_ranks():
    """On NCCL from SUMMED_SLOTS_FROM ranks an all_gather's slots go in one all_reduce of the table (a tree: 2
    ceil(log2 W) hops where the all_gather's ring takes W - 1); below it, and on gloo, the all_gather; through the
    channel (one host) the channel's."""
    assert routes.SUMMED_SLOTS_FROM == 64
    assert not routes.slots_summed(world=63, cpu=False) and routes.slots_summed(world=64, cpu=False)
    assert not routes.slots_summed(world=8192, cpu=True) and routes.slots_summed(world=2, cpu=True, forced=True)
    for world, device, first in (
        (63, "cuda", "all_gather"),
        (64, "cuda", "sum"),
        (8192, "cuda", "sum"),
        (8192, "cpu", "all_gather"),
    ):
        step = plan("all_gather", Topology(world=world, device=device), [0] * world).steps[0]
        assert (step.collective, step.medium) == (first, BACKEND), (world, device, step)
        assert step.nbytes == ((world * 4096,) if first == "sum" else (4096,) * world)
    one_host = plan("all_gather", Topology(world=8, ranks_per_host=8, device="cuda"), [0] * 8).steps[0]
    assert (one_host.collective, one_host.medium) == ("all_gather", CHANNEL)


def test_plan_refuses_an_op_it_does_not_cover():
    with pytest.raises(ValueError, match="plans cover"):
        plan("scatter", Topology(world=2), [0, 0])


def test_two_levels_cut_off():
    assert routes.two_levels(hosts=2, widest=2, cpu=True, local=True)
    assert not routes.two_levels(hosts=1, widest=8, cpu=True, local=True)  # one host: the group's own channel
    assert not routes.two_levels(hosts=8, widest=1, cpu=True, local=True)  # one rank per host: nothing to share
    assert not routes.two_levels(hosts=8, widest=8, cpu=False, local=True)  # NCCL builds its own hierarchy
    assert not routes.two_levels(hosts=8, widest=8, cpu=True, local=False)


@pytest.mark.parametrize("world", [16, 512, 8192])
def test_two_levels_leave_the_backend_to_one_rank_per_host(world):
    """gloo, hosts of 8: every backend step runs over the leaders (one rank per host, across hosts); the hosts' own
    steps over 8 ranks through the channel; bounded calls whatever the spread."""
    topology = Topology(world=world, ranks_per_host=8)
    for case, rests in _spreads(world).items():
        for op, most in (("all_gather", 3), ("gather", 3), ("broadcast", 4), ("all_reduce", 5)):
            got = plan(op, topology, rests)
            backend = [s for s in got.steps if s.medium == BACKEND]  # (a reduction's tree: the leaders')
            assert backend and all(s.across and s.ranks == world // 8 for s in backend), (op, case, got)
            assert all(s.ranks == 8 for s in got.steps if s.medium == CHANNEL), (op, case, got)
            assert got.backend_calls <= most + (max(rests) >> 28), (op, case, world, got.backend_calls)


def test_a_reductions_tree_takes_two_levels_where_every_host_holds_consecutive_ranks():
    """routes.tree_on_two_levels: consecutive ranks on every host (torchrun's numbering), of any sizes; not where a
    host's ranks interleave with another's (combining a host's ranks first would change the order of ranks)."""
    assert routes.tree_on_two_levels([(0, 1, 2), (3, 4, 5), (6, 7)])
    assert routes.tree_on_two_levels([(r,) for r in range(8)] + [tuple(range(8, 8192))])
    assert not routes.tree_on_two_levels([(0, 2), (1, 3)])
    assert not routes.tree_on_two_levels([(0, 1, 3), (2, 4, 5)])


def test_a_trees_messages_wait_for_no_answer_where_the_slot_lists_the_sizes():
    """A reduction tree's message sends a rest up to TREE_PIECED_UP_TO in pieces of at most SCRATCH_BYTES
    (routes.tree_piece), so that where its slot lists the sizes the receiver does not answer first: an edge is one
    message where the slot carries all (or the backend takes the rest with it), else the slot then the rest; an
    answer between them only where the sizes are in the frame alone, or past TREE_PIECED_UP_TO. The plan's tree steps
    carry that count, which the model charges a latency each."""
    chunk, most = Knobs().chunk_bytes, routes.TREE_PIECED_UP_TO
    assert routes.tree_piece(chunk, 3 << 20) == SCRATCH_BYTES and routes.tree_piece(1 << 16, 3 << 20) == 1 << 16
    assert routes.tree_piece(chunk, most) == SCRATCH_BYTES and routes.tree_piece(chunk, most + 1) == chunk
    assert routes.tree_messages(0, cpu=False, listed=True, chunk=chunk) == 1
    assert routes.tree_messages(routes.BACKEND_WHOLE_BYTES, cpu=True, listed=True, chunk=chunk) == 1
    # a GPU group's tree: a frame's rest up to BACKEND_WHOLE_BYTES in its slot's padded message; tensors on their own
    assert routes.tree_messages(37 << 10, cpu=False, listed=True, chunk=chunk) == 1
    assert routes.tree_messages(37 << 10, cpu=False, listed=True, chunk=chunk, tensors=True) == 2
    # on one host a GPU group's tree takes the channel's route: the slot, the receiver's answer, the rest (NCCL)
    assert routes.tree_messages(37 << 10, cpu=False, listed=True, chunk=chunk, backend=False) == 3
    assert routes.tree_messages(37 << 10, cpu=True, listed=True, chunk=chunk, backend=False) == 1
    for rest in (
        routes.BACKEND_WHOLE_BYTES + 1,
        SCRATCH_BYTES + 1,
        most,
    ):  # past the scratch size too: its pieces are not
        assert routes.tree_messages(rest, cpu=False, listed=True, chunk=chunk) == 2, rest
    assert routes.tree_messages(3 << 20, cpu=False, listed=False, chunk=chunk) == 3
    # past TREE_PIECED_UP_TO, the settings' pieces and the answer: a round trip, not hundreds of calls a message
    assert routes.tree_messages(100 << 20, cpu=False, listed=True, chunk=chunk) == 3
    assert routes.tree_calls(8192, 3 << 20, cpu=False, listed=True, chunk=chunk) == 13 * 2
    got = plan("all_reduce", Topology(world=8192, device="cuda"), [3 << 20] + [0] * 8191)
    assert [(s.collective, s.calls, s.messages) for s in got.steps] == [("tree", 26, 2), ("down_tree", 26, 2)]


@pytest.mark.parametrize("op", ["all_reduce", "reduce"])
def test_a_reductions_tree_on_two_levels_climbs_each_host_then_the_leaders(op):
    """gloo, hosts of 8: the tree's first ceil(log2 8) levels inside each host (the channel), then ceil(log2 1024)
    among the leaders through the backend, whose calls are the leaders' tree's (all_reduce's result back down the
    leaders' tree, then each host's, from routes.TREE_DOWN_FROM leaders); NCCL and one rank a host: one tree over
    every rank."""
    for rest in (0, 3 * MB):
        got = plan(op, Topology(world=8192, ranks_per_host=8), [rest] * 8192)
        host, leaders = got.steps[:2]
        assert (host.collective, host.medium, host.ranks, host.nbytes) == ("tree", CHANNEL, 8, (4096 + rest,))
        assert (leaders.collective, leaders.medium, leaders.ranks, leaders.across) == ("tree", BACKEND, 1024, True)
        assert leaders.calls == routes.tree_calls(1024, rest, cpu=True, listed=True, chunk=Knobs().chunk_bytes)
        assert "tree" not in [s.collective for s in got.steps[2:]]
        if op == "all_reduce":  # from TREE_DOWN_FROM leaders the result goes down the same two trees
            down = [(s.collective, s.medium, s.ranks, s.across, s.calls) for s in got.steps[2:]]
            assert down == [("down_tree", BACKEND, 1024, True, leaders.calls), ("down_tree", CHANNEL, 8, False, 1)]
            below = plan(op, Topology(world=8 * (routes.TREE_DOWN_FROM - 1), ranks_per_host=8), [rest] * 504)
            assert "down_tree" not in [s.collective for s in below.steps]  # gloo's broadcast, two levels
        for flat in (Topology(world=8192, ranks_per_host=8, device="cuda"), Topology(world=8192)):
            first = plan(op, flat, [rest] * 8192).steps[0]
            assert (first.collective, first.medium, first.ranks) == ("tree", BACKEND, 0), flat


def test_two_levels_only_where_they_apply():
    rests = _spreads(64)["all 1 MB"]
    for topology, knobs in (
        (Topology(world=64, ranks_per_host=8, device="cuda"), Knobs()),
        (Topology(world=64, ranks_per_host=1), Knobs()),
        (Topology(world=64, ranks_per_host=8), Knobs(local=False)),
        (Topology(world=64, ranks_per_host=8, channel_open=False), Knobs()),
    ):
        steps = plan("all_gather", topology, rests, knobs).steps
        assert not any(s.ranks or s.across for s in steps), (topology, knobs)


def test_a_hosts_all_gather_result_is_written_in_place_where_the_leaders_pad_or_go_by_stripes():
    assert routes.in_place_table([16 << 20, 16 << 20], cpu=True)  # equal bundles: one padded all_gather
    assert routes.in_place_table([16 << 20, 12 << 20, 8 << 20], cpu=True)  # within 2x
    skewed = [64 << 20] + [1 << 10] * 63
    assert routes.exchange_shape(skewed, cpu=True) == STRIPES and routes.in_place_table(skewed, cpu=True)
    assert routes.exchange_shape(skewed) == EXACT and not routes.in_place_table(skewed, cpu=False)  # a copy
    assert not routes.in_place_table([4 << 20, 4 << 20], cpu=True)  # below IN_PLACE_FROM: malloc's buffer is cheaper
    assert not routes.in_place_table([20 << 20] + [1 << 10] * 3, cpu=True)  # stripes of 5 MiB: 20 MiB in all
    assert routes.in_place_table([routes.IN_PLACE_FROM // 2] * 2, cpu=True)
    assert not routes.in_place_table([0, 0], cpu=True)  # nothing to hand over
    topology = Topology(world=64, ranks_per_host=8)
    equal, skewed = [1 << 20] * 64, [64 << 20] + [1 << 10] * 63
    handed = {}
    for name, rests, knobs in (
        ("equal", equal, Knobs()),
        ("skewed", skewed, Knobs()),
        ("below the threshold", equal, Knobs(shm_threshold=1 << 40)),  # through the channel: every byte sent
    ):
        last = plan("all_gather", topology, rests, knobs).steps[-1]
        assert last.collective == "broadcast" and last.ranks == 8, (name, last)
        handed[name] = (last.medium, last.nbytes)
    assert handed["equal"] == (SHARED_MEMORY, (0,))  # the leaders' exchange wrote the file: nothing copied
    assert handed["skewed"] == (SHARED_MEMORY, (0,))  # the leaders' stripes wrote the stream into it
    assert handed["below the threshold"] == (CHANNEL, (sum(equal),))


def test_scatter_and_all_to_all_shrink_their_parts_slots_past_a_4_mib_table():
    """The settings' slot up to PARTS_TABLE of slots a rank (1024 ranks at 4 KiB), a smaller one past it, never below
    PART_SLOT_LEAST, nor above the settings' (a smaller setting stays as it is)."""
    assert routes.part_slot(world=2, slot=4096) == 4096
    assert routes.part_slot(world=1024, slot=4096) == 4096
    assert routes.part_slot(world=2048, slot=4096) == 2048
    assert routes.part_slot(world=8192, slot=4096) == 512 == routes.PART_SLOT_LEAST
    assert routes.part_slot(world=8192, slot=4096) * 8192 == routes.PARTS_TABLE
    assert routes.part_slot(world=1 << 20, slot=4096) == 512
    assert routes.part_slot(world=8192, slot=128) == 128
    assert routes.part_slot(world=8192, slot=1 << 16) == 512


def test_an_all_gathers_slots_suggest_a_wider_slot_for_frames_past_it_of_sizes_alike():
    """routes.slot_after: the widest frame and an eighth (at most 16 KiB), in 64 bytes, where every frame is alike (a
    padded all_gather of them moves at most twice their bytes), none sent tensors, one was past the settings' slot,
    and the table stays within LEARNED_TABLE_MOST and the slot within the smallest piece; else the settings' slot."""
    after = routes.slot_after
    assert doctest.testmod(routes.cutoffs).failed == 0
    assert after([50_000] * 16, tensors=False, base=4096, piece=1 << 28) == 56_320  # 24 + 50,000 + 6,250, in 64s
    assert after([100] * 16, tensors=False, base=4096, piece=1 << 28) == 4096  # every frame fits the slot
    assert after([4072] * 16, tensors=False, base=4096, piece=1 << 28) == 4096  # just fits
    assert after([4073] * 16, tensors=False, base=4096, piece=1 << 28) == 4608  # just past: 24 + 4,073 + 509, in 64s
    assert after([50_000] * 16, tensors=True, base=4096, piece=1 << 28) == 4096  # tensors take a second round
    assert after([50_000] * 15 + [200_000], tensors=False, base=4096, piece=1 << 28) == 4096  # not alike
    assert after([50_000] * 16, tensors=False, base=4096, piece=32 << 10) == 4096  # past a sender's piece
    widest = routes.LEARNED_TABLE_MOST // 32 - 24 - routes.HOP_BYTES // 4 - 64  # a slot of just under 1/32 of it
    assert after([widest] * 32, tensors=False, base=4096, piece=1 << 28) * 32 <= routes.LEARNED_TABLE_MOST
    assert after([widest] * 33, tensors=False, base=4096, piece=1 << 28) == 4096  # 33 such slots: past the table
    assert after([4073] * 8192, tensors=False, base=4096, piece=1 << 28) == 4096  # at 8192 ranks: never wider
    assert after([1 << 20] * 16, tensors=False, base=4096, piece=1 << 28) == 24 + (1 << 20) + (16 << 10) + 40  # in 64s
    # a broadcast's one frame, its slot at most LEARNED_BROADCAST_MOST (1 MiB)
    most = routes.LEARNED_BROADCAST_MOST
    assert after([600_000], tensors=False, base=4096, piece=1 << 28, most=most) == 616_448  # 24 + 600,000 + 16 KiB
    assert after([1_100_000], tensors=False, base=4096, piece=1 << 28, most=most) == 4096


def test_an_all_gathers_slot_memory_takes_the_smaller_of_the_last_two_suggestions():
    """Two calls alike before a wider slot is taken; calls of two sizes in turn keep the settings' slot; a call with
    an error report or tensors, or frames past the wider slot it took, suggests the settings' slot; forget() (a call
    every rank refused) goes back to it."""
    from objcomm._format.slot import SlotInfo
    from objcomm._transport.rounds import SlotMemory

    assert doctest.testmod(__import__("objcomm._transport.rounds", fromlist=["_"])).failed == 0

    def infos(length: int, total: int = 0, error: bool = False) -> list:
        return [SlotInfo(length, error, False, 1 << 30, total or length, None)] * 4

    memory = SlotMemory(4096)
    memory.learn(infos(50_000), 4096)
    assert memory.slot == 4096  # one call: not yet
    memory.learn(infos(50_000), 4096)
    assert memory.slot == routes.slot_after([50_000] * 4, tensors=False, base=4096, piece=1 << 28) > 50_000
    memory.learn(infos(100), 4096)
    assert memory.slot == 4096  # smaller objects: back at once
    for length in (50_000, 100, 50_000, 100):  # two sizes in turn
        memory.learn(infos(length), 4096)
        assert memory.slot == 4096
    memory.learn(infos(50_000), 4096)
    memory.learn(infos(50_000, total=60_000), 4096)  # with tensors
    assert memory.slot == 4096
    memory.learn(infos(50_000), 4096)
    memory.learn(infos(300, error=True), 4096)  # a failed call
    assert memory.slot == 4096
    for _ in range(2):
        memory.learn(infos(50_000), 4096)
    wide = memory.slot
    memory.learn(infos(70_000), wide)  # frames past the wider slot (growing objects): the settings' slot next
    assert wide > 4096 and memory.slot == 4096
    for _ in range(2):
        memory.learn(infos(50_000), 4096)
    memory.forget()  # a call every rank refused
    assert memory.slot == 4096
    small = [SlotInfo(100, False, False, 1 << 30, 100, memoryview(bytes(100)))] * 4
    for ended in (False, True):  # round 1 ended the call in the settings' slot: the same, without reading the slots
        twin = SlotMemory(4096)
        for _ in range(2):
            twin.learn(infos(50_000), 4096)
        twin.learn(small, 4096, ended)
        assert twin.last == (routes.slot_after([50_000] * 4, tensors=False, base=4096, piece=1 << 28), 4096), ended
    many = [SlotInfo(5000, False, False, 1 << 30, 5000, None)] * 8192  # no wider slot's table fits: nothing read
    memory.learn(many, 4096)
    memory.learn(many, 4096)
    assert memory.slot == 4096 and routes.slot_after([5000] * 8192, tensors=False, base=4096, piece=1 << 28) == 4096


def test_an_all_gathers_frames_all_past_the_slot_suggest_a_narrower_one_where_no_wider_is_taken():
    """routes.slot_after with ``narrow`` (an all_gather's NARROW_SLOT): where every frame passed the settings' slot,
    none sent tensors and no wider slot is taken (its table past LEARNED_TABLE_MOST, sizes not alike, past a piece),
    the narrow slot where it pays (its W slots save NARROW_SAVES_LEAST: from 342 ranks at 4 KiB); else what slot_after
    says without it."""
    after, narrow = routes.slot_after, routes.NARROW_SLOT
    assert 128 <= narrow < 4096  # (an error report must fit: settings.MIN_SLOT_BYTES)
    assert after([8_000] * 8192, tensors=False, base=4096, piece=1 << 28, narrow=narrow) == narrow  # 72 MB wider
    assert after([8_000] * 8192, tensors=False, base=4096, piece=1 << 28) == 4096  # without narrow: as before
    for world, slot in ((16, 4096), (341, 4096), (342, narrow), (400, narrow)):  # where W x 3 KiB saves 1 MiB
        assert routes.narrow_pays(world=world, base=4096, narrow=narrow) == (slot == narrow), world
        unlike = [5_000] * (world - 1) + [200_000]
        assert after(unlike, tensors=False, base=4096, piece=1 << 28, narrow=narrow) == slot, world
        pieces = [20_000] * world  # a wider slot past the 16 KiB piece a sender announced
        assert after(pieces, tensors=False, base=4096, piece=16 << 10, narrow=narrow) == slot, world
    wide = after([50_000] * 400, tensors=False, base=4096, piece=1 << 28)
    assert wide > 50_000 and after([50_000] * 400, tensors=False, base=4096, piece=1 << 28, narrow=narrow) == wide
    assert after([4_072] + [5_000] * 8191, tensors=False, base=4096, piece=1 << 28, narrow=narrow) == 4096  # one fit
    assert after([4_073] + [5_000] * 8191, tensors=False, base=4096, piece=1 << 28, narrow=narrow) == narrow  # none
    assert after([8_000] * 8192, tensors=True, base=4096, piece=1 << 28, narrow=narrow) == 4096  # a second round
    assert after([100] * 8192, tensors=False, base=4096, piece=1 << 28, narrow=narrow) == 4096  # every frame fits
    for base in (narrow, 512):  # the settings' slot no wider than the narrow one: theirs
        assert after([8_000] * 8192, tensors=False, base=base, piece=1 << 28, narrow=narrow) == base


def test_a_ranks_own_error_report_is_cut_again_to_a_narrower_slot():
    """rounds._fitted: this rank's error report, cut for the settings' slot (or, past 1 MiB, to MAX_ERROR_REPORT),
    cut again to the narrow slot its all_gather takes, without raising; one that fits is sent as it is."""
    from objcomm._format import frame as _frame
    from objcomm._transport import rounds

    wire = rounds.Wire(None, range(3), 0, None, routes.NARROW_SLOT, 1 << 28, 1 << 30)  # type: ignore[arg-type]
    for made_for in (4096 - 24, 2 << 20):
        report = _frame.error_frame(RuntimeError("E" * 3_000_000), made_for)
        fitted = rounds._fitted(report, wire)
        view = memoryview(fitted.frame)
        kind, message = _frame.read_error(view, _frame.parse_header(view))
        assert fitted.error and fitted.frame_nbytes <= wire.inline_capacity and kind == "RuntimeError", made_for
        assert message.startswith("E" * 800), made_for
    small = _frame.error_frame(RuntimeError("short"), 4072)
    assert rounds._fitted(small, wire) is small


def test_an_all_gathers_slot_memory_narrows_after_two_calls_whose_frames_all_passed_the_slot():
    """SlotMemory with a narrow slot: two calls whose frames all passed the settings' slot where no wider one is taken
    (here 8192 ranks: the memory reads their slots, which it skips without one) before the narrow slot; one call, or
    calls of two sizes in turn, or a narrow and a wider suggestion, keep the settings' slot; a call whose frames fit,
    an error report, or forget() go back to it. applied(wider=False) (a summed table) takes the narrow slot only."""
    from objcomm._format.slot import SlotInfo
    from objcomm._transport.base import Wire
    from objcomm._transport.rounds import SlotMemory

    def infos(length: int, world: int = 8192, error: bool = False) -> list:
        return [SlotInfo(length, error, False, 1 << 30, length, None)] * world

    memory, narrow = SlotMemory(4096, narrow=routes.NARROW_SLOT), routes.NARROW_SLOT
    memory.learn(infos(8_000), 4096)
    assert memory.slot == 4096  # one call: not yet
    memory.learn(infos(8_000), 4096)
    assert memory.slot == narrow
    memory.learn(infos(8_000), narrow)  # in the narrow slot, frames past it: it stays
    assert memory.slot == narrow
    memory.learn(infos(100), narrow)  # frames that fit the settings' slot: back at once
    assert memory.slot == 4096
    for length in (8_000, 100, 8_000, 100):  # two sizes in turn
        memory.learn(infos(length), 4096)
        assert memory.slot == 4096
    memory.learn(infos(8_000), 4096)
    memory.learn(infos(300, error=True), 4096)  # a failed call
    assert memory.slot == 4096
    memory.learn(infos(8_000), 4096)
    memory.learn(infos(50_000, world=16), 4096)  # a wider suggestion after a narrower one: neither
    assert memory.last[1] > 4096 and memory.slot == 4096
    for _ in range(2):
        memory.learn(infos(8_000), 4096)
    wire = Wire(None, range(8192), 0, None, 4096, 1 << 28, 1 << 30)  # type: ignore[arg-type]
    assert memory.applied(wire)[0].slot == narrow and memory.applied(wire, wider=False)[0].slot == narrow
    memory.forget()  # a call every rank refused
    assert memory.slot == 4096
    for _ in range(2):
        memory.learn(infos(50_000, world=16), 4096)
    assert memory.slot > 4096 and memory.applied(wire, wider=False)[0].slot == 4096
    assert memory.applied(wire._replace(slot=2048)) == (wire._replace(slot=2048), None)  # another slot setting's


def test_the_plans_envelope_is_the_transports():
    """routes (a pure module, below the transport) costs a GPU group's tree message with the envelope p2p sends."""
    from objcomm._transport import p2p
    from objcomm._transport.routes import plans

    assert plans.ENVELOPE_BYTES == p2p.ENVELOPE.size
