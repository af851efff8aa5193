"""objcomm._format.limits at thousands of ranks: the pairwise checks' answers and messages, with O(W) work."""

from __future__ import annotations

import functools
import random
from typing import Any, List, NamedTuple, Optional

import pytest

from objcomm import TooLargeError
from objcomm._format import limits
from objcomm._format.limits import check_relays, checked_sizes, for_sender

pytestmark = pytest.mark.timeout(60)


class Info(NamedTuple):  # the fields of objcomm._format.slot.SlotInfo that the limit checks read
    length: int
    error: bool
    total: int
    limit: int
    sizes: Optional[List[int]] = None
    inline: Optional[bytes] = None  # the frame, where the slot carried it


CAPACITY = 4072  # the frame bytes the settings' slot carries (4 KiB less its prefix)
check_limits = functools.partial(limits.check_limits, least=CAPACITY)


def whole(total: int, limit: int = 10**9) -> Info:
    """A sender whose frame of ``total`` bytes came whole in its slot (no tensors)."""
    return Info(total, False, total, limit, inline=b"x" * total)


class Counted:
    """An info whose ``total`` counts how often it is read."""

    reads = 0

    def __init__(self, info: Info) -> None:
        self._info = info

    def __getattr__(self, name: str) -> Any:
        if name == "total":
            Counted.reads += 1
        return getattr(self._info, name)


def pairwise(infos: List[Any], receivers: Any, op: str) -> None:
    """The O(W²) check this module had: every (receiver, sender) pair in order."""
    for receiver in receivers:
        limit = infos[receiver].limit
        for sender, info in enumerate(infos):
            taken = info.inline is not None and info.total == info.length and info.total <= CAPACITY
            if sender != receiver and not info.error and not taken and info.total > limit:
                raise TooLargeError(
                    f"{op}: rank {sender} sends {info.total:,} bytes, above the max_bytes={limit:,} "
                    f"of receiving rank {receiver}"
                )


def outcome(check: Any, infos: List[Any], receivers: Any) -> Optional[str]:
    try:
        check(infos, receivers, "all_gather")
    except TooLargeError as exc:
        return str(exc).split(": ", 1)[1].split(";")[0]
    return None


def test_the_same_first_failure_as_every_pair_in_order():
    rng = random.Random(25)
    raised = 0
    for _ in range(2000):
        world = rng.choice([1, 2, 3, 5, 8, 33])
        infos = [
            Info(10, rng.random() < 0.2, rng.choice([10, 100, 1000, 5000]), rng.choice([50, 500, 2000, 10**9]))
            if rng.random() < 0.7
            else whole(rng.choice([100, 3000, 4072, 5000]), rng.choice([50, 500, 2000, 10**9]))
            for _ in range(world)
        ]
        receivers = [rng.randrange(world)] if rng.random() < 0.3 else range(world)
        expected = outcome(pairwise, infos, receivers)
        assert outcome(check_limits, infos, receivers) == expected, (infos, list(receivers))
        raised += expected is not None
    assert 500 < raised < 1500  # both outcomes were tried often


def test_a_sender_is_never_held_to_its_own_limit():
    infos = [Info(10, False, 10**6, 100), Info(10, False, 10, 100)]  # rank 0's own payload is above its limit
    assert (
        outcome(check_limits, infos, range(2)) == "rank 0 sends 1,000,000 bytes, above the max_bytes=100 of "
        "receiving rank 1"
    )
    assert outcome(check_limits, infos, [0]) is None


@pytest.mark.parametrize("failing", [False, True])
def test_work_is_linear_in_the_world_size(failing):
    world = 8192
    infos = [Counted(Info(10, False, 1000 + r, 10**9)) for r in range(world)]
    if failing:
        infos[world - 1] = Counted(Info(10, False, 1000, 500))  # the last receiver refuses
    Counted.reads = 0
    assert (outcome(check_limits, infos, range(world)) is not None) == failing
    assert Counted.reads <= 3 * world, Counted.reads  # pairwise: 8192 x 8191 reads


