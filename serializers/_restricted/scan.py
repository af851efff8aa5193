"""A walk over pickle opcodes that builds nothing: the checks restricted-pickle makes before loading.

Plain-data payloads are first tried by the fast walk (``_pickle_plain.is_plain``); only a
payload it cannot show plain pays for this one. The walk runs pickle's stack machine on
*summaries* of the values instead of the values, and refuses, before the C unpickler allocates
or hashes anything:

- a declared length past the bytes present (pickle allocates what a length opcode declares
  before reading it), a memo index beyond the opcodes seen, a text number over 4,400 characters,
  and opcodes objcomm never writes (persistent ids, extension codes, out-of-band buffers);
- tuples (and calls, which may build tuple-like values) nested deeper than ``MAX_NESTING``:
  CPython hashes nested tuples recursively without a depth check, so a deep one used as a dict
  key overflows the C stack;
- hashing work past a budget proportional to the input: tuples are not hash-cached, so a tuple
  built from two references to the previous one, 60 times over, costs 2**60 to hash; nor are
  ints, so each use of a memoized LONG4 int as a key costs its size again; and a key or member
  equal to one already present but not the same object is compared, so each use of a long
  string or bytes costs its size, and of a frozenset what its members cost (nested ones would
  double per level); a value built from a list, dict or set (a call's argument, or a tuple's item)
  costs ``CONTAINER_WORK``, as the walk does not count their items (comparing two equal structured
  dtypes built from one memoized field list compares all their fields);
- a global (a class or function the payload names) used as anything but the callable of a call
  or a direct argument of a call: globals travel only as constructors, never as values.

:func:`full_walk` runs the same walk in C first (``_pickle_walks_c.c``, where it was built), which
answers only for payloads of binary opcodes that :func:`full_walk_python` accepts, with the same
answer, and leaves every other payload to it (tests/serializing/test_pickle_scan.py compares the two). Both read
the opcode tables of ``opcode_tables.py`` (argument layouts, stack effects), the C walk through ``_c_tables``.

It reports whether the real load needs the probe pass: whether BUILD, APPEND(S), SETITEM(S) or
ADDITEMS act on a value a call built (see ``_restricted``). For that answer the walk's stack and
memo must be pickle's own: every opcode it accepts moves values exactly as the C unpickler does
whenever the C unpickler gets past that opcode (where the two differ, the C unpickler raises:
a PUT or MEMOIZE below a mark, a negative memo index, APPENDS into a value below an outer mark).
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

from serializers._protocol import Buffer
from serializers._restricted.opcode_tables import (
    _ADDITEMS,
    _APPEND,
    _APPENDS,
    _ARGUMENTS,
    _BUILD,
    _BY_CODE,
    _DICT,
    _DUP,
    _FIXED,
    _FRAME,
    _FROZENSET,
    _GET,
    _GET_TEXT,
    _INST,
    _LIST,
    _LONG4,
    _MARK,
    _MEMOIZE,
    _NEWOBJ,
    _NEWOBJ_EX,
    _OBJ,
    _POP,
    _POP_MARK,
    _PUSH,
    _PUSH_GLOBAL,
    _PUT,
    _PUT_TEXT,
    _REDUCE,
    _SETITEM,
    _SETITEMS,
    _SIGNED_LENGTHS,
    _STACK_GLOBAL,
    _STOP,
    _STRINGS,
    _TEXT_NUMBERS,
    _TUPLE_MARK,
    _TUPLE_N,
    _TUPLE_SIZE,
)
from serializers._restricted.plain import is_plain

MAX_TEXT_NUMBER = 4400  # chars of a text INT/LONG/FLOAT argument (CPython 3.11 refuses > 4300 digits anyway)
MAX_NESTING = 512  # tuples and calls inside each other
# A LONG4 int longer than this many bytes (a text number, any) makes the walk note its size, where asked: a load that
# builds a Decimal refuses ints past 2,048 bits (_budget.big_number)
NOTED_INT_BYTES = 256
HASH_WORK_PER_BYTE = 16  # tuple elements hashed, per input byte, across the whole load
# What a list, dict or set counts for in the hashing work of a tuple or call holding it. Their items
# are not counted (a memoized list grows after it is pushed), and only a call can turn one into a
# hashable value: restricted-pickle's constructors that take a list and build something hashable from
# its items build a numpy dtype (at most 256 fields, ~14 µs to compare two equal ones); frozenset and
# torch.Size take tuples only. Lists, dicts and sets are unhashable themselves.
CONTAINER_WORK = 1024

# Value summaries: (tag, nesting, hash work). Tags: a plain value, a global, a tuple holding a
# global directly (a call's arguments), a value a call built, and the plain values of exactly the
# types list, dict and set (which take items through their type's own C code).
PLAIN, GLOBAL, ARGS, BUILT, LIST, DICT, SET = range(7)
_PLAIN = (PLAIN, 0, 1)
_LIST_VALUE, _DICT_VALUE, _SET_VALUE = ((tag, 0, CONTAINER_WORK) for tag in (LIST, DICT, SET))


class ScanResult(NamedTuple):
    """What the walk learned: whether the probe pass must run, and the payload as bytes (walked once)."""

    needs_probe: bool
    data: bytes


_PUSHED = [_PLAIN] * 256  # the summary each push opcode pushes (but for LONG4 and long strings)
_PUSHED[ord("]")], _PUSHED[ord("}")], _PUSHED[0x8F] = _LIST_VALUE, _DICT_VALUE, _SET_VALUE
_BUILD_TARGET = -1  # no target kind takes BUILD without the probe pass
# str and bytes cache their hash, but a key or member equal to one already in a dict or set and
# not the same object is compared byte by byte, and the memo (or DUP) lets a payload use one long
# string as a key many times for a few bytes each: such a use costs 1 per COMPARED_BYTES bytes.
COMPARED_BYTES = 64


# REDUCE, NEWOBJ(_EX) and OBJ call a class or function the payload names (a global), never a value it built: an
# allowed class's instance may be callable (a helper's find: Job() then REDUCE(instance, args) ran Job.__call__
# with the payload's arguments, unguarded); the encoder writes no such call
_CALLS_A_VALUE = "the opcode at byte {at} calls a value the payload built, not a class or function it names"


class ScanError(ValueError):
    """The payload breaks one of the walk's rules; the message says which and where."""


