"""objcomm._transport.bytes's buffers and objcomm._transport.exchange.LaidRests, without ranks: what a receive
leaves where a peer sent less (zeros, never this process's old memory), and the rests of one buffer as tensors and
as host memory (tests/transport/test_many_ranks.py moves them between real ranks)."""

from __future__ import annotations

import torch

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
