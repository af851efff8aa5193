"""Messages a rank sends itself (issue 28, item 4): delivered locally, in order per tag, as copies, under the same
serializer, ``accept=`` and ``max_bytes`` rules as messages from peers; without a process group, in a group of
one, and next to peer messages on real gloo groups.

The patterns are mpi4py's (its ``test_p2p_obj.py``): ``isend`` to oneself then ``recv``; ``irecv`` from oneself then
``send``; a ring ``isend(x, (rank + 1) % size)`` / ``recv((rank - 1) % size)``, which at size 1 is all self-messages.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
from _ranks import get_pool

import objcomm

pytestmark = pytest.mark.timeout(120)

_BASIC: List[Any] = [None, True, False, -7, 0, 7, -(2**63) + 1, 2**63 - 1, -2.17, 0.0, 3.14, 1 + 2j, "mpi4py"]
MESSAGES: List[Any] = [
    *_BASIC,
    list(_BASIC),
    tuple(_BASIC),
    set(_BASIC),
    frozenset(_BASIC),
    {f"k{k}": v for k, v in enumerate(_BASIC)},
]
OOB = 20_000  # float32 elements: 80 KB, above inline_tensor_bytes: the tensor travels out of band
PATHS = ["channel", "backend"]


def _rank_and_size(group: Any = None) -> tuple:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group: Any, group_rank: int) -> int:
    return group_rank if group is None or not dist.is_initialized() else dist.get_global_rank(group, group_rank)


# -- scenarios, run without a process group (here) and in groups of one (in ranks) -----------------------------------
def ring(group: Any = None, tag: int = 0) -> List[bool]:
    """mpi4py's ring, in its three shapes: isend then recv, irecv then send, send then recv."""
    rank, size = _rank_and_size(group)
    me = _global(group, rank)
    dst, src = _global(group, (rank + 1) % size), _global(group, (rank - 1) % size)
    checks = []
    for smess in MESSAGES:
        request = objcomm.isend(smess, dst, tag, group=group)
        rmess = objcomm.recv(src, tag, group=group)
        checks.append(request.wait(timeout=30) is None and rmess == smess)
    for smess in MESSAGES:
        request = objcomm.irecv(src, tag, group=group)
        objcomm.send(smess, dst, tag, group=group)
        checks.append(request.wait(timeout=30) == smess)
    if size == 1:
        for smess in MESSAGES:
            objcomm.send(smess, me, tag, group=group)
            checks.append(objcomm.recv(me, tag, group=group) == smess)
            objcomm.send(smess, me, tag, group=group)
            checks.append(objcomm.recv(None, tag, group=group, return_sender=True) == (me, smess))
    return checks


def posted_per_tag(group: Any = None) -> List[Any]:
    """mpi4py's three irecv from oneself under tags 1, 2, 3: a send under tag i completes exactly the i-th."""
    rank, _ = _rank_and_size(group)
    me = _global(group, rank)
    states = []
    requests = [objcomm.irecv(me, tag, group=group) for tag in (11, 12, 13)]
    states.append([r.is_completed() for r in requests])
    for i, tag in enumerate((12, 11, 13)):
        objcomm.send({"tag": tag, "i": i}, me, tag, group=group)
        states.append([r.is_completed() for r in requests])
    states.append([r.wait(timeout=5) for r in requests])
    return states


def ordered_per_tag(group: Any = None) -> List[Any]:
    """Self-messages under two tags, interleaved when sent, each tag read in its own order."""
    rank, _ = _rank_and_size(group)
    me = _global(group, rank)
    for i in range(5):
        for tag in (21, 22):
            (objcomm.isend if i % 2 else objcomm.send)((tag, i), me, tag, group=group)
    second = [objcomm.recv(me, 22, group=group) for _ in range(5)]
    first = [objcomm.irecv(me, 21, group=group).wait(timeout=5) for _ in range(5)]
    return [first, second]


