"""``serializers._exact_tree``: which objects msgspec gives back exactly, the C walk against the Python reference.

``serializer="auto"`` sends an object through msgspec unjudged where :func:`carried_exactly` says yes, so a wrong
yes would change a user's object silently. Random trees mixing what msgspec carries exactly with what it converts
(tuples, sets, subclasses, big ints, shared containers) are asked of both walks, and every yes is sent through
msgspec and judged. Each batch runs in a child process (``_child.run_in_child``): a crash of the C walk fails the
test, not pytest.
"""

from __future__ import annotations

import enum
import random
from collections import OrderedDict, defaultdict
from typing import Any, List, Tuple

import numpy as np
import pytest
import torch
from _child import run_in_child
from _hostile import FUZZ_SCALE

from objcomm._format import tensors as _tensors
from serializers import _exact_tree

needs_c_walk = pytest.mark.skipif(
    _exact_tree.carried_exactly is None, reason="the C walk was not built here (no compiler at install)"
)
# what serializer="auto" passes: tensors; arrays past 4 KiB of the dtypes objcomm lifts out of band
LEAVES = ((torch.Tensor,), np.ndarray, 4096, tuple(_tensors._NUMPY_CODES))
LONG = "s" * _exact_tree.SHARED_LENGTH


class Level(enum.IntEnum):
    LOW = 1


class Name(str):
    pass


def _scalar(rng: random.Random) -> Any:
    return rng.choice(
        [
            lambda: None,
            lambda: rng.random() < 0.5,
            lambda: rng.random(),
            lambda: "é" * rng.randrange(4),
            lambda: bytes(rng.randrange(3)),
            lambda: rng.randrange(-5, 5),
            lambda: rng.choice([2**63 - 1, -(2**63), 2**64 - 1]),
            lambda: rng.choice([2**64, -(2**63) - 1, 10**30]),  # beyond msgspec's ints
            lambda: np.arange(rng.randrange(4)),
            lambda: np.zeros(rng.choice([512, 513, 2000])),
            lambda: torch.zeros(2),
            lambda: np.zeros(2000, dtype=rng.choice([">f8", "<U5", "S8", "M8[s]"])),
            lambda: LONG,
            lambda: LONG + "x",
            lambda: LONG.encode(),
            lambda: LONG[:-1],
            lambda: (1, 2),
            lambda: {1},
            lambda: frozenset(),
            lambda: bytearray(b"x"),
            lambda: Level.LOW,
            lambda: Name("n"),
            lambda: np.float32(1.5),
            lambda: torch.nn.Parameter(torch.zeros(1)),
            lambda: 1j,
        ]
    )()


def _tree(rng: random.Random, depth: int, shared: List[Any], held: List[Any]) -> Any:
    """A random object; nested containers are met once unless put in ``shared`` (met again, maybe) or ``held``
    (also held by the caller, as a user's variable would: met once still)."""
    if depth == 0 or rng.random() < 0.3:
        return _scalar(rng)
    roll = rng.random()
    if roll < 0.05 and shared:
        return rng.choice(shared)
    if roll < 0.45:
        value: Any = [_tree(rng, depth - 1, shared, held) for _ in range(rng.randrange(5))]
    elif roll < 0.9:
        value = {}
        for _ in range(rng.randrange(5)):
            key = rng.choice(
                [f"k{rng.randrange(9)}", rng.randrange(-3, 9), 2**64, 1.5, (1,), None, Name("n"), LONG]
                if rng.random() < 0.3
                else [f"k{rng.randrange(9)}"]
            )
            value[key] = _tree(rng, depth - 1, shared, held)
    elif roll < 0.95:
        value = OrderedDict(a=_tree(rng, depth - 1, shared, held))
    else:
        value = defaultdict(list, a=_tree(rng, depth - 1, shared, held))
    if rng.random() < 0.04:
        shared.append(value)
    elif rng.random() < 0.04:
        held.append(value)
    return value


