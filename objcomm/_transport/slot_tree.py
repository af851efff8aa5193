"""A gather of fixed-width slots up a tree of point-to-point messages (of radix
:data:`~objcomm._transport.routes.SLOT_TREE_RADIX`), each slot trimmed to what it carries: round 1 of a gather from
:data:`objcomm._transport.routes.TREE_GATHER_FROM` ranks (:mod:`objcomm._transport.gather`), and the leaders' step
of a gather on two levels (:mod:`objcomm._samehost.two_level_moves`), where each leader carries its host's slots;
and the destination's word back down the same tree (:func:`word_down_tree`).
"""

from __future__ import annotations

import struct
from typing import Optional, Union

import torch

from objcomm._format.slot import DEFAULT_PIECE
from objcomm._transport.base import INTERNAL_TAG, Wire
from objcomm._transport.bytes import Batch, Deadline, host_view, zeroed
from objcomm._transport.patterns import knomial
from objcomm._transport.routes import SLOT_TREE_RADIX


def gather_up_tree(
    wire: Wire,
    raw: Union[bytes, bytearray],
    width: int,
    dst: int,
    op: str,
    count: int = 1,
    radix: int = SLOT_TREE_RADIX,
) -> Optional[bytearray]:
    """Every rank's ``count`` slots of ``width`` bytes (``raw``) on group rank ``dst``, up a tree rooted there, each
    slot trimmed to what it carries: the slots of every group rank end to end, in group-rank order, on ``dst``
    (zeros where a slot carried nothing); None elsewhere. A gather's round 1 (one slot a rank); two levels'
    leaders, each with its host's slots (``count``: the most ranks on one host). ``radix``: the tree's (tests take a
    smaller one for relays among a few ranks).

    With ranks numbered from ``dst`` (``v = (rank - dst) mod W``), the tree is
    :func:`~objcomm._transport.patterns.knomial`'s of radix 4: rank ``v``'s children are ``v + j * 4**i`` (``j`` from 1
    to 3) below its lowest nonzero base-4 digit; a subtree of ``span`` ranks ``v .. v + span - 1`` travels as two
    messages: its *lengths* (``span x count`` int32s: each slot's bytes up to its last nonzero one) and its *bytes*
    (those slots' bytes end to end). A rank takes its children's lengths in one batch (their size is known), then sends
    its subtree's lengths to its parent while it takes its children's bytes (the lengths' sums) in one batch, then sends
    those bytes: the lengths climb the ceil(log4 W) levels one latency each (a level's 3 children at once), the bytes
    one level behind them (ceil(log4 W) + 1 latencies in all: 8 at 8192 ranks, where a binomial tree took 14), and the
    destination takes in what the slots carry (a 1 KB object's slot: ~1.1 KB of its 4 KB) rather than every slot whole.
    A rank relays its subtree's slots unchecked, as a two-level leader relays its host's (docs/security.md), but a
    child's lengths are checked: one past ``width`` empties that child's subtree (its slots arrive as zeros, which read
    as empty frames: refused where decoded), and its bytes are taken and dropped, so that a lying child changes no other
    subtree's slots."""
    size = wire.size
    me = (wire.rank - dst) % size
    tree = knomial(me, size, radix)
    span = tree.end - me  # the ranks of this rank's subtree
    view = memoryview(raw)
    mine = [bytes(view[j * width : (j + 1) * width]).rstrip(b"\0") for j in range(count)]
    lengths = zeroed(4 * count * span, wire)  # (zeroed: a short child's lengths read 0, never old memory)
    lengths[: 4 * count].copy_(torch.tensor([len(m) for m in mine], dtype=torch.int32).view(torch.uint8))
    wire = wire._replace(tag=INTERNAL_TAG, chunk=DEFAULT_PIECE)  # (round 1: in pieces no rank's settings change)
    batch = Batch(wire, op, together=True)
    # one deadline for the three waits: a child that holds back each of its two messages just within the group's
    # timeout would otherwise hold this rank for twice it, while the ranks that finished at once time out waiting
    # for the destination's word (some ranks returning, others raising: the outcome must be the same everywhere)
    deadline = Deadline(wire, op, "a gather's slots up the tree")
    children = [(child - me, end - child) for child, end in zip(tree.children, tree.ends)]  # (offset, ranks) each
    for first, ranks in children:
        batch.recv_into(lengths[4 * count * first : 4 * count * (first + ranks)], (me + first + dst) % size)
    batch.wait(deadline)
    counts = lengths.view(torch.int32).cpu()  # a lie past 2**31 reads negative: refused below
    own = b"".join(mine)
    carried, dropped = [len(own)], []
    for first, ranks in children:
        theirs = counts[count * first : count * (first + ranks)]
        total = int(theirs.sum())
        if int(theirs.min()) < 0 or int(theirs.max()) > width:  # a lying child: its subtree arrives empty
            theirs.zero_()
            dropped.append((first, min(total, ranks * count * width) if total > 0 else 0))
            total = 0
        carried.append(total)
    data = zeroed(sum(carried), wire)
    if own:
        data[: len(own)].copy_(torch.frombuffer(bytearray(own), dtype=torch.uint8))
    parent = None if tree.parent is None else (tree.parent + dst) % size
    if parent is not None:  # the lengths go on at once: the levels above post their receives while these bytes come
        batch.send(counts.view(torch.uint8), parent)
        if not children and data.numel():  # a leaf: its bytes with them
            batch.send(data, parent)
    at = len(own)
    for (first, _), total in zip(children, carried[1:]):
        if total:
            batch.recv_into(data[at : at + total], (me + first + dst) % size)
        at += total
    for first, total in dropped:  # taken and dropped, so that the lying child's sends complete
        if total:
            batch.recv(total, (me + first + dst) % size)
    batch.wait(deadline)
    if parent is not None:
        if children and data.numel():
            batch.send(data, parent)
            batch.wait(deadline)
        return None
    table = bytearray(size * count * width)
    into, flat = memoryview(table), host_view(data)
    at = 0
    for i, n in enumerate(counts.tolist()):  # slot j of relative rank v: group rank (v + dst) mod W's slot j
        v, j = divmod(i, count)
        place = (((v + dst) % size) * count + j) * width
        into[place : place + n] = flat[at : at + n]
        at += n
    return table


