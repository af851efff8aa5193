"""Drop-in replacements for ``torch.distributed``'s object collectives, built on objcomm.

Swap the import and leave the rest of the program as it is::

    # from torch.distributed import all_gather_object, broadcast_object_list
    from objcomm.compat import all_gather_object, broadcast_object_list

Each function has the signature of its torch 2.13 namesake (argument names, order and defaults,
``group_dst``/``group_src`` included, whichever torch >= 2.2 is installed), fills the caller's
list in place as torch does, and returns what torch returns. ``dst``/``src`` are global ranks,
``group_dst``/``group_src`` ranks within ``group``, exactly as in torch. A keyword-only
``serializer=`` picks how this rank encodes; the default is objcomm's default, ``"pickle"``, which
is what torch uses.

Where the shims differ from torch, it is on purpose:

- A rank that cannot encode its object makes every rank raise :class:`objcomm.RemoteError`; torch
  raises on that rank and leaves the others waiting for it.
- Misuse torch reports with ``ValueError`` before communicating (``object_gather_list`` missing on
  the destination, a bad ``scatter_object_output_list``) is reported with the same ``ValueError``
  *after* the collective, so the other ranks are not left waiting.
- ``broadcast_object_list`` and ``recv_object_list`` raise ``ValueError`` when the receiving list's
  length differs from the sent list's; torch's behaviour is undefined there.
- On a rank outside ``group``, ``send_object_list``/``recv_object_list`` warn and return (``-1`` for
  ``recv_object_list``), as torch documents; torch 2.13 raises ``ValueError`` there instead.
- ``use_batch`` is accepted and has no effect: objcomm's transport decides how bytes move.
- Without an initialised process group, the collectives act as a group of one (as all of objcomm
  does); torch raises.
- Bytes travel in objcomm's frame format: both ends of a ``send_object_list``/``recv_object_list``
  pair must use objcomm (``objcomm.send``/``objcomm.recv`` interoperate with these shims).
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from serializers import SerializerLike, registry

from ._api import all_gather, gather, scatter
from ._communicator import Communicator
from ._errors import RemoteError

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
]


def all_gather_object(
    object_list: List[Any], obj: Any, group: Any = None, *, serializer: Optional[SerializerLike] = None
) -> None:
    """Gather ``obj`` from every rank of ``group`` into ``object_list`` (in place), like torch's.

    Parameters
    ----------
    object_list: filled with one object per group rank, in group-rank order; at least that long.
    obj: this rank's object.
    group: process group (default: the default group).
    serializer: how this rank encodes ``obj`` (default ``"pickle"``).

    Returns
    -------
    ``None``. A rank outside ``group`` gets a warning and ``object_list`` is left alone.

    Raises
    ------
    RemoteError: on every rank, when any rank could not encode its object.
    IndexError: when ``object_list`` is shorter than the group (after the collective, as torch).

    Example::

        output = [None] * dist.get_world_size()
        all_gather_object(output, {"rank": rank}, serializer="msgpack")
    """
    if _not_in_group(group):
        _warn_not_in_group("all_gather_object")
        return None
    for i, item in enumerate(all_gather(obj, group=group, serializer=serializer)):
        object_list[i] = item
    return None


def gather_object(
    obj: Any,
    object_gather_list: Optional[List[Any]] = None,
    dst: Optional[int] = None,
    group: Any = None,
    group_dst: Optional[int] = None,
    *,
    serializer: Optional[SerializerLike] = None,
) -> None:
    """Gather ``obj`` from every rank into ``object_gather_list`` on the destination rank, like torch's.

    Parameters
    ----------
    obj: this rank's object.
    object_gather_list: on the destination, a list at least as long as the group; ``None`` elsewhere.
    dst: destination as a global rank; ``group_dst``: the same as a rank of ``group`` (give at most
        one; neither means global rank 0).
    group: process group (default: the default group).
    serializer: how this rank encodes ``obj`` (default ``"pickle"``).

    Returns
    -------
    ``None``; the destination's ``object_gather_list`` holds the objects in group-rank order.

    Raises
    ------
    ValueError: a list missing on the destination or given elsewhere (after the collective), or
        both ``dst`` and ``group_dst``.
    RemoteError: on every rank, when any rank could not encode its object.

    Example::

        output = [None] * dist.get_world_size() if rank == 0 else None
        gather_object(predictions, output, dst=0)
    """
    if _not_in_group(group):
        _warn_not_in_group("gather_object")
        return None
    root = _global_rank(group, dst, group_dst, "dst", default=0)
    gathered = gather(obj, dst=root, group=group, serializer=serializer)
    if gathered is None:
        if object_gather_list:
            raise ValueError(
                f"gather_object: object_gather_list must be None on ranks other than the destination "
                f"(global rank {root}); this is global rank {_my_rank()}"
            )
        return None
    if not object_gather_list:
        raise ValueError(
            f"gather_object: the destination (global rank {root}) must pass object_gather_list, "
            f"a list of {len(gathered)} slots; the gathered objects were dropped"
        )
    for i, item in enumerate(gathered):
        object_gather_list[i] = item
    return None


def broadcast_object_list(
    object_list: List[Any],
    src: Optional[int] = None,
    group: Any = None,
    device: Optional[torch.device] = None,
    group_src: Optional[int] = None,
    *,
    serializer: Optional[SerializerLike] = None,
) -> None:
    """Copy the source rank's ``object_list`` into every other rank's ``object_list`` (in place), like torch's.

    The whole list travels as one object. The source's list is left as it is (its elements are not
    replaced by decoded copies, as in torch).

    Parameters
    ----------
    object_list: the objects on the source; elsewhere, a list of the same length to overwrite.
    src: source as a global rank; ``group_src``: the same as a rank of ``group`` (give at most one;
        neither means global rank 0).
    group: process group (default: the default group).
    device: where the bytes travel (default: the CPU for gloo, the current CUDA device for NCCL).
    serializer: how the source encodes the list (default ``"pickle"``).

    Returns
    -------
    ``None``.

    Raises
    ------
    ValueError: a receiving list whose length differs from the source's (after the collective).
    RemoteError: on every rank, when the source could not encode its list.

    Example::

        config = [load_config() if rank == 0 else None]
        broadcast_object_list(config, src=0)
    """
    if _not_in_group(group):
        _warn_not_in_group("broadcast_object_list")
        return None
    root = _global_rank(group, src, group_src, "src", default=0)
    is_root = _my_rank() == root
    received = Communicator(group, device=device).broadcast(
        list(object_list) if is_root else None, root, serializer=serializer
    )
    if not is_root:
        _fill(object_list, received, "broadcast_object_list", f"source (global rank {root})")
    return None


def scatter_object_list(
    scatter_object_output_list: List[Any],
    scatter_object_input_list: Optional[List[Any]] = None,
    src: Optional[int] = None,
    group: Any = None,
    group_src: Optional[int] = None,
    *,
    serializer: Optional[SerializerLike] = None,
) -> None:
    """Give group rank ``r`` element ``r`` of the source's input list, in its ``scatter_object_output_list[0]``.

    Parameters
    ----------
    scatter_object_output_list: a list of at least one element; element 0 receives this rank's object.
    scatter_object_input_list: on the source, one object per group rank; ignored elsewhere.
    src: source as a global rank; ``group_src``: the same as a rank of ``group`` (give at most one;
        neither means global rank 0).
    group: process group (default: the default group).
    serializer: how the source encodes the objects (default ``"pickle"``).

    Returns
    -------
    ``None``.

    Raises
    ------
    ValueError: no input list on the source, or an output list that is not a non-empty list.
    RemoteError: on every rank, when the source's input is unusable (other ranks than the source)
        or could not be encoded.

    Example::

        out = [None]
        scatter_object_list(out, [{"shard": r} for r in range(world)] if rank == 0 else None, src=0)
    """
    if _not_in_group(group):
        _warn_not_in_group("scatter_object_list")
        return None
    root = _global_rank(group, src, group_src, "src", default=0)
    try:
        item = scatter(scatter_object_input_list, src=root, group=group, serializer=serializer)
    except (RemoteError, TypeError) as exc:
        if _my_rank() == root and scatter_object_input_list is None:
            raise ValueError("scatter_object_list: the source rank must pass scatter_object_input_list") from exc
        raise
    if not isinstance(scatter_object_output_list, list):
        raise ValueError(
            "scatter_object_list: scatter_object_output_list must be a list of at least one element, "
            f"got {type(scatter_object_output_list).__name__}; the received object was dropped"
        )
    if not scatter_object_output_list:
        raise ValueError(
            "scatter_object_list: scatter_object_output_list is empty; pass a list of at least one element "
            "(e.g. [None]), whose element 0 receives this rank's object. The received object was dropped"
        )
    scatter_object_output_list[0] = item
    return None


def send_object_list(
    object_list: List[Any],
    dst: Optional[int] = None,
    group: Any = None,
    device: Optional[torch.device] = None,
    group_dst: Optional[int] = None,
    use_batch: bool = False,
    *,
    serializer: Optional[SerializerLike] = None,
) -> None:
    """Send ``object_list`` (as one object) to the destination, which calls :func:`recv_object_list`.

    Parameters
    ----------
    object_list: the objects to send.
    dst: destination as a global rank; ``group_dst``: the same as a rank of ``group`` (exactly one).
    group: process group (default: the default group).
    device: where the bytes travel (default: the CPU for gloo, the current CUDA device for NCCL).
    use_batch: accepted for compatibility; it has no effect.
    serializer: how this rank encodes the list (default ``"pickle"``).

    Returns
    -------
    ``None``.

    Raises
    ------
    ValueError: no destination, both ``dst`` and ``group_dst``, or this rank itself.
    EncodeError: the list could not be encoded (the receiver raises ``RemoteError``, so it is not left waiting).

    Example::

        if rank == 0:
            send_object_list([{"step": 10}, "done"], dst=1)
    """
    if _not_in_group(group):
        _warn_not_in_group("send_object_list")
        return None
    peer = _global_rank(group, dst, group_dst, "dst", default=None)
    Communicator(group, device=device).send(list(object_list), peer, serializer=serializer)
    return None


def recv_object_list(
    object_list: List[Any],
    src: Optional[int] = None,
    group: Any = None,
    device: Optional[torch.device] = None,
    group_src: Optional[int] = None,
    use_batch: bool = False,
    *,
    serializer: Optional[SerializerLike] = None,
) -> int:
    """Receive the list :func:`send_object_list` sent into ``object_list`` (in place); return the sender's global rank.

    Parameters
    ----------
    object_list: a list as long as the sent one, overwritten element by element.
    src: sender as a global rank; ``group_src``: the same as a rank of ``group`` (exactly one, as
        torch 2.13 requires).
    group: process group (default: the default group).
    device: where the bytes travel (default: the CPU for gloo, the current CUDA device for NCCL).
    use_batch: accepted for compatibility; it has no effect.
    serializer: the one serializer this rank accepts for the incoming list (default: any the
        process-wide ``accept`` setting allows). ``serializer="msgpack"`` makes sure no pickle is
        ever decoded here.

    Returns
    -------
    The sender's global rank; ``-1`` on a rank outside ``group`` (with a warning).

    Raises
    ------
    ValueError: no source, both ``src`` and ``group_src``, this rank itself, or a length mismatch.
    RemoteError: the sender could not encode its list.
    ContentRefusedError: the list arrived in a serializer other than ``serializer``.

    Example::

        if rank == 1:
            box = [None, None]
            sender = recv_object_list(box, src=0)
    """
    if _not_in_group(group):
        _warn_not_in_group("recv_object_list")
        return -1
    peer = _global_rank(group, src, group_src, "src", default=None)
    accept = None if serializer is None else [registry.get(serializer).name]
    received = Communicator(group, device=device).recv(peer, accept=accept)
    _fill(object_list, received, "recv_object_list", f"sender (global rank {peer})")
    return peer


def _fill(object_list: List[Any], received: Any, op: str, who: str) -> None:
    if not isinstance(received, (list, tuple)):
        raise ValueError(f"{op}: the {who} sent a {type(received).__name__}, not a list; send it with objcomm.compat")
    if len(received) != len(object_list):
        raise ValueError(
            f"{op}: the {who} sent {len(received)} objects but this rank's object_list has {len(object_list)} "
            "slots; make the lists the same length on every rank"
        )
    for i, item in enumerate(received):
        object_list[i] = item


def _my_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _not_in_group(group: Any) -> bool:
    return group is not None and dist.is_available() and group == dist.GroupMember.NON_GROUP_MEMBER


def _warn_not_in_group(op: str) -> None:
    warnings.warn(
        f"Running {op} on global rank {_my_rank()} which does not belong to the given group.",
        UserWarning,
        stacklevel=3,
    )


def _global_rank(group: Any, rank: Optional[int], group_rank: Optional[int], what: str, default: Optional[int]) -> int:
    """The global rank meant by ``dst``/``src`` or by ``group_dst``/``group_src``, as torch resolves them."""
    if group_rank is not None:
        if rank is not None:
            raise ValueError(f"pass {what} (a global rank) or group_{what} (a rank in the group), not both")
        if not (dist.is_available() and dist.is_initialized()):
            return group_rank  # a group of one: its rank 0 is the only rank
        resolved: Any = group if group is not None else dist.group.WORLD
        return dist.get_global_rank(resolved, group_rank)
    if rank is None:
        if default is None:
            raise ValueError(f"pass {what} (a global rank) or group_{what} (a rank in the group)")
        return default
    return rank
