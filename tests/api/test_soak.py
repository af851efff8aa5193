"""A soak: 10,000 mixed calls on one group, some failing on purpose; memory must not keep growing."""

from __future__ import annotations

import statistics

import psutil
import pytest
import torch.distributed as dist

import objcomm

pytestmark = pytest.mark.timeout(400)

CALLS = 10_000
SERIALIZERS = ["pickle", "msgpack", "json", "restricted-pickle"]


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("deliberate")


def soak(calls: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    process = psutil.Process()
    rss, failures = [], 0
    comm = objcomm.Communicator(slot_bytes=256, chunk_bytes=8192)
    for i in range(calls):
        serializer = SERIALIZERS[i % len(SERIALIZERS)]
        fail = i % 50 < 5  # five calls in fifty fail, one of each op, on a rank that changes
        obj = Unpicklable() if fail and rank == (i // 50) % world else {"i": i, "rank": rank, "pad": "p" * (i % 1000)}
        op = i % 5
        try:
            if op == 0:
                assert comm.all_gather(obj, serializer=serializer)[rank]["i"] == i
            elif op == 1:
                got = comm.gather(obj, dst=i % world, serializer=serializer)
                assert (got is not None) == (rank == i % world)
            elif op == 2:
                root = (i // 50) % world
                assert comm.broadcast(obj if rank == root else None, src=root, serializer=serializer)["i"] == i
            elif op == 3:
                root = (i // 50) % world
                assert comm.scatter([obj] * world if rank == root else None, src=root, serializer=serializer)["i"] == i
            else:
                peer = (rank + 1) % world
                if rank % 2 == 0:
                    comm.send(obj, dst=peer, serializer=serializer)
                else:
                    comm.recv(src=peer)
        except objcomm.ObjcommError:
            failures += 1
        if i % 250 == 0:
            rss.append(process.memory_info().rss)
    quarter = len(rss) // 4
    return {
        "failures": failures,
        "first": statistics.median(rss[1:quarter]),  # skip the very first sample: warm-up allocations
        "last": statistics.median(rss[-quarter:]),
    }


def test_soak_memory_stays_flat():
    from _ranks import get_pool

    results = get_pool(2).run(soak, CALLS, timeout=360)
    for result in results:
        assert result["failures"] > 0, "the soak must include failing calls"
        growth = result["last"] - result["first"]
        assert growth < 16 << 20, f"resident memory grew by {growth / 2**20:.1f} MiB over {CALLS} calls"
