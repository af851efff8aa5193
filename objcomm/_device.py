"""Which device the byte tensors live on: the one place that decides it.

``nccl`` moves only CUDA tensors, so bytes go to the *current* CUDA device (the one the user or
launcher set from LOCAL_RANK, or the group's bound device) — never ``cuda:{rank}``, which is wrong
on every node but the first. ``gloo`` and ``mpi`` move CPU tensors. A group with several backends
(``"cpu:gloo,cuda:nccl"``) moves bytes on the CPU side.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch

_CPU_BACKENDS = {"gloo", "mpi"}
_CUDA_BACKENDS = {"nccl"}


def device_for_backend(backend: str, current_cuda: Callable[[], int]) -> torch.device:
    """The byte-transport device for a backend string as ``dist.get_backend`` reports it.

    >>> device_for_backend("gloo", lambda: 0)
    device(type='cpu')
    >>> device_for_backend("nccl", lambda: 3)
    device(type='cuda', index=3)
    >>> device_for_backend("cpu:gloo,cuda:nccl", lambda: 1)
    device(type='cpu')
    """
    backend = backend.lower()
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        per_device = dict(part.split(":", 1) for part in backend.split(","))
        if "cpu" in per_device:
            return torch.device("cpu")
        if "cuda" in per_device:
            return torch.device("cuda", current_cuda())
        raise ValueError(f"process group backend {backend!r} has neither a cpu nor a cuda backend; pass device=")
    if backend in _CPU_BACKENDS:
        return torch.device("cpu")
    if backend in _CUDA_BACKENDS:
        return torch.device("cuda", current_cuda())
    raise ValueError(
        f"objcomm does not know which device the {backend!r} backend moves; pass device='cpu' or device='cuda'"
    )


def current_cuda_device(group: object = None) -> int:
    """The group's bound CUDA device if it has one, else ``torch.cuda.current_device()``.

    Warns when LOCAL_RANK points at another device: on a multi-GPU node every rank would
    otherwise share GPU 0. Call ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))``.
    """
    bound = getattr(group, "bound_device_id", None)
    if isinstance(bound, torch.device) and bound.type == "cuda" and bound.index is not None:
        return bound.index
    index = torch.cuda.current_device()
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and local_rank.isdigit() and int(local_rank) != index and torch.cuda.device_count() > 1:
        warnings.warn(
            f"NCCL group on cuda:{index}, but LOCAL_RANK={local_rank}; ranks of this node may share one GPU. "
            "Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before using objcomm.",
            RuntimeWarning,
            stacklevel=3,
        )
    return index


def group_backend(group: Any) -> str:
    """The group's backend string; a group made by ``init_process_group()`` without a backend reports
    ``"undefined"`` from ``get_backend`` but ``"cpu:gloo,cuda:nccl"`` (or similar) from its config."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if backend == "undefined" and hasattr(dist, "get_backend_config"):
        backend = str(dist.get_backend_config(group))
    return backend


_CPU = torch.device("cpu")


def is_cpu(device: torch.device) -> bool:
    """Whether ``device`` is the CPU: ``device.type == "cpu"``, where that comparison is the slow half (torch builds
    the type's string each time, ~0.4 µs; equality with a CPU device ~0.02 µs), asked several times a call.

    >>> is_cpu(torch.device("cpu")), is_cpu(torch.device("cpu", 0)), is_cpu(torch.device("cuda", 1))
    (True, True, False)
    """
    return device == _CPU or device.type == "cpu"


def resolve_device(
    backend: str, group: object = None, device: Optional[Union[str, torch.device]] = None
) -> torch.device:
    """``device`` if given, else the device the group's backend moves."""
    if device is not None:
        return torch.device(device)
    return device_for_backend(backend, lambda: current_cuda_device(group))


def timeout_seconds(group: Any) -> float:
    """:func:`group_timeout` in seconds; torch's default process-group timeout when it does not tell."""
    timeout: Optional[timedelta] = group_timeout(group)
    if timeout is None:
        from torch.distributed.constants import default_pg_timeout

        timeout = default_pg_timeout
    return max(timeout.total_seconds(), 0.001)


def group_timeout(group: Any) -> Any:
    """The group's own timeout (a ``timedelta``), so that what objcomm adds gives up when the group
    would; None when torch does not tell (its default then applies)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # private and version-dependent
            continue
    return None
