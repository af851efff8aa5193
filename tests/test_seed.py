"""The scenario users hand-rolled in ../shared/seeds: 10 ranks, gather dicts, merge."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from _ranks import get_pool

import objcomm

pytestmark = pytest.mark.timeout(300)


def gather_and_merge(serializer: str):
    rank = dist.get_rank()
    local = {rank: 1} if rank % 2 == 0 else {}
    try:
        parts = objcomm.all_gather(local, serializer=serializer)
    except objcomm.ObjcommError as exc:
        return type(exc).__name__, str(exc)
    merged = {}
    for part in parts:
        merged.update(part)
    return merged


@pytest.fixture(scope="module")
def ten_ranks():
    return get_pool(10, timeout=120)


@pytest.mark.parametrize("serializer", ["pickle", "cloudpickle", "msgpack", "restricted-pickle"])
def test_ten_ranks_merge_with_int_keys_kept(ten_ranks, serializer):
    expected = {0: 1, 2: 1, 4: 1, 6: 1, 8: 1}
    assert ten_ranks.run(gather_and_merge, serializer) == [expected] * 10


def test_json_refuses_int_keys_on_every_rank(ten_ranks):
    """JSON object keys are strings: json refuses {0: 1} rather than silently turning 0 into "0"."""
    results = ten_ranks.run(gather_and_merge, "json")
    for kind, message in results:
        assert kind == "RemoteError"
        assert "ranks 0, 2, 4, 6, 8" in message
        assert "json cannot encode dict key 0 (int)" in message