def _answers(seed: int, count: int) -> Tuple[List[str], int, int]:
    """In the child: the trees the two walks disagree on, how many were yes, and the yeses msgspec changed."""
    import serializers
    from objcomm._format import frame
    from objcomm._format.message import Incoming
    from serializers._fidelity import judge

    msgspec = serializers.registry.guarded("msgspec")
    rng = random.Random(seed)
    differ, yes, changed = [], 0, []
    for _ in range(count):
        shared: List[Any] = []
        held: List[Any] = []
        obj = _tree(rng, 5, shared, held)
        del shared  # met twice inside obj is what makes them shared; `held` stays held
        c, python = _exact_tree.carried_exactly(obj, *LEAVES), _exact_tree.carried_exactly_python(obj, *LEAVES)
        if c != python:
            differ.append(repr(obj)[:200])
        if c:
            yes += 1
            out = frame.encode(obj, msgspec, max_bytes=1 << 30)
            got = frame.decode(Incoming(out.frame, list(out.tensors)), sender=0, accept=None, own=True)
            if judge(obj, got)[0] != "exact":
                changed.append(repr(obj)[:200])
    return differ, yes, len(changed)


@needs_c_walk
@pytest.mark.timeout(200)
def test_the_c_walk_answers_as_the_python_one_and_every_yes_comes_back_exactly():
    count = 3000 * FUZZ_SCALE
    differ, yes, changed = run_in_child(_answers, 7, count, memory_budget=512 << 20, timeout=150)
    assert differ == []
    assert changed == 0
    assert count // 10 < yes < count * 9 // 10, yes  # both answers are common: the trees exercise the rules


@needs_c_walk
@pytest.mark.parametrize("walk", ["c", "python"])
def test_the_rules(walk):
    carried = _exact_tree.carried_exactly if walk == "c" else _exact_tree.carried_exactly_python
    assert carried({"loss": 0.25, "ids": [1, 2], 3: b"x", "none": None, "flag": True, "s": "é"}, ())
    assert carried([2**64 - 1, -(2**63)], ()) and not carried([2**64], ()) and not carried([-(2**63) - 1], ())
    assert carried(np.zeros(513), *LEAVES) and not carried(np.zeros(512), *LEAVES)  # 4,104 and 4,096 bytes
    assert not carried(np.zeros(513), (torch.Tensor,)) and carried(torch.zeros(1), *LEAVES)
    for converted in (
        (1,),
        {1},
        frozenset(),
        bytearray(),
        Level.LOW,
        Name("n"),
        OrderedDict(),
        defaultdict(list),
        np.float32(1),
        torch.nn.Parameter(torch.zeros(1)),
        1j,
        {1.5: 1},
        {None: 1},
        {(1,): 1},
        {Name("n"): 1},
        {2**64: 1},
    ):
        assert not carried({"x": converted}, *LEAVES), converted
    inner = [1]
    assert not carried([inner, inner], ())  # met twice: msgspec would send two lists
    assert not carried([LONG, LONG], ()) and not carried([LONG.encode()] * 2, ())  # written twice, read as two
    assert carried([LONG[:-1]] * 2, ()) and carried([LONG + "a", LONG + "a"], ())  # short; two strings met once
    assert not carried([{LONG: 1}, {LONG: 2}], ()) and carried([{LONG[:-1]: 1}, {LONG[:-1]: 2}], ())
    big = np.zeros(513)
    assert not carried([big, np.zeros(513, ">f8")], *LEAVES)  # objcomm does not lift '>f8': in the payload
    assert carried([big, big], *LEAVES)  # lifted once, one array on the receiver too
    assert carried({"x": inner}, ())  # also held by a variable here, but met once
    assert not carried({"x": {"y": inner}, "z": [inner]}, ())
    loop: list = []
    loop.append(loop)
    assert not carried(loop, ())
    deep: list = []
    level = deep
    for _ in range(_exact_tree.MAX_DEPTH):
        level.append([])
        level = level[0]
    del level  # else the innermost list is held here too
    assert not carried(deep, ())
    assert carried(deep[0], ())  # one level less

    class Sized:
        nbytes = 10_000  # a Python class: its getters could run code while the walk holds borrowed references

    if walk == "c":
        with pytest.raises(TypeError, match="large must be a type defined in C"):
            carried([Sized()], (), Sized, 0, ())

    class Equal(type):
        def __eq__(cls, other):  # equal to everything: the walks compare types by identity
            return True

        __hash__ = type.__hash__

    class Odd(metaclass=Equal):
        pass

    assert not carried({"x": Odd()}, (torch.Tensor,))
