"""objcomm's exceptions: one hierarchy with one root, :class:`ObjcommError`.

::

    ObjcommError
    ├── SerializationError
    │   ├── EncodeError          this rank could not encode its object
    │   └── DecodeError          this rank could not decode what a sender sent
    ├── UnknownSerializerError   a frame or a call names a serializer nobody registered here
    ├── ContentRefusedError      a frame's serializer is not in ``accept``, or a refused pickle global
    ├── FrameError               a malformed frame: bad magic, unknown version, truncated, lengths disagree
    ├── TooLargeError            a frame above ``max_bytes`` (checked before anything is allocated)
    ├── RemoteError              another rank failed in the same call; ``.failures`` says who and why
    ├── CommunicationError       the collective itself failed: a rank never arrived, the group timed out
    ├── WaitTimeoutError         ``Request.wait(timeout)`` ran out; the operation goes on (also a TimeoutError)
    ├── MissingDependencyError   an optional library (zstandard, lz4) is not installed (also an ImportError)
    ├── LaunchError              a local rank (``objcomm bench``/``demo``, ``benchmarks/``) failed, died or timed out
    └── OpError                  the op function of ``reduce``/``all_reduce`` raised (its ``RemoteError`` quotes it)

The first five come from the torch-free ``serializers`` package and are re-exported here.
``MissingDependencyError`` is defined in ``_compression`` and exported; ``LaunchError`` is
private to ``_launch`` (the command line reports it and exits with status 1). ``OpError`` is
private too: it travels as its cause's type (see :func:`original`) and every rank raises a
``RemoteError`` quoting its message. The classes exported here show, and pickle, as ``objcomm.<Name>``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type, TypeVar, cast

from serializers import (
    ContentRefusedError,
    DecodeError,
    EncodeError,
    ObjcommError,
    SerializationError,
    UnknownSerializerError,
)
from serializers._errors import PUBLIC_MODULE

__all__ = [
    "CommunicationError",
    "ContentRefusedError",
    "DecodeError",
    "EncodeError",
    "FrameError",
    "ObjcommError",
    "RemoteError",
    "SerializationError",
    "TooLargeError",
    "UnknownSerializerError",
    "WaitTimeoutError",
]


class FrameError(ObjcommError, ValueError):
    """A frame is malformed: wrong magic, unknown format version, truncated, or inconsistent lengths."""

    __module__ = PUBLIC_MODULE


class TooLargeError(ObjcommError, ValueError):
    """A frame is larger than the ``max_bytes`` limit of the sender or of a receiver."""

    __module__ = PUBLIC_MODULE


class CommunicationError(ObjcommError, RuntimeError):
    """The underlying torch.distributed call failed (a rank never arrived, the group timed out, ...)."""

    __module__ = PUBLIC_MODULE


class WaitTimeoutError(ObjcommError, TimeoutError):
    """``Request.wait(timeout)`` returned before the operation completed; it is still in progress."""

    __module__ = PUBLIC_MODULE


Failure = Tuple[str, str]  # (exception type name, message)


def ranks_note(ranks: Optional[Sequence[int]]) -> str:
    """What an error about a group whose ranks are not the global ones adds after "rank r of W": objcomm's errors name
    group ranks, where ``src`` and ``dst`` take global ones (a helper's find: a subgroup's error blamed "rank 0",
    global rank 1). Empty where they are the same."""
    if ranks is None or all(g == r for r, g in enumerate(ranks)):
        return ""
    if len(ranks) <= 16:
        return f" (ranks of this group; their global ranks: {list(ranks)})"
    return " (ranks of this group: dist.get_global_rank(group, r) gives each one's global rank)"


# why a peer did not come, where a wait for it ran out: what a timeout's message lists
NOT_THERE = (
    "a rank may have crashed, never called this operation, called a different one, or called it with settings "
    "that every rank of a group must share and this one does not (local, slot_bytes, shm, shm_threshold, "
    'shm_zero_copy, shm_dir: docs/same-host.md, "Settings"); OBJCOMM_CHECK_CALLS=1 on every rank names the rank '
    "whose collective or settings differ"
)
# why a receive's sender did not send, where the wait for it ran out (a send/recv: no collective, no shared settings)
NOT_SENT = (
    "the sender may have crashed, not sent under this tag yet, or be held back in its own send by the bound on sends "
    'not yet received (1024 small sends a group: docs/from-mpi4py.md, "Blocking sends")'
)
NO_RESULT = "so no rank received a result"  # what a RemoteError says of the call, where every rank raises it


SPELT_OUT = 16  # failing ranks a RemoteError's message names one by one; past them, ranks that failed alike together
KINDS_SHOWN = 8  # past SPELT_OUT: the distinct failures it spells out (RemoteError.failures holds every one)
SPANS_SHOWN = 10  # and the runs of consecutive ranks it names for each


def spans(ranks: Sequence[int]) -> str:
    """Ascending ``ranks`` as runs (``0-3, 5, 7-9``), the first :data:`SPANS_SHOWN` of them."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    shown = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:SPANS_SHOWN])
    return shown + (f", ... ({len(runs) - SPANS_SHOWN} more runs)" if len(runs) > SPANS_SHOWN else "")


