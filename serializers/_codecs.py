"""Per-type codecs: how a type msgpack or JSON cannot carry natively travels anyway.

A codec turns a value into something the serializer can carry (``encode``) and back
(``decode``). msgpack wraps the result in an extension type, JSON in a tagged object
``{"__objcomm_type__": name, "value": ...}``. Both sides look codecs up by *name*, so
ranks may register them in any order.

Example::

    import serializers
    from fractions import Fraction

    def check(v):  # decode gets whatever a peer sent: refuse anything but two small ints
        if not (type(v) is list and len(v) == 2 and all(type(n) is int and n.bit_length() <= 64 for n in v)):
            raise ValueError("expected [numerator, denominator] as 64-bit ints")

    serializers.register_type(
        Fraction,
        encode=lambda f: [f.numerator, f.denominator],
        decode=lambda v: Fraction(*v),
        validate=check,
    )

``decode`` and ``validate`` receive what a peer sent, unchecked: with a safe serializer that is
hostile input. ``validate(value)`` runs first and raises to refuse; any exception from either
becomes a :class:`DecodeError` naming the codec.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Union

from serializers._errors import DecodeError
from serializers._rebuild import brief


@dataclass(frozen=True)
class TypeCodec:
    """How one type travels: ``encode(value) -> carriable``, ``decode(carriable) -> value``.

    ``validate(carriable)``, when given, runs before ``decode`` on every received value and raises
    to refuse it.
    """

    cls: type
    name: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    validate: Optional[Callable[[Any], Any]] = None

    def decode_received(self, value: Any) -> Any:
        """Validate and decode a value a peer sent; every failure is a :class:`DecodeError`."""
        try:
            if self.validate is not None:
                self.validate(value)
            return self.decode(value)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"codec {self.name!r} refused a received value: {type(exc).__name__}: {exc}") from exc


class CodecRegistry:
    """Codecs by exact type and by name; subclasses find their base's codec through the MRO."""

    def __init__(self) -> None:
        self._by_type: Dict[type, TypeCodec] = {}
        self._by_name: Dict[str, TypeCodec] = {}
        self._lock = threading.Lock()

    def register(
        self,
        cls: type,
        encode: Callable[[Any], Any],
        decode: Callable[[Any], Any],
        *,
        name: Optional[str] = None,
        replace: bool = False,
        validate: Optional[Callable[[Any], Any]] = None,
    ) -> TypeCodec:
        """Register a codec for ``cls``; ``name`` defaults to ``module.QualName``.

        ``validate(carriable)`` runs on every received value before ``decode`` and raises to
        refuse it: with msgpack and json, what arrives is whatever a peer sent.
        """
        if not isinstance(cls, type):
            raise TypeError(f"register_type() needs a class, got {cls!r}")
        codec = TypeCodec(cls, name or f"{cls.__module__}.{cls.__qualname__}", encode, decode, validate)
        with self._lock:
            taken = self._by_name.get(codec.name)
            if taken is not None and not replace and taken.cls is not cls:
                raise ValueError(
                    f"a codec named {codec.name!r} is already registered for {taken.cls!r}; "
                    "pass replace=True to override it or choose another name"
                )
            if cls in self._by_type and not replace:
                raise ValueError(f"{cls!r} already has a codec; pass replace=True to override it")
            old = self._by_type.pop(cls, None)
            if old is not None:
                self._by_name.pop(old.name, None)
            self._by_type[cls] = codec
            self._by_name[codec.name] = codec
        return codec

    def unregister(self, cls_or_name: Union[type, str]) -> None:
        """Remove a codec by class or by name; unknown ones raise ``KeyError``."""
        with self._lock:
            codec = self._by_name.get(cls_or_name) if isinstance(cls_or_name, str) else self._by_type.get(cls_or_name)
            if codec is None:
                raise KeyError(f"no codec registered for {cls_or_name!r}")
            del self._by_type[codec.cls]
            del self._by_name[codec.name]

    def for_value(self, value: Any) -> Optional[TypeCodec]:
        """The codec for ``type(value)`` or its nearest registered base, else None."""
        by_type = self._by_type
        if not by_type:
            return None
        for cls in type(value).__mro__:
            codec = by_type.get(cls)
            if codec is not None:
                return codec
        return None

    def by_name(self, name: str) -> Optional[TypeCodec]:
        """The codec registered under ``name``, else None."""
        return self._by_name.get(name)

    def names(self) -> list[str]:
        """Names of the registered codecs, sorted."""
        return sorted(self._by_name)

    def named(self, serializer: str, name: Any) -> TypeCodec:
        """The codec a ``serializer`` payload names as ``name``; :class:`DecodeError` where this rank has none. The
        name is described, never repr'd: a payload's value (a helper's find: msgpack's 600 references to one tensor
        as a name took 4.4 s of tensor formatting and a 4 MB message)."""
        codec = self._by_name.get(name) if type(name) is str else None
        if codec is None:
            raise DecodeError(
                f"{serializer} payload holds a value of registered type {brief(name)}, but no codec of that name is "
                f"registered on this rank (known: {self.names()}); call serializers.register_type() here too"
            )
        return codec


codecs = CodecRegistry()
register_type = codecs.register
unregister_type = codecs.unregister