def _as_value(item: Tuple[int, int, int], at: int) -> Tuple[int, int, int]:
    if item[0] == GLOBAL or item[0] == ARGS:
        raise ScanError(
            f"the opcode at byte {at} uses a class or function as a value: restricted-pickle carries them only as "
            "constructors (send a name instead, or use pickle)"
        )
    return item


def scan(data: Buffer) -> ScanResult:
    """Walk ``data`` opcode by opcode without building anything; raise :class:`ScanError` on a broken rule."""
    raw = bytes(data)
    return ScanResult(not is_plain(raw) and full_walk(raw), raw)


def full_walk(raw: bytes, noted: Optional[List[int]] = None) -> bool:
    """The walk of :func:`scan` without the fast walk first; True: the probe pass must run. ``noted[0]``: set to the
    bytes of the payload's longest int past :data:`NOTED_INT_BYTES` (a text number's: its digits' worth), if any.

    For a caller that has already tried ``is_plain(raw)`` (``_restricted`` does, to pick its plain path).
    The C walk (``_pickle_walks_c.c``, where it was built) answers for the payloads :func:`full_walk_python`
    accepts and that hold binary opcodes only (noting ints as it does); for any other, the Python walk decides and
    words the refusal.
    """
    if _full_walk_c is not None:
        answer = _full_walk_c(raw, noted)
        if answer is not None:
            return answer
    return full_walk_python(raw, noted)


