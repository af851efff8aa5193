"""Find where in an object a serializer gave up, for error messages like ``$['metrics'][2]``.

Only runs after an encode failed, so it may be slow; it never runs on the hot path.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Tuple

from serializers._errors import EncodeError

MAX_DEPTH = 200


def _children(obj: Any, path: str) -> Iterator[Tuple[str, Any, bool]]:
    """Yield ``(path, child, is_key)`` for the containers a serializer walks into."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield path, key, True
            yield f"{path}[{key!r}]", value, False
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield f"{path}[{index}]", value, False
    elif isinstance(obj, (set, frozenset)):
        for value in obj:
            yield f"{path}{{{value!r}}}", value, False
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj):
        for name, value in vars(obj).items():
            yield f"{path}.{name}", value, False


def locate(
    obj: Any, rejects: Callable[[Any, bool], bool], root: str = "$", whole: Optional[Callable[[Any], bool]] = None
) -> Optional[Tuple[str, Any, bool]]:
    """Return ``(path, value, is_key)`` of the first value ``rejects(value, is_key)`` flags, depth first.

    For a dict key, ``path`` is the path of the dict holding it.

    A container is reported only when none of its children is (the innermost culprit wins). ``whole``: whether
    the encoder has no way at all to take a value of that type (msgpack: no codec, no extension, as for a
    dataclass, a named tuple, a ``Counter``): such a value it refuses is reported itself, not one of its fields, which
    the encoder never reached (a codec for that field would not help).

    >>> locate({"a": [1, {2}]}, lambda v, k: isinstance(v, set))
    ("$['a'][1]", {2}, False)
    """
    seen: set[int] = set()

    def visit(value: Any, path: str, is_key: bool, depth: int) -> Optional[Tuple[str, Any, bool]]:
        if depth > MAX_DEPTH or id(value) in seen:
            return None
        seen.add(id(value))
        if whole is not None and whole(value) and rejects(value, is_key):
            return path, value, is_key
        for child_path, child, child_is_key in _children(value, path):
            found = visit(child, child_path, child_is_key, depth + 1)
            if found is not None:
                return found
        return (path, value, is_key) if rejects(value, is_key) else None

    return visit(obj, root, False, 0)


def describe(value: Any) -> str:
    """The type's name for messages: ``set``, ``numpy.ndarray``, ``torch.Tensor``,
    ``torch.nn.modules.linear.Linear`` (the whole module path: where to find the class)."""
    cls = type(value)
    module = cls.__module__
    if module in ("builtins", "__builtin__"):
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"


# what a safe serializer that refuses a value suggests instead: a safe one first, pickle only for trusted ranks
INSTEAD = "restricted-pickle (safe: .allow() your classes) or pickle (ranks you trust)"


def encode_refusal(
    name: str,
    obj: Any,
    rejects: Callable[[Any, bool], bool],
    exc: BaseException,
    instead: str,
    whole: Optional[Callable[[Any], bool]] = None,
) -> EncodeError:
    """The :class:`EncodeError` of backend ``name`` for ``obj``: the first value ``rejects`` and where it sits
    (``whole``: :func:`locate`'s)."""
    found = locate(obj, rejects, whole=whole)
    path, value, _ = found if found is not None else ("$", obj, False)
    return EncodeError(  # (the encoder's own words may name a holder of that value: where it stopped)
        f"{name} cannot encode {describe(value)} at {path} (the encoder said: {exc}); "
        f"register a codec with serializers.register_type(), or use {instead}"
    )
