"""objcomm._transport.let_go: a gloo call through ``guarded`` returns once gloo's worker thread let go of its tensors
(else a program whose last call ran on a thread of objcomm's could abort at exit: see the module)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _ranks import get_pool

from objcomm._transport import let_go
from objcomm._transport.let_go import held_by, wait_let_go

pytestmark = pytest.mark.timeout(120)


def _held_after_calls(calls: int) -> int:
    """On a thread of its own, as the same-host channel's voting thread runs: ``calls`` small gloo all_gathers through
    ``guarded``, each with fresh tensors; how many returned while gloo's worker still held one of them."""
    import torch.distributed as dist

    from objcomm._transport.base import Wire, all_gather_single, guarded

    world = dist.get_world_size()
    wire = Wire(dist.group.WORLD, list(range(world)), dist.get_rank(), torch.device("cpu"), 4096, 1 << 20, 1 << 20)
    still: list = []

    def run() -> None:
        count = 0
        for i in range(calls):
            mine = torch.tensor([dist.get_rank(), i], dtype=torch.int64)
            everyone = torch.empty(2 * world, dtype=torch.int64)
            guarded("let_go test", wire, all_gather_single, everyone, mine)
            count += mine._use_count() > 1 or everyone._use_count() > 1
            assert everyone.tolist()[1::2] == [i] * world
        still.append(count)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return still[0]


def test_a_gloo_collective_returns_once_gloo_let_go_of_its_tensors():
    """Without the wait, about one call in four returned while the worker still held a tensor here (300 calls: a
    certain failure); with it, none does."""
    assert get_pool(2).run(_held_after_calls, 300) == [0, 0]


def test_the_wait_ends_when_the_last_other_reference_goes():
    tensor = torch.zeros(4, requires_grad=True)
    held = held_by([tensor, [torch.zeros(1)]], {"out": torch.zeros(2)})
    assert [(t.shape[0], before) for t, before in held] == [(4, 1), (1, 1), (2, 1)]
    graph = [tensor.sin()]  # the autograd graph holds two more references to it, as gloo's worker would one
    assert tensor._use_count() > 1
    threading.Timer(0.2, graph.clear).start()
    start = time.monotonic()
    wait_let_go(held)
    assert 0.15 < time.monotonic() - start < let_go.PATIENCE and tensor._use_count() == 1


def test_a_tensor_held_past_the_patience_is_kept_alive(monkeypatch):
    monkeypatch.setattr(let_go, "PATIENCE", 0.1)
    tensor = torch.zeros(4, requires_grad=True)
    held = held_by([tensor], {})
    graph = tensor.sin()
    start = time.monotonic()
    wait_let_go(held)
    assert 0.1 <= time.monotonic() - start < 5 and let_go._KEPT[-1] is tensor
    del graph


def test_of_a_list_of_rows_the_first_and_the_last_are_waited_for():
    """A gather's W rows: two checks, not W (O(1) a call); gloo's worker drops them all when it destroys the work."""
    rows = list(torch.zeros(8192).chunk(8192))
    assert [t for t, _ in held_by([torch.zeros(1), rows], {})][1:] == [rows[0], rows[-1]]


def test_only_host_tensors_are_waited_for():
    """NCCL's watchdog lets go of a collective up to a poll period later: a call does not wait for that."""
    assert held_by([torch.empty(2, device="meta"), [torch.empty(1, device="meta")], 3, "x"], {}) == []
