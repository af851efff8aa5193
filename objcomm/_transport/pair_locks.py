"""Send/recv through the backend from several threads: each message's parts stay together.

Through the backend a message may be more than one gloo message: its slot, then its rest (past
:data:`objcomm._transport.routes.BACKEND_WHOLE_BYTES`, or after the receiver's answer). gloo matches a pair's messages
under one tag in posting order, so two threads of one rank sending to the same peer under the same tag could
interleave their parts (slot A, slot B, rest A), and two threads receiving from it could each take the other's
part: a receive posted for a slot then meets a rest, and gloo aborts the process (its message is longer than the
buffer). The same-host channel keeps them apart by message id; here:

- a send holds the lock of its (group, receiver, tag) from its slot to its last part, so that concurrent sends to
  one peer under one tag go one after another (MPI's order per thread holds; between threads there is none to keep);
- a receive holds the lock of its (group, sender, tag), or of (group, any rank, tag): concurrent receives from one
  rank, or from any rank, under one tag go one after another;
- a receive from any rank while another thread receives from a given rank under the same tag, or the reverse, is
  refused at once (:class:`~objcomm.ObjcommError`, nothing received), as ``irecv`` refuses it: the sender of the
  first is known only once its slot came, and waiting for the other could wait for a message that only this
  receive's would bring about.

Sends and receives never wait for each other. Entries live while in use (tags may be many); a forked child starts
with none.

>>> import threading
>>> group = threading.Lock()  # (any hashable, weakly referable object stands for a process group)
>>> with sending(group, dst=1, tag=0):
...     pass
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Dict, Hashable, Optional

from objcomm._errors import ObjcommError


class _Entry:
    """One lock and how many threads hold or wait for it."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0


class _Group:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards the dicts below
        self.entries: Dict[Hashable, _Entry] = {}  # ("send", dst, tag) / ("recv", src or None, tag)
        self.receiving: Dict[Hashable, int] = {}  # (tag, from any rank?): receives in flight


_GROUPS: weakref.WeakKeyDictionary[Any, _Group] = weakref.WeakKeyDictionary()
_UNREFERABLE = _Group()  # for a group that cannot be weakly referenced: one table for all such groups
_MAKING = threading.Lock()


def _of(group: Any) -> _Group:
    """``group``'s table (made at its first send or receive)."""
    try:
        held = _GROUPS.get(group)
    except TypeError:  # no weak reference to it
        return _UNREFERABLE
    return held if held is not None else _made(group)


def _made(group: Any) -> _Group:
    with _MAKING:
        return _GROUPS.setdefault(group, _Group())


class _Holding:
    """Holds the lock of ``key`` in ``held`` inside (``with``); the entry is dropped when no thread uses it."""

    __slots__ = ("held", "key", "entry")

    def __init__(self, held: _Group, key: Hashable) -> None:
        self.held, self.key = held, key

    def __enter__(self) -> None:
        held = self.held
        with held.lock:
            entry = held.entries.get(self.key)
            if entry is None:
                entry = held.entries[self.key] = _Entry()
            entry.users += 1
        self.entry = entry
        entry.lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        entry, held = self.entry, self.held
        entry.lock.release()
        with held.lock:
            entry.users -= 1
            if not entry.users:
                del held.entries[self.key]


def sending(group: Any, dst: int, tag: int) -> _Holding:
    """Inside (``with``): this thread is the only one of this rank sending to group rank ``dst`` under ``tag`` on
    ``group``."""
    return _Holding(_of(group), ("send", dst, tag))


class receiving:  # noqa: N801 (used as ``with receiving(...)``, as sending)
    """Inside (``with``): this thread is the only one of this rank receiving from group rank ``src`` (None: any rank)
    under ``tag`` on ``group``. Entering raises :class:`~objcomm.ObjcommError` at once where another thread receives
    under ``tag`` from any rank while ``src`` is given, or from a given rank while ``src`` is None."""

    __slots__ = ("held", "src", "tag", "holding")

    def __init__(self, group: Any, src: Optional[int], tag: int) -> None:
        self.held, self.src, self.tag = _of(group), src, tag
        self.holding = _Holding(self.held, ("recv", src, tag))

    def __enter__(self) -> None:
        held, src, tag, anyone = self.held, self.src, self.tag, self.src is None
        with held.lock:
            if held.receiving.get((tag, not anyone)):
                mine, theirs = ("any rank", "a given rank") if anyone else (f"rank {src}", "any rank")
                raise ObjcommError(
                    f"recv: a receive from {mine} under tag {tag} while another thread of this rank receives from "
                    f"{theirs} under the same tag through the backend: one could take the parts of the other's "
                    "message. Under one tag, receive either from given ranks or from any rank at a time (as irecv "
                    "requires), or use another tag"
                )
            held.receiving[tag, anyone] = held.receiving.get((tag, anyone), 0) + 1
        try:
            self.holding.__enter__()
        except BaseException:
            self._leave()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.holding.__exit__(*exc)
        finally:
            self._leave()

    def _leave(self) -> None:
        held, key = self.held, (self.tag, self.src is None)
        with held.lock:
            left = held.receiving.pop(key) - 1
            if left:
                held.receiving[key] = left


def _forget_in_child() -> None:
    """A forked child's locks may be held by threads it does not have: it starts without any."""
    global _GROUPS, _UNREFERABLE, _MAKING
    _GROUPS, _UNREFERABLE, _MAKING = weakref.WeakKeyDictionary(), _Group(), threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
