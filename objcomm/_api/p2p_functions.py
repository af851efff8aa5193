"""Module-level point-to-point calls (send, recv, sendrecv, isend, irecv) and ``connect``: each one a
:class:`Communicator` call with per-call settings, as :mod:`objcomm._api.functions`' collectives are."""

from __future__ import annotations

from typing import Any, Collection, Optional

from objcomm._api.functions import Device, communicator_of
from objcomm._api.handles import Request
from objcomm._api.mpi4py_names import mpi4py_keywords
from objcomm._settings import call_kwargs
from serializers import SerializerLike


@mpi4py_keywords
def send(
    obj: Any,
    dst: int,
    tag: int = 0,
    *,
    group: Any = None,
    serializer: Optional[SerializerLike] = None,
    max_bytes: Optional[int] = None,
    compression: Optional[str] = None,
) -> None:
    """Send one object to global rank ``dst``, which must call :func:`recv` with the same ``tag``.

    Messages with different tags between the same two ranks never mix (gloo; on NCCL only
    ``tag=0`` is accepted, since NCCL ignores tags). A small object (one whose frame fits the slot,
    without tensors out of band) is sent eagerly, wherever the ranks run: this returns before
    ``dst`` receives it, as MPI's eager sends do, with a bounded amount of such sends waiting per
    group (see ``docs/non-blocking.md``); so is a medium one on a CPU group (up to ~60 KiB past the
    slot, in one message with it); a larger one returns once ``dst`` took it. On NCCL a send
    that goes through the backend (across hosts, or with ``local`` off) still waits for its receiver.
    ``dst`` may be this rank itself, as in mpi4py (and is, without a process group): the message waits,
    encoded, until this rank receives it, and this returns at once (see ``docs/from-mpi4py.md``).

    Example::

        if rank == 1:
            objcomm.send({"done": True}, dst=0)
            objcomm.send(["log line"], dst=0, tag=7)  # a second stream
    """
    communicator_of(group).send(obj, dst, tag, **call_kwargs(locals()))


@mpi4py_keywords
def recv(
    src: Optional[int] = None,
    tag: int = 0,
    *,
    group: Any = None,
    accept: Optional[Collection[str]] = None,
    max_bytes: Optional[int] = None,
    map_location: Device = None,
    return_sender: bool = False,
) -> Any:
    """Receive one object from global rank ``src`` (``None``: whichever rank sends first; gloo only)
    sent with ``tag``.

    ``return_sender=True`` returns ``(sender's global rank, object)``: the way to learn who sent
    it when ``src=None``. From this rank itself (``src`` its rank; without a process group, or with
    ``src=None`` in a group of one), it takes the oldest message this rank sent itself under ``tag``,
    or raises ``ObjcommError`` at once if there is none, since none could arrive while it blocks
    (:func:`irecv` waits for another thread's); ``src=None`` takes such a message, where one waits,
    before it waits for other ranks.

    Example::

        if rank == 0:
            status = objcomm.recv(src=1)
            lines = objcomm.recv(src=1, tag=7)
            sender, item = objcomm.recv(return_sender=True)  # from whichever rank sends first
    """
    return communicator_of(group).recv(src, tag, return_sender=return_sender, **call_kwargs(locals()))


@mpi4py_keywords
def sendrecv(
    obj: Any,
    dst: int,
    *,
    src: Optional[int] = None,
    sendtag: int = 0,
    recvtag: Optional[int] = None,
    group: Any = None,
    serializer: Optional[SerializerLike] = None,
    accept: Optional[Collection[str]] = None,
    max_bytes: Optional[int] = None,
    map_location: Device = None,
    compression: Optional[str] = None,
    return_sender: bool = False,
) -> Any:
    """Send ``obj`` to global rank ``dst`` and receive from global rank ``src`` at once (``recvtag``: ``sendtag``
    unless given; ``src=None``: any rank, gloo only), as mpi4py's ``comm.sendrecv``: ranks that each send to one
    rank and receive from another need no order among them. See :meth:`objcomm.Communicator.sendrecv`.

    Example::

        rank, world = dist.get_rank(), dist.get_world_size()
        from_left = objcomm.sendrecv(my_block, dst=(rank + 1) % world, src=(rank - 1) % world)   # a ring's shift
    """
    return communicator_of(group).sendrecv(
        obj, dst, src=src, sendtag=sendtag, recvtag=recvtag, return_sender=return_sender, **call_kwargs(locals())
    )


@mpi4py_keywords
def isend(
    obj: Any,
    dst: int,
    tag: int = 0,
    *,
    group: Any = None,
    serializer: Optional[SerializerLike] = None,
    max_bytes: Optional[int] = None,
    compression: Optional[str] = None,
) -> Request:
    """Start sending one object to global rank ``dst`` and return a :class:`Request` at once.

    ``wait()`` returns ``None`` once sent, or raises what :func:`send` would. Sends to the same rank
    with the same tag leave in issue order. ``obj`` is encoded here and what shares memory
    with it (tensors, numpy arrays, buffers) is copied, so it may change as soon as this returns; a
    bad ``dst`` or ``tag`` raises here, as :func:`send` does. To this rank itself the message is
    delivered here and the handle comes back completed.

    Example::

        pending = [objcomm.isend({"step": step}, dst=0, tag=1) for step in range(3)]
        for request in pending:
            request.wait()
    """
    return communicator_of(group).isend(obj, dst, tag, **call_kwargs(locals()))


@mpi4py_keywords
def irecv(
    src: Optional[int] = None,
    tag: int = 0,
    *,
    group: Any = None,
    accept: Optional[Collection[str]] = None,
    max_bytes: Optional[int] = None,
    map_location: Device = None,
    return_sender: bool = False,
) -> Request:
    """Start receiving one object from global rank ``src`` sent with ``tag``; return a :class:`Request` at once.

    ``wait()`` returns the object (``(sender, object)`` with ``return_sender=True``), or raises what
    :func:`recv` would. Receives from the same rank with the same tag complete in issue order. From
    this rank itself, it completes at the send to this rank under ``tag`` that delivers its message
    (or at once, if one waits): the way to wait for another thread's send to this rank.

    Example::

        first, second = objcomm.irecv(src=1, tag=1), objcomm.irecv(src=1, tag=1)
        assert first.wait()["step"] == 0 and second.wait()["step"] == 1
    """
    return communicator_of(group).irecv(src, tag, return_sender=return_sender, **call_kwargs(locals()))


def connect(group: Any = None) -> bool:
    """Open ``group``'s same-host channel now, with send/recv on it (a collective: every rank of the group calls
    it); whether send/recv now take it, alike on every rank. For programs whose first calls are send/recv: they
    otherwise take the channel after their first few messages. See :meth:`Communicator.connect`.

    Example::

        dist.init_process_group("gloo")
        objcomm.connect()
        objcomm.send({"step": 0}, dst=1)   # the same-host channel from the first message
    """
    return communicator_of(group).connect()
