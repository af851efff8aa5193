"""Validated constructors for the stdlib types a restricted-pickle payload names by their own global.

A payload names ``builtins.set``, ``collections.deque``, ``datetime.date``, ``decimal.Decimal``,
``fractions.Fraction`` and the like as standard pickle writes them; restricted-pickle's guards
(``_restricted``) route those calls to the functions below, never to the real class. Each takes
only values the payload spelled out (lists, tuples, sets, dicts, bytes, short text, ints of at most
``_MAX_INT_BITS`` bits) and charges what it copies or hashes to the per-load budget
(``_budget.charge``): ``bytearray(10**9)``, ``set(range(10**9))`` or ``Fraction("1e30000000")``
are refused. Unlike ``_rebuild``'s functions these are not named on the wire: the payload names
the stdlib type, so where they live is no part of the format.

Every function raises :class:`ContentRefusedError` (built by ``_refused``, which the guards share)
for input it will not build.
"""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import re
from typing import Any, Callable, List

from serializers import _budget, _rebuild
from serializers._errors import ContentRefusedError
from serializers._restricted.scan import COMPARED_BYTES

_MAX_INT_BITS = 14_300  # about 4,300 decimal digits: gcd and str conversions stay cheap
_DIGITS = _rebuild.MAX_INT_DIGITS
_FRACTION_TEXT = re.compile(rf"\s*[+-]?\d{{1,{_DIGITS}}}(?:/\d{{1,{_DIGITS}}})?\s*\Z")
_BUILT = (list, tuple, set, frozenset, dict)

# types whose hash and comparison cost a few words: anything else is looked at (_uncached_units)
_CHEAP_HASH = frozenset([float, bool, type(None), complex, decimal.Decimal])


def _refused(what: str) -> ContentRefusedError:
    return ContentRefusedError(f"restricted-pickle refused {what}; nothing was run")


def _built(value: Any, what: str, hashed: str = "") -> Any:
    """``value`` if it is a container the payload itself spelled out; its copy (and hashing) is charged.

    ``hashed``: ``"items"`` when its elements become set members or counter keys, ``"pairs"`` when
    it holds ``(key, value)`` pairs (or is a dict) whose keys are hashed.
    """
    if type(value) not in _BUILT:
        raise _refused(f"{what} of {type(value).__name__}: only lists, tuples, sets and dicts from the payload")
    _budget.charge(8 * len(value), what)
    if hashed == "pairs" and type(value) is not dict and not all(map(_is_pair, value)):
        # the constructor takes any 2-item iterable as a pair and hashes its first item: a deque, a dict, a set or
        # a 2-character string whose key no charge below sees (an attacker's find: OrderedDict([deque((t, 1))]),
        # t a chain of 60 DUP TUPLE2, 182 bytes that hashed 2**60 tuples); what the probe pass follows, too
        raise _refused(f"a{'n' if what[0] in 'AEIOU' else ''} {what} of pairs other than (key, value) tuples or lists")
    if type(value) is dict or hashed == "pairs":
        _charge_hashing(value if type(value) is dict else [p[0] for p in value], what)
    elif hashed:
        _charge_hashing(value, what)
    return value


def _charge_hashing(values: Any, what: str) -> None:
    """Charge what hashing ``values`` costs: 8 each, and again for what no type here caches: an int's size, a
    tuple's items (``torch.Size``'s too), a range's length (a new int each time) and a Fraction's modular inverse
    (an attacker's find: a set of 100,000 references to one Size of 100,000 sizes, 569 KB, took 32 s); and what
    comparing one with an equal one, not the same object, costs for each reference: a str's or bytes' size (as the
    walk charges its uses as keys, ``scan.COMPARED_BYTES``), a frozenset's members. One charge for the top level: a
    Python call per item would cost more than the hashing."""
    units = 8 * len(values)
    tuples = []
    for item in values:
        kind = type(item)
        if kind is int:
            units += item.bit_length() >> 3
        elif kind is str or kind is bytes:  # hashed once, but compared whole with an equal one each reference
            units += len(item) // COMPARED_BYTES
        elif kind is tuple:
            tuples.append(item)
        elif kind not in _CHEAP_HASH:
            units += _uncached_units(item, tuples)
    _budget.charge(units, what)
    while tuples:  # charged a tuple at a time: a dag of tuples costs exponentially more than it takes to spell
        item = tuples.pop()
        units = 8 * len(item)
        for sub in item:
            if type(sub) is int:
                units += sub.bit_length() >> 3
            elif type(sub) is str or type(sub) is bytes:
                units += len(sub) // COMPARED_BYTES
            elif type(sub) is tuple:
                tuples.append(sub)
            elif type(sub) not in _CHEAP_HASH:
                units += _uncached_units(sub, tuples)
        _budget.charge(units, what)


