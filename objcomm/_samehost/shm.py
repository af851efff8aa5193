"""Same-host fast path: the second round's bytes through POSIX shared memory, the control words through
the group's same-host channel (:mod:`objcomm._samehost.channel`) or, without one, the group.

When every rank a call involves runs on one host (see :mod:`objcomm._samehost.hosts`) and the bytes of the
second round (frames that overflow their slot, plus out-of-band CPU tensors) reach ``threshold``,
each sending rank writes its bytes into one segment and the group only carries small integers. A
segment is a sealed memory file (:mod:`objcomm._samehost.sealed`; receivers map it, so what they get are
views, no copy) when ``zero_copy`` is on and every rank shares one pid namespace, else a file in
``directory`` (``/dev/shm``) that receivers copy:

1. every rank announces, in one ``all_gather`` of ``1 + W`` int64s, the sequence number of what it
   wrote (0: it sends nothing more; -1: it could not write, e.g. no space) and, per part, where it
   is (:func:`~objcomm._samehost.shm_parts._where`: the descriptor of a sealed segment, or minus the identity of
   a file);
2. receivers map the sealed segments they need (:func:`objcomm._samehost.sealed.map_sealed`), or read the
   files into fresh memory (:func:`objcomm._samehost.segments.read_segment`, ``pread``, no mapping);
3. one ``all_reduce`` says whether every reader is done, one could not read, or one refused a segment;
   then each writer unlinks its segment.

A reader that could not read (an ``OSError``: the file is gone, ``/proc/<pid>/fd`` cannot be opened,
...) sends *every* rank back to the normal transport for this call (one debug line on the ``objcomm``
logger says why); when a rank could not open a sealed segment at all
(:class:`objcomm._samehost.sealed.Unopenable`), the group uses files from then on. A reader that
*refuses* a segment raises :class:`~objcomm.FrameError` alone, like a rank that cannot decode what
arrived; the others keep their results and the group stays in step.

:class:`SharedMemory` is a :class:`objcomm._transport.base.RestMedia`: the transport
asks it once per call after round 1 and moves the bytes itself when it answers ``NOT_USED``. One
method, :meth:`SharedMemory.hosts_for`, decides whether a call may use it (CPU, enough bytes, one
host). Segment files themselves (how they are written, checked and read, their names, and
:func:`~objcomm._samehost.segments.sweep`, which removes those of dead writers) are :mod:`objcomm._samehost.segments`;
the bookkeeping of those a process wrote is a :class:`~objcomm._samehost.segments.SegmentBook` it is given.
What a call writes and how it is read back are :mod:`objcomm._samehost.shm_parts`; the words and answer of a
send/recv, :mod:`objcomm._samehost.shm_p2p`.
This module unlinks what it wrote in a ``finally`` (exceptions, KeyboardInterrupt), and sweeps when
a rank fails mid-call and when a group first asks for its hosts here (the start of the next job).

Mixed groups: collectives use shared memory only when the whole group shares one host, otherwise
they keep the normal transport; send/recv use it whenever the two ranks share a host.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Dict, List, Optional, TypeVar, Union

import torch

from objcomm import _state
from objcomm._device import is_cpu
from objcomm._errors import CommunicationError
from objcomm._format import limits as _limits
from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._format.slot import SlotInfo, outgoing_second_round_bytes
from objcomm._samehost import hosts as _hosts
from objcomm._samehost import shm_p2p as _shm_p2p
from objcomm._samehost.sealed import Sealed, SealedSegment, Unopenable
from objcomm._samehost.segments import (
    DEFAULT_DIRECTORY,
    SEGMENTS,
    SegmentBook,
    SegmentFile,
    _me,
    _name,
    _Segment,
    _this_host,
    _Writer,
    sweep,
)
from objcomm._samehost.shm_parts import Part, Source, SourceOf, _part, _where, fetch
from objcomm._settings import DEFAULT_SHM_THRESHOLD
from objcomm._transport import routes
from objcomm._transport.base import NOT_USED, NotUsed, Route, Wire, all_gather_single, guarded, largest_of
from objcomm._transport.patterns import Pattern
from objcomm._transport.rests import Due, Mine, PatternRests, Rest

log = logging.getLogger("objcomm")

DEFAULT_THRESHOLD = DEFAULT_SHM_THRESHOLD
T = TypeVar("T")

_READ, _FELL_BACK, _REFUSED = 0, 1, 2  # what a reader reports after step 2; the largest wins
_COLLECTIVES = -1  # the key under which a group remembers that its collectives cannot use sealed segments


@dataclass(frozen=True)
class SharedMemory(PatternRests):
    """The second round through segment files when the ranks a call involves share a host."""

    threshold: int = DEFAULT_THRESHOLD  # second-round bytes (largest sender) from which shared memory is used
    directory: str = DEFAULT_DIRECTORY
    separate: Union[bool, int] = False  # tests: every rank its own host (True), or hosts of k ranks
    zero_copy: bool = True  # sealed segments received as views where possible; False: files, read by copy
    book: SegmentBook = field(default=SEGMENTS, compare=False)

    # -- the decision ----------------------------------------------------------------------------
    def worth(self, wire: Wire, moved: int, op: str, peer: Optional[int] = None) -> bool:
        """Whether ``moved`` second-round bytes (the largest sender's) may go this way: CPU transfers at or above
        the threshold, unless a collective's group is known to span hosts (learned at one call on every rank), or a
        send/recv's ``peer`` is known to run on another host (the group's hosts learned, or an earlier send's
        answer): then it asks no answer of the receiver, nor sends it shared memory's words."""
        if not is_cpu(wire.device):
            return False
        if not routes.shared_memory_takes(moved, threshold=self.threshold, cpu=True):
            log.debug(
                "objcomm shm: %s moves %d bytes, below the threshold of %d; normal transport", op, moved, self.threshold
            )
            return False
        known = self.learned_hosts(wire)
        if known is not None and not known.one_host and op not in ("send", "recv"):  # (peers may share a host)
            log.debug("objcomm shm: %s spans %d hosts; normal transport", op, known.count)
            return False
        if peer is not None and peer != wire.rank:
            apart = known is not None and not known.same_host(wire.rank, peer)
            if apart or (peer, self.separate) in _state.group_facts(wire.group).remote_peers:
                way = "from" if op == "recv" else "to"
                log.debug("objcomm shm: %s %s rank %d crosses hosts; normal transport", op, way, peer)
                return False
        return True

    def learned_hosts(self, wire: Wire) -> Optional[_hosts.Hosts]:
        """The group's hosts where a call has learned them (:meth:`hosts`), else None."""
        return _state.group_facts(wire.group).hosts.get(self.separate)

    def hosts(self, wire: Wire, op: str) -> _hosts.Hosts:
        """The group's hosts, learned at the first call that asks (a collective: every rank asks at the same call),
        unless the group's same-host channel learnt them at its set-up (:func:`objcomm._samehost.hosts.keep`)."""
        facts = _state.group_facts(wire.group)
        known: Dict[Union[bool, int], _hosts.Hosts] = facts.hosts
        found = known.get(self.separate)
        if found is None:
            found = known[self.separate] = _hosts.discover(wire, self.separate, op)
        if self.directory not in facts.swept:  # a new job on this host: clear what dead jobs left (this rank alone)
            facts.swept.add(self.directory)
            sweep(self.directory)
        return found

    def hosts_for(self, wire: Wire, moved: int, op: str) -> Optional[_hosts.Hosts]:
        """The group's hosts when the call uses shared memory, else None: the same answer on every rank.
        The first call that gets this far on a group learns its hosts (a collective)."""
        if not self.worth(wire, moved, op):
            return None
        hosts = self.hosts(wire, op)
        if not hosts.one_host:
            log.debug("objcomm shm: %s spans %d hosts; normal transport", op, hosts.count)
            return None
        return hosts

    # -- control ---------------------------------------------------------------------------------
    def _gather_rows(self, wire: Wire, row: List[int], op: str) -> List[List[int]]:
        """Every rank's ``row`` (equal lengths), in rank order: through the same-host channel when the group
        has one (see :meth:`objcomm._transport.base.SlotMedium.gather_words`), else through the group."""
        rows = wire.slot_medium.gather_words(wire, row, op)
        if rows is not NOT_USED:
            return rows
        every = torch.empty(wire.size * len(row), dtype=torch.int64)
        mine = torch.tensor(row, dtype=torch.int64)
        guarded(op, wire, all_gather_single, every, mine, group=wire.group)
        return every.view(wire.size, len(row)).tolist()

    def _sealed(self, hosts: _hosts.Hosts, peer: int, wire: Wire) -> bool:
        """Whether segments for ``peer`` (:data:`_COLLECTIVES`: the group's collectives) are sealed: the same
        answer on the ranks concerned. Sealed segments are opened through ``/proc/<pid>``, so every rank
        must share one known pid namespace; a group whose readers once could not open one uses files."""
        if not self.zero_copy or (peer, self.separate) in _state.group_facts(wire.group).unsealed:
            return False
        return hosts.one_pid_namespace

    def _any(self, wire: Wire, values: List[int], op: str) -> List[int]:
        """The largest of each of ``values`` any rank gave."""
        return largest_of(wire, values, op)

    def _collective(
        self,
        wire: Wire,
        hosts: _hosts.Hosts,
        parts: Dict[int, Part],
        read: Callable[[SourceOf], T],
        op: str,
        declines: bool = False,
    ) -> Union[T, NotUsed]:
        """Write ``parts`` (part number -> frame or None, tensors), agree, let ``read`` read what it needs, unlink.

        Each rank announces a row: its sequence number (0: nothing written, -1: could not write, or ``declines``:
        its settings do not take this rest, :mod:`objcomm._samehost.voted_rests`), then for each part (a receiving
        rank, or 0) where it is (:func:`_where`)."""
        written: List[Union[_Segment, SealedSegment]] = []
        sealed = self._sealed(hosts, _COLLECTIVES, wire)
        row = [0] * (1 + wire.size)
        try:
            if declines:
                row[0] = -1
            elif parts:
                row[0] = self.book.next_seq()
                try:
                    for part, (frame, tensors) in parts.items():
                        if sealed:
                            sealed_segment = self.book.create_sealed(frame, tensors)
                            written.append(sealed_segment)
                            row[1 + part] = _where(sealed_segment)
                        else:
                            path = _name(self.directory, _me(hosts.token), row[0], part)
                            segment = self.book.create(path, frame, tensors)
                            written.append(segment)
                            row[1 + part] = _where(segment)
                except OSError as exc:
                    log.debug(
                        "objcomm shm: %s on rank %d could not write shared memory (%s); normal transport",
                        op,
                        wire.rank,
                        exc,
                    )
                    row[0] = -1
            rows = self._gather_rows(wire, row, op)
            seqs = [r[0] for r in rows]
            if min(seqs) < 0 or not any(seqs):  # a writer failed, or nobody wrote (scatter below the threshold)
                return NOT_USED

            def source_of(writer: int, part: int) -> Source:
                if sealed:
                    return Sealed(hosts.pids[writer], rows[writer][1 + part])
                who = _Writer(_this_host(), hosts.pid_namespaces[writer], hosts.token, hosts.pids[writer])
                return SegmentFile(_name(self.directory, who, seqs[writer], part), -rows[writer][1 + part])

            failure: Optional[Exception] = None
            result: Union[T, NotUsed]
            try:
                result, outcome = read(source_of), _READ
            except Unopenable as exc:  # a sealed segment: this rank cannot open what it names
                log.debug(
                    "objcomm shm: %s on rank %d could not open a sealed segment (%s); normal transport, and "
                    "files from now on",
                    op,
                    wire.rank,
                    exc,
                )
                result, outcome, failure = NOT_USED, _FELL_BACK, exc
            except OSError as exc:
                log.debug(
                    "objcomm shm: %s on rank %d could not read shared memory (%s); normal transport", op, wire.rank, exc
                )
                result, outcome, failure = NOT_USED, _FELL_BACK, exc
            except Exception as exc:  # a refused segment: raised below, once every rank knows
                result, outcome, failure = NOT_USED, _REFUSED, exc
            worst, unopenable = self._any(wire, [outcome, isinstance(failure, Unopenable)], op)
            if unopenable:  # e.g. /proc/<pid>/fd is closed to a rank: files from now on, on every rank
                _state.group_facts(wire.group).unsealed.add((_COLLECTIVES, self.separate))
            if worst == _FELL_BACK:
                return NOT_USED
            try:
                if isinstance(failure, OSError):  # another rank refused, so nobody takes the normal transport
                    problem = f"{op} on rank {wire.rank} could not read shared memory: {failure}"
                    raise CommunicationError(problem) from failure
                if failure is not None:
                    raise failure
            finally:  # the error's traceback holds this frame: no cycle through it (a caller's gc.disable()
                failure = None  # would otherwise keep each failed call's segments mapped until a collection)
            return result
        except BaseException:
            sweep(self.directory)  # a peer that died mid-call may have left its segments
            raise
        finally:
            for each in written:
                each.release()

    # -- collectives (each one's pattern: objcomm._transport.rests) -------------------------------
    def medium(self, wire: Wire, largest: int, gathered: int, op: str) -> Optional[SharedRest]:
        hosts = self.hosts_for(wire, largest, op)
        return None if hosts is None else SharedRest(self, hosts)

    # -- point to point (the two ranks' hosts are learned per call, and remembered when they differ) --
    def send(
        self, wire: Wire, out: Outgoing, dst: int, op: str, route: Optional[Route] = None, message: int = 0
    ) -> bool:
        """Send the second round through shared memory; False: the caller sends it the normal way. The status and
        the receiver's answer go through ``route`` when the slot of message ``message`` did (the same-host channel:
        concurrent sends under one tag then never take each other's), else through the group."""
        # (without the peer: the caller judged with it once, and another thread may learn of it meanwhile, where
        # _shm_p2p.send then sends its words as declined)
        if not self.worth(wire, outgoing_second_round_bytes(out, wire.inline_capacity), op):
            return False
        return _shm_p2p.send(
            self.book, self.directory, self.separate, self.zero_copy, wire, out, dst, op, route, message
        )

    def recv(
        self,
        wire: Wire,
        info: SlotInfo,
        sizes_of: SizesOf,
        src: int,
        op: str,
        route: Optional[Route] = None,
        message: int = 0,
    ) -> Union[Incoming, NotUsed]:
        """The sender's second round from shared memory, or NOT_USED: the caller receives it the normal way (the
        status and answer through ``route``, as in :meth:`send`)."""
        if not self.worth(wire, info.second_round_bytes, op):  # (p2p asks only where it answered TAKES)
            return NOT_USED
        return _shm_p2p.recv(self.directory, self.separate, wire, info, sizes_of, src, op, route, message)


