"""Same-host channel for small messages: Unix-domain sockets between the ranks of one group (issue 14).

When every rank of a group runs on one host, the round-1 slots of collectives move between the
processes directly instead of through the backend (gloo over loopback TCP): :mod:`objcomm._samehost.channel_slots`
opens one channel per group and routes them here (the ``local`` setting; on by default,
``OBJCOMM_LOCAL=0`` turns it off).

Why Unix-domain sockets (SOCK_SEQPACKET, full mesh, abstract names)
-------------------------------------------------------------------
``benchmarks/bench_local_channel.py`` measured an all_gather of a 4096-byte slot on a shared,
noisy 2-core machine (medians of the slowest rank from a barrier; benchmarks/history/RESULTS-log-2026-11.md, "Same-host
channel prototype"). Against a raw gloo all_gather of the same slot, at W=2 / W=4: bare sockets in
a full mesh 0.19x / 0.16x, a star through rank 0 0.19x / 0.16x, shared-memory mailboxes (a memfd,
an eventfd doorbell per rank) 0.20x / 0.16x, this prototype 0.35x / 0.27x (143 µs / 842 µs; back
to back without barriers 36-50 µs per all_gather at W=2, bare mesh 9-13 µs). The three mechanisms
tie: a 4 KiB copy is noise next to the wake-up, which every one of them pays once. Mesh over star:
one hop instead of two, and no rank on everyone's path. Sockets over mailboxes, because mailboxes
learn nothing of a dead peer (they need a socket per peer anyway), need a memfd passed around and
a reuse protocol, while a socket gives the rest from the kernel:

- a peer that dies, even by SIGKILL, closes its end: the others read EOF (or ECONNRESET) at once;
- waits block in the kernel (``recv`` under ``SO_RCVTIMEO``, or ``poll``): a rank waiting 100 ms
  for a late peer spends < 1 ms of CPU (MPICH, busy-polling: 64-100 ms). Before it blocks, a wait
  polls its sockets for a moment (the ``local_spin_us`` setting; automatic: 1 ms), once per call,
  yielding the CPU between polls (``sched_yield``: free where nothing else waits for the CPU; see
  :func:`objcomm._samehost.polling.poll_briefly`):
  waking a sleeping rank costs ~50 µs a hop on this machine's virtual CPUs, which is most of a small
  call (a back-to-back all_gather at W=2: 108 µs sleeping at once, 90 µs with a 100 µs spin; a send/recv
  round trip: 253 and 155 µs), and a receiver woken on a cold core decodes slower: a 16 KB send/recv round
  trip took 17-18% less with a 1 ms spin than with 100 µs, in three runs out of three
  (``benchmarks/bench_p2p_phases.py --spin-us``, issue 25);
- abstract names (``\\0objcomm-...``) live in the network namespace, never in the file system,
  and vanish with the last descriptor: nothing to clean up after exit, crash or SIGKILL;
- ``SO_PEERCRED`` tells who connected: its pid and uid are checked against what the group
  announced, and the connector must show a per-rank secret that only travelled through the group.

Set-up (once per group, collective): every rank binds a listening socket, one ``all_gather``
through the group carries each rank's host key, pid, uid, pid namespace, socket nonce and secret
(and its send/recv vote and the history of the group's channels);
if they are not all on one host (or differ in uid or pid namespace) every rank returns ``None``
from :meth:`LocalChannel.open` and the caller keeps the backend. Otherwise rank ``i`` connects to
every rank below it and accepts from every rank above; the listeners close; one ``all_reduce``
makes the outcome the same everywhere.

Messages are eager (:mod:`objcomm._samehost.mesh`; a send returns once the kernel holds the bytes): every
operation is one ``sendmsg`` per peer and one ``recv`` per message received (``poll`` first when several are
awaited). Each message carries a 12-byte header: kind, flags, a sequence number (collectives,
checked: ranks calling different operations raise) and a tag (send/recv). Receiving is
:mod:`objcomm._samehost.inbox`: several threads may wait at once (collectives on the caller's thread,
send/recv on ``isend``/``irecv`` lanes), each socket read by one of them at a time; messages that
arrive before they are wanted wait in a bounded stash, and every message is checked on arrival (a
member that breaks the protocol fails the channel with a clear error, never a hang or an allocation
beyond the stash). A forked child closes its copies of the sockets at once
(``os.register_at_fork``), so that a DataLoader worker never keeps a dead rank's connections open.

How it plugs in
---------------
:class:`objcomm._samehost.channel_slots.ChannelSlots`, a :class:`objcomm._transport.base.SlotMedium`
(``Wire.slot_medium``), moves the slots of ``_exchange_slots`` (all_gather, gather, the
reductions' last step), ``broadcast``, ``scatter`` and ``all_to_all`` of :mod:`objcomm._transport.rounds`,
and the slots of ``send``/``recv`` once every rank has voted them in (the set-up's ``ready`` word, or a
vote through the group after an all_gather or all_to_all, :meth:`LocalChannel.vote`: values every rank sees alike; see
:mod:`objcomm._samehost.channel_slots`). The channel is
opened on the first collective of a group that may use it, with the group's timeout, kept in
:func:`objcomm._state.group_facts` and closed with the group or at exit; after a failure the next
collective opens a new one when every rank failed at the same call (the set-up carries each rank's
``(generation, failure point)``; ranks that disagree are out of step, and raise from then on).
Async collectives run on the shadow group, which gets a channel of its own.
The small words of large collectives go through it too: the receivers' votes and the shared-memory
control words (:meth:`objcomm._samehost.channel_slots.ChannelSlots.gather_words`,
:func:`objcomm._transport.base.largest_of`). So do the answers and second rounds of send/recv below the shared-memory
threshold (messages of their own kinds, under the send's message id: :mod:`objcomm._samehost.channel_rests`). A set-up
through the group tells every rank the group's hosts too (:func:`objcomm._samehost.hosts.keep`), which two levels
and shared memory then read instead of a discovery of their own. Still open: the channel's own cost: its bookkeeping
(header, stash, checks) doubles the bare mesh's time.
"""

