"""Failures are loud, immediate and the same on every rank; the group stays usable."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import objcomm
import serializers

pytestmark = pytest.mark.timeout(180)

POSITIONS = {"first": [0], "middle": [1], "last": [-1], "all": None}


class Unpicklable:
    """Fails to encode with every serializer (pickle raises from __reduce__)."""

    def __reduce__(self):
        raise RuntimeError("cannot pickle this on purpose")


def _failing(world: int, position: str) -> list[int]:
    chosen = POSITIONS[position]
    return list(range(world)) if chosen is None else [c % world for c in chosen]


def fail_in_every_collective(position: str) -> dict:
    """Each collective with the failing object at `position`; returns what each call raised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    failing = _failing(world, position)
    mine = Unpicklable() if rank in failing else {"rank": rank}
    outcome = {}
    calls = {
        "all_gather": lambda: objcomm.all_gather(mine),
        "gather": lambda: objcomm.gather(mine, dst=world - 1),
        # broadcast/scatter encode on the source only: the source is the failing rank
        "broadcast": lambda: objcomm.broadcast(mine if rank == failing[0] else None, src=failing[0]),
        "scatter": lambda: objcomm.scatter(
            [Unpicklable() if r in failing else r for r in range(world)] if rank == 0 else None, src=0
        ),
    }
    for name, call in calls.items():
        started = time.monotonic()
        try:
            call()
            outcome[name] = None
        except objcomm.RemoteError as exc:
            outcome[name] = (
                exc.ranks if name != "scatter" else [0],
                exc.failures[exc.ranks[0]][0],
                time.monotonic() - started,
            )
            assert "cannot pickle this on purpose" in str(exc)
        # the next call on the same group works
        assert objcomm.all_gather(rank) == list(range(world))
    return outcome


@pytest.mark.parametrize("position", POSITIONS)
def test_every_rank_raises_naming_the_failing_ranks(ranks4, position):
    failing = _failing(4, position)
    for outcome in ranks4.run(fail_in_every_collective, position):
        for name, result in outcome.items():
            assert result is not None, f"{name} did not raise"
            raised_ranks, kind, seconds = result
            expected = [0] if name == "scatter" else ([failing[0]] if name == "broadcast" else failing)
            assert raised_ranks == expected, name
            assert kind == "RuntimeError"  # the original type (what __reduce__ raised), as the README promises
            assert seconds < 10, f"{name} took {seconds:.1f}s to fail"


def sender_fails_point_to_point() -> str:
    rank = dist.get_rank()
    if rank == 0:
        with pytest.raises(objcomm.EncodeError, match="cannot pickle this on purpose"):
            objcomm.send(Unpicklable(), dst=1)
        objcomm.send("after", dst=1)
        return "sender raised"
    if rank == 1:
        with pytest.raises(objcomm.RemoteError, match=r"rank 0: RuntimeError"):
            objcomm.recv(src=0)
        assert objcomm.recv(src=0) == "after"
        return "receiver raised"
    return "idle"


def test_point_to_point_failure_reaches_the_receiver(ranks3):
    assert ranks3.run(sender_fails_point_to_point) == ["sender raised", "receiver raised", "idle"]


class PickyLoads(serializers.Serializer):
    """Decodes on every rank but rank 0, to show decode failures stay local."""

    name, safe, description = "picky", True, "utf-8 strings; rank 0 refuses to decode"

    def dumps(self, obj, /, **_):
        return str(obj).encode()

    def loads(self, data, /, **_):
        if dist.get_rank() == 0:
            raise ValueError("rank 0 does not like this")
        return bytes(data).decode()


def decode_failure_is_local() -> object:
    serializers.register(PickyLoads(), replace=True)
    rank = dist.get_rank()
    try:
        result = objcomm.all_gather(f"r{rank}", serializer="picky")
    except objcomm.DecodeError as exc:
        result = str(exc)
    assert objcomm.all_gather(rank) == list(range(dist.get_world_size()))
    return result


def test_decode_failure_raises_locally_naming_sender_and_serializer(ranks3):
    results = ranks3.run(decode_failure_is_local)
    assert "'picky' payload from rank 0" in results[0] and "rank 0 does not like this" in results[0]
    assert results[1] == results[2] == ["r0", "r1", "r2"]


