"""What a serializer is: a name, ``dumps``/``loads`` and two pieces of metadata.

Out-of-band objects
-------------------
A serializer whose ``supports_external`` is True accepts two keyword-only hooks that let the
caller carry some objects outside the byte stream (objcomm uses them for tensors):

- ``dumps(obj, lift=fn)``: ``fn(value)`` is offered non-builtin values; it returns an ``int``
  key when it takes the value out of band, or ``None`` to let the serializer encode it.
- ``loads(data, restore=fn)``: ``fn(key)`` returns the object that stood at that key.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, runtime_checkable

from ._errors import DecodeError, EncodeError

Buffer = Any  # bytes, bytearray, memoryview or anything else with the buffer protocol
Lift = Callable[[Any], Optional[int]]
Restore = Callable[[int], Any]


@runtime_checkable
class SerializerProtocol(Protocol):
    """The surface every serializer offers (structural: any object with these members will do)."""

    name: str
    safe: bool
    description: str

    def dumps(self, obj: Any, /) -> Buffer: ...

    def loads(self, data: Buffer, /) -> Any: ...


class Serializer:
    """Base class for serializers; subclasses set the class attributes and implement two methods.

    Example::

        class Upper(Serializer):
            name, safe, description = "upper", True, "str only, upper-cased"
            def dumps(self, obj, /, **_):
                return obj.upper().encode()
            def loads(self, data, /, **_):
                return bytes(data).decode()
    """

    name: str = ""
    safe: bool = False
    description: str = ""
    supports_external: bool = False

    def dumps(self, obj: Any, /, *, lift: Lift | None = None) -> Buffer:
        """Encode ``obj`` to a bytes-like object; raise :class:`EncodeError` on failure."""
        raise NotImplementedError

    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any:
        """Decode any bytes-like ``data`` (a ``memoryview`` slice included) back to an object."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} safe={self.safe}>"


class FunctionSerializer(Serializer):
    """A serializer made from a plain ``dumps``/``loads`` pair, as ``register(name, dumps, loads)`` builds."""

    def __init__(
        self,
        name: str,
        dumps: Callable[[Any], Buffer],
        loads: Callable[[Buffer], Any],
        *,
        safe: bool = False,
        description: str = "",
    ) -> None:
        self.name = name
        self.safe = safe
        self.description = description or f"user serializer {name!r}"
        self._dumps = dumps
        self._loads = loads

    def dumps(self, obj: Any, /, *, lift: Lift | None = None) -> Buffer:
        try:
            return self._dumps(obj)
        except Exception as exc:
            raise EncodeError(f"{self.name} cannot encode {type(obj).__name__}: {exc}") from exc

    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any:
        try:
            return self._loads(data)
        except Exception as exc:
            raise DecodeError(f"{self.name} cannot decode {len(memoryview(data))} bytes: {exc}") from exc
