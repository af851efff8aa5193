"""Which route a call took: count the calls of module or class attributes for a while, then put them back."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Mapping, Sequence, Tuple


@contextlib.contextmanager
def counting(targets: Mapping[str, Sequence[Tuple[Any, str]]]) -> Iterator[Dict[str, int]]:
    """``{key: [(owner, attribute name), ...]}``: inside, each call of one of a key's attributes adds one to
    ``counts[key]`` (the dict this yields); the attributes are restored on the way out, whatever happened.

    Example::

        with counting({"send": [(_transport, "send")]}) as counts:
            comm.send(obj, 1)
        assert counts["send"] == 0  # the express path
    """
    counts = {key: 0 for key in targets}
    saved = []
    try:
        for key, attributes in targets.items():
            for owner, name in attributes:
                real = getattr(owner, name)
                saved.append((owner, name, real))

                def counted(*args: Any, _real: Any = real, _key: str = key, **kwargs: Any) -> Any:
                    counts[_key] += 1
                    return _real(*args, **kwargs)

                setattr(owner, name, counted)
        yield counts
    finally:
        for owner, name, real in reversed(saved):
            setattr(owner, name, real)
