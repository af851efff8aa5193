"""The fast walk: proves, at regular-expression speed, that a pickle holds nothing but plain data.

Two implementations give the same answer on every input: :func:`is_plain_python` (this module, in
the regular-expression engine) and ``is_plain_c`` (``_pickle_walks_c.c``, an opcode at a time,
13-30x faster on the bench payloads; built at install where a compiler is at hand).
restricted-pickle runs :data:`is_plain`, the C one where it was built.
``tests/serializing/test_pickle_plain.py`` compares the two.

Most payloads (metrics, records, lists of floats or strings, int-keyed dicts, configs) are built
from opcodes that cannot reach a global, a call or state: scalars, strings, bytes, empty
containers, marks, APPEND(S)/SETITEM(S)/ADDITEMS, LIST/DICT, POP, POP_MARK, MEMOIZE, memo reads,
and TUPLE1/2/3 of the scalars pushed right before them. For such a payload the only rule of
``_pickle_scan`` that can fail is a declared length past the bytes present (the C unpickler
allocates what BINBYTES8 and friends declare before reading), so this walk checks exactly that,
and answers *plain* only when the payload reaches STOP through nothing else. Anything else (a
global, any other tuple, FROZENSET, DUP, BUILD, PUT, text opcodes, an unknown or truncated
opcode) answers *not shown plain*, and the full walk runs from the start and decides, with its
own error messages.

Why what it skips is safe to skip, for a payload made only of these opcodes:

- **Nesting** concerns tuples (and calls, which it refuses). A tuple it accepts holds only
  scalars pushed by the opcodes right before the tuple opcode (BININT, BININT1, BININT2,
  BINFLOAT, SHORT_BINUNICODE of at most 255 bytes, NONE, NEWTRUE, NEWFALSE, each maybe followed
  by MEMOIZE, which leaves the stack alone): it nests one deep, and no tuple can be an item of
  another, since a tuple is not a scalar and a memo read is not accepted as an item. Lists and
  dicts may nest deep, as the full walk allows too: unpickling is iterative, deallocation uses
  the trashcan, and restricted-pickle never renders values.
- **Hashing work**: each use of a value as a dict key or set member takes a value off the stack
  that exactly one opcode pushed. The full walk charges such a use 1 for a scalar, 1 + n/64 for
  a string of n bytes (at most 4 here) and, for a tuple, 1 plus its items' charges: at most 13
  for the tuples above. A value reaches the stack only through the opcodes that spell it (at
  least one byte per unit it is charged: a scalar's opcode, or a tuple opcode with its items)
  or through a memo read (2 or 5 bytes, at most 13 units). So a plain payload's charges stay
  under 6.5 per byte, below the full walk's
  budget of 16 per byte (``HASH_WORK_PER_BYTE``): the full walk would never refuse it for
  hashing work, and the C unpickler's hashing is linear in the payload. (A list, dict or set
  used as a key or member, which the full walk charges ``CONTAINER_WORK``, fails the load as
  unhashable at its first use.)
- **Memo reads** (BINGET, LONG_BINGET): the C unpickler checks the index against its memo and
  raises on an empty slot. MEMOIZE grows the memo by one slot per opcode. PUT opcodes, which
  could size the memo by a number the sender wrote, are left to the full walk.
- **Stack and mark underflow, APPEND or SETITEM on a value without them**: the C unpickler raises
  (``DecodeError``); every value on the stack is a builtin scalar, tuple or container, so no hook
  runs. Values left under the result at STOP are dropped, as ``pickle.loads`` drops them.
- **Hash flooding** needs non-string keys and is outside the guarantee (docs/security.md).
- **Comparing equal keys**: a key or set member equal to one already present but not the same
  object is compared. The memo lets a payload reuse one string as a key for two bytes a use, so a
  plain payload holds no str or bytes longer than 255 bytes (each reuse compares at most that
  much, three times for a tuple), no FROZENSET (comparing equal frozensets compares their
  members, recursively) and no DUP; the full walk charges those to its work budget.

How it stays an exact parse although it runs in ``re``: every alternative of the run pattern is a
sequence of whole opcodes, each one opcode byte followed by exactly its argument (fixed widths,
or for SHORT_BINUNICODE one alternative per length byte, followed by that many bytes), and where
alternatives start with the same byte they parse the same first opcode. So a match starting on
an opcode boundary can only follow the one parse the C unpickler follows, and it ends on an
opcode boundary; argument bytes are never read as opcodes. (Some alternatives read more than one
opcode: a run of BININTs, of strings each with a MEMOIZE, of memo reads each with the value after
it, of opcodes without argument; each is still a sequence of whole opcodes, the same parse in one
pass of the outer repeat, and no other alternative starts with a byte the last one's class holds.)
The lookahead after BINFLOAT reads the next opcode from that boundary too. A tuple opcode is
accepted only at the end of an alternative that itself parsed at least that many scalars just
before it. Where the run stops, a short Python step parses one length-prefixed opcode (checking
the length against the bytes present), or checks a run of BINFLOATs by stride (every 9th byte,
from a BINFLOAT, is the next opcode; the pattern without tuples only), and resumes the run.
A tuple opcode the pattern without tuples meets is stepped over (see below).

**Frames are parsed as the C unpickler reads them from a file**, which is how restricted-pickle
loads what is not plain (``pickle.loads`` over bytes, which loads plain payloads, ignores them: for
a payload whose frames begin and end between opcodes, as this walk requires, both parse alike).
After FRAME it buffers exactly the frame; an opcode whose argument runs past the frame's end makes
it refill the buffer from the bytes *after* the frame, dropping the rest of the argument inside it,
so that it would then run opcodes this walk took for an argument (a whole hostile pickle hidden in a
BYTEARRAY8, found by review). So FRAME is no alternative of the patterns: the Python step reads it,
and the run goes on with the frame's end as the end of the string the engine sees
(``match(raw, at, end)``), so no match crosses it; a length-prefixed opcode or a float run must end
inside it too, and a FRAME inside a frame is not plain. The pickler writes neither (it starts a
frame only between opcodes, and large arguments outside frames). The full walk applies the same
rules.

Every payload is walked first by the pattern without tuples (the tuple alternatives cost time on
every scalar, and it leaves runs of floats to the much faster stride check), which steps over a
TUPLE1/2/3 as the one-byte opcode it is (from the first one on, a pattern with them among the
opcodes without argument reads them) and enforces the frame rules above. A payload that holds
one is then walked a second time by the pattern with tuples, over a copy without its FRAME opcodes:
the first walk showed that every frame begins and ends between two opcodes, and FRAME leaves the
stack alone, so the C unpickler parses the copy alike, and a tuple whose items a frame separates
(the pickler starts a frame wherever one fills) is still a tuple of the scalars just pushed.
"""

