"""Sends that outlive their call: what ``isend`` captures when it is called, and the small sends the backend holds
until their receivers take them (issue 25).

**isend captures its object.** mpi4py pickles an object when ``isend`` is called; so does objcomm: the caller's
thread encodes it, and :func:`captured` copies whatever of the result still shares memory with the object (the
bytes of small tensors, numpy arrays and buffers written into the frame, and the tensors, arrays and large
``bytes``/``bytearray`` that travel out of band: a CPU copy each, taken when ``isend`` is called), so that the
caller may change the object, its tensors included, as soon as ``isend`` returns.

**Small sends return at once on every path.** Through the same-host channel a send returns once the kernel holds its
bytes; gloo's send waits until its receiver posts the receive. So a ring of blocking sends (each rank sends to the
next, then receives from the previous, as mpi4py programs do) completed on one host and hung across hosts. Now a send
through the group whose slot carries the whole message (or an error report: no second round follows), or that goes
in one message with its rest (:func:`objcomm._transport.routes.backend_whole`: a medium rest on a CPU group), is
posted with ``dist.isend`` and left here (:func:`post`), as MPI's eager protocol buffers small messages:

- at most :data:`MOST_SENDS` such sends, holding at most :data:`MOST_BYTES` bytes, wait for their receivers
  per group on this rank (with the default 4 KiB slot the count binds first for slots alone: 1024 sends, 4 MiB;
  the bytes for messages with their rest: about 250 of up to 64 KiB. It was 64 sends, 4 MiB: a worker that sent
  500 progress messages under one tag while its master waited for another tag waited until the timeout, where
  the same-host channel, which holds up to 8 MiB a peer (less past 4 ranks a host), took them); a send past the
  bound waits until the oldest are received, the group's timeout at most (the channel bounds what it holds too);
- a thread per (group, receiver) with sends pending waits for them in order (gloo tells a send's end to a waiter
  only: a wait with a timeout that expires breaks the group's connections), and ends :data:`LINGER` seconds after
  none is left;
- a pending send that fails (its receiver died, or did not receive it within the group's timeout) is reported by
  the next ``send`` or ``recv`` of this rank on the group (:func:`check`), as a
  :class:`~objcomm.CommunicationError` that names the send;
- at exit this process waits for its pending sends, each group's timeout at most, and warns about those that were
  not received (:func:`drain`): a program that sends and ends still delivers. ``dist.destroy_process_group`` does not
  drop them either: a pending send keeps its transfer alive until it ends.

Messages between two ranks under one tag keep their order: gloo matches a pair's sends and receives under one tag
in posting order, and a large send (whose slot goes with a blocking send, then its second round) is posted after the
small ones before it. Large sends, and every send through an NCCL group's backend (where objcomm keeps point-to-point
blocking), wait for their receivers as before. The send an ``isend`` runs in the background is eager where a
blocking send is: its ``wait()`` returns once a small message is posted here.

On one host, send/recv move to the same-host channel (:mod:`objcomm._samehost.channel_slots`) at a collective where no
rank has a send/recv in flight; a pending send counts as one (:func:`idle`: the vote first waits a moment for the
pending sends to be received, then votes no while any is left).
"""

from __future__ import annotations

import atexit
import os
import re
import threading
import time
import warnings
import weakref
from collections import deque
from typing import Any, Deque, Dict, List, NamedTuple, Set, Tuple

import torch
import torch.distributed as dist

from objcomm._device import timeout_seconds
from objcomm._errors import CommunicationError
from objcomm._format.message import Outgoing
from objcomm._transport.base import Wire, guarded

MOST_SENDS = 1024  # pending eager sends per group on one rank
MOST_BYTES = 16 << 20  # and the bytes of their slots
LINGER = 0.05  # seconds a receiver's thread waits for another send once none is left (a loop of sends keeps one)


# -- isend: the object as it was at the call -----------------------------------------------------------------------
def captured(out: Outgoing) -> Outgoing:
    """``out`` owning every byte it sends: frame parts that are not immutable ``bytes`` are copied (the payload of
    a serializer that returns a view, the inline bytes of small tensors and arrays), and every out-of-band tensor is
    copied to the CPU. What an ``isend`` sends later is then what its object was when it was called."""
    if out.error:  # an error report owns its frame
        return out
    parts = [part if _immutable(part) else bytes(part) for part in out.parts]
    tensors = [tensor.to("cpu", copy=True) for tensor in out.tensors]  # from a CUDA tensor: a synchronous copy
    return Outgoing(parts=parts, tensors=tensors, nbytes=out.frame_nbytes)