@dataclass(frozen=True)
class SharedRest:
    """Shared memory as a medium of the rests of collectives (:class:`objcomm._transport.rests.RestMedium`) on
    ``hosts``, one host: each sender writes one segment (with ``at.each``, one per receiver, numbered by it), each
    receiver reads those of its sources."""

    shared: SharedMemory
    hosts: _hosts.Hosts
    declines: bool = False  # this rank's settings do not take the rest: it announces so, and nobody writes
    drained: ClassVar[str] = "shared memory, unread"

    def exchange(self, wire: Wire, at: Pattern, mine: Mine, due: Due, op: str) -> Union[Dict[int, Incoming], NotUsed]:
        me, moved, infos, sizes_of = wire.rank, due.moved, due.infos, due.sizes_of
        parts: Dict[int, Part] = {}
        if isinstance(mine, Rest):
            parts = {0: _part(mine.out, mine.frame_inline)}
        elif mine is not None:
            parts = {r: _part(rest.out, rest.frame_inline) for r, rest in enumerate(mine) if rest is not None}
        part = me if at.each else 0  # the segment a source wrote for this rank

        def read(source_of: SourceOf) -> Dict[int, Incoming]:
            got: Dict[int, Incoming] = {}
            order = list(at.sources) if due.keep else []
            if due.own and moved[me] and isinstance(source_of(me, 0), Sealed):  # its own from its segment, mapped:
                bisect.insort(order, me)  # no copy, as it must not alias its input (read in rank order)
            try:
                for r in order:
                    if moved[r]:
                        checked = _limits.for_sender(sizes_of, infos[r])  # against its own slot: O(1) a frame
                        got[r] = fetch(source_of(r, part), moved[r], infos[r].inline, infos[r].length, checked)
            except BaseException:
                got.clear()  # the traceback keeps this frame: what was mapped must not live as long as the error
                raise
            return got

        return self.shared._collective(wire, self.hosts, {} if self.declines else parts, read, op, self.declines)
