"""Drop-in replacements for ``torch.distributed``'s object collectives, built on objcomm.

Two ways in. Swap the import::

    # from torch.distributed import all_gather_object, broadcast_object_list
    from objcomm.compat import all_gather_object, broadcast_object_list

or leave the program as it is and route torch's own names through objcomm, for the whole process
or for a block (:func:`patch`, :func:`unpatch`)::

    objcomm.compat.patch()                      # dist.all_gather_object(...) now runs here
    with objcomm.compat.patch(serializer="msgpack", accept=["msgpack"]):
        dist.all_gather_object(out, metrics)

Each function has the signature of its torch 2.14 namesake (argument names, order and defaults,
``group_dst``/``group_src`` and ``weights_only`` included, whichever torch >= 2.2 is installed), fills the caller's
list in place as torch does, and returns what torch returns. ``dst``/``src`` are global ranks,
``group_dst``/``group_src`` ranks within ``group``, exactly as in torch. A keyword-only
``serializer=`` picks how this rank encodes; the default is objcomm's default, ``"pickle"``, which
is what torch uses. Bad arguments raise torch's exception type with torch's sentence first, then
objcomm's explanation.

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
- ``weights_only`` (torch 2.14: ``torch.save``, then ``torch.load(weights_only=True)``, safe types only) is taken
  on every torch: ``True`` sends in ``"restricted-pickle"`` where no ``serializer=`` is given and the process-wide
  one is not safe (tensors, numpy arrays, containers and plain types; no code runs on decode), and receivers accept
  only the safe serializers among those the process-wide ``accept`` allows, where no ``accept`` is set (a
  ``patch(accept=...)`` or a receiver's ``serializer=`` stays in force). A sender that sends
  pickle anyway makes the receivers raise :class:`objcomm.ContentRefusedError`. Every rank must pass the same value,
  as in torch.
- Without an initialised process group, the collectives act as a group of one (as all of objcomm
  does); torch raises.
- Bytes travel in objcomm's frame format: both ends of a ``send_object_list``/``recv_object_list``
  pair must use objcomm (``objcomm.send``/``objcomm.recv`` interoperate with these shims).

``__all__`` names the six drop-in functions only, so that ``from objcomm.compat import *`` replaces
exactly torch's names (and no ``patch`` shadows ``unittest.mock.patch``); :func:`patch` and
:func:`unpatch` are public all the same.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Collection, Dict, List, Optional, Type

import torch

from objcomm._api.compat_calls import (
    Options,
    _all_gather_object,
    _broadcast_object_list,
    _gather_object,
    _only,
    _recv_object_list,
    _scatter_object_list,
    _send_object_list,
)
from objcomm._api.compat_patch import _TAKES, _Patcher
from objcomm._api.functions import Device
from objcomm._settings import CALL_KNOBS, given
from serializers import SerializerLike

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
]


def all_gather_object(
    object_list: List[Any],
    obj: Any,
    group: Any = None,
    weights_only: bool = False,
    *,
    serializer: Optional[SerializerLike] = None,
) -> None:
    """Gather ``obj`` from every rank of ``group`` into ``object_list`` (in place), like torch's.

    Parameters
    ----------
    object_list: filled with one object per group rank, in group-rank order; at least that long.
    obj: this rank's object.
    group: process group (default: the default group).
    weights_only: as torch's (2.14): ``True`` makes the objects travel safely, in ``"restricted-pickle"``
        where no ``serializer`` is given, and receivers accept only safe serializers (see the module docstring).
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
    return _all_gather_object(object_list, obj, group, weights_only, options={"serializer": serializer})


