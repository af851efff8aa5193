"""The budget of one restricted-pickle load (:func:`start_budget` to :func:`end_budget`, per thread): the work its
constructors may still do (:func:`charge`, in units of about one byte copied, eight bytes of memory built or 20 ns of
CPU: a payload can name one big value many times through pickle's memo, so each call must pay for what it builds),
and what the load remembers to refuse what no single call shows: chains of deques and defaultdicts (:func:`nested`),
one bytearray under several arrays (:func:`unshared`), a Decimal beside a big number (:func:`big_number`,
:func:`decimal_built`). Outside a load nothing is charged or remembered.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional

from serializers._errors import DecodeError


def _refuse(what: str) -> DecodeError:
    return DecodeError(f"payload refused: {what}")


_work = threading.local()  # .remaining: the load's state (start_budget) while a budget is active


class work_budget:  # used like the function it replaced, and cheaper on every load
    """Charge the work done by constructors inside this block (copies, hashing, what they build) against ``units``."""

    __slots__ = ("units", "outer")

    def __init__(self, units: int) -> None:
        self.units = units
        self.outer: Optional[List[Any]] = None

    def __enter__(self) -> None:
        self.outer = start_budget(self.units)

    def __exit__(self, *exc: Any) -> None:
        end_budget(self.outer)


def start_budget(units: int) -> Optional[List[Any]]:
    """Start a budget of ``units`` without a ``with`` block; return what :func:`end_budget` restores."""
    outer = getattr(_work, "remaining", None)
    # the units left, nested()'s depths, unshared()'s buffers, big_number()'s bits, whether a Decimal was built, the
    # probe pass's nesting probes (guards._NestingProbe), fraction_built()'s bits
    _work.remaining = [units, {}, None, 0, False, 0, 0]
    return outer


def end_budget(outer: Optional[List[Any]]) -> None:
    """End the budget :func:`start_budget` began (in a ``finally``), restoring the one it returned."""
    _work.remaining = outer


def charge(units: int, what: str) -> None:
    """Spend ``units`` of the active budget (if any) on ``what``; refuse the payload when it runs out."""
    remaining = getattr(_work, "remaining", None)
    if remaining is not None:
        remaining[0] -= units
        if remaining[0] < 0:
            raise _refuse(
                f"{what}: the payload asks for more work (bytes copied, keys hashed, values built) "
                "than its size allows: restricted-pickle's work budget is exhausted"
            )


# Deques and defaultdicts directly inside each other, at most this many deep: CPython frees them by recursing into
# what they hold without the "trashcan" that lists, tuples and dicts use, so a chain of ~150,000 (1.6 MB of pickle)
# overflows the C stack when it is freed (an attacker's find). restricted-pickle's probe pass bounds the chains that
# its APPEND(S) and SETITEM(S) build (guards._NestingProbe); calls that build one from the last (:func:`nested`)
# are bounded here.
MAX_NESTED = 512


def nested(value: Any, children: Any, what: str) -> Any:
    """``value`` (a deque or defaultdict just built; ``children``: what it holds directly), once the chain of those
    inside each other that it ends is at most :data:`MAX_NESTED` deep: its depth is one more than its deepest child
    built so in this load (O(len(children)), only once the load has built one)."""
    remaining = getattr(_work, "remaining", None)
    if remaining is None or remaining[1] is None:
        return value
    depths, depth = remaining[1], 1
    if depths:
        for child in children:
            seen = depths.get(id(child))
            if seen is not None and seen[1] >= depth:
                depth = seen[1] + 1
        if depth > MAX_NESTED:
            raise too_deep(what)
    depths[id(value)] = (value, depth)  # (the value held: its id is not reused while the load runs)
    return value


def state() -> List[Any]:
    """This load's state (:func:`start_budget`'s list; slot 5 counts the probe pass's nesting probes), or a fresh one
    outside a load."""
    remaining = getattr(_work, "remaining", None)
    return [0, {}, None, 0, False, 0, 0] if remaining is None else remaining


def nesting_checked() -> None:
    """What :func:`nested` checks, the probe pass checked already in this load (it follows every chain, the
    calls' included): the real pass need not."""
    remaining = getattr(_work, "remaining", None)
    if remaining is not None:
        remaining[1] = None


def unshared(data: Any, what: str, nbytes: Optional[int] = None, copy: Any = bytearray) -> Any:
    """``data`` (a bytearray; or a tensor, ``nbytes`` long, which ``copy`` copies), the first time a load builds an
    array, a tensor or a Parameter over it; a copy (charged) each time after, so that no two values of one load share
    memory, as none a trusted encoder writes do (one bytearray, or one tensor, that the payload names through its
    memo for several would otherwise make writes to one show in the others)."""
    remaining = getattr(_work, "remaining", None)
    if remaining is None:
        return data
    if remaining[2] is None:
        remaining[2] = {}
    if id(data) not in remaining[2]:
        remaining[2][id(data)] = data  # (held: its id is not reused while the load runs)
        return data
    charge(len(data) if nbytes is None else nbytes, what)
    return copy(data)


# Comparing a Decimal with an int or a Fraction converts that to a Decimal, in time quadratic in its size (~270 µs
# for an int of 14,300 bits, ~540 µs for a Fraction of two), and a payload whose set or dict holds the two with
# equal hashes (numbers' hashes are easy to make equal) pays one comparison per two-byte reference to either: 100 KB
# took 35 s (an attacker's find). A load that builds a Decimal holds no int or Fraction of more than this many bits.
DECIMAL_PEER_BITS = 2048
# Comparing a Decimal with a Fraction grows with the Decimal's digits and more with the Fraction's bits: 603 digits
# and 2,001 bits, 13.5 µs; a 4,300-digit Decimal and a Fraction of two 2,030-bit ints of equal hash, 43 µs a
# comparison, one per one-byte reference (a helper's find: 104 KB took 4.6 s). With a Decimal, a Fraction's parts
# hold at most this many bits (4,300 digits: ~5 µs).
FRACTION_DECIMAL_BITS = 256


def big_number(bits: int, what: str) -> None:
    """A number of ``bits`` bits in this load (an int the walk read, a Fraction's larger part); refused past
    :data:`DECIMAL_PEER_BITS` where the load builds a Decimal too."""
    remaining = getattr(_work, "remaining", None)
    if remaining is None or bits <= DECIMAL_PEER_BITS:
        return
    if remaining[4]:
        raise _with_decimal(what, bits)
    remaining[3] = max(remaining[3], bits)


def fraction_built(bits: int, what: str = "a Fraction") -> None:
    """This load builds a Fraction whose larger part has ``bits`` bits: refused past :data:`DECIMAL_PEER_BITS`, and
    past :data:`FRACTION_DECIMAL_BITS`, where the load builds a Decimal too (in either order)."""
    big_number(bits, what)
    remaining = getattr(_work, "remaining", None)
    if remaining is None or bits <= FRACTION_DECIMAL_BITS:
        return
    if remaining[4]:
        raise _with_decimal(what, bits, "a Fraction", FRACTION_DECIMAL_BITS)
    remaining[6] = max(remaining[6], bits)


def decimal_built() -> None:
    """This load builds a Decimal: refused where it holds a number past :data:`DECIMAL_PEER_BITS`, or a Fraction
    past :data:`FRACTION_DECIMAL_BITS`."""
    remaining = getattr(_work, "remaining", None)
    if remaining is None:
        return
    if remaining[3]:
        raise _with_decimal("a Decimal", remaining[3])
    if remaining[6]:
        raise _with_decimal("a Decimal", remaining[6], "a Fraction", FRACTION_DECIMAL_BITS)
    remaining[4] = True


def _with_decimal(what: str, bits: int, peer: str = "a number", limit: int = DECIMAL_PEER_BITS) -> DecodeError:
    instead = "one of them as text" if peer == "a number" else "the Fraction as text (str(f)) or its two ints"
    return _refuse(
        f"{what}: a Decimal and {peer} of more than {limit:,} bits (about {bits:,}) in one payload: comparing them "
        f"costs time quadratic in the number's size, once per reference; send {instead}, or use pickle"
    )


def too_deep(what: str) -> DecodeError:
    """The error of a chain of deques and defaultdicts past :data:`MAX_NESTED` (or, in the probe pass, a cycle)."""
    return _refuse(
        f"{what}: deques and defaultdicts nested over {MAX_NESTED} deep, or in a cycle of two or more (freeing a deep "
        "chain recurses in C)"
    )
