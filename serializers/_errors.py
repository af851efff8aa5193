"""The root of objcomm's one exception hierarchy, here because ``serializers`` is the lower layer.

This module defines the part of the tree that needs no torch: :class:`ObjcommError` (the root),
:class:`SerializationError` with :class:`EncodeError` and :class:`DecodeError`,
:class:`UnknownSerializerError` and :class:`ContentRefusedError`. The whole tree, with what
each error means, is drawn once, in :mod:`objcomm._errors`. Backend exceptions are wrapped
(:func:`encoding`, :func:`decoding`) with the original kept as ``__cause__``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional


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
def encoding(serializer: str, obj: Any) -> Iterator[None]:
    """Turn any non-objcomm exception raised while ``serializer`` encodes ``obj`` into an EncodeError."""
    try:
        yield
    except ObjcommError:
        raise
    except Exception as exc:
        raise EncodeError(f"{serializer} cannot encode {type(obj).__name__}: {type(exc).__name__}: {exc}") from exc


class _Decoding:
    """The context manager :func:`decoding` returns; a class because it wraps every decode (cheaper)."""

    __slots__ = ("serializer", "data")

    def __init__(self, serializer: str, data: Any) -> None:
        self.serializer = serializer
        self.data = data

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Optional[type], exc: Optional[BaseException], tb: Any) -> None:
        if exc is None or isinstance(exc, ObjcommError) or not isinstance(exc, Exception):
            return
        raise decode_error(self.serializer, self.data, exc) from exc


def decode_error(serializer: str, data: Any, exc: BaseException) -> DecodeError:
    """The DecodeError :func:`decoding` raises for ``exc`` (for hot paths that catch it themselves)."""
    try:
        size = f"{memoryview(data).nbytes:,} bytes"
    except TypeError:
        size = f"a {type(data).__name__}"
    return DecodeError(f"{serializer} cannot decode {size}: {type(exc).__name__}: {exc}")


def decoding(serializer: str, data: Any) -> _Decoding:
    """Turn any non-objcomm exception raised while ``serializer`` decodes ``data`` into a DecodeError."""
    return _Decoding(serializer, data)