def shown_ranks(ranks: Sequence[int]) -> str:
    """A group's ranks as an error shows them: the list, up to :data:`SPELT_OUT` of them; past it, how many and their
    runs (``8,192 ranks: 0-8191``), where the list took 50 KB in one message."""
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= SPELT_OUT else f"{len(ranks):,} ranks: {spans(ranks)}"


def shown_values(values: Sequence[Any]) -> str:
    """Every rank's value as an error shows them: the list, up to :data:`SPELT_OUT` ranks; past it, each distinct value
    once with the ranks that hold it (``8,192 ranks: ranks 0-8190: 100; rank 8191: 99``), the first
    :data:`KINDS_SHOWN`, where the list took tens of KB on every rank."""
    if len(values) <= SPELT_OUT:
        return str(list(values))
    return f"{len(values):,} ranks: " + _by_value(enumerate(values), repr, "values")


def _alike(failures: Dict[int, Failure]) -> str:
    """The failures, each distinct one once with the ranks that had it (the first :data:`KINDS_SHOWN`)."""
    return _by_value(
        failures.items(), lambda f: f"{f[0]}: {f[1]}", "failures (the exception's .failures holds every rank's)"
    )


def _by_value(by_rank: Iterable[Tuple[int, Any]], shown: Callable[[Any], str], what: str) -> str:
    """Each distinct value of ``by_rank`` (rank, value) once, as ``shown`` spells it, with the ranks that hold it, the
    first :data:`KINDS_SHOWN` (``ranks 0-3: ...; rank 4: ...``), and how many more distinct ``what`` there are."""
    ranks_of: Dict[Any, List[int]] = {}
    for rank, value in by_rank:
        ranks_of.setdefault(value, []).append(rank)
    listed = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {spans(rs)}: {shown(v)}" for v, rs in list(ranks_of.items())[:KINDS_SHOWN]
    )
    more = len(ranks_of) - KINDS_SHOWN
    return listed + (f"; {more} more distinct {what}" if more > 0 else "")


class RemoteError(ObjcommError, RuntimeError):
    """One or more ranks failed in this call; every rank raises it, the failing ones included.

    ``failures`` maps each failing rank (in the group) to ``(exception type name, message)``; ``outcome`` says
    which ranks went without a result (every rank, unless a lying rank split the group).
    """

    __module__ = PUBLIC_MODULE

    def __init__(self, op: str, failures: Dict[int, Failure], outcome: str = NO_RESULT) -> None:
        self.op = op
        self.failures = dict(sorted(failures.items()))
        self.outcome = outcome
        plural = "s" if len(self.failures) > 1 else ""
        if len(self.failures) <= SPELT_OUT:
            ranks = f"rank{plural} " + ", ".join(str(r) for r in self.failures)
            details = "; ".join(f"rank {r}: {t}: {m}" for r, (t, m) in self.failures.items())
        else:  # (8192 ranks that fail alike: one line, not megabytes on every rank)
            ranks, details = f"{len(self.failures):,} ranks ({spans(list(self.failures))})", _alike(self.failures)
        super().__init__(
            f"{op} failed on {ranks}, {outcome}. {details}. The group is still usable; fix what failed there and retry."
        )

    @property
    def ranks(self) -> list[int]:
        """The failing ranks, ascending."""
        return list(self.failures)

    def __reduce__(self) -> tuple[Any, ...]:  # the combined classes of remote_error() exist only at run time
        extra = [k for k in type(self).__bases__ if k is not RemoteError]
        return _unpickle_remote_error, (self.op, self.failures, extra[0] if extra else None, self.outcome)