from __future__ import annotations

import functools
import re
import sys
from typing import Callable, List, Optional

_STOP, _PROTO, _FRAME = ord("."), 0x80, 0x95
_BINSTRING = ord("T")  # its length is signed; a negative one is malformed
_BYTEARRAY8 = 0x96  # unhashable: never a key, so any length is plain
_LONGEST_KEY = 255  # longest str or bytes a plain payload holds (as SHORT_BINUNICODE's length byte allows)


def _opcode(code: bytes, width: int) -> bytes:
    return re.escape(code) + (b".{%d}" % width if width else b"")


@functools.cache  # compiled on first use (~15 ms each), not at import
def _run_pattern(kind: int) -> re.Pattern[bytes]:
    """The run of plain opcodes; :data:`TUPLES`: also TUPLE1/2/3 of the scalars right before them;
    :data:`STEPPING`: also TUPLE1/2/3 as opcodes without argument, whatever their items."""
    # The C engine tries alternatives in order, skipping one whose first byte differs in a few
    # nanoseconds: the most frequent opcodes come first, and short strings by their length byte
    # (a string of length n costs n skips, still cheaper than leaving the engine).
    short_unicode = b"\x8c(?:" + b"|".join(_opcode(bytes([n]), n) for n in range(256)) + b")"
    # Possessive (3.11+): the engine keeps no backtracking state per opcode. Before 3.11 a bounded
    # greedy repeat keeps it to 1,000 opcodes per call instead.
    repeat = b"*+" if sys.version_info >= (3, 11) else b"{0,1000}"
    one_or_more = b"++" if sys.version_info >= (3, 11) else b"+"
    if kind == TUPLES:
        # A scalar (BINFLOAT, SHORT_BINUNICODE, BININT, BININT1, BININT2, NONE, NEWTRUE, NEWFALSE)
        # with the MEMOIZEs that follow it. Runs of BINFLOATs are read here too, not by the stride
        # check. (A FRAME between a tuple's items ends the run, and the tuple is not shown plain.)
        scalar = (
            b"(?:"
            + b"|".join(
                [
                    _opcode(b"G", 8),
                    short_unicode,
                    _opcode(b"J", 4),
                    _opcode(b"K", 1),
                    _opcode(b"M", 2),
                    *(_opcode(bytes([c]), 0) for c in b"N\x88\x89"),
                ]
            )
            + b")\x94*"
        )
        # Consecutive scalars, optionally closed by TUPLE1/2/3 when at least that many precede it
        # in this alternative: the tuple's items are exactly the scalars just pushed.
        scalars = [
            scalar
            + b"(?:\x85|"
            + scalar
            + b"(?:[\x85\x86]|"
            + scalar
            + b"(?:"
            + scalar
            + b")"
            + repeat
            + b"[\x85\x86\x87]?)?)?"
        ]
        # The scalars come last: their alternative starts with a group, which the engine enters to
        # try (it skips an alternative that starts with another byte or class without entering it).
        # Opcodes without argument are read a run at a time, as below (NONE, NEWTRUE and NEWFALSE,
        # scalars here, are not in the class: they may be a tuple's items).
        no_argument = b"[" + re.escape(b"\x94(eu}]as\x8f\x90ld01)") + b"]" + one_or_more
        alternatives = [_opcode(b"h", 1), no_argument, _opcode(b"j", 4), *scalars]
    else:
        # A pass of the outer repeat costs more than a nested repeat or a second opcode in the same
        # alternative, so the commonest sequences are read in one: a run of BININTs (an int-keyed
        # dict, a list of ids), a run of strings, each but the first with the MEMOIZE the pickler
        # writes after it (a string without one ends the run, and the outer repeat goes on),
        # a run of memo reads (a dict's keys, memoized on their first use), each with the value
        # after it, and a run of opcodes without argument (one character class: ``]\x94(``,
        # ``u}\x94(``, ``\x94(``...).
        # BINFLOAT; a run of them is left to the stride check below (but after a tuple, where they
        # come in twos and threes: read here)
        floats = _opcode(b"G", 8) + (b"" if kind == STEPPING else b"(?!G)")
        string = short_unicode + b"(?:" + _opcode(b"\x94", 0) + b"|)"
        binints = _opcode(b"J", 4) + b"(?:" + _opcode(b"J", 4) + b")" + repeat
        value = b"(?:" + b"|".join([floats, string, binints, _opcode(b"K", 1)]) + b"|)"
        # MEMOIZE MARK APPENDS SETITEMS EMPTY_DICT EMPTY_LIST NONE NEWTRUE NEWFALSE APPEND SETITEM EMPTY_SET
        # ADDITEMS LIST DICT POP POP_MARK EMPTY_TUPLE (not FROZENSET or DUP: the full walk charges
        # comparing equal frozensets and reused strings)
        no_argument = (
            b"["
            + re.escape(b"\x94(eu}]N\x88\x89as\x8f\x90ld01)" + (b"\x85\x86\x87" if kind == STEPPING else b""))
            + b"]"
            + one_or_more
        )
        keyed = _opcode(b"h", 1) + value
        strings = string + b"(?:" + short_unicode + _opcode(b"\x94", 0) + b")" + repeat
        alternatives = [
            floats,
            keyed + b"(?:" + keyed + b")" + repeat,
            strings,
            binints,
            _opcode(b"K", 1),
            no_argument,
            _opcode(b"M", 2),
            _opcode(b"j", 4),  # BININT2, LONG_BINGET
        ]
    return re.compile(b"(?:" + b"|".join(alternatives) + b")" + repeat, re.DOTALL)


