"""Lying ranks on two levels (objcomm._samehost.two_level) cannot send one host's ranks into a different number of the
group's collectives than another's (they met the other hosts' next call: wrong data, silently): the votes of an
operation whose second round moves through the whole group's backend (scatter, all_to_all) are the whole group's,
never relayed by a leader. And a broadcast past the scratch size votes first, since a leader relays all of it for its
host. A relay that lies in the reduce tree on two levels (up or down a host's channel, or the leaders' tree) misleads
its own subtree only, which raises, and nobody is left with wrong data in a later call."""

from __future__ import annotations

import struct
import time
from datetime import timedelta
from typing import Any, List, Optional, Set

import pytest
import torch
import torch.distributed as dist
from _hostile import a_relay_that_lies, all_reduce_under, result_or_error
from _ranks import get_pool
from test_many_ranks import ranks_per_host

import objcomm
from objcomm import _state
from objcomm._api.resolving import Hooks
from objcomm._format import frame as _frame
from objcomm._format.slot import fill_slot
from objcomm._samehost import mesh as _mesh
from objcomm._samehost import two_level as _two_level
from objcomm._samehost import two_level_moves as _moves
from objcomm._samehost import two_level_rests as _rests
from objcomm._samehost.channel_rests import chunks
from serializers import registry

pytestmark = pytest.mark.timeout(180)

W, LEADER = 8, 4  # the pool of tests/transport/test_many_ranks.py; hosts of 4: ranks 4-7 and their leader, 4
CHUNK = 1 << 16
STREAM = 2 * CHUNK + 4096  # an all_to_all's stream per pair: 3 rounds of chunk_bytes


def _lying(real: Any) -> Any:
    """Leader 4's vote in two levels, as it tells its host: the longest stream one round short, a refusal dropped."""

    def largest(here: Any, values: Any, op: str) -> List[int]:
        packing = struct.Struct(f"<{len(values)}q")
        rows = _moves.to_leader(here, packing.pack(*values), op)
        voted = _moves.as_leader(
            here, op, _moves.largest_of, here.leader, [max(c) for c in zip(*map(packing.unpack, rows))], op
        )
        told = [0, *voted[1:]]  # no refusal
        if len(told) == 2 and told[1] > 2 * CHUNK:
            told[1] = 2 * CHUNK
        here.channel.broadcast(packing.pack(*told), 0, here.spin)
        _moves.echo(here.channel, packing.pack(*told), here.spin, op, "votes")
        return list(voted)

    return largest


def lying_leader() -> List[Any]:
    """all_to_all of STREAM bytes a pair, a scatter that rank 1 refuses, then an all_to_all of small ints: what each
    rank got (right, or the error's type)."""
    rank = dist.get_rank()
    seen: List[Any] = []
    with ranks_per_host(4):
        comm = objcomm.Communicator(chunk_bytes=CHUNK)
        comm.all_gather(rank)  # the set-up: hosts, node and leaders' groups, channels
        real = _two_level.largest_in_levels
        if rank == LEADER:
            _two_level.largest_in_levels = _lying(real)  # type: ignore[assignment]
        try:
            outs = [torch.full((STREAM,), (rank * 16 + j) % 256, dtype=torch.uint8) for j in range(W)]
            got = comm.all_to_all(outs)
            seen.append(
                all(
                    torch.equal(t, torch.full((STREAM,), (r * 16 + rank) % 256, dtype=torch.uint8))
                    for r, t in enumerate(got)
                )
            )
            try:
                parts = [b"p" * 200_000] * W if rank == 0 else None
                seen.append(len(comm.scatter(parts, src=0, max_bytes=1000 if rank == 1 else None)))
            except objcomm.TooLargeError:
                seen.append("TooLargeError")
        finally:
            _two_level.largest_in_levels = real  # type: ignore[assignment]
        seen.append(comm.all_to_all([10 * rank + j for j in range(W)]) == [10 * r + rank for r in range(W)])
    return seen


