"""What ``objcomm.compat``'s shims and the names ``patch()`` puts in torch's place run: torch's six object
collectives on objcomm, taking objcomm's per-call settings, with their arguments checked as torch checks them.
"""

from __future__ import annotations

import functools
import pickle
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

from objcomm._api.call import source_keeps_its_own
from objcomm._api.communicator import Communicator
from objcomm._api.functions import all_gather, gather, scatter
from objcomm._errors import DecodeError, shown_ranks, with_original_type
from objcomm._settings import settings
from serializers import SerializerLike, registry

F = TypeVar("F", bound=Callable[..., Any])

Options = Mapping[str, Any]  # per-call settings handed to objcomm (serializer=, accept=, ...); None: not given


# -- the six, taking objcomm's per-call settings (the shims above and the patched names below) ----------


def _torch_types(shim: F) -> F:
    """``shim``, whose receivers' decoding failures are also instances of what unpickling raised (an
    ``AttributeError`` for a class the receiver lacks, as torch's object collectives raise it), so that code catching
    torch's exception keeps catching objcomm's :class:`~objcomm.DecodeError`; and which warns once where torch's
    pickling hooks were replaced (:func:`_hooks_replaced`)."""

    @functools.wraps(shim)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not _WARNED_OF_HOOKS and _hooks_replaced():
            _warn_of_hooks()
        try:
            return shim(*args, **kwargs)
        except DecodeError as exc:
            raise with_original_type(exc) from exc.__cause__

    return cast(F, call)


_WARNED_OF_HOOKS = False


def _hooks_replaced() -> bool:
    """Whether a program replaced ``torch.distributed.distributed_c10d._pickler`` or ``_unpickler``, through which
    torch's object collectives pickle (a Pickler with a ``reducer_override``, an Unpickler whose ``find_class`` maps
    classes: a reviewer's find, as Avalanche does), and which the shims do not use."""
    return getattr(_c10d, "_pickler", pickle.Pickler) is not pickle.Pickler or (
        getattr(_c10d, "_unpickler", pickle.Unpickler) is not pickle.Unpickler
    )


def _warn_of_hooks() -> None:
    global _WARNED_OF_HOOKS
    _WARNED_OF_HOOKS = True
    warnings.warn(
        "torch.distributed.distributed_c10d._pickler or _unpickler was replaced: torch's object collectives pickle "
        "through them, objcomm.compat's do not (they encode with objcomm's serializer, pickle by default), so what "
        "those classes change (a reducer_override, a find_class) does not happen here. Register a serializer that "
        "does it (serializers.register) and pass serializer=, or leave these calls to torch (docs/compat.md)",
        RuntimeWarning,
        stacklevel=4,  # the program's call (through objcomm.compat's function and this shim's wrapper)
    )


@_torch_types
def _all_gather_object(
    object_list: List[Any], obj: Any, group: Any = None, weights_only: bool = False, *, options: Options
) -> None:
    if _outside(group, "all_gather_object"):
        return None
    for i, item in enumerate(all_gather(obj, group=group, **_safe(options, weights_only))):
        object_list[i] = item
    return None


@_torch_types
def _gather_object(
    obj: Any,
    object_gather_list: Optional[List[Any]] = None,
    dst: Optional[int] = None,
    group: Any = None,
    group_dst: Optional[int] = None,
    weights_only: bool = False,
    *,
    options: Options,
) -> None:
    dst = _one_of(dst, group_dst, "dst", default=0)
    if _outside(group, "gather_object"):
        return None
    root = _global_rank(group, dst, group_dst, "dst")
    gathered = gather(obj, dst=root, group=group, **_safe(options, weights_only))
    if gathered is None:
        if object_gather_list:
            raise ValueError(
                _torch_says(
                    "Argument ``gather_list`` must NOT be specified on non-destination ranks.",
                    f"object_gather_list must be None on ranks other than the destination (global rank {root}); "
                    f"this is global rank {_my_rank()}",
                )
            )
        return None
    if not object_gather_list:
        raise ValueError(
            _torch_says(
                "Argument ``gather_list`` must be specified on destination rank.",
                f"the destination (global rank {root}) must pass object_gather_list, a list of {len(gathered)} "
                f"slot{'' if len(gathered) == 1 else 's'} (one a rank); "
                "the gathered objects were dropped. Reported after the collective, so no rank is left waiting",
            )
        )
    for i, item in enumerate(gathered):
        object_gather_list[i] = item
    return None