def _uncached_units(item: Any, tuples: List[Any]) -> int:
    """What hashing ``item`` (a type not in :data:`_CHEAP_HASH`) costs beyond its 8; a tuple subclass (``torch.Size``)
    and a frozenset (its hash is cached, but an equal one, not the same object, is compared member by member: 5.5 s
    for 200 KB of references to two equal 20,000-member frozensets) go to ``tuples``, charged for their items."""
    if isinstance(item, (tuple, frozenset)):
        tuples.append(item)
    elif isinstance(item, int):
        return item.bit_length() >> 3
    elif isinstance(item, (str, bytes)):  # numpy's str_ and bytes_ scalars: compared whole as their bases are
        return len(item) // COMPARED_BYTES
    elif type(item) is range:
        return (item.start.bit_length() + item.stop.bit_length() + item.step.bit_length()) >> 3
    elif type(item) is fractions.Fraction:  # its hash: pow(denominator, -1, P), then a product
        return (item.numerator.bit_length() + item.denominator.bit_length()) >> 2
    return 0


def _small_int(value: Any, what: str) -> int:
    if type(value) is not int or value.bit_length() > _MAX_INT_BITS:
        raise _refused(f"{what}: expected an int of at most {_MAX_INT_BITS} bits")
    return value


def _no_args(real: type) -> Callable[..., Any]:
    def build(*args: Any) -> Any:
        if args:
            raise _refused(f"calling {real.__name__} with arguments (only its empty value is built)")
        return real()

    return build


def _collection(real: type) -> Callable[..., Any]:
    def build(items: Any = ()) -> Any:
        return real(_built(items, real.__name__, hashed="items"))

    return build


def _frozenset(items: Any = ()) -> frozenset[Any]:
    # Comparing two equal frozensets compares their members: the walk charges each use of one as a key
    # or member for its members only when it knows them, from a tuple or frozenset (a list grows unseen).
    if type(items) not in (tuple, frozenset):
        raise _refused(f"frozenset() of {type(items).__name__}: only of a tuple or frozenset from the payload")
    return frozenset(_built(items, "frozenset", hashed="items"))


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if type(real) not in (int, float) or type(imag) not in (int, float):
        raise _refused("complex() of anything but numbers")
    return complex(_small_int(real, "complex") if type(real) is int else real, imag)


def _bytearray(source: Any = b"", encoding: Any = None) -> bytearray:
    if type(source) in (bytes, bytearray) and encoding is None:
        _budget.charge(len(source), "bytearray")
        return bytearray(source)
    if type(source) is str and encoding == "latin-1":
        _budget.charge(len(source), "bytearray")
        return bytearray(source, "latin-1")
    raise _refused("bytearray() of anything but bytes (a size would allocate without bound)")


def _ints_or_none(name: str, real: Any, max_args: int) -> Callable[..., Any]:
    def build(*args: Any) -> Any:
        if not 0 < len(args) <= max_args or any(type(a) is not int and a is not None for a in args):
            raise _refused(f"{name}() of anything but up to {max_args} ints")
        for a in args:
            if a is not None:
                _small_int(a, name)
        # range computes its length from them: a new int as long as the longest, each call
        _budget.charge(sum(a.bit_length() for a in args if a is not None) >> 3, name)
        return real(*args)

    return build


def _odict(items: Any = ()) -> Any:
    return collections.OrderedDict(_built(items, "OrderedDict", hashed="pairs"))


def _counter(items: Any = ()) -> Any:
    return collections.Counter(_built(items, "Counter", hashed="items"))


def _defaultdict(factory: Any = None, items: Any = ()) -> Any:
    real = None if factory is None else getattr(factory, "_factory", None)
    if factory is not None and real is None:
        raise _refused("a defaultdict whose factory is not an allowed empty constructor")
    items = _built(items, "defaultdict", hashed="pairs")  # (pairs only: a deque could hide a chain from the probe)
    built = collections.defaultdict(real, items)
    return _budget.nested(built, built.values(), "defaultdict")


def _deque(items: Any = (), maxlen: Any = None) -> Any:
    if maxlen is not None and (type(maxlen) is not int or not 0 <= maxlen < 2**62):
        raise _refused("a deque with that maxlen")
    built = collections.deque(_built(items, "deque"), maxlen)
    return _budget.nested(built, built, "deque")


def _defaultdict_holds(factory: Any = None, items: Any = ()) -> Any:
    """What a call of ``defaultdict`` with these arguments holds directly, as far as the probe pass can tell (its
    values, and each item that is no pair); ``()`` for arguments the real call refuses. An item that is no pair is
    refused by the real call, but only once the probe pass is over: a deque there (``defaultdict(None, [deque(["k",
    last])])``) hid a chain from the probe, whose pass over 200,000 of them took seconds before the refusal."""
    if type(items) is dict:
        return items.values()
    return [p[1] if _is_pair(p) else p for p in items] if type(items) in (list, tuple) else ()


