"""The messages a rank sends itself (``send``/``isend`` to this rank, and every one without a process group): held
encoded in a box per group until this rank receives them, which completes the receives waiting for them (the rules:
:mod:`objcomm._api.requests`, "Messages to oneself"); and a receive from any rank, which such a message completes
too, as MPI matches it (:class:`AnySourceWait`, :func:`wake_any_source`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections import deque
from typing import Any, Callable, Deque, Dict, Tuple

from objcomm import _state
from objcomm._api.handles import Request, completed
from objcomm._transport import any_source

Posted = Tuple[concurrent.futures.Future[Any], Callable[[Any], Any], Callable[[], None]]  # an irecv from oneself


class _OwnBox:
    """The messages a rank sent itself on one group (or without one) and has not received yet, per tag in the
    order sent; and its receives from itself that wait for their message (``irecv``), per tag in the order posted.

    A message is what the sender's encoding gave (an :class:`~objcomm._transport.base.Outgoing` that owns its bytes, or
    an error report): the receiver decodes it with its own settings, as a peer's. Both queues hold only non-empty
    deques, so ``tag in queued`` says whether a message waits.
    """

    __slots__ = ("lock", "queued", "posted")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queued: Dict[int, Deque[Any]] = {}  # tag -> messages not received yet
        self.posted: Dict[int, Deque[Posted]] = {}  # tag -> irecv from oneself: (future, take, release)

    def post(self, tag: int, message: Any) -> None:
        """Deliver ``message``: to the oldest receive waiting under ``tag`` (decoded now, in this thread), else to the
        queue."""
        with self.lock:
            waiting = self.posted.get(tag)
            if not waiting:
                self.queued.setdefault(tag, deque()).append(message)
                return
            future, take, release = waiting.popleft()
            if not waiting:
                del self.posted[tag]
        _complete(future, lambda: take(message), release)

    def take(self, tag: int) -> Any:
        """The oldest message under ``tag``, or :data:`NOTHING`."""
        with self.lock:
            queue = self.queued.get(tag)
            if not queue:
                return NOTHING
            message = queue.popleft()
            if not queue:
                del self.queued[tag]
            return message

    def receive(
        self, tag: int, take: Callable[[Any], Any], hold: Callable[[], None], release: Callable[[], None]
    ) -> Request:
        """An ``irecv`` from oneself: completed with ``take(message)`` now if a message waits under ``tag``, else
        once one is sent. ``hold()`` runs as it starts to wait, ``release()`` before it completes."""
        with self.lock:
            queue = self.queued.get(tag)
            if not queue:
                future: concurrent.futures.Future[Any] = concurrent.futures.Future()
                future.set_running_or_notify_cancel()
                hold()
                self.posted.setdefault(tag, deque()).append((future, take, release))
                return Request("irecv", future)
            message = queue.popleft()
            if not queue:
                del self.queued[tag]
        return completed("irecv", lambda: take(message))


NOTHING = object()  # what _OwnBox.take returns when no message waits


def _complete(future: concurrent.futures.Future[Any], fn: Callable[[], Any], release: Callable[[], None]) -> None:
    """Complete ``future`` with what ``fn`` returns or raises (in the caller's thread), ``release`` first."""
    try:
        result = fn()
    except BaseException as exc:  # wait() raises it
        release()
        future.set_exception(exc)
    else:
        release()
        future.set_result(result)


def own_waiting(facts: _state.GroupFacts, tag: Any) -> bool:
    """Whether a message this rank sent itself waits under ``tag`` on the group of ``facts`` (a look, no lock)."""
    lanes = facts.requests  # (objcomm._api.requests._Lanes)
    return lanes is not None and tag in lanes.own.queued


_WAITING_LOCK = threading.Lock()  # the counts of AnySourceWait


class AnySourceWait(any_source.watching):
    """A receive from any rank under ``tag`` on the group of ``facts``, while it waits: it watches for a message to
    oneself (:mod:`objcomm._transport.any_source`), and is counted, so that an ``irecv`` from oneself posted meanwhile
    in another thread raises (MPI gives the next message to oneself to this receive, posted first: a reviewer's find,
    where that ``irecv`` took it)."""

    __slots__ = ("facts", "tag")

    def __init__(self, facts: _state.GroupFacts, tag: int) -> None:
        super().__init__(functools.partial(own_waiting, facts, tag))
        self.facts, self.tag = facts, tag

    def __enter__(self) -> None:
        with _WAITING_LOCK:
            waiting = self.facts.any_source
            waiting[self.tag] = waiting.get(self.tag, 0) + 1
        super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        with _WAITING_LOCK:
            waiting = self.facts.any_source
            if waiting[self.tag] > 1:
                waiting[self.tag] -= 1
            else:
                del waiting[self.tag]


def wake_any_source(group: Any) -> None:
    """After a send to oneself on ``group``: a receive from any rank that waits on its same-host channel looks at it
    (:mod:`objcomm._transport.any_source`), as MPI matches it."""
    for state in list(_state.group_facts(group).local.values()):
        channel = state.channel
        if channel is not None and not channel.closed:
            channel.wake()