@_torch_types
def _broadcast_object_list(
    object_list: List[Any],
    src: Optional[int] = None,
    group: Any = None,
    device: Optional[torch.device] = None,
    group_src: Optional[int] = None,
    weights_only: bool = False,
    *,
    options: Options,
) -> None:
    src = _one_of(src, group_src, "src", default=0)
    if _outside(group, "broadcast_object_list"):
        return None
    root = _global_rank(group, src, group_src, "src")
    is_root = _my_rank() == root
    if is_root:  # its list is left as it was, as torch's; no copy decoded where none is refused (refuses_nothing)
        with source_keeps_its_own():
            Communicator(group, device=device).broadcast(list(object_list), root, **_safe(options, weights_only))
        return None
    received = Communicator(group, device=device).broadcast(None, root, **_safe(options, weights_only))
    _fill(object_list, received, "broadcast_object_list", f"source (global rank {root})")
    return None


@_torch_types
def _scatter_object_list(
    scatter_object_output_list: List[Any],
    scatter_object_input_list: Optional[List[Any]] = None,
    src: Optional[int] = None,
    group: Any = None,
    group_src: Optional[int] = None,
    weights_only: bool = False,
    *,
    options: Options,
) -> None:
    src = _one_of(src, group_src, "src", default=0)
    if _outside(group, "scatter_object_list"):
        return None
    root = _global_rank(group, src, group_src, "src")
    item, failure = None, None
    try:
        item = scatter(scatter_object_input_list, src=root, group=group, **_safe(options, weights_only))
    except Exception as exc:  # reported below, after what torch checks first
        failure = exc
    output = scatter_object_output_list
    if not isinstance(output, list) or not output:
        what = "is empty" if isinstance(output, list) else f"is a {type(output).__name__}"
        raise ValueError(
            _torch_says(
                "Expected argument scatter_object_output_list to be a list of size at least 1.",
                f"scatter_object_output_list {what}; pass a list of at least one element (e.g. [None]), whose "
                "element 0 receives this rank's object. The received object was dropped",
            )
        ) from failure
    if failure is not None:
        if _my_rank() == root and scatter_object_input_list is None:
            raise ValueError(
                _torch_says(
                    "source rank must provide non-None scatter_object_input_list",
                    f"this rank (global rank {root}) is the source; the other ranks raise RemoteError",
                )
            ) from failure
        raise failure
    output[0] = item
    return None


def _send_object_list(
    object_list: List[Any],
    dst: Optional[int] = None,
    group: Any = None,
    device: Optional[torch.device] = None,
    group_dst: Optional[int] = None,
    use_batch: bool = False,
    weights_only: bool = False,
    *,
    options: Options,
) -> None:
    dst = _one_of(dst, group_dst, "dst", default=None)
    if _outside(group, "send_object_list"):
        return None
    peer = _not_self(_global_rank(group, dst, group_dst, "dst"), "destination", "dst")
    Communicator(group, device=device).send(list(object_list), peer, **_safe(options, weights_only, receives=False))
    return None


@_torch_types
def _recv_object_list(
    object_list: List[Any],
    src: Optional[int] = None,
    group: Any = None,
    device: Optional[torch.device] = None,
    group_src: Optional[int] = None,
    use_batch: bool = False,
    weights_only: bool = False,
    *,
    options: Options,
) -> int:
    src = _one_of(src, group_src, "src", default=None)
    if _outside(group, "recv_object_list"):
        return -1
    peer = _not_self(_global_rank(group, src, group_src, "src"), "source", "src")
    received = Communicator(group, device=device).recv(peer, **_safe(options, weights_only, sends=False))
    _fill(object_list, received, "recv_object_list", f"sender (global rank {peer})")
    return peer