PLAIN, TUPLES, STEPPING = 0, 1, 2  # the run patterns (see _run_pattern)
_RUNS: List[Optional[Callable[[bytes, int, int], Optional[re.Match[bytes]]]]] = [None, None, None]  # by kind


def _compiled_run(kind: int) -> Callable[[bytes, int, int], Optional[re.Match[bytes]]]:
    """``_run_pattern(kind).match``, kept in ``_RUNS`` (one list index a walk, not a cached call)."""
    run = _RUNS[kind] = _run_pattern(kind).match
    return run


def _length_widths() -> List[int]:
    widths = [0] * 256
    # LONG4 is left to the full walk, which charges hashing a big int to the work budget
    for codes, width in ((b"\x8cCU\x8a", 1), (b"XBT", 4), (b"\x8d\x8e\x96", 8)):
        for code in codes:
            widths[code] = width
    return widths


_WIDTHS = _length_widths()  # per opcode byte: the size of its length prefix; 0 for other opcodes
_FLOATS = b"G"
_TUPLE_SIZE = [0] * 256  # per opcode byte: n for TUPLE1/2/3, else 0
_TUPLE_SIZE[0x85], _TUPLE_SIZE[0x86], _TUPLE_SIZE[0x87] = 1, 2, 3
_FLOAT_RUN = 4096  # BINFLOATs checked per stride slice


