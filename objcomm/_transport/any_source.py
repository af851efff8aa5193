"""A receive from any rank that a message this rank sends itself completes, as MPI matches it.

A message a rank sends itself waits in its own box (``objcomm._api.own_box``), never on the wire; a receive from any
rank takes one that waits there before it waits for the other ranks. Under MPI a receive from any rank that already
waits is matched by a message the rank sends itself afterwards too (a port's find: each rank posts ``irecv(src=None)``
for every rank, then ``isend`` s to every rank, itself included; the last receive waited until the timeout). So a
receive from any rank waits for the others under :func:`watching`: where the same-host channel carries it, that wait
stops, raising :class:`OwnMessage`, once ``check()`` says a message to oneself waits (a send to oneself wakes the
channel's waiting threads), and the caller takes it. Through the backend (gloo's receive from any rank) nothing wakes
the wait: there it still takes a message of another rank.

Example::

    >>> with watching(lambda: True):
    ...     WATCH.get()()
    True
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable, Optional

WATCH: ContextVar[Optional[Callable[[], bool]]] = ContextVar("objcomm_any_source_watch", default=None)


class OwnMessage(Exception):
    """A receive from any rank stopped waiting for the other ranks: a message to oneself waits for it."""


class watching:  # noqa: N801 (used as a function: ``with watching(check):``)
    """Within it, this thread's wait for a message from any rank on the same-host channel raises
    :class:`OwnMessage` once ``check()`` is true (a class: a generator's context manager cost a small receive ~2 µs)."""

    __slots__ = ("check", "token")

    def __init__(self, check: Callable[[], bool]) -> None:
        self.check = check

    def __enter__(self) -> None:
        self.token = WATCH.set(self.check)

    def __exit__(self, *exc: Any) -> None:
        WATCH.reset(self.token)
