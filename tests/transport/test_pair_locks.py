"""objcomm._transport.pair_locks: which backend sends and receives of a rank wait for each other (threads, no ranks)."""

from __future__ import annotations

import threading
from typing import Any, Callable, List

import pytest

from objcomm._errors import ObjcommError
from objcomm._transport import pair_locks
from objcomm._transport.pair_locks import receiving, sending

pytestmark = pytest.mark.timeout(60)


class _Group:  # a stand-in for a process group: hashable and weakly referable
    pass


def _waits_for(first: Callable[[], Any], second: Callable[[], Any]) -> bool:
    """Whether ``second`` (entered in another thread) waits while ``first`` is held here."""
    entered = threading.Event()

    def other() -> None:
        with second():
            entered.set()

    with first():
        worker = threading.Thread(target=other)
        worker.start()
        waited = not entered.wait(0.3)
    worker.join(5)
    assert entered.is_set()  # and it went on once the first was left
    return waited


def test_sends_to_one_peer_under_one_tag_go_one_at_a_time():
    group = _Group()
    assert _waits_for(lambda: sending(group, 1, 0), lambda: sending(group, 1, 0))
    assert not _waits_for(lambda: sending(group, 1, 0), lambda: sending(group, 2, 0))  # another peer
    assert not _waits_for(lambda: sending(group, 1, 0), lambda: sending(group, 1, 7))  # another tag
    assert not _waits_for(lambda: sending(group, 1, 0), lambda: sending(_Group(), 1, 0))  # another group


def test_receives_from_one_peer_or_from_any_go_one_at_a_time():
    group = _Group()
    assert _waits_for(lambda: receiving(group, 1, 0), lambda: receiving(group, 1, 0))
    assert not _waits_for(lambda: receiving(group, 1, 0), lambda: receiving(group, 2, 0))
    assert _waits_for(lambda: receiving(group, None, 0), lambda: receiving(group, None, 0))
    assert not _waits_for(lambda: receiving(group, None, 0), lambda: receiving(group, None, 1))  # another tag


@pytest.mark.parametrize("first, second", [(1, None), (None, 2)], ids=["given, then any", "any, then given"])
def test_a_receive_from_any_rank_beside_one_from_a_given_rank_is_refused(first, second):
    group = _Group()
    with receiving(group, first, 3):
        with pytest.raises(ObjcommError, match="under tag 3 while another thread"):
            with receiving(group, second, 3):
                pass
        with receiving(group, second, 4):  # another tag: no conflict
            pass
    with receiving(group, second, 3):  # once the first is done
        pass


def test_entries_live_while_in_use():
    group = _Group()
    for tag in range(1000):  # a tag per step
        with sending(group, 1, tag), receiving(group, 1, tag):
            pass
    held = pair_locks._of(group)
    assert held.entries == {} and held.receiving == {}


def test_sends_and_receives_never_wait_for_each_other():
    group = _Group()
    assert not _waits_for(lambda: receiving(group, None, 0), lambda: sending(group, 1, 0))
    assert not _waits_for(lambda: sending(group, 1, 0), lambda: receiving(group, 1, 0))


def test_a_receive_that_raises_lets_the_others_in():
    group = _Group()
    with pytest.raises(RuntimeError):
        with receiving(group, 1, 0):
            raise RuntimeError("the backend's receive failed")
    done: List[int] = []

    def any_source() -> None:
        with receiving(group, None, 0):
            done.append(1)

    worker = threading.Thread(target=any_source)
    worker.start()
    worker.join(5)
    assert done == [1]
