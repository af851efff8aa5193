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
    └── MissingDependencyError   an optional library (zstandard, lz4) is not installed (also an ImportError)

The first five come from the torch-free ``serializers`` package and are re-exported here.
"""

from __future__ import annotations

from typing import Dict, Tuple

from serializers import (
    ContentRefusedError,
    DecodeError,
    EncodeError,
    ObjcommError,
    SerializationError,
    UnknownSerializerError,
)

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


class TooLargeError(ObjcommError, ValueError):
    """A frame is larger than the ``max_bytes`` limit of the sender or of a receiver."""


class CommunicationError(ObjcommError, RuntimeError):
    """The underlying torch.distributed call failed (a rank never arrived, the group timed out, ...)."""


class WaitTimeoutError(ObjcommError, TimeoutError):
    """``Request.wait(timeout)`` returned before the operation completed; it is still in progress."""


Failure = Tuple[str, str]  # (exception type name, message)


class RemoteError(ObjcommError, RuntimeError):
    """One or more ranks failed in this call; every rank raises it, the failing ones included.

    ``failures`` maps each failing rank (in the group) to ``(exception type name, message)``.
    """

    def __init__(self, op: str, failures: Dict[int, Failure]) -> None:
        self.op = op
        self.failures = dict(sorted(failures.items()))
        ranks = ", ".join(str(r) for r in self.failures)
        details = "; ".join(f"rank {r}: {t}: {m}" for r, (t, m) in self.failures.items())
        plural = "s" if len(self.failures) > 1 else ""
        super().__init__(
            f"{op} failed on rank{plural} {ranks}, so no rank received a result. {details}. "
            "The group is still usable; fix the failing object (or pick a serializer that can carry it) and retry."
        )

    @property
    def ranks(self) -> list[int]:
        """The failing ranks, ascending."""
        return list(self.failures)
