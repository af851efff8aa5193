"""Same-host fast path: the second round's bytes through POSIX shared memory, the control on the group.

When every rank a call involves runs on one host (see :mod:`objcomm._hosts`) and the bytes of the
second round (frames that overflow their slot, plus out-of-band CPU tensors) reach ``threshold``,
each sending rank writes its bytes into one segment file in ``directory`` (``/dev/shm``) and the group
only carries small integers:

1. every rank announces, in one ``all_gather`` of an int64, the sequence number of the segment it
   wrote (0: it sends nothing more; -1: it could not write, e.g. no space);
2. receivers read the segments they need into fresh memory (:func:`objcomm._segments.read_segment`,
   ``pread``, no mapping);
3. one ``all_reduce`` says whether every reader is done, one could not read, or one refused a segment;
   then each writer unlinks its segment.

A reader that could not read (an ``OSError``: the file is gone, ...) sends *every* rank back to the
normal transport for this call (one debug line on the ``objcomm`` logger says why). A reader that
*refuses* a segment raises :class:`~objcomm.FrameError` alone, like a rank that cannot decode what
arrived; the others keep their results and the group stays in step.

Segment files themselves (how they are written, checked and read, their names, and :func:`sweep`,
which removes those of dead writers) are :mod:`objcomm._segments`. This module unlinks what it wrote
in a ``finally`` (exceptions, KeyboardInterrupt), and sweeps when a rank fails mid-call and at every
discovery (the start of the next job).

Mixed groups: collectives use shared memory only when the whole group shares one host, otherwise
they keep the normal transport; send/recv use it whenever the two ranks share a host.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _hosts
from ._errors import CommunicationError
from ._segments import DEFAULT_DIRECTORY, _me, _name, _Segment, _this_host, _Writer, read_segment, sweep
from ._settings import DEFAULT_SHM_THRESHOLD
from ._wire import Incoming, Outgoing, all_gather_single, guarded

log = logging.getLogger("objcomm")

DEFAULT_THRESHOLD = DEFAULT_SHM_THRESHOLD
NOT_USED: Any = object()  # returned when the call must take the normal transport

_seq = itertools.count(1)
_process_token = secrets.randbits(63)  # names send/recv segments (no group-wide agreement there)
_PAIR_REMOTE: Dict[Tuple[int, int, bool], bool] = {}  # (group id, peer, separate) -> peer is on another host

_READ, _FELL_BACK, _REFUSED = 0, 1, 2  # what a reader reports after step 2; the largest wins


@dataclass(frozen=True)
class ShmConfig:
    """How the same-host path behaves; ``None`` on a ``Wire`` switches it off."""

    threshold: int = DEFAULT_THRESHOLD  # second-round bytes (largest sender) from which shared memory is used
    directory: str = DEFAULT_DIRECTORY
    separate: bool = False  # pretend every rank is on its own host (tests)


def config(enabled: bool, threshold: int, directory: Optional[str], separate: bool) -> Optional[ShmConfig]:
    """The path's configuration from resolved settings (:func:`objcomm._settings.resolve`; the
    environment is read there); ``None`` when switched off."""
    if not enabled:
        return None
    return ShmConfig(threshold=threshold, directory=directory or DEFAULT_DIRECTORY, separate=separate)


# -- control ------------------------------------------------------------------------------------
def _gather_ints(wire: Any, value: int, op: str) -> List[int]:
    every = torch.empty(wire.size, dtype=torch.int64)
    mine = torch.tensor([value], dtype=torch.int64)
    guarded(op, wire, all_gather_single, every, mine, group=wire.group)
    return every.tolist()


def _any(wire: Any, value: int, op: str) -> int:
    """The largest ``value`` any rank gave."""
    largest = torch.tensor([value], dtype=torch.int64)
    guarded(op, wire, dist.all_reduce, largest, op=dist.ReduceOp.MAX, group=wire.group)
    return int(largest.item())


def second_round_bytes(info: Any) -> int:
    """Second-round bytes of one sender: its frame unless it fit the slot, and its tensors."""
    return (0 if info.inline is not None else info.length) + info.total - info.length


def log_below_threshold(wire: Any, moved: int, op: str) -> None:
    if wire.device.type == "cpu":
        log.debug("objcomm shm: %s moves %d bytes, below the threshold of %d; normal transport",
                  op, moved, wire.shm.threshold)


def _hosts_for(wire: Any, largest: int, op: str) -> Optional[_hosts.Hosts]:
    """The group's hosts when the call may use shared memory (same decision on every rank), else None."""
    cfg = wire.shm
    if wire.device.type != "cpu":
        return None
    if largest < cfg.threshold:
        log_below_threshold(wire, largest, op)
        return None
    hosts = _hosts.known(wire.group, cfg.separate)
    if hosts is None:
        hosts = _hosts.discover(wire, cfg.separate, op)
        sweep(cfg.directory)  # a new job on this host: clear what dead jobs left
    if not hosts.one_host:
        log.debug("objcomm shm: %s spans %d hosts; normal transport", op, len(set(hosts.keys)))
        return None
    return hosts


