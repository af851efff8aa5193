"""The full walk of restricted-pickle (``serializers._restricted.scan``): its C build answers as the Python one.

The C walk (``_pickle_walks_c.c``) answers only for payloads of binary opcodes that the Python walk
accepts, and must then give the same answer (whether the probe pass runs); for every other payload it
answers None and the Python walk decides. Every comparison runs in a child process, so a crash of the
C walk fails a test instead of pytest. The hostile-input tests of the full walk are in
``test_adversarial_serializers.py``: they go through the C walk first wherever it was built.
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Union

import pytest
from _child import run_in_child
from _hostile import FUZZ_SCALE, dag, glob, payload, tuple_dag, v
from _pickles import random_call_pickle, rich_value

import serializers
from serializers._restricted import scan as _scan

needs_c_walk = pytest.mark.skipif(
    _scan._full_walk_c is None, reason="the C walk was not built here (no compiler at install)"
)
Answer = Union[bool, str, None]


def _answers(cases: List[bytes]) -> List[tuple]:
    """In the child: each case's answer from the Python walk ("refused" where it raises) and the C walk."""
    answers = []
    for data in cases:
        try:
            python: Answer = _scan.full_walk_python(data)
        except Exception:
            python = "refused"
        answers.append((python, _scan._full_walk_c(data)))
    return answers


@needs_c_walk
@pytest.mark.timeout(400)
def test_the_c_walk_answers_as_the_python_walk_on_random_and_mutated_pickles():
    rng = random.Random(20261201)
    cases = [random_call_pickle(rng) for _ in range(3000 * FUZZ_SCALE)]
    answers = run_in_child(_answers, cases, memory_budget=512 << 20, timeout=300, preload=("numpy", "torch"))
    wrong = {data[:150]: pair for data, pair in zip(cases, answers) if pair[1] is not None and pair[0] != pair[1]}
    assert not wrong
    decided = [pair for pair in answers if pair[1] is not None]
    # both answers are well represented, and the C walk leaves few accepted payloads to the Python one
    assert sum(pair[1] is True for pair in decided) > 100 and sum(pair[1] is False for pair in decided) > 100
    left = [pair for pair in answers if pair[1] is None and pair[0] != "refused"]
    assert len(left) < len(cases) // 20


@needs_c_walk
def test_the_c_walk_decides_restricted_pickles_own_payloads():
    """What restricted-pickle writes (protocol 5, binary opcodes only) is decided by the C walk."""
    rng = random.Random(7)
    cases = [bytes(serializers.get("restricted-pickle").dumps(rich_value(rng))) for _ in range(300)]
    answers = run_in_child(_answers, cases, memory_budget=512 << 20, preload=("numpy", "torch"))
    assert [pair for pair in answers if pair[0] != pair[1]] == []


@needs_c_walk
def test_the_c_walk_leaves_every_hostile_payload_to_the_python_walk():
    """Globals as values, state on globals, deep and exponential tuples, memo past the opcodes, a
    budget-breaking frozenset nest, stack underflow below a mark: the C walk never accepts one."""
    frozen = b")"  # frozensets of two references to the one before: comparing them doubles per level
    for level in range(40):
        frozen += b"\x94(h" + bytes([level]) + b"h" + bytes([level]) + b"\x91"
    cases = {
        "a global as a value": payload(b"]" + v("builtins") + v("set") + b"\x93a"),
        "state on a global": payload(v("builtins") + v("set") + b"\x93}b"),
        "a global as a dict key": payload(b"}" + v("builtins") + v("set") + b"\x93Ns"),
        "a call of a call's arguments": payload(v("builtins") + v("set") + b"\x93\x85\x85R"),
        "tuples 513 deep": payload(b"K\x01" + b"\x85" * 513),
        "a tuple dag as a key": payload(b"}" + tuple_dag(60) + b"Ns"),
        "a tuple dag as a key through DICT": payload(b"(" + tuple_dag(60) + b"Nd"),
        "nested frozensets as a key": payload(b"}" + frozen + b"Ns"),
        "a list dag": payload(dag(40)),
        "a memo slot past the opcodes": payload(b"N" + b"r\xff\xff\x00\x00"),
        "a memo read of an empty slot": payload(b"h\x05"),
        "STACK_GLOBAL below a mark": payload(v("a") + b"(" + v("b") + b"\x93" + b"\x85" + b"1"),
        "no STOP": b"\x80\x05N",
        "two values at STOP": payload(b"NN"),
        "an EXT1": payload(b"\x82\x01"),
        "a persistent id": payload(b"N" + b"Q"),
        "GLOBAL (a text opcode)": payload(glob("builtins", "set") + b")R"),
        "a call of a value a call built": payload(v("builtins") + v("set") + b"\x93)R" + v("x") + b"\x85R"),
        "OBJ of a value a call built": payload(b"(" + v("builtins") + v("set") + b"\x93)R" + b"o"),
    }
    answers = run_in_child(_answers, list(cases.values()), memory_budget=256 << 20, preload=("numpy", "torch"))
    decided: Dict[str, Optional[bool]] = {label: pair[1] for label, pair in zip(cases, answers) if pair[1] is not None}
    accepted_by_python = {label for label, pair in zip(cases, answers) if pair[0] != "refused"}
    assert decided == {label: answers[i][0] for i, label in enumerate(cases) if label in decided}
    assert not decided.keys() - accepted_by_python
    assert "a list dag" in accepted_by_python and "a list dag" in decided  # a dag of lists is fine: no hashing


