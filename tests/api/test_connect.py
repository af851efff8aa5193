"""objcomm.connect(): a program whose first calls are send/recv gets the same-host channel from its first message
(issue 25: without it, the channel opened at the group's first collective only)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict

import pytest
import torch.distributed as dist
from _ranks import get_pool

import objcomm
from objcomm import _state
from objcomm._samehost import channel as _channel

pytestmark = pytest.mark.timeout(120)


def connects(local: bool) -> Dict[str, Any]:
    """connect() on a new group, then a ring of sends and receives, counting what went through the channel."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=20))
    comm = objcomm.Communicator(group, local=local)
    on = comm.connect()
    sent = []
    real_send = _channel.LocalChannel.send
    _channel.LocalChannel.send = lambda self, *a, **k: (sent.append(1), real_send(self, *a, **k))[1]
    try:
        comm.send({"from": rank}, dst=(rank + 1) % world)
        got = comm.recv(src=(rank - 1) % world)
    finally:
        _channel.LocalChannel.send = real_send
    state = _state.group_facts(group).local.get(False)
    return {
        "on": on,
        "got": got,
        "through channel": len(sent),
        "collectives": 0 if state is None or state.channel is None else state.channel.sequence,
        "again": comm.connect(),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_send_recv_take_the_channel_from_the_first_message(world):
    for rank, report in enumerate(get_pool(world).run(connects, True)):
        assert report["on"] and report["again"], report
        assert report["got"] == {"from": (rank - 1) % world}
        assert report["through channel"] == 1, report  # the send went through the channel, not the backend
        assert report["collectives"] == 0, report  # no collective ran on the channel: connect() opened it


def test_connect_says_no_where_the_channel_is_off():
    for report in get_pool(2).run(connects, False):
        assert report == {"on": False, "got": report["got"], "through channel": 0, "collectives": 0, "again": False}


def test_connect_without_a_process_group_says_no():
    assert objcomm.connect() is False
