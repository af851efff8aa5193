"""A walk over pickle opcodes that builds nothing: the checks restricted-pickle makes before loading.

pickle allocates what a length opcode declares *before* reading it (``b"\\x80\\x05\\x8e"`` plus an
8-byte length asks for gigabytes) and grows its memo to any index a PUT names. The walk checks
every declared length against the bytes actually present, memo indices against the opcodes
seen, and text numbers against CPython's digit limit, and refuses opcodes objcomm never writes
(persistent ids, extension codes, out-of-band buffers). It reports whether the stream uses
BUILD, which decides whether the probe pass must run (see ``_restricted``).
"""

from __future__ import annotations

import pickletools
from typing import List, Optional, Tuple

from ._protocol import Buffer

MAX_TEXT_NUMBER = 4400  # chars of a text INT/LONG/FLOAT argument (CPython 3.11 refuses > 4300 digits anyway)


def _argument_kinds() -> List[Optional[Tuple[int, int]]]:
    """Per opcode byte: ``(form, size)`` of its argument, from pickletools' table; None: unknown opcode.

    form 0: fixed ``size`` bytes; 1: up to a newline (``size`` lines); 2: a length prefix of ``size``
    bytes, then that many bytes.
    """
    table: List[Optional[Tuple[int, int]]] = [None] * 256
    prefixed = {
        pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
        pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8,
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
# Opcodes objcomm never writes and that reach hooks or registries: PERSID, BINPERSID, EXT1/2/4,
# NEXT_BUFFER, READONLY_BUFFER.
for _code in b"PQ\x82\x83\x84\x97\x98":
    _ARGUMENTS[_code] = None
_MEMO_PUTS = {ord("p"), ord("q"), ord("r")}  # PUT, BINPUT, LONG_BINPUT
_TEXT_NUMBERS = {ord("I"), ord("L"), ord("F"), ord("p"), ord("g")}  # and text memo indices
_SIGNED_LENGTHS = {0x8B, 0x54}  # LONG4, BINSTRING
_BUILD = ord("b")
_STOP = ord(".")


def scan(data: Buffer) -> bool:
    """Check ``data`` opcode by opcode without building anything; True when it uses BUILD.

    Raises ``ValueError`` saying what is wrong and where.
    """
    raw = bytes(data)
    size, at, count, builds = len(raw), 0, 0, False
    table = _ARGUMENTS
    while at < size:
        code = raw[at]
        kind = table[code]
        if kind is None:
            raise ValueError(f"opcode {code:#x} at byte {at} is unknown or not allowed here")
        start = at + 1
        form, width = kind
        if form == 0:
            at = start + width
        elif form == 1:
            at = start
            for _ in range(width):
                newline = raw.find(b"\n", at)
                if newline < 0:
                    raise ValueError(f"unterminated line argument at byte {start}")
                at = newline + 1
            if code in _TEXT_NUMBERS and at - start > MAX_TEXT_NUMBER:
                raise ValueError(f"a text number of {at - start:,} characters at byte {start}")
        else:
            length = int.from_bytes(raw[start : start + width], "little", signed=width == 4 and code in _SIGNED_LENGTHS)
            if length < 0 or start + width + length > size:
                raise ValueError(f"opcode at byte {at} declares {length:,} bytes, {size - start - width:,} remain")
            at = start + width + length
        if code in _MEMO_PUTS:
            index = int(raw[start : at - 1]) if code == ord("p") else int.from_bytes(raw[start:at], "little")
            if index > count:
                raise ValueError(f"memo slot {index} after {count} opcodes")
        elif code == _BUILD:
            builds = True
        if at > size:
            raise ValueError("truncated payload")
        if code == _STOP:
            return builds
        count += 1
    raise ValueError("payload ends without STOP")