def test_a_lying_leader_cannot_split_the_votes_of_a_flat_second_round():
    assert get_pool(W).run(lying_leader, timeout=120) == [[True, "TooLargeError", True]] * W


def refused_broadcast() -> Any:
    """Rank 5 broadcasts 40 tensors of 1 MiB (each piece within the scratch size, their sizes in its slot); ranks 0,
    4 and 6, two of them leaders, accept at most 1 MiB. A leader relays the whole rest for its host: on two levels the
    receivers vote first, so that nobody holds it and every rank raises alike."""
    rank = dist.get_rank()
    with ranks_per_host(4):
        comm = objcomm.Communicator(inline_tensor_bytes=0)
        comm.all_gather(rank)
        tensors = [torch.full((1 << 18,), float(i)) for i in range(40)] if rank == 5 else None
        try:
            return len(comm.broadcast(tensors, src=5, max_bytes=(1 << 20) if rank in (0, 4, 6) else None))
        except objcomm.TooLargeError as exc:
            return "refused before any transfer" if "nothing was transferred" in str(exc) else str(exc)


def test_a_two_level_broadcast_past_the_scratch_size_votes_first():
    assert get_pool(W).run(refused_broadcast, timeout=120) == ["refused before any transfer"] * W


def _on_two_levels(timeout: timedelta) -> Any:
    """A group of the W ranks with a short ``timeout`` (what the liars' victims wait) and a Communicator on it whose
    two levels are set up (the result of an all_reduce back down the tree), made again where the set-up did not work
    on every rank: on this loaded machine a host's channel may not open within half of so short a timeout."""
    for _ in range(3):
        dist.barrier()  # (the default group's timeout): every rank here before the short one counts
        sub = dist.new_group(list(range(W)), timeout=timeout)
        comm = objcomm.Communicator(sub, _hooks=Hooks(down_tree=True))
        try:
            comm.all_gather(dist.get_rank())  # the set-up
            ready = any(levels is not None for levels in _state.group_facts(sub).levels.values())
        except objcomm.CommunicationError:
            ready = False
        everywhere = torch.tensor([int(ready)])
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)  # through the default group
        if everywhere.item():
            return sub, comm
        dist.destroy_process_group(sub)
    raise AssertionError("the two levels were not set up on every rank in three tries")


def lying_relay_in_the_tree(case: str, k: int, liar: int, victim: int, limited: Optional[int]) -> List[Any]:
    """all_reduce on two levels (hosts of ``k``, the result back down the tree, as from 64 leaders), on a group of the
    8 ranks with a 3 s timeout; ``liar`` lies in its sends to ``victim`` along the tree: ``forged``, an error report in
    place of the result on the way down; ``hidden limit``, a limit of 2**61 for its subtree on the way up, hiding the
    max_bytes of rank ``limited``, which then refuses the result. Then two all_gathers: what this rank got of each."""
    rank = dist.get_rank()
    with ranks_per_host(k):
        sub, comm = _on_two_levels(timedelta(seconds=3))
        with a_relay_that_lies(case, lambda wire, dst: dst == victim, rank == liar):
            reduced = all_reduce_under(case, comm, rank, W, limited)
        after = [result_or_error(lambda: comm.all_gather(rank)) for _ in range(2)]
        dist.destroy_process_group(sub)
    return [reduced, *after]