PathOf = Callable[[int, int], str]  # (writer's group rank, part) -> path of that segment


def _collective(
    wire: Any, hosts: _hosts.Hosts, parts: Dict[int, Tuple[Optional[memoryview], Sequence[torch.Tensor]]],
    read: Callable[[PathOf], Any], op: str,
) -> Any:
    """Write ``parts`` (part number -> frame or None, tensors), agree, let ``read`` read what it needs, unlink."""
    cfg = wire.shm
    written: List[_Segment] = []
    seq = 0
    try:
        if parts:
            seq = next(_seq)
            try:
                for part, (frame, tensors) in parts.items():
                    written.append(_Segment.create(_name(cfg.directory, _me(hosts.token), seq, part), frame, tensors))
            except OSError as exc:
                log.debug("objcomm shm: %s on rank %d could not write shared memory (%s); normal transport",
                          op, wire.rank, exc)
                seq = -1
        seqs = _gather_ints(wire, seq, op)
        if min(seqs) < 0 or not any(seqs):  # a writer failed, or nobody wrote (scatter below the threshold)
            return NOT_USED

        def path_of(writer: int, part: int) -> str:
            who = _Writer(_this_host(), hosts.pid_namespaces[writer], hosts.token, hosts.pids[writer])
            return _name(cfg.directory, who, seqs[writer], part)

        failure: Optional[Exception] = None
        try:
            result, outcome = read(path_of), _READ
        except OSError as exc:
            log.debug("objcomm shm: %s on rank %d could not read shared memory (%s); normal transport",
                      op, wire.rank, exc)
            result, outcome, failure = NOT_USED, _FELL_BACK, exc
        except Exception as exc:  # a refused segment: raised below, once every rank knows
            result, outcome, failure = NOT_USED, _REFUSED, exc
        worst = _any(wire, outcome, op)
        if worst == _FELL_BACK:
            return NOT_USED
        if isinstance(failure, OSError):  # another rank refused, so nobody takes the normal transport
            raise CommunicationError(f"{op} on rank {wire.rank} could not read shared memory: {failure}") from failure
        if failure is not None:
            raise failure
        return result
    except BaseException:
        sweep(cfg.directory)  # a peer that died mid-call may have left its segments
        raise
    finally:
        for segment in written:
            segment.release()


# -- operations (called by the transport after round 1; NOT_USED: take the normal path) ----------
def _payload(out: Outgoing, frame_inline: bool) -> Tuple[Optional[memoryview], Sequence[torch.Tensor]]:
    return (None if frame_inline else out.frame), out.tensors


def _own(out: Outgoing, copy: bool) -> Incoming:
    return Incoming(out.frame, [t.to("cpu", copy=copy) for t in out.tensors])


