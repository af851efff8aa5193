"""Through torch's implementation module: ``torch.distributed.distributed_c10d.all_gather_object(...)``."""

from __future__ import annotations

from typing import Any, List, Optional

import torch.distributed
import torch.distributed.distributed_c10d


def all_gather(obj: Any) -> List[Any]:
    out: List[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.distributed_c10d.all_gather_object(out, obj)
    return out


def gather(obj: Any, dst: int = 0) -> Optional[List[Any]]:
    here = torch.distributed.get_rank() == dst
    out: Optional[List[Any]] = [None] * torch.distributed.get_world_size() if here else None
    torch.distributed.distributed_c10d.gather_object(obj, out, dst=dst)
    return out


def broadcast(obj: Any, src: int = 0) -> Any:
    box = [obj]
    torch.distributed.distributed_c10d.broadcast_object_list(box, src=src)
    return box[0]


def scatter(objs: Optional[List[Any]], src: int = 0) -> Any:
    out: List[Any] = [None]
    torch.distributed.distributed_c10d.scatter_object_list(out, objs, src=src)
    return out[0]


def send(obj: Any, dst: int) -> None:
    torch.distributed.distributed_c10d.send_object_list([obj], dst=dst)


def recv(src: int) -> Any:
    box: List[Any] = [None]
    torch.distributed.distributed_c10d.recv_object_list(box, src=src)
    return box[0]
