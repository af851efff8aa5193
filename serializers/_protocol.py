"""What a serializer is: a name, ``dumps``/``loads`` and three pieces of metadata.

:class:`SerializerProtocol` is the whole surface objcomm calls; :class:`Serializer` is a base
class that provides it. A serializer may offer less (``name``, ``dumps(obj)`` and ``loads(data)``
are enough): the registry fills in the rest when it is registered (see :mod:`serializers._registry`).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional, Protocol, runtime_checkable

from serializers._errors import decoding, encoding

Buffer = Any  # bytes, bytearray, memoryview or anything else with the buffer protocol
Lift = Callable[[Any], Optional[int]]
Restore = Callable[[int], Any]
# Decoders written in C that bound nesting by Python's recursion limit, not by their C stack (json's scanner,
# msgspec), are trusted with it up to this limit; past it (a program that raised it, as ML code often does) input is
# counted first: a crash came between 20,000 and 30,000 levels on an 8 MiB stack.
SAFE_RECURSION_LIMIT = 5_000


@runtime_checkable
class SerializerProtocol(Protocol):
    """The surface every serializer offers objcomm (structural: any object with these members will do).

    Out-of-band objects: ``dumps`` and ``loads`` take two keyword-only hooks that let the caller
    carry some objects outside the byte stream (objcomm uses them for tensors); a serializer whose
    ``supports_external`` is False ignores them.

    - ``dumps(obj, lift=fn)``: ``fn(value)`` is offered non-builtin values; it returns an ``int``
      key when it takes the value out of band, or ``None`` to let the serializer encode it.
    - ``loads(data, restore=fn)``: ``fn(key)`` returns the object that stood at that key.
    """

    name: str
    safe: bool
    description: str
    supports_external: bool

    def dumps(self, obj: Any, /, *, lift: Lift | None = None) -> Buffer: ...

    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any: ...


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
    # True on a class whose own dumps/loads raise only objcomm errors (the built-ins); the registry
    # wraps every other serializer once, when it is registered. Read from the class itself, not
    # inherited: a subclass that overrides dumps or loads may raise anything.
    _raises_own_errors: ClassVar[bool] = False

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

    _raises_own_errors = True

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
        with encoding(self.name, obj):
            return self._dumps(obj)

    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any:
        with decoding(self.name, data):
            return self._loads(data)