def _read_every_rank(
    infos: Sequence[Any], moved: Sequence[int], me: int, out: Outgoing, sizes_of: Any, path_of: PathOf, copy_own: bool,
) -> List[Incoming]:
    """Each rank's part: this rank's own, a segment for those that wrote one, else what round 1 carried."""
    incoming = []
    for r, info in enumerate(infos):
        if r == me:
            incoming.append(_own(out, copy=copy_own))
        elif moved[r]:
            incoming.append(read_segment(path_of(r, 0), moved[r], info.inline, info.length, sizes_of))
        else:
            incoming.append(Incoming(info.inline))
    return incoming


def all_gather(wire: Any, out: Outgoing, infos: Sequence[Any], sizes_of: Any, op: str) -> Any:
    moved = [second_round_bytes(info) for info in infos]
    hosts = _hosts_for(wire, max(moved), op)
    if hosts is None:
        return NOT_USED
    me = wire.rank
    parts = {0: _payload(out, infos[me].inline is not None)} if moved[me] else {}

    def read(path_of: PathOf) -> List[Incoming]:
        return _read_every_rank(infos, moved, me, out, sizes_of, path_of, copy_own=True)  # never alias input

    return _collective(wire, hosts, parts, read, op)


def gather(wire: Any, out: Outgoing, infos: Sequence[Any], sizes_of: Any, dst: int, op: str) -> Any:
    moved = [0 if r == dst else second_round_bytes(info) for r, info in enumerate(infos)]
    hosts = _hosts_for(wire, max(moved), op)
    if hosts is None:
        return NOT_USED
    me = wire.rank
    parts = {0: _payload(out, infos[me].inline is not None)} if moved[me] else {}

    def read(path_of: PathOf) -> Optional[List[Incoming]]:
        if me != dst:
            return None
        # the caller decodes its own with own=True, so no copy here
        return _read_every_rank(infos, moved, me, out, sizes_of, path_of, copy_own=False)

    return _collective(wire, hosts, parts, read, op)


def broadcast(wire: Any, out: Optional[Outgoing], info: Any, sizes_of: Any, src: int, op: str) -> Any:
    moved = second_round_bytes(info)
    hosts = _hosts_for(wire, moved, op)
    if hosts is None:
        return NOT_USED
    parts = {0: _payload(out, info.inline is not None)} if wire.rank == src and out is not None else {}

    def read(path_of: PathOf) -> Incoming:
        if wire.rank == src:
            assert out is not None
            return _own(out, copy=False)  # the caller decodes its own with own=True
        return read_segment(path_of(src, 0), moved, info.inline, info.length, sizes_of)

    return _collective(wire, hosts, parts, read, op)


def scatter(wire: Any, outs: Optional[Sequence[Outgoing]], info: Any, sizes_of: Any, src: int, op: str) -> Any:
    """Receivers cannot see the others' sizes, so ``src`` decides and the first exchange tells them."""
    hosts = _hosts_for(wire, wire.shm.threshold, op)  # every rank reaches here: the threshold is checked below
    if hosts is None:
        return NOT_USED
    parts: Dict[int, Tuple[Optional[memoryview], Sequence[torch.Tensor]]] = {}
    if wire.rank == src:
        assert outs is not None
        frame_inline = [o.frame.nbytes <= wire.inline_capacity for o in outs]
        moved = [(0 if inline else o.frame.nbytes) + sum(t.numel() for t in o.tensors)
                 for o, inline in zip(outs, frame_inline)]
        moved[src] = 0
        if max(moved) >= wire.shm.threshold:
            parts = {r: _payload(o, frame_inline[r]) for r, o in enumerate(outs) if moved[r]}
        else:
            log.debug("objcomm shm: %s moves at most %d bytes per rank, below the threshold of %d; normal transport",
                      op, max(moved), wire.shm.threshold)

    def read(path_of: PathOf) -> Incoming:
        if wire.rank == src:
            assert outs is not None
            return _own(outs[src], copy=False)
        size = second_round_bytes(info)
        if not size:
            return Incoming(info.inline)
        return read_segment(path_of(src, wire.rank), size, info.inline, info.length, sizes_of)

    return _collective(wire, hosts, parts, read, op)


