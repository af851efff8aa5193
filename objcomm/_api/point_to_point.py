""":class:`Communicator`'s point-to-point calls: ``send``, ``recv``, their non-blocking ``isend`` / ``irecv``
(:mod:`objcomm._api.requests`), and ``sendrecv``, both at once as mpi4py's ``comm.sendrecv``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Collection, Optional, Tuple

import torch.distributed as dist

from objcomm._api import requests as _requests
from objcomm._api.call import Device
from objcomm._api.express import NOT_TAKEN, Express
from objcomm._api.handles import Request
from objcomm._api.mpi4py_names import mpi4py_keywords
from objcomm._api.operations import Operations
from objcomm._api.own_box import own_waiting
from objcomm._errors import CommunicationError
from objcomm._settings import call_kwargs
from objcomm._transport import call_words
from serializers import SerializerLike


class PointToPoint(Operations):
    """The point-to-point calls of :class:`~objcomm.Communicator` (see there for its settings)."""

    @mpi4py_keywords
    def send(
        self,
        obj: Any,
        dst: int,
        tag: int = 0,
        *,
        serializer: Optional[SerializerLike] = None,
        max_bytes: Optional[int] = None,
        compression: Optional[str] = None,
    ) -> None:
        """Send ``obj`` to global rank ``dst``, which calls :meth:`recv` with the same ``tag``.

        Messages with different tags between the same two ranks never mix. If encoding fails, the
        receiver gets the error report (and raises ``RemoteError``) and this rank raises the original
        error: nobody is left waiting. A small message (one that fits the slot: no second round) is sent
        eagerly on every path: this returns before its receiver takes it, within a bound per group
        (:mod:`objcomm._transport.pending`); a large one returns once its receiver took it. Through an NCCL group's
        backend every send waits for its receiver. ``dst`` may be this rank itself (and is, without a process
        group): the message waits here, encoded, until this rank receives it, and this returns at once.
        """
        # a send/recv is no collective: its errors are not named after this thread's last one (call_words.leave, inline)
        call_words.WORD.set(0)
        express, serialized = self._short_send(obj, dst, tag, serializer, max_bytes, compression)
        if serialized is True:
            return
        call = self._call(call_kwargs(locals()))
        self._send_call(call, obj, dst, tag, serialized, express)

    @mpi4py_keywords
    def recv(
        self,
        src: Optional[int] = None,
        tag: int = 0,
        *,
        accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
        map_location: Device = None,
        return_sender: bool = False,
    ) -> Any:
        """Receive the object global rank ``src`` sends with ``tag``; ``src=None`` takes it from any rank
        (gloo only). ``return_sender=True`` returns ``(sender's global rank, object)``.

        ``src`` may be this rank itself (and is, without a process group or with ``src=None`` in a group of one):
        the oldest message it sent itself under ``tag``; when there is none, this raises ``ObjcommError`` at once,
        since nothing could arrive while it blocks. ``src=None`` takes a message this rank sent itself, where one
        waits, before it waits for the other ranks.
        """
        call_words.WORD.set(0)  # (as send)
        if accept is None and max_bytes is None and map_location is None:
            express, held, group = self._express_found()
            if express is not None and (
                src is not None or (len(express.ranks) > 1 and not own_waiting(express.facts, tag))
            ):
                got = express.recv(src, tag, self._group)
                if got is not NOT_TAKEN:
                    return got if return_sender else got[1]
            call = self._held_call(held, group)
        else:
            call = self._given_call(call_kwargs(locals()))
        return self._recv_call(call, src, tag, return_sender)

    # -- non-blocking (see objcomm._api.requests) --------------------------------------------------------
    @mpi4py_keywords
    def isend(
        self,
        obj: Any,
        dst: int,
        tag: int = 0,
        *,
        serializer: Optional[SerializerLike] = None,
        max_bytes: Optional[int] = None,
        compression: Optional[str] = None,
    ) -> Request:
        """Non-blocking :meth:`send`: a :class:`~objcomm.Request` whose ``wait()`` returns ``None`` once sent.

        ``obj`` is encoded here, in the caller's thread, and what shares memory with it is copied (its tensors and
        arrays among them: :func:`objcomm._transport.pending.captured`), so it may change as soon as this returns. A bad
        ``dst`` or ``tag`` raises here, as :meth:`send` does; an object that cannot be encoded fails as there: the
        receiver gets the error report and ``wait()`` raises the original error. To this rank itself (and without a
        process group), the message is delivered here, and the handle comes back completed.
        """
        kwargs = call_kwargs(locals())
        call_words.leave()  # (as send)
        _requests.issuable(self.group, "isend")  # raises on NCCL
        call = self._call(kwargs)
        return self._isend_call(call, obj, dst, tag)

    @mpi4py_keywords
    def irecv(
        self,
        src: Optional[int] = None,
        tag: int = 0,
        *,
        accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
        map_location: Device = None,
        return_sender: bool = False,
    ) -> Request:
        """Non-blocking :meth:`recv`: a :class:`~objcomm.Request` whose ``wait()`` returns the object. A bad ``src``
        or ``tag`` raises here, as :meth:`recv` does. From this rank itself (and without a process group, or with
        ``src=None`` in a group of one), it completes with the oldest message this rank sent itself under ``tag``:
        one waiting now, else the next one sent (in the sending thread; ``wait(timeout)`` to wait for another
        thread's)."""
        kwargs = call_kwargs(locals())
        call_words.leave()  # (as send)
        _requests.issuable(self.group, "irecv")  # raises on NCCL
        call = self._call(kwargs).usable()
        wire, peer = self._source(call, src, tag, "irecv")
        if wire is None or peer == wire.rank:
            return _requests.receive_own(
                None if wire is None else wire.group, src, tag, lambda out: call.own(out, return_sender)
            )
        return _requests.point_to_point(
            self.group, "recv", src, tag, lambda: self.recv(src, tag, return_sender=return_sender, **kwargs)
        )

    @mpi4py_keywords
    def sendrecv(
        self,
        obj: Any,
        dst: int,
        *,
        src: Optional[int] = None,
        sendtag: int = 0,
        recvtag: Optional[int] = None,
        serializer: Optional[SerializerLike] = None,
        accept: Optional[Collection[str]] = None,
        max_bytes: Optional[int] = None,
        map_location: Device = None,
        compression: Optional[str] = None,
        return_sender: bool = False,
    ) -> Any:
        """Send ``obj`` to global rank ``dst`` under ``sendtag`` and receive what global rank ``src`` sends under
        ``recvtag`` (``sendtag`` unless given; ``src=None``: any rank, gloo only: through NCCL a ``ValueError``
        before either half), both at once, as mpi4py's ``comm.sendrecv``: ranks that each send to one rank and
        receive from another (a ring's shift, a halo exchange) need no order among them. ``max_bytes`` bounds both
        what this rank sends and what it accepts.

        On a gloo group the send goes as :meth:`isend` while this rank receives as :meth:`recv`, then the send is
        waited for (a small message through the same-host channel, with the communicator's settings, is posted
        before the receive instead, as :meth:`send` posts it). Through an NCCL group (whose sends cannot run beside
        a receive) it sends and receives one after the other, receiving first where ``src`` is a lower global rank
        than this one and sending first elsewhere, which no permutation of sends deadlocks (a ring's shift then
        moves one rank after another). If this rank's object cannot be encoded, ``dst`` raises ``RemoteError`` and
        this rank the original error, once it has received; a failed receive raises its error once the send has
        ended (the send's own, if it failed too, is dropped); a send that fails at once (a bad ``dst``) raises once
        this rank has received what its source sends it all the same.

        Example::

            rank, world = dist.get_rank(), dist.get_world_size()
            from_left = objcomm.sendrecv(my_block, dst=(rank + 1) % world, src=(rank - 1) % world)
        """
        call_words.leave()  # (as send)
        tag = sendtag if recvtag is None else recvtag

        def receive() -> Any:
            try:
                return self.recv(
                    src, tag, accept=accept, max_bytes=max_bytes, map_location=map_location, return_sender=return_sender
                )
            except CommunicationError as exc:  # (a port that gives a sendtag alone: mpi4py's recvtag is any tag)
                if recvtag is not None or not sendtag or type(exc) is not CommunicationError:
                    raise
                raise CommunicationError(
                    f"{exc}; sendrecv received under recvtag={tag}, which defaults to sendtag (mpi4py's defaults to "
                    "any tag): pass recvtag= the tag its source sends under"
                ) from exc

        def send() -> None:
            self.send(obj, dst, sendtag, serializer=serializer, max_bytes=max_bytes, compression=compression)

        if _requests.on_nccl(self.group):  # one after the other, in the order that cannot deadlock
            if src is None:  # (before either half: a send already made would wait for its receiver in vain)
                raise ValueError(
                    "sendrecv(src=None) needs a backend that can receive from any rank (gloo); this group moves bytes "
                    "through NCCL — pass the sender's rank as src"
                )
            if src < dist.get_rank():
                return _in_turn(receive, send)[0]
            return _in_turn(send, receive)[1]
        try:
            sending = self._isend_now(obj, dst, sendtag, serializer, max_bytes, compression)
        except Exception:
            with contextlib.suppress(Exception):  # its source sends all the same
                receive()
            raise
        if sending is None:  # posted
            return receive()
        try:
            received = receive()
        except Exception:
            with contextlib.suppress(Exception):  # the send's own failure, if any, tells less than this one
                sending.wait()
            raise
        sending.wait()
        return received

    def _isend_now(
        self,
        obj: Any,
        dst: int,
        tag: int,
        serializer: Optional[SerializerLike],
        max_bytes: Optional[int],
        compression: Optional[str],
    ) -> Optional[Request]:
        """sendrecv's send on gloo: None where the short path posted it (a small message through the same-host
        channel, with the communicator's settings, as :meth:`send`'s: it declines while a request is outstanding),
        else an :meth:`isend`'s request, on a lane's thread, after this rank's isends to ``dst`` under ``tag``."""
        express, serialized = self._short_send(obj, dst, tag, serializer, max_bytes, compression)
        if serialized is True:
            return None
        call = self._call({"serializer": serializer, "max_bytes": max_bytes, "compression": compression})
        return self._isend_call(call, obj, dst, tag, express, serialized)

    def _short_send(
        self,
        obj: Any,
        dst: int,
        tag: int,
        serializer: Optional[SerializerLike],
        max_bytes: Optional[int],
        compression: Optional[str],
    ) -> Tuple[Optional[Express], Any]:
        """A send through the express path, where the call has the communicator's settings: ``(its express path,
        True)`` once posted, else ``(express path or None, what it serialized for the general path to take over)``."""
        if serializer is not None or max_bytes is not None or compression is not None:
            return None, None
        express = self._express()
        return express, None if express is None else express.send(obj, dst, tag)


def _in_turn(first: Callable[[], Any], then: Callable[[], Any]) -> Tuple[Any, Any]:
    """``first()``, then ``then()``, which runs even where ``first()`` failed (its peer waits for it all the same):
    what ``first()`` raised, else both results."""
    try:
        one = first()
    except Exception:
        with contextlib.suppress(Exception):
            then()
        raise
    return one, then()