def unknown_serializer_on_receiver() -> str:
    rank = dist.get_rank()
    if rank == 1:
        serializers.register("only-on-1", dumps=lambda o: str(o).encode(), loads=bytes, replace=True)
        objcomm.send("x", dst=0, serializer="only-on-1")
        return "sent"
    if rank == 0:
        with pytest.raises(objcomm.UnknownSerializerError, match=r"rank 1 .*'only-on-1'.*registered: .*msgpack"):
            objcomm.recv(src=1)
        return "refused"
    return "idle"


def test_frame_naming_an_unregistered_serializer(ranks3):
    assert ranks3.run(unknown_serializer_on_receiver) == ["refused", "sent", "idle"]


def _one_of_each(rank: int, world: int, mine: dict) -> dict:
    """Each operation once, with ``mine`` as this rank's settings (send: rank 1 to rank 0)."""
    return {
        "all_gather": lambda: objcomm.all_gather(rank, **mine),
        "gather": lambda: objcomm.gather(rank, dst=0, **mine),
        "broadcast from 1": lambda: objcomm.broadcast("b" if rank == 1 else None, src=1, **mine),
        "broadcast to 1": lambda: objcomm.broadcast("b" if rank == 0 else None, src=0, **mine),
        "scatter to 1": lambda: objcomm.scatter(list(range(world)) if rank == 0 else None, src=0, **mine),
        "all_to_all": lambda: objcomm.all_to_all(list(range(world)), **mine),
        "all_reduce": lambda: objcomm.all_reduce(rank, op="sum", **mine),
        "reduce": lambda: objcomm.reduce(rank, op="sum", dst=2, **mine),
        "send": lambda: objcomm.send("s", dst=0, **mine) if rank == 1 else objcomm.recv(src=1) if rank == 0 else 0,
    }


def settings_that_fail_on_one_rank() -> dict:
    """Rank 1 alone passes settings it cannot use (a serializer registered elsewhere only, a max_bytes out of
    range, a compression that does not exist): each operation raises, and the next call of every rank pairs with
    the same call of the others (before: rank 1 raised before taking part, and the others' operation took its
    next call's object)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    got = {}
    for setting, bad in {
        "serializer": {"serializer": "msgpak"},
        "max_bytes": {"max_bytes": -5},
        "compression": {"compression": "gzip"},
    }.items():
        calls = _one_of_each(rank, world, bad if rank == 1 else {})
        for name, call in calls.items():
            try:
                call()
                got[setting, name] = "returned"
            except objcomm.RemoteError as exc:
                got[setting, name] = ("RemoteError", exc.ranks)
            except Exception as exc:
                got[setting, name] = type(exc).__name__
            assert objcomm.all_gather((setting, name, rank)) == [(setting, name, r) for r in range(world)]
        # a receive raises before it takes anything: the message waits for the next receive
        if rank == 0 and "max_bytes" in bad:  # (recv takes no serializer or compression)
            objcomm.send(setting, dst=1)
        elif rank == 1 and "max_bytes" in bad:
            try:
                objcomm.recv(src=0, **bad)
            except Exception as exc:
                got[setting, "recv"] = type(exc).__name__
            got[setting, "recv", "next"] = objcomm.recv(src=0)
    return got


def test_settings_that_fail_on_one_rank_fail_every_rank_and_keep_the_group_in_step(ranks3):
    results = ranks3.run(settings_that_fail_on_one_rank)
    raised = {"serializer": "UnknownSerializerError", "max_bytes": "ValueError", "compression": "ValueError"}
    for setting, error in raised.items():
        for name in ("all_gather", "gather", "all_to_all", "all_reduce", "reduce", "broadcast from 1"):
            assert results[1][setting, name] == error, (setting, name)
            assert results[0][setting, name] == results[2][setting, name] == ("RemoteError", [1]), (setting, name)
        for name in ("broadcast to 1", "scatter to 1"):  # rank 1 only receives: it takes part, then raises
            assert results[1][setting, name] == error, (setting, name)
            assert results[0][setting, name] == results[2][setting, name] == "returned", (setting, name)
        assert results[1][setting, "send"] == error and results[0][setting, "send"] == ("RemoteError", [1])
    assert results[1]["max_bytes", "recv"] == "ValueError" and results[1]["max_bytes", "recv", "next"] == "max_bytes"


EVERY_CALL = {  # each collective of objcomm's, its arguments from (comm, rank, world)
    "all_gather": lambda comm, rank, world: comm.all_gather(rank),
    "gather": lambda comm, rank, world: comm.gather(rank, dst=0),
    "broadcast": lambda comm, rank, world: comm.broadcast(rank, src=0),
    "scatter": lambda comm, rank, world: comm.scatter(list(range(world)), src=0),
    "all_to_all": lambda comm, rank, world: comm.all_to_all([rank] * world),
    "all_reduce": lambda comm, rank, world: comm.all_reduce(rank, max),
    "reduce": lambda comm, rank, world: comm.reduce(rank, max, dst=0),
    "scan": lambda comm, rank, world: comm.scan(rank, max),
}


def round_one_settings_that_differ() -> dict:
    """Rank 1 gives another slot_bytes (8 KiB) than ranks 0 and 2 (4 KiB), at a new group's first call of each
    collective: through the backend (local=False), with every rank its own host, and on one host before its channel
    opened; then local=False on rank 1 alone. Whether each call raised a CommunicationError that says so, then
    whether the group's next call with one setting on every rank works. (Until 2026-12-07 gloo aborted rank 0's
    process at such an all_gather; the local=False call ended at the group's timeout, saying nothing of why.)"""
    from objcomm._api.resolving import Hooks

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for how, kwargs in [("backend", {"local": False}), ("hosts", {"_hooks": Hooks(separate_hosts=True)}), ("host", {})]:
        for op in EVERY_CALL:
            group = dist.new_group(list(range(world)))
            comm = objcomm.Communicator(group, slot_bytes=8192 if rank == 1 else 4096, **kwargs)
            try:
                EVERY_CALL[op](comm, rank, world)
                out[how, op] = "returned"
            except objcomm.CommunicationError as exc:
                out[how, op] = str(exc) if "slot_bytes" not in str(exc) or "4,096 to 8,192" not in str(exc) else "said"
            agreeing = objcomm.Communicator(group, **kwargs)
            out[how, op, "next"] = agreeing.all_gather(rank) == list(range(world))
            dist.destroy_process_group(group)
    for (
        op
    ) in EVERY_CALL:  # local=False on rank 1 alone: it moved round 1 through the group, the others tried the channel
        group = dist.new_group(list(range(world)))
        try:
            EVERY_CALL[op](objcomm.Communicator(group, local=rank != 1), rank, world)
            out["local", op] = "returned"
        except objcomm.CommunicationError as exc:
            out["local", op] = "said" if "do not agree on the same-host channel" in str(exc) else str(exc)
        out["local", op, "next"] = objcomm.Communicator(group).all_gather(rank) == list(range(world))
        dist.destroy_process_group(group)
    return out


