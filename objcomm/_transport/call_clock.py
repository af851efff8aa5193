"""One timeout for the steps of a call after its round 1.

Round 1 waits as long as the group's timeout for every rank to come: ranks reach a call at different times. Once
every rank of the call is there, what follows (votes, echoes, control words, the rest) should take moments.
Each wait there used to get the whole timeout of its own, so a peer that answered each step just within it held the
others for one timeout per step (a helper measured 5.6 times the timeout for one all_gather through shared memory).
Now a transport operation (:func:`one_call`) starts a clock at the first moment this rank knows every rank of the
call is there (:func:`round_one_done`): after all_gather's and all_to_all's exchange of slots, gather's word from its
destination, a send's answer, a receive's slot, and a broadcast's or scatter's echo of round 1 (one host) or vote
(never at their slot alone: one receiver's slot says nothing of the others, which may still be coming). The waits
after it end when that clock has run for the group's timeout (:func:`ends`): a collective's waits on the
same-host channel (which then fails, as after any collective's timeout, so that every rank learns at once), and the
backend's transfers (:class:`objcomm._transport.bytes.Deadline`). Before that mark, the same waits end twice the
timeout after the operation began: a late rank comes within one, and what follows takes moments (on two levels a
broadcast's echo and vote come before the mark, and two colluding ranks, one on each host, answering each hop just
within the timeout held the others 4.3 timeouts: a helper's find). A send/recv's waits on the channel keep a timeout
each (one that runs out leaves the channel open; its stream is bounded by
:func:`objcomm._samehost.channel_rests.in_time`).

The clock is per thread (a :class:`contextvars.ContextVar`), so another thread's send/recv on the same channel keeps
its own; a call nested in another (a reduction's tree of sends, its result's broadcast) has its own. The backend's
own collectives (a vote's ``all_reduce`` through gloo) still wait the group's timeout each.

Example::

    >>> @one_call
    ... def call():
    ...     round_one_done()
    ...     return ends(30.0) is not None
    >>> call(), ends(30.0)
    (True, None)
"""

from __future__ import annotations

import functools
import time
from contextvars import ContextVar
from typing import Any, Callable, List, Optional, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

# [round 1 done, the call began] of this thread's call; None outside one (the channel's waits read it: CLOCK.get())
CLOCK: ContextVar[Optional[List[Optional[float]]]] = ContextVar("objcomm_call_clock", default=None)


def one_call(function: F) -> F:
    """``function`` runs as one call: its own clock, started by :func:`round_one_done`, gone when it returns."""

    @functools.wraps(function)
    def scoped(*args: Any, **kwargs: Any) -> Any:
        token = CLOCK.set([None, time.monotonic()])  # [round 1 done, the call began]
        try:
            return function(*args, **kwargs)
        finally:
            CLOCK.reset(token)

    return scoped  # type: ignore[return-value]


def round_one_done() -> None:
    """This call's round 1 is done on this rank: its later waits share one timeout from now (the first mark counts)."""
    started = CLOCK.get()
    if started is not None and started[0] is None:
        started[0] = time.monotonic()


def until(start: float, timeout: float, shared: bool = True) -> float:
    """When a wait begun at ``start`` (``time.monotonic()``) with ``timeout`` must end: ``start + timeout``, or this
    call's end (:func:`ends`) where that is sooner and the wait is ``shared`` (a collective's; a send/recv's on the
    channel keeps its own timeout)."""
    started = CLOCK.get() if shared else None  # (not ends(): every wait on the channel asks, a small call too)
    return start + timeout if started is None else min(start + timeout, _end(started, timeout))


def ends(timeout: float) -> Optional[float]:
    """When this call's steps must be done (``time.monotonic()``): ``timeout`` after its round 1; before its round 1
    is done, twice ``timeout`` after it began; None outside a call."""
    started = CLOCK.get()
    return None if started is None else _end(started, timeout)


def _end(started: List[Optional[float]], timeout: float) -> float:
    done, began = started
    return done + timeout if done is not None else (began or 0.0) + 2 * timeout
