"""One suite over every built-in serializer: round trips, memoryview input, errors with paths."""

from __future__ import annotations

import dataclasses
import datetime as dt
import subprocess
import sys
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
from _builtins import BUILTINS

import serializers
from serializers import DecodeError, EncodeError, SerializationError

pytestmark = pytest.mark.timeout(60)

PICKLES = ["pickle", "cloudpickle", "restricted-pickle"]
EXACT = PICKLES + ["msgpack"]

JSON_SAFE = {"metrics": {"loss": 0.25, "acc": [0.5, 1.0]}, "names": ["a", "é"], "n": None, "ok": True, "big": 2**63}
RICH = {
    0: (1, 2),
    "set": {1, 2},
    "fs": frozenset({"a"}),
    "bytes": b"\x00\xff",
    "nested": [{"x": [1, (2, 3)]}, OrderedDict(b=1, a=2)],
    "when": dt.datetime(2024, 1, 2, 3, 4, 5, 6),
    "day": dt.date(2024, 1, 2),
    "span": dt.timedelta(days=1, microseconds=5),
    "huge": -(2**100),
    "z": 1 - 1j,
}


def _same(a, b):
    return serializers._fidelity._same(a, b)


@pytest.mark.parametrize("name", BUILTINS)
def test_metadata(name):
    s = serializers.get(name)
    assert s.name == name
    assert isinstance(s.safe, bool) and s.description
    assert s.safe == (name in {"msgpack", "json", "restricted-pickle", "msgspec"})


@pytest.mark.parametrize("name", BUILTINS)
def test_json_like_round_trip(name):
    s = serializers.get(name)
    assert s.loads(s.dumps(JSON_SAFE)) == JSON_SAFE


@pytest.mark.parametrize("name", EXACT)
def test_rich_types_round_trip_exactly(name):
    s = serializers.get(name)
    assert _same(s.loads(s.dumps(RICH)), RICH)


@pytest.mark.parametrize("name", EXACT)
def test_numpy_keeps_dtype_and_shape(name):
    s = serializers.get(name)
    for arr in [
        np.arange(12, dtype=np.int16).reshape(3, 4),
        np.zeros((0, 2), np.float64),
        np.asfortranarray(np.eye(3)),
    ]:
        back = s.loads(s.dumps({"a": arr}))["a"]
        assert back.dtype == arr.dtype and back.shape == arr.shape and np.array_equal(back, arr)
    scalar = s.loads(s.dumps(np.float32(1.5)))
    assert type(scalar) is np.float32 and scalar == 1.5


@pytest.mark.parametrize("name", BUILTINS)
def test_loads_takes_a_memoryview_slice(name):
    s = serializers.get(name)
    data = bytes(s.dumps(JSON_SAFE))
    buffer = bytearray(b"junk" + data + b"tail")
    assert s.loads(memoryview(buffer)[4 : 4 + len(data)]) == JSON_SAFE


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("garbage", [b"", b"\xc1", b"\xff" * 7, b"not a payload at all"])
def test_garbage_raises_decode_error(name, garbage):
    with pytest.raises(DecodeError):
        serializers.get(name).loads(garbage)


def test_json_converts_tuples_and_refuses_with_a_path():
    s = serializers.get("json")
    assert s.loads(s.dumps({"t": (1, 2)})) == {"t": [1, 2]}
    with pytest.raises(EncodeError, match=r"json cannot encode set at \$\['metrics'\]\[2\]; msgpack or pickle can"):
        s.dumps({"metrics": [1, 2, {3}]})
    with pytest.raises(EncodeError, match=r"dict key 0 \(int\) in the dict at \$\['x'\]"):
        s.dumps({"x": {0: 1}})
    with pytest.raises(EncodeError, match=r"cannot encode .*_Plain at \$\[.x.\]; pickle can; or register a codec"):
        s.dumps({"x": _Plain()})  # a class instance: msgpack cannot either, without a codec


def test_json_never_writes_nan_as_null():
    s = serializers.get("json")
    with pytest.raises(EncodeError, match=r"float nan at \$\['a'\]\[1\]"):
        s.dumps({"a": [1.0, float("nan")]})
    assert s.loads(s.dumps({"a": None})) == {"a": None}


def test_json_refuses_ints_beyond_64_bits():
    with pytest.raises(EncodeError, match=r"int at \$\[0\]"):
        serializers.get("json").dumps([2**70])


