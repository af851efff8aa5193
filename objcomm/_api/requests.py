"""Non-blocking object messaging: where the operations behind :class:`~objcomm._api.handles.Request` handles run.

``isend``/``irecv`` and every collective with ``async_op=True`` hand the blocking operation to a
background thread and return a :class:`Request` at once. The rules, per process group:

- **Collectives** (``all_gather(..., async_op=True)`` and the rest) run on the group's *shadow*: a
  second process group with the same ranks and backend. One lane per group runs them one after another,
  in issue order. Since torch matches collectives of one process group by issue order per thread, and
  the caller's thread never touches the shadow, the caller may keep running blocking objcomm calls and
  tensor collectives on the group meanwhile: they neither wait for nor mix with the outstanding ones.
  Every rank must issue a group's async collectives in the same order, as with blocking ones.
- **The shadow is made in the lane** (:func:`_make_shadow`), by the first async collective's job, so issuing
  never blocks: members may reach their first async collective at different points of their blocking calls
  (or ``dist.new_group`` calls). It is named after the group's own torch name, which every member shares, so
  neither group counts nor the order of creation matter; its set-up talks only to its members, through the
  store, and gives up after the group's timeout (a member that never issues an async collective on the group:
  ``wait()`` raises :class:`~objcomm.CommunicationError`, as does every later async collective there). It
  joins torch's groups in the background, which recent torch counts when it names a group made with
  ``use_local_synchronization`` or ``split_group``: create those before the first async collective on a group,
  or after its ``wait()``.
- **Point to point** (``isend``/``irecv``) runs on the group itself, in one lane per (direction, peer,
  tag): messages between the same pair with the same tag keep their issue order, while an ``isend``
  never waits behind an ``irecv`` (gloo's send waits for its receiver, so one lane for both would
  deadlock two ranks that each post an irecv before their isend). Tags keep lanes apart on the wire.
- **MPI's order, else an error, never a race or a hang**: a blocking ``send``/``recv`` on a (peer, tag) that an
  outstanding ``isend``/``irecv`` of this rank also uses waits for it and goes after it (:func:`check_blocking`);
  where waiting would not keep MPI's order (a ``recv(src=None, tag)`` next to an ``irecv`` from a given rank, a
  receive from oneself, a request's done-callback on a lane's thread), and for an ``irecv(src=None, tag)`` next to
  an outstanding ``irecv`` from a given rank with the same tag (or the reverse), the call raises
  :class:`~objcomm.ObjcommError` at once. Point to point on NCCL is refused (its one communicator
  cannot take sends from several threads); NCCL collectives use the shadow like gloo's.

- **Messages to oneself** (``send``/``isend`` to this rank, and every one without a process group) never
  touch the backend: :class:`~objcomm._api.own_box._OwnBox`, one per group, holds them, encoded, until this
  rank receives them, in order per tag. An ``irecv`` from oneself needs no lane either: it waits in the box, and
  the next send to oneself under its tag completes it (the receives posted under a tag, in posting order); it
  counts as outstanding for the rules above, as an ``irecv`` from a peer does.

A lane is a queue with a thread that exists only while the queue has work, so idle groups hold no
thread and thousands of handles leave none behind. Without a process group, the operation runs
at once and the handle is returned completed. Failures are the blocking call's: ``wait()`` raises
them (``RemoteError`` on every rank when any rank failed to encode), nothing is swallowed.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from objcomm import _state
from objcomm._api.handles import _LOCAL, Request, _settle, completed
from objcomm._api.own_box import NOTHING, _OwnBox
from objcomm._device import device_for_backend, group_backend, is_cpu, timeout_seconds
from objcomm._errors import CommunicationError, ObjcommError
from objcomm._transport import groups as _groups

Job = Tuple[concurrent.futures.Future[Any], Callable[[], Any]]
Key = Tuple[str, Any, Any]  # a lane: ("send" | "recv", peer, tag), or COLLECTIVES
COLLECTIVES: Key = ("collective", None, None)


class _Lanes:
    """One group's async state: its shadow group, its lanes, which point-to-point keys are busy, and the messages
    this rank sends itself on it."""

    def __init__(self, me: int = -1) -> None:
        self.me = me  # this process's global rank, for the exit's wait (_at_exit)
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)  # notified as requests end (a blocking call may wait for them)
        self.shadow: Any = None  # the shadow group, or the exception that stopped its set-up (shadow_of)
        self.queues: Dict[Key, Deque[Job]] = {}  # a lane exists while it has work and its thread
        self.busy: Dict[Key, int] = {}  # (direction, peer, tag) -> outstanding requests
        self.tagged: Dict[Tuple[str, Any], Dict[Key, None]] = {}  # (direction, tag) -> its busy keys, oldest first
        self.own = _OwnBox()

    def shadow_of(self, group: Any) -> Any:
        """``group``'s shadow, made at the first call (only the collective lane calls this, one job at a time). A
        failed set-up fails this and every later async collective on the group: its members are out of step."""
        if self.shadow is None:
            try:
                self.shadow = _make_shadow(group)
            except Exception as exc:
                self.shadow = exc
        if isinstance(self.shadow, Exception):
            raise CommunicationError(
                "async collectives on this group run on a second process group with its ranks, which each member "
                "sets up at its first async collective on the group, waiting for the others up to the group's "
                f"timeout; that set-up failed: {self.shadow}"
            ) from self.shadow
        return self.shadow

    def hold(self, key: Key) -> None:
        """One more outstanding request on ``key``, released by :meth:`_done`."""
        with self.lock:
            self._busier(key)

    def _busier(self, key: Key) -> None:
        """One more outstanding request on ``key`` (called holding ``lock``)."""
        held = self.busy.get(key, 0)
        self.busy[key] = held + 1
        if not held:
            self.tagged.setdefault((key[0], key[2]), {})[key] = None

    def submit(self, op: str, key: Key, fn: Callable[[], Any]) -> Request:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # never cancellable: the other ranks would wait forever
        with self.lock:
            queue = self.queues.get(key)
            start = queue is None
            if queue is None:
                queue = self.queues[key] = deque()
            queue.append((future, fn))
            if key != COLLECTIVES:  # under the lock: the lane's thread may run the job and release it at once
                self._busier(key)
        if start:
            threading.Thread(target=self._drain, args=(key,), name=f"objcomm-{op}", daemon=True).start()
        return Request(op, future)

    def _drain(self, key: Key) -> None:
        """Run the lane's jobs in order; the thread ends when the lane is empty."""
        _LOCAL.lane = True
        while True:
            with self.lock:
                queue = self.queues[key]
                if not queue:
                    del self.queues[key]
                    return
                future, fn = queue.popleft()
            _settle(future, fn, lambda: self._done(key))
            del future, fn  # hold nothing of a finished job

    def _done(self, key: Key) -> None:
        """Release ``key`` before the future completes, so a blocking call right after ``wait()`` is allowed."""
        if key == COLLECTIVES:
            return
        with self.lock:
            left = self.busy[key] - 1
            if left:
                self.busy[key] = left
            else:
                del self.busy[key]
                keys = self.tagged[(key[0], key[2])]
                del keys[key]
                if not keys:
                    del self.tagged[(key[0], key[2])]
                self.idle.notify_all()

    def wait_idle(self, key: Key, deadline: float) -> bool:
        """Wait until no request is outstanding on ``key``, until ``deadline`` (``time.monotonic()``); whether so."""
        with self.idle:
            return self.idle.wait_for(lambda: key not in self.busy, max(deadline - time.monotonic(), 0.0))

    def conflict(self, direction: str, peer: Optional[int], tag: int) -> Optional[Key]:
        """An outstanding key that a ``direction`` operation with ``peer`` and ``tag`` would race with. O(1), where
        scanning every busy key made W ``irecv`` s from every peer O(W^2) (a helper's find: 2.9 s at 8191 peers)."""
        with self.lock:
            keys = self.tagged.get((direction, tag))
            if not keys:
                return None
            if peer is None:  # any rank's: whichever is outstanding, the oldest
                return next(iter(keys))
            for key in ((direction, peer, tag), (direction, None, tag)):
                if key in keys:
                    return key
        return None


