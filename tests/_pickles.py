"""Random, mutated and hand-made pickles for the differential tests of restricted-pickle's walks.

``tests/serializing/test_pickle_plain.py`` and ``tests/serializing/test_pickle_scan.py`` feed them to the C and the
Python implementation of a walk and compare the answers.
"""

from __future__ import annotations

import pickle
import random
import struct
from typing import Sequence

import serializers

# Whole opcodes, each with its argument: the fast walk's alphabet, then a few it refuses
PLAIN_OPCODES = [
    b"G" + bytes(8),
    b"\x8c\x01a",
    b"\x8c\x00",
    b"J\x01\x02\x03\x04",
    b"K\x05",
    b"M\x01\x02",
    b"N",
    b"\x88",
    b"\x89",
    b"\x94",
    b"h\x00",
    b"j\x00\x00\x00\x00",
    b"(",
    b"e",
    b"u",
    b"}",
    b"]",
    b"a",
    b"s",
    b"\x8f",
    b"\x90",
    b"l",
    b"d",
    b"0",
    b"1",
    b")",
    b"\x85",
    b"\x86",
    b"\x87",
    b"C\x02ab",
    b"U\x01x",
    b"\x8a\x01\x05",
    b"X\x01\x00\x00\x00z",
    b"B\x00\x00\x00\x00",
    b"T\x01\x00\x00\x00q",
    b"\x8d\x01" + bytes(7) + b"y",
    b"\x8e" + bytes(8),
    b"\x96\x03" + bytes(7) + b"abc",
    b"\x80\x05",
    b"\x8e" + (256).to_bytes(8, "little") + bytes(256),
    b"X" + (300).to_bytes(4, "little") + bytes(300),
    b"\x96" + (300).to_bytes(8, "little") + bytes(300),
]
OTHER_OPCODES = [
    b"\x95\x05" + bytes(7),
    b"\x95" + bytes(8),
    b".",
    b"c",
    b"\x93",
    b"R",
    b"b",
    b"\x91",
    b"2",
    b"q\x01",
    b"r\x01\x00\x00\x00",
    b"\x8b\x01\x00\x00\x00\x01",
    b"T\xff\xff\xff\xff",
    b"X\x00\x01\x00\x00",
    b"\x95",
]


def random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(12 if depth < 4 else 7)
    if kind == 0:
        return rng.random()
    if kind == 1:
        return rng.randrange(-(2**40), 2**40)
    if kind == 2:
        return "s" * rng.randrange(0, 300)
    if kind == 3:
        return rng.choice([None, True, False])
    if kind == 4:
        return rng.randrange(256)
    if kind == 5:
        return tuple(random_value(rng, 9) for _ in range(rng.randrange(0, 5)))
    if kind == 6:
        return b"b" * rng.randrange(0, 300)
    if kind == 7:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    if kind == 8:
        return {str(rng.randrange(20)): random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))}
    if kind == 9:
        return {(rng.randrange(3), "x"): random_value(rng, depth + 1) for _ in range(rng.randrange(0, 3))}
    if kind == 10:
        return bytearray(rng.randrange(0, 100))
    return {rng.randrange(9) for _ in range(rng.randrange(0, 4))}


_PLAIN_BYTES = b".\x85\x86\x87\x95\x94G\x8cNh"  # one-byte opcodes written over a byte


def mutated(
    rng: random.Random, data: bytes, inserted: Sequence[bytes] = (), overwriting: bytes = _PLAIN_BYTES
) -> bytes:
    """``data`` with one to three changes: a byte changed, bytes deleted, an opcode of ``inserted``
    (default: the fast walk's and a few others) inserted, a byte overwritten by one of ``overwriting``,
    or the end cut."""
    inserted = inserted or PLAIN_OPCODES + OTHER_OPCODES
    out = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        if not out:
            out += rng.choice(inserted)
            continue
        at = rng.randrange(len(out))
        change = rng.randrange(5)
        if change == 0:
            out[at] = rng.randrange(256)
        elif change == 1:
            del out[at : at + rng.randrange(1, 10)]
        elif change == 2:
            out[at:at] = rng.choice(inserted)
        elif change == 3:
            out[at] = rng.choice(overwriting)
        else:
            del out[at:]
    return bytes(out)


def _framed(rng: random.Random, body: bytes) -> bytes:
    """``body`` cut into frames of random sizes, some declaring one byte more or less than they hold."""
    out, at = bytearray(b"\x80\x05"), 0
    while at < len(body):
        chunk = body[at : at + rng.randrange(1, 40)]
        at += len(chunk)
        if rng.random() < 0.1:  # a frame inside this one
            chunk = b"\x95" + struct.pack("<Q", len(chunk)) + chunk
        out += b"\x95" + struct.pack("<Q", len(chunk) + rng.choice([0, 0, 0, 1, -1])) + chunk
    return bytes(out)