def full_walk_python(raw: bytes, noted: Optional[List[int]] = None) -> bool:
    """:func:`full_walk` in pure Python: the reference the C walk answers as."""
    size, at, count = len(raw), 0, 0
    frame_end = 0  # where the frame being read ends (see _pickle_plain: frames are read as from a file)
    budget = HASH_WORK_PER_BYTE * size + 4096
    table, effects, fixed = _ARGUMENTS, _BY_CODE, _FIXED
    stack: List[Tuple[int, int, int]] = []
    marks: List[int] = []
    # The memo as the C unpickler keeps it: slots by index; MEMOIZE writes at the count of filled slots.
    memo: List[Optional[Tuple[int, int, int]]] = []
    filled = 0
    needs_probe = False
    # Until the first global or tuple every value is plain (tag PLAIN, nesting 0, hash work 1) or a list,
    # dict or set (unhashable: its use as a key fails the load), so the per-item checks can be skipped:
    # plain data (the common case) pays only for its lengths.
    tracking = False
    try:
        while at < size:
            code = raw[at]
            start = at + 1
            width = fixed[code]
            if width >= 0:
                end = start + width
            else:
                kind = table[code]
                if kind is None:
                    raise ScanError(f"opcode {code:#x} at byte {at} is unknown or not allowed here")
                form, width = kind
                if form == 1:
                    end = start
                    for _ in range(width):
                        newline = raw.find(b"\n", end)
                        if newline < 0:
                            raise ScanError(f"unterminated line argument at byte {start}")
                        end = newline + 1
                    if code in _TEXT_NUMBERS and end - start > MAX_TEXT_NUMBER:
                        raise ScanError(f"a text number of {end - start:,} characters at byte {start}")
                    if code in _TEXT_NUMBERS and noted is not None and end - start > 2 * NOTED_INT_BYTES:
                        noted[0] = max(noted[0], (end - start) // 2)  # a hex digit (base 0: "0x..."): half a byte
                else:
                    if start + width > size:
                        raise ScanError("truncated payload")
                    if width == 1:
                        length = raw[start]
                    else:
                        length = int.from_bytes(raw[start : start + width], "little", signed=code in _SIGNED_LENGTHS)
                    if length < 0 or start + width + length > size:
                        remain = size - start - width
                        raise ScanError(f"opcode at byte {at} declares {length:,} bytes, {remain:,} remain")
                    end = start + width + length
            if end > size:
                raise ScanError("truncated payload")
            if end > frame_end > at:  # the C unpickler would read the rest from after the frame: another parse
                raise ScanError(f"the opcode at byte {at} runs past the end of its frame (byte {frame_end})")
            if code == _FRAME:
                if at < frame_end:
                    raise ScanError(f"a FRAME at byte {at} inside the frame that ends at byte {frame_end}")
                frame_end = end + int.from_bytes(raw[start:end], "little")
                if frame_end > size:
                    raise ScanError(f"the FRAME at byte {at} declares {frame_end - end:,} bytes, {size - end:,} remain")
            effect = effects[code]
            if effect == _PUSH:
                if code == _LONG4:  # ints do not cache their hash: a big one costs its size per key use
                    stack.append((PLAIN, 0, 1 + (end - start) // 8))
                    tracking = True
                    if noted is not None and end - start - 4 > NOTED_INT_BYTES:
                        noted[0] = max(noted[0], end - start - 4)
                elif end - start > COMPARED_BYTES and code in _STRINGS:  # costs its size per equal key use
                    stack.append((PLAIN, 0, 1 + (end - start) // COMPARED_BYTES))
                    tracking = True
                else:
                    stack.append(_PUSHED[code])
            elif effect == _SETITEMS or effect == _APPENDS or effect == _ADDITEMS:
                mark = marks.pop()
                if tracking:
                    items = stack[mark:]
                    for item in items:
                        _as_value(item, at)
                    if effect != _APPENDS:
                        budget -= sum(k[2] for k in (items[::2] if effect == _SETITEMS else items))
                    del stack[mark:]
                    takes = DICT if effect == _SETITEMS else LIST if effect == _APPENDS else SET
                    needs_probe = _target(stack[-1], takes, at) or needs_probe
                else:
                    if effect != _APPENDS:
                        budget -= (len(stack) - mark) >> (effect == _SETITEMS)
                    del stack[mark:]
                    stack[-1]  # noqa: B018 - the target must exist
            elif effect == _GET:
                index = raw[start] if end - start == 1 else _memo_index(raw, code, start, end)
                value = memo[index] if index < len(memo) else None
                if value is None:
                    raise ScanError(f"memo slot {index} read before it was written (byte {at})")
                stack.append(value)
            elif effect == _MEMOIZE or effect == _PUT:
                if effect == _MEMOIZE:
                    index = filled
                else:
                    index = raw[start] if end - start == 1 else _memo_index(raw, code, start, end)
                    if index > count:
                        raise ScanError(f"memo slot {index} after {count} opcodes")
                if index >= len(memo):
                    memo.extend([None] * (index + 1 - len(memo)))
                if memo[index] is None:
                    filled += 1
                memo[index] = stack[-1]
            elif effect == _MARK:
                marks.append(len(stack))
            elif effect == _SETITEM or effect == _APPEND or effect == _BUILD:
                popped = 2 if effect == _SETITEM else 1
                _above_mark(stack, marks, popped + 1, at)
                if tracking:
                    _as_value(stack.pop(), at)
                    if effect == _SETITEM:
                        budget -= _as_value(stack.pop(), at)[2]
                    takes = DICT if effect == _SETITEM else LIST if effect == _APPEND else _BUILD_TARGET
                    needs_probe = _target(stack[-1], takes, at) or needs_probe
                else:
                    del stack[len(stack) - popped :]
                    budget -= effect == _SETITEM
            elif effect == _TUPLE_MARK or effect == _TUPLE_N:
                if effect == _TUPLE_N:
                    n = _TUPLE_SIZE[code]
                    _above_mark(stack, marks, n, at)
                    items = stack[len(stack) - n :]
                    del stack[len(stack) - n :]
                else:
                    mark = marks.pop()
                    items = stack[mark:]
                    del stack[mark:]
                stack.append(_tuple(items, at, budget))
                tracking = True
            elif effect == _REDUCE or effect == _NEWOBJ or effect == _NEWOBJ_EX:
                tracking = True
                _above_mark(stack, marks, 3 if effect == _NEWOBJ_EX else 2, at)
                args = stack.pop()
                kwargs = _as_value(stack.pop(), at) if effect == _NEWOBJ_EX else _PLAIN
                if effect != _REDUCE or args[0] == GLOBAL:
                    _as_value(args, at)  # only a call's own arguments may hold a global
                callable_ = stack.pop()
                if callable_[0] == ARGS:
                    _as_value(callable_, at)
                if callable_[0] != GLOBAL:
                    raise ScanError(_CALLS_A_VALUE.format(at=at))
                stack.append(_built((args, kwargs), at, budget))
            elif effect == _PUSH_GLOBAL:
                stack.append((GLOBAL, 0, 1))
                tracking = True
            elif effect == _STACK_GLOBAL:
                stack.pop()
                stack.pop()
                stack.append((GLOBAL, 0, 1))
                tracking = True
            elif effect == _LIST or effect == _DICT or effect == _FROZENSET or effect == _POP_MARK:
                mark = marks.pop()
                items = stack[mark:]
                del stack[mark:]
                if effect != _POP_MARK:
                    for item in items:
                        _as_value(item, at)
                    if effect != _LIST:
                        budget -= sum(k[2] for k in (items[::2] if effect == _DICT else items))
                    if effect == _FROZENSET and items:
                        # comparing equal frozensets compares their members: a use as a key or member
                        # costs what its members cost (nested ones double per level without this)
                        stack.append((PLAIN, 0, min(1 + sum(k[2] for k in items), budget + 1)))
                        tracking = True
                    else:
                        stack.append(_LIST_VALUE if effect == _LIST else _DICT_VALUE if effect == _DICT else _PLAIN)
            elif effect == _OBJ or effect == _INST:
                tracking = True
                mark = marks.pop()
                items = stack[mark:]
                del stack[mark:]
                if effect == _OBJ and (not items or items[0][0] != GLOBAL):
                    raise ScanError(_CALLS_A_VALUE.format(at=at))
                for item in items[1:] if effect == _OBJ else items:
                    _as_value(item, at)
                stack.append(_built(items, at, budget))
            elif effect == _POP:
                # As the C unpickler does: POP right after MARK removes the mark, not a value.
                if marks and marks[-1] == len(stack):
                    marks.pop()
                else:
                    _above_mark(stack, marks, 1, at)
                    stack.pop()
            elif effect == _DUP:
                _above_mark(stack, marks, 1, at)
                stack.append(stack[-1])
            elif code == _STOP:
                if len(stack) != 1 or marks:
                    raise ScanError(f"STOP at byte {at} with {len(stack)} values and {len(marks)} marks on the stack")
                _as_value(stack[0], at)
                return needs_probe
            if budget < 0:
                raise ScanError(f"hashing its dict keys and set members would exceed the work budget (byte {at})")
            at = end
            count += 1
    except IndexError:
        raise ScanError(f"stack or mark underflow at byte {at}") from None
    raise ScanError("payload ends without STOP")


def _memo_index(raw: bytes, code: int, start: int, end: int) -> int:
    if code == _PUT_TEXT or code == _GET_TEXT:
        try:
            return int(raw[start : end - 1])
        except ValueError:  # (a helper's find: int()'s own error left the walk)
            raise ScanError(f"a memo index that is not a number at byte {start - 1}") from None
    return int.from_bytes(raw[start:end], "little")


def _above_mark(stack: List[Tuple[int, int, int]], marks: List[int], count: int, at: int) -> None:
    """The C unpickler pops nothing from below the latest mark; neither does the walk."""
    if len(stack) - (marks[-1] if marks else 0) < count:
        raise ScanError(f"stack underflow at byte {at}")


def _target(target: Tuple[int, int, int], takes: int, at: int) -> bool:
    """Refuse state or items set on a global; True: the probe pass must run.

    The probe pass is skipped only for APPEND(S) on a list, SETITEM(S) on a dict and ADDITEMS on a
    set that the payload's own opcodes built (EMPTY_LIST/LIST, EMPTY_DICT/DICT, EMPTY_SET), as
    ``takes`` names: the C unpickler then takes the exact type's own path (``PyList_CheckExact``,
    ``PyDict_CheckExact``, ``PySet_Check``), which reaches no hook of the target, and with probes
    for arguments it would have failed only where the real values fail too. Every other target (a
    value a call built, a bytearray or list taking a slice through ``__setitem__``, anything taking
    BUILD) goes through the probe pass, which judges it exactly. This relies on the walk's stack
    and memo being pickle's own (module docstring).
    """
    if target[0] == GLOBAL or target[0] == ARGS:
        raise ScanError(f"the opcode at byte {at} sets state or items on a class or function")
    return target[0] != takes


def _tuple(items: List[Tuple[int, int, int]], at: int, budget: int) -> Tuple[int, int, int]:
    tag, nesting, work = PLAIN, 0, 1
    for item in items:
        if item[0] == ARGS:
            _as_value(item, at)  # a call's arguments inside another tuple
        if item[0] == GLOBAL:
            tag = ARGS
        if item[1] > nesting:
            nesting = item[1]
        work += item[2]
    if nesting >= MAX_NESTING:
        raise ScanError(f"tuples or calls nested over {MAX_NESTING} deep (byte {at})")
    return (tag, nesting + 1, min(work, budget + 1))


def _built(items: Sequence[Tuple[int, int, int]], at: int, budget: int) -> Tuple[int, int, int]:
    nesting = max((item[1] for item in items), default=0)
    if nesting >= MAX_NESTING:
        raise ScanError(f"tuples or calls nested over {MAX_NESTING} deep (byte {at})")
    return (BUILT, nesting + 1, min(1 + sum(item[2] for item in items), budget + 1))


def _c_tables() -> Tuple[bytes, bytes, bytes]:
    """The opcode tables of the C walk (see ``_pickle_walks_c.c``), from this module's."""
    fixed, prefixed, signed, string, lines = 0x100, 0x200, 0x400, 0x800, 0x1000
    arguments = []
    for code, kind in enumerate(_ARGUMENTS):
        if kind is None:
            entry = 0
        elif kind[0] == 0:
            entry = fixed | kind[1]
        elif kind[0] == 1:
            entry = lines
        else:
            entry = prefixed | kind[1] | (signed if code in _SIGNED_LENGTHS else 0)
            entry |= string if code in _STRINGS else 0
        arguments.append(entry.to_bytes(2, "little"))
    return b"".join(arguments), bytes(_BY_CODE), bytes(summary[0] for summary in _PUSHED)


_full_walk_c: Optional[Callable[[bytes, Optional[List[int]]], Optional[bool]]]  # None: not built
try:  # the same walk in C, for binary opcodes, built where a compiler was at hand
    from serializers._restricted._walks_c import configure as _configure_c
    from serializers._restricted._walks_c import full_walk as _full_walk_c
except ImportError:  # pragma: no cover - an install without a compiler
    _full_walk_c = None
else:
    _configure_c(*_c_tables(), MAX_NESTING, HASH_WORK_PER_BYTE, COMPARED_BYTES, CONTAINER_WORK)