_LANES_LOCK = threading.Lock()


def _lanes(group: Any) -> _Lanes:
    facts = _state.group_facts(group)
    with _LANES_LOCK:
        lanes: Optional[_Lanes] = facts.requests
        if lanes is None:
            lanes = facts.requests = _Lanes(dist.get_rank())
            _LIVE.add(lanes)
        return lanes


# -- at exit ---------------------------------------------------------------------------------------------------------
_LIVE: weakref.WeakSet[_Lanes] = weakref.WeakSet()  # every group's lanes (a group's lanes go with it)
EXIT_WAIT, EXIT_WAIT_ON_HIGHER = 10.0, 2.0  # seconds, at most: see _at_exit


def _outstanding() -> List[Tuple[_Lanes, Key, int]]:
    """Every lane that has work, with how many operations it holds (the one running among them)."""
    found = []
    for lanes in list(_LIVE):
        with lanes.lock:
            found += [(lanes, key, len(queue) + 1) for key, queue in lanes.queues.items()]
    return found


def _waits_on_lower(lanes: _Lanes, key: Key) -> bool:
    """Whether a lane's operation waits on one given rank below this one (see :func:`_at_exit`)."""
    return key != COLLECTIVES and key[1] is not None and key[1] < lanes.me


def _described(key: Key, count: int) -> str:
    what = "async collectives" if key == COLLECTIVES else f"{'irecv' if key[0] == 'recv' else 'isend'}"
    if key != COLLECTIVES:
        what += f"({'src' if key[0] == 'recv' else 'dst'}={key[1]}, tag={key[2]})"
    return what if count == 1 else f"{count} x {what}"