def _immutable(part: Any) -> bool:
    if type(part) is bytes:
        return True
    return type(part) is memoryview and part.readonly and type(part.obj) is bytes


# -- eager sends ---------------------------------------------------------------------------------------------------
class _Sent(NamedTuple):
    """One pending send: its transfer, and its slot (kept alive until the transfer ends)."""

    work: Any
    slot: torch.Tensor
    tag: int


Lane = Tuple[int, int]  # (receiver's global rank, tag)


class _Sends:
    """One group's pending eager sends on this rank, per receiver (global rank) and tag, oldest first: gloo matches a
    pair's messages of one tag in order, and a tag's sends that were received leave the count whatever another tag's
    wait for (a helper's find: one unreceived send under tag 0 held 63 received ones under tag 1 in the count, and
    the 64th waited for the group's timeout)."""

    def __init__(self, timeout: float) -> None:
        self.cond = threading.Condition()
        self.queues: Dict[Lane, Deque[_Sent]] = {}  # a lane's queue exists while it has sends, and its thread
        self.count = 0
        self.bytes = 0
        self.timeout = timeout  # the group's, in seconds
        self.failures: List[str] = []  # not reported yet
        self.rank = -1  # this rank's group rank, for messages

    def post(self, wire: Wire, slot: torch.Tensor, dst: int, op: str) -> None:
        peer, size = wire.ranks[dst], slot.numel()
        with self.cond:
            self.rank = wire.rank
            self._raise_failures(op)
            if not self.cond.wait_for(lambda: self._room(size) or bool(self.failures), self.timeout):
                raise CommunicationError(
                    f"{op} on rank {wire.rank}: {self.count} earlier sends of this rank on this group were not "
                    f"received within the group's timeout of {self.timeout:.0f}s, and at most {MOST_SENDS} (or "
                    f"{MOST_BYTES >> 20} MiB) may wait for their receivers. Does every rank receive what it is sent?"
                )
            self._raise_failures(op)
            work = guarded(op, wire, dist.isend, slot, dst=peer, group=wire.group, tag=wire.data_tag)
            lane = (peer, wire.tag)
            queue = self.queues.get(lane)
            start = queue is None
            if queue is None:
                queue = self.queues[lane] = deque()
            queue.append(_Sent(work, slot, wire.tag))
            self.count += 1
            self.bytes += size
            _LIVE.add(self)
            self.cond.notify_all()  # a waiting thread of this receiver takes it
        if start:
            threading.Thread(target=self._reap, args=(lane, queue), name="objcomm-eager-send", daemon=True).start()

    def _room(self, size: int) -> bool:
        return self.count == 0 or (self.count < MOST_SENDS and self.bytes + size <= MOST_BYTES)

    def _reap(self, lane: Lane, queue: Deque[_Sent]) -> None:
        """Wait for the sends of ``lane`` (receiver, tag) in order; the thread ends when none is left for
        :data:`LINGER` seconds."""
        peer = lane[0]
        while True:
            with self.cond:
                if not queue and not self.cond.wait_for(lambda: bool(queue), LINGER):
                    del self.queues[lane]
                    self.cond.notify_all()  # drain() waits for every thread to end
                    if not self.count and not self.failures:
                        _LIVE.discard(self)
                    return
                sent = queue[0]
            failure = None
            try:
                sent.work.wait()  # the group's timeout bounds it
            except Exception as exc:  # noqa: BLE001 - whatever the backend raised, reported by the next call
                failure = (
                    f"an earlier send of this rank to rank {peer} (tag {sent.tag}) returned before rank {peer} "
                    f"received it, and it was not received: {_said(exc)}"
                )
            with self.cond:
                if failure is not None and not self._room(1):  # the bound held the sends after it back
                    failure += (
                        f" ({self.count} sends of this rank were waiting for their receivers, the most it keeps: "
                        f"{MOST_SENDS}, or {MOST_BYTES >> 20} MiB; a send past them waited for room. A receiver that "
                        "first waits for a message under another tag, which this rank sends after them, never gets "
                        "it: receive in between, or irecv first; docs/from-mpi4py.md, \"Waits end at the group's "
                        'timeout")'
                    )
                queue.popleft()
                self.count -= 1
                self.bytes -= sent.slot.numel()
                if failure is not None:
                    self.failures.append(failure)
                self.cond.notify_all()
            del sent

    def _raise_failures(self, op: str) -> None:
        """Raise the failures of pending sends not reported yet (called holding ``cond``)."""
        if not self.failures:
            return
        failures, self.failures = self.failures, []
        more = f" ({len(failures) - 1} more such sends failed)" if len(failures) > 1 else ""
        raise CommunicationError(
            f"{op} on rank {self.rank}: {failures[0]}{more}. A rank may have crashed or never called recv for it; "
            "the group's timeout (init_process_group(timeout=...)) bounds how long a send waits for its receiver"
        )

    def threads_end(self, within: float) -> None:
        """Wait until every receiver's thread ended (:data:`LINGER` after its last send), ``within`` s at most."""
        with self.cond:
            self.cond.wait_for(lambda: not self.queues, within)

    def wait_all(self, until: float) -> List[str]:
        """Wait until every pending send ended or the monotonic clock reads ``until``; what is left to report."""
        with self.cond:
            self.cond.wait_for(lambda: not self.count, max(0.0, until - time.monotonic()))
            left = list(self.failures)
            if self.count:
                left.append(f"{self.count} sends of rank {self.rank} were not received within {self.timeout:.0f}s")
            self.failures = []
            return left