@pytest.mark.parametrize(
    "case, k, liar, victim, misled, limited",
    [
        ("forged", 4, 6, 7, {7}, None),  # down host 4's tree (4 <- 5, 4 <- 6 <- 7), over its channel
        ("forged", 4, 0, 4, {4, 5, 6, 7}, None),  # down the leaders' tree: leader 4 passes it down its host's
        ("forged", 3, 0, 6, {6, 7}, None),  # leaders 0 <- 3, 0 <- 6; in the group's tree 6's parent is 4
        ("hidden limit", 4, 6, 4, {7}, 7),  # up host 4's tree
        ("hidden limit", 4, 4, 0, {7}, 7),  # up the leaders' tree; rank 7 refuses in its host's tree
        ("hidden limit", 3, 3, 0, {5}, 5),
        ("hidden limit", 2, 4, 0, {6, 7}, 6),  # leaders 0 <- 2, 0 <- 4 <- 6: leader 6 refuses in theirs
    ],
)
def test_a_lying_relay_in_the_tree_on_two_levels_misleads_its_subtree_only(
    case, k, liar, victim, misled: Set[int], limited
):
    """The ranks outside the lie get the right result. A forged error report: the misled raise, waiting for failure
    reports that only their relay could send, never in a collective of the group; the next calls wait for them, and
    raise or (where they come in time) return the right result. A hidden limit: the rank that refuses began the
    failure, raises at once and reports to nobody (its relay returned the result), and the group stays in step."""
    outcomes = get_pool(W).run(lying_relay_in_the_tree, case, k, liar, victim, limited, timeout=120)
    result = sum(range(1, W + 1)) if case == "forged" else 20_000 * W
    for rank, (reduced, *after) in enumerate(outcomes):
        if case == "forged" and rank != liar:
            assert reduced == ("CommunicationError" if rank in misled else result), (rank, outcomes)
            # the next calls wait for the misled ranks, which come after their timeout: in time, or not
            assert all(got in (list(range(W)), "CommunicationError") for got in after), (rank, outcomes)
        elif case == "hidden limit":
            assert reduced == ("RemoteError" if rank in misled else result), (rank, outcomes)
            assert after == [list(range(W))] * 2, (rank, outcomes)


T, DRIP = 3, 2.2  # the group's timeout, and the wait before each of a dripping liar's messages (within it)


