"""What the rank pool (tests/_ranks.py) raises.

::

    AssertionError
    └── RankPoolError          ranks reported errors (an AssertionError, so pytest shows the message well)
        ├── RankFailure        one or more ranks raised, or could not send their result back
        │   └── RankDied       a worker process exited during a call; the pool is broken
        └── RankTimeout        a call did not finish in time; the pool was killed and is broken
    RuntimeError
    ├── PoolBrokenError        run() on a pool that is closed or broken
    └── PoolStartupError       the workers could not start or form the process group
"""

from __future__ import annotations

from typing import Any

__all__ = ["PoolBrokenError", "PoolStartupError", "RankDied", "RankFailure", "RankPoolError", "RankTimeout"]


class RankPoolError(AssertionError):
    """Base for errors reported by ranks (an AssertionError so pytest shows the message well)."""


class RankFailure(RankPoolError):
    """One or more ranks raised (or could not return their result).

    Attributes:
        failures: rank -> formatted remote traceback (or explanation).
        exceptions: rank -> the remote exception object if it could be pickled back, else None.
        results: rank -> result for ranks that did succeed.
        pool_killed: True if the pool had to be killed (then it is ``broken``).
    """

    def __init__(self, message: str, *, failures=None, exceptions=None, results=None, pool_killed: bool = False):
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})
        self.exceptions: dict[int, BaseException | None] = dict(exceptions or {})
        self.results: dict[int, Any] = dict(results or {})
        self.pool_killed = pool_killed

    @property
    def ranks(self) -> list[int]:
        return sorted(self.failures)


class RankDied(RankFailure):
    """A worker process exited during a call (crash, os._exit, signal). The pool is broken."""

    def __init__(self, message: str, *, exitcodes=None, **kw):
        super().__init__(message, pool_killed=True, **kw)
        self.exitcodes: dict[int, int | None] = dict(exitcodes or {})


class RankTimeout(RankPoolError):
    """A call did not finish in time; the whole pool was killed and is broken.

    Attributes:
        pending: ranks that had not answered.
        failures / exceptions / results: what the other ranks did answer.
    """

    def __init__(self, message: str, *, pending=(), failures=None, exceptions=None, results=None):
        super().__init__(message)
        self.pending: list[int] = sorted(pending)
        self.failures: dict[int, str] = dict(failures or {})
        self.exceptions: dict[int, BaseException | None] = dict(exceptions or {})
        self.results: dict[int, Any] = dict(results or {})


class PoolBrokenError(RuntimeError):
    """run() on a pool that is closed or broken (after a timeout or a dead worker)."""


class PoolStartupError(RuntimeError):
    """The workers could not start or form the process group."""
