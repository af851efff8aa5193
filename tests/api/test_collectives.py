"""Every op x every built-in serializer x uneven payloads, on real gloo groups of 1-4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _builtins import ON_RANKS
from _ranks import get_pool

import objcomm

pytestmark = pytest.mark.timeout(180)

SERIALIZERS = ON_RANKS
# Tiny slots and chunks so the overflow and chunked paths run on small data.
LAYOUTS = {"default": {}, "tiny": {"slot_bytes": 128, "chunk_bytes": 1000}}
KINDS_FOR = {"default": ["empty", "one-byte", "1MiB", "skewed", "mixed"], "tiny": ["empty", "one-byte", "mixed"]}


def payload(rank: int, kind: str):
    """Uneven payloads: empty, one byte, 1 MiB, and one rank far bigger than the rest."""
    if kind == "empty":
        return ""
    if kind == "one-byte":
        return "x"
    if kind == "1MiB":
        return "m" * (1 << 20)
    if kind == "skewed":
        return "big" * 100_000 if rank == 1 else str(rank)
    if kind == "mixed":
        return ["", "x", "m" * 5000, "big" * 5_000][rank % 4]
    raise ValueError(kind)


def run_all_ops(serializer: str, layout: dict, kinds: list[str]) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = objcomm.Communicator(serializer=serializer, **layout)
    checked = 0
    for kind in kinds:
        expected = [payload(r, kind) for r in range(world)]
        assert comm.all_gather(expected[rank]) == expected, kind
        for root in sorted({0, world - 1}):
            got = comm.gather(expected[rank], dst=root)
            assert got == (expected if rank == root else None), kind
            assert comm.broadcast(expected[rank] if rank == root else None, src=root) == expected[root], kind
            assert comm.scatter(expected if rank == root else None, src=root) == expected[rank], kind
        if world > 1:
            # a ring: each rank sends to the next and receives from the previous
            nxt, prv = (rank + 1) % world, (rank - 1) % world
            if rank % 2 == 0:
                comm.send(expected[rank], dst=nxt)
                assert comm.recv(src=prv) == expected[prv]
            else:
                assert comm.recv(src=prv) == expected[prv]
                comm.send(expected[rank], dst=nxt)
        checked += 1
    return checked


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_every_op_every_serializer(ranks, serializer, layout):
    kinds = KINDS_FOR[layout]
    assert ranks.run(run_all_ops, serializer, LAYOUTS[layout], kinds) == [len(kinds)] * ranks.world_size


def ops_on_subgroup() -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    members = list(range(1, world))  # everyone but rank 0
    group = dist.new_group(members)
    if rank not in members:
        return []
    comm = objcomm.Communicator(group, serializer="msgpack", slot_bytes=128)
    me = {"rank": rank, "blob": b"z" * (rank * 500)}
    everyone = [{"rank": r, "blob": b"z" * (r * 500)} for r in members]
    assert comm.all_gather(me) == everyone
    last = members[-1]
    assert comm.gather(me, dst=last) == (everyone if rank == last else None)
    assert comm.broadcast(me if rank == last else None, src=last) == everyone[-1]
    assert comm.scatter(everyone if rank == members[0] else None, src=members[0]) == me
    if rank == members[0]:
        comm.send(me, dst=last)
    elif rank == last:
        assert comm.recv() == everyone[0]  # src=None: from whichever rank sends
    return comm.all_gather(rank)


def test_sub_group(ranks4):
    assert ranks4.run(ops_on_subgroup) == [[]] + [[1, 2, 3]] * 3


class Record:
    """A user class; attributes added after construction must survive."""

    def __init__(self, name):
        self.name = name

    def __eq__(self, other):
        return type(other) is Record and vars(self) == vars(other)


def mixed_objects(rank: int) -> list:
    """Like torch's own object-collective tests: nested dicts, a user class holding a tensor, strings, lists."""
    rec = Record(f"r{rank}")
    rec.extra = {"tensor": torch.arange(4) + rank}
    return [{"key1": 3, "key2": {"inner": [1, 2, (rank, "t")]}}, rec, f"foo{rank}", [1, 2, [3, [rank]]]]


def _equal(a, b) -> bool:
    if isinstance(a, Record):
        return type(b) is Record and a.name == b.name and torch.equal(a.extra["tensor"], b.extra["tensor"])
    return a == b