def test_ranks_whose_slot_bytes_or_local_differ_all_raise_saying_so_and_the_group_goes_on(ranks3):
    for rank, outcome in enumerate(ranks3.run(round_one_settings_that_differ)):
        assert set(outcome.values()) == {"said", True}, (rank, outcome)


def limited_parts(comm: objcomm.Communicator, rank: int) -> list:
    """all_to_all where rank 0's part for rank 2 (limit 5,000) is 20 KB, every other part small."""
    return comm.all_to_all(["z" * 20_000 if rank == 0 and r == 2 else "s" for r in range(3)])


def limits_on_both_sides() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # sender side: too large to send, so nobody receives anything
    with pytest.raises(objcomm.RemoteError, match=r"TooLargeError.*max_bytes=1,000"):
        objcomm.all_gather("x" * (2000 if rank == 1 else 10), max_bytes=1000)
    # receiver side, collective: rank 2 accepts at most 5,000 bytes; everybody learns it in round 1
    limit = 5000 if rank == 2 else None
    with pytest.raises(
        objcomm.TooLargeError, match=r"rank 0 sends [\d,]+ bytes, above the max_bytes=5,000 of receiving rank 2"
    ):
        objcomm.Communicator(max_bytes=limit).all_gather("y" * (20_000 if rank == 0 else 1))
    # receiver side, broadcast: round 1 told rank 2 every transfer, so it drains them (through a chunk-sized
    # buffer of the backend, or the same-host channel's messages) and raises alone; the others receive
    comm = objcomm.Communicator(max_bytes=limit, chunk_bytes=4096)
    for key, drained, via in [
        ("broadcast", "messages of at most 65,536 bytes of the same-host channel", comm),
        (
            "broadcast, backend",
            "scratch buffer of at most chunk_bytes=4,096",
            objcomm.Communicator(max_bytes=limit, chunk_bytes=4096, local=False),
        ),
    ]:
        try:
            out[key] = len(via.broadcast("z" * 50_000 if rank == 0 else None, src=0))
        except objcomm.TooLargeError as exc:
            out[key] = "drained" if drained in str(exc) else str(exc)
    # too many tensors to list in a 128-byte slot: the receivers vote first, and every rank raises
    voting = objcomm.Communicator(max_bytes=limit, slot_bytes=128, inline_tensor_bytes=0)
    tensors = [torch.ones(200) for _ in range(20)]
    try:
        out["vote"] = len(voting.broadcast(tensors if rank == 0 else None, src=0))
    except objcomm.TooLargeError as exc:
        out["vote"] = "refused" if "to a rank whose max_bytes it exceeds" in str(exc) else str(exc)
    # scatter: each receiver judges its own part; every rank names the part refused (rank 2's), not the root's own
    parts = ["own", "small", tensors] if rank == 0 else None
    try:
        out["scatter vote"] = voting.scatter(parts, src=0)
    except objcomm.TooLargeError as exc:
        out["scatter vote"] = str(exc)
    # all_to_all: each rank votes on the parts sent to it; every rank's error names the sender and the refuser
    try:
        out["all_to_all vote"] = limited_parts(voting, rank)
    except objcomm.TooLargeError as exc:
        out["all_to_all vote"] = str(exc)
    # reduce: the result, over dst's limit, goes to dst in a gather; the error says it was the reduce's
    try:
        out["reduce"] = voting.reduce("r" * (20_000 if rank == 0 else 1), lambda a, b: a + b, dst=2)
    except objcomm.TooLargeError as exc:
        out["reduce"] = str(exc)
    # point to point: the receiver drains and raises; the sender is done and the pair stays usable
    # (slot_bytes and chunk_bytes must agree between the ranks, as for every collective)
    out_of_band = objcomm.Communicator(max_bytes=limit, chunk_bytes=4096, inline_tensor_bytes=0)
    if rank == 0:
        comm.send("w" * 50_000, dst=2)
        out_of_band.send(tensors, dst=2)  # 20 tensors out of band, their sizes listed in the slot
        comm.send("small", dst=2)
    elif rank == 2:
        with pytest.raises(objcomm.TooLargeError, match="above this rank's max_bytes=5,000"):
            comm.recv(src=0)
        with pytest.raises(objcomm.TooLargeError, match="above this rank's max_bytes=5,000"):
            out_of_band.recv(src=0)
        assert comm.recv(src=0) == "small"
    assert objcomm.all_gather(rank) == list(range(world))
    return out