_GROUPS: weakref.WeakKeyDictionary[Any, _Sends] = weakref.WeakKeyDictionary()
_GROUPS_LOCK = threading.Lock()
_LIVE: Set[_Sends] = set()  # those with sends pending or failures unreported: kept to the end, whatever the group


def _sends(group: Any) -> _Sends:
    found = _GROUPS.get(group)
    if found is None:
        with _GROUPS_LOCK:
            found = _GROUPS.get(group)
            if found is None:
                found = _GROUPS[group] = _Sends(timeout_seconds(group))
    return found


def post(wire: Wire, slot: torch.Tensor, dst: int, op: str) -> None:
    """Post ``slot``, a whole message (a slot that carries it or an error report, or a slot with its rest), to group
    rank ``dst`` under ``wire.data_tag`` and return
    without waiting for its receiver. Raises :class:`~objcomm.CommunicationError` for an earlier pending send that
    failed, or when the bound stays reached for the group's timeout."""
    _sends(wire.group).post(wire, slot, dst, op)


def check(group: Any, op: str) -> None:
    """Raise :class:`~objcomm.CommunicationError` for a pending send of this rank on ``group`` that failed and was
    not reported yet (every send and recv calls it first)."""
    found = _GROUPS.get(group)
    if found is not None and found.failures:
        with found.cond:
            found._raise_failures(op)


def _said(exc: BaseException) -> str:
    """What the backend said, without gloo's source location and its guess that a peer crashed (a peer that exited,
    its receives done, closes the connection too: a helper's find, where the warning read like a crash)."""
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", str(exc))
    return text.split(". This is typically caused by", 1)[0]


def idle(group: Any, within: float = 0.0) -> bool:
    """Whether this rank has no send pending on ``group``, waiting up to ``within`` seconds for those there are
    to be received (a vote on moving send/recv to the same-host channel counts them as in flight)."""
    found = _GROUPS.get(group)
    if found is None:
        return True
    with found.cond:
        return found.cond.wait_for(lambda: not found.count, within) if within > 0 else not found.count


def drain() -> None:
    """Wait for this process's pending sends, each group's timeout at most (at exit); warn about any not received."""
    start = time.monotonic()
    for sends in list(_LIVE):
        for problem in sends.wait_all(start + sends.timeout):
            warnings.warn(f"objcomm: {problem}", RuntimeWarning, stacklevel=1)
        sends.threads_end(10 * LINGER)  # none left inside torch while the interpreter shuts down
    _LIVE.clear()


def _forget_in_child() -> None:
    """A forked child has no thread waiting for its parent's sends: it keeps none, and never touches theirs."""
    _ABANDONED.append((dict(_GROUPS), set(_LIVE)))
    _GROUPS.clear()
    _LIVE.clear()


_ABANDONED: List[Any] = []  # a forked child's copies of its parent's sends: never waited for, never destroyed
os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(drain)  # registered after torch (imported first), so it runs before torch's own exit hooks
