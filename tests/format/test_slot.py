"""objcomm._format.slot: many slots read at once (read_slots) read each slot as read_slot does."""

from __future__ import annotations

import random
from typing import Any, List, Tuple

import pytest
import torch

from objcomm._format import frame as _frame
from objcomm._format import slot as _slot
from serializers import registry


def _fields(info: _slot.SlotInfo) -> Tuple[Any, ...]:
    return (*info[:5], None if info.inline is None else bytes(info.inline), *info[6:])


def _table(rng: random.Random, count: int, width: int) -> bytearray:
    """``count`` slots of ``width`` bytes: frames that fit (plain, with tensors listed after them, error reports),
    frames past the slot (sizes listed or not), and a liar's prefixes (any flag bits over a length that fits, a
    length past the slot, any bytes at all)."""
    table = bytearray(count * width)
    pickle, capacity = registry.guarded("pickle"), width - _slot.PREFIX.size
    for r in range(count):
        view = memoryview(table)[r * width : (r + 1) * width]
        kind = rng.randrange(7)
        if kind == 0:  # a small object: its frame inline, nothing after it
            out = _frame.encode(list(range(rng.randrange(20))), pickle, max_bytes=1 << 40)
        elif kind == 1:  # out-of-band tensors: their sizes listed after the frame
            tensors = [torch.zeros(rng.randrange(1, 9)) for _ in range(rng.randrange(1, 4))]
            out = _frame.encode(tensors, pickle, max_bytes=1 << 40, inline_tensor_bytes=0)
        elif kind == 2:
            out = _frame.error_frame(ValueError("x" * rng.randrange(50)), capacity)
        elif kind == 3:  # past the slot
            out = _frame.encode(b"y" * (capacity + rng.randrange(1, 5000)), pickle, max_bytes=1 << 40)
        if kind <= 3:
            piece = 1 << rng.randrange(20, 31)
            _slot.fill_slot(view, out, rng.randrange(1 << 40), round2=rng.random() < 0.3, piece=piece)
        elif kind == 4:  # a liar's prefix: any bits above a length that fits
            word = rng.randrange(capacity + 1) | rng.getrandbits(8) << _slot.PIECE_SHIFT
            _slot.PREFIX.pack_into(view, 0, word, rng.getrandbits(64), rng.getrandbits(64))
            view[_slot.PREFIX.size :] = rng.randbytes(capacity)
        elif kind == 5:  # a length past the slot, listed bit or not
            word = rng.randrange(capacity + 1, 1 << 20) | rng.getrandbits(8) << _slot.PIECE_SHIFT
            _slot.PREFIX.pack_into(view, 0, word, 0, rng.getrandbits(64))
            view[_slot.PREFIX.size :] = rng.randbytes(capacity)
        else:
            view[:] = rng.randbytes(width)
    return table


@pytest.mark.parametrize("width", [1024, 4096, 1001, 64])
@pytest.mark.parametrize("count", [1, _slot.PREFIXES_AT_ONCE - 1, _slot.PREFIXES_AT_ONCE, 300])
def test_many_slots_read_at_once_read_as_each_alone(count, width):
    rng = random.Random(count * 7919 + width)
    for _ in range(5):
        table = _table(rng, count, width)
        host = memoryview(table)
        each: List[Any] = [_fields(_slot.read_slot(host[r * width : (r + 1) * width])) for r in range(count)]
        assert [_fields(info) for info in _slot.read_slots(host, count, width)] == each