def _forget_in_child() -> None:
    """In a forked child: the parent's lanes are not this process's (their threads did not come along, their locks
    may be held): its exit waits for none of them."""
    global _LIVE
    _LIVE = weakref.WeakSet()


def _at_exit() -> None:
    """At exit, an operation still outstanding holds its lane's thread inside torch.distributed (an ``irecv`` whose
    message never came). If it ends while the interpreter is torn down (its peer exits at that moment, closing the
    connection), that thread aborts the process (``terminate called without an active exception``, SIGABRT). So the
    process first waits for them to end: one from a given lower rank up to :data:`EXIT_WAIT` seconds, the others up
    to :data:`EXIT_WAIT_ON_HIGHER`. Two ranks that wait on each other then end one after the other, the higher after
    the lower, whose exit ends the higher's wait; a rank whose peer exits meanwhile ends cleanly. What is still
    outstanding after that is named in a warning. A process ending on an uncaught exception (a crash, Ctrl-C) does
    not wait: its peers are usually stopped after it, never while it is torn down."""
    start = time.monotonic()
    left = _outstanding()
    crashed = getattr(sys, "last_value", None) is not None  # set where an uncaught exception was printed
    while left and not crashed:
        waited = time.monotonic() - start
        if waited >= EXIT_WAIT or (
            waited >= EXIT_WAIT_ON_HIGHER and not any(_waits_on_lower(lanes, key) for lanes, key, _ in left)
        ):
            break
        time.sleep(0.01)
        left = _outstanding()
    if left:
        named = ", ".join(_described(key, count) for _, key, count in left)
        warnings.warn(
            f"objcomm: this process exits with non-blocking operations not completed: {named} "
            f"(waited {time.monotonic() - start:.1f} s for them). "
            "wait() for every Request before the end, and post an irecv only for a message that will come (it "
            "takes the message: post it once, then poll is_completed()); a thread left inside torch.distributed "
            "can abort the process as it exits",
            RuntimeWarning,
            stacklevel=1,
        )


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(_at_exit)  # registered after torch (imported first), so it runs before torch's own exit hooks


