"""sendrecv on a real gloo group of 3 ranks: a ring's shift, a pair's exchange, from any rank and to oneself, both
ways it runs (at once, as on gloo; one after the other in the order that cannot deadlock, as through NCCL), and a
failure on one rank raised where it belongs with the group still in step."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List

import pytest
import torch.distributed as dist
from _ranks import get_pool

import objcomm
from objcomm._api import requests as _requests

pytestmark = pytest.mark.timeout(180)
W = 3


@contextlib.contextmanager
def nccl_order(on: bool) -> Iterator[None]:
    """sendrecv as through an NCCL group (``on``): its send and its receive one after the other, blocking."""
    real = _requests.on_nccl
    if on:
        _requests.on_nccl = lambda group: True  # type: ignore[assignment]
    try:
        yield
    finally:
        _requests.on_nccl = real  # type: ignore[assignment]


def _payload(rank: int, size: int) -> Dict[str, Any]:
    return {"rank": rank, "data": bytes([rank]) * size}


def exchanges(local: bool, size: int, ordered: bool) -> List[Any]:
    """What this rank got in each exchange (True where it is what it should be)."""
    rank = dist.get_rank()
    left, right = (rank - 1) % W, (rank + 1) % W
    comm = objcomm.Communicator(local=local, shm=False)
    with nccl_order(ordered):
        shifted = comm.sendrecv(_payload(rank, size), dst=right, src=left, return_sender=True)
        # the ring the other way, under tag 6 (both tags named)
        back = objcomm.sendrecv(_payload(rank, size), dst=left, src=right, sendtag=6, recvtag=6)
        # (NCCL: its source named)
        anyone = objcomm.sendrecv(rank, right, src=left if ordered else None, sendtag=8, return_sender=True)
        mine = comm.sendrecv([rank], dst=rank, src=rank, sendtag=9)
        pair = comm.sendrecv(rank * 10, dst=rank ^ 1, src=rank ^ 1) if rank < 2 else rank ^ 1
    return [
        shifted == (left, _payload(left, size)),
        back == _payload(right, size),
        anyone == (left, left),
        mine == [rank],
        pair == (rank ^ 1) * 10 if rank < 2 else True,
    ]


@pytest.mark.parametrize("ordered", [False, True], ids=["at once", "one after the other"])
@pytest.mark.parametrize("local, size", [(True, 100), (False, 100), (False, 3 << 20)])
def test_every_rank_gets_what_its_source_sent(local, size, ordered):
    """3 MiB through the backend: each send waits for its receiver's answer, so a ring whose ranks all sent first,
    blocking, would wait forever; at once and in that order it completes."""
    for rank, got in enumerate(get_pool(W).run(exchanges, local, size, ordered)):
        assert got == [True] * 5, (rank, got)


def a_failing_sender(ordered: bool) -> List[Any]:
    """Rank 1 sends what pickle cannot encode along the ring: (what each rank raised or got, then an all_gather)."""
    rank = dist.get_rank()
    obj = (lambda: 0) if rank == 1 else rank
    with nccl_order(ordered):
        try:
            outcome: Any = objcomm.sendrecv(obj, dst=(rank + 1) % W, src=(rank - 1) % W)
        except objcomm.ObjcommError as exc:
            outcome = type(exc).__name__
    return [outcome, objcomm.all_gather(rank)]


@pytest.mark.parametrize("ordered", [False, True], ids=["at once", "one after the other"])
def test_a_failure_raises_on_its_sender_and_its_receiver_only(ordered):
    """Rank 1's object cannot be encoded: rank 2, its receiver, raises RemoteError; rank 1 raises the encoding error
    once it has received; rank 0 gets rank 2's object; and the group's next call runs on every rank."""
    got = get_pool(W).run(a_failing_sender, ordered)
    assert [g[0] for g in got] == [2, "EncodeError", "RemoteError"]
    assert [g[1] for g in got] == [[0, 1, 2]] * W


def test_without_a_process_group_a_rank_sends_to_itself():
    assert objcomm.sendrecv({"x": 1}, dst=0, src=0) == {"x": 1}
    assert objcomm.Communicator().sendrecv([1], 0, src=0, sendtag=3, return_sender=True) == (0, [1])


def misuses() -> List[Any]:
    """Through NCCL's order, ``src=None`` raises before either half (a send made first would wait in vain); on gloo a
    send that fails at once (rank 1's bad ``dst``) still takes what its source sends it (3 MiB: rank 0's send waits
    for rank 1's answer, which it would have waited for until the group's timeout)."""
    rank = dist.get_rank()
    found: List[Any] = []
    with nccl_order(True):
        try:
            objcomm.sendrecv(rank, dst=(rank + 1) % W, src=None)
        except ValueError as exc:
            found.append("src=None" in str(exc) and "NCCL" in str(exc))
    big = bytes([rank]) * (3 << 20)
    try:
        if rank == 0:
            found.append(objcomm.sendrecv(big, dst=1, src=2) == bytes([2]) * (3 << 20))
        elif rank == 1:
            objcomm.sendrecv(big, dst=99, src=0)
        else:
            objcomm.send(big, dst=0)
            found.append(True)
    except ValueError as exc:
        found.append("ValueError" if "99" in str(exc) else str(exc))
    found.append(objcomm.all_gather(rank))
    return found


def test_misuse_raises_where_it_is_and_leaves_no_peer_waiting():
    got = get_pool(W).run(misuses)
    assert got[0] == [True, True, [0, 1, 2]]
    assert got[1] == [True, "ValueError", [0, 1, 2]]
    assert got[2] == [True, True, [0, 1, 2]]


def behind_outstanding_sends(local: bool) -> List[Any]:
    """A reviewer's finds. Each rank's isend of 1 MiB to the right, then a sendrecv to the right under the same tag
    (its receive takes the 1 MiB), then the isend waited for and the small message received; then rank 0 leaves
    1024 small sends to rank 2 pending (under another tag) before a ring of sendrecvs whose rank 2 sends 1 MiB: a
    sendrecv that sent in the caller's thread waited for its own isend, or for room among the pending sends, where its
    receive had to run first."""
    rank = dist.get_rank()
    comm = objcomm.Communicator(local=local, shm=False)
    right, left = (rank + 1) % W, (rank - 1) % W
    pending = comm.isend(b"x" * (1 << 20), dst=right, tag=0)
    first = comm.sendrecv({"small": rank}, dst=right, src=left, sendtag=0)
    pending.wait()
    then = comm.recv(src=left, tag=0)
    if rank == 0:
        for i in range(1024):
            comm.send(i, dst=2, tag=9)
    ring = comm.sendrecv(b"y" * (1 << 20) if rank == 2 else {"small": rank}, dst=right, src=left, sendtag=1)
    held = [comm.recv(src=0, tag=9) for _ in range(1024)] if rank == 2 else list(range(1024))
    return [
        first == b"x" * (1 << 20),
        then == {"small": left},
        ring == (b"y" * (1 << 20) if rank == 0 else {"small": left}),
        held == list(range(1024)),
    ]


@pytest.mark.parametrize("local", [True, False])
def test_a_sendrecv_behind_this_ranks_own_sends_still_receives_first(local):
    for rank, got in enumerate(get_pool(W).run(behind_outstanding_sends, local)):
        assert got == [True] * 4, (rank, got)


def test_src_and_tags_are_keywords_only_as_mpi4pys_third_parameter_is_sendtag():
    """``comm.sendrecv(tok, right, STEP)`` ported as it was took the tag for a source rank (a porting review's find)."""
    for call in (objcomm.sendrecv, objcomm.Communicator().sendrecv):
        with pytest.raises(TypeError, match="positional"):
            call([1], 0, 5)
    assert objcomm.sendrecv([1], 0, src=0, sendtag=5) == [1]  # a world of one: its own message


def tags_each_its_own() -> List[Any]:
    """A port's find: mpi4py's recvtag defaults to any tag, objcomm's to sendtag, so ranks that each send under their
    own tag and give no recvtag wait until the timeout; the error then says why. Through the same-host channel of a
    pair with a 2 s timeout, which stays open: each rank then takes the message it left."""
    import datetime

    rank = dist.get_rank()
    pair = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    if rank > 1:
        return []
    comm = objcomm.Communicator(pair)
    comm.all_gather(None)
    comm.connect()
    peer = 1 - rank
    try:
        comm.sendrecv(("from", rank), dst=peer, src=peer, sendtag=100 + rank)
        said = "returned"
    except objcomm.CommunicationError as exc:
        said = str(exc)
    left = comm.recv(src=peer, tag=100 + peer)  # what the peer sent, under its own tag
    comm.all_gather(None)
    return [(f"recvtag={100 + rank}, which defaults to sendtag" in said, said), left]


def test_a_sendrecv_that_times_out_under_its_sendtag_says_recvtag_defaults_to_it():
    results = get_pool(W).run(tags_each_its_own)
    for rank in (0, 1):
        assert results[rank][0][0] is True, results[rank][0][1]
        assert results[rank][1] == ("from", 1 - rank)
    assert results[2] == []
