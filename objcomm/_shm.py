"""Same-host fast path: the second round's bytes through POSIX shared memory, the control on the group.

When every rank a call involves runs on one host (see :mod:`objcomm._hosts`) and the bytes of the
second round (frames that overflow their slot, plus out-of-band CPU tensors) reach ``threshold``,
each sending rank writes its bytes into one file in ``directory`` (``/dev/shm``) and the group only
carries small integers:

1. every rank announces, in one ``all_gather`` of an int64, the sequence number of the segment it
   wrote (0: it sends nothing more; -1: it could not write, e.g. no space);
2. receivers map the segments they need and read from them (frames are decoded straight from the
   mapping; tensors are copied out, so no user-visible tensor points into shared memory);
3. one ``all_reduce`` says every reader is done (or failed), and each writer unlinks its segment.

Any -1 in step 1 or failure in step 2 sends *every* rank back to the normal transport for this call
(one debug line on the ``objcomm`` logger says why). A mapping outlives its file: readers still
holding a frame after the unlink keep valid memory until they drop it.

Names are ``objcomm-<token>-<pid>-<seq>-<part>``: the token is per job (agreed at discovery; for
send/recv, per sending process), the pid is the writer's. Segments are unlinked in a ``finally``
(exceptions, KeyboardInterrupt), at interpreter exit, and, for writers that died (SIGKILL), by any
rank that fails mid-call and by every discovery (the start of the next job): :func:`sweep` removes
``objcomm-*`` files whose writer pid is gone.

Mixed groups: collectives use shared memory only when the whole group shares one host, otherwise
they keep the normal transport; send/recv use it whenever the two ranks share a host.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import mmap
import os
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from . import _hosts, _transport  # _transport imports this module: use its names at call time
from ._settings import DEFAULT_SHM_THRESHOLD

if TYPE_CHECKING:
    from ._transport import Incoming, Outgoing

log = logging.getLogger("objcomm")

DEFAULT_THRESHOLD = DEFAULT_SHM_THRESHOLD
DEFAULT_DIRECTORY = "/dev/shm"
PREFIX = "objcomm-"
NOT_USED: Any = object()  # returned when the call must take the normal transport

_seq = itertools.count(1)
_process_token = secrets.randbits(63)  # names send/recv segments (no group-wide agreement there)
_owned: Set[str] = set()  # paths this process created and has not unlinked yet
_atexit_registered = False
_PAIR_REMOTE: Dict[Tuple[int, int, bool], bool] = {}  # (group id, peer, separate) -> peer is on another host


@dataclass(frozen=True)
class ShmConfig:
    """How the same-host path behaves; ``None`` on a ``Wire`` switches it off."""

    threshold: int = DEFAULT_THRESHOLD  # second-round bytes (largest sender) from which shared memory is used
    directory: str = DEFAULT_DIRECTORY
    separate: bool = False  # pretend every rank is on its own host (tests)


def config(
    enabled: Optional[bool], threshold: int, directory: Optional[str], separate: Optional[bool]
) -> Optional[ShmConfig]:
    """The path's configuration, environment included: ``OBJCOMM_SHM=0`` switches it off,
    ``OBJCOMM_FORCE_SEPARATE_HOSTS=1`` makes every rank its own host, ``OBJCOMM_SHM_DIR`` moves it."""
    if enabled is False or os.environ.get("OBJCOMM_SHM", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    forced = os.environ.get("OBJCOMM_FORCE_SEPARATE_HOSTS", "0").strip().lower() in ("1", "true", "yes", "on")
    return ShmConfig(
        threshold=threshold,
        directory=directory or os.environ.get("OBJCOMM_SHM_DIR") or DEFAULT_DIRECTORY,
        separate=bool(separate) or forced,
    )


# -- segments ----------------------------------------------------------------------------------
class _Segment:
    """One file in the shared-memory directory: written with ``write(2)`` by its owner, mapped by readers."""

    def __init__(self, path: str, mm: Optional[mmap.mmap], owner: bool) -> None:
        self.path = path
        self.mm = mm
        self.owner = owner

    @classmethod
    def create(cls, path: str, frame: Optional[memoryview], tensors: Sequence[torch.Tensor]) -> _Segment:
        """Write ``frame`` then ``tensors`` into a new file. Plain writes, not a mapping: a full
        filesystem raises ENOSPC here instead of SIGBUS, and the kernel fills pages faster than faults do."""
        size = (frame.nbytes if frame is not None else 0) + sum(t.numel() for t in tensors)
        _check_space(os.path.dirname(path), size)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        _track(path)
        try:
            pieces = ([frame] if frame is not None else []) + [_host_bytes(t) for t in tensors if t.numel()]
            for piece in pieces:
                while piece.nbytes:
                    piece = piece[os.write(fd, piece):]
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(path, None, owner=True)

    @classmethod
    def open(cls, path: str, size: int) -> _Segment:
        fd = os.open(path, os.O_RDWR)  # writable mapping: torch.frombuffer warns on read-only buffers
        try:
            if os.fstat(fd).st_size != size:
                raise OSError(f"segment {path} holds {os.fstat(fd).st_size} bytes, {size} were announced")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        return cls(path, mm, owner=False)

    def read(self, inline: Optional[memoryview], length: int, sizes_of: Callable[[memoryview], List[int]]) -> Incoming:
        """The frame (a view of the mapping when it was not inline) and copies of the tensors."""
        position = 0
        if inline is None:
            assert self.mm is not None
            frame = memoryview(self.mm)[:length]
            position = length
        else:
            frame = inline
        tensors = []
        for n in sizes_of(frame):
            if n:
                tensors.append(torch.frombuffer(self.mm, dtype=torch.uint8, count=n, offset=position).clone())
            else:
                tensors.append(torch.empty(0, dtype=torch.uint8))
            position += n
        return _transport.Incoming(frame, tensors)

    def release(self) -> None:
        """Unlink (writers); unmap (readers) unless a frame still points into the mapping (then GC unmaps it)."""
        if self.owner:
            _unlink(self.path)
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().reshape(-1).cpu().contiguous().numpy()).cast("B")  # type: ignore[arg-type]


def _check_space(directory: str, size: int) -> None:
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    if size > free:
        raise OSError(f"{directory} has {free:,} bytes free, {size:,} are needed")


def _track(path: str) -> None:
    global _atexit_registered
    _owned.add(path)
    if not _atexit_registered:
        atexit.register(_unlink_owned)
        _atexit_registered = True


def _unlink(path: str) -> None:
    _owned.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_owned() -> None:
    for path in list(_owned):
        _unlink(path)


def _name(directory: str, token: int, pid: int, seq: int, part: int) -> str:
    return os.path.join(directory, f"{PREFIX}{token:016x}-{pid}-{seq}-{part}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:  # a killed but unreaped process is a zombie: dead
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def sweep(directory: str = DEFAULT_DIRECTORY) -> List[str]:
    """Unlink ``objcomm-*`` segments whose writing process is gone; return their names."""
    removed: List[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name.split("-")[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _alive(pid):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:
                pass
    if removed:
        log.debug("objcomm shm: removed %d stale segment(s) of dead processes from %s", len(removed), directory)
    return removed


# -- control ------------------------------------------------------------------------------------
def _gather_ints(wire: Any, value: int, op: str) -> List[int]:
    every = torch.empty(wire.size, dtype=torch.int64)
    mine = torch.tensor([value], dtype=torch.int64)
    _transport._guarded(op, wire, _transport._all_gather_single, every, mine, group=wire.group)
    return every.tolist()


def _any(wire: Any, flag: bool, op: str) -> bool:
    value = torch.tensor([1 if flag else 0], dtype=torch.int64)
    _transport._guarded(op, wire, dist.all_reduce, value, op=dist.ReduceOp.MAX, group=wire.group)
    return bool(value.item())


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


def _collective(
    wire: Any, hosts: _hosts.Hosts, parts: Dict[int, Tuple[Optional[memoryview], Sequence[torch.Tensor]]],
    read: Callable[[List[int], Callable[[int, int, int], _Segment]], Any], op: str,
) -> Any:
    """Write ``parts`` (part number -> frame or None, tensors), agree, let ``read`` map what it needs, unlink."""
    cfg = wire.shm
    written: List[_Segment] = []
    mapped: List[_Segment] = []
    seq = 0
    try:
        if parts:
            seq = next(_seq)
            try:
                for part, (frame, tensors) in parts.items():
                    path = _name(cfg.directory, hosts.token, os.getpid(), seq, part)
                    written.append(_Segment.create(path, frame, tensors))
            except OSError as exc:
                log.debug("objcomm shm: %s on rank %d could not write shared memory (%s); normal transport",
                          op, wire.rank, exc)
                seq = -1
        seqs = _gather_ints(wire, seq, op)
        if min(seqs) < 0 or not any(seqs):  # a writer failed, or nobody wrote (scatter below the threshold)
            return NOT_USED

        def open_segment(writer: int, part: int, size: int) -> _Segment:
            segment = _Segment.open(_name(cfg.directory, hosts.token, hosts.pids[writer], seqs[writer], part), size)
            mapped.append(segment)
            return segment

        try:
            result, failed = read(seqs, open_segment), False
        except OSError as exc:
            log.debug("objcomm shm: %s on rank %d could not read shared memory (%s); normal transport",
                      op, wire.rank, exc)
            result, failed = NOT_USED, True
        if _any(wire, failed, op):
            return NOT_USED
        return result
    except BaseException:
        sweep(cfg.directory)  # a peer that died mid-call may have left its segments
        raise
    finally:
        for segment in written + mapped:
            segment.release()


# -- operations (called by the transport after round 1; NOT_USED: take the normal path) ----------
def _payload(out: Outgoing, frame_inline: bool) -> Tuple[Optional[memoryview], Sequence[torch.Tensor]]:
    return (None if frame_inline else out.frame), out.tensors


def _own(out: Outgoing, copy: bool) -> Incoming:
    return _transport.Incoming(out.frame, [t.to("cpu", copy=copy) for t in out.tensors])


def _read_every_rank(
    infos: Sequence[Any], moved: Sequence[int], me: int, out: Outgoing, sizes_of: Any,
    open_segment: Callable[[int, int, int], _Segment], copy_own: bool,
) -> List[Incoming]:
    """Each rank's part: this rank's own, a segment for those that wrote one, else what round 1 carried."""
    incoming = []
    for r, info in enumerate(infos):
        if r == me:
            incoming.append(_own(out, copy=copy_own))
        elif moved[r]:
            incoming.append(open_segment(r, 0, moved[r]).read(info.inline, info.length, sizes_of))
        else:
            incoming.append(_transport.Incoming(info.inline))
    return incoming


def all_gather(wire: Any, out: Outgoing, infos: Sequence[Any], sizes_of: Any, op: str) -> Any:
    moved = [second_round_bytes(info) for info in infos]
    hosts = _hosts_for(wire, max(moved), op)
    if hosts is None:
        return NOT_USED
    me = wire.rank
    parts = {0: _payload(out, infos[me].inline is not None)} if moved[me] else {}

    def read(seqs: List[int], open_segment: Callable[[int, int, int], _Segment]) -> List[Incoming]:
        return _read_every_rank(infos, moved, me, out, sizes_of, open_segment, copy_own=True)  # never alias input

    return _collective(wire, hosts, parts, read, op)


def gather(wire: Any, out: Outgoing, infos: Sequence[Any], sizes_of: Any, dst: int, op: str) -> Any:
    moved = [0 if r == dst else second_round_bytes(info) for r, info in enumerate(infos)]
    hosts = _hosts_for(wire, max(moved), op)
    if hosts is None:
        return NOT_USED
    me = wire.rank
    parts = {0: _payload(out, infos[me].inline is not None)} if moved[me] else {}

    def read(seqs: List[int], open_segment: Callable[[int, int, int], _Segment]) -> Optional[List[Incoming]]:
        if me != dst:
            return None
        # the caller decodes its own with own=True, so no copy here
        return _read_every_rank(infos, moved, me, out, sizes_of, open_segment, copy_own=False)

    return _collective(wire, hosts, parts, read, op)


def broadcast(wire: Any, out: Optional[Outgoing], info: Any, sizes_of: Any, src: int, op: str) -> Any:
    moved = second_round_bytes(info)
    hosts = _hosts_for(wire, moved, op)
    if hosts is None:
        return NOT_USED
    parts = {0: _payload(out, info.inline is not None)} if wire.rank == src and out is not None else {}

    def read(seqs: List[int], open_segment: Callable[[int, int, int], _Segment]) -> Incoming:
        if wire.rank == src:
            assert out is not None
            return _own(out, copy=False)  # the caller decodes its own with own=True
        return open_segment(src, 0, moved).read(info.inline, info.length, sizes_of)

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

    def read(seqs: List[int], open_segment: Callable[[int, int, int], _Segment]) -> Incoming:
        if wire.rank == src:
            assert outs is not None
            return _own(outs[src], copy=False)
        size = second_round_bytes(info)
        if not size:
            return _transport.Incoming(info.inline)
        return open_segment(src, wire.rank, size).read(info.inline, info.length, sizes_of)

    return _collective(wire, hosts, parts, read, op)


# -- point to point ------------------------------------------------------------------------------
_P2P = 4  # seq (or -1), pid, token, host key


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
                path = _name(cfg.directory, _process_token, os.getpid(), seq, 0)
                segment = _Segment.create(path, *_payload(out, out.frame.nbytes <= wire.inline_capacity))
            except OSError as exc:
                log.debug("objcomm shm: %s could not write shared memory (%s); normal transport", op, exc)
                seq = -1
        status = torch.tensor([seq, os.getpid(), _process_token, _hosts.host_key(cfg.separate)], dtype=torch.int64)
        _transport._guarded(op, wire, dist.send, status, dst=wire.ranks[dst], group=wire.group)
        if seq < 0:
            return False
        answer = torch.empty(1, dtype=torch.int64)
        _transport._guarded(op, wire, dist.recv, answer, src=wire.ranks[dst], group=wire.group)
        if answer.item() == 1:
            _PAIR_REMOTE[_pair_key(wire, dst)] = True
            log.debug("objcomm shm: %s to rank %d crosses hosts; normal transport", op, dst)
        return answer.item() == 0
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
    _transport._guarded(op, wire, dist.recv, status, src=wire.ranks[src], group=wire.group)
    seq, pid, token, key = status.tolist()
    if seq < 0:
        return NOT_USED
    answer, result = 1, NOT_USED
    if key == _hosts.host_key(cfg.separate):
        try:
            segment = _Segment.open(_name(cfg.directory, token, pid, seq, 0), second_round_bytes(info))
            result, answer = segment.read(info.inline, info.length, sizes_of), 0
            segment.release()
        except OSError as exc:
            log.debug("objcomm shm: %s could not read shared memory (%s); normal transport", op, exc)
            answer = 2
    else:
        log.debug("objcomm shm: %s from rank %d crosses hosts; normal transport", op, src)
    reply = torch.tensor([answer], dtype=torch.int64)
    _transport._guarded(op, wire, dist.send, reply, dst=wire.ranks[src], group=wire.group)
    return result
