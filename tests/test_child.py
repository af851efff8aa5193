"""Tests of the child-process harness in tests/_child.py: each call runs in a fresh child forked from one zygote,
and a crash, a hang, an exception or an allocation past the budget comes back as the right outcome."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from _child import ChildCrashed, ChildRaised, ChildTimeout, run_in_child

pytestmark = pytest.mark.timeout(120)

_MARK = "_objcomm_child_test_mark"


def pid_and_mark() -> tuple:
    """This child's pid, and whether an earlier child's mark survived into it; then marks it."""
    seen = hasattr(sys, _MARK)
    setattr(sys, _MARK, True)
    return os.getpid(), seen


def raise_value_error(message: str) -> None:
    raise ValueError(message)


def die_by(signum: int) -> None:
    os.kill(os.getpid(), signum)


def sleep_for(seconds: float) -> None:
    time.sleep(seconds)


def allocate(nbytes: int) -> int:
    return len(bytearray(nbytes))


def test_each_call_gets_a_fresh_child():
    (first, seen_first), (second, seen_second) = run_in_child(pid_and_mark), run_in_child(pid_and_mark)
    assert first != second and first != os.getpid()
    assert not seen_first and not seen_second  # nothing a child did reaches the next one


def test_an_exception_comes_back_with_its_type_and_message():
    with pytest.raises(ChildRaised) as raised:
        run_in_child(raise_value_error, "the message")
    assert raised.value.type_name == "ValueError" and raised.value.message == "the message"


@pytest.mark.parametrize("signum", [signal.SIGSEGV, signal.SIGKILL])
def test_a_crash_is_reported_with_its_signal(signum):
    with pytest.raises(ChildCrashed, match=signal.Signals(signum).name):
        run_in_child(die_by, signum)
    assert run_in_child(allocate, 10) == 10  # the next call still works


def test_a_child_past_its_timeout_is_killed():
    start = time.monotonic()
    with pytest.raises(ChildTimeout):
        run_in_child(sleep_for, 60, timeout=1)
    assert time.monotonic() - start < 30
    assert run_in_child(allocate, 10) == 10


def test_an_allocation_past_the_budget_raises_memory_error_in_the_child():
    assert run_in_child(allocate, 16 << 20, memory_budget=64 << 20) == 16 << 20
    with pytest.raises(ChildRaised) as raised:
        run_in_child(allocate, 1 << 30, memory_budget=64 << 20)
    assert raised.value.type_name == "MemoryError"
