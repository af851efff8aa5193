"""The same-host channel opened in the background, so that a program whose first calls are send/recv gets it too.

The channel's set-up is a collective of every rank of the group, where a send/recv involves two. So on a group that
may run on one host (:func:`background`: up to :data:`MOST_RANKS` ranks, on one node by torchrun's
``LOCAL_WORLD_SIZE`` where it is set), each rank's first call on it, whatever the operation, starts an
:class:`Opener`: a thread that makes the group's control group (a sibling made over the store,
:func:`objcomm._transport.groups.sibling`), opens the channel through it, never through the group itself, whose
collectives the main threads may be in, and then votes send/recv onto it. A collective waits for the opening
(:func:`opened`); a send/recv goes on through the group meanwhile.

The votes (:meth:`objcomm._samehost.p2p_state.SameHost.begin_vote`) go through the control group, every rank's
thread taking part in each, at growing pauses (:data:`FIRST_PAUSE` to :data:`LONGEST_PAUSE`), until every rank votes
yes at once (send/recv then take the channel: its outcome is what every rank sees), the channel fails, or a rank
stops voting: at exit, when its group is gone, or before the group reopens a failed channel, a rank's thread votes
"stop" and every rank's thread ends at that vote, send/recv staying on the group. While a rank's vote is out, its
send/recv wait for the outcome (one small collective: about 0.1 ms at W=2).

Ranks that never call objcomm on the group hold the opening back: the others wait for them (up to the group's
timeout) in the background, their send/recv going through the group meanwhile; a collective waits with them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from typing import Any, Optional, Union

from objcomm._device import timeout_seconds
from objcomm._errors import CommunicationError
from objcomm._samehost import channel as _channel
from objcomm._samehost.p2p_state import SameHost
from objcomm._transport import groups as _groups
from objcomm._transport.base import Wire

MOST_RANKS = 64  # a group of more ranks is opened by its first collective, in the foreground
FIRST_PAUSE, LONGEST_PAUSE = 1e-3, 0.1  # seconds between votes: doubling from the first to the longest
EXIT_WAIT = 2.0  # seconds a rank waits at exit, or when its group goes, for its voting thread's last vote
_LIVE: weakref.WeakSet[Opener] = weakref.WeakSet()  # voting now (told to stop at exit)


def background(wire: Wire, state: SameHost, separate: Union[bool, int]) -> bool:
    """Whether this group's channel opens in the background (the same answer on every rank, from what every rank
    knows alike): a group of at most :data:`MOST_RANKS` ranks, not split into test hosts (``separate``), whose
    ranks torchrun put on one node where it says so (``LOCAL_WORLD_SIZE`` ranks a node, in rank order)."""
    if state.background is None:
        per_node = os.environ.get("LOCAL_WORLD_SIZE", "")
        nodes = {rank // int(per_node) for rank in wire.ranks} if per_node.isdigit() and int(per_node) > 0 else {0}
        state.background = not separate and wire.size <= MOST_RANKS and len(nodes) == 1
    return state.background


def start(wire: Wire, state: SameHost, separate: Union[bool, int]) -> Opener:
    """This rank's opener of the group's channel, started at its first call (later calls get the same)."""
    with state.cond:
        opener: Opener = state.opener if state.opener is not None else Opener(wire, state, separate)
        state.opener = opener
        return opener


def opened(wire: Wire, state: SameHost, separate: Union[bool, int], op: str) -> Optional[_channel.LocalChannel]:
    """The group's channel once the opener has opened it (None: the ranks are not all on this host, or the opening
    failed); started here where this is the rank's first call. Raises :class:`~objcomm.CommunicationError` after
    twice the group's timeout."""
    opener = start(wire, state, separate)
    timeout = 2 * timeout_seconds(wire.group) + _channel.SETUP_TIMEOUT
    if not opener.opened.wait(timeout):
        raise CommunicationError(
            f"{op}: this group's same-host channel, opening in the background since this rank's first call on the "
            f"group, has not opened after {timeout:.0f}s (a rank of the group has not called objcomm on it)"
        )
    return state.channel


def vote_on(wire: Wire, state: SameHost, channel: _channel.LocalChannel) -> None:
    """Start voting send/recv onto ``channel`` in the background (after a reopening that left them off it)."""
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

    def _run(self) -> None:
        group, channel = self._held
        self._held.clear()
        try:
            if channel is None:
                channel = self._open(group)
        finally:
            self.opened.set()
        del group
        if channel is not None and not channel.p2p:
            _LIVE.add(self)
            try:
                self._vote(channel)
            finally:
                _LIVE.discard(self)

    def _open(self, group: Any) -> Optional[_channel.LocalChannel]:
        state, wire = self.state, self.wire._replace(group=group)
        op = "opening the same-host channel (in the background)"
        channel = control = None
        try:
            control = _groups.sibling(group, "objcomm-channel", "gloo")
            entries = state.begin_vote(group)
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
                    state.channel, state.decided, state.owed = channel, True, {}
                    state.control = None if channel is None else control
                state.end_vote()
        except Exception as exc:  # the group's send/recv and collectives go on without the channel
            self.problem = f"{op} failed: {exc}"
            with state.cond:
                state.decided = True
        if channel is None:
            if control is not None:
                _groups.forget(control)
            return None
        channel.control = control
        weakref.finalize(group, self._gone, channel, control).atexit = False
        return channel

    def _gone(self, channel: _channel.LocalChannel, control: Any) -> None:
        """The group is gone: stop voting, close the channel, then its control group."""
        self.stop()
        channel.close()
        _groups.forget(control)

    def _vote(self, channel: _channel.LocalChannel) -> None:
        state, wire, pause = self.state, self.wire, FIRST_PAUSE
        what = "voting send/recv onto the same-host channel (in the background)"
        while True:
            stop = self.stopping.wait(pause)
            pause = min(2 * pause, LONGEST_PAUSE)
            group = self.group()
            with state.control_lock:  # (a reopening of the group's channel waits: it goes through the control group)
                stop = stop or group is None or channel.closed
                entries = None if stop or group is None else state.begin_vote(group, settle=0.0)
                del group
                try:
                    rows = channel.vote(wire, entries, what, stop=stop)
                    with state.cond:  # before the vote ends: a send/recv waiting for it must see the outcome
                        if rows is not None:
                            state.owe(rows, wire.rank)
                            channel.p2p = True
                except _channel.VotingStopped:
                    return
                except CommunicationError as exc:  # (OutOfStep included) the next collective decides anew
                    if isinstance(exc, _channel.OutOfStep):
                        state.broken = str(exc)
                    with contextlib.suppress(CommunicationError):
                        channel.fail(what, f"the send/recv vote failed ({exc})", exc)
                    return
                finally:
                    state.end_vote()
            if rows is not None:
                return


def _stop_all() -> None:
    """At exit: every voting thread of this process votes "stop", so that the peers' threads end with it."""
    for opener in list(_LIVE):
        opener.stop()


atexit.register(_stop_all)
