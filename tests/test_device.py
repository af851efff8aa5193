"""objcomm.device_for_backend: which device bytes travel on, for every backend string torch reports.

No GPU is needed: the CUDA index comes from the ``current_cuda`` callable, and a CUDA
``torch.device`` can be named without a GPU being present.
"""

from __future__ import annotations

import doctest
from typing import List

import pytest
import torch

import objcomm
from objcomm import _device, device_for_backend

pytestmark = pytest.mark.timeout(30)


class Calls:
    """A ``current_cuda`` stand-in that records whether it was asked."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.asked: List[int] = []

    def __call__(self) -> int:
        self.asked.append(self.index)
        return self.index


@pytest.mark.parametrize(
    ("backend", "expected", "asks_cuda"),
    [
        ("gloo", torch.device("cpu"), False),
        ("GLOO", torch.device("cpu"), False),
        ("mpi", torch.device("cpu"), False),
        ("nccl", torch.device("cuda", 3), True),
        # what dist.get_backend() reports after init_process_group() without a backend
        ("cpu:gloo,cuda:nccl", torch.device("cpu"), False),
        ("cuda:nccl,cpu:gloo", torch.device("cpu"), False),
        ("cpu:gloo", torch.device("cpu"), False),
        ("cuda:nccl", torch.device("cuda", 3), True),
    ],
)
def test_known_backends(backend, expected, asks_cuda):
    current = Calls(3)
    assert device_for_backend(backend, current) == expected
    assert bool(current.asked) is asks_cuda  # the CPU paths never touch CUDA


@pytest.mark.parametrize("backend", ["ucc", "xccl", "fake", "", "xpu:xccl", "hpu:hccl,xpu:xccl"])
def test_unknown_backends_ask_for_a_device(backend):
    with pytest.raises(ValueError, match="device="):
        device_for_backend(backend, Calls(0))


def test_the_cuda_index_is_the_current_device_not_the_rank(monkeypatch):
    # on node 1 of two 2-GPU nodes, global rank 3 runs on local GPU 1
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert device_for_backend("nccl", Calls(1)) == torch.device("cuda", 1)


def test_a_group_bound_to_a_device_wins(monkeypatch):
    class BoundGroup:
        bound_device_id = torch.device("cuda", 2)

    assert _device.current_cuda_device(BoundGroup()) == 2
    assert _device.resolve_device("nccl", BoundGroup()) == torch.device("cuda", 2)


def test_an_explicit_device_wins_over_the_backend():
    assert _device.resolve_device("nccl", None, "cpu") == torch.device("cpu")
    assert _device.resolve_device("weird", None, torch.device("cpu")) == torch.device("cpu")


def test_docstring_examples():
    failed, attempted = doctest.testmod(_device, verbose=False)
    assert attempted >= 3 and failed == 0
    assert objcomm.device_for_backend is _device.device_for_backend


@pytest.mark.parametrize(
    "device, cpu", [("cpu", True), ("cpu:0", True), ("cuda", False), ("cuda:1", False), ("meta", False)]
)
def test_is_cpu_says_what_the_devices_type_says(device, cpu):
    assert _device.is_cpu(torch.device(device)) is cpu is (torch.device(device).type == "cpu")