def test_size_limits(ranks3):
    results = ranks3.run(limits_on_both_sides)
    for key in ("broadcast", "broadcast, backend"):
        assert [r[key] for r in results] == [50_000, 50_000, "drained"], key
    assert [r["vote"] for r in results] == ["refused"] * 3
    for r in results:  # 20 tensors of 200 float32 each, and the frame that lists them
        assert re.search(r"rank 0 sends (1[6-9]|2\d),\d{3} bytes to a rank whose max_bytes", r["scatter vote"]), r
        assert "rank 2 refused one" in r["scatter vote"], r  # the same words on every rank, naming the refuser
        assert "all_to_all: rank 0 sends rank 2 more than its max_bytes" in r["all_to_all vote"] or (
            "rank 0 sends" in r["all_to_all vote"] and "above this rank's max_bytes=5,000" in r["all_to_all vote"]
        ), r  # (rank 2 itself names its own limit)
        assert r["reduce"].startswith("reduce: its result goes from group rank 0 to dst"), r
        assert "max_bytes=5,000 of receiving rank 2" in r["reduce"], r


def frames_in_their_slots_past_a_limit() -> dict:
    """Rank 2 takes at most 1,000 bytes; rank 1's 3,000-byte string fits its slot (4 KiB); rank 0 sends a tensor
    out of band, so a second round follows. Each collective on the channel's round 1 and the backend's: what it
    returned on this rank, or the error."""
    rank = dist.get_rank()
    tensor = torch.arange(100)
    mine = {0: tensor, 1: "x" * 3000, 2: "small"}[rank]
    out = {}
    for local in (True, False):
        comm = objcomm.Communicator(max_bytes=1000 if rank == 2 else None, local=local, inline_tensor_bytes=0)
        parts = [tensor if rank == 0 else "x" * 3000 if rank == 1 else "s"] * 3
        calls = {
            "all_gather": lambda comm=comm: comm.all_gather(mine),
            "gather": lambda comm=comm: comm.gather(mine, dst=2),
            "all_to_all": lambda comm=comm, parts=parts: comm.all_to_all(parts),
            "scatter": lambda comm=comm: comm.scatter(["s", tensor, "x" * 3000] if rank == 0 else None, src=0),
        }
        for name, call in calls.items():
            try:
                got = call()
                out[name, local] = (
                    [len(g) if isinstance(g, str) else int(g.sum()) for g in got]
                    if isinstance(got, list)
                    else (got if got is None else len(got) if isinstance(got, str) else int(got.sum()))
                )
            except objcomm.ObjcommError as exc:
                out[name, local] = f"{type(exc).__name__}: {exc}"
    return out


