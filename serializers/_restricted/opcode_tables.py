"""The opcode tables of restricted-pickle's full walk (``scan.py``), one entry per opcode byte, built once
from pickletools' own table: how each opcode's argument is laid out (``_ARGUMENTS``: a fixed width, up to
a newline, or a length prefix; None for an opcode that is unknown, or that objcomm never writes and that
reaches hooks or registries: the walk refuses both), what it does to pickle's stack and memo
(``_BY_CODE``, one of the stack effects ``_PUSH`` .. ``_NOTHING``), and which opcodes the walk treats
apart (fixed widths, tuple sizes, text memo indices and numbers, LONG4, strings, signed length
prefixes). They hold no rule of the walk and know nothing of its value summaries; ``scan.py`` reads
them and encodes them for the C walk (``_c_tables``), so both walks parse alike.
"""

from __future__ import annotations

import pickletools
from typing import Dict, List, Optional, Tuple


def _argument_kinds() -> List[Optional[Tuple[int, int]]]:
    """Per opcode byte: ``(form, size)`` of its argument, from pickletools' table; None: unknown opcode.

    form 0: fixed ``size`` bytes; 1: up to a newline (``size`` lines); 2: a length prefix of ``size``
    bytes, then that many bytes.
    """
    table: List[Optional[Tuple[int, int]]] = [None] * 256
    prefixed = {
        pickletools.TAKEN_FROM_ARGUMENT1: 1,
        pickletools.TAKEN_FROM_ARGUMENT4: 4,
        pickletools.TAKEN_FROM_ARGUMENT4U: 4,
        pickletools.TAKEN_FROM_ARGUMENT8U: 8,
    }
    for op in pickletools.opcodes:
        arg = op.arg
        if arg is None:
            kind = (0, 0)
        elif arg.n >= 0:
            kind = (0, arg.n)
        elif arg.n == pickletools.UP_TO_NEWLINE:
            kind = (1, 2 if arg.name == "stringnl_noescape_pair" else 1)
        else:
            kind = (2, prefixed[arg.n])
        table[ord(op.code)] = kind
    return table


_ARGUMENTS = _argument_kinds()
# Opcodes objcomm never writes and that reach hooks or registries.
_REFUSED = {"PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"}
for _op in pickletools.opcodes:
    if _op.name in _REFUSED:
        _ARGUMENTS[ord(_op.code)] = None

# Stack effects, by opcode name.
(
    _PUSH,
    _PUSH_GLOBAL,
    _STACK_GLOBAL,
    _MARK,
    _POP,
    _POP_MARK,
    _DUP,
    _PUT,
    _MEMOIZE,
    _GET,
    _TUPLE_MARK,
    _TUPLE_N,
    _LIST,
    _DICT,
    _FROZENSET,
    _APPEND,
    _APPENDS,
    _SETITEM,
    _SETITEMS,
    _ADDITEMS,
    _BUILD,
    _REDUCE,
    _NEWOBJ,
    _NEWOBJ_EX,
    _OBJ,
    _INST,
    _NOTHING,
) = range(27)
_EFFECTS: Dict[str, int] = {
    **dict.fromkeys(
        "INT BININT BININT1 BININT2 LONG LONG1 LONG4 STRING BINSTRING SHORT_BINSTRING BINBYTES SHORT_BINBYTES "
        "BINBYTES8 BYTEARRAY8 NONE NEWTRUE NEWFALSE UNICODE SHORT_BINUNICODE BINUNICODE BINUNICODE8 FLOAT BINFLOAT "
        "EMPTY_LIST EMPTY_DICT EMPTY_SET EMPTY_TUPLE".split(),
        _PUSH,
    ),
    "GLOBAL": _PUSH_GLOBAL,
    "STACK_GLOBAL": _STACK_GLOBAL,
    "MARK": _MARK,
    "POP": _POP,
    "POP_MARK": _POP_MARK,
    "DUP": _DUP,
    "PUT": _PUT,
    "BINPUT": _PUT,
    "LONG_BINPUT": _PUT,
    "MEMOIZE": _MEMOIZE,
    "GET": _GET,
    "BINGET": _GET,
    "LONG_BINGET": _GET,
    "TUPLE": _TUPLE_MARK,
    "TUPLE1": _TUPLE_N,
    "TUPLE2": _TUPLE_N,
    "TUPLE3": _TUPLE_N,
    "LIST": _LIST,
    "DICT": _DICT,
    "FROZENSET": _FROZENSET,
    "APPEND": _APPEND,
    "APPENDS": _APPENDS,
    "SETITEM": _SETITEM,
    "SETITEMS": _SETITEMS,
    "ADDITEMS": _ADDITEMS,
    "BUILD": _BUILD,
    "REDUCE": _REDUCE,
    "NEWOBJ": _NEWOBJ,
    "NEWOBJ_EX": _NEWOBJ_EX,
    "OBJ": _OBJ,
    "INST": _INST,
    "PROTO": _NOTHING,
    "FRAME": _NOTHING,
    "STOP": _NOTHING,
}
_BY_CODE: List[int] = [_NOTHING] * 256
for _op in pickletools.opcodes:
    _BY_CODE[ord(_op.code)] = _EFFECTS.get(_op.name, _NOTHING)
_TUPLE_SIZE = {ord("\x85"): 1, ord("\x86"): 2, ord("\x87"): 3}
_PUT_TEXT, _GET_TEXT = ord("p"), ord("g")
_FIXED = [kind[1] if kind is not None and kind[0] == 0 else -1 for kind in _ARGUMENTS]  # fixed argument widths
_STOP, _FRAME = ord("."), 0x95
_TEXT_NUMBERS = {ord("I"), ord("L"), ord("F"), ord("p"), ord("g")}
_LONG4 = 0x8B
# The opcodes that push a str or bytes: each caches its hash, but one equal to a key or member already
# present is compared byte by byte (what a use costs: scan.py, COMPARED_BYTES).
_STRINGS = frozenset(b"\x8cX\x8dCB\x8eUTSV")  # SHORT_BINUNICODE .. UNICODE; not BYTEARRAY8 (unhashable)
_SIGNED_LENGTHS = {_LONG4, 0x54}  # LONG4, BINSTRING
