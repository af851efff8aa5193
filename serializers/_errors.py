"""The root of objcomm's one exception hierarchy, here because ``serializers`` is the lower layer.

This module defines the part of the tree that needs no torch: :class:`ObjcommError` (the root),
:class:`SerializationError` with :class:`EncodeError` and :class:`DecodeError`,
:class:`UnknownSerializerError` and :class:`ContentRefusedError`. The whole tree, with what
each error means, is drawn once, in :mod:`objcomm._errors`. Backend exceptions are wrapped
(:func:`encoding`, :func:`decoding`) with the original kept as ``__cause__``. Every public class
says ``__module__ = "objcomm"``, its public home: users see ``objcomm.DecodeError``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Tuple

# What every public exception's ``__module__`` says: its repr, tracebacks and pickles name it
# ``objcomm.DecodeError`` (resolved by objcomm's lazy ``__getattr__``), not this private module.
PUBLIC_MODULE = "objcomm"


class ObjcommError(Exception):
    """Root of every error objcomm raises on purpose."""

    __module__ = PUBLIC_MODULE


class SerializationError(ObjcommError, ValueError):
    """A value could not be encoded to bytes, or bytes could not be decoded."""

    __module__ = PUBLIC_MODULE


class EncodeError(SerializationError, TypeError):
    """``dumps`` failed: the message names the serializer, the type and its path in the object."""

    __module__ = PUBLIC_MODULE


class DecodeError(SerializationError):
    """``loads`` failed: the bytes are corrupt, truncated or were written by another serializer."""

    __module__ = PUBLIC_MODULE


class UnknownSerializerError(ObjcommError, LookupError):
    """No serializer is registered under the requested name."""

    __module__ = PUBLIC_MODULE


class ContentRefusedError(ObjcommError):
    """The receiver refuses this content: a serializer outside ``accept`` or a global not allowed."""

    __module__ = PUBLIC_MODULE


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


# Top-level packages whose frames are the serializing machinery, not an object's own code (raised_by).
MACHINERY: Tuple[str, ...] = ("pickle", "_pickle", "copyreg", "cloudpickle", "serializers", "objcomm")


def raised_by(exc: BaseException, machinery: Tuple[str, ...] = MACHINERY) -> Optional[str]:
    """Where an object's own code raised ``exc`` while a serializer ran it (a ``__reduce__``, a
    ``__getstate__``): ``"Bad.__reduce__ (models.py, line 12)"``, the first frame of that code;
    ``None`` when the failure came from the serializer itself (its innermost frame is machinery's,
    as for ``cannot pickle '_thread.lock' object``), so that its hint about serializers applies."""
    tb = exc.__traceback__
    entry: Any = None
    own = False
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__") or ""
        own = module.partition(".")[0] not in machinery
        if own and entry is None:
            entry = tb
        tb = tb.tb_next
    if not own or entry is None:
        return None
    frame = entry.tb_frame
    code = frame.f_code
    name = getattr(code, "co_qualname", None)  # Python 3.11+; before, a method is told by its ``self``
    if name is None:
        owner = type(frame.f_locals.get("self"))
        name = f"{owner.__qualname__}.{code.co_name}" if hasattr(owner, code.co_name) else code.co_name
    return f"{name} ({os.path.basename(code.co_filename)}, line {entry.tb_lineno})"


def decoding(serializer: str, data: Any) -> _Decoding:
    """Turn any non-objcomm exception raised while ``serializer`` decodes ``data`` into a DecodeError."""
    return _Decoding(serializer, data)