def _resolved(group: Any) -> Any:
    return group if group is not None else dist.group.WORLD


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def collective(group: Any, op: str, fn: Callable[[Any], Any]) -> Request:
    """Issue ``fn(shadow)`` on ``group``'s collective lane; ``fn`` runs the blocking collective on the
    process group it is given (the shadow; ``group`` itself when there is no process group)."""
    if not _initialized():
        return completed(op, lambda: fn(group))
    group = _resolved(group)
    lanes, device = _lanes(group), _cuda_device(group)
    if device is None:
        return lanes.submit(op, COLLECTIVES, lambda: fn(lanes.shadow_of(group)))

    def on_device() -> Any:  # a thread starts on CUDA device 0: give it the caller's (the shadow's set-up too)
        with torch.cuda.device(device):
            return fn(lanes.shadow_of(group))

    return lanes.submit(op, COLLECTIVES, on_device)


def _cuda_device(group: Any) -> Optional[int]:
    """The caller's current CUDA device when objcomm moves ``group``'s bytes there (NCCL), else None."""
    device = device_for_backend(group_backend(group), torch.cuda.current_device)
    return None if is_cpu(device) else device.index


def on_nccl(group: Any) -> bool:
    """Whether ``group``'s bytes move through NCCL, whose one communicator cannot take sends and receives from
    several threads."""
    return _initialized() and _cuda_device(_resolved(group)) is not None


def issuable(group: Any, op: str) -> bool:
    """Whether ``op`` (``isend``/``irecv``) on ``group`` runs on a lane: False without a process group (it runs at
    once, its handle completed); raises on NCCL (see :func:`point_to_point`)."""
    if not _initialized():
        return False
    if on_nccl(group):
        raise ObjcommError(
            f"{op}: this group uses NCCL, whose one communicator cannot take sends and receives from several "
            "threads; use blocking send/recv there, async collectives (async_op=True), or a gloo group for isend/irecv"
        )
    return True


def point_to_point(group: Any, direction: str, peer: Optional[int], tag: Any, fn: Callable[[], Any]) -> Request:
    """Issue ``fn`` (a blocking send or recv on ``group``) on the lane of ``(direction, peer, tag)``."""
    op = "isend" if direction == "send" else "irecv"
    if not issuable(group, op):
        return completed(op, fn)
    group = _resolved(group)
    lanes = _lanes(group)
    if direction == "recv":
        _check_sources(lanes, peer, tag)
    return lanes.submit(op, (direction, peer, tag), fn)


def _check_sources(lanes: _Lanes, peer: Optional[int], tag: Any) -> None:
    """Raise if an ``irecv(src=peer, tag)`` would take the messages of an outstanding one from another source."""
    clash = lanes.conflict("recv", peer, tag)
    if clash is not None and clash[1] != peer:
        raise ObjcommError(
            f"irecv(src={peer}, tag={tag}) while an irecv(src={clash[1]}, tag={tag}) is outstanding: a receive "
            "from any rank and one from a given rank with the same tag would take each other's messages. "
            "Wait for the outstanding one first, or use different tags"
        )


# -- messages to oneself (see _OwnBox) ---------------------------------------------------------------------------------
_NO_GROUP = _OwnBox()  # without a process group: the one rank's messages to itself


def own_box(group: Any) -> _OwnBox:
    """The box of this rank's messages to itself on ``group`` (a process group; None: without one)."""
    return _NO_GROUP if group is None else _lanes(group).own


def own_message(group: Any, tag: int) -> Any:
    """The oldest message this rank sent itself on ``group`` (None: without a process group) under ``tag``, or
    :data:`NOTHING`."""
    if group is None:
        return _NO_GROUP.take(tag)
    lanes: Optional[_Lanes] = _state.group_facts(group).requests
    return NOTHING if lanes is None else lanes.own.take(tag)


def nothing_waiting(op: str, src: Any, tag: int) -> ObjcommError:
    """What a blocking receive from this rank itself raises when no message waits: none could arrive while it blocks."""
    any_rank = " (from any rank, in a group of one: from this rank itself)" if src is None else ""
    return ObjcommError(
        f"{op}(src={src}, tag={tag}){any_rank}: nothing this rank sent itself waits under tag {tag}, and nothing "
        "can arrive while this call blocks the thread that would send it (mpi4py would wait forever here). "
        "Send to this rank first (a send to oneself returns at once), or, where another thread sends it, "
        f"wait with objcomm.irecv(src={src}, tag={tag}).wait(timeout)"
    )


