"""The object API: encode, move frames, decode — with failures raised on every rank alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from serializers import SerializerLike, registry

from . import _framing, _transport
from ._device import resolve_device
from ._errors import CommunicationError, Failure, ObjcommError, RemoteError
from ._settings import check_positive, check_slot, normalize_accept, settings

Device = Union[str, torch.device, None]


@dataclass
class _Call:
    """Everything one call needs, resolved: serializer, limits, and the wire (None: single process)."""

    serializer: Any
    accept: Optional[frozenset]
    max_bytes: int
    wire: Optional[_transport.Wire]

    def encode(self, obj: Any) -> tuple[torch.Tensor, bool, Optional[BaseException]]:
        """``(frame, is_error, exception)``: a failure becomes an error frame that still travels."""
        try:
            return _framing.encode(obj, self.serializer, max_bytes=self.max_bytes), False, None
        except Exception as exc:
            limit = self.wire.inline_capacity if self.wire is not None else 1 << 16
            return _framing.error_frame(exc, limit), True, exc

    def failures(self, frames: Sequence[Optional[memoryview]]) -> Dict[int, Failure]:
        found = {}
        for rank, view in enumerate(frames):
            if view is not None:
                header = _framing.parse_header(view)
                if header.is_error:
                    found[rank] = _framing.read_error(view, header)
        return found

    def raise_failures(self, op: str, frames: Sequence[Optional[memoryview]], local: Optional[BaseException]) -> None:
        failures = self.failures(frames)
        if failures:
            raise RemoteError(op, failures) from local
        if local is not None:  # cannot happen: our own error frame is among the frames
            raise local

    def decode(self, view: Optional[memoryview], sender: int) -> Any:
        if view is None:
            raise CommunicationError(f"no frame arrived from rank {sender}")
        return _framing.decode(view, sender=sender, accept=self.accept)

    def roundtrip(self, obj: Any) -> Any:
        """What a group of one returns: the object encoded and decoded, so failures match."""
        frame = _framing.encode(obj, self.serializer, max_bytes=self.max_bytes)
        return self.decode(memoryview(frame.numpy()), 0)


class Communicator:
    """Object collectives over one process group, holding per-group defaults.

    Parameters
    ----------
    group:
        A ``torch.distributed`` process group; ``None`` is the default group.
    serializer:
        Registered name or serializer object used when a call names none (default ``"pickle"``).
    device:
        Where byte tensors live; default: the current CUDA device for NCCL, the CPU otherwise.
    accept:
        Serializer names this rank will decode; frames naming others raise ``ContentRefusedError``.
    max_bytes, slot_bytes, chunk_bytes:
        Size limits (see :class:`objcomm.Settings`); ``None`` uses the process-wide default.

    Example::

        comm = objcomm.Communicator(serializer="msgpack", accept=["msgpack"])
        everyone = comm.all_gather({"rank": rank, "loss": 0.25})
    """

    def __init__(
        self,
        group: Any = None,
        serializer: Optional[SerializerLike] = None,
        device: Device = None,
        *,
        accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
        slot_bytes: Optional[int] = None,
        chunk_bytes: Optional[int] = None,
    ) -> None:
        if serializer is not None:
            registry.get(serializer)  # fail now, not at the first call
        if max_bytes is not None:
            check_positive("max_bytes", max_bytes)
        if chunk_bytes is not None:
            check_positive("chunk_bytes", chunk_bytes)
        if slot_bytes is not None:
            check_slot(slot_bytes)
        self.group = group
        self.serializer = serializer
        self.device = device
        self.accept = normalize_accept(accept)
        self.max_bytes = max_bytes
        self.slot_bytes = slot_bytes
        self.chunk_bytes = chunk_bytes

    def __repr__(self) -> str:
        return f"Communicator(group={self.group!r}, serializer={self.serializer!r}, device={self.device!r})"

    # -- resolution ----------------------------------------------------------------------------
    def _call(
        self,
        serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
    ) -> _Call:
        defaults = settings()
        chosen = serializer if serializer is not None else self.serializer
        resolved_accept = normalize_accept(accept) if accept is not None else self.accept
        limit = max_bytes if max_bytes is not None else self.max_bytes or defaults.max_bytes
        if max_bytes is not None:
            check_positive("max_bytes", max_bytes)
        return _Call(
            serializer=registry.get(chosen, default=defaults.serializer),
            accept=resolved_accept if resolved_accept is not None else defaults.accept,
            max_bytes=limit,
            wire=self._wire(limit, defaults),
        )

    def _wire(self, max_bytes: int, defaults: Any) -> Optional[_transport.Wire]:
        if not (dist.is_available() and dist.is_initialized()):
            if self.group is not None:
                raise ObjcommError("a group was given but torch.distributed is not initialised; call init_process_group()")
            return None
        group = self.group if self.group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        if rank < 0:
            raise ObjcommError(
                f"this rank (global rank {dist.get_rank()}) is not a member of the group it was asked to use; "
                "only call objcomm with groups this rank belongs to"
            )
        return _transport.Wire(
            group=group,
            ranks=dist.get_process_group_ranks(group),
            rank=rank,
            device=resolve_device(dist.get_backend(group), group, self.device),
            slot=self.slot_bytes or defaults.slot_bytes,
            chunk=self.chunk_bytes or defaults.chunk_bytes,
            max_bytes=max_bytes,
        )

    @staticmethod
    def _group_rank(wire: _transport.Wire, global_rank: Any, what: str) -> int:
        if isinstance(global_rank, bool) or not isinstance(global_rank, int):
            raise TypeError(f"{what} must be an int rank, got {global_rank!r}")
        if global_rank not in wire.ranks:
            raise ValueError(f"{what}={global_rank} is not a rank of this group (its ranks: {list(wire.ranks)})")
        return list(wire.ranks).index(global_rank)

    # -- collectives ---------------------------------------------------------------------------
    def all_gather(
        self, obj: Any, *, serializer: Optional[SerializerLike] = None, accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
    ) -> List[Any]:
        """Every rank's object, on every rank, in group-rank order: ``[obj_0, ..., obj_{n-1}]``."""
        call = self._call(serializer, accept, max_bytes)
        if call.wire is None:
            return [call.roundtrip(obj)]
        frame, error, local = call.encode(obj)
        frames = _transport.all_gather(call.wire, frame, error)
        call.raise_failures("all_gather", frames, local)
        return [call.decode(view, r) for r, view in enumerate(frames)]

    def gather(
        self, obj: Any, dst: int = 0, *, serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None, max_bytes: Optional[int] = None,
    ) -> Optional[List[Any]]:
        """Every rank's object on global rank ``dst`` (a list in group-rank order); ``None`` elsewhere."""
        call = self._call(serializer, accept, max_bytes)
        if call.wire is None:
            self._check_single(dst, "dst")
            return [call.roundtrip(obj)]
        root = self._group_rank(call.wire, dst, "dst")
        frame, error, local = call.encode(obj)
        frames = _transport.gather(call.wire, frame, error, root)
        if frames is None:
            return None
        call.raise_failures("gather", frames, local)
        if call.wire.rank != root:
            return None
        return [call.decode(view, r) for r, view in enumerate(frames)]

    def broadcast(
        self, obj: Any = None, src: int = 0, *, serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None, max_bytes: Optional[int] = None,
    ) -> Any:
        """Global rank ``src``'s object, on every rank (``obj`` is ignored on the others)."""
        call = self._call(serializer, accept, max_bytes)
        if call.wire is None:
            self._check_single(src, "src")
            return call.roundtrip(obj)
        root = self._group_rank(call.wire, src, "src")
        frame, error, local = call.encode(obj) if call.wire.rank == root else (None, False, None)
        view = _transport.broadcast(call.wire, frame, error, root)
        call.raise_failures("broadcast", _only(root, view, call.wire.size), local)
        return call.decode(view, root)

    def scatter(
        self, objs: Optional[Sequence[Any]] = None, src: int = 0, *, serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None, max_bytes: Optional[int] = None,
    ) -> Any:
        """Element ``r`` of ``objs`` (given on global rank ``src``, one per group rank) on group rank ``r``."""
        call = self._call(serializer, accept, max_bytes)
        if call.wire is None:
            self._check_single(src, "src")
            return call.roundtrip(_scatter_items(objs, 1)[0])
        wire = call.wire
        root = self._group_rank(wire, src, "src")
        frames: Optional[List[torch.Tensor]] = None
        error, local = False, None
        if wire.rank == root:
            try:
                frames = [_framing.encode(o, call.serializer, max_bytes=call.max_bytes) for o in _scatter_items(objs, wire.size)]
            except Exception as exc:
                error, local = True, exc
                frames = [_framing.error_frame(exc, wire.inline_capacity)] * wire.size
        view = _transport.scatter(wire, frames, error, root)
        call.raise_failures("scatter", _only(root, view, wire.size), local)
        return call.decode(view, root)

    def send(self, obj: Any, dst: int, *, serializer: Optional[SerializerLike] = None, max_bytes: Optional[int] = None) -> None:
        """Send ``obj`` to global rank ``dst``, which calls :meth:`recv`.

        If encoding fails, the receiver gets the error report (and raises ``RemoteError``) and this
        rank raises the original ``EncodeError``: nobody is left waiting.
        """
        call = self._call(serializer, None, max_bytes)
        wire = self._require_group(call, "send")
        peer = self._group_rank(wire, dst, "dst")
        if peer == wire.rank:
            raise ValueError(f"send(dst={dst}) is this rank itself; send to another rank")
        frame, error, local = call.encode(obj)
        _transport.send(wire, frame, error, peer)
        if local is not None:
            raise local

    def recv(self, src: Optional[int] = None, *, accept: Optional[Collection[str]] = None, max_bytes: Optional[int] = None) -> Any:
        """Receive the object global rank ``src`` sends; ``src=None`` takes it from any rank (gloo only)."""
        call = self._call(None, accept, max_bytes)
        wire = self._require_group(call, "recv")
        peer = None if src is None else self._group_rank(wire, src, "src")
        if peer == wire.rank:
            raise ValueError(f"recv(src={src}) is this rank itself; receive from another rank")
        if peer is None and wire.device.type != "cpu":
            raise ValueError(
                f"recv(src=None) needs a backend that can receive from any rank (gloo); this group moves bytes on "
                f"{wire.device} — pass the sender's rank as src"
            )
        sender, view, is_error = _transport.recv(wire, peer)
        if is_error:
            call.raise_failures("send/recv", _only(sender, view, wire.size), None)
        return call.decode(view, sender)

    @staticmethod
    def _require_group(call: _Call, op: str) -> _transport.Wire:
        if call.wire is None:
            raise ObjcommError(f"{op} needs an initialised process group with another rank; call init_process_group()")
        return call.wire

    @staticmethod
    def _check_single(rank: Any, what: str) -> None:
        if rank != 0:
            raise ValueError(f"{what}={rank}, but there is no process group: the only rank is 0")


def _only(rank: int, view: memoryview, size: int) -> List[Optional[memoryview]]:
    frames: List[Optional[memoryview]] = [None] * size
    frames[rank] = view
    return frames


def _scatter_items(objs: Optional[Sequence[Any]], size: int) -> Sequence[Any]:
    if objs is None or isinstance(objs, (str, bytes)) or not hasattr(objs, "__len__"):
        raise TypeError(f"scatter needs a sequence of {size} objects on the source rank, got {type(objs).__name__}")
    if len(objs) != size:
        raise ValueError(f"scatter needs exactly one object per rank: got {len(objs)} for a group of {size}")
    return objs
