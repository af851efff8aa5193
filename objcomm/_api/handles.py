"""The handles of non-blocking operations: :class:`Request` (``isend``, ``irecv``, ``async_op=True``), and how the
future behind one completes, in a lane's thread or at once (where the operations run: :mod:`objcomm._api.requests`).
"""

from __future__ import annotations

import concurrent.futures
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional

from objcomm._api.mpi4py_names import MPI4PY_REQUEST_CLASS_NAMES, MPI4PY_REQUEST_NAMES, mpi4py_keywords, no_attribute
from objcomm._errors import WaitTimeoutError


class _RequestType(type):
    if not TYPE_CHECKING:  # (as Request's own __getattr__)

        def __getattr__(cls, name: str) -> Any:
            """Only for names the class lacks: mpi4py's ``Request.waitall`` and its kin say what to write instead."""
            raise no_attribute("type object 'Request'", "Request", name, MPI4PY_REQUEST_CLASS_NAMES)


class Request(metaclass=_RequestType):
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

    __slots__ = ("_future", "_seen", "op")

    def __init__(self, op: str, future: concurrent.futures.Future[Any]) -> None:
        self.op = op
        self._future = future
        self._seen = False  # whether its outcome was asked for (wait(), get_future()); see __del__

    @mpi4py_keywords
    def wait(self, timeout: Optional[float] = None) -> Any:
        """The operation's result (``None`` for ``isend``), once it completes; or its exception.

        ``timeout``: seconds to wait at most; when they pass first, :class:`~objcomm.WaitTimeoutError`.
        """
        try:
            result = self._future.result(timeout)
            self._seen = True
            return result
        except concurrent.futures.TimeoutError:
            raise WaitTimeoutError(
                f"{self.op} did not complete within {timeout} s; it is still in progress and this handle stays "
                "usable: call wait() again. If it never completes, a peer has not issued the matching call"
            ) from None
        except BaseException:
            self._seen = True
            raise

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
        self._seen = True  # (its outcome is the future's holder's now)
        return self._future

    def __del__(self) -> None:
        """A request dropped before anyone asked for its outcome: if it failed, or fails later, a RuntimeWarning
        says so (as asyncio does for a task's exception never retrieved), since no ``wait()`` will raise it: an
        ``isend`` not waited for before ``dist.destroy_process_group()``, say, whose message never left."""
        if not self._seen:
            self._future.add_done_callback(_warn_if_failed(self.op))

    if not TYPE_CHECKING:  # type checkers keep refusing unknown attributes

        def __getattr__(self, name: str) -> Any:
            """Only for names this class lacks: mpi4py's Request methods say what to write instead."""
            raise no_attribute("'Request' object", "request", name, MPI4PY_REQUEST_NAMES)

    def __repr__(self) -> str:
        state = "completed" if self._future.done() else "pending"
        return f"<objcomm.Request {self.op} {state}>"


def _warn_if_failed(op: str) -> Callable[[concurrent.futures.Future[Any]], None]:
    def warn(future: concurrent.futures.Future[Any]) -> None:
        failure = None if future.cancelled() else future.exception()
        if failure is not None:
            warnings.warn(  # what to do first: the failure's own text may be long and blame a crash (a newcomer's find)
                f"objcomm: {op} failed and its request was dropped without wait(), so nothing raised it. Wait for "
                "non-blocking requests (Request.wait()) before dist.destroy_process_group() or the end of the "
                f"program; a request left waiting at exit fails when the group closes. The failure: "
                f"{type(failure).__name__}: {failure}",
                RuntimeWarning,
                stacklevel=2,
            )

    return warn


class _ThreadState(threading.local):
    inside = False  # this thread runs a lane's call (its blocking calls are the request); a class default: a missing
    # attribute of a threading.local costs an AttributeError on every blocking send/recv
    lane = False  # this thread is a lane's (its requests' done-callbacks run here: none may wait for a lane)


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