def _is_pair(item: Any) -> bool:
    """Whether ``item`` is a (key, value) pair as the payload spells one: a tuple or a list of two."""
    return type(item) in (tuple, list) and len(item) == 2


def _deque_holds(items: Any = (), maxlen: Any = None) -> Any:
    """What a call of ``deque`` with these arguments holds directly (see :func:`_defaultdict_holds`)."""
    return items if type(items) in _BUILT else ()


# the calls whose values the probe pass follows down chains of each other (_budget.MAX_NESTED)
NESTING = {("collections", "defaultdict"): _defaultdict_holds, ("collections", "deque"): _deque_holds}


_DATETIME_ARGS = (int, float, bytes, str, bool, type(None), datetime.tzinfo, datetime.timedelta)


def _revalidated(value: Any) -> Any:
    """Rebuild a date/time from its fields: pickle's byte state is checked only for the month."""
    if isinstance(value, datetime.datetime):
        fields = (value.year, value.month, value.day, value.hour, value.minute, value.second, value.microsecond)
        return datetime.datetime(*fields, value.tzinfo, fold=value.fold)
    if isinstance(value, datetime.date):
        return datetime.date(value.year, value.month, value.day)
    if isinstance(value, datetime.time):
        return datetime.time(value.hour, value.minute, value.second, value.microsecond, value.tzinfo, fold=value.fold)
    return value


def _datetime(real: type) -> Callable[..., Any]:
    def build(*args: Any) -> Any:
        for arg in args:
            if not isinstance(arg, _DATETIME_ARGS) or (isinstance(arg, (str, bytes)) and len(arg) > 64):
                raise _refused(f"{real.__name__}() of {type(arg).__name__}")
            if type(arg) is int:
                _small_int(arg, real.__name__)
        try:
            return _revalidated(real(*args))
        except (ValueError, TypeError, OverflowError) as exc:
            raise _refused(f"an invalid {real.__name__}: {exc}") from None

    return build


def _decimal(value: Any = "0", context: Any = None) -> decimal.Decimal:
    if context is not None or type(value) not in (str, int, float, tuple):
        raise _refused("Decimal() of anything but a number, its text or its tuple")
    if type(value) is int:
        _small_int(value, "Decimal")
    # At most _DIGITS digits, as ints: comparing two equal Decimals compares every digit, once per reference
    # (an attacker's find: two of a million digits, compared once per 64 payload bytes, took 18 s for 9 MB)
    if type(value) is tuple:  # (sign, digits, exponent): each digit is converted, whatever the tuple's size
        if len(value) != 3 or type(value[1]) not in (tuple, list) or len(value[1]) > _DIGITS:
            raise _refused(f"Decimal() of a tuple other than (sign, digits, exponent) of at most {_DIGITS} digits")
        _budget.charge(8 * len(value[1]), "Decimal")
    elif type(value) is str:
        if len(value) > _DIGITS + 100:  # (room for a sign, a point and an exponent)
            raise _refused(f"Decimal() of text of more than {_DIGITS + 100} characters")
        _budget.charge(len(value), "Decimal")
    else:
        _budget.charge(8, "Decimal")
    _budget.decimal_built()
    return decimal.Decimal(value)


def _fraction(numerator: Any = 0, denominator: Any = None) -> fractions.Fraction:
    if type(numerator) is str and denominator is None:
        if not _FRACTION_TEXT.match(numerator):
            raise _refused("Fraction() of text other than 'n' or 'n/d' with at most 4300 digits each")
        _budget.charge(8 * len(numerator), "Fraction")
        built = fractions.Fraction(numerator)
        _budget.fraction_built(max(built.numerator.bit_length(), built.denominator.bit_length()))
        return built
    _small_int(numerator, "Fraction")
    if denominator is not None:
        _small_int(denominator, "Fraction")
    # their gcd and the quotients, a byte of work a byte of int: 3,575 units (~10 µs) for the largest; the
    # guard's fixed charge pays for small ones (Fraction(3, 7), as Python 3.11 pickles it, costs ~1 µs)
    bits = numerator.bit_length() + (denominator.bit_length() if denominator is not None else 0)
    _budget.charge(bits >> 3, "Fraction")
    built = fractions.Fraction(numerator, denominator)  # (the walk notes only ints past NOTED_INT_BYTES: LONG4)
    _budget.fraction_built(max(built.numerator.bit_length(), built.denominator.bit_length()))
    return built


def _object() -> object:
    return object()