# -- point to point ------------------------------------------------------------------------------
_P2P = 5  # seq (or -1), pid, token, host key, pid namespace
_SENT, _OTHER_HOST, _RESEND, _REFUSED_P2P = 0, 1, 2, 3  # the receiver's answer


def _pair_key(wire: Any, peer: int) -> Tuple[int, int, bool]:
    return (id(wire.group), peer, wire.shm.separate)


def send(wire: Any, out: Outgoing, dst: int, op: str) -> bool:
    """Send the second round through shared memory; False: the caller sends it the normal way."""
    cfg = wire.shm
    moved = (0 if out.frame.nbytes <= wire.inline_capacity else out.frame.nbytes) + sum(t.numel() for t in out.tensors)
    if wire.device.type != "cpu" or moved < cfg.threshold:
        log_below_threshold(wire, moved, op)
        return False
    segment: Optional[_Segment] = None
    seq = -1
    try:
        if _PAIR_REMOTE.get(_pair_key(wire, dst)):
            log.debug("objcomm shm: %s to rank %d crosses hosts; normal transport", op, dst)
        else:
            try:
                seq = next(_seq)
                path = _name(cfg.directory, _me(_process_token), seq, 0)
                segment = _Segment.create(path, *_payload(out, out.frame.nbytes <= wire.inline_capacity))
            except OSError as exc:
                log.debug("objcomm shm: %s could not write shared memory (%s); normal transport", op, exc)
                seq = -1
        status = torch.tensor([seq, os.getpid(), _process_token, _hosts.host_key(cfg.separate),
                               _hosts.pid_namespace()], dtype=torch.int64)
        guarded(op, wire, dist.send, status, dst=wire.ranks[dst], group=wire.group)
        if seq < 0:
            return False
        answer = torch.empty(1, dtype=torch.int64)
        guarded(op, wire, dist.recv, answer, src=wire.ranks[dst], group=wire.group)
        if answer.item() == _OTHER_HOST:
            _PAIR_REMOTE[_pair_key(wire, dst)] = True
            log.debug("objcomm shm: %s to rank %d crosses hosts; normal transport", op, dst)
        return answer.item() in (_SENT, _REFUSED_P2P)  # a refusing receiver raises; it expects nothing more
    finally:
        if segment is not None:
            segment.release()


def recv(wire: Any, info: Any, sizes_of: Any, src: int, op: str) -> Any:
    """The sender's second round from shared memory, or NOT_USED: the caller receives it the normal way."""
    cfg = wire.shm
    if wire.device.type != "cpu" or second_round_bytes(info) < cfg.threshold:
        log_below_threshold(wire, second_round_bytes(info), op)
        return NOT_USED
    status = torch.empty(_P2P, dtype=torch.int64)
    guarded(op, wire, dist.recv, status, src=wire.ranks[src], group=wire.group)
    seq, pid, token, key, namespace = status.tolist()
    if seq < 0:
        return NOT_USED
    answer, result, failure = _OTHER_HOST, NOT_USED, None
    if key == _hosts.host_key(cfg.separate):
        path = _name(cfg.directory, _Writer(_this_host(), namespace, token, pid), seq, 0)
        try:
            result, answer = read_segment(path, second_round_bytes(info), info.inline, info.length, sizes_of), _SENT
        except OSError as exc:
            log.debug("objcomm shm: %s could not read shared memory (%s); normal transport", op, exc)
            answer = _RESEND
        except Exception as exc:  # a refused segment: raised once the sender knows not to send it again
            answer, failure = _REFUSED_P2P, exc
    else:
        log.debug("objcomm shm: %s from rank %d crosses hosts; normal transport", op, src)
    reply = torch.tensor([answer], dtype=torch.int64)
    guarded(op, wire, dist.send, reply, dst=wire.ranks[src], group=wire.group)
    if failure is not None:
        raise failure
    return result