def _unpickle_remote_error(
    op: str, failures: Dict[int, Failure], kind: type | None, outcome: str = NO_RESULT
) -> RemoteError:
    return (RemoteError if kind is None else also_instance_of(RemoteError, kind))(op, failures, outcome)


class OpError(ObjcommError):
    """The function given to ``reduce``/``all_reduce`` raised; ``__cause__`` is what it raised.

    The message names the function and where it raised, so that every rank's :class:`RemoteError`
    says the caller's code failed (no serializer would help); :func:`original` reports the cause's type.
    """


# -- the failing rank's own exception type ---------------------------------------------------------
def original(exc: BaseException) -> BaseException:
    """What really failed: an :class:`EncodeError`'s or :class:`DecodeError`'s cause (the serializer's own
    exception, e.g. ``pickle.PicklingError``, or what unpickling raised) or an :class:`OpError`'s (what the op
    function raised), else ``exc`` itself."""
    while isinstance(exc, (EncodeError, DecodeError, OpError)) and exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


_E = TypeVar("_E", bound=BaseException)


def also_instance_of(base: Type[_E], kind: type) -> Type[_E]:
    """A subclass of ``base`` that is also ``kind``, so that code catching the original type (as it
    would around torch's object collectives) catches objcomm's exception too; ``base`` itself when
    the two cannot be combined (incompatible layouts, final classes) or already are."""
    plain: type = base  # as the memo takes it (a type, hashable)
    return cast(Type[_E], _combined(plain, kind))  # a subclass of base (or base itself)


@functools.lru_cache(maxsize=256)  # a pure memo: one class per pair, so equal failures raise equal types
def _combined(base: type, kind: type) -> type:
    if issubclass(base, kind) or not issubclass(kind, Exception):
        return base
    try:
        namespace = {"__str__": BaseException.__str__, "__module__": base.__module__, "__doc__": base.__doc__}
        if base.__reduce__ is BaseException.__reduce__:  # (RemoteError has its own)
            namespace["__reduce__"] = _reduce_combined  # the class exists only at run time: pickle names its parts
        return type(base.__name__, (base, kind), namespace)
    except TypeError:  # e.g. a class that forbids subclassing
        return base


def _reduce_combined(exc: BaseException) -> tuple[Any, ...]:
    base, kind = type(exc).__bases__
    return _unpickle_combined, (base, kind, exc.args, exc.__dict__)


def _unpickle_combined(base: type, kind: type, args: tuple[Any, ...], state: Dict[str, Any]) -> BaseException:
    """An exception of :func:`also_instance_of`'s class for ``base`` and ``kind``, as it was pickled."""
    exc: BaseException = _combined(base, kind)(*args)
    exc.__dict__.update(state)
    return exc


def with_original_type(exc: BaseException) -> BaseException:
    """``exc``, or a copy of it that is also an instance of :func:`original`'s type: what the failing
    rank raises itself (a sender whose object cannot be encoded), so that ``except PicklingError``
    written for torch's object collectives still catches it."""
    cls = also_instance_of(type(exc), type(original(exc)))
    if cls is type(exc):
        return exc
    try:
        copy = cls(*exc.args)
    except Exception:  # the original's constructor wants other arguments (UnicodeDecodeError: five)
        return exc
    copy.__dict__.update(exc.__dict__)
    copy.__cause__, copy.__traceback__ = exc.__cause__, exc.__traceback__
    return copy


def remote_error(
    op: str, failures: Dict[int, Failure], local: BaseException | None, outcome: str = NO_RESULT
) -> RemoteError:
    """The :class:`RemoteError` a rank raises; on a rank whose own step failed (``local``), one that
    is also an instance of what failed there (see :func:`also_instance_of`)."""
    cls = RemoteError if local is None else also_instance_of(RemoteError, type(original(local)))
    return cls(op, failures, outcome)
