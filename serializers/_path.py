"""Find where in an object a serializer gave up, for error messages like ``$['metrics'][2]``.

Only runs after an encode failed, so it may be slow; it never runs on the hot path.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Tuple

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


_CONTAINERS = (dict, list, tuple, set, frozenset)  # exactly these: an encoder walks into their items


def locate(
    obj: Any, rejects: Callable[[Any, bool], bool], root: str = "$", whole: bool = False
) -> Optional[Tuple[str, Any, bool]]:
    """Return ``(path, value, is_key)`` of the first value ``rejects(value, is_key)`` flags, depth first.

    For a dict key, ``path`` is the path of the dict holding it.

    A container is reported only when none of its children is (the innermost culprit wins). ``whole``: for an
    encoder that takes other objects (a dataclass, a named tuple, a ``Counter``) only whole, through a codec
    (msgpack), such an object it refuses is reported itself, not one of its fields (which the encoder never reached:
    a codec for that field would not help).

    >>> locate({"a": [1, {2}]}, lambda v, k: isinstance(v, set))
    ("$['a'][1]", {2}, False)
    """
    seen: set[int] = set()

    def visit(value: Any, path: str, is_key: bool, depth: int) -> Optional[Tuple[str, Any, bool]]:
        if depth > MAX_DEPTH or id(value) in seen:
            return None
        seen.add(id(value))
        if whole and type(value) not in _CONTAINERS and rejects(value, is_key):
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