def _safe(options: Options, weights_only: bool, sends: bool = True, receives: bool = True) -> Options:
    """``options`` under torch's ``weights_only=True`` (safe types only, ``objcomm.compat``): where a sender names no
    serializer and the process-wide one is not safe, ``restricted-pickle``; where a receiver sets no ``accept``, the
    safe serializers among those the process-wide ``accept`` allows (never more than it allows)."""
    if not weights_only:
        return options
    safe = dict(options)
    defaults = settings()
    if sends and safe.get("serializer") is None and not getattr(registry.get(defaults.serializer), "safe", False):
        safe["serializer"] = "restricted-pickle"
    if receives and safe.get("accept") is None:
        allowed = defaults.accept
        safe["accept"] = [name for name in registry.available(safe=True) if allowed is None or name in allowed]
    return safe


def _only(serializer: Optional[SerializerLike]) -> Dict[str, Any]:
    """A receiver's ``serializer=``: the one serializer it accepts."""
    return {"accept": None if serializer is None else [registry.get(serializer).name]}


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
    return dist.get_rank() if _initialized() else 0


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _outside(group: Any, op: str) -> bool:
    """Whether this rank is outside ``group`` (torch's ``NON_GROUP_MEMBER``): then ``op`` does nothing here, and
    says so with torch's warning."""
    if group is None or not dist.is_available() or group != dist.GroupMember.NON_GROUP_MEMBER:
        return False
    warnings.warn(
        f"Running {op} on global rank {_my_rank()} which does not belong to the given group.",
        UserWarning,
        stacklevel=4,  # the caller of the shim (or of the patched torch name)
    )
    return True


# -- arguments, checked as torch checks them: torch's exception type, torch's sentence first ---------------


def _torch_says(sentence: str, explanation: str) -> str:
    return f"{sentence} (objcomm.compat: {explanation})"


def _one_of(rank: Optional[int], group_rank: Optional[int], what: str, default: Optional[int]) -> Optional[int]:
    """``rank``, or ``default`` when neither it nor ``group_rank`` is given; raise as torch does for both or neither."""
    if group_rank is not None:
        if rank is not None:
            raise ValueError(
                _torch_says(
                    "Can't specify both group_rank and global_rank",
                    f"pass {what} (a global rank) or group_{what} (a rank within group), not both",
                )
            )
        return None
    if rank is None:
        if default is None:
            raise ValueError(
                _torch_says(
                    "Must specify global_rank or group_rank",
                    f"pass {what} (a global rank) or group_{what} (a rank within group)",
                )
            )
        return default
    return rank


def _global_rank(group: Any, rank: Optional[int], group_rank: Optional[int], what: str) -> int:
    """The global rank meant by ``rank`` or ``group_rank`` (one of them given); torch's own lookups judge them."""
    if not _initialized():
        return group_rank if group_rank is not None else rank  # type: ignore[return-value]  # a group of one
    resolved: Any = group if group is not None else dist.group.WORLD
    if group_rank is not None:
        return dist.get_global_rank(resolved, group_rank)
    try:
        dist.get_group_rank(resolved, rank)  # type: ignore[arg-type]  # given when group_rank is not
    except ValueError as exc:
        raise ValueError(
            _torch_says(
                str(exc),
                f"{what} is a global rank; this group's are {shown_ranks(dist.get_process_group_ranks(resolved))}",
            )
        ) from exc
    return rank  # type: ignore[return-value]  # given when group_rank is not


def _not_self(peer: int, role: str, what: str) -> int:
    """``peer``, unless it is this rank (without a process group: rank 0 of a group of one), as torch refuses it."""
    if peer == (dist.get_rank() if _initialized() else 0):
        raise ValueError(
            _torch_says(
                f"Invalid {role} rank: {role} rank should not be the same as the rank of the current process.",
                f"{what} resolves to global rank {peer}, this rank itself",
            )
        )
    return peer
