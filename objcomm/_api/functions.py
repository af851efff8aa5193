"""Module-level object collectives: each one a :class:`Communicator` call with per-call settings (the point-to-point
calls: :mod:`objcomm._api.p2p_functions`).

The signatures are spelled out (they mirror torch and help IDEs); each body hands its per-call
options on in one line, ``**call_kwargs(locals())`` (see :mod:`objcomm._settings`). Each function
answers mpi4py's keywords (``dest=``, ``root=``) with what to write instead
(:func:`objcomm._api.mpi4py_names.mpi4py_keywords`), and :func:`no_attribute` mpi4py's names (``objcomm.bcast``).
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Optional, Sequence, Union

import torch

from objcomm._api.communicator import Communicator
from objcomm._api.mpi4py_names import mpi4py_keywords
from objcomm._api.mpi4py_names import no_attribute as _no_attribute
from objcomm._settings import call_kwargs
from serializers import SerializerLike

Device = Optional[Union[str, torch.device]]

# What a call with group=None goes through: a Communicator that holds no settings of its own (and is
# never changed), so building one per call would only cost time.
_DEFAULT = Communicator()


def communicator_of(group: Any) -> Communicator:
    """The Communicator a module-level call on ``group`` goes through (also :mod:`objcomm._api.p2p_functions`)."""
    return _DEFAULT if group is None else Communicator(group)


def no_attribute(name: str) -> AttributeError:
    """What ``objcomm.<name>`` raises for a name objcomm lacks: for mpi4py's (``bcast``, ``allreduce``, ``SUM``, ...,
    :data:`objcomm._api.mpi4py_names.MPI4PY_NAMES`), one that says what to write instead."""
    return _no_attribute("module 'objcomm'", "objcomm", name)


@mpi4py_keywords
def all_gather(
    obj: Any,
    *,
    group: Any = None,
    serializer: Optional[SerializerLike] = None,
    accept: Optional[Collection[str]] = None,
    max_bytes: Optional[int] = None,
    map_location: Device = None,
    compression: Optional[str] = None,
    async_op: bool = False,
) -> Any:
    """Gather one object from every rank onto every rank.

    Parameters
    ----------
    obj: this rank's object.
    group: process group (default: the default group).
    serializer: registered name or serializer object (default ``"pickle"``); ranks may differ.
    accept: serializer names this rank agrees to decode (default: all registered).
    max_bytes: largest payload (frame plus tensors) sent or accepted.
    map_location: where received tensors go (default: the transport device, never the sender's).
    compression: ``None``, ``"zstd"``, ``"lz4"`` or ``"auto"`` for what this rank sends.
    async_op: return a :class:`Request` at once; its ``wait()`` returns (or raises) what this call would.
        Every collective takes it (see the README's "Non-blocking calls").

    Returns
    -------
    ``[obj_0, ..., obj_{n-1}]`` in group-rank order. Without a process group: ``[obj]``.

    Raises
    ------
    RemoteError: on every rank, when any rank failed to encode (``.failures`` says who and why).
    ContentRefusedError, DecodeError: on a rank that cannot or will not decode what arrived.

    Example::

        merged = {}
        for part in objcomm.all_gather({rank: 1} if rank % 2 == 0 else {}):
            merged.update(part)
    """
    return communicator_of(group).all_gather(obj, async_op=async_op, **call_kwargs(locals()))


@mpi4py_keywords
def gather(
    obj: Any,
    dst: int = 0,
    *,
    group: Any = None,
    serializer: Optional[SerializerLike] = None,
    accept: Optional[Collection[str]] = None,
    max_bytes: Optional[int] = None,
    map_location: Device = None,
    compression: Optional[str] = None,
    async_op: bool = False,
) -> Any:
    """Gather one object from every rank onto global rank ``dst``; other ranks get ``None``.

    Example::

        everyone = objcomm.gather(predictions, dst=0)   # a list on rank 0, None elsewhere
    """
    return communicator_of(group).gather(obj, dst, async_op=async_op, **call_kwargs(locals()))


@mpi4py_keywords
def broadcast(
    obj: Any = None,
    src: int = 0,
    *,
    group: Any = None,
    serializer: Optional[SerializerLike] = None,
    accept: Optional[Collection[str]] = None,
    max_bytes: Optional[int] = None,
    map_location: Device = None,
    compression: Optional[str] = None,
    async_op: bool = False,
) -> Any:
    """Send global rank ``src``'s object to every rank and return it there.

    Example::

        config = objcomm.broadcast(load_config() if rank == 0 else None, src=0)
    """
    return communicator_of(group).broadcast(obj, src, async_op=async_op, **call_kwargs(locals()))


@mpi4py_keywords
def scatter(
    objs: Optional[Sequence[Any]] = None,
    src: int = 0,
    *,
    group: Any = None,
    serializer: Optional[SerializerLike] = None,
    accept: Optional[Collection[str]] = None,
    max_bytes: Optional[int] = None,
    map_location: Device = None,
    compression: Optional[str] = None,
    async_op: bool = False,
) -> Any:
    """Give group rank ``r`` element ``r`` of ``objs``, a sequence given on global rank ``src``.

    Example::

        shard = objcomm.scatter(split(work, world_size) if rank == 0 else None, src=0)
    """
    return communicator_of(group).scatter(objs, src, async_op=async_op, **call_kwargs(locals()))


@mpi4py_keywords
def all_to_all(
    objs: Sequence[Any],
    *,
    group: Any = None,
    serializer: Optional[SerializerLike] = None,
    accept: Optional[Collection[str]] = None,
    max_bytes: Optional[int] = None,
    map_location: Device = None,
    compression: Optional[str] = None,
    async_op: bool = False,
) -> Any:
    """Send ``objs[j]`` to group rank ``j``, for every ``j``; return what every rank sent this one.

    ``objs`` holds one object per group rank (each rank its own list; sizes may differ freely per
    pair). Element ``i`` of the result came from group rank ``i``. Small parts finish in one
    collective; big ones move at their exact sizes; tensors inside travel as tensors.

    Raises
    ------
    RemoteError: on every rank, when any rank failed to encode or gave a list of the wrong length
    (on that rank, from the original error).

    Example::

        # route each record to the rank that owns its key
        outbox = [[] for _ in range(world_size)]
        for record in records:
            outbox[hash(record["key"]) % world_size].append(record)
        mine = [r for part in objcomm.all_to_all(outbox) for r in part]
    """
    return communicator_of(group).all_to_all(objs, async_op=async_op, **call_kwargs(locals()))


@mpi4py_keywords
def reduce(
    obj: Any,
    op: Union[str, Callable[[Any, Any], Any]],
    dst: int = 0,
    *,
    group: Any = None,
    serializer: Optional[SerializerLike] = None,
    accept: Optional[Collection[str]] = None,
    max_bytes: Optional[int] = None,
    map_location: Device = None,
    compression: Optional[str] = None,
    async_op: bool = False,
) -> Any:
    """Combine every rank's object with ``op`` on global rank ``dst``; other ranks get ``None``.

    ``op(a, b) -> c`` is any associative function (it need not be commutative: objects are
    combined in group-rank order, ``op(op(obj_0, obj_1), obj_2)...``), or a name: ``"sum"``,
    ``"prod"``, ``"min"``, ``"max"``, ``"merge"`` (dict union, a later rank wins) or
    ``"merge_sum"`` (dicts of counts: values of the same key added), in any case (``"SUM"``). A binomial tree: ⌈log2 W⌉
    rounds, and no rank decodes more than ⌈log2 W⌉ objects. Group rank 0 returns what ``op``
    returned itself; the others get it through the serializer.

    Raises
    ------
    RemoteError: on every rank, when ``op``, encoding or decoding failed on any rank.

    Example::

        confusion = objcomm.reduce(local_counts, "merge_sum", dst=0)  # {(label, pred): n} on rank 0
        best = objcomm.reduce(record, lambda a, b: b if b["score"] > a["score"] else a)
    """
    return communicator_of(group).reduce(obj, op, dst, async_op=async_op, **call_kwargs(locals()))


@mpi4py_keywords
def all_reduce(
    obj: Any,
    op: Union[str, Callable[[Any, Any], Any]],
    *,
    group: Any = None,
    serializer: Optional[SerializerLike] = None,
    accept: Optional[Collection[str]] = None,
    max_bytes: Optional[int] = None,
    map_location: Device = None,
    compression: Optional[str] = None,
    async_op: bool = False,
) -> Any:
    """Combine every rank's object with ``op`` (see :func:`reduce`) and return the result on every rank.

    The tree of :func:`reduce` towards group rank 0, then group rank 0's result back to every rank (down the same
    tree, or in a broadcast), so that all ranks return the same result or raise the same error.

    Example::

        totals = objcomm.all_reduce({"seen": n_seen, "correct": n_correct}, "merge_sum")
    """
    return communicator_of(group).all_reduce(obj, op, async_op=async_op, **call_kwargs(locals()))


@mpi4py_keywords
def scan(
    obj: Any,
    op: Union[str, Callable[[Any, Any], Any]],
    *,
    group: Any = None,
    serializer: Optional[SerializerLike] = None,
    accept: Optional[Collection[str]] = None,
    max_bytes: Optional[int] = None,
    map_location: Device = None,
    compression: Optional[str] = None,
    async_op: bool = False,
) -> Any:
    """On group rank ``r``, the objects of group ranks ``0 .. r`` combined with ``op`` (see :func:`reduce`), in
    group-rank order, as mpi4py's ``comm.scan``. ceil(log2 W) steps of send/recv at doubling distances, then one vote,
    so that every rank returns or every rank raises the same error.

    Example::

        seen_so_far = objcomm.scan(len(my_records), "sum")   # rank r: the records of ranks 0 .. r
    """
    return communicator_of(group).scan(obj, op, async_op=async_op, **call_kwargs(locals()))


@mpi4py_keywords
def exscan(
    obj: Any,
    op: Union[str, Callable[[Any, Any], Any]],
    *,
    group: Any = None,
    serializer: Optional[SerializerLike] = None,
    accept: Optional[Collection[str]] = None,
    max_bytes: Optional[int] = None,
    map_location: Device = None,
    compression: Optional[str] = None,
    async_op: bool = False,
) -> Any:
    """On group rank ``r``, the objects of group ranks ``0 .. r - 1`` combined with ``op`` (see :func:`reduce`);
    ``None`` on group rank 0, as mpi4py's ``comm.exscan``. The steps of :func:`scan`.

    Example::

        start = objcomm.exscan(len(my_records), "sum") or 0   # where this rank's records begin in the whole
    """
    return communicator_of(group).exscan(obj, op, async_op=async_op, **call_kwargs(locals()))