WORD = struct.Struct("<q")  # a destination's word (objcomm._transport.gather: GO or LOOK)


def word_down_tree(wire: Wire, word: Optional[int], dst: int, op: str, radix: int = SLOT_TREE_RADIX) -> int:
    """Group rank ``dst``'s ``word`` (a signed 64-bit int; None elsewhere) on every rank, down the tree rooted at
    ``dst`` that :func:`gather_up_tree` climbed: each rank takes it from its parent, then passes it to its children.
    ceil(log4 W) latencies, where NCCL's all_reduce of a word takes 2 ceil(log2 W) and its broadcast one a rank (a
    ring). A relay passes on what its parent sent, unchecked, as it relayed its subtree's slots on the way up."""
    size = wire.size
    me = (wire.rank - dst) % size
    tree = knomial(me, size, radix)
    # (a reviewer's find: a rank's own chunk_bytes of 4 cut the word in two, and its second half became the next call's
    # word on its child)
    wire = wire._replace(tag=INTERNAL_TAG, chunk=DEFAULT_PIECE)
    batch = Batch(wire, op, together=True)
    if tree.parent is None:
        assert word is not None, "the destination has the word"
        data = torch.frombuffer(bytearray(WORD.pack(word)), dtype=torch.uint8)
    else:
        data = batch.recv(WORD.size, (tree.parent + dst) % size)
        batch.wait(Deadline(wire, op, "the destination's word down the tree"))
        word = WORD.unpack(bytes(host_view(data)))[0]
    for child in reversed(tree.children):  # the largest subtree first: its levels are the most
        batch.send(data, (child + dst) % size)
    batch.wait()
    return word
