"""Setting up the same-host channel waits no longer than the group's timeout allows.

A rank that cannot connect leaves the others waiting for it in set-up; they give up within the group's
timeout (not a fixed 30 s), early enough that every rank meets in set-up's closing all_reduce, so every
rank gets no channel and the call goes on through the group, instead of raising.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Dict

import pytest
import torch.distributed as dist
from _ranks import get_pool

import objcomm
from objcomm._samehost import channel as _channel

GROUP_TIMEOUT_S = 3


def a_rank_cannot_connect() -> Dict[str, Any]:
    """On a fresh pair with a short timeout, rank 1's connections lead nowhere; the first collective opens the
    channel. What each rank got, how long the call took, and whether the group then has a channel."""
    from objcomm import _state

    rank = dist.get_rank()
    pair = dist.new_group([0, 1], timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    comm = objcomm.Communicator(pair, local=True)
    real = _channel._address
    if rank == 1:  # its listener and its connections use names nobody else knows: its connect() fails at once
        _channel._address = lambda pid, nonce: f"\0objcomm-test-nowhere-{pid}-{nonce:016x}"  # type: ignore[assignment]
    start = time.monotonic()
    try:
        got: Any = comm.all_gather(rank)
    except objcomm.ObjcommError as exc:
        got = f"{type(exc).__name__}: {exc}"
    finally:
        _channel._address = real  # type: ignore[assignment]
    elapsed = time.monotonic() - start
    channel = _state.group_facts(pair).local[False].channel
    try:
        after: Any = comm.all_gather(rank)
    except objcomm.ObjcommError as exc:  # the ranks left set-up apart: a report, not a failed pool
        after = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group(pair)
    return {"got": got, "elapsed": elapsed, "channel": channel is not None, "after": after}


@pytest.mark.timeout(150)
def test_a_rank_that_cannot_connect_costs_less_than_the_group_timeout_and_no_error():
    results = get_pool(2).run(a_rank_cannot_connect, timeout=120)
    for rank, found in enumerate(results):
        assert found["got"] == [0, 1], (rank, found)  # no channel: the group carried the call
        assert found["elapsed"] < GROUP_TIMEOUT_S, (rank, found)  # not SETUP_TIMEOUT (30 s)
        assert not found["channel"] and found["after"] == [0, 1], (rank, found)


def test_the_default_set_up_wait_is_longer_than_the_group_timeout_above():
    assert _channel.SETUP_TIMEOUT > GROUP_TIMEOUT_S  # else the test above proves nothing
