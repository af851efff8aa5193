"""The one exception hierarchy of objcomm, rooted here because ``serializers`` is the lower layer.

::

    ObjcommError                       everything objcomm raises on purpose
    ├── SerializationError             a value could not be turned into bytes or back
    │   ├── EncodeError                dumps failed (a type the serializer cannot carry, ...)
    │   └── DecodeError                loads failed (corrupt or foreign bytes, ...)
    ├── UnknownSerializerError         a name nobody registered (also a LookupError)
    ├── ContentRefusedError            a serializer or a global the receiver does not accept
    ├── FrameError                     objcomm: a malformed frame (bad magic, truncated, ...)
    ├── TooLargeError                  objcomm: a frame over the ``max_bytes`` limit
    ├── RemoteError                    objcomm: another rank failed in the same call
    └── CommunicationError             objcomm: the collective itself failed (timeout, lost rank)

The last four are defined in :mod:`objcomm._errors`; all are exported from ``objcomm``.
Backend exceptions are wrapped with the original kept as ``__cause__``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator


class ObjcommError(Exception):
    """Root of every error objcomm raises on purpose."""


class SerializationError(ObjcommError, ValueError):
    """A value could not be encoded to bytes, or bytes could not be decoded."""


class EncodeError(SerializationError, TypeError):
    """``dumps`` failed: the message names the serializer, the type and its path in the object."""


class DecodeError(SerializationError):
    """``loads`` failed: the bytes are corrupt, truncated or were written by another serializer."""


class UnknownSerializerError(ObjcommError, LookupError):
    """No serializer is registered under the requested name."""


class ContentRefusedError(ObjcommError):
    """The receiver refuses this content: a serializer outside ``accept`` or a global not allowed."""


@contextmanager
def decoding(serializer: str, data: Any) -> Iterator[None]:
    """Turn any non-objcomm exception raised while ``serializer`` decodes ``data`` into a DecodeError."""
    try:
        yield
    except ObjcommError:
        raise
    except Exception as exc:
        try:
            size = f"{memoryview(data).nbytes:,} bytes"
        except TypeError:
            size = f"a {type(data).__name__}"
        raise DecodeError(f"{serializer} cannot decode {size}: {type(exc).__name__}: {exc}") from exc
