"""The serializer registry: a small class, one shared instance, module-level aliases.

A serializer from outside this package is wrapped once, when it is registered (:class:`_Foreign`):
objcomm calls the wrapper, :meth:`SerializerRegistry.guarded`, so whatever the serializer raises
reaches it as :class:`EncodeError` or :class:`DecodeError` (the original kept as ``__cause__``),
and the hooks a minimal serializer lacks are filled in. ``get`` returns what was registered.

Packages ship serializers through the entry-point group ``objcomm.serializers``; an entry point
may name a :class:`Serializer` instance, a class (instantiated without arguments) or a function
returning one. Entry points load on first need: a lookup of an unknown name, or ``available()``.
"""

from __future__ import annotations

import difflib
import threading
import warnings
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Union, cast

from serializers._errors import UnknownSerializerError, decoding, encoding
from serializers._protocol import Buffer, FunctionSerializer, Lift, Restore, Serializer, SerializerProtocol

ENTRY_POINT_GROUP = "objcomm.serializers"
SerializerLike = Union[str, SerializerProtocol]
OPTIONAL = {"msgspec": "msgspec"}  # built-ins registered only where their package is installed: name -> package


class _Foreign(Serializer):
    """A serializer from outside this package as objcomm calls it: failures become EncodeError or
    DecodeError, and ``supports_external`` and the keyword hooks are there even where it lacks them."""

    _raises_own_errors = True

    def __init__(self, wrapped: Any) -> None:
        self.wrapped = wrapped
        self.name = wrapped.name
        self.safe = bool(getattr(wrapped, "safe", False))
        self.description = str(getattr(wrapped, "description", ""))
        self.supports_external = bool(getattr(wrapped, "supports_external", False))

    def dumps(self, obj: Any, /, *, lift: Lift | None = None) -> Buffer:
        with encoding(self.name, obj):
            if lift is None or not self.supports_external:
                return self.wrapped.dumps(obj)
            return self.wrapped.dumps(obj, lift=lift)

    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any:
        with decoding(self.name, data):
            if restore is None or not self.supports_external:
                return self.wrapped.loads(data)
            return self.wrapped.loads(data, restore=restore)

    def __repr__(self) -> str:
        return f"<objcomm's wrapper of {self.wrapped!r}>"


def _guard(serializer: Any) -> SerializerProtocol:
    """``serializer`` itself when its own class raises only objcomm errors, else wrapped (:class:`_Foreign`)."""
    if vars(type(serializer)).get("_raises_own_errors", False):
        return cast(SerializerProtocol, serializer)  # one of this package's own serializer classes
    return _Foreign(serializer)


class _Entry(NamedTuple):
    registered: SerializerProtocol  # what register() was given (or built): get() returns it
    guarded: SerializerProtocol  # what objcomm calls: the same object, or its wrapper


