"""A serializer for Python literals: ``repr`` to encode, ``ast.literal_eval`` to decode.

Readable on the wire and safe to decode (``literal_eval`` builds values, it never calls
anything). Registered with objcomm by the entry point in this package's ``pyproject.toml``::

    [project.entry-points."objcomm.serializers"]
    literal = "objcomm_literal:LiteralSerializer"

Example::

    import serializers

    s = serializers.get("literal")          # found through the entry point
    s.loads(s.dumps({"a": (1, 2.5), "b": {3}}))   # {'a': (1, 2.5), 'b': {3}}
"""

from __future__ import annotations

import ast
import math
from typing import Any

from serializers import DecodeError, EncodeError, Serializer

__all__ = ["LiteralSerializer"]

_SCALARS = (type(None), bool, int, str, bytes)
_CONTAINERS = (tuple, list, set)


class LiteralSerializer(Serializer):
    """Python literals as UTF-8 text; anything ``ast.literal_eval`` cannot rebuild is refused."""

    name = "literal"
    safe = True
    description = "Python literals as repr text, decoded by ast.literal_eval: readable, safe, builtins only"

    def dumps(self, obj: Any, /, **_: Any) -> bytes:
        """Encode ``obj`` as the text of a Python literal; raise ``EncodeError`` naming the bad part."""
        _check(obj, "obj")
        return repr(obj).encode("utf-8")

    def loads(self, data: Any, /, **_: Any) -> Any:
        """Rebuild the value from its literal text; raise ``DecodeError`` if it is not one."""
        try:
            return ast.literal_eval(bytes(data).decode("utf-8"))
        except (ValueError, TypeError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as exc:
            raise DecodeError(f"literal cannot decode {len(memoryview(data))} bytes: {exc}") from exc


def _check(value: Any, path: str) -> None:
    """Refuse what ``repr`` would not write as a literal (exact types: a subclass's repr may differ)."""
    cls = type(value)
    if cls in _SCALARS:
        return
    if cls is float or cls is complex:
        parts = (value.real, value.imag) if cls is complex else (value,)
        if not all(math.isfinite(p) for p in parts):
            raise EncodeError(f"literal cannot encode {value!r} at {path}: nan and inf have no literal form")
        return
    if cls in _CONTAINERS:
        for i, item in enumerate(value if cls is not set else sorted(value, key=repr)):
            _check(item, f"{path}[{i}]")
        return
    if cls is dict:
        for key, item in value.items():
            _check(key, f"{path} key {key!r}")
            _check(item, f"{path}[{key!r}]")
        return
    raise EncodeError(
        f"literal cannot encode {cls.__module__}.{cls.__qualname__} at {path}: only Python literals "
        "(None, bool, int, float, complex, str, bytes, tuple, list, dict, set); use pickle or msgpack for others"
    )