class _Job:
    """An allowed class whose instances are callable (a model, a transform, a task)."""

    called: List[tuple] = []

    def __call__(self, *args: object) -> str:
        _Job.called.append(args)
        return "ran"


def test_calls_of_a_value_the_payload_built_are_refused_by_both_walks():
    """A helper's find: REDUCE (and OBJ) took any value as the callable but a call's arguments, so with an allowed
    class whose instances are callable, ``_Job()`` then ``REDUCE(instance, ("chosen", 1000000))`` ran
    ``_Job.__call__`` with the payload's arguments, unguarded. A call's callable is a global now, in both walks (the
    C walk leaves such a payload to the Python one, which says why); the encoder writes no other."""
    job = v(_Job.__module__) + v("_Job") + b"\x93)R"
    cases = [payload(job + v("chosen") + b"J\x40\x42\x0f\x00\x86R"), payload(b"(" + job + b"o")]
    restricted = serializers.RestrictedPickleSerializer()
    restricted.allow(_Job)
    for data in cases:
        with pytest.raises(_scan.ScanError, match="calls a value the payload built"):
            _scan.full_walk_python(data)
        if _scan._full_walk_c is not None:
            assert _scan._full_walk_c(data) is None
        with pytest.raises(serializers.ContentRefusedError, match="calls a value the payload built"):
            restricted.loads(data)
    assert _Job.called == []
    assert type(restricted.loads(restricted.dumps(_Job()))) is _Job  # an allowed class itself still loads


def test_a_text_memo_index_that_is_not_a_number_is_the_walk_s_error():
    """A helper's find: int()'s ValueError left the Python walk, where its callers expect ScanError."""
    with pytest.raises(_scan.ScanError, match="memo index that is not a number"):
        _scan.full_walk_python(b"\x80\x05Np\x87x\n.")


@needs_c_walk
def test_the_c_walk_takes_bytes_only():
    for data in (bytearray(b"N."), memoryview(b"N.")):
        with pytest.raises(TypeError, match="takes bytes"):
            _scan._full_walk_c(data)


def _answers_with_a_larger_budget(cases: List[bytes], per_byte: int) -> List[tuple]:
    """In the child: :func:`_answers` with both walks' hashing budget at ``per_byte`` per payload byte."""
    _scan.HASH_WORK_PER_BYTE = per_byte
    _scan._configure_c(*_scan._c_tables(), _scan.MAX_NESTING, per_byte, _scan.COMPARED_BYTES)
    return _answers(cases)


@needs_c_walk
def test_the_c_walks_sums_of_hashing_work_never_overflow():
    """A frozenset (or a tuple used as a key) of n references to a tuple dag whose hashing work is capped
    at the budget: its work sums n capped values. At 16 units a byte that overflows int64 only from
    ~760 MB of payload on, so the budget is raised to 2**50 a byte here (both walks alike) to bring it
    within a few hundred bytes. Python refuses each; an overflowing C sum would wrap negative and accept."""
    dag = b"K\x01\x85" + b"2\x86" * 60 + b"\x940(h\x00"
    cases = []
    for n in (1, 2, 8, 64, 150, 200, 400):
        cases += [
            payload(dag + b"2" * (n - 1) + b"\x91"),
            payload(b"}" + dag + b"2" * (n - 1) + b"tNs"),
            payload(b"(" + dag + b"2" * (n - 1) + b"tNd"),
            payload(b"\x8f(" + dag + b"2" * (n - 1) + b"\x90"),
        ]
    answers = run_in_child(_answers_with_a_larger_budget, cases, 2**50, memory_budget=256 << 20)
    assert {pair[0] for pair in answers} == {"refused"}  # one capped dag already passes the budget
    assert [data.hex() for data, pair in zip(cases, answers) if pair[1] is not None] == []  # left to Python


def _loads_both_ways(cases: List[bytes]) -> List[tuple]:
    """In the child: each case's outcome through restricted-pickle's ``loads`` with the C walks, then with
    both walks in pure Python (as an install without a compiler runs): the outcome, and repr of the value."""
    from _hostile import outcome

    from serializers import _restricted

    restricted = serializers.get("restricted-pickle")

    def load(data: bytes) -> tuple:
        values: list = []
        result = outcome(lambda: values.append(restricted.loads(data)))
        return result, repr(values[0]) if values else None

    answers = []
    for data in cases:
        with_c = load(data)
        with _restricted.python_walks():
            answers.append((with_c, load(data)))
    return answers


@needs_c_walk
@pytest.mark.timeout(400)
def test_restricted_pickle_decodes_alike_with_and_without_the_c_walks():
    """The same outcome (value, or the kind of refusal) for random, mutated and call-heavy pickles."""
    rng = random.Random(11)
    cases = [random_call_pickle(rng) for _ in range(1500 * FUZZ_SCALE)]
    answers = run_in_child(_loads_both_ways, cases, memory_budget=1 << 30, timeout=300, preload=("numpy", "torch"))
    assert [(data[:100], pair) for data, pair in zip(cases, answers) if pair[0] != pair[1]] == []
    assert sum(pair[0][0] == "ok" for pair in answers) > len(cases) // 4