def dripping(case: str, k: int, liar: int, other: int) -> List[Any]:
    """On two levels (hosts of ``k``, a group with a T-second timeout), ``liar`` waits DRIP before each message of its
    part: ``gather``, each 64 KiB channel message of its rest to its host's leader or of everything a leader hands
    the destination ``other`` over the host's channel (390 KB from the liar and from rank 1); ``broadcast``, each
    64 KiB piece of its rest among the leaders (the liar the source, a leader). What this rank got (ok, or the
    error's type), after how long, and the next call's outcome."""
    rank = dist.get_rank()
    with ranks_per_host(k):
        sub, comm = _on_two_levels(timedelta(seconds=T))
        if case == "broadcast":
            comm = objcomm.Communicator(sub, chunk_bytes=1 << 16, _hooks=Hooks(down_tree=True))
        real_send, real_among = _rests.send_within, _moves.among_leaders

        def send_slowly(here: Any, to: int, views: Any) -> None:  # a rest's stream, one channel message at a time
            for chunk in chunks(list(views)):
                time.sleep(DRIP)
                real_send(here, to, [memoryview(chunk)])

        def among_slowly(here: Any, op: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
            if fn is dist.broadcast:
                time.sleep(DRIP)
            return real_among(here, op, fn, *args, **kwargs)

        if rank == liar:
            _rests.send_within, _moves.among_leaders = send_slowly, among_slowly  # type: ignore[assignment]
        blob = b"x" * (6 * (1 << 16) - 1000)
        start = time.monotonic()
        try:
            if case == "gather":
                got = result_or_error(lambda: comm.gather(blob if rank in (liar, 1) else rank, dst=other))
            else:
                got = result_or_error(lambda: comm.broadcast(blob if rank == liar else None, src=liar) == blob)
        finally:
            _rests.send_within, _moves.among_leaders = real_send, real_among  # type: ignore[assignment]
        took = time.monotonic() - start
        after = result_or_error(lambda: comm.all_gather(rank))
        dist.destroy_process_group(sub)
    return [got if isinstance(got, str) else "ok", took, after if isinstance(after, str) else "ok"]


@pytest.mark.parametrize(
    "case, k, liar, other",
    [
        ("gather", 4, 5, 0),  # a host's rank drips its rest to its leader, 4
        ("gather", 4, 4, 5),  # a leader drips everything it hands the destination, on its host
        ("broadcast", 7, 0, 0),  # the source's leader drips its pieces to rank 7, a host of one
        ("broadcast", 4, 0, 0),  # ... to leader 4, which passes each on to its host
    ],
)
def test_a_liar_that_drips_its_messages_on_two_levels_holds_nobody_past_twice_the_timeout(case, k, liar, other):
    """One timeout for a stream of channel messages on two levels (a rest to the leader, what a leader hands a rank
    of its host), and one for the pieces of a leaders' relay: a liar that sends each just within it held an honest
    rank for one timeout per message or piece (13 to 26 s here)."""
    outcomes = get_pool(W).run(dripping, case, k, liar, other, timeout=250)
    for rank, (got, took, _) in enumerate(outcomes):
        if rank != liar:
            assert got in ("ok", "CommunicationError"), (rank, outcomes)
            assert took < 2 * T + 1.5, (rank, outcomes)


def colluding_drips() -> List[Any]:
    """On two levels (hosts of 4, a group with a T-second timeout), a broadcast of 2 MB from rank 0 (its receivers
    echo round 1 in each host, then vote): ranks 3 and 7, a non-leader on each host, wait DRIP before each of their
    channel messages of the echo and the vote (a gather to the leader, an echo). What this rank got, after how long."""
    rank = dist.get_rank()
    with ranks_per_host(4):
        sub, comm = _on_two_levels(timedelta(seconds=T))
        real_echo, real_gather = _mesh.Mesh.echo, _mesh.Mesh.gather

        def slowly(real: Any) -> Any:
            def waited(self: Any, *args: Any, **kwargs: Any) -> Any:
                time.sleep(DRIP)
                return real(self, *args, **kwargs)

            return waited

        if rank in (3, 7):
            _mesh.Mesh.echo, _mesh.Mesh.gather = slowly(real_echo), slowly(real_gather)  # type: ignore[method-assign]
        blob = b"b" * (2 << 20)
        start = time.monotonic()
        try:
            got = result_or_error(lambda: comm.broadcast(blob if rank == 0 else None, src=0) == blob)
        finally:
            _mesh.Mesh.echo, _mesh.Mesh.gather = real_echo, real_gather  # type: ignore[method-assign]
        took = time.monotonic() - start
        dist.destroy_process_group(sub)
    return [got if isinstance(got, str) else "ok", took]


def test_two_liars_that_drip_the_steps_before_a_vote_on_two_levels_hold_nobody_past_twice_the_timeout():
    """A helper's find: with one dripping non-leader on each host, both leaders reach the leaders' vote together,
    and every hop of the echo and the vote before it (which the call clock did not yet count) waited a timeout of
    its own: the honest ranks returned after 4.3 timeouts. Before round 1 is done a call's waits end twice the
    timeout after it began."""
    outcomes = get_pool(W).run(colluding_drips, timeout=250)
    for rank, (got, took) in enumerate(outcomes):
        if rank not in (3, 7):
            assert got in ("ok", "CommunicationError"), (rank, outcomes)
            assert took < 2 * T + 1.5, (rank, outcomes)


def a_lying_go() -> Any:
    """On two levels (hosts of 4, a group with a T-second timeout), a gather to rank 5 (on host 4-7, not its leader)
    that says go whatever the slots say, while rank 1's slot announces a rest of 1 TiB it never sends; the other
    ranks' max_bytes is 100,000. What this rank got, and how much its peak memory grew (MB)."""
    import resource

    from objcomm._format.slot import COUNT, PREFIX, SIZES_UNLISTED
    from objcomm._transport import gather as _gather

    rank = dist.get_rank()
    with ranks_per_host(4):
        sub, comm = _on_two_levels(timedelta(seconds=T))
        real_verdict, real_slot = _gather._verdict, _gather._slot

        def forged(wire: Any, out: Any) -> bytearray:
            slot = bytearray(wire.slot)
            PREFIX.pack_into(slot, 0, 1 << 40, wire.max_bytes, 1 << 40)  # a frame of 1 TiB, to come after the slot
            COUNT.pack_into(slot, PREFIX.size, SIZES_UNLISTED)
            return slot

        if rank == 5:
            _gather._verdict = lambda *args, **kwargs: (_gather.GO, None)  # type: ignore[assignment]  # (nothing checked)
        if rank == 1:
            _gather._slot = forged  # type: ignore[assignment]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            got = result_or_error(lambda: comm.gather(rank, dst=5, max_bytes=None if rank in (1, 5) else 100_000))
        except MemoryError:
            got = "MemoryError"
        finally:
            _gather._verdict, _gather._slot = real_verdict, real_slot  # type: ignore[assignment]
        grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        dist.destroy_process_group(sub)
    return [got if isinstance(got, str) else "ok", grew]


def test_a_relaying_leader_is_held_to_its_own_limit_whatever_the_destination_says():
    """A helper's find: the destination's word (go) was all a leader relaying a gather's rests trusted, so a lying
    destination and a sender announcing 200 MB made honest leaders with 100 KB limits allocate 200 MB (1 TiB: a
    MemoryError, no objcomm error). A leader checks what it is about to hold against its own max_bytes first."""
    outcomes = get_pool(W).run(a_lying_go, timeout=250)
    for leader in (0, 4):
        got, grew = outcomes[leader]
        assert got == "TooLargeError" and grew < 50, (leader, outcomes)


def a_forged_slot() -> List[Any]:
    """Hosts of 4, in a group of their own (3 s timeout): leader 4 forges rank 5's slot (an object that fits it) in
    the bundle it hands the leaders and its host. An all_gather of small objects, then one with a second round (rank 0
    sends 10 KB): what each rank got for ranks 5 and 6, or the error's type."""
    rank = dist.get_rank()
    seen: List[Any] = []
    with ranks_per_host(4):
        sub = dist.new_group(list(range(W)), timeout=timedelta(seconds=3))
        comm = objcomm.Communicator(sub)
        comm.all_gather(rank)  # the set-up
        real = _moves.bundle_of

        def forging(here: Any, items: Any, width: int, op: str) -> bytearray:
            items = list(items)
            forged = bytearray(width)
            fill_slot(
                memoryview(forged), _frame.encode("forged", registry.guarded("pickle"), max_bytes=1 << 30), 1 << 30
            )
            items[1] = forged  # rank 5, the host's second
            return real(here, items, width, op)

        if rank == LEADER:
            _moves.bundle_of = forging  # type: ignore[assignment]
        try:
            got = comm.all_gather(f"r{rank}")
            seen.append(got[5:7])
            try:
                got = comm.all_gather(b"x" * 10_000 if rank == 0 else f"r{rank}")
                seen.append(got[5:7])
            except objcomm.CommunicationError:
                seen.append("CommunicationError")
        finally:
            _moves.bundle_of = real  # type: ignore[assignment]
            dist.destroy_process_group(sub)
    return seen


def test_a_lying_leader_speaks_for_its_hosts_ranks_to_the_others_never_to_themselves():
    """A rank's own slot on two levels is the one it sent, never its leader's copy of it: a leader that forges a
    host rank's object changes what the other ranks receive from that rank (it speaks for it) and nothing that rank
    returns for itself; where a second round follows, the host's echo finds that rank's reading of its own slot apart
    from the others' and every rank raises (before, the rank took the forgery for its own object too, and the call
    returned everywhere)."""
    outcomes = get_pool(W).run(a_forged_slot, timeout=120)
    assert outcomes[5][0] == ["r5", "r6"], outcomes
    for rank in set(range(W)) - {5}:
        assert outcomes[rank][0] == ["forged", "r6"], (rank, outcomes)
    assert [o[1] for o in outcomes] == ["CommunicationError"] * W, outcomes