def receive_own(group: Any, src: Optional[int], tag: int, take: Callable[[Any], Any]) -> Request:
    """An ``irecv(src, tag)`` from this rank itself on ``group`` (None: without a process group): completed with
    ``take(message)`` by the message this rank sent itself under ``tag``, now or at its send. On a group it is
    outstanding on ``("recv", src, tag)`` until then, as an ``irecv`` from a peer is on its lane."""
    if group is None:
        return _NO_GROUP.receive(tag, take, _nothing, _nothing)
    lanes = _lanes(group)
    _check_sources(lanes, src, tag)
    if src is not None and _state.group_facts(group).any_source.get(tag):
        raise ObjcommError(
            f"irecv(src={src}, tag={tag}) from this rank itself while a recv(src=None, tag={tag}) of another thread "
            "waits: MPI would give the next message this rank sends itself under that tag to that receive, posted "
            "first. Let that receive take it, or use different tags"
        )
    key = ("recv", src, tag)
    return lanes.own.receive(tag, take, lambda: lanes.hold(key), lambda: lanes._done(key))


def _nothing() -> None:
    return None


def check_blocking(group: Any, direction: str, peer: Optional[int], tag: Any) -> None:
    """Before a blocking ``send``/``recv``, MPI's order with this rank's outstanding ``isend``/``irecv`` of the same
    peer and tag: wait until they complete (a send then follows the isends before it, a receive takes the message
    after theirs), up to the group's timeout. Raise where waiting would not keep MPI's order (a ``recv`` from any
    rank next to an ``irecv`` from one: MPI would let it take another rank's message first), on a lane's thread
    (a request's done-callback), whose wait could be for its own lane, and for a receive from oneself (the message
    its irecv waits for would have to come from this thread)."""
    if _LOCAL.inside or not _initialized():
        return
    resolved = _resolved(group)
    lanes: Optional[_Lanes] = _state.group_facts(resolved).requests
    if lanes is None:
        return
    blocking, pending = ("send", "isend") if direction == "send" else ("recv", "irecv")
    where = "dst" if direction == "send" else "src"
    deadline = None
    while True:
        clash = lanes.conflict(direction, peer, tag)
        if clash is None:
            return
        oneself = peer == dist.get_rank() or peer is None and dist.get_world_size(resolved) == 1
        if _LOCAL.lane or clash[1] not in (None, peer) or oneself:  # (from oneself: nothing would come)
            raise ObjcommError(
                f"{blocking}({where}={peer}, tag={tag}) while an {pending}({where}={clash[1]}, tag={tag}) is "
                f"outstanding on this group: their messages would race. wait() for the {pending} first, or use "
                "another tag"
            )
        if deadline is None:
            deadline = time.monotonic() + timeout_seconds(resolved)
        if not lanes.wait_idle(clash, deadline):
            raise CommunicationError(
                f"{blocking}({where}={peer}, tag={tag}) waited for this rank's outstanding {pending}("
                f"{where}={clash[1]}, tag={tag}) to complete first (MPI's order), until the group's timeout; it is "
                f"still outstanding. Does its peer {'receive' if direction == 'send' else 'send'} it?"
            )


def _make_shadow(group: Any) -> Any:
    """A process group with ``group``'s ranks (in its order) and backend, for async collectives; made in the lane
    (:func:`objcomm._transport.groups.sibling`), and destroyed when ``group`` is collected.

    NCCL is untested here (no GPU): its communicator forms at the shadow's first collective, in the lane; where
    the default group is bound to a device, torch splits it from that group's communicator (``ncclCommSplit``),
    which then runs next to the caller's own NCCL calls on the default group."""
    shadow = _groups.sibling(group, "objcomm-shadow")
    weakref.finalize(group, _groups.forget, shadow).atexit = False  # at exit torch tears every group down itself
    return shadow