class SerializerRegistry:
    """Serializers by name.

    Example::

        reg = SerializerRegistry()
        reg.register("upper", dumps=lambda s: s.upper().encode(), loads=lambda b: bytes(b).decode())
        reg.get("upper").dumps("hi")   # b'HI'
    """

    def __init__(self) -> None:
        self._by_name: Dict[str, _Entry] = {}
        self._lock = threading.RLock()
        self._entry_points_loaded = False
        self.version = 0  # counts changes, so that a caller may keep what guarded() returned until the next one

    def register(
        self,
        serializer: Union[SerializerProtocol, str],
        dumps: Optional[Callable[[Any], Buffer]] = None,
        loads: Optional[Callable[[Buffer], Any]] = None,
        *,
        safe: bool = False,
        description: str = "",
        replace: bool = False,
    ) -> SerializerProtocol:
        """Register a serializer object, or build one from ``name, dumps, loads``; return it.

        A taken name raises ``ValueError`` unless ``replace=True``. A serializer from outside this
        package is wrapped here, once, for objcomm (see :meth:`guarded`).
        """
        if isinstance(serializer, str):
            if dumps is None or loads is None:
                raise TypeError(f"register({serializer!r}, dumps, loads): both dumps and loads are required")
            serializer = FunctionSerializer(serializer, dumps, loads, safe=safe, description=description)
        elif dumps is not None or loads is not None:
            raise TypeError("pass either a serializer object or a name with dumps and loads, not both")
        _check_serializer(serializer)
        with self._lock:
            taken = self._by_name.get(serializer.name)
            if taken is not None and taken.registered is not serializer and not replace:
                raise ValueError(
                    f"a serializer named {serializer.name!r} is already registered ({taken.registered!r}); "
                    "pass replace=True to replace it, or pick another name"
                )
            if taken is None or taken.registered is not serializer:
                self._by_name[serializer.name] = _Entry(serializer, _guard(serializer))
                self.version += 1
        return serializer

    def unregister(self, name: str) -> None:
        """Remove the serializer registered as ``name``."""
        with self._lock:
            if self._by_name.pop(name, None) is None:
                raise UnknownSerializerError(self._unknown_message(name))
            self.version += 1

    def get(self, serializer: Optional[SerializerLike] = None, default: str = "pickle") -> SerializerProtocol:
        """The serializer for a name (or a serializer object, returned as is); ``None`` means ``default``."""
        if serializer is None:
            serializer = default
        if not isinstance(serializer, str):
            _check_serializer(serializer)
            return serializer
        return self._entry(serializer).registered

    def guarded(self, serializer: Optional[SerializerLike] = None, default: str = "pickle") -> SerializerProtocol:
        """The serializer as objcomm calls it: the whole :class:`SerializerProtocol`, raising only objcomm errors.

        Built-ins are returned as they are; others come wrapped, once, when registered (an object
        that is not registered is wrapped here).
        """
        if serializer is None:
            serializer = default
        if isinstance(serializer, str):
            found = self._by_name.get(serializer)  # the common case, without a call
            return (found if found is not None else self._entry(serializer)).guarded
        _check_serializer(serializer)
        found = self._by_name.get(serializer.name)
        if found is not None and found.registered is serializer:
            return found.guarded
        return _guard(serializer)

    def _entry(self, name: str) -> _Entry:
        found = self._by_name.get(name)
        if found is None:
            self.load_entry_points()
            found = self._by_name.get(name)
        if found is None:
            raise UnknownSerializerError(self._unknown_message(name))
        return found

    def available(self, *, safe: Optional[bool] = None) -> List[str]:
        """Registered names (entry points included), sorted; ``safe=True`` keeps those whose loads cannot run code."""
        self.load_entry_points()
        with self._lock:
            return sorted(n for n, e in self._by_name.items() if safe is None or bool(e.registered.safe) == safe)

    def load_entry_points(self) -> None:
        """Register the serializers other packages ship under ``objcomm.serializers``; runs once."""
        with self._lock:
            if self._entry_points_loaded:
                return
            self._entry_points_loaded = True
            from importlib.metadata import entry_points

            for ep in entry_points(group=ENTRY_POINT_GROUP):
                if ep.name in self._by_name:
                    continue
                try:
                    self.register(_instantiate(ep.load()))
                except Exception as exc:  # a broken plugin must not break every lookup
                    warnings.warn(
                        f"objcomm could not load serializer entry point {ep.name!r} ({ep.value}): {exc}",
                        RuntimeWarning,
                        stacklevel=2,
                    )

    def unregistered(self, names: Iterable[str]) -> str:
        """A note for a refusal by an ``accept=`` list that names serializers this rank does not have (a misspelt
        name refused every sender alike, and the message named only the sender's serializer: a newcomer's find);
        ``""`` where every name is registered."""
        registered = self.available()
        unknown = sorted(set(names) - set(registered))
        if not unknown:
            return ""
        return (
            f" (no serializer named {', '.join(map(repr, unknown))} is registered on this rank: a misspelling? "
            f"registered: {', '.join(registered)})"
        )

    def _unknown_message(self, name: str) -> str:
        known = ", ".join(sorted(self._by_name)) or "none"
        extra = OPTIONAL.get(name)
        fix = (
            f"install it on every rank: pip install {extra}"
            if extra is not None
            else "register it with serializers.register() or install the package that provides it"
        )
        close = difflib.get_close_matches(name, self._by_name, n=1) if isinstance(name, str) else []
        guess = f"did you mean {close[0]!r}? " if close else ""
        return f"no serializer named {name!r} is registered on this rank (registered: {known}); {guess}{fix}"


def _instantiate(loaded: Any) -> SerializerProtocol:
    if isinstance(loaded, type):
        return cast(SerializerProtocol, loaded())
    if not _missing(loaded):
        return cast(SerializerProtocol, loaded)
    if callable(loaded):
        return cast(SerializerProtocol, loaded())
    raise TypeError(f"expected a serializer, a serializer class or a factory, got {loaded!r}")


def _missing(serializer: Any) -> List[str]:
    """What ``serializer`` lacks of the least a serializer must have (the registry fills in the rest)."""
    return [a for a in ("name", "dumps", "loads") if not hasattr(serializer, a)]


def _check_serializer(serializer: Any) -> None:
    missing = _missing(serializer)
    if missing:
        raise TypeError(f"{serializer!r} is not a serializer: it lacks {', '.join(missing)}")
    name = serializer.name
    if not isinstance(name, str) or not name or len(name.encode()) > 255 or not name.isascii():
        raise ValueError(f"serializer names must be non-empty ASCII strings of at most 255 bytes, got {name!r}")


registry = SerializerRegistry()
register = registry.register
unregister = registry.unregister
get = registry.get
available = registry.available

__all__ = [
    "ENTRY_POINT_GROUP",
    "Serializer",
    "SerializerRegistry",
    "registry",
    "register",
    "unregister",
    "get",
    "available",
]
