"""objcomm._format.plain_slot: a slot's plain frame is read as the general path reads it, field by field."""

from __future__ import annotations

import random
from typing import Any, Optional, Tuple

from objcomm._format import frame as _frame
from objcomm._format import plain_slot as _plain_slot
from objcomm._format.slot import PREFIX, read_slot
from serializers import registry

SLOT = 256


def _general(raw: bytes) -> Optional[_frame.Header]:
    """The header the general path reads of ``raw`` where it holds a whole frame with nothing after it, else None."""
    try:
        info = read_slot(memoryview(raw))
        if info.error or info.inline is None or info.sizes:
            return None
        return _frame.parse_header(info.inline)
    except Exception:
        return None


def test_the_slots_plain_test_takes_what_the_frames_plain_test_takes_field_by_field():
    """``_plain_lengths`` spells out ``_plain``'s test (a small call's speed): each header field set to values that
    matter, one at a time and in random pairs, gets the same answer from the slot's reader and the frame's, and
    whatever they take the general path reads alike."""
    rng = random.Random(7)
    base = _plain_slot.small_slot(b"pickle", registry.get("pickle").dumps({"a": 1}), SLOT, 1 << 30)
    assert base is not None
    fields = list(_plain_slot._SLOT_HEADER.unpack_from(base, 0))  # the prefix's 3, then the frame header's 10
    numbers = (0, 1, 2, 3, 7, 0x7F, 0xFF, len(base) - PREFIX.size, (1 << 31) - 1)

    def values(at: int) -> Tuple[Any, ...]:
        if isinstance(fields[at], bytes):  # the magic
            return (fields[at], b"\0" * 4, fields[at][:3] + b"X", b"X" + fields[at][1:])
        return (*numbers, fields[at], fields[at] + 1, fields[at] - 1)

    variants = [[value if i == at else f for i, f in enumerate(fields)] for at in range(13) for value in values(at)]
    for _ in range(3000):
        changed = list(fields)
        for at in rng.sample(range(13), 2):
            changed[at] = rng.choice(values(at))
        variants.append(changed)
    taken = 0
    for changed in variants:
        try:
            head = _plain_slot._SLOT_HEADER.pack(*changed)
        except Exception:  # a value outside its field's width
            continue
        raw = head + base[len(head) :]
        plain = _plain_slot.plain_in_slot(raw)
        word = changed[0]
        frame = (
            raw[PREFIX.size : PREFIX.size + word]
            if changed[0] == changed[2] and word <= len(raw) - PREFIX.size
            else b""
        )
        assert (plain is not None) == (_plain_slot.plain_frame(frame) is not None), changed
        assert (plain is None) == (_plain_slot.plain_named(raw) is None), changed
        if plain is not None:
            taken += 1
            general = _general(raw)
            assert general is not None, changed
            assert (general.serializer, general.payload_len, general.flags) == (
                plain[1].serializer,
                plain[1].payload_len,
                0,
            )
    assert taken >= 3
