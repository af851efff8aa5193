"""The same-host channel opened in the background, so that a program whose first calls are send/recv gets it too.

The channel's set-up is a collective of every rank of the group, where a send/recv involves two. So on a CPU group
that may run on one host (:func:`background`: up to :data:`MOST_RANKS` ranks, in a job on one node where torchrun
says so), each rank's first call on it, whatever the operation, starts an
:class:`Opener`: a thread that makes a control group for the channel (a sibling made over the store,
:func:`objcomm._transport.groups.sibling`), opens the channel through it, never through the group itself, whose
collectives the main threads may be in, and then votes send/recv onto it. A send/recv goes on through the group
meanwhile.

Collectives take the channel once every rank says, at one of them, that its opening is done (:func:`agree`: one
``all_reduce(MIN)`` through the group at each collective until then; a collective waits a moment for the opening
first). Until then they go through the group; where the opening failed on some rank, every rank opens the channel
at that collective through the group instead, as a larger group does, and the background's is dropped.

The votes (:meth:`objcomm._samehost.p2p_state.SameHost.begin_vote`) go through the control group, every rank's
thread taking part in each, at growing pauses (:data:`FIRST_PAUSE` to :data:`LONGEST_PAUSE`), until every rank votes
yes at once (send/recv then take the channel: its outcome is what every rank sees), the channel fails, or a rank
stops voting: at exit, when its group is gone, before the group reopens a failed channel or settles send/recv at
``connect()``, a rank's thread votes "stop" and every rank's thread ends at that vote, send/recv staying where they
are. While a rank's vote is out, its send/recv wait for the outcome (one small collective: about 0.1 ms at W=2).

Ranks that never call objcomm on the group hold the opening back: the others wait for them (up to the group's
timeout) in the background, their send/recv going through the group meanwhile.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Optional, Set, Union

import torch
import torch.distributed as dist

from objcomm import _state
from objcomm._device import is_cpu, timeout_seconds
from objcomm._errors import CommunicationError
from objcomm._samehost import channel as _channel
from objcomm._samehost.p2p_state import SameHost
from objcomm._transport import groups as _groups
from objcomm._transport.base import Wire, guarded

MOST_RANKS = 64  # a group of more ranks is opened by its first collective, in the foreground
FIRST_PAUSE, LONGEST_PAUSE = 1e-3, 0.1  # seconds between votes: doubling from the first to the longest
EXIT_WAIT = 5.0  # seconds a rank waits at exit, or when its group goes, for its thread to end
SUFFIX = "objcomm-channel-bg"  # the control group's name after its group's (the foreground's is another)
FAILED, NOT_ONE_HOST, OPENING, OPEN = -1, 0, 1, 2  # what a rank says of its opening at a collective (agree)
_LIVE: Set[Opener] = set()  # opening or voting now (ended at exit)
_LIVE_LOCK = threading.Lock()


def background(wire: Wire, state: SameHost, separate: Union[bool, int]) -> bool:
    """Whether this group's channel opens in the background (the same answer on every rank, from what every rank
    knows alike): a CPU group (on NCCL a send returns before its receiver posts, which the votes' counts rely on) of
    at most :data:`MOST_RANKS` ranks, not split into test hosts (``separate``), in a job on one node where torchrun
    says (``LOCAL_WORLD_SIZE`` is ``WORLD_SIZE``: every rank sees the same), with a torch whose store connections can
    be cloned (2.8 on: without it, the thread's wait for its peers would hold the process's only one)."""
    if state.background is None:
        local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
        state.background = (
            is_cpu(wire.device)
            and not separate
            and wire.size <= MOST_RANKS
            and (local is None or local == world)
            and _groups.store_clones()
        )
    return state.background


def start(wire: Wire, state: SameHost, separate: Union[bool, int]) -> Opener:
    """This rank's opener of the group's channel, started at its first call (later calls get the same)."""
    with state.cond:
        opener: Opener = state.opener if state.opener is not None else Opener(wire, state, separate)
        state.opener = opener
        return opener


def agree(wire: Wire, state: SameHost, separate: Union[bool, int], op: str) -> int:
    """At a collective, until every rank's opening is done: what the ranks say of it, their minimum
    (:data:`OPEN`, :data:`OPENING`, :data:`NOT_ONE_HOST` or :data:`FAILED`), one ``all_reduce`` through the group,
    after waiting for this rank's opening up to half the group's timeout, the channel's set-up bound at most."""
    opener = start(wire, state, separate)
    opener.opened.wait(min(_channel.SETUP_TIMEOUT, timeout_seconds(wire.group) / 2))
    with state.cond:
        if not opener.opened.is_set():
            said = OPENING
        elif opener.problem is not None:
            said = FAILED
        else:
            said = OPEN if state.channel is not None else NOT_ONE_HOST
    word = torch.tensor([said], dtype=torch.int64, device=wire.device)
    guarded(
        f"{op} (agreeing on the same-host channel)", wire, dist.all_reduce, word, op=dist.ReduceOp.MIN, group=wire.group
    )
    agreed = int(word.item())
    if agreed == FAILED:
        opener.abandon()
    return agreed


def agreed_channel(
    wire: Wire,
    state: SameHost,
    separate: Union[bool, int],
    op: str,
    reopen: Callable[[], Optional[_channel.LocalChannel]],
) -> Optional[_channel.LocalChannel]:
    """The channel a collective takes while the ranks have not all said their opening is done (:func:`agree`): None
    (this call goes through the group) until they have; where it failed on some rank, the one ``reopen()`` opens
    here on every rank, through the group, as a larger group does."""
    agreed = agree(wire, state, separate, op)
    if agreed == OPENING:
        return None  # the next collective asks again
    if agreed == OPEN:
        state.agreed = True
        return state.channel
    if agreed == NOT_ONE_HOST:
        if state.channel is not None:  # (a rank that says it opened one where another found the hosts differ)
            state.opener.abandon()
        with state.cond:
            state.agreed = state.decided = True
        return None
    state.background = False  # (agree dropped what the thread opened) from now on as a larger group does
    with state.control_lock:
        return reopen()


def end_votes(wire: Wire, state: SameHost) -> None:
    """Before the group's own use of its control group (a reopening, ``connect()``): this rank's voting thread, if any
    and not abandoned, votes "stop", and every rank's ends at that vote; waits for it up to the group's timeout."""
    if state.opener is not None and not state.opener.abandoned:
        state.opener.stop(timeout_seconds(wire.group))


def vote_on(wire: Wire, state: SameHost, channel: _channel.LocalChannel) -> None:
    """Start voting send/recv onto ``channel`` in the background (after a reopening, or ``connect()``, that left
    them off it)."""
    with state.cond:
        state.opener = Opener(wire, state, False, channel)


class Opener:
    """One rank's thread that opens a group's channel (unless given ``channel``) and votes send/recv onto it."""

    def __init__(
        self, wire: Wire, state: SameHost, separate: Union[bool, int], channel: Optional[_channel.LocalChannel] = None
    ) -> None:
        self.state, self.separate = state, separate
        self.group = weakref.ref(wire.group)  # held strongly while opening only: the group may go meanwhile
        self.wire = wire._replace(group=None)  # what the votes need of it (the control group carries them)
        self.opened = threading.Event()
        self.stopping = threading.Event()
        self.abandoned = False  # the ranks opened the channel in the foreground instead (agree)
        self.problem: Optional[str] = None  # why the opening failed, if it did
        if channel is not None:
            self.opened.set()
        self._held = [wire.group, channel]  # handed to the thread, which lets go of the group once it has opened
        self.thread = threading.Thread(target=self._run, name="objcomm-channel-opener", daemon=True)
        self.thread.start()

    def stop(self, wait: float = EXIT_WAIT) -> None:
        """Have this rank's thread vote "stop" (every rank's thread ends at that vote) and wait for it to end."""
        self.stopping.set()
        if self.thread is not threading.current_thread():
            self.thread.join(wait)

    def abandon(self) -> None:
        """The ranks open the channel in the foreground: drop what this thread opened, or will."""
        state = self.state
        with state.cond:
            self.abandoned = True
            channel, control = state.channel, state.control
            state.channel, state.control, state.decided = None, None, False
        if channel is not None:
            self.stop()
            channel.close("the ranks opened the same-host channel again, in the foreground")
        if control is not None:
            _groups.forget(control)

    def _run(self) -> None:
        group, channel = self._held
        self._held.clear()
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            try:
                if channel is None:
                    channel = self._open(group)
            finally:
                self.opened.set()
            del group
            if channel is not None and not channel.p2p:
                self._vote(channel)
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(self)

    def _open(self, group: Any) -> Optional[_channel.LocalChannel]:
        state, wire = self.state, self.wire._replace(group=group)
        op = "opening the same-host channel (in the background)"
        channel = control = None
        try:
            if not _groups.arrive(group, SUFFIX, self.stopping, timeout_seconds(group)):
                raise CommunicationError("this rank stopped before every rank of the group had come")
            control = _groups.sibling(group, SUFFIX, "gloo")
            with state.cond:  # (a thread abandoned by now must not vote: the ranks vote in the foreground)
                if self.abandoned:
                    raise CommunicationError("abandoned")
                entries = state.begin_vote(group, settle=0.0)  # (a wait here would hold its peers, frozen, too)
            try:
                channel = _channel.LocalChannel.open(
                    wire,
                    timeout=timeout_seconds(group),
                    separate=self.separate,
                    op=op,
                    ready=entries == [],
                    control=control,
                )
            finally:
                with state.cond:  # before the vote ends: a send/recv waiting for it must see the channel
                    if not self.abandoned:  # (an abandoned thread's vote was ended by the ranks' own)
                        if channel is not None or sys.exc_info()[0] is None:  # decided: open, or not one host
                            state.channel, state.decided, state.owed = channel, True, {}
                            state.control = None if channel is None else control
                        state.end_vote()
        except Exception as exc:  # the ranks agree on what to do instead at a collective (agree)
            self.problem = f"{op} failed: {exc}"
            if channel is not None:
                channel.close(self.problem)
            channel = None
        if channel is None or self.abandoned:
            if channel is not None:
                channel.close("the ranks opened the same-host channel again, in the foreground")
            if control is not None:
                _groups.forget(control)
            return None
        channel.control = control
        weakref.finalize(group, _gone, state).atexit = False
        return channel

    def _vote(self, channel: _channel.LocalChannel) -> None:
        state, wire, pause = self.state, self.wire, FIRST_PAUSE
        what = "voting send/recv onto the same-host channel (in the background)"
        while True:
            stop = self.stopping.wait(pause)
            pause = min(2 * pause, LONGEST_PAUSE)
            with state.control_lock:  # (a reopening of the group's channel waits: it goes through the control group)
                rows = entries = None
                try:
                    group = self.group()
                    stop = stop or group is None or channel.closed or self.stopping.is_set()
                    entries = None if stop else state.begin_vote(group, settle=0.0)
                    del group
                except Exception:  # (this rank cannot vote: it votes "stop", so that its peers' threads end too)
                    stop = True
                try:
                    rows = channel.vote(wire, entries, what, stop=stop)
                    state.settle(rows, wire.rank, channel)
                except _channel.VotingStopped:
                    return
                except Exception as exc:  # (OutOfStep included) the next collective decides anew
                    if isinstance(exc, _channel.OutOfStep):
                        state.broken = str(exc)
                    with contextlib.suppress(Exception):
                        channel.fail(what, f"the send/recv vote failed ({exc})", exc)
                    return
                finally:
                    state.end_vote()
            if rows is not None:
                return


def _gone(state: SameHost) -> None:
    """The group is gone: its voting thread stops, its channel closes (telling the peers this rank left: their
    receives from any rank go on with the others), then its control group goes."""
    opener, channel, control = state.opener, state.channel, state.control
    if opener is not None:
        opener.stop()
    if channel is not None:
        channel.leave()
    if control is not None:
        _groups.forget(control)


def _stop_all() -> None:
    """At exit: every thread of this process ends before torch is torn down under it (a thread still in torch then
    aborts the process): one waiting for its peers to come stops, one opening finishes (its peers are there), one
    voting votes "stop", so that its peers' threads end with it; :data:`EXIT_WAIT` seconds in all at most."""
    with _LIVE_LOCK:
        openers = list(_LIVE)
    for opener in openers:
        opener.stopping.set()
    deadline = time.monotonic() + EXIT_WAIT
    for opener in openers:
        opener.thread.join(max(0.0, deadline - time.monotonic()))


def _leave_destroyed() -> None:
    """At exit (after :func:`_stop_all`): a group that was destroyed (``dist.destroy_process_group``) but not collected
    yet (a caught exception's traceback can hold it in a cycle until the collector runs) still has its channel open;
    it closes telling the peers this rank left, as the group's collection would (:func:`_gone`): a peer that still
    waits for this rank then says it left, not that it died (a porting review's find). A group not destroyed, where
    the process ends on an error, closes without a word: its peers read that it died."""
    try:
        registered = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
        for group, facts in _state.known_groups():
            if group in registered:
                continue
            for state in list(facts.local.values()):
                channel = state.channel
                if channel is not None and not channel.closed:
                    channel.leave()
    except Exception:  # (at exit: torch half torn down, say) the peers read that this rank ended, as before
        pass


atexit.register(_leave_destroyed)  # (registered first: run last)
atexit.register(_stop_all)
