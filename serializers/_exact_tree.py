"""Whether msgspec gives an object back exactly: ``serializer="auto"``'s one look at a value before it uses msgspec.

msgspec (decoding into ``Any``) is the fastest encoder of JSON-like data, but turns tuples, sets and class
instances into lists and dicts without a word. :func:`carried_exactly` says, without encoding anything, that an
object holds nothing it would change, so ``auto`` may send it through msgspec unjudged. True when the object is,
all the way down:

- ``None``, ``bool``, ``float``, ``str``, ``bytes``, or an ``int`` from -2**63 to 2**64 - 1 (exact types: a
  subclass, an ``IntEnum`` say, would come back as its base); a ``str`` or ``bytes`` of :data:`SHARED_LENGTH` or
  more met twice is not carried (msgspec would write it each time: ``[s] * 1000`` of a 100 KB ``s`` made 100 MB,
  where pickle writes it once; a long ``str`` key met in many dicts likewise);
- a ``list``, or a ``dict`` whose keys are ``str`` or such ``int`` (exact types again), of such values;
- a value whose exact type is one of ``leaves`` (objcomm passes ``torch.Tensor``: tensors travel out of band,
  the same way whichever serializer carries the rest), or is ``large`` with more than ``large_above`` bytes and a
  dtype (by identity) in ``large_dtypes`` (``numpy.ndarray`` past msgspec's ``in_band_array_bytes``, of a dtype
  objcomm lifts out of band too, where aliasing survives; msgspec writes other arrays in its payload, each time
  it meets them, and decodes small ones through Python, three times slower than pickle: those go to pickle).
  ``large`` must be a type defined in C: the walk reads its ``nbytes`` and ``dtype`` while it holds borrowed
  references, and a Python class could run code there (a ``TypeError`` says so).

Two more rules keep it exact where equality would not notice: no list or dict may be met twice (msgspec writes
it twice, and the receiver would get two lists where the sender had one; a container inside itself is met twice
too), and nesting stops at :data:`MAX_DEPTH`.

A string msgspec cannot encode (a lone surrogate) still passes: msgspec refuses it when encoding, and ``auto``
goes on to the next candidate. The walk is in C (``_exact_tree_c.c``, built by setup.py where a compiler was at
hand); without it :data:`carried_exactly` is None and ``auto`` does without (pickle first, as it would anyway).
:func:`carried_exactly_python` is the reference the tests hold the C walk to, and too slow to be worth using.

>>> carried_exactly is None or carried_exactly({"loss": 0.25, "ids": [1, 2]}, ())
True
>>> carried_exactly_python({"kernel": (3, 3)}, ())
False
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Set, Tuple

MAX_DEPTH = 100  # containers nested deeper than this: not looked into, not carried (pickle is)
SHARED_LENGTH = 64  # a str or bytes this long or longer met twice: not carried
_SCALARS = (type(None), bool, float)


def carried_exactly_python(
    obj: Any,
    leaves: Tuple[type, ...],
    large: Optional[type] = None,
    large_above: int = 0,
    large_dtypes: Tuple[Any, ...] = (),
) -> bool:
    """:func:`carried_exactly` in Python (the reference for the C walk)."""

    def fits(value: int) -> bool:
        return -(1 << 63) <= value < (1 << 64)

    seen: Set[int] = set()

    def once(text: Any) -> bool:  # short, or a long str or bytes met for the first time
        if len(text) < SHARED_LENGTH:
            return True
        met = id(text) in seen
        seen.add(id(text))
        return not met

    def walk(value: Any, depth: int) -> bool:
        kind = type(value)
        if kind is str or kind is bytes:
            return once(value)
        if any(kind is scalar for scalar in _SCALARS):
            return True
        if kind is int:
            return fits(value)
        if kind is not list and kind is not dict:
            if kind is large:
                return value.nbytes > large_above and any(value.dtype is d for d in large_dtypes)
            return any(kind is leaf for leaf in leaves)
        if depth >= MAX_DEPTH or id(value) in seen:
            return False
        seen.add(id(value))
        if kind is list:
            return all(walk(item, depth + 1) for item in value)
        return all(
            (once(k) if type(k) is str else type(k) is int and fits(k)) and walk(v, depth + 1) for k, v in value.items()
        )

    return walk(obj, 0)


_c: Optional[Callable[..., bool]]
try:
    from serializers._exact_tree_c import carried_exactly as _c
except ImportError:  # built without a compiler: auto does without
    _c = None
carried_exactly = _c