from __future__ import annotations

import itertools
import os
import secrets
import select
import socket
import struct
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from objcomm._errors import CommunicationError, ranks_note
from objcomm._samehost import hosts as _hosts
from objcomm._samehost.inbox_waits import Inbox
from objcomm._samehost.mesh import MAX_PAYLOAD, Mesh
from objcomm._transport import groups as _groups
from objcomm._transport.base import BACKEND, Wire, all_gather_single, guarded, largest_of

DEFAULT_TIMEOUT = 300.0  # seconds any one wait may take
SETUP_TIMEOUT = 30.0  # seconds to connect the mesh
AUTO_SPIN = 1e-3  # seconds a wait polls (yielding the CPU between polls) before sleeping, when the spin is automatic

_HELLO = struct.Struct("<iq")  # connector's group rank, the acceptor's secret
_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
# ok, host key, pid, uid, pid namespace, socket nonce, secret, ready, then the previous channel's: generation,
# failure point, resumed at, send/recv slots sent, and taken
_WORDS = 13
_OPEN: weakref.WeakSet[LocalChannel] = weakref.WeakSet()  # closed in a forked child (see _forget_in_child)
VOTE = 2  # first word of a vote (LocalChannel.vote), where set-up has 0 or 1
_ROOM_WORDS = (1, 3, 4, 5, 6, 9, 10, 11, 12)  # the words of the set-up's shape a vote leaves free: its triples
_STOP = 2  # a vote's "ready" word from a rank that stops voting
VOTE_ROOM = len(_ROOM_WORDS) // 3  # (src, tag, slots) triples a vote carries (p2p_state.SameHost.begin_vote)


class OutOfStep(CommunicationError):
    """A reopen found the ranks at different calls (see :meth:`LocalChannel.open`)."""


class VotingStopped(Exception):
    """A rank voted to stop voting (:meth:`LocalChannel.vote`, ``stop``): every rank stops with it."""


def _address(pid: int, nonce: int) -> str:
    return f"\0objcomm-{pid}-{nonce:016x}"  # abstract namespace: never a file


def _peer_cred(sock: socket.socket) -> Tuple[int, int]:
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


