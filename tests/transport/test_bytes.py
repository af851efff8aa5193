"""objcomm._transport.bytes's buffers and objcomm._transport.exchange.LaidRests, without ranks: what a receive
leaves where a peer sent less (zeros, never this process's old memory), and the rests of one buffer as tensors and
as host memory (tests/transport/test_many_ranks.py moves them between real ranks); and that a collective's
transfers are batched on both ends (4 real ranks)."""

from __future__ import annotations

from typing import Any, Dict

import torch
from _ranks import get_pool

from objcomm._transport.base import Wire
from objcomm._transport.bytes import receive_buffer, zeroed
from objcomm._transport.exchange import LaidRests

CPU = Wire(
    group=None, ranks=[0, 1, 2, 3], rank=1, device=torch.device("cpu"), slot=64, chunk=1 << 20, max_bytes=1 << 30
)


def test_receive_buffers_hold_zeros_and_share_their_bytes_with_the_host_view():
    """A receive that a peer fills only in part leaves zeros elsewhere, on every call (this process's memory freed
    by the last one does not show through), and the host view is the tensor's own bytes, not a copy."""
    for length in (0, 7, 4096, 3 << 20):  # calloc serves the large one from fresh pages, the small from the heap
        for _ in range(3):
            tensor, host = receive_buffer(length, CPU)
            assert host is not None and host.nbytes == tensor.numel() == length
            assert not tensor.any() and not any(host[:4096])
            tensor.fill_(0xAB)  # a receive writes the tensor; the view sees it
            assert bytes(host[:3]) == b"\xab" * min(3, length)
            del tensor, host
            again = zeroed(length, CPU)
            assert again.dtype == torch.uint8 and again.numel() == length and not again.any()
            again.fill_(0xCD)


def test_laid_rests_are_slices_of_one_buffer():
    """Rank r's rest is bytes starts[r] .. starts[r] + lengths[r] of the buffer, as a tensor view and as host
    memory (one view of the buffer, sliced); None where a rank sends none and for this rank (1)."""
    buffer = torch.arange(40, dtype=torch.uint8)
    lengths, starts = [3, 5, 0, 10], [0, 10, 20, 30]
    laid = LaidRests(buffer, starts, lengths, me=1)
    assert len(laid) == 4
    got = list(laid)
    assert got[1] is None and got[2] is None
    assert got[0] is not None and got[0].tolist() == [0, 1, 2]
    assert laid[3] is not None and laid[3].tolist() == list(range(30, 40))
    assert laid[3].data_ptr() == buffer[30:].data_ptr()  # a view, not a copy
    host = laid.host(3)
    assert host is not None and bytes(host) == bytes(range(30, 40))
    buffer[30] = 99  # the same memory
    assert host[0] == 99 and bytes(laid.host(0) or b"") == bytes([0, 1, 2])


def transfers_posted_alone() -> Dict[str, Any]:
    """Per collective through the backend (``local=False``; two levels: across hosts), each with rests past the
    slot: (how many point-to-point transfers this rank posted alone, outside a ``batch_isend_irecv``, whether the
    result is right)."""
    import torch.distributed as dist

    import objcomm
    from objcomm._api.resolving import Hooks

    rank, world = dist.get_rank(), dist.get_world_size()

    def big(r: int) -> bytes:
        return bytes([r + 1]) * 100_000

    every = [big(r) for r in range(world)]
    ways = {
        "gather": ({}, lambda c: c.gather(big(rank), dst=1), every if rank == 1 else None),
        "gather up a tree": ({"up_tree": True}, lambda c: c.gather(big(rank), dst=1), every if rank == 1 else None),
        "scatter": ({}, lambda c: c.scatter(every if rank == 2 else None, src=2), big(rank)),
        "broadcast down a tree": ({"rest_tree": True}, lambda c: c.broadcast(big(0) if rank == 0 else None, 0), big(0)),
        "all_to_all": ({}, lambda c: c.all_to_all([big(r) for r in range(world)]), [big(rank)] * world),
        # each rank its own host: the leaders' gather of their hosts' bundles (objcomm._samehost.two_level_rests)
        "gather on two levels": (
            {"separate_hosts": True},
            lambda c: c.gather(big(rank), 1),
            every if rank == 1 else None,
        ),
    }
    alone, inside = [0], [False]
    real = {name: getattr(dist, name) for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv")}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if name == "batch_isend_irecv":
                inside[0] = True
                try:
                    return real[name](*args, **kwargs)
                finally:
                    inside[0] = False
            alone[0] += not inside[0]
            return real[name](*args, **kwargs)

        return call

    out = {}
    modules = (dist, dist.distributed_c10d)  # (P2POp accepts only the functions distributed_c10d names)
    try:
        for name in real:
            wrapped = counted(name)
            for module in modules:
                setattr(module, name, wrapped)
        for way, (hooks, call, expected) in ways.items():
            local = "separate_hosts" in hooks  # (two levels: the channel within each host, the backend across)
            comm = objcomm.Communicator(local=local, shm=False, _hooks=Hooks(**hooks))
            alone[0] = 0
            got = call(comm)
            out[way] = (alone[0], got == expected)
    finally:
        for name, function in real.items():
            for module in modules:
                setattr(module, name, function)
    return out


def test_a_collectives_transfers_are_posted_in_batches_on_both_ends():
    """On NCCL an isend or irecv posted alone runs on a communicator of its two ranks, made once per pair (a gather's
    destination made one per sender: thousands at 8192 ranks, a scale audit's find), and a transfer whose two ends
    are not both batched never completes. So every point-to-point transfer of a collective's rests goes in a
    batch_isend_irecv on both ends (gloo runs them alike: this counts them)."""
    for rank, outcome in enumerate(get_pool(4).run(transfers_posted_alone)):
        assert outcome == {way: (0, True) for way in outcome}, (rank, outcome)
        assert len(outcome) == 6