def random_pickle(rng: random.Random) -> bytes:
    """Pickles of random values (tuples, strings past 255 bytes, bytearrays, sets; several frames),
    restricted-pickle's own, mutated ones, random opcode sequences, ones cut into frames of wrong sizes."""
    kind = rng.randrange(6)
    if kind == 0:
        return pickle.dumps(random_value(rng), protocol=5)
    if kind == 1:
        return bytes(serializers.get("restricted-pickle").dumps(random_value(rng)))
    if kind == 2:
        return mutated(rng, pickle.dumps(random_value(rng), protocol=rng.choice([2, 4, 5])))
    if kind == 3:
        body = b"".join(rng.choice(PLAIN_OPCODES + OTHER_OPCODES) for _ in range(rng.randrange(0, 30)))
        return b"\x80\x05" + body + rng.choice([b".", b"", b"N."])
    if kind == 4:
        body = b"".join(rng.choice(PLAIN_OPCODES) for _ in range(rng.randrange(0, 40))) + b"."
        framed = _framed(rng, body)
        return mutated(rng, framed) if rng.random() < 0.5 else framed
    big = pickle.dumps([random_value(rng) for _ in range(rng.randrange(100, 2000))], protocol=5)  # several frames
    return mutated(rng, big) if rng.random() < 0.7 else big


# Opcodes of calls, state, memo and stack juggling, for payloads the full walk decides
CALL_OPCODES = [
    b"\x93",
    b"R",
    b"b",
    b"\x81",
    b"\x92",
    b"o",
    b"2",
    b"\x91",
    b"t",
    b"(",
    b"0",
    b"1",
    b"q\x00",
    b"r\x01\x00\x00\x00",
    b"h\x00",
    b"j\x00\x00\x00\x00",
    b"\x94",
    b"\x8c\x08builtins\x8c\x03set",
    b"\x8b\x02\x00\x00\x00\x01\x02",
    b"X\x50\x00\x00\x00" + b"a" * 80,
    b"\x85",
    b"\x86",
    b"\x87",
    b"s",
    b"u",
    b"a",
]
_CALL_BYTES = b"\x93Rb\x81o2\x91t(01\x94\x85\x86\x87"  # one-byte opcodes written over a byte


def rich_value(rng: random.Random, depth: int = 0) -> object:
    """A value restricted-pickle writes as calls: arrays, tensors, collections, dates, numbers, frozensets."""
    import collections
    import datetime
    import decimal

    import numpy as np
    import torch

    kind = rng.randrange(10)
    if kind == 0:
        return np.arange(rng.randrange(0, 20), dtype=rng.choice(["f4", "i8", "u1", "f2"]))
    if kind == 1:
        return torch.arange(rng.randrange(0, 10))
    if kind == 2:
        return collections.OrderedDict(a=1, b=[2])
    if kind == 3:
        return datetime.datetime(2020, 1, 2, 3, 4, 5)
    if kind == 4:
        return decimal.Decimal("1.5")
    if kind == 5:
        return frozenset({1, (2, 3)})
    if kind == 6:
        return collections.deque([1, 2])
    if kind == 7 and depth < 3:
        return [rich_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if kind == 8 and depth < 3:
        return {str(i): rich_value(rng, depth + 1) for i in range(rng.randrange(0, 4))}
    return random_value(rng)


def random_call_pickle(rng: random.Random) -> bytes:
    """restricted-pickle's own pickles of rich values, mutated ones (bytes changed, cut, call and memo
    opcodes inserted), pickles of protocols 2-5, random sequences of call and plain opcodes."""
    restricted = serializers.get("restricted-pickle")
    kind = rng.randrange(5)
    if kind == 0:
        return bytes(restricted.dumps(rich_value(rng)))
    if kind == 1:
        return mutated(rng, bytes(restricted.dumps(rich_value(rng))), CALL_OPCODES, _CALL_BYTES)
    if kind == 2:
        return random_pickle(rng)
    if kind == 3:
        return mutated(rng, pickle.dumps(rich_value(rng), protocol=rng.choice([2, 4, 5])), CALL_OPCODES, _CALL_BYTES)
    return b"\x80\x05" + b"".join(rng.choice(CALL_OPCODES + PLAIN_OPCODES) for _ in range(rng.randrange(0, 30))) + b"."