def test_msgpack_error_names_type_and_path():
    with pytest.raises(EncodeError, match=r"msgpack cannot encode object at \$\['x'\]\[0\]"):
        serializers.get("msgpack").dumps({"x": [object()]})


@dataclasses.dataclass
class _Shape:  # as accelerate's TensorInformation: a dataclass whose fields msgpack refuses too
    shape: Any
    kind: Any


def test_msgpack_error_names_the_object_it_refuses_whole_not_a_field_it_never_reached():
    """A helper's find: a dataclass without a codec was reported as its first field's type (torch.Size), and after a
    codec for that, as the next field's; msgpack takes such objects only whole, through a codec of their own."""
    import collections

    s = serializers.get("msgpack")
    with pytest.raises(EncodeError, match=r"msgpack cannot encode .*_Shape at \$\[0\]\[1\] "):
        s.dumps([[1, _Shape(object(), {1})]])
    with pytest.raises(EncodeError, match=r"msgpack cannot encode collections.Counter at \$\['c'\] "):
        s.dumps({"c": collections.Counter(a=object())})
    # a value msgpack takes (an extension, a codec) whose contents it refuses: the innermost culprit, as before
    with pytest.raises(EncodeError, match=r"msgpack cannot encode object at \$\['a'\]\['x'\] "):
        s.dumps({"a": OrderedDict(x=object())})
    serializers.register_type(_Shape, lambda v: [v.shape, v.kind], lambda v: _Shape(*v), name="test.shape")
    try:
        with pytest.raises(EncodeError, match=r"msgpack cannot encode object at \$\['k'\]\.shape "):
            s.dumps({"k": _Shape(object(), 1)})
    finally:
        serializers.unregister_type(_Shape)
    if "msgspec" in serializers.available():  # msgspec takes dataclasses itself: the innermost culprit stays
        with pytest.raises(EncodeError, match=r"msgspec cannot encode object at \$\[0\]\.shape "):
            serializers.get("msgspec").dumps([_Shape(object(), 1)])


def test_pickle_error_suggests_cloudpickle():
    with pytest.raises(EncodeError, match=r"pickle cannot encode function at \$\['f'\].*cloudpickle can"):
        serializers.get("pickle").dumps({"f": lambda x: x})


def test_cloudpickle_carries_lambdas_and_closures():
    s = serializers.get("cloudpickle")
    k = 3
    back = s.loads(s.dumps({"f": lambda x: x + k}))
    assert back["f"](1) == 4


def test_cloudpickle_carries_classes_defined_in_main():
    code = (
        "import serializers\n"
        "class Local:\n"
        "    def __init__(self): self.v = 7\n"
        "s = serializers.get('cloudpickle')\n"
        "import sys; sys.stdout.buffer.write(bytes(s.dumps(Local())))\n"
    )
    payload = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, timeout=60).stdout
    assert serializers.get("cloudpickle").loads(payload).v == 7


def test_serialization_errors_are_objcomm_errors():
    assert issubclass(EncodeError, SerializationError) and issubclass(DecodeError, SerializationError)
    assert issubclass(SerializationError, serializers.ObjcommError)


def test_serializers_import_without_torch():
    code = "import sys, serializers; serializers.get('msgpack').dumps({1: 2}); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("name", ["json", "msgpack", "msgspec"])
def test_a_class_from_a_torch_submodule_is_named_with_its_module(name):
    import torch

    with pytest.raises(EncodeError, match=r"torch\.nn\.modules\.linear\.Linear"):
        serializers.get(name).dumps({"model": torch.nn.Linear(1, 1)})


# -- the lifting pickler kept between dumps (serializers._pickle._dump) -------------------------------------------


class _Lifted:
    """A value the test's lift takes out of band."""

    def __init__(self, n: int) -> None:
        self.n = n


class _Plain:
    """A value pickled in band."""


class _Lift:
    """Lifts :class:`_Lifted` values; restores them by key."""

    def __init__(self) -> None:
        self.held: list = []

    def __call__(self, value):
        if isinstance(value, _Lifted):
            self.held.append(value)
            return len(self.held) - 1
        return None


def _lifted_round_trip(s, obj):
    lift = _Lift()
    return s.loads(s.dumps(obj, lift=lift), restore=lambda key: lift.held[key])