def test_a_frame_that_fits_its_slot_is_taken_whatever_the_receivers_limit(ranks3):
    """docs/security.md: the limit bounds what a receiver allocates beyond its slot; a frame that fits the slot came
    with it, and is accepted whatever max_bytes, also where another rank's payload (a tensor out of band) takes a
    second round (every rank raised TooLargeError there, naming the 3,000-byte string, before)."""
    total = int(torch.arange(100).sum())
    for rank, got in enumerate(ranks3.run(frames_in_their_slots_past_a_limit)):
        for local in (True, False):
            assert got["all_gather", local] == [total, 3000, 5], (rank, local, got)
            assert got["gather", local] == ([total, 3000, 5] if rank == 2 else None), (rank, local, got)
            assert got["all_to_all", local] == [total, 3000, 1], (rank, local, got)
            assert got["scatter", local] == [1, total, 3000][rank], (rank, local, got)


MARKER_NAME = "objcomm-pwned-marker"


class Malicious:
    """Pickles into a payload that runs a shell command when *loaded*."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def malicious_payload(marker: str) -> list:
    rank = dist.get_rank()
    outcome = []
    if rank == 1:
        objcomm.send(Malicious(marker), dst=0, serializer="pickle")
        objcomm.send(Malicious(marker), dst=0, serializer="restricted-pickle")
        objcomm.send(Malicious(marker), dst=0, serializer="pickle")  # the control: it really is malicious
        return outcome
    if rank == 0:
        with pytest.raises(objcomm.ContentRefusedError, match="accepts only"):
            objcomm.recv(src=1, accept=["msgpack", "json"])
        outcome.append(os.path.exists(marker))
        with pytest.raises(
            objcomm.ContentRefusedError, match=r"restricted-pickle refused to load global (posix|os)\.system"
        ):
            objcomm.recv(src=1, accept=["restricted-pickle"])
        outcome.append(os.path.exists(marker))
        objcomm.recv(src=1)  # plain pickle accepted: loading it runs the command
        outcome.append(os.path.exists(marker))
    return outcome


def test_malicious_pickle_is_refused_and_nothing_runs(ranks3, tmp_path):
    marker = str(tmp_path / MARKER_NAME)
    assert ranks3.run(malicious_payload, marker) == [[False, False, True], [], []]


def accept_settings() -> list:
    rank = dist.get_rank()
    seen = []
    previous = objcomm.configure(accept=["msgpack"])
    try:
        for serializer, comm, call_accept in [
            ("pickle", objcomm.Communicator(), None),  # process-wide default refuses
            ("pickle", objcomm.Communicator(accept=["pickle"]), None),  # communicator overrides
            ("json", objcomm.Communicator(accept=["pickle"]), ["json"]),  # the call overrides
        ]:
            try:
                comm.all_gather(rank, serializer=serializer, accept=call_accept)
                seen.append("ok")
            except objcomm.ContentRefusedError:
                seen.append("refused")
    finally:
        objcomm.restore(previous)
    return seen


def test_accept_per_call_communicator_and_process(ranks3):
    assert ranks3.run(accept_settings) == [["refused", "ok", "ok"]] * 3


def one_rank_never_arrives() -> object:
    rank = dist.get_rank()
    if rank == 1:
        return "stayed away"
    started = time.monotonic()
    try:
        objcomm.all_gather(rank)
    except objcomm.CommunicationError as exc:
        said = str(exc)  # the causes it lists include settings that differ (a rank that turned local off, say)
        return ("CommunicationError", round(time.monotonic() - started, 1), "timeout" in said.lower(), said)
    return "returned"


def test_missing_rank_ends_in_an_error_within_the_group_timeout():
    """A rank that never calls: the others raise CommunicationError once the group's timeout (3 s) passes."""
    from _ranks import RankPool

    with RankPool(3, pg_timeout=3, timeout=60) as pool:
        results = pool.run(one_rank_never_arrives)
    assert results[1] == "stayed away"
    for kind, seconds, mentions_timeout, said in (results[0], results[2]):
        assert kind == "CommunicationError" and mentions_timeout
        assert "settings that every rank of a group must share" in said and "shm_threshold" in said, said
        assert 2 <= seconds < 30


