"""Gather a dict from every rank and merge them: the seed question, done with objcomm.

Even ranks hold ``{rank: 1}``, odd ranks an empty dict; every rank prints its own, rank 0 prints
the merge. Run it with torchrun, on CPUs (gloo) or on GPUs (NCCL, one per local rank)::

    torchrun --nproc_per_node=4 examples/gather_dicts.py
    # P 0: {0: 1}
    # P 1: {}
    # P 2: {2: 1}
    # P 3: {}
    # All: {0: 1, 2: 1}

On several nodes, start the same command on each with ``--nnodes``, ``--node_rank`` and a
rendezvous endpoint (see docs/multinode.md); nothing in the script changes.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import objcomm


def main() -> None:
    if torch.cuda.is_available():
        # Each process drives the GPU of its *local* rank; objcomm moves NCCL bytes on the current device.
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        local = {rank: 1} if rank % 2 == 0 else {}
        merged: dict = {}
        for part in objcomm.all_gather(local, serializer="msgpack"):  # every rank's dict, in rank order
            merged.update(part)  # (int keys survive msgpack; json would make them strings)
        print(f"P {rank}: {local}", flush=True)
        if rank == 0:
            print(f"All: {merged}", flush=True)

        # the README's other calls
        config = objcomm.broadcast({"lr": 3e-4} if rank == 0 else None, src=0)
        everyone = objcomm.gather({"rank": rank}, dst=0)  # a list on rank 0, None elsewhere
        shard = objcomm.scatter([r * 10 for r in range(world)] if rank == 0 else None, src=0)  # rank r: r * 10
        assert config == {"lr": 3e-4} and shard == rank * 10
        assert everyone == ([{"rank": r} for r in range(world)] if rank == 0 else None)
        if rank == 1:
            objcomm.send({"done": True}, dst=0)
        elif rank == 0 and world > 1:
            assert objcomm.recv(src=1) == {"done": True}
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
