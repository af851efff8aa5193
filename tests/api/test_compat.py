"""objcomm.compat against torch.distributed: one scenario, run with each, must record the same thing.

The scenario follows torch's own object-collective tests (``test_c10d_object_collectives.py`` and
``distributed_test.py``'s ``COLLECTIVES_OBJECT_TEST_LIST``): a list of mixed objects — nested
dicts, a user-class instance with an attribute added after construction, one holding a tensor, a
string, nested lists — where each rank contributes the element at its rank index; then the same
on sub-groups, with ``group_dst``/``group_src``, and on a rank outside the group.
"""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

import objcomm
import serializers
from objcomm import compat

pytestmark = pytest.mark.timeout(120)

NAMES = [
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
]


class Foo:
    """A user class, as in torch's tests; ``bar`` is added after construction."""

    def __init__(self, x: Any) -> None:
        self.x = x


def mixed_objects() -> list:
    f = Foo(10)
    f.bar = 1  # type: ignore[attr-defined]
    return [
        {"key1": 3, "key2": 4, "key3": {"nested": True}},
        f,
        Foo(torch.arange(9.0).reshape(3, 3)),
        "foo",
        [1, 2, True, "string", [4, 5, "nested"], (6, 7)],
    ]


def plain(x: Any) -> Any:
    """A comparable, picklable picture of ``x`` that keeps exact types (True is not 1, a tuple is not a list)."""
    if isinstance(x, torch.Tensor):
        return ("Tensor", str(x.dtype), x.tolist())
    if isinstance(x, Foo):
        return ("Foo", plain(vars(x)))
    if isinstance(x, dict):
        return ("dict", [(plain(k), plain(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [plain(v) for v in x])
    return (type(x).__name__, x)


def outcome(call: Callable[[], Any]) -> Any:
    """What a call did: its return value and warnings, or the type of what it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = ("returned", plain(call()))
        except Exception as exc:
            result = ("raised", type(exc).__name__)
    return result + (sorted({str(w.message) for w in caught if "group" in str(w.message)}),)


def api(which: str, serializer: Any) -> Dict[str, Callable[..., Any]]:
    if which == "torch":
        return {n: getattr(dist, n) for n in NAMES}
    extra = {} if serializer is None else {"serializer": serializer}
    return {n: (lambda f: lambda *a, **k: f(*a, **k, **extra))(getattr(compat, n)) for n in NAMES}


def scenario(which: str, serializer: Any = None) -> dict:
    """Every object collective, on the world and on sub-groups; returns what this rank observed."""
    fn = api(which, serializer)
    rank, world = dist.get_rank(), dist.get_world_size()
    objs = mixed_objects()
    seen: dict = {}

    out: list = [None] * world
    seen["all_gather"] = (fn["all_gather_object"](out, objs[rank % len(objs)]), plain(out))
    out = [None] * world
    fn["all_gather_object"](object_list=out, obj=rank)  # keyword form, as torch's test calls it
    seen["all_gather_kw"] = plain(out)

    for dst in sorted({0, world - 1}):
        out_or_none = [None] * world if rank == dst else None
        ret = fn["gather_object"](objs[rank % len(objs)], out_or_none, dst=dst)
        seen[f"gather_dst{dst}"] = (ret, plain(out_or_none))

    for src in sorted({0, world - 1}):
        lst = list(objs) if rank == src else [None] * len(objs)
        before = list(lst)
        ret = fn["broadcast_object_list"](lst, src=src)
        # on the source the elements are left as they were (not replaced by decoded copies)
        seen[f"broadcast_src{src}"] = (ret, plain(lst), rank == src and all(a is b for a, b in zip(lst, before)))
    lst = [99] if rank == 0 else [None]
    fn["broadcast_object_list"](object_list=lst)  # src defaults to 0
    seen["broadcast_default"] = plain(lst)

    for src in sorted({0, world - 1}):
        out = [None]
        ret = fn["scatter_object_list"](out, objs[:world] if rank == src else None, src=src)
        seen[f"scatter_src{src}"] = (ret, plain(out))

    # point to point: 0 -> 1 (all objects) and world-1 -> 0 (positional dst/src)
    box: list = [None] * len(objs)
    if rank == 0:
        seen["send"] = fn["send_object_list"](objs, dst=1)
    elif rank == 1:
        seen["recv"] = (fn["recv_object_list"](box, src=0), plain(box))
    small: list = [None, None]
    if rank == world - 1:
        fn["send_object_list"]([rank, f"from {rank}"], 0)
    elif rank == 0:
        seen["recv_positional"] = (fn["recv_object_list"](small, world - 1), plain(small))

    # sub-group without global rank 0, so group ranks differ from global ranks
    members = list(range(1, world))
    group = dist.new_group(members)
    if rank in members:
        me = members.index(rank)
        out = [None] * len(members)
        fn["all_gather_object"](out, objs[rank % len(objs)], group=group)
        seen["sub_all_gather"] = plain(out)
        out_or_none = [None] * len(members) if rank == members[-1] else None
        fn["gather_object"](rank, out_or_none, dst=members[-1], group=group)
        seen["sub_gather_dst"] = plain(out_or_none)
        out_or_none = [None] * len(members) if me == 0 else None
        fn["gather_object"](objs[rank % len(objs)], out_or_none, group=group, group_dst=0)
        seen["sub_gather_group_dst"] = plain(out_or_none)
        lst = [objs[1], rank] if me == len(members) - 1 else [None, None]
        fn["broadcast_object_list"](lst, group=group, group_src=len(members) - 1)
        seen["sub_broadcast_group_src"] = plain(lst)
        lst = [rank] if rank == members[0] else [None]
        fn["broadcast_object_list"](lst, src=members[0], group=group)
        seen["sub_broadcast_src"] = plain(lst)
        out = [None]
        fn["scatter_object_list"](out, [m * 10 for m in members] if me == 0 else None, group=group, group_src=0)
        seen["sub_scatter_group_src"] = plain(out)
        out = [None]
        fn["scatter_object_list"](out, members if rank == members[-1] else None, src=members[-1], group=group)
        seen["sub_scatter_src"] = plain(out)
        if len(members) > 1:
            if me == 0:
                fn["send_object_list"]([objs[2], me], group=group, group_dst=len(members) - 1)
            elif me == len(members) - 1:
                box2: list = [None, None]
                seen["sub_recv_group_src"] = (fn["recv_object_list"](box2, group=group, group_src=0), plain(box2))
    else:  # a rank outside the group: torch warns and returns without communicating
        out = ["untouched"]
        seen["outside"] = [
            outcome(lambda: fn["all_gather_object"](out, 1, group=group)),
            outcome(lambda: fn["gather_object"](1, None, dst=members[0], group=group)),
            outcome(lambda: fn["broadcast_object_list"](out, src=members[0], group=group)),
            outcome(lambda: fn["scatter_object_list"](out, None, src=members[0], group=group)),
            outcome(lambda: fn["send_object_list"](out, dst=members[0], group=group)),
            outcome(lambda: fn["recv_object_list"](out, src=members[0], group=group)),
            plain(out),
        ]

    if world % 2 == 0:  # pairs, like torch's test_subpg_* tests
        pairs = [dist.new_group([b, b + 1]) for b in range(0, world, 2)]
        pair, ranks = pairs[rank // 2], [rank - rank % 2, rank - rank % 2 + 1]
        out = [None] * 2
        fn["all_gather_object"](out, rank, group=pair)
        one = [rank if rank == ranks[0] else None]
        fn["broadcast_object_list"](one, src=ranks[0], group=pair)
        sc = [None]
        fn["scatter_object_list"](sc, ranks, src=ranks[0], group=pair)
        seen["pairs"] = (plain(out), plain(one), plain(sc))

    # mistakes both report before communicating
    seen["mistakes"] = [
        outcome(lambda: fn["send_object_list"]([1], dst=rank)),
        outcome(lambda: fn["recv_object_list"]([None], src=rank)),
        outcome(lambda: fn["send_object_list"]([1], dst=0, group_dst=0)),
        outcome(lambda: fn["send_object_list"]([1])),
        outcome(lambda: fn["recv_object_list"]([None])),
    ]
    dist.barrier()
    return seen


def differences(ours: list, theirs: list) -> list:
    """(rank, key, ours, torch's) for every observation that differs."""
    found = []
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                found.append((rank, key, a.get(key), b.get(key)))
    return found


NEWER_ARGUMENTS = {"group_dst", "group_src", "use_batch", "weights_only"}  # added after torch 2.2; the shims take them


def test_signatures_match_torch():
    """Torch's parameters, in torch's order with torch's kinds and defaults, then keyword-only serializer."""
    for name in NAMES:
        theirs = list(inspect.signature(getattr(dist, name)).parameters.values())
        ours = list(inspect.signature(getattr(compat, name)).parameters.values())
        assert ours[-1].name == "serializer" and ours[-1].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert ours[-1].default is None
        mirrored = ours[:-1]
        assert [(p.name, p.kind, p.default) for p in mirrored[: len(theirs)]] == [
            (p.name, p.kind, p.default) for p in theirs
        ], name
        # on an older torch, what torch lacks may only be the newer arguments (on 2.13: weights_only; 2.14: nothing)
        assert {p.name for p in mirrored[len(theirs) :]} <= NEWER_ARGUMENTS, name
    assert sorted(compat.__all__) == sorted(NAMES)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [3, 4])
def test_same_scenario_same_results_as_torch(world):
    from _ranks import get_pool

    pool = get_pool(world)
    theirs = pool.run(scenario, "torch")
    ours = pool.run(scenario, "objcomm")
    cloud = pool.run(scenario, "objcomm", "cloudpickle")
    # One documented difference: torch 2.13 documents "warn and return (-1 for recv)" for a rank
    # outside the group, but its send/recv_object_list raise ValueError("Invalid process group
    # specified") before getting there; the shims do what torch documents.
    assert [o[:2] for o in theirs[0]["outside"][4:6]] == [("raised", "ValueError")] * 2
    assert [o[:2] for o in ours[0]["outside"][4:6]] == [("returned", plain(None)), ("returned", plain(-1))]
    for seen in (theirs[0], ours[0], cloud[0]):
        del seen["outside"][4:6]
    assert differences(ours, theirs) == []
    assert differences(cloud, theirs) == []

    # and what torch did is what the scenario intends, so equality is not vacuous
    objs = [plain(o) for o in mixed_objects()]
    every = ("list", [objs[r % len(objs)] for r in range(world)])
    assert all(seen["all_gather"] == (None, every) for seen in ours)
    assert all(seen["all_gather_kw"] == plain(list(range(world))) for seen in ours)
    assert ours[0]["gather_dst0"] == (None, every) and ours[1]["gather_dst0"] == (None, ("NoneType", None))
    assert all(seen["broadcast_src0"][1] == ("list", objs) for seen in ours)
    assert ours[0]["broadcast_src0"][2] is True  # the source's own elements are the same objects
    assert [seen["scatter_src0"][1] for seen in ours] == [("list", [objs[r]]) for r in range(world)]
    assert ours[1]["recv"] == (0, ("list", objs))
    assert ours[0]["recv_positional"] == (world - 1, plain([world - 1, f"from {world - 1}"]))
    assert ours[world - 1]["sub_recv_group_src"] == (1, ("list", [objs[2], plain(0)]))
    assert [seen.get("sub_scatter_group_src") for seen in ours[1:]] == [plain([m * 10]) for m in range(1, world)]
    outside = ours[0]["outside"]
    assert outside[-1] == plain(["untouched"])
    assert all(o[0] == "returned" and o[2] for o in outside[:-1]), outside
    assert [m[0] for m in ours[0]["mistakes"]] == ["raised"] * 5
    if world == 4:
        assert [seen["pairs"] for seen in ours] == [
            (plain([b, b + 1]), plain([b]), plain([r])) for r, b in zip(range(4), [0, 0, 2, 2])
        ]


# -- what only the shims do -------------------------------------------------------------------


def serializer_is_used() -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: list = [None] * world
    compat.all_gather_object(out, {"set": {rank}, "tuple": (rank,)}, serializer="msgpack")
    assert out == [{"set": {r}, "tuple": (r,)} for r in range(world)]
    assert isinstance(out[0]["tuple"], tuple)
    seen = []
    try:  # json cannot carry a set: every rank learns it, nobody waits
        compat.all_gather_object(out, {rank}, serializer="json")
    except objcomm.RemoteError as exc:
        seen.append(sorted(exc.failures))
    # a receiver that names a serializer refuses frames in any other
    if rank == 0:
        compat.send_object_list([{"x": 1}], dst=1)  # pickle
        compat.send_object_list([{"x": 2}], dst=1, serializer="msgpack")
    elif rank == 1:
        box = [None]
        try:
            compat.recv_object_list(box, src=0, serializer="msgpack")
        except objcomm.ContentRefusedError:
            seen.append("refused pickle")
        assert compat.recv_object_list(box, src=0, serializer="msgpack") == 0 and box == [{"x": 2}]
    compat.all_gather_object(out, rank)
    return seen + [out]


def test_serializer_keyword(ranks3):
    results = ranks3.run(serializer_is_used)
    assert results[0] == [[0, 1, 2], [0, 1, 2]]
    assert results[1] == [[0, 1, 2], "refused pickle", [0, 1, 2]]
    assert results[2] == [[0, 1, 2], [0, 1, 2]]


DECODED: List[int] = []  # the values of the Decoded objects this process rebuilt


def _rebuilt(value: int) -> Decoded:
    DECODED.append(value)
    return Decoded(value)


class Decoded:
    """An object that notes each decode of it in this process (pickle rebuilds it by calling :func:`_rebuilt`)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> Any:
        return _rebuilt, (self.value,)


def source_decodes_nothing() -> list:
    """broadcast_object_list from rank 0 of a small list (its slot carries it), of a large one (a second round) and
    with a per-call serializer (the general path): the source's list holds its own objects and it rebuilt none of
    them, where every receiver rebuilt each; Communicator.broadcast still gives its source a copy."""
    rank = dist.get_rank()
    DECODED.clear()
    seen: list = []
    for values, extra in (([1, 2], {}), ([3] * 30_000, {}), ([4, 5], {"serializer": "cloudpickle"})):
        mine = [Decoded(v) for v in values] if rank == 0 else [None] * len(values)
        before = list(mine)
        compat.broadcast_object_list(mine, src=0, **extra)
        kept = rank == 0 and all(a is b for a, b in zip(mine, before))
        seen.append((kept, [o.value for o in mine] == values, len(DECODED)))
        DECODED.clear()
    copy = objcomm.broadcast([Decoded(6)] if rank == 0 else None, src=0)
    seen.append((copy[0].value, DECODED))
    return seen


def test_broadcast_object_lists_source_decodes_no_copy(ranks3):
    """torch leaves the source's list alone, so its copy would be read by nobody: it is not decoded (a 256 KB list
    of records cost the source ~2 ms a call, where torch's took 3.7 ms in all)."""
    results = ranks3.run(source_decodes_nothing)
    assert results[0] == [(True, True, 0), (True, True, 0), (True, True, 0), (6, [6])]
    assert results[1] == results[2] == [(False, True, 2), (False, True, 30_000), (False, True, 2), (6, [6])]


class Custom:
    """A class of the program's own: pickle rebuilds it by calling it; a safe decoder must not."""

    def __init__(self, x: int) -> None:
        self.x = x


def weights_only_is_safe() -> list:
    """torch 2.14's ``weights_only=True`` on every torch: tensors and plain containers arrive; a rank that sends pickle
    anyway, or an object of the program's own class, is refused on the receiving ranks; the group stays in step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seen: list = []
    out: list = [None] * world
    compat.all_gather_object(out, {"t": torch.arange(3) + rank, "r": (rank,)}, None, True)  # torch's position
    seen.append([(o["r"], o["t"].tolist()) for o in out])
    for call in (
        lambda: compat.all_gather_object(out, {"r": rank}, weights_only=True, serializer="pickle" if rank else None),
        lambda: compat.broadcast_object_list([Custom(1)] if rank == 0 else [None], src=0, weights_only=True),
    ):
        try:
            call()
            seen.append("returned")
        except objcomm.ObjcommError as exc:
            seen.append(type(exc).__name__)
    if rank == 0:
        compat.send_object_list([{"x": torch.ones(2)}], dst=1, weights_only=True)
        compat.send_object_list([{"x": 2}], dst=1)  # pickle
    elif rank == 1:
        box: list = [None]
        compat.recv_object_list(box, src=0, weights_only=True)
        seen.append(box[0]["x"].tolist())
        try:
            compat.recv_object_list(box, src=0, weights_only=True)
        except objcomm.ContentRefusedError:
            seen.append("refused pickle")
    compat.all_gather_object(out, rank)
    return seen + [out]


def test_weights_only_makes_the_objects_travel_safely(ranks3):
    results = ranks3.run(weights_only_is_safe)
    arrived = [((r,), [r, r + 1, r + 2]) for r in range(3)]
    for rank, seen in enumerate(results):
        assert seen[0] == arrived, (rank, seen)
        assert seen[1] == "ContentRefusedError", (rank, seen)  # ranks 1 and 2 sent pickle: every rank refuses it
        assert seen[2] == "ContentRefusedError", (rank, seen)  # restricted-pickle does not rebuild Custom
        assert seen[-1] == [0, 1, 2]
    assert results[1][3:5] == [[1.0, 1.0], "refused pickle"]


def test_weights_only_narrows_the_process_wide_settings_never_widens_them():
    """What ``weights_only=True`` makes of a call's settings: the process-wide serializer stays where it is safe, and
    the receivers accept the safe serializers among those the process-wide ``accept`` allows."""
    from objcomm._api.compat_calls import _safe

    assert _safe({"serializer": None}, False) == {"serializer": None}
    plain = _safe({"serializer": None}, True)
    assert plain["serializer"] == "restricted-pickle" and "pickle" not in plain["accept"]
    assert set(plain["accept"]) == set(serializers.registry.available(safe=True))
    previous = objcomm.configure(serializer="msgpack", accept=["msgpack", "pickle"])
    try:
        assert _safe({"serializer": None}, True) == {"serializer": None, "accept": ["msgpack"]}
        assert _safe({"accept": ["json"]}, True, sends=False) == {"accept": ["json"]}  # a receiver's own choice
    finally:
        objcomm.restore(previous)


def misuse_leaves_nobody_waiting() -> list:
    """Mistakes torch reports before communicating (leaving peers stuck) are reported after it here."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seen = []

    def record(call: Callable[[], Any]) -> None:
        try:
            call()
            seen.append("ok")
        except Exception as exc:
            seen.append(type(exc).__name__)

    record(lambda: compat.gather_object(rank, None, dst=0))  # no list on the destination
    record(lambda: compat.gather_object(rank, [None] * world, dst=0))  # a list on every rank
    record(lambda: compat.scatter_object_list([None], None, src=1))  # no input on the source
    record(lambda: compat.scatter_object_list("not a list", list(range(world)), src=0))  # type: ignore[arg-type]
    record(lambda: compat.broadcast_object_list([1, 2, 3] if rank == 0 else [None] * (rank + 1), src=0))
    record(lambda: compat.all_gather_object([None] * (world - 1), rank))  # too short: IndexError, as torch
    out: list = [None] * world
    compat.all_gather_object(out, rank)  # the group is still in step
    return seen + [out]


def test_misuse_raises_where_it_happened_and_the_group_stays_usable(ranks3):
    r0, r1, r2 = ranks3.run(misuse_leaves_nobody_waiting)
    assert r0 == ["ValueError", "ok", "RemoteError", "ValueError", "ok", "IndexError", [0, 1, 2]]
    assert r1 == ["ok", "ValueError", "ValueError", "ValueError", "ValueError", "IndexError", [0, 1, 2]]
    assert r2 == ["ok", "ValueError", "RemoteError", "ValueError", "ok", "IndexError", [0, 1, 2]]


def test_torchs_replaced_pickling_hooks_are_named_once(monkeypatch):
    """torch's object collectives pickle through distributed_c10d._pickler and _unpickler, which libraries replace (a
    find_class that maps classes, a reducer_override): the shims do not use them, and say so once, at the program's
    call (a reviewer's find: a class mapped on torch's path arrived unmapped, silently)."""
    import pickle

    import torch.distributed.distributed_c10d as c10d

    from objcomm._api import compat_calls

    class Mapping(pickle.Unpickler):
        pass

    monkeypatch.setattr(compat_calls, "_WARNED_OF_HOOKS", False)
    out: list = [None]
    with warnings.catch_warnings(record=True) as untouched:
        warnings.simplefilter("always")
        compat.all_gather_object(out, 0)
    monkeypatch.setattr(c10d, "_unpickler", Mapping)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.all_gather_object(out, 1)
        lst = ["keep"]
        compat.broadcast_object_list(lst)
    assert out == [1] and lst == ["keep"]
    assert not [w for w in untouched if "_unpickler" in str(w.message)]
    assert [(w.category, w.filename) for w in caught] == [(RuntimeWarning, __file__)]
    assert "_pickler or _unpickler was replaced" in str(caught[0].message)


def test_without_a_process_group_the_collectives_act_as_a_group_of_one():
    assert not dist.is_initialized()
    out: list = [None]
    compat.all_gather_object(out, {"a": (1,)})
    assert out == [{"a": (1,)}]
    gathered: list = [None]
    compat.gather_object("x", gathered)
    assert gathered == ["x"]
    lst = ["keep"]
    compat.broadcast_object_list(lst)
    assert lst == ["keep"]
    compat.scatter_object_list(out, ["only"], group_src=0)
    assert out == ["only"]
    with pytest.raises(ValueError, match="scatter_object_output_list is empty"):
        compat.scatter_object_list([], ["only"], group_src=0)
    with pytest.raises(objcomm.ObjcommError, match="init_process_group"):
        compat.send_object_list([1], dst=1)
    with pytest.raises(ValueError, match="Invalid destination rank"):  # to itself, as torch refuses with a group
        compat.send_object_list([1], dst=0)
    with pytest.raises(ValueError, match="Invalid source rank"):
        compat.recv_object_list([None], src=0)


def numpy_ranks(api_name: str) -> Any:
    """src and dst given as numpy integers, as torch takes them."""
    api = dist if api_name == "torch" else compat
    rank, world = dist.get_rank(), dist.get_world_size()
    import numpy as np

    box = ["from 1"] if rank == 1 else [None]
    api.broadcast_object_list(box, src=np.int64(1))
    gathered = [None] * world if rank == 1 else None
    api.gather_object(rank, gathered, dst=np.int64(1))
    return box, gathered


class Tagged(torch.Tensor):
    """A tensor subclass (torchvision's BoundingBoxes and the like)."""


def tensor_subclasses_and_attributes(api_name: str) -> Any:
    api = dist if api_name == "torch" else compat
    tagged = torch.arange(3.0).as_subclass(Tagged)
    annotated = torch.zeros(2)
    annotated.meta = "kept"  # type: ignore[attr-defined]
    out = [None] * dist.get_world_size()
    api.all_gather_object(out, [tagged, annotated, torch.ones(2)])
    other = out[1 - dist.get_rank()]
    return [type(t).__name__ for t in other], getattr(other[1], "meta", "lost"), other[0].tolist()


@pytest.mark.parametrize("scenario", [numpy_ranks, tensor_subclasses_and_attributes])
def test_numpy_ranks_and_tensor_subclasses_as_torch_has_them(scenario):
    from _ranks import get_pool

    pool = get_pool(2)
    assert pool.run(scenario, "objcomm") == pool.run(scenario, "torch")


# -- bad arguments: torch's exception type, torch's sentence first ------------------------------------


def bad_arguments(api_name: str) -> list:
    """Each bad call, made so that torch raises on every rank that makes it before communicating (so nobody
    waits), through torch, the shims, or torch's names patched; ``(type, text)`` of what each raised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = dist.new_group([0])  # global rank 1 is not part of it
    fn: Any = compat if api_name == "compat" else dist
    inputs = list(range(world)) if rank == 0 else None
    cases: list = [
        lambda: fn.gather_object(rank, None if rank == 0 else [None] * world, dst=0),  # missing / not wanted
        lambda: fn.scatter_object_list([], inputs, src=0),
        lambda: fn.scatter_object_list("out", inputs, src=0),
        lambda: fn.scatter_object_list([None] if rank == 0 else [], None, src=0),  # no input on the source
        lambda: fn.gather_object(rank, None, dst=0, group_dst=0),
        lambda: fn.broadcast_object_list([1], src=0, group_src=0),
        lambda: fn.scatter_object_list([None], inputs, src=0, group_src=0),
        lambda: fn.send_object_list([1], dst=1 - rank, group_dst=1 - rank),
        lambda: fn.recv_object_list([None], src=1 - rank, group_src=1 - rank),
        lambda: fn.send_object_list([1]),
        lambda: fn.recv_object_list([None]),
        lambda: fn.send_object_list([1], dst=rank),
        lambda: fn.recv_object_list([None], src=rank),
        lambda: fn.send_object_list([1], group_dst=rank),
    ]
    if rank == 0:  # a global rank outside the group, and this rank itself within it
        cases += [
            lambda: fn.gather_object(rank, [None], dst=1, group=mine),
            lambda: fn.broadcast_object_list([1], src=1, group=mine),
            lambda: fn.scatter_object_list([None], None, src=1, group=mine),
            lambda: fn.send_object_list([1], dst=1, group=mine),
            lambda: fn.recv_object_list([None], src=1, group=mine),
            lambda: fn.send_object_list([1], group=mine, group_dst=0),
        ]
    seen: List[Tuple[str, ...]] = []
    if api_name == "patched":
        compat.patch()
    try:
        for case in cases:
            try:
                case()
                seen.append(("returned",))
            except Exception as exc:
                seen.append((type(exc).__name__, re.sub(r" at 0x[0-9a-f]+", "", str(exc))))  # each run, its group
    finally:
        compat.unpatch()
    out: list = [None] * world
    compat.all_gather_object(out, rank)  # the group is still in step
    return seen + [out]


def test_bad_arguments_raise_torchs_type_with_torchs_sentence_first():
    from _ranks import get_pool

    pool = get_pool(2)
    theirs = pool.run(bad_arguments, "torch")
    ours = pool.run(bad_arguments, "compat")
    patched = pool.run(bad_arguments, "patched")
    for rank, (t, o, p) in enumerate(zip(theirs, ours, patched)):
        assert t[-1] == o[-1] == p[-1] == [0, 1]
        assert len(t) == len(o) == len(p) == (21 if rank == 0 else 15)
        for case, (their, our, through_torchs_names) in enumerate(zip(t[:-1], o[:-1], p[:-1])):
            for mine in (our, through_torchs_names):
                assert their[0] == mine[0] == "ValueError", (rank, case, their, mine)
                assert mine[1].startswith(their[1] + " (objcomm.compat: "), (rank, case, their, mine)
    sentences = {o[1].split(" (objcomm.compat: ")[0] for o in ours[0][:-1] + ours[1][:-1]}
    assert {
        "Argument ``gather_list`` must be specified on destination rank.",
        "Argument ``gather_list`` must NOT be specified on non-destination ranks.",
        "Expected argument scatter_object_output_list to be a list of size at least 1.",
        "source rank must provide non-None scatter_object_input_list",
        "Can't specify both group_rank and global_rank",
        "Must specify global_rank or group_rank",
        "Invalid destination rank: destination rank should not be the same as the rank of the current process.",
        "Invalid source rank: source rank should not be the same as the rank of the current process.",
    } < sentences
    assert "Global rank 1 is not part of group <torch.distributed.distributed_c10d.ProcessGroup object>" in sentences


def test_scatter_into_an_empty_list_says_torchs_sentence_first():
    with pytest.raises(ValueError) as caught:
        compat.scatter_object_list([], ["only"])
    text = str(caught.value)
    assert text.startswith("Expected argument scatter_object_output_list to be a list of size at least 1. (objcomm")
    assert "pass a list of at least one element (e.g. [None])" in text
