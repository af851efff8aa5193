"""The handles of non-blocking operations: :class:`Request` (``isend``, ``irecv``, ``async_op=True``), and how the
future behind one completes, in a lane's thread or at once (where the operations run: :mod:`objcomm._api.requests`).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

from objcomm._api.mpi4py_names import MPI4PY_REQUEST_NAMES, no_attribute
from objcomm._errors import WaitTimeoutError


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

    def __init__(self, op: str, future: concurrent.futures.Future[Any]) -> None:
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

    def get_future(self) -> concurrent.futures.Future[Any]:
        """A ``concurrent.futures.Future`` that completes with the operation.

        That type because the operation runs in a plain thread: it works with
        ``concurrent.futures.wait``/``as_completed``, ``asyncio.wrap_future`` and ``add_done_callback``,
        and ``result(timeout)`` has a timeout; a ``torch.futures.Future`` has none, and its CUDA-stream
        semantics promise nothing for Python objects. It cannot be cancelled: every rank must take part.
        """
        return self._future

    if not TYPE_CHECKING:  # type checkers keep refusing unknown attributes

        def __getattr__(self, name: str) -> Any:
            """Only for names this class lacks: mpi4py's Request methods say what to write instead."""
            raise no_attribute("'Request' object", "request", name, MPI4PY_REQUEST_NAMES)

    def __repr__(self) -> str:
        state = "completed" if self._future.done() else "pending"
        return f"<objcomm.Request {self.op} {state}>"


class _ThreadState(threading.local):
    inside = False  # this thread runs a lane's call (its blocking calls are the request); a class default: a missing
    # attribute of a threading.local costs an AttributeError on every blocking send/recv


_LOCAL = _ThreadState()


def _settle(future: concurrent.futures.Future[Any], fn: Callable[[], Any], release: Callable[[], None]) -> None:
    """Complete ``future`` with what ``fn`` returns or raises; ``release`` runs first (see
    :meth:`objcomm._api.requests._Lanes._done`). The lane's own blocking call runs ``inside``; the future's
    done-callbacks, which run on this thread as it completes, do not: their calls are checked like any other
    thread's."""
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


def completed(op: str, fn: Callable[[], Any]) -> Request:
    """Run ``fn`` now (no process group: nothing to overlap) and return its completed handle."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    _settle(future, fn, lambda: None)
    return Request(op, future)
