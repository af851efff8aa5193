"""objcomm._transport.rests: each collective's rest, written once over a medium's one primitive, called in one
process with a medium that records what it is asked (the real media run on live ranks:
tests/samehost/test_channel_rests.py, tests/samehost/test_shm.py)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch

from objcomm._errors import TooLargeError
from objcomm._format.message import Incoming, Outgoing
from objcomm._format.slot import SlotInfo
from objcomm._transport.base import NOT_USED, Wire
from objcomm._transport.patterns import Pattern
from objcomm._transport.rests import Due, Mine, PatternRests, Rest

SLOT = 64


def _wire(rank: int, world: int, max_bytes: int = 1 << 30) -> Wire:
    return Wire(None, list(range(world)), rank, torch.device("cpu"), SLOT, 1 << 20, max_bytes)


def _info(moved: int) -> SlotInfo:
    """A slot whose frame (8 bytes) it carried, followed by ``moved`` bytes of tensors (0: nothing follows)."""
    return SlotInfo(8, False, bool(moved), 1 << 30, 8 + moved, memoryview(b"inline!!"), [moved] if moved else [])


class Recording:
    """A medium that delivers, from each source that moves bytes, an Incoming naming it, and keeps what it was asked."""

    drained = "a recording"

    def __init__(self) -> None:
        self.asked: List[Any] = []

    def exchange(self, wire: Wire, at: Pattern, mine: Mine, due: Due, op: str) -> Dict[int, Incoming]:
        self.asked.append((at, mine, due))
        got = {r: Incoming(memoryview(b"from %d" % r)) for r in at.sources if due.moved[r] and due.keep}
        return got


class Rests(PatternRests):
    def __init__(self, medium: Optional[Recording]) -> None:
        self.chosen = medium
        self.sizes: List[Any] = []

    def medium(self, wire: Wire, largest: int, gathered: int, op: str) -> Optional[Recording]:
        self.sizes.append((largest, gathered))
        return self.chosen


def _out(tag: bytes) -> Outgoing:
    return Outgoing(tag, [torch.arange(4, dtype=torch.uint8)])


@pytest.mark.parametrize("world", [2, 5, 8192])
def test_all_gather_reads_every_sender_that_moved_and_copies_its_own(world):
    moved = [(r % 3) * 100 for r in range(world)]  # a third of the ranks move nothing
    infos, me = [_info(n) for n in moved], 1
    medium, out = Recording(), _out(b"mine")
    rests = Rests(medium)
    got = rests.all_gather(_wire(me, world), out, infos, None, "all_gather")
    assert rests.sizes == [(max(moved), 0)]
    ((at, mine, due),) = medium.asked
    assert at.op == "all_gather" and len(at.sources) == world - 1 and due.own and due.keep
    assert isinstance(mine, Rest) and mine.out is out and mine.frame_inline
    assert [bytes(g.frame) for g in got[:3]] == [b"inline!!", b"mine", b"from 2"][:world]
    assert got[me].tensors[0].data_ptr() != out.tensors[0].data_ptr()  # a copy: never the input itself


def test_gather_asks_by_the_largest_sender_and_the_sum_and_returns_only_at_the_root():
    moved, world = [300, 0, 200, 100], 4
    infos = [_info(n) for n in moved]
    for me in range(world):
        medium = Recording()
        rests = Rests(medium)
        got = rests.gather(_wire(me, world), _out(b"g%d" % me), infos, None, 2, "gather")
        assert rests.sizes == [(300, 400)]  # the root's own 200 moves nowhere
        ((at, mine, due),) = medium.asked
        assert due.paced == 400  # what a root takes unpaced
        if me != 2:
            assert got is None and at.to == (2,) and (mine is None) == (moved[me] == 0)
        else:
            assert [bytes(g.frame) for g in got] == [b"from 0", b"inline!!", b"g2", b"from 3"]


def test_broadcast_refused_by_a_receiver_over_its_limit_is_drained_then_raised():
    info, world = _info(1000), 3
    medium = Recording()
    with pytest.raises(TooLargeError, match="received into a recording, and dropped"):
        Rests(medium).broadcast(_wire(1, world, max_bytes=500), None, info, None, 0, "broadcast")
    ((at, mine, due),) = medium.asked
    assert not due.keep and at.sources == (0,) and mine is None
    root = Rests(Recording()).broadcast(_wire(0, world, max_bytes=500), _out(b"root"), info, None, 0, "broadcast")
    assert bytes(root.frame) == b"root"  # the root's own limit is not asked


def test_scatter_and_all_to_all_send_a_rest_per_receiver_only_where_one_follows():
    world, me = 3, 0
    outs = [Outgoing(b"x" * 8), Outgoing(b"y" * 8, [torch.zeros(9, dtype=torch.uint8)]), Outgoing(b"z" * 200)]
    medium = Recording()
    Rests(medium).scatter(_wire(me, world), outs, _info(0), None, 0, 200, "scatter")
    ((at, mine, due),) = medium.asked
    assert at.each and mine is not None and isinstance(mine, list)
    assert [None if m is None else (m.out, m.frame_inline) for m in mine] == [None, (outs[1], True), (outs[2], False)]
    medium = Recording()
    got = Rests(medium).all_to_all(_wire(me, world), outs, [_info(0), _info(9), _info(0)], None, 9, "all_to_all")
    assert [bytes(g.frame) for g in got] == [b"x" * 8, b"from 1", b"inline!!"]
    assert medium.asked[0][2].longest == 9


def test_no_medium_leaves_every_collective_to_the_transport():
    rests, wire, infos = Rests(None), _wire(0, 2), [_info(10), _info(10)]
    assert rests.all_gather(wire, _out(b"a"), infos, None, "all_gather") is NOT_USED
    assert rests.gather(wire, _out(b"a"), infos, None, 0, "gather") is NOT_USED
    assert rests.broadcast(wire, _out(b"a"), infos[0], None, 0, "broadcast") is NOT_USED
    assert rests.scatter(wire, [_out(b"a")] * 2, infos[0], None, 0, 10, "scatter") is NOT_USED
    assert rests.all_to_all(wire, [_out(b"a")] * 2, infos, None, 10, "all_to_all") is NOT_USED
    assert rests.gather(wire, _out(b"a"), None, None, 0, "gather") is NOT_USED  # only the destination read round 1
