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
        rank = dist.get_rank()
        local = {rank: 1} if rank % 2 == 0 else {}
        merged: dict = {}
        for part in objcomm.all_gather(local):  # every rank's dict, in rank order
            merged.update(part)
        print(f"P {rank}: {local}", flush=True)
        if rank == 0:
            print(f"All: {merged}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
