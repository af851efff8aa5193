"""The most common style: ``import torch.distributed as dist``, then ``dist.all_gather_object(...)``."""

from __future__ import annotations

from typing import Any, List, Optional

import torch.distributed as dist


def all_gather(obj: Any) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather(obj: Any, dst: int = 0) -> Optional[List[Any]]:
    out: Optional[List[Any]] = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def broadcast(obj: Any, src: int = 0) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def scatter(objs: Optional[List[Any]], src: int = 0) -> Any:
    out: List[Any] = [None]
    dist.scatter_object_list(out, objs, src=src)
    return out[0]


def send(obj: Any, dst: int) -> None:
    dist.send_object_list([obj], dst=dst)


def recv(src: int) -> Any:
    box: List[Any] = [None]
    dist.recv_object_list(box, src=src)
    return box[0]