def test_a_payload_round_1_carried_whole_in_the_settings_slot_is_taken_whatever_the_limit():
    """A frame that fits the slot came with the slot every receiver takes: accepted whatever a receiver's max_bytes
    (docs/security.md), also where another sender's payload (a tensor, here) takes a second round; a payload past
    the settings' slot is held to the limit, and one that came whole in a wider slot (``least`` below it) is
    dropped, saying so. A relay holds no rest for such a sender."""
    tensor = Info(300, False, 800, 10**9)  # its frame in its slot, 500 bytes of tensor after it: a second round
    infos = [Info(10, False, 10, 1000), whole(3000), tensor]  # rank 0 takes at most 1,000 bytes
    assert outcome(check_limits, infos, range(3)) is None
    check_relays(infos, [(0, [0, 1, 2])], 2, "gather", CAPACITY)
    infos[2] = Info(300, False, 1800, 10**9)  # its tensor past rank 0's limit
    assert (
        outcome(check_limits, infos, range(3))
        == "rank 2 sends 1,800 bytes, above the max_bytes=1,000 of receiving rank 0"
    )
    infos[2] = tensor
    with pytest.raises(TooLargeError, match="rank 1 sends 3,000 bytes.*it came in round 1's slots, and was dropped"):
        limits.check_limits(infos, range(3), "all_gather", least=1000)  # a wider slot than the settings' 1 KB
    with pytest.raises(TooLargeError, match="rank 2 sends 1,800 bytes.*nothing was transferred"):
        limits.check_limits([*infos[:2], Info(300, False, 1800, 10**9)], range(3), "all_gather", least=CAPACITY)


def test_a_relay_is_held_to_its_limit_for_the_senders_it_holds_only():
    """A two-level gather's leaders (objcomm._samehost.two_level_rests.TwoLevelRests.relays): each sender's total
    against the limit of the ranks that hold it on its way to the destination, never the relay's own or dst's."""
    big, small = 10**6, 100
    infos = [Info(10, False, 10, small)] + [Info(10, False, 10, 10**9) for _ in range(5)]  # rank 0 relays, limit 100
    hosts = [(0, [0, 1, 2]), (3, [3, 4, 5])]  # dst: rank 1
    for sender in (0, 1, 3, 4, 5):  # its own, dst's own (which does not move), or a host rank 0 does not hold
        over = infos[:sender] + [Info(10, False, big, small)] + infos[sender + 1 :]
        check_relays(over, hosts, 1, "gather", CAPACITY)
    infos[2] = Info(10, True, big, 10**9)  # an error report: raised as such, never as too large
    check_relays(infos, hosts, 1, "gather", CAPACITY)
    infos[2] = Info(10, False, big, 10**9)
    with pytest.raises(TooLargeError, match="rank 2 sends 1,000,000 bytes, above the max_bytes=100 of rank 0, which "):
        check_relays(infos, hosts, 1, "gather", CAPACITY)
    infos[2] = Info(10, False, 10, 10**9)
    infos[5] = Info(10, False, big, 10**9)
    with pytest.raises(TooLargeError, match="rank 5 sends 1,000,000 bytes, above the max_bytes=100 of rank 0"):
        check_relays(infos, hosts + [(0, range(6))], 1, "gather", CAPACITY)  # rank 0 also holds every host's for dst


def test_checked_sizes_read_each_frame_against_its_own_senders_slot():
    """A helper's find: every frame was checked against each slot of the same frame length, O(W²) where lengths are
    equal (27 s at 8192 ranks), and a frame that agreed with another sender's slot passed. Now one slot a frame."""
    world = 8192
    infos = [Counted(Info(100, False, 100 + r % 256, 10**9, [r % 256])) for r in range(world)]  # equal frames
    every = checked_sizes(lambda frame: [frame[0]], infos)
    Counted.reads = 0
    for r in range(world):
        assert for_sender(every, infos[r])(memoryview(bytes([r % 256]) + bytes(99))) == [r % 256]
    assert Counted.reads <= 2 * world, Counted.reads
    with pytest.raises(OSError, match="disagree with its sender's slot"):  # rank 3's sizes are rank 5's slot's
        for_sender(every, infos[3])(memoryview(bytes([5]) + bytes(99)))
    with pytest.raises(OSError, match="disagree with its sender's slot"):  # a frame of another length
        for_sender(every, infos[0])(memoryview(bytes(99)))
    with pytest.raises(ValueError):  # a checker of every sender reads no frame itself
        every(memoryview(bytes(100)))
