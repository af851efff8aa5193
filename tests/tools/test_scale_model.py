"""benchmarks/scale_model.py: the alpha-beta model of objcomm's routes at 8 to 8192 ranks (no ranks started).

The formulas are checked against hand-computed values, so that a change to one is noticed (and
docs/scaling.md, which quotes the model's output, is looked at again).
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "scale_model.py"
KEYS = {"op", "case", "W", "params", "objcomm_s", "ideal_s", "torch_s"}


def _load():
    spec = importlib.util.spec_from_file_location("_scale_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


sm = _load()


@pytest.fixture(scope="module")
def table():
    return sm.rows()


def test_json_rows_have_the_documented_keys_for_every_op_case_and_world(capsys):
    assert sm.main(["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(set(row) == KEYS for row in rows)
    seen = {(r["op"], r["case"], r["W"], r["params"]) for r in rows}
    assert seen == {(op, case, w, p) for op in sm.OPS for case in sm.CASES for w in sm.WORLDS for p in ("nccl", "gloo")}
    assert len(rows) == len(seen)


def test_costs_are_positive_and_finite(table):
    for row in table:
        for key in ("objcomm_s", "ideal_s", "torch_s"):
            assert math.isfinite(row[key]) and row[key] > 0, row


@pytest.mark.parametrize("world", [8, 8192])
@pytest.mark.parametrize("op", ["all_gather", "gather", "all_reduce"])
def test_one_outlier_under_nccl_costs_objcomm_less_than_torch(world, op):
    sizes = sm.sizes_for("one-outlier", world)
    assert sm.objcomm_cost(op, sm.NCCL, world, sizes) < sm.torch_cost(op, sm.NCCL, world, sizes)


def test_levels():
    assert [sm.levels(w) for w in (1, 2, 3, 8, 9, 8192)] == [0, 1, 2, 3, 4, 13]
    assert [sm.levels(w, 8) for w in (1, 2, 8, 9, 64, 65, 8192)] == [0, 1, 1, 2, 2, 3, 5]
    assert sm.level_latency(9, 1.0) == 1.0 and sm.level_latency(10, 1.0) == 2.0  # 8 messages at once


def test_formulas_reproduce_hand_computed_values():
    assert sm.ring_all_gather(4, 1000, 1e-5, 1e9) == pytest.approx(3e-5 + 3e-6)
    assert sm.ring_all_gatherv([100, 200, 300, 400], 1e-5, 1e3) == pytest.approx(3e-5 + 0.9)
    assert sm.ring_all_gatherv([0, 0, 0, 50], 1.0, 10.0) == pytest.approx(3 + 5)  # a rank with 0 receives all 50
    # ranks 0, 1 receive 400 bytes from 2 peers; rank 2 sends 100 to 3 and receives 300; rank 3 sends 300 to 3
    assert sm.direct_all_gatherv([0, 0, 100, 300], 1.0, 100.0) == pytest.approx(9 + 1)
    assert sm.direct_all_gatherv([0] * 7 + [80] * 10, 1.0, 10.0) == pytest.approx(max(16 * 80, 9 * 80) / 10 + 2)
    # stripes of 3 bytes: rank 1 sends 3 to rank 0, 3 to rank 2, 1 to rank 3 (3 peers, one start-up), keeps 3;
    # rank 3's 2 bytes lie in its own stripe; the busiest is rank 1
    assert sm.stripes_exchange([0, 10, 0, 2], 1.0, 1.0) == pytest.approx(7 + 1)
    assert sm.stripes_exchange([0] * 15 + [160], 1.0, 10.0) == pytest.approx(150 / 10 + 2)  # 15 peers: 2 start-ups
    assert sm.table_sum(sm.NCCL, 8, 100, 1.0, 10.0) == pytest.approx(2 * 3 + 20)  # a tree: 2 log2(8) hops
    assert sm.table_sum(sm.GLOO, 8, 100, 1.0, 10.0) == pytest.approx(2 * 7 + 20)  # a ring: 2 (W - 1) hops
    assert sm.flat_gather([5, 10, 0, 20], 0, 2.0, 10.0) == pytest.approx(2 + 3)
    assert sm.flat_gather([1] * 18, 0, 1.0, 1e9) == pytest.approx(3 + 17e-9)  # 17 senders, 8 at a time
    assert sm.tree_gather([5, 10, 0, 20], 0, 2.0, 10.0) == pytest.approx(2 * 2 + 3)
    assert sm.ring_broadcast(5, 100, 1.0, 100.0) == pytest.approx(4 + 1)
    assert sm.binomial_broadcast(5, 100, 1.0, 100.0) == pytest.approx(3 * (1 + 1))
    assert sm.tree_broadcast(5, 100, 1.0, 100.0) == pytest.approx(3 + 1)
    assert sm.ring_vote(5, 1.0) == pytest.approx(8)
    assert sm.tree_vote(5, 1.0) == pytest.approx(6)
    assert sm.tree_reduce(8, 100, 1.0, 100.0) == pytest.approx(3 * 2)
    assert sm.tree_reduce(8, 100, 1.0, 100.0, messages=2) == pytest.approx(3 * 3)  # a slot, then the rest, an edge
    assert sm.direct_broadcast(9, 100, 1.0, 100.0) == pytest.approx(1 + 8)
    assert sm.direct_vote(9, 1.0) == pytest.approx(2)
    assert sm.shared_memory_exchange([0, int(sm.SAME_HOST_BANDWIDTH)], 1e-5) == pytest.approx(2e-5 + 1)


def test_parameters_are_the_documented_ones():
    assert sm.RANKS_PER_NODE == 8
    assert (sm.NCCL.alpha(8), sm.NCCL.alpha(9), sm.NCCL.bandwidth) == (5e-6, 20e-6, 25e9)
    assert (sm.GLOO.alpha(8), sm.GLOO.alpha(9), sm.GLOO.bandwidth) == (10e-6, 50e-6, 1.25e9)
    assert (sm.NCCL.broadcast, sm.NCCL.vote, sm.GLOO.broadcast, sm.GLOO.vote) == ("ring", "tree", "binomial", "ring")


def test_rests_follow_the_slot():
    fits = 4096 - 24 - sm.FRAME_OVERHEAD
    assert [sm.pickled_rest(n) for n in (1024, fits, fits + 1)] == [0, 0, fits + 1 + sm.FRAME_OVERHEAD]
    assert sm.sizes_for("equal-small", 64).rests == (0,) * 64
    assert sm.sizes_for("uneven-tensors", 64).rests == sm.sizes_for("uneven-tensors", 64).payloads


def test_cases_are_seeded_and_shaped():
    assert sm.payloads_for("log-normal", 512) == sm.payloads_for("log-normal", 512)
    big = sm.payloads_for("10pct-large", 8192)
    assert big[0] == 1024 and sum(1 for n in big if n == 16 << 20) == round(8192 / 10)
    assert sm.payloads_for("10pct-large", 8).count(16 << 20) == 1
    outlier = sm.payloads_for("one-outlier", 64)
    assert outlier[0] == 1024 and max(outlier) == 100 << 20
    assert all(0.9 * (1 << 20) - 4 <= n <= 1.1 * (1 << 20) for n in sm.payloads_for("uneven-tensors", 512))
    assert max(sm.payloads_for("log-normal", 8192)) <= 1 << 30


def test_a_whole_row_by_hand():
    """all_gather of 1 KB objects on 8 NCCL ranks, one host: the 4 KB slots through the same-host channel (each
    rank sends its slot to 7 peers at once), nothing after; flat (``--flat``): one padded all_gather of them."""
    a, b = 5e-6, 25e9
    sizes = sm.sizes_for("equal-small", 8)
    assert sm.objcomm_cost("all_gather", sm.NCCL, 8, sizes) == pytest.approx(a + 7 * 4096 / sm.SAME_HOST_BANDWIDTH)
    flat = sm.objcomm_plan("all_gather", sm.NCCL, 8, sizes, two_levels=False)
    assert sm.plan_cost(flat, sm.NCCL, 8) == pytest.approx(7 * a + 7 * 4096 / b)
    assert sm.ideal_cost("all_gather", sm.NCCL, 8, sizes) == pytest.approx(7 * a + 7 * 1024 / b)
    assert sm.torch_cost("all_gather", sm.NCCL, 8, sizes) == pytest.approx(14 * a + 7 * (8 + 1024) / b)
    assert sm.ideal_cost("all_reduce", sm.GLOO, 64, sizes) == pytest.approx(2 * 6 * 50e-6 + 2 * 1024 / 1.25e9)


def test_a_gather_up_a_tree_by_hand():
    """gather of 1 KB objects on 64 NCCL ranks across hosts: the slots up a tree of radix 4 (3 levels, each a hop:
    a rank's 3 children of a level at once; the lengths climb a level a hop, the slots one level behind them; each
    trimmed: the 24-byte prefix and the 1,070-byte frame (the frame's 46 bytes measured), plus a 4-byte length; the
    root takes in 63 of them), then the destination's word back down the same tree (3 hops, 3 words of 8 bytes
    out of each relay)."""
    a, b = 20e-6, 25e9
    sizes = sm.sizes_for("equal-small", 64)
    assert sm.slot_carries(1024, tensor=False) == 24 + 1024 + sm.FRAME_OVERHEAD
    got = sm.objcomm_plan("gather", sm.NCCL, 64, sizes)
    assert sm.route_code(got) == "GT+TD"
    assert sm.FRAME_OVERHEAD == 46
    assert sm.plan_cost(got, sm.NCCL, 64) == pytest.approx((3 + 1) * a + 63 * (4 + 1094) / b + 3 * (a + 3 * 8 / b))


def test_check_exits_non_zero_exactly_when_a_row_misses(capsys, table):
    missed = sm.misses(table)
    assert sm.main(["--check", "--world", "8192"]) == (1 if missed else 0)
    out = capsys.readouterr().out
    assert f"{len(missed)} of 36 checked rows" in out
    for row in missed:
        assert f"{row['op']} {row['case']} {row['params']}:" in out


def test_nccl_broadcast_switch_renames_the_parameter_set(capsys):
    assert sm.main(["--json", "--world", "64", "--params", "nccl", "--nccl-broadcast", "tree"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["params"] for r in rows} == {"nccl-tree-bcast"}


def test_the_table_is_markdown(capsys):
    assert sm.main(["--world", "8", "--case", "equal-small", "--op", "all_gather"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 + 2 and all(line.startswith("| ") or line.startswith("|---") for line in lines)


def test_a_row_of_two_levels_by_hand():
    """all_gather of 1 KB objects on 16 gloo ranks, two hosts of 8: each host's slots to its leader through the
    channel, the two leaders' all_gather of their hosts' 8 slots (across hosts), the 64 KB table back through the
    channel."""
    inside, across, slot = sm.GLOO.alpha_intra, sm.GLOO.alpha_inter, 4096
    to_leader = inside + 7 * slot / sm.SAME_HOST_BANDWIDTH
    leaders = across + 8 * slot / sm.GLOO.bandwidth
    back = inside + 7 * (2 * 8 * slot) / sm.SAME_HOST_BANDWIDTH
    cost = sm.objcomm_cost("all_gather", sm.GLOO, 16, sm.sizes_for("equal-small", 16))
    assert cost == pytest.approx(to_leader + leaders + back)


def test_a_gather_tree_s_climb_by_hand_and_the_radix_it_chose():
    """4 ranks, a hop of 1 and a CPU cost of 0 or 1 a message: the binomial tree (0 <- 1, 0 <- 2 <- 3) takes two hops,
    radix 4 (every rank the root's child) one; with the CPU cost the binomial root's last message comes at 4 and it
    is done at 5, radix 4's root posts 3 receives (3) and takes the last at 4. At 8192 ranks and NCCL's 20 us hop,
    routes.SLOT_TREE_RADIX (4) beats the binomial tree at every CPU cost up to a hop's latency and is never slower
    than it in the table, where radix 8 loses to it from half a hop's latency (its root takes 29 messages); over the
    table it is the radix whose worst time against the fastest radix at the same cost is least (1.4x: radix 3 at
    no cost 1.6x, radix 8 at 40 us 1.72x)."""
    assert (sm.tree_climb(4, 2, 1.0, 0.0), sm.tree_climb(4, 4, 1.0, 0.0)) == (2.0, 1.0)
    assert (sm.tree_climb(4, 2, 1.0, 1.0), sm.tree_climb(4, 4, 1.0, 1.0)) == (5.0, 4.0)
    a = sm.NCCL.alpha_inter
    for cost in sm.RADIX_TABLE[1]:
        binomial, chosen = sm.tree_climb(8192, 2, a, cost), sm.tree_climb(8192, sm.routes.SLOT_TREE_RADIX, a, cost)
        assert chosen <= binomial and (chosen < binomial or cost > a)
        if cost >= a / 2:
            assert sm.tree_climb(8192, 8, a, cost) > chosen
    radixes, costs = sm.RADIX_TABLE
    times = {(r, c): sm.tree_climb(8192, r, a, c) for r in radixes for c in costs}
    worst = {r: max(times[r, c] / min(times[q, c] for q in radixes) for c in costs) for r in radixes}
    assert min(worst, key=worst.get) == sm.routes.SLOT_TREE_RADIX
    assert worst[4] == pytest.approx(1.4) and worst[3] == pytest.approx(1.6)
    assert sm.main(["--radix-table"]) == 0