def copies(group: Any = None) -> List[bool]:
    """A self-send is a copy made at the send: changing the object afterwards, its tensors included (inline and out
    of band), changes nothing received."""
    rank, _ = _rank_and_size(group)
    me = _global(group, rank)
    obj = {"list": [1, 2], "small": torch.zeros(4), "big": torch.zeros(OOB), "bytes": bytearray(b"abc")}
    objcomm.send(obj, me, 31, group=group)
    request = objcomm.isend(obj, me, 31, group=group)
    obj["list"].append(3)
    obj["small"].fill_(7)
    obj["big"].fill_(7)
    obj["bytes"][0] = ord("z")
    request.wait(timeout=5)
    checks = []
    for _ in range(2):
        got = objcomm.recv(me, 31, group=group)
        checks += [
            got is not obj,
            got["list"] == [1, 2],
            torch.equal(got["small"], torch.zeros(4)),
            torch.equal(got["big"], torch.zeros(OOB)),
            got["bytes"] == bytearray(b"abc"),
            got["big"].data_ptr() != obj["big"].data_ptr(),
        ]
    return checks


def _raises(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__
    return "no error"


def refusals(group: Any = None) -> Dict[str, Any]:
    """accept= and max_bytes judge a self-message on receipt, as a peer's; a sender's failure reaches the receiver
    as an error report; a refused message is dropped, as a peer's is."""
    rank, _ = _rank_and_size(group)
    me = _global(group, rank)
    found: Dict[str, Any] = {}
    objcomm.send({"x": 1}, me, 41, group=group, serializer="pickle")
    found["accept"] = _raises(lambda: objcomm.recv(me, 41, group=group, accept=["msgpack"]))
    found["accept dropped it"] = _raises(lambda: objcomm.recv(me, 41, group=group))
    objcomm.send({"x": 1}, me, 41, group=group, serializer="msgpack")
    found["accept msgpack"] = objcomm.recv(me, 41, group=group, accept=["msgpack"])
    request = objcomm.irecv(me, 41, group=group, accept=["json"])
    objcomm.send({1, 2}, me, 41, group=group, serializer="pickle")
    found["irecv accept"] = _raises(lambda: request.wait(timeout=5))

    objcomm.send(b"x" * 100_000, me, 42, group=group)  # out of band: past any slot
    found["max_bytes"] = _raises(lambda: objcomm.recv(me, 42, group=group, max_bytes=10_000))
    objcomm.send(b"x" * 100, me, 42, group=group)  # fits the slot: accepted whatever max_bytes, as from a peer
    found["small under max_bytes"] = objcomm.recv(me, 42, group=group, max_bytes=10) == b"x" * 100
    found["sender max_bytes"] = _raises(lambda: objcomm.send(b"x" * 1000, me, 42, group=group, max_bytes=100))
    found["its receiver"] = _raises(lambda: objcomm.recv(me, 42, group=group))

    found["encode"] = _raises(lambda: objcomm.send(lambda: 1, me, 43, group=group))
    found["encode receiver"] = _raises(lambda: objcomm.recv(me, 43, group=group))
    request = objcomm.isend({1, 2}, me, 43, group=group, serializer="json")
    found["isend encode"] = _raises(lambda: request.wait(timeout=5))
    found["isend encode receiver"] = _raises(lambda: objcomm.recv(me, 43, group=group))
    return found


REFUSALS = {
    "accept": "ContentRefusedError",
    "accept dropped it": "ObjcommError",
    "accept msgpack": {"x": 1},
    "irecv accept": "ContentRefusedError",
    "max_bytes": "TooLargeError",
    "small under max_bytes": True,
    "sender max_bytes": "TooLargeError",
    "its receiver": "RemoteError",
    "encode": "EncodeError",
    "encode receiver": "RemoteError",
    "isend encode": "EncodeError",
    "isend encode receiver": "RemoteError",
}


def nothing_queued(group: Any = None) -> List[Any]:
    """A blocking recv from oneself with nothing sent raises at once (mpi4py would wait forever), and leaves
    nothing behind: a send and a receive afterwards work."""
    rank, _ = _rank_and_size(group)
    me = _global(group, rank)
    start = time.monotonic()
    try:
        objcomm.recv(me, 51, group=group)
        outcome = "no error"
    except objcomm.ObjcommError as exc:
        outcome = str(exc)
    took = time.monotonic() - start
    objcomm.send("later", me, 51, group=group)
    return [outcome, took < 1, objcomm.recv(me, 51, group=group)]


# -- without a process group: a world of one ----------------------------------------------------------------------
def test_ring_without_a_process_group():
    assert not dist.is_initialized()
    assert ring() == [True] * (4 * len(MESSAGES))
    assert ring(tag=9) == [True] * (4 * len(MESSAGES))


def test_irecv_from_oneself_completes_with_the_send_under_its_tag():
    assert posted_per_tag() == [
        [False, False, False],
        [False, True, False],
        [True, True, False],
        [True, True, True],
        [{"tag": 11, "i": 1}, {"tag": 12, "i": 0}, {"tag": 13, "i": 2}],
    ]


def test_order_per_tag():
    assert ordered_per_tag() == [[(21, i) for i in range(5)], [(22, i) for i in range(5)]]


def test_a_self_send_is_a_copy():
    assert all(copies())


def test_refusals_are_those_of_a_peer_message():
    assert refusals() == REFUSALS


def test_recv_from_oneself_with_nothing_sent_raises_at_once():
    message, quick, later = nothing_queued()
    assert quick and later == "later"
    assert "recv(src=0, tag=51)" in message and "nothing" in message and "irecv" in message, message


def test_without_a_process_group_only_rank_0_exists():
    with pytest.raises(objcomm.ObjcommError, match="init_process_group"):
        objcomm.send("x", dst=1)
    with pytest.raises(objcomm.ObjcommError, match="init_process_group"):
        objcomm.recv(src=1)
    with pytest.raises(objcomm.ObjcommError, match="init_process_group"):
        objcomm.irecv(src=1)
    with pytest.raises(ValueError, match="tag must be"):
        objcomm.send("x", dst=0, tag=-1)
    with pytest.raises(TypeError, match="dst must be an int rank"):
        objcomm.send("x", dst="0")


def test_a_communicator_without_a_process_group():
    comm = objcomm.Communicator(serializer="msgpack", accept=["msgpack"])
    comm.send({"a": [1]}, 0, tag=61)
    assert comm.recv(0, tag=61, return_sender=True) == (0, {"a": [1]})
    objcomm.send({"a": 1}, 0, tag=61, serializer="pickle")
    with pytest.raises(objcomm.ContentRefusedError):
        comm.recv(tag=61)


# -- groups of one: a world of one, and a one-rank subgroup of a larger world ------------------------------------------
def in_a_group_of_one(path: str) -> Dict[str, Any]:
    previous = objcomm.configure(local=path == "channel")
    try:
        world = dist.get_world_size()
        groups = [dist.new_group([r]) for r in range(world)]  # every rank makes every group, in the same order
        found = {}
        for name, group in (("world", None), ("own", groups[dist.get_rank()])):
            if name == "world" and world != 1:
                continue
            objcomm.all_gather(None, group=group)  # opens the same-host channel, where there is one
            found[name] = [
                all(ring(group)),
                posted_per_tag(group)[-1],
                ordered_per_tag(group),
                all(copies(group)),
                refusals(group),
                nothing_queued(group)[1:],
            ]
        return found
    finally:
        objcomm.restore(previous)


@pytest.mark.parametrize("world", [1, 2], ids=["world1", "subgroup_of_one"])
@pytest.mark.parametrize("path", PATHS)
def test_groups_of_one(world, path):
    expected = [
        True,
        [{"tag": 11, "i": 1}, {"tag": 12, "i": 0}, {"tag": 13, "i": 2}],
        [[(21, i) for i in range(5)], [(22, i) for i in range(5)]],
        True,
        REFUSALS,
        [True, "later"],
    ]
    for found in get_pool(world).run(in_a_group_of_one, path):
        assert found["own"] == expected
        if world == 1:
            assert found["world"] == expected


# -- next to peer messages ---------------------------------------------------------------------------------------------
def mixed_with_peers(path: str) -> Dict[str, Any]:
    """Each rank sends itself and its peer three messages under each of three tags, interleaved, then reads each
    (source, tag) stream, each in order; then under one tag from any rank, where per-sender order holds."""
    previous = objcomm.configure(local=path == "channel")
    try:
        rank = dist.get_rank()
        peer = 1 - rank
        objcomm.all_gather(None)  # opens the same-host channel (local on), so send/recv take it
        for i in range(3):
            for tag in (1, 2, 3):
                objcomm.send({"from": rank, "i": i, "tag": tag}, rank, tag)
                objcomm.send({"from": rank, "i": i, "tag": tag}, peer, tag)
        streams = {}
        for tag in (3, 1, 2):
            for src in (rank, peer):
                streams[f"{src}/{tag}"] = [
                    (m["from"], m["i"], m["tag"]) for m in (objcomm.recv(src, tag) for _ in range(3))
                ]
        for i in range(3):
            objcomm.isend(("self", i), rank, 4).wait(timeout=30)
            objcomm.send(("peer", i), peer, 4)
        anyone: Dict[int, List[Any]] = {0: [], 1: []}
        for _ in range(6):
            sender, obj = objcomm.recv(None, 4, return_sender=True)
            anyone[sender].append(obj)
        objcomm.send("queued", rank, 5)  # an irecv from any rank sees a self-message queued before it
        any_source = objcomm.irecv(None, 5, return_sender=True).wait(timeout=30)
        objcomm.all_gather(None)
        return {"streams": streams, "any": anyone, "any_source irecv": any_source}
    finally:
        objcomm.restore(previous)


@pytest.mark.parametrize("path", PATHS)
def test_self_messages_mixed_with_peer_messages(path):
    results = get_pool(2).run(mixed_with_peers, path)
    for rank, found in enumerate(results):
        peer = 1 - rank
        for tag in (1, 2, 3):
            assert found["streams"][f"{rank}/{tag}"] == [(rank, i, tag) for i in range(3)]
            assert found["streams"][f"{peer}/{tag}"] == [(peer, i, tag) for i in range(3)]
        assert found["any"] == {rank: [("self", i) for i in range(3)], peer: [("peer", i) for i in range(3)]}
        assert found["any_source irecv"] == (rank, "queued")


def refusals_next_to_a_peer(path: str) -> Dict[str, Any]:
    """The same refusals for a self-message and a peer's, on one group; and the receive rules of non-blocking calls
    hold for receives from oneself."""
    previous = objcomm.configure(local=path == "channel")
    try:
        rank = dist.get_rank()
        peer = 1 - rank
        objcomm.all_gather(None)
        found: Dict[str, Any] = {}
        for who in (rank, peer):
            objcomm.send({"x": 1}, who, 6, serializer="pickle")
        found["self accept"] = _raises(lambda: objcomm.recv(rank, 6, accept=["msgpack"]))
        found["peer accept"] = _raises(lambda: objcomm.recv(peer, 6, accept=["msgpack"]))
        objcomm.all_gather(None)
        objcomm.send(b"y" * 100_000, rank, 7)
        sent = objcomm.isend(b"y" * 100_000, peer, 7)  # past the slot: a blocking send could wait for its receiver
        found["self max_bytes"] = _raises(lambda: objcomm.recv(rank, 7, max_bytes=10_000))
        found["peer max_bytes"] = _raises(lambda: objcomm.recv(peer, 7, max_bytes=10_000))
        _raises(lambda: sent.wait(timeout=30))  # the sender learns of the refusal on some paths only
        objcomm.all_gather(None)
        pending = objcomm.irecv(rank, 8)
        found["recv(None) next to irecv(self)"] = _raises(lambda: objcomm.recv(None, 8))
        found["irecv(None) next to irecv(self)"] = _raises(lambda: objcomm.irecv(None, 8))
        found["recv(self) next to irecv(self)"] = _raises(lambda: objcomm.recv(rank, 8))
        objcomm.send("done", rank, 8)
        found["irecv(self)"] = pending.wait(timeout=30)
        found["free again"] = objcomm.send("again", rank, 8) or objcomm.recv(None, 8)
        objcomm.all_gather(None)
        return found
    finally:
        objcomm.restore(previous)


@pytest.mark.parametrize("path", PATHS)
def test_refusals_match_those_of_peer_messages(path):
    for found in get_pool(2).run(refusals_next_to_a_peer, path):
        assert found == {
            "self accept": "ContentRefusedError",
            "peer accept": "ContentRefusedError",
            "self max_bytes": "TooLargeError",
            "peer max_bytes": "TooLargeError",
            "recv(None) next to irecv(self)": "ObjcommError",
            "irecv(None) next to irecv(self)": "ObjcommError",
            "recv(self) next to irecv(self)": "ObjcommError",
            "irecv(self)": "done",
            "free again": "again",
        }


def from_another_thread(_: Optional[int] = None) -> Any:
    """irecv from oneself is how to wait for another thread's send to this rank."""
    import threading

    rank = dist.get_rank() if dist.is_initialized() else 0
    request = objcomm.irecv(rank, 71)
    thread = threading.Thread(target=lambda: (time.sleep(0.2), objcomm.send("from a thread", rank, 71)))
    thread.start()
    got = request.wait(timeout=30)
    thread.join(30)
    return got


def test_irecv_from_oneself_waits_for_another_threads_send():
    assert from_another_thread() == "from a thread"
    assert get_pool(2).run(from_another_thread) == ["from a thread"] * 2


def any_source_then_oneself(path: str) -> Dict[str, Any]:
    """MPI's exchange: every rank posts an irecv from any rank for each rank, then isends to each, itself last, once
    its irecvs took its peers' messages and the last one waits on the wire; and a blocking recv from any rank that
    another thread's send to this rank ends. A port's find: through the same-host channel the last irecv waited
    until the timeout, the message to oneself left for a next receive."""
    import threading

    previous = objcomm.configure(local=path == "channel")
    try:
        rank, size = dist.get_rank(), dist.get_world_size()
        objcomm.all_gather(None)
        objcomm.connect()
        posted = [objcomm.irecv(None, 81, return_sender=True) for _ in range(size)]
        sent = [objcomm.isend((rank, peer), peer, 81) for peer in range(size) if peer != rank]
        from_peers = sorted(request.wait(timeout=30) for request in posted[:-1])
        time.sleep(0.3)  # the last irecv waits for the other ranks now
        sent.append(objcomm.isend((rank, rank), rank, 81))
        last = posted[-1].wait(timeout=30)
        for request in sent:
            request.wait(timeout=30)
        thread = threading.Thread(target=lambda: (time.sleep(0.3), objcomm.send("from a thread", rank, 82)))
        thread.start()
        blocking = objcomm.recv(None, 82, return_sender=True)  # nothing from the others under tag 82
        thread.join(30)
        objcomm.all_gather(None)
        return {"from peers": from_peers, "last": last, "blocking": blocking}
    finally:
        objcomm.restore(previous)


@pytest.mark.parametrize("world", [2, 3])
def test_a_receive_from_any_rank_already_waiting_takes_a_later_message_to_oneself(world):
    """Where the same-host channel carries send/recv. Through the backend (gloo's receive from any rank) nothing wakes
    such a wait (objcomm._transport.any_source): not run there."""
    for rank, found in enumerate(get_pool(world).run(any_source_then_oneself, "channel")):
        assert found["from peers"] == [(peer, (peer, rank)) for peer in range(world) if peer != rank]
        assert found["last"] == (rank, (rank, rank))
        assert found["blocking"] == (rank, "from a thread")


def irecv_from_oneself_behind_a_waiting_receive(path: str) -> List[Any]:
    """Another thread's recv(src=None) waits; an irecv from oneself under its tag then raises (MPI gives the next
    message to oneself to the receive posted first, which a reviewer found the irecv took), and the send that
    follows goes to the waiting receive."""
    import threading

    previous = objcomm.configure(local=path == "channel")
    try:
        rank = dist.get_rank()
        objcomm.all_gather(None)
        objcomm.connect()
        got: List[Any] = []
        waiting = threading.Thread(target=lambda: got.append(objcomm.recv(None, 91, return_sender=True)))
        waiting.start()
        time.sleep(0.3)
        try:
            objcomm.irecv(rank, 91)
            said = "posted"
        except objcomm.ObjcommError as exc:
            said = str(exc)
        objcomm.send("to oneself", rank, 91)
        waiting.join(30)
        objcomm.all_gather(None)
        return ["recv(src=None, tag=91) of another thread waits" in said, got]
    finally:
        objcomm.restore(previous)


def test_an_irecv_from_oneself_behind_another_threads_waiting_receive_from_any_rank_raises():
    for rank, found in enumerate(get_pool(2).run(irecv_from_oneself_behind_a_waiting_receive, "channel")):
        assert found == [True, [(rank, "to oneself")]]
