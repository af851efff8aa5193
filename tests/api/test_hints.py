"""Error hints follow the cause: cloudpickle is suggested only for what it carries, and code of the
user's own that raised (a ``__reduce__``, a ``__getstate__``, the op of ``reduce``/``all_reduce``) is
named as such, with what it raised, on every rank and at world size 1."""

from __future__ import annotations

import threading
from typing import Any, Dict, List

import pytest
import torch.distributed as dist
from _ranks import get_pool

import objcomm
from objcomm import serializers

pytestmark = pytest.mark.timeout(120)

PICKLES = ["pickle", "cloudpickle", "restricted-pickle"]
CLOUDPICKLE_HINT = "cloudpickle can carry"


class RaisingReduce:
    def __reduce__(self) -> Any:
        raise ValueError("nope")


class RaisingGetstate:
    def __getstate__(self) -> Any:
        raise RuntimeError("no state")


def _local_function() -> Any:
    def inner() -> None:
        pass

    return inner


def encode_error(serializer: str, obj: Any) -> str:
    with pytest.raises(objcomm.EncodeError) as caught:
        serializers.get(serializer).dumps(obj)
    return str(caught.value)


@pytest.mark.parametrize("value", [lambda x: x, _local_function()], ids=["lambda", "local-function"])
@pytest.mark.parametrize("serializer", ["pickle", "restricted-pickle"])
def test_what_pickle_finds_no_name_for_is_sent_to_cloudpickle(serializer, value):
    message = encode_error(serializer, {"f": value})
    assert f"{serializer} cannot encode function at $['f']" in message
    assert CLOUDPICKLE_HINT in message
    assert serializers.get("cloudpickle").loads(serializers.get("cloudpickle").dumps(value)) is not None


@pytest.mark.parametrize("serializer", PICKLES)
@pytest.mark.parametrize(
    ("value", "hook", "raised"),
    [
        (RaisingReduce(), "RaisingReduce.__reduce__", "ValueError: nope"),
        (RaisingGetstate(), "RaisingGetstate.__getstate__", "RuntimeError: no state"),
    ],
    ids=["__reduce__", "__getstate__"],
)
def test_the_objects_own_code_raising_is_named_and_no_serializer_suggested(serializer, value, hook, raised):
    message = encode_error(serializer, {"a": [value]})
    assert f"at $['a'][0]: {hook} (test_hints.py, line " in message
    assert f"raised {raised}" in message
    assert "the object's own code" in message and "fix it there" in message
    assert CLOUDPICKLE_HINT not in message
    assert "pickle carries more" not in message  # restricted-pickle's hint


def test_a_lock_is_not_sent_to_cloudpickle_which_cannot_carry_it_either():
    message = encode_error("pickle", {"lock": threading.Lock()})
    assert "cannot pickle '_thread.lock' object" in message
    assert "cloudpickle" not in message
    assert "no pickle carries it" in message


def test_without_a_group_the_same_hints_reach_the_caller():
    with pytest.raises(objcomm.EncodeError, match=r"RaisingReduce.__reduce__ .* raised ValueError: nope") as caught:
        objcomm.all_gather({"a": RaisingReduce()})
    assert CLOUDPICKLE_HINT not in str(caught.value)
    with pytest.raises(objcomm.EncodeError, match=CLOUDPICKLE_HINT):
        objcomm.all_gather({"f": lambda x: x})


def gathers(what: str) -> Dict[str, Any]:
    """Rank 1 gathers something it cannot encode; every rank's RemoteError quotes the right hint."""
    rank = dist.get_rank()
    obj: Any = {"r": rank}
    if rank == 1:
        obj = {"a": RaisingReduce()} if what == "reduce" else {"f": lambda x: x}
    try:
        objcomm.all_gather(obj)
    except objcomm.RemoteError as exc:
        return {"message": str(exc), "types": [t for t, _ in exc.failures.values()]}
    return {"message": "returned", "types": []}


def test_on_a_group_every_rank_gets_the_hint_of_the_cause():
    for result in get_pool(2).run(gathers, "reduce"):
        assert result["types"] == ["ValueError"]
        assert "RaisingReduce.__reduce__" in result["message"] and "ValueError: nope" in result["message"]
        assert "cloudpickle" not in result["message"] and "pick a serializer" not in result["message"]
    for result in get_pool(2).run(gathers, "lambda"):
        assert CLOUDPICKLE_HINT in result["message"]


def my_op(a: Any, b: Any) -> Any:
    raise ValueError("op says no")


def reduces(op: Any) -> List[Any]:
    """What all_reduce and reduce raise (or return) with ``op``, as picklable facts."""
    rank = dist.get_rank()
    outcomes: List[Any] = []
    for call in (lambda: objcomm.all_reduce({"r": rank}, op), lambda: objcomm.reduce({"r": rank}, op, dst=0)):
        try:
            outcomes.append({"returned": call()})
        except objcomm.RemoteError as exc:
            outcomes.append(
                {
                    "message": str(exc),
                    "failures": exc.failures,
                    "is_value_error": isinstance(exc, ValueError),
                    "cause": repr(exc.__cause__),
                }
            )
    return outcomes


def test_a_raising_op_function_is_named_and_serializers_are_not():
    for rank, outcomes in enumerate(get_pool(2).run(reduces, my_op)):
        for outcome in outcomes:
            message = outcome["message"]
            assert list(outcome["failures"]) == [0], "group rank 0 combines, so its op raised"
            kind, reported = outcome["failures"][0]
            assert kind == "ValueError"
            assert reported.startswith("the op function my_op (test_hints.py, line ")
            assert "raised ValueError: op says no" in reported
            assert "a from group rank 0 and b from group rank 1" in reported
            assert "fix my_op" in reported
            assert "serializer" not in message and "cloudpickle" not in message
            if rank == 0:  # the rank whose op raised: also the op's type, chained to what it raised
                assert outcome["is_value_error"]
                assert "op says no" in outcome["cause"]


def test_a_named_op_that_cannot_combine_the_objects_says_so():
    for outcomes in get_pool(2).run(reduces, "sum"):
        for outcome in outcomes:
            kind, reported = outcome["failures"][0]
            assert kind == "TypeError"
            assert reported.startswith("op 'sum' raised TypeError: unsupported operand")
            assert "choose another op or pass a function" in reported
            assert "serializer" not in outcome["message"]


def test_at_world_size_1_the_op_is_never_called():
    """A group of one (or no group) has nothing to combine: the object comes back, op untouched."""
    assert get_pool(1).run(reduces, my_op) == [[{"returned": {"r": 0}}, {"returned": {"r": 0}}]]
    assert objcomm.all_reduce({"r": 0}, my_op) == {"r": 0}
    assert objcomm.reduce({"r": 0}, my_op) == {"r": 0}