def is_plain_python(raw: bytes) -> bool:
    """True if ``raw`` reaches STOP through plain-data opcodes only, every declared length in bounds.

    False says nothing about the payload: the full walk (``_pickle_scan.full_walk``) then decides.
    Frames are read as the C unpickler reads them from a file (see the module docstring): no opcode
    may run past the end of the frame it starts in, and no FRAME may start inside another. A payload
    holding TUPLE1/2/3 is walked a second time, without its FRAME opcodes, by the pattern that reads
    tuples (slower per opcode, so payloads without tuples never pay for it).
    """
    size, widths, tuples = len(raw), _WIDTHS, False
    run = _RUNS[PLAIN] or _compiled_run(PLAIN)
    at = 2 if raw[:1] == b"\x80" else 0  # PROTO, as the loop below would skip it, without a match
    limit, framed = size, False  # the end of the frame being read (else of the payload), and whether in one
    frames: List[int] = []  # where each FRAME opcode starts
    while True:
        match = run(raw, at, limit)  # the engine sees nothing past ``limit``: no match crosses it
        assert match is not None  # the repeat matches the empty string
        end = match.end()
        if end >= limit:
            if not framed or limit == size:
                return False  # the payload ended before STOP
            at, limit, framed = end, size, False  # the frame ended between two opcodes
            continue
        code = raw[end]
        width = widths[code]
        if width:
            at = _past_counted(raw, end, width, limit)
            if at < 0:
                return False
        elif code == 0x47:  # BINFLOAT followed by another: every 9th byte from here must say G
            stride = raw[end : min(limit - 8, end + 9 * _FLOAT_RUN) : 9]
            floats = len(stride) - len(stride.lstrip(_FLOATS))
            if not floats:
                return False
            at = end + 9 * floats
        elif code == _STOP:
            return not tuples or _tuples_plain(raw, frames)
        elif code == _FRAME:
            at = end + 9
            if framed or at > limit:
                return False  # a FRAME inside a frame, or a truncated one
            limit, framed = at + int.from_bytes(raw[end + 1 : at], "little"), True
            if limit > size:
                return False
            frames.append(end)
        elif code == _PROTO:
            at = end + 2
            if at > limit:
                return False
        elif _TUPLE_SIZE[code]:
            if framed and limit == size:  # in a frame that ends with the payload, as every small pickle:
                return _tuples_plain(raw, frames)  # any FRAME from here on is inside it, which that walk refuses
            # one byte, no argument: stepped over from here on, its items checked by _tuples_plain
            tuples, at, run = True, end + 1, _RUNS[STEPPING] or _compiled_run(STEPPING)
        elif end > at:
            at = end  # the run stopped at its repeat bound (before 3.11) or before a truncated opcode
        else:
            return False


def _tuples_plain(raw: bytes, frames: List[int]) -> bool:
    """The second walk of a payload in which :func:`is_plain` found TUPLE1/2/3: whether each tuple holds
    only the scalars pushed right before it. It reads ``raw`` without its FRAME opcodes (at ``frames``),
    a copy the C unpickler parses alike: the first walk showed that every frame starts and ends between
    two opcodes (up to STOP, or up to a frame that ends with the payload, in which this walk refuses any
    FRAME), and FRAME leaves the stack alone, so a tuple whose items a frame separates is still one of
    the scalars just pushed."""
    flat = raw
    if frames:
        pieces, at = [], 0
        for start in frames:
            pieces.append(raw[at:start])
            at = start + 9
        pieces.append(raw[at:])
        flat = b"".join(pieces)
    size, widths = len(flat), _WIDTHS
    run = _RUNS[TUPLES] or _compiled_run(TUPLES)
    at = 2 if flat[:1] == b"\x80" else 0
    while True:
        match = run(flat, at, size)
        assert match is not None
        end = match.end()
        if end >= size:
            return False
        code = flat[end]
        width = widths[code]
        if width:
            at = _past_counted(flat, end, width, size)
            if at < 0:
                return False
        elif code == _STOP:
            return True
        elif code == _PROTO:
            at = end + 2
            if at > size:
                return False
        elif end > at:
            at = end
        else:
            return False  # a tuple of anything else, or what the first walk read differently (a FRAME)


def _past_counted(raw: bytes, end: int, width: int, limit: int) -> int:
    """Where the length-prefixed opcode at ``end`` (a length of ``width`` bytes) ends, or -1 when it is not
    plain: its length runs past ``limit`` or is negative, or a str or bytes is longer than a plain payload
    holds (one reused as a key is compared each time: the full walk charges it)."""
    start = end + 1 + width
    if start > limit:
        return -1
    code = raw[end]
    length = raw[end + 1] if width == 1 else int.from_bytes(raw[end + 1 : start], "little", signed=code == _BINSTRING)
    past = start + length
    if length < 0 or past > limit or length > _LONGEST_KEY and code != _BYTEARRAY8:
        return -1
    return past


is_plain_c: Optional[Callable[[bytes], bool]]  # None: not built
try:  # the same walk in C (``_pickle_walks_c.c``), built where a compiler was at hand
    from serializers._restricted._walks_c import is_plain as is_plain_c
except ImportError:  # pragma: no cover - an install without a compiler
    is_plain_c = None

is_plain: Callable[[bytes], bool] = is_plain_c or is_plain_python
"""The fast walk restricted-pickle runs: the C one where it was built, else :func:`is_plain_python`."""