@pytest.mark.parametrize("name", ["pickle", "restricted-pickle"])
def test_a_kept_pickler_pickles_each_object_as_a_new_one_would(name):
    import pickle as stdlib

    from serializers import _pickle

    s = serializers.registry.guarded(name)
    base = s._pickler_base()
    cls = _pickle._lifting(base)
    fresh = []
    for obj in [{"a": [1, 2]}, "shared", ["x", "x", ("x",)], {"a": [1, 2]}]:  # the memo does not carry over
        file = __import__("io").BytesIO()
        pickler = cls(file, protocol=_pickle.PROTOCOL)
        pickler._lift = _Lift()
        pickler.dump(obj)
        fresh.append((obj, file.getvalue()))
    kept = [(obj, s.dumps(obj, lift=_Lift())) for obj, _ in fresh]
    assert [bytes(data) for _, data in kept] == [data for _, data in fresh]
    assert cls.spares, "a small pickle leaves its pickler for the next call"
    assert [stdlib.loads(data) for _, data in kept] == [obj for obj, _ in fresh]  # earlier results not overwritten
    value = _lifted_round_trip(s, {"v": _Lifted(3), "w": [_Lifted(4)]})  # and lifts through the kept one
    assert value["v"].n == 3 and value["w"][0].n == 4


def test_a_kept_pickler_holds_nothing_of_the_last_call():
    import gc
    import weakref

    from serializers import _pickle

    s = serializers.registry.guarded("pickle")
    lift, obj = _Lift(), {"pickled": _Plain(), "lifted": _Lifted(1)}
    refs = [weakref.ref(lift), weakref.ref(obj["pickled"]), weakref.ref(obj["lifted"])]
    s.dumps(obj, lift=lift)
    del lift, obj
    gc.collect()
    assert [ref() for ref in refs] == [None] * 3  # neither the lift (and what it lifted) nor the memo's objects
    assert _pickle._lifting(s._pickler_base()).spares


def test_a_pickler_that_raised_or_pickled_something_large_is_not_kept():
    from serializers import _pickle

    s = serializers.registry.guarded("pickle")
    spares = _pickle._lifting(s._pickler_base()).spares
    s.dumps("warm", lift=_Lift())
    kept = len(spares)
    with pytest.raises(EncodeError):
        s.dumps({"ok": 1, "bad": lambda: 0}, lift=_Lift())
    assert kept and len(spares) == kept - 1  # the pickler it took is not given back
    assert s.loads(s.dumps({"ok": 2}, lift=_Lift())) == {"ok": 2}  # the next call is whole
    taken = len(spares)
    big = s.dumps(b"z" * (_pickle.SPARE_BYTES + 1), lift=_Lift())
    assert isinstance(big, memoryview) and len(spares) == taken - 1  # handed over with its buffer, not kept
    assert s.loads(big) == b"z" * (_pickle.SPARE_BYTES + 1)


def test_threads_and_a_dumps_inside_a_reducer_each_get_their_own_pickler():
    import threading

    s = serializers.registry.guarded("pickle")

    class Nested:
        def __reduce__(self):
            inner = bytes(s.dumps({"inner": [1, 2, 3]}, lift=_Lift()))  # while the outer pickler is busy
            return (bytes, (inner,))

    outer = s.loads(s.dumps({"outer": Nested(), "after": "x" * 50}, lift=_Lift()))
    assert s.loads(outer["outer"]) == {"inner": [1, 2, 3]} and outer["after"] == "x" * 50

    wrong: list = []

    def work(t: int) -> None:
        for i in range(500):
            obj = {"thread": t, "i": i, "pad": "p" * (t * 7 % 50)}
            if s.loads(s.dumps(obj, lift=_Lift())) != obj:
                wrong.append((t, i))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_only_picklers_that_say_they_keep_no_state_are_kept():
    from serializers import _pickle

    cloud = serializers.registry.guarded("cloudpickle")
    assert not cloud._reusable  # cloudpickle's pickler keeps the globals of the functions it pickled
    cloud.dumps({"f": lambda: 1}, lift=_Lift())
    assert _pickle._lifting(cloud._pickler_base()).spares == []

    class Mine(_pickle.PickleSerializer):  # a subclass may bring a pickler with state: not kept unless it says so
        name = "mine"

    class MineStateless(_pickle.PickleSerializer):
        name = "mine-stateless"
        _reusable = True

    assert not Mine()._reusable and MineStateless()._reusable
    assert all(serializers.registry.guarded(name)._reusable for name in ("pickle", "restricted-pickle"))
