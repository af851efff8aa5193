"""The benchmark's building blocks: payload sizing, round-trip verdicts, and timing on live ranks."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from _ranks import get_pool

import objcomm
import serializers
from objcomm._tools.bench.config import OPS
from objcomm._tools.bench.measure import MAX_BATCH, TORCH, Timing, compare_op, interleaved
from objcomm._tools.bench.payloads import BUILTIN, format_size, parse_size, reference_size
from objcomm._tools.bench.roundtrip import check, judge

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "text, expected",
    [("512", 512), ("1KB", 1024), ("1.5kb", 1536), ("16MB", 16 << 20), ("2GiB", 2 << 30), (" 64 KB ", 64 << 10)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "KB", "1XB", "-1KB", "0", "1e3"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_format_size():
    assert [format_size(n) for n in (0, 1023, 1024, 1536, 16 << 20)] == ["0 B", "1023 B", "1 KB", "1.5 KB", "16 MB"]


@pytest.mark.parametrize("name", [n for n, p in BUILTIN.items() if p.scalable])
@pytest.mark.parametrize("size", [4 << 10, 256 << 10])
def test_scalable_payloads_reach_the_requested_size(name, size):
    objs = [BUILTIN[name].make(rank, size) for rank in (0, 1)]
    for obj in objs:
        assert 0.8 * size <= reference_size(obj) <= 1.25 * size
    assert reference_size(objs[0]) > 0 and not _equal(objs[0], objs[1]), "ranks hold different objects"


def _equal(a, b) -> bool:
    return judge(a, b) == ("exact", "")


@pytest.mark.parametrize(
    "sent, got, verdict, note",
    [
        ([1.0, math.nan], [1.0, math.nan], "exact", ""),
        ({"a": (1, 2)}, {"a": [1, 2]}, "converted", "tuple → list at $['a']"),
        (OrderedDict(a=1), {"a": 1}, "converted", "OrderedDict → dict at $"),
        ([True], [1], "converted", "bool → int at $[0]"),
        ({"x": [1.5]}, {"x": [1.25]}, "lossy", "value changed at $['x'][0]"),
        ({1: 2}, {"1": 2}, "lossy", "keys changed at $"),
        ({"t": torch.arange(3)}, {"t": torch.arange(3)}, "exact", ""),
        (
            {"t": torch.arange(3)},
            {"t": torch.arange(3).double()},
            "converted",
            "tensor dtype int64 → float64 at $['t']",
        ),
        ({"t": torch.arange(3)}, {"t": torch.arange(1, 4)}, "lossy", "tensor values changed at $['t']"),
        (torch.zeros(2, 3), torch.zeros(3, 2), "lossy", "tensor shape (2, 3) → (3, 2) at $"),
    ],
)
def test_judge(sent, got, verdict, note):
    assert judge(sent, got) == (verdict, note)


def test_check_measures_and_refuses():
    trip = check(serializers.get("msgpack"), {"ids": list(range(100))}, repeat=3)
    assert trip.verdict == "exact" and trip.encoded_bytes > 100 and trip.encode_s > 0 and trip.decode_s > 0
    refused = check(serializers.get("json"), {1: "int key"}, repeat=3)
    assert refused.refused and "json" in refused.note and refused.encode_s is None


def test_check_encodes_with_the_configured_settings():
    text = "objcomm " * 20_000
    plain = check(serializers.get("pickle"), text, repeat=1).encoded_bytes
    previous = objcomm.configure(compression="zstd")
    try:
        compressed = check(serializers.get("pickle"), text, repeat=1).encoded_bytes
    finally:
        objcomm.restore(previous)
    assert plain is not None and compressed is not None and compressed < plain // 10


# -- on live ranks -----------------------------------------------------------------------------
def _records(rank: int) -> list:
    return [{"id": rank * 100 + i, "score": i / 7} for i in range(50)]


def compare_every_op(repeat: int) -> dict:
    return {op: compare_op(op, _records, ["pickle", "msgpack"], repeat=repeat) for op in OPS}


def raw_and_objects() -> dict:
    send = torch.zeros(256, dtype=torch.uint8)
    out = torch.empty(256 * dist.get_world_size(), dtype=torch.uint8)
    calls = {
        "raw": lambda: dist.all_gather_into_tensor(out, send),
        "objects": lambda: dist.all_gather_object([None] * dist.get_world_size(), _records(0)),
    }
    return interleaved(calls, repeat=4, warmup=0)


def test_compare_op_times_objcomm_and_torch_alike_on_every_rank():
    pool = get_pool(2)
    per_rank = pool.run(compare_every_op, 3)
    assert per_rank[0] == per_rank[1], "every rank reports the slowest rank's times"
    assert set(per_rank[0]) == set(OPS)  # the new ops (all_to_all, all_reduce, iall_gather) included
    for op, timings in per_rank[0].items():
        assert set(timings) == {"pickle", "msgpack", TORCH}, op
        for timing in timings.values():
            assert isinstance(timing, Timing) and timing.repeats == 3
            assert timing.median_s > 0 and timing.median_s == sorted(timing.samples_s)[1]


def test_interleaved_times_any_callable():
    results = get_pool(2).run(raw_and_objects)
    assert results[0] == results[1]
    assert set(results[0]) == {"raw", "objects"} and all(t.repeats == 4 for t in results[0].values())


def batched(batch: int) -> list:
    """Each sample of ``batch`` calls back to back, a round at least 10 ms x ``batch``; 0.3 s of budget."""
    import time

    calls = []
    timed = interleaved(
        {"sleep": lambda: (calls.append(1), time.sleep(0.01))}, repeat=100, warmup=1, budget_s=0.3, batch=batch
    )["sleep"]
    return [timed.repeats, len(calls), timed.median_s >= 0.01]


def test_interleaved_batches_calls_and_budgets_whole_rounds():
    # 0.3 s at >= 0.1 s a round: the fewest rounds, 3 (the budget once counted one call a round: 30);
    # each sample is 10 timed calls after an untimed one (the lead-in), warm-up round included
    assert get_pool(1).run(batched, 10) == [[3, (1 + 3) * (10 + 1), True]]


def sampled(min_sample_s: float) -> list:
    """Calls of ~1 ms with samples of at least ``min_sample_s``: the batch is chosen from the warm-up."""
    import time

    calls = []
    timed = interleaved(
        {"nap": lambda: (calls.append(1), time.sleep(0.001)), "idle": lambda: None},
        repeat=3,
        warmup=1,
        min_sample_s=min_sample_s,
    )
    return [len(calls), timed["nap"].median_s >= 0.001]


def test_interleaved_times_fast_calls_several_to_a_sample():
    # the fastest candidate ("idle", microseconds) sets the batch: the most, 20 calls a sample plus the lead-in;
    # one warm-up call, then 3 rounds of 21
    assert get_pool(1).run(sampled, 0.002) == [[1 + 3 * (MAX_BATCH + 1), True]]


def orders() -> list:
    """The order in which each of 12 rounds (after the warm-up) called the 4 candidates."""
    called: list = []
    interleaved({n: (lambda n=n: called.append(n)) for n in "abcd"}, repeat=12, warmup=1)
    return [called[i : i + 4] for i in range(4, len(called), 4)]


def test_each_round_calls_the_candidates_in_an_order_of_its_own():
    rounds = get_pool(1).run(orders)[0]
    assert len(rounds) == 12 and all(sorted(r) == list("abcd") for r in rounds)
    # what came right before "a": a fixed rotation always has "d" there (or nothing), so "a" always paid for
    # whatever "d" left behind (torch's garbage, for the first serializer by name, before)
    before_a = {r[r.index("a") - 1] for r in rounds if r[0] != "a"}
    assert len(before_a) > 1, rounds


def send_recv_alone() -> str:
    try:
        compare_op("send/recv", _records)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_send_recv_needs_two_ranks():
    assert get_pool(1).run(send_recv_alone) == ["send/recv needs at least 2 ranks"]
