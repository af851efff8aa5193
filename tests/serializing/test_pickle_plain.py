"""The fast walk of restricted-pickle (``serializers._restricted.plain``): its C build answers as the Python one.

restricted-pickle runs the C walk (``_pickle_walks_c.c``) where it was built and the regular-expression
walk (``is_plain_python``) elsewhere; both must show exactly the same payloads plain. Every comparison
runs in a child process (``_child.run_in_child``): a crash of the C walk fails the test, not pytest.
The hostile-input tests of the plain path are in ``test_adversarial_serializers.py``; their helpers
ask both walks too.
"""

from __future__ import annotations

import pickle
import random
import struct
from typing import Dict, List, Tuple

import pytest
from _child import run_in_child
from _hostile import FUZZ_SCALE, glob, payload, v
from _pickles import PLAIN_OPCODES, random_pickle

from serializers._restricted import plain as _plain
from serializers._restricted import plain_load as _plain_load

needs_c_walk = pytest.mark.skipif(
    _plain.is_plain_c is None, reason="the C walk was not built here (no compiler at install)"
)


def _answers(cases: List[bytes]) -> List[Tuple[bool, bool]]:
    """In the child: each case's answer from the Python walk and from the C walk."""
    return [(_plain.is_plain_python(data), _plain.is_plain_c(data)) for data in cases]


def _differences(cases: List[bytes]) -> Dict[bytes, Tuple[bool, bool]]:
    answers = run_in_child(_answers, cases, memory_budget=256 << 20, timeout=300)
    return {data[:120]: answer for data, answer in zip(cases, answers) if answer[0] != answer[1]}


@needs_c_walk
@pytest.mark.timeout(400)
def test_the_c_walk_answers_as_the_python_walk_on_random_and_mutated_pickles():
    """Pickles of random values (tuples, strings past 255 bytes, bytearrays, sets; several frames),
    restricted-pickle's own, mutated ones (bytes changed, cut, opcodes inserted), random opcode
    sequences and ones cut into frames of wrong sizes: both walks give the same answer on each."""
    rng = random.Random(20261201)
    cases = [random_pickle(rng) for _ in range(3000 * FUZZ_SCALE)]
    assert sum(map(_plain.is_plain_python, cases)) > len(cases) // 5  # both answers are well represented
    assert not _differences(cases)


