"""Names bound at import: ``from torch.distributed import all_gather_object, ...``.

Such a module keeps whatever the names were when it was imported: torch's functions if it was
imported before ``objcomm.compat.patch()``, objcomm's if after (and then even after ``unpatch()``).
"""

from __future__ import annotations

from typing import Any, List, Optional

from torch.distributed import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    get_rank,
    get_world_size,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)


def all_gather(obj: Any) -> List[Any]:
    out: List[Any] = [None] * get_world_size()
    all_gather_object(out, obj)
    return out


def gather(obj: Any, dst: int = 0) -> Optional[List[Any]]:
    out: Optional[List[Any]] = [None] * get_world_size() if get_rank() == dst else None
    gather_object(obj, out, dst=dst)
    return out


def broadcast(obj: Any, src: int = 0) -> Any:
    box = [obj]
    broadcast_object_list(box, src=src)
    return box[0]


def scatter(objs: Optional[List[Any]], src: int = 0) -> Any:
    out: List[Any] = [None]
    scatter_object_list(out, objs, src=src)
    return out[0]


def send(obj: Any, dst: int) -> None:
    send_object_list([obj], dst=dst)


def recv(src: int) -> Any:
    box: List[Any] = [None]
    recv_object_list(box, src=src)
    return box[0]