def gather_mixed_objects(serializer: str) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    got = objcomm.all_gather(mixed_objects(rank), serializer=serializer)
    for r in range(world):
        assert all(_equal(x, y) for x, y in zip(got[r], mixed_objects(r))), (r, got[r])
    # each rank sends the element at its rank index, as torch's tests do
    mine = mixed_objects(rank)[rank % 4]
    got = objcomm.all_gather(mine, serializer=serializer)
    assert all(_equal(got[r], mixed_objects(r)[r % 4]) for r in range(world))
    return True


@pytest.mark.parametrize("serializer", ["pickle", "cloudpickle"])
def test_mixed_objects_like_torch_tests(ranks, serializer):
    assert all(ranks.run(gather_mixed_objects, serializer))


def ranks_disagree_on_serializer() -> list:
    rank = dist.get_rank()
    mine = ["pickle", "msgpack", "json", "cloudpickle"][rank % 4]
    return objcomm.all_gather({"from": rank, "via": mine}, serializer=mine)


def test_ranks_may_use_different_serializers(ranks4):
    expected = [{"from": r, "via": s} for r, s in enumerate(["pickle", "msgpack", "json", "cloudpickle"])]
    assert ranks4.run(ranks_disagree_on_serializer) == [expected] * 4


def test_without_process_group_every_call_is_a_single_rank():
    assert not dist.is_initialized()
    assert objcomm.all_gather({"a": 1}) == [{"a": 1}]
    assert objcomm.gather(1, dst=0) == [1]
    assert objcomm.broadcast("x") == "x"
    assert objcomm.scatter(["only"]) == "only"
    with pytest.raises(objcomm.EncodeError, match="json cannot encode set"):
        objcomm.all_gather({1}, serializer="json")
    with pytest.raises(ValueError, match="no process group"):
        objcomm.broadcast("x", src=1)
    with pytest.raises(objcomm.ObjcommError, match="init_process_group"):
        objcomm.send("x", dst=1)


def bad_arguments() -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    messages = []
    for call in (
        lambda: objcomm.broadcast(1, src=world),
        lambda: objcomm.gather(1, dst=-1),
        lambda: objcomm.scatter([1] * (world + 1) if rank == 0 else None),
        lambda: objcomm.all_gather(1, serializer="yaml"),
    ):
        try:
            call()
        except (objcomm.ObjcommError, ValueError, TypeError) as exc:
            messages.append(type(exc).__name__)
    # the group still works afterwards
    assert objcomm.all_gather(rank) == list(range(world))
    return messages


def test_bad_arguments_fail_on_every_rank_and_leave_the_group_usable(ranks3):
    results = ranks3.run(bad_arguments)
    assert results[0] == ["ValueError", "ValueError", "RemoteError", "UnknownSerializerError"]
    assert results[1] == results[2] == results[0]


def copies_of_a_used_communicator() -> list:
    """A communicator that has worked (settings kept, the same-host express path built), then copied: shallow,
    deep (as ``copy.deepcopy`` of a model holding one), inside a module, and through pickle."""
    import copy
    import pickle

    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    comm = objcomm.Communicator(serializer="msgpack", accept=["msgpack"], local=True)
    comm.all_gather(None)
    comm.all_gather(None)
    comm.send(rank, peer) if rank == 0 else comm.recv(peer)  # builds what a default send/recv uses
    assert comm._held is not None
    model = torch.nn.Linear(2, 2)
    model.comm = comm  # type: ignore[assignment]
    sub = dist.new_group([0, 1])
    on_sub = objcomm.Communicator(sub, serializer="msgpack")
    copies = [
        copy.copy(comm),
        copy.deepcopy(comm),
        copy.deepcopy(model).comm,
        pickle.loads(pickle.dumps(comm)),
        copy.deepcopy(on_sub),
    ]
    got = []
    for twin in copies:
        got.append(
            (
                twin.serializer,
                twin._held is None,
                twin._given == comm._given or twin.group is sub,
                twin.all_gather({"from": rank}),
                twin.broadcast("b" if rank == 0 else None),
            )
        )
        if rank == 0:
            twin.send([rank], peer)
        else:
            got.append(twin.recv(peer))
    got.append(copies[4].group is sub and copies[1]._given is comm._given)  # a handle: group and settings shared
    try:
        pickle.dumps(on_sub)
    except TypeError as exc:
        got.append("cannot be pickled" in str(exc))
    assert comm.all_gather(rank) == [0, 1]  # the original works on
    dist.destroy_process_group(sub)
    return got


def test_a_used_communicator_copies_deep_copies_and_pickles():
    sender, receiver = get_pool(2).run(copies_of_a_used_communicator)
    row = ("msgpack", True, True, [{"from": 0}, {"from": 1}], "b")
    assert sender == [row] * 5 + [True, True]
    assert receiver == [row, [0]] * 5 + [True, True]
