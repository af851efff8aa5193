"""Non-blocking object messaging: :class:`Request` handles, and where their operations run.

``isend``/``irecv`` and every collective with ``async_op=True`` hand the blocking operation to a
background thread and return a :class:`Request` at once. The rules, per process group:

- **Collectives** (``all_gather(..., async_op=True)`` and the rest) run on the group's *shadow*: a
  second process group with the same ranks and backend, created the first time this rank issues an
  async collective on the group (in the caller's thread, a collective over the group's members, so
  every member creates it at the same point of its call sequence). One lane per group runs them one
  after another, in issue order. Since torch matches collectives of one process group by issue order
  per thread, and the caller's thread never touches the shadow, the caller may keep running blocking
  objcomm calls and tensor collectives on the group meanwhile: they neither wait for nor mix with the
  outstanding ones. Every rank must issue a group's async collectives in the same order, as with
  blocking ones.
- **Point to point** (``isend``/``irecv``) runs on the group itself, in one lane per (direction, peer,
  tag): messages between the same pair with the same tag keep their issue order, while an ``isend``
  never waits behind an ``irecv`` (gloo's send waits for its receiver, so one lane for both would
  deadlock two ranks that each post an irecv before their isend). Tags keep lanes apart on the wire.
- **Misuse is an error, not a race or a hang**: a blocking ``send``/``recv`` on a (peer, tag) that an
  outstanding ``isend``/``irecv`` of this rank also uses, and an ``irecv(src=None, tag)`` next to an
  outstanding ``irecv`` from a given rank with the same tag (or the reverse), raise
  :class:`~objcomm.ObjcommError` at once. Point to point on NCCL is refused (its one communicator
  cannot take sends from several threads); NCCL collectives use the shadow like gloo's.

A lane is a queue with a thread that exists only while the queue has work, so idle groups hold no
thread and thousands of handles leave none behind. Without a process group, the operation runs
at once and the handle is returned completed. Failures are the blocking call's: ``wait()`` raises
them (``RemoteError`` on every rank when any rank failed to encode), nothing is swallowed.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from typing import Any, Callable, Deque, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import _state
from ._device import device_for_backend, group_backend, group_timeout
from ._errors import ObjcommError, WaitTimeoutError
from ._wire import all_gather_single

Job = Tuple[concurrent.futures.Future, Callable[[], Any]]
Key = Tuple[str, Any, Any]  # a lane: ("send" | "recv", peer, tag), or COLLECTIVES
COLLECTIVES: Key = ("collective", None, None)


class Request:
    """A handle on one non-blocking objcomm operation (``isend``, ``irecv``, ``async_op=True``).

    ``wait()`` returns what the blocking call returns, or raises what it raises, on every rank alike.
    A ``wait(timeout)`` that expires raises :class:`~objcomm.WaitTimeoutError` and leaves the handle
    usable: the operation goes on, and a later ``wait()`` collects it. ``get_future()`` gives a
    ``concurrent.futures.Future`` (see :meth:`get_future`).

    Example::

        pending = objcomm.all_gather(metrics, async_op=True)
        loss.backward()                      # keep computing; tensor collectives are fine too
        everyone = pending.wait()
    """

    __slots__ = ("_future", "op")

    def __init__(self, op: str, future: concurrent.futures.Future) -> None:
        self.op = op
        self._future = future

    def wait(self, timeout: Optional[float] = None) -> Any:
        """The operation's result (``None`` for ``isend``), once it completes; or its exception.

        ``timeout``: seconds to wait at most; when they pass first, :class:`~objcomm.WaitTimeoutError`.
        """
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise WaitTimeoutError(
                f"{self.op} did not complete within {timeout} s; it is still in progress and this handle stays "
                "usable: call wait() again. If it never completes, a peer has not issued the matching call"
            ) from None

    def is_completed(self) -> bool:
        """Whether the operation has finished, successfully or not (``wait()`` then returns at once)."""
        return self._future.done()

    def get_future(self) -> concurrent.futures.Future:
        """A ``concurrent.futures.Future`` that completes with the operation.

        That type because the operation runs in a plain thread: it works with
        ``concurrent.futures.wait``/``as_completed``, ``asyncio.wrap_future`` and ``add_done_callback``,
        and ``result(timeout)`` has a timeout; a ``torch.futures.Future`` has none, and its CUDA-stream
        semantics promise nothing for Python objects. It cannot be cancelled: every rank must take part.
        """
        return self._future

    def __repr__(self) -> str:
        state = "completed" if self._future.done() else "pending"
        return f"<objcomm.Request {self.op} {state}>"


class _Lanes:
    """One group's async state: its shadow group, its lanes, and which point-to-point keys are busy."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.shadow: Any = None
        self.queues: Dict[Key, Deque[Job]] = {}  # a lane exists while it has work and its thread
        self.busy: Dict[Key, int] = {}  # (direction, peer, tag) -> outstanding requests

    def submit(self, op: str, key: Key, fn: Callable[[], Any]) -> Request:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # never cancellable: the other ranks would wait forever
        with self.lock:
            queue = self.queues.get(key)
            start = queue is None
            if queue is None:
                queue = self.queues[key] = deque()
            queue.append((future, fn))
            if key != COLLECTIVES:
                self.busy[key] = self.busy.get(key, 0) + 1
        if start:
            threading.Thread(target=self._drain, args=(key,), name=f"objcomm-{op}", daemon=True).start()
        return Request(op, future)

    def _drain(self, key: Key) -> None:
        """Run the lane's jobs in order; the thread ends when the lane is empty."""
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

    def conflict(self, direction: str, peer: Optional[int], tag: int) -> Optional[Key]:
        """An outstanding key that a ``direction`` operation with ``peer`` and ``tag`` would race with."""
        with self.lock:
            for key in self.busy:
                kind, other, other_tag = key
                if kind == direction and other_tag == tag and (other == peer or None in (other, peer)):
                    return key
        return None