def _lengths() -> List[int]:
    return [0, 1, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


@needs_c_walk
def test_the_c_walk_reads_any_declared_length_without_overflow():
    """Every length opcode and FRAME with lengths up to 2**64 - 1 (past the bytes present, negative
    as signed), alone, inside a frame and after one; and every prefix of plain payloads."""
    cases = []
    for length in _lengths():
        for code, width in (
            (b"C", 1),
            (b"U", 1),
            (b"\x8a", 1),
            (b"X", 4),
            (b"B", 4),
            (b"T", 4),
            (b"\x8d", 8),
            (b"\x8e", 8),
            (b"\x96", 8),
            (b"\x95", 8),
        ):
            if length >= 1 << (8 * width):
                continue
            opcode = code + length.to_bytes(width, "little") + b"ab"
            frame = b"\x95" + struct.pack("<Q", len(opcode) + 2)
            cases += [
                payload(opcode),
                payload(b"]" + opcode + b"a"),
                b"\x80\x05" + frame + b"]" + opcode + b"a.",
                b"\x80\x05" + frame + b"N0" + b"]" + opcode + b"a.",
            ]
    for data in (pickle.dumps([1.5, "x", (1, 2), {"k": b"v"}], protocol=5), payload(b"]" + b"G" + bytes(8) * 3)):
        cases += [data[:end] for end in range(len(data) + 1)]
    assert not _differences(cases)


@needs_c_walk
def test_the_c_walk_draws_the_lines_where_the_python_walk_does():
    """Lengths at 255 and 256 with their bytes present (only BYTEARRAY8 may be longer), frames inside
    frames, empty frames, frames ending mid-opcode and at STOP, tuples straddling a frame."""
    cases, shown = [], []
    for length in (0, 255, 256, 1000):
        for code, width in (
            (b"C", 1),
            (b"U", 1),
            (b"\x8a", 1),
            (b"X", 4),
            (b"B", 4),
            (b"T", 4),
            (b"\x8d", 8),
            (b"\x8e", 8),
            (b"\x96", 8),
            (b"\x8c", 1),
        ):
            if length < 1 << (8 * width):
                cases.append(payload(b"]" + code + length.to_bytes(width, "little") + b"a" * length + b"a"))
    frame = lambda body, extra=0: b"\x95" + struct.pack("<Q", len(body) + extra) + body  # noqa: E731
    cases += [
        b"\x80\x05" + frame(b"]" + frame(b"N") + b"a."),  # a FRAME inside a frame
        b"\x80\x05" + frame(b"") + frame(b"N."),  # an empty frame
        b"\x80\x05" + frame(b"N") + frame(b".") + b"",  # STOP in a frame of its own
        *(
            b"\x80\x05" + frame(b"N" + op[:cut]) + op[cut:] + b"0."
            for op in PLAIN_OPCODES[:12]
            for cut in range(1, len(op))
        ),  # an opcode whose argument runs past its frame's end
        b"\x80\x05" + frame(b"K\x01") + frame(b"K\x02\x86."),  # a tuple's items in two frames
        b"\x80\x05" + frame(b"K\x01") + frame(b"\x87."),  # TUPLE3 of one item across a frame
        b"\x80\x05" + frame(b"N", 1) + b".",  # a frame declaring one byte more: ends on STOP
        b"\x80\x05" + frame(b"N.", 1),  # declaring one byte past the payload
    ]
    answers = run_in_child(_answers, cases, memory_budget=64 << 20)
    assert [a for a, b in answers if a != b] == []
    shown = [data for data, (answer, _) in zip(cases, answers) if answer]
    assert payload(b"]\x96" + (1000).to_bytes(8, "little") + b"a" * 1000 + b"a") in shown  # bytearrays: any length
    assert payload(b"]\x8e" + (256).to_bytes(8, "little") + b"a" * 256 + b"a") not in shown  # other bytes: 255 at most
    assert b"\x80\x05" + frame(b"K\x01") + frame(b"K\x02\x86.") in shown


@needs_c_walk
def test_the_c_walk_takes_bytes_only():
    """restricted-pickle copies what is not bytes before walking it: a view the sender still writes to
    could change between the walk and the load."""
    for data in (bytearray(b"N."), memoryview(b"N.")):
        with pytest.raises(TypeError, match="takes bytes"):
            _plain.is_plain_c(data)


def _refusals_of_the_plain_loads(payloads: Dict[str, bytes]) -> Dict[str, Tuple[str, str]]:
    """In the child: what each plain load (``pickle.loads`` without imports, the unpickler that refuses
    every global) makes of payloads that name globals."""
    import sys

    from _hostile import outcome

    results = {}
    for label, data in payloads.items():
        imported = set(sys.modules)
        fallback = lambda d=data: _plain_load._PlainUnpickler(_plain_load.BytesIO(d)).load()  # noqa: E731
        results[label] = (outcome(lambda d=data: _plain_load._plain_load(d)), outcome(fallback))
        assert set(sys.modules) == imported, label  # nothing the payload names was imported
    return results


def test_the_plain_load_refuses_every_global_before_importing_it():
    """The plain path's backstop holds on this Python (checked at import, ``_backstop_holds``): a global
    in a payload loaded as plain is refused by the refusing ``__import__``, never imported or called."""
    assert _plain_load._backstop_holds()
    payloads = {
        "os.system": payload(b"(" + glob("os", "system") + v("true") + b"tR"),
        "a STACK_GLOBAL": payload(v("os") + v("system") + b"\x93" + v("true") + b"\x85R"),
        "a never-imported module": payload(glob("antigravity", "fly") + b")R"),
        "builtins": payload(glob("builtins", "len") + b"\x94"),
    }
    results = run_in_child(_refusals_of_the_plain_loads, payloads, memory_budget=64 << 20)
    assert results == dict.fromkeys(payloads, ("ContentRefusedError", "ContentRefusedError"))