class LocalChannel(Mesh):
    """A full mesh of Unix-domain sockets between the ranks of one group on one host.

    Made collectively by :meth:`open`; then :meth:`all_gather`, :meth:`broadcast`, :meth:`scatter`,
    :meth:`all_to_all` (every rank of the group calls them in the same order, from one thread at a
    time) and :meth:`send` / :meth:`recv` (from any number of threads, also while a collective runs)
    move small byte strings. A peer that dies, a wait longer than ``timeout``, ranks calling
    different operations or a message that breaks the protocol raise :class:`~objcomm.CommunicationError`
    and close the channel, so that the other ranks learn of it at once too.

    ``generation`` counts this group's channels up to this one; ``failed_at`` is the sequence number of
    the last collective this rank started on it when it failed (``None`` while it works).
    ``p2p``: whether send/recv of objcomm's transport may use it (see :mod:`objcomm._samehost.channel_slots`).
    """

    def __init__(
        self,
        rank: int,
        peers: Dict[int, socket.socket],
        pids: Sequence[int],
        timeout: float,
        *,
        p2p: bool = False,
        generation: int = 0,
        stash_bytes: Optional[int] = None,
        names: Optional[Sequence[int]] = None,
    ) -> None:
        self.rank = rank
        self.size = len(pids)
        self.ranks_note = ranks_note(names)  # where group ranks are not global ones: which are which
        self.timeout = timeout
        self.p2p = p2p
        self.generation = generation
        self.failed_at: Optional[int] = None
        self.rounds = 0  # the calls whose first round went through this channel (their round-1 collective began)
        self.rejoins = False  # once failed: a peer failed it first, at an earlier call (see Mesh._failure_point)
        self.found_in: Optional[int] = None  # once failed: the collective this rank was in, if any
        self.rejoining = False  # the next opening takes the place of that collective (Mesh.rejoins_after)
        self._current: Optional[int] = None  # the collective this rank is in
        self._pids = tuple(pids)
        self._peers = peers
        self._others = sorted(peers)  # every other rank
        self._patterns = {}  # this rank's part in each operation and root it met (Mesh._pattern)
        timeval = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))  # bounds a blocking recv in the kernel
        for sock in peers.values():
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        self._inbox = Inbox(peers, pids, timeout, MAX_PAYLOAD, self._fail, stash_bytes, yielding=True)
        self._inbox.ranks_note = self.ranks_note
        self.auto_spin = AUTO_SPIN
        self.unsynced = 0  # second-round bytes of broadcasts, gathers, scatters since the last all_gather after them
        self._votes = 0  # all_gathers and all_to_alls that could have voted send/recv in (see vote_due)
        self.sequence = 0
        self._messages = itertools.count(1)  # ids of sends (itertools.count: atomic under the GIL)
        self._owner = os.getpid()
        self._lock = threading.Lock()  # one collective at a time
        self.closed = False
        self.control: Any = None  # the group's control group (see open), which carries the votes once set
        _OPEN.add(self)

    # -- set-up ------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        wire: Wire,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        setup_timeout: float = SETUP_TIMEOUT,
        separate: Union[bool, int] = False,
        op: str = "local channel set-up",
        ready: bool = False,
        history: Tuple[int, ...] = (0,) * 5,
        stash_bytes: Optional[int] = None,
        control: Any = None,
    ) -> Optional[LocalChannel]:
        """Connect every rank of ``wire``'s group (a collective); ``None`` on every rank when they are
        not all on this host with one uid and pid namespace, or when any rank could not connect.

        ``ready``: this rank has no send/recv in flight (the channel takes send/recv when every rank is).
        ``history``: ``(generation, failure point, resumed at, slots sent, slots taken)`` of the group's previous
        channel (zeros: none; resumed at: the call whose first round this one takes the place of,
        :attr:`objcomm._samehost.mesh.Mesh.resumes_at`; slots: its send/recv messages); ranks that tell different
        first three are out of step (a rank that finished calls the others never made, a peer that failed at another
        call), and so are ranks that sent more messages through it than they took (the others went with it: the
        sender of each returned as if delivered); every rank raises.
        ``stash_bytes``: see :mod:`objcomm._samehost.inbox` (``None``: room for every peer's credit). ``control``: the
        group's control group (:func:`objcomm._transport.groups.sibling`, gloo), which carries a reopening's
        collectives instead of the group, so that they never meet a collective of the group another rank is still in;
        None at the first set-up."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        nonce, secret = secrets.randbits(63), secrets.randbits(63)
        try:
            listener.bind(_address(os.getpid(), nonce))
            listener.listen(wire.size)
            ok = 1
        except OSError:
            ok = 0
        mine = [
            ok,
            _hosts.host_key(separate),
            os.getpid(),
            os.getuid(),
            _hosts.pid_namespace(),
            nonce,
            secret,
            int(ready),
            *history,
        ]
        # On the wire's device: an NCCL group's set-up goes through NCCL, once; the channel then moves host bytes.
        group, device = _through(wire, control)
        everyone = torch.empty(_WORDS * wire.size, dtype=torch.int64, device=device)
        guarded(
            op, wire, all_gather_single, everyone, torch.tensor(mine, dtype=torch.int64, device=device), group=group
        )
        words: List[int] = everyone.tolist()
        oks, keys, pids, uids, namespaces, nonces, their_secrets, readies, generations, points, resumed, sent, taken = (
            words[i::_WORDS] for i in range(_WORDS)
        )
        if control is None:  # through the group, at the same call on every rank (not the background's thread)
            _hosts.keep(wire.group, separate, keys, pids, namespaces, their_secrets[0])
        peers: Dict[int, socket.socket] = {}
        try:
            if VOTE in oks:
                raise OutOfStep(
                    f"{op}: rank {oks.index(VOTE)} voted on send/recv through its same-host channel "
                    "while this rank opened a new one: the group's calls are out of step; it cannot be "
                    "used any more"
                )
            if len({*zip(generations, points, resumed)}) > 1:
                raise OutOfStep(
                    f"{op}: the ranks of this group disagree about where its same-host channel failed (channel, "
                    f"failure point, this call per rank: {list(zip(generations, points, resumed))}): they are not "
                    "at the same call. The group's calls are out of step; it cannot be used any more"
                )
            if sum(sent) != sum(taken):
                raise OutOfStep(
                    f"{op}: {sum(sent) - sum(taken):,} send/recv message(s) sent through this group's same-host "
                    "channel before it failed were never received (sent, received per rank: "
                    f"{list(zip(sent, taken))}): they were lost with it, though their senders returned. The group's "
                    "sends and receives are out of step; it cannot be used any more"
                )
            usable = all(oks) and len({*keys}) == 1 and len({*uids}) == 1 and len({*namespaces}) == 1
            if usable:
                # Half the group's timeout at most: ranks that gave up at once wait for this one in the
                # vote below, under that timeout, and must still be there when it comes.
                deadline = time.monotonic() + min(setup_timeout, timeout / 2)
                usable = cls._connect(wire.rank, peers, pids, nonces, their_secrets, secret, listener, deadline)
        finally:
            listener.close()  # the name disappears with it
        # every rank's verdict: the maximum of "unusable" (on gloo recursive doubling, then a broadcast: 2 log2 W
        # steps, where an all_reduce is a ring of 2(W - 1): 0.8 s at 8192 ranks across hosts, at their first call)
        vote = wire._replace(group=group, device=device, slot_medium=BACKEND)
        if largest_of(vote, [0 if usable else 1], op)[0]:
            for s in peers.values():
                s.close()
            return None
        channel = cls(
            wire.rank,
            peers,
            pids,
            timeout,
            p2p=all(readies),
            generation=history[0] + 1,
            stash_bytes=stash_bytes,
            names=wire.ranks,
        )
        channel.control = control
        return channel

    def vote(
        self, wire: Wire, ready: Optional[Sequence[int]], op: str, stop: bool = False, balance: Optional[int] = None
    ) -> Optional[List[List[int]]]:
        """Whether every rank of the group is ``ready`` for send/recv through this channel (None: no; else up to
        :data:`VOTE_ROOM` ``(src, tag, slots)`` triples, :meth:`objcomm._samehost.p2p_state.SameHost.begin_vote`):
        every rank's triples where all are, else None. A collective through the control group (see :meth:`open`),
        whose result every rank sees alike. It has the set-up's shape, one all_gather of ``_WORDS`` words per rank,
        so that a vote that meets a rank's reopening (on the control group too) is one collective on both, and both
        raise :class:`OutOfStep`. ``stop``: this rank stops voting (:mod:`objcomm._samehost.opener`); every rank then
        raises :class:`VotingStopped`. ``balance`` (an NCCL group, where a send returns before its receiver posts: the
        counts of the triples say nothing then): this rank's slots posted less taken through the group; the vote
        passes only with no triple anywhere and a sum of 0 (every message sent there taken there)."""
        room = [*(ready or ()), *(-1, 0, 0) * VOTE_ROOM][: len(_ROOM_WORDS)]
        said = _STOP if stop else int(ready is not None)
        mine = [VOTE, 0, balance or 0, 0, 0, 0, 0, said, self.generation, 0, 0, 0, 0]
        for at, word in zip(_ROOM_WORDS, room):
            mine[at] = word
        group, device = _through(wire, self.control)
        everyone = torch.empty(_WORDS * wire.size, dtype=torch.int64, device=device)
        guarded(
            op, wire, all_gather_single, everyone, torch.tensor(mine, dtype=torch.int64, device=device), group=group
        )
        words: List[int] = everyone.tolist()
        kinds, generations = words[0::_WORDS], words[8::_WORDS]
        if any(k != VOTE for k in kinds) or len({*generations}) > 1:
            raise OutOfStep(
                f"{op}: the ranks are not all voting on send/recv through the same-host channel of one "
                f"generation (vote marks {kinds}, channels {generations}): the group's calls are out "
                "of step; it cannot be used any more"
            )
        if _STOP in words[7::_WORDS]:
            raise VotingStopped(f"rank {words[7::_WORDS].index(_STOP)} stopped voting")
        if not all(words[7::_WORDS]):
            return None
        rows = [[words[r * _WORDS + at] for at in _ROOM_WORDS] for r in range(wire.size)]
        if balance is not None and (sum(words[2::_WORDS]) != 0 or any(row[0] >= 0 for row in rows)):
            return None
        return [[word for at in range(0, len(row), 3) if row[at] >= 0 for word in row[at : at + 3]] for row in rows]

    @staticmethod
    def _connect(
        rank: int,
        peers: Dict[int, socket.socket],
        pids: Sequence[int],
        nonces: Sequence[int],
        secrets_: Sequence[int],
        secret: int,
        listener: socket.socket,
        deadline: float,
    ) -> bool:
        """Connect to the ranks below, accept the ranks above (checking who they are); False on failure."""
        uid = os.getuid()
        for peer in range(rank):  # connect() completes against the backlog, before the peer accepts
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(_address(pids[peer], nonces[peer]))
                if _peer_cred(sock) != (pids[peer], uid):
                    raise OSError(f"rank {peer}'s address is held by another process")
                sock.send(_HELLO.pack(rank, secrets_[peer]))
            except OSError:
                sock.close()
                return False
            peers[peer] = sock
        while len(peers) < len(pids) - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([listener], [], [], remaining)[0]:
                return False
            sock, _ = listener.accept()
            try:
                # Who connected is the kernel's word, checked before anything is read: a process that is
                # not one of the ranks still expected (any user can find and connect to an abstract name)
                # is refused at once, instead of holding set-up while it says nothing.
                pid, peer_uid = _peer_cred(sock)
                expected = {pids[r]: r for r in range(rank + 1, len(pids)) if r not in peers}
                if peer_uid != uid or pid not in expected:
                    raise ValueError("not a rank of this group")
                sock.settimeout(max(0.0, deadline - time.monotonic()))
                who, shown = _HELLO.unpack(sock.recv(_HELLO.size + 1))
                if who != expected[pid] or shown != secret:
                    raise ValueError("not a rank of this group")
            except (OSError, ValueError, struct.error):  # a stranger: refuse it, keep waiting for the ranks
                sock.close()
                continue
            sock.settimeout(None)
            peers[who] = sock
        return True


def control_group(wire: Wire, op: str) -> Any:
    """The group's control group (:mod:`objcomm._transport.groups`), destroyed with the group; made at the first
    set-up that worked on every rank. None where torch cannot make one (its private group helper differs): the
    channel's votes and reopenings then go through the group itself, as before the control group existed. The ranks
    agree on it (a MIN through the group): one that could not make it makes every rank do without, for a rank
    voting through one group while its peers vote through the other would wait for them until the timeout."""
    try:
        control = _groups.sibling(wire.group, "objcomm-channel", "gloo")
    except Exception:
        control = None
    made = torch.tensor([control is not None], dtype=torch.int64, device=wire.device)
    try:
        guarded(op, wire, dist.all_reduce, made, op=dist.ReduceOp.MIN, group=wire.group)
    except CommunicationError:
        if control is not None:
            _groups.forget(control)
        raise
    if control is not None and not made.item():
        _groups.forget(control)
        return None
    if control is not None:
        weakref.finalize(wire.group, _groups.forget, control).atexit = False
    return control


def _through(wire: Wire, control: Any) -> Tuple[Any, torch.device]:
    """Where the channel's own collectives go: the control group (gloo, host memory) once there is one, else
    ``wire``'s group on its device (the first set-up)."""
    return (wire.group, wire.device) if control is None else (control, torch.device("cpu"))


def _forget_in_child() -> None:
    for channel in list(_OPEN):
        channel._forget()


os.register_at_fork(after_in_child=_forget_in_child)
