"""The spreads of per-rank object sizes of issue 27's table, shared by ``tests/transport/test_many_ranks.py`` and
``benchmarks/bench_many_ranks.py``: the same objects are checked in one and timed in the other."""

from __future__ import annotations

import random
from typing import Any

import torch

CASES = ["all 1 KB", "all 1 MB", "one 20 MB", "two 2 MB", "log-normal", "uneven tensors"]


def spread_of(case: str, rank: int, world: int) -> Any:
    """Rank ``rank``'s object (of ``world``) in each case of the issue's table."""
    if case == "all 1 KB":
        return {"r": rank, "b": b"s" * 1000}
    if case == "all 1 MB":
        return {"r": rank, "b": b"l" * (1 << 20)}
    if case == "one 20 MB":
        return {"r": rank, "b": b"o" * ((20 << 20) if rank == 1 else 1000)}
    if case == "two 2 MB":
        return {"r": rank, "b": b"t" * ((2 << 20) if rank in (0, world // 2) else 1000)}
    if case == "log-normal":  # median 32 KB, sigma 2
        return {"r": rank, "b": b"n" * int(min(32_000 * random.Random(rank).lognormvariate(0, 2), 64 << 20))}
    if case == "uneven tensors":  # 256-300 KB, a different length on every rank
        return {"r": rank, "t": torch.arange(64_000 + 11_000 * rank // max(world - 1, 1), dtype=torch.float32)}
    raise ValueError(case)