def gather_object(
    obj: Any,
    object_gather_list: Optional[List[Any]] = None,
    dst: Optional[int] = None,
    group: Any = None,
    group_dst: Optional[int] = None,
    weights_only: bool = False,
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
    weights_only: as torch's (2.14): ``True`` makes the objects travel safely, in ``"restricted-pickle"``
        where no ``serializer`` is given, and receivers accept only safe serializers (see the module docstring).
    serializer: how this rank encodes ``obj`` (default ``"pickle"``).

    Returns
    -------
    ``None``; the destination's ``object_gather_list`` holds the objects in group-rank order.

    Raises
    ------
    ValueError: a list missing on the destination or given elsewhere (after the collective), both
        ``dst`` and ``group_dst``, or a ``dst`` outside ``group`` (torch's sentences first).
    RemoteError: on every rank, when any rank could not encode its object.

    Example::

        output = [None] * dist.get_world_size() if rank == 0 else None
        gather_object(predictions, output, dst=0)
    """
    return _gather_object(
        obj, object_gather_list, dst, group, group_dst, weights_only, options={"serializer": serializer}
    )


def broadcast_object_list(
    object_list: List[Any],
    src: Optional[int] = None,
    group: Any = None,
    device: Optional[torch.device] = None,
    group_src: Optional[int] = None,
    weights_only: bool = False,
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
    weights_only: as torch's (2.14): ``True`` makes the objects travel safely, in ``"restricted-pickle"``
        where no ``serializer`` is given, and receivers accept only safe serializers (see the module docstring).
    serializer: how the source encodes the list (default ``"pickle"``).

    Returns
    -------
    ``None``.

    Raises
    ------
    ValueError: a receiving list whose length differs from the source's (after the collective), both
        ``src`` and ``group_src``, or a ``src`` outside ``group`` (torch's sentences first).
    RemoteError: on every rank, when the source could not encode its list.

    Example::

        config = [load_config() if rank == 0 else None]
        broadcast_object_list(config, src=0)
    """
    return _broadcast_object_list(
        object_list, src, group, device, group_src, weights_only, options={"serializer": serializer}
    )


def scatter_object_list(
    scatter_object_output_list: List[Any],
    scatter_object_input_list: Optional[List[Any]] = None,
    src: Optional[int] = None,
    group: Any = None,
    group_src: Optional[int] = None,
    weights_only: bool = False,
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
    weights_only: as torch's (2.14): ``True`` makes the objects travel safely, in ``"restricted-pickle"``
        where no ``serializer`` is given, and receivers accept only safe serializers (see the module docstring).
    serializer: how the source encodes the objects (default ``"pickle"``).

    Returns
    -------
    ``None``.

    Raises
    ------
    ValueError: an output list that is not a non-empty list, no input list on the source (both after
        the collective), both ``src`` and ``group_src``, or a ``src`` outside ``group`` (torch's
        sentences first).
    RemoteError: on every rank, when the source's input is unusable (other ranks than the source)
        or could not be encoded.

    Example::

        out = [None]
        scatter_object_list(out, [{"shard": r} for r in range(world)] if rank == 0 else None, src=0)
    """
    return _scatter_object_list(
        scatter_object_output_list,
        scatter_object_input_list,
        src,
        group,
        group_src,
        weights_only,
        options={"serializer": serializer},
    )


def send_object_list(
    object_list: List[Any],
    dst: Optional[int] = None,
    group: Any = None,
    device: Optional[torch.device] = None,
    group_dst: Optional[int] = None,
    use_batch: bool = False,
    weights_only: bool = False,
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
    weights_only: as torch's (2.14): ``True`` makes the objects travel safely, in ``"restricted-pickle"``
        where no ``serializer`` is given, and receivers accept only safe serializers (see the module docstring).
    serializer: how this rank encodes the list (default ``"pickle"``).

    Returns
    -------
    ``None``.

    Raises
    ------
    ValueError: no destination, both ``dst`` and ``group_dst``, this rank itself, or a ``dst`` outside
        ``group`` (torch's sentences first).
    EncodeError: the list could not be encoded (the receiver raises ``RemoteError``, so it is not left waiting).

    Example::

        if rank == 0:
            send_object_list([{"step": 10}, "done"], dst=1)
    """
    return _send_object_list(
        object_list, dst, group, device, group_dst, use_batch, weights_only, options={"serializer": serializer}
    )


def recv_object_list(
    object_list: List[Any],
    src: Optional[int] = None,
    group: Any = None,
    device: Optional[torch.device] = None,
    group_src: Optional[int] = None,
    use_batch: bool = False,
    weights_only: bool = False,
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
    weights_only: as torch's (2.14): ``True`` makes the objects travel safely, in ``"restricted-pickle"``
        where no ``serializer`` is given, and receivers accept only safe serializers (see the module docstring).
    serializer: the one serializer this rank accepts for the incoming list (default: any the
        process-wide ``accept`` setting allows). ``serializer="msgpack"`` makes sure no pickle is
        ever decoded here.

    Returns
    -------
    The sender's global rank; ``-1`` on a rank outside ``group`` (with a warning).

    Raises
    ------
    ValueError: no source, both ``src`` and ``group_src``, this rank itself, a ``src`` outside ``group``
        (torch's sentences first), or a length mismatch.
    RemoteError: the sender could not encode its list.
    ContentRefusedError: the list arrived in a serializer other than ``serializer``.

    Example::

        if rank == 1:
            box = [None, None]
            sender = recv_object_list(box, src=0)
    """
    return _recv_object_list(
        object_list, src, group, device, group_src, use_batch, weights_only, options=_only(serializer)
    )


# -- patch(): torch.distributed's own names, through objcomm (objcomm._api.compat_patch) -----------------

_PATCHER = _Patcher({name: globals()[name] for name in __all__})


class _Patch:
    """What :func:`patch` returns: the patch is in force already; as a context manager, leaving puts back what
    was in force before it (torch's functions, or the settings of the patch before)."""

    layer: Any  # its place among the patches in force (objcomm._api.compat_patch._Patcher)

    def __init__(self, settings: Dict[str, Options]) -> None:
        _PATCHER.begin(self, settings)

    def __enter__(self) -> _Patch:
        _PATCHER.enter(self)
        return self

    def __exit__(
        self, kind: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        _PATCHER.leave(self)


def patch(
    *,
    serializer: Optional[SerializerLike] = None,
    accept: Optional[Collection[str]] = None,
    max_bytes: Optional[int] = None,
    map_location: Device = None,
    compression: Optional[str] = None,
) -> _Patch:
    """Make ``torch.distributed``'s six object functions run through objcomm, with these settings.

    Replaces ``all_gather_object``, ``gather_object``, ``broadcast_object_list``,
    ``scatter_object_list``, ``send_object_list`` and ``recv_object_list`` on ``torch.distributed``
    and ``torch.distributed.distributed_c10d`` by the shims of this module, so code that looks them
    up when it calls (``dist.all_gather_object(...)``) goes through objcomm unchanged. A module that
    bound one earlier (``from torch.distributed import all_gather_object``) keeps torch's: patch
    before importing it. Patching again only changes the settings; :func:`unpatch` puts torch's
    exact functions back. The patch is process-wide, for every thread.

    Parameters
    ----------
    serializer: how this rank encodes (default ``"pickle"``, as torch).
    accept: serializer names this rank decodes (default: every registered one).
    max_bytes: largest payload sent or accepted.
    map_location: where received tensors go (default: the transport device, never the sender's).
    compression: ``None``, ``"zstd"``, ``"lz4"`` or ``"auto"`` for what this rank sends.
    A setting not given follows :func:`objcomm.configure`, then the environment, then the default.

    Returns
    -------
    A context manager: the patch is in force already, and leaving the ``with`` block puts back what
    was in force before it (torch's functions, or an outer patch's settings).

    Raises
    ------
    UnknownSerializerError, ValueError, TypeError: a setting is not valid (nothing is patched).

    Example::

        objcomm.compat.patch()                    # once, before importing the libraries that call them
        with objcomm.compat.patch(serializer="msgpack", accept=["msgpack"]):
            dist.all_gather_object(out, metrics)  # objcomm, msgpack only
    """
    checked = given(
        serializer=serializer, accept=accept, max_bytes=max_bytes, map_location=map_location, compression=compression
    )
    settings: Dict[str, Options] = {
        name: {knob: checked[knob] for knob in _TAKES.get(name, CALL_KNOBS) if knob in checked} for name in __all__
    }
    return _Patch(settings)


def unpatch() -> None:
    """Put ``torch.distributed``'s own six object functions back (nothing happens when none is patched).

    Restores the exact objects :func:`patch` replaced, on ``torch.distributed`` and
    ``torch.distributed.distributed_c10d``, whatever patches and ``with`` blocks came before.
    """
    _PATCHER.unpatch()