def a_receive_whose_sender_never_sends() -> object:
    comm = objcomm.Communicator(local=False)  # through gloo, which times out
    comm.all_reduce(1, "sum")  # (the group's first call: its vote behind it)
    if dist.get_rank() == 1:
        return "sent nothing"
    said = []
    for call in (lambda: comm.recv(1, tag=7), lambda: comm.all_reduce(1, "sum")):  # the second: a tree's receive
        try:
            call()
            said.append("returned")
        except objcomm.CommunicationError as exc:
            said.append(str(exc))
    return said


def test_a_receive_that_times_out_through_the_backend_names_what_holds_a_sender_back():
    """A porting review's find: it listed the causes of a collective that never met (settings every rank must share),
    where a receive's sender may not have sent under its tag, or be held back in send by the bound on sends. A
    reduction's own receives keep a collective's causes."""
    from _ranks import RankPool

    with RankPool(2, pg_timeout=3, timeout=60) as pool:
        (said, in_tree), _ = pool.run(a_receive_whose_sender_never_sends)
    assert said.startswith("recv from rank 1 under tag 7"), said
    assert "not sent under this tag yet, or be held back in its own send by the bound" in said, said
    assert "settings that every rank of a group must share" not in said, said
    assert "settings that every rank of a group must share" in in_tree and "bound on sends" not in in_tree, in_tree


def original_type_on_the_failing_rank() -> dict:
    """Rank 1's object is a local function, which pickle refuses: code written for torch catches
    pickle's own exception type on that rank; every rank's RemoteError names that type."""
    import pickle

    from objcomm import compat

    rank, world = dist.get_rank(), dist.get_world_size()

    def local() -> None:
        pass

    try:
        pickle.dumps(local)
        raise AssertionError("pickle accepted a local function")
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        expected = type(exc)
    obj = local if rank == 1 else rank
    calls = {
        "all_gather": lambda: objcomm.all_gather(obj),
        "compat all_gather_object": lambda: compat.all_gather_object([None] * world, obj),
        "all_to_all": lambda: objcomm.all_to_all([obj] * world),
        "all_reduce": lambda: objcomm.all_reduce([obj], "sum"),
    }
    seen = {}
    for name, call in calls.items():
        try:
            call()
            seen[name] = "returned"
        except objcomm.RemoteError as exc:
            again = pickle.loads(pickle.dumps(exc))  # the harness and users ship exceptions between processes
            seen[name] = [
                isinstance(exc, expected),
                exc.failures[1][0] == expected.__name__,
                isinstance(again, expected) == isinstance(exc, expected) and again.failures == exc.failures,
            ]
    if rank == 1:
        try:
            objcomm.send(local, dst=0)
        except objcomm.EncodeError as exc:
            again = pickle.loads(pickle.dumps(exc))  # (its class exists only at run time: pickle names its parts)
            seen["send"] = [isinstance(exc, expected), True, isinstance(again, expected) and str(again) == str(exc)]
    elif rank == 0:
        try:
            objcomm.recv(src=1)
        except objcomm.RemoteError as exc:
            seen["send"] = [isinstance(exc, expected), exc.failures[1][0] == expected.__name__, True]
    return seen


def test_the_failing_rank_raises_an_instance_of_the_original_type(ranks3):
    results = ranks3.run(original_type_on_the_failing_rank)
    assert "send" in results[0] and "send" in results[1] and "send" not in results[2]
    for rank, seen in enumerate(results):
        for name, (is_original, names_it, survives_pickle) in seen.items():
            assert is_original == (rank == 1), (rank, name)
            assert names_it and survives_pickle, (rank, name)