class _ThreadState(threading.local):
    inside = False  # this thread runs a lane's call (its blocking calls are the request); a class default: a missing
    # attribute of a threading.local costs an AttributeError on every blocking send/recv


_LOCAL = _ThreadState()
_LANES_LOCK = threading.Lock()


def _settle(future: concurrent.futures.Future, fn: Callable[[], Any], release: Callable[[], None]) -> None:
    """Complete ``future`` with what ``fn`` returns or raises; ``release`` runs first (see :meth:`_Lanes._done`).
    The lane's own blocking call runs ``inside``; the future's done-callbacks, which run on this thread as it
    completes, do not: their calls are checked like any other thread's."""
    _LOCAL.inside = True
    try:
        result = fn()
    except BaseException as exc:  # wait() raises it, on this rank as the blocking call would: nothing is swallowed
        _LOCAL.inside = False
        release()
        future.set_exception(exc)
    else:
        _LOCAL.inside = False
        release()
        future.set_result(result)


def _lanes(group: Any) -> _Lanes:
    facts = _state.group_facts(group)
    with _LANES_LOCK:
        if facts.requests is None:
            facts.requests = _Lanes()
        return facts.requests


def _resolved(group: Any) -> Any:
    return group if group is not None else dist.group.WORLD


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def completed(op: str, fn: Callable[[], Any]) -> Request:
    """Run ``fn`` now (no process group: nothing to overlap) and return its completed handle."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    _settle(future, fn, lambda: None)
    return Request(op, future)


def collective(group: Any, op: str, fn: Callable[[Any], Any]) -> Request:
    """Issue ``fn(shadow)`` on ``group``'s collective lane; ``fn`` runs the blocking collective on the
    process group it is given (the shadow; ``group`` itself when there is no process group)."""
    if not _initialized():
        return completed(op, lambda: fn(group))
    lanes = _lanes(_resolved(group))
    if lanes.shadow is None:  # only the caller's thread creates it, so no lock is needed around the collective
        lanes.shadow = _make_shadow(_resolved(group))
    shadow, device = lanes.shadow, _cuda_device(_resolved(group))
    if device is None:
        return lanes.submit(op, COLLECTIVES, lambda: fn(shadow))

    def on_device() -> Any:  # a thread starts on CUDA device 0: give it the caller's
        with torch.cuda.device(device):
            return fn(shadow)

    return lanes.submit(op, COLLECTIVES, on_device)


def _cuda_device(group: Any) -> Optional[int]:
    """The caller's current CUDA device when objcomm moves ``group``'s bytes there (NCCL), else None."""
    device = device_for_backend(group_backend(group), torch.cuda.current_device)
    return None if device.type == "cpu" else device.index


def point_to_point(group: Any, direction: str, peer: Optional[int], tag: Any, fn: Callable[[], Any]) -> Request:
    """Issue ``fn`` (a blocking send or recv on ``group``) on the lane of ``(direction, peer, tag)``."""
    op = "isend" if direction == "send" else "irecv"
    if not _initialized():
        return completed(op, fn)
    group = _resolved(group)
    if _cuda_device(group) is not None:
        raise ObjcommError(
            f"{op}: this group uses NCCL, whose one communicator cannot take sends and receives from several "
            "threads; use blocking send/recv there, async collectives (async_op=True), or a gloo group for isend/irecv"
        )
    lanes = _lanes(group)
    if direction == "recv":
        clash = lanes.conflict("recv", peer, tag)
        if clash is not None and clash[1] != peer:
            raise ObjcommError(
                f"irecv(src={peer}, tag={tag}) while an irecv(src={clash[1]}, tag={tag}) is outstanding: a receive "
                "from any rank and one from a given rank with the same tag would take each other's messages. "
                "Wait for the outstanding one first, or use different tags"
            )
    return lanes.submit(op, (direction, peer, tag), fn)


def check_blocking(group: Any, direction: str, peer: Optional[int], tag: Any) -> None:
    """Raise if a blocking ``send``/``recv`` would race with an outstanding ``isend``/``irecv`` of this rank."""
    if _LOCAL.inside or not _initialized():
        return
    facts = _state.group_facts(_resolved(group))
    if facts.requests is None:
        return
    clash = facts.requests.conflict(direction, peer, tag)
    if clash is not None:
        blocking, pending = ("send", "isend") if direction == "send" else ("recv", "irecv")
        where = "dst" if direction == "send" else "src"
        raise ObjcommError(
            f"{blocking}({where}={peer}, tag={tag}) while an {pending}({where}={clash[1]}, tag={tag}) is "
            f"outstanding on this group: their messages would race. wait() for the {pending} first, or use "
            "another tag"
        )


def _make_shadow(group: Any) -> Any:
    """A process group with ``group``'s ranks (in its order) and backend, for async collectives."""
    ranks = list(dist.get_process_group_ranks(group))
    options: Dict[str, Any] = {"backend": group_backend(group), "timeout": group_timeout(group)}
    if ranks != sorted(ranks):
        options["sort_ranks"] = False
    if len(ranks) == dist.get_world_size():  # every rank is here: torch names it by its group counter
        return dist.new_group(ranks, **options)
    _check_names_agree(group)
    return dist.new_group(ranks, use_local_synchronization=True, **options)


def _check_names_agree(group: Any) -> None:
    """torch names a group made with ``use_local_synchronization`` after how many groups each member knows;
    members that know different numbers would wait for each other forever. Raise on all of them instead."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is None or not hasattr(world, "pg_names"):
        return
    # an int64 per rank, not all_gather_object: nothing a peer sends here is unpickled
    device = _cuda_device(group)
    mine = torch.tensor([len(world.pg_names)], dtype=torch.int64, device="cpu" if device is None else device)
    every = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=mine.device)
    all_gather_single(every, mine, group=group)
    counts = every.tolist()
    if len(set(counts)) > 1:
        raise ObjcommError(
            "async collectives on this subgroup need a second process group with its ranks, which torch can only "
            f"create when its members have created the same number of process groups (they have {counts}). "
            "Use blocking calls on this group, async_op=True on a group of every rank, or issue the first async "
            "collective before creating groups some members are not in"
        )
