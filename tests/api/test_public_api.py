"""The public surface is what __init__ exports, on purpose."""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys
import traceback

import pytest

import objcomm
import serializers

pytestmark = pytest.mark.timeout(30)


def test_objcomm_exports():
    assert sorted(objcomm.__all__) == sorted(
        [
            "all_gather",
            "gather",
            "broadcast",
            "scatter",
            "send",
            "recv",
            "all_to_all",
            "reduce",
            "all_reduce",
            "scan",
            "exscan",
            "Communicator",
            "collect_results",
            "compat",
            "device_for_backend",
            "ObjcommError",
            "EncodeError",
            "DecodeError",
            "RemoteError",
            "FrameError",
            "TooLargeError",
            "UnknownSerializerError",
            "ContentRefusedError",
            "CommunicationError",
            "SerializationError",
            "MissingDependencyError",
            "configure",
            "restore",
            "settings",
            "Settings",
            "__version__",
            "isend",
            "irecv",
            "sendrecv",
            "Request",
            "WaitTimeoutError",
            "serializers",
            "connect",
        ]
    )
    for name in objcomm.__all__:
        assert hasattr(objcomm, name), name
    assert not [n for n in objcomm.__all__ if n.startswith("_") and n != "__version__"]


def test_serializers_exports():
    for name in serializers.__all__:
        assert hasattr(serializers, name), name
    assert sorted(serializers.__all__) == sorted(
        [
            "register",
            "get",
            "available",
            "unregister",
            "registry",
            "SerializerRegistry",
            "SerializerLike",
            "ENTRY_POINT_GROUP",
            "register_type",
            "unregister_type",
            "codecs",
            "CodecRegistry",
            "TypeCodec",
            "fidelity",
            "fidelity_table",
            "PROBES",
            "Verdict",
            "Serializer",
            "SerializerProtocol",
            "FunctionSerializer",
            "PickleSerializer",
            "CloudpickleSerializer",
            "RestrictedPickleSerializer",
            "MsgpackSerializer",
            "JsonSerializer",
            "ObjcommError",
            "SerializationError",
            "EncodeError",
            "DecodeError",
            "UnknownSerializerError",
            "ContentRefusedError",
            "MsgspecSerializer",
            "AutoSerializer",
        ]
    )


OBJCOMM_SERIALIZERS = """
import sys
import objcomm
assert "serializers" not in sys.modules, "import objcomm imports no serializer yet"
from objcomm import serializers as a
import objcomm.serializers as b
import serializers as c
assert a is b is c is objcomm.serializers is sys.modules["objcomm.serializers"], (a, b, c)
assert a.get("msgpack").loads(a.get("msgpack").dumps({0: (1, 2)})) == {0: (1, 2)}
assert "torch" not in sys.modules, "torch was imported"
"""


def test_objcomm_serializers_is_the_serializers_package():
    """``objcomm.serializers`` is the documented name: the same module object as ``import serializers``."""
    done = subprocess.run([sys.executable, "-c", OBJCOMM_SERIALIZERS], capture_output=True, text=True, timeout=25)
    assert done.returncode == 0, done.stderr
    assert objcomm.serializers is serializers
    assert "serializers" in dir(objcomm)


def test_dir_lists_the_public_names_and_not_the_helpers_of_init():
    """``dir(objcomm)`` (tab completion, ``help``) shows what ``__all__`` lists, not what ``__init__`` imports."""
    shown = dir(objcomm)
    assert set(objcomm.__all__) <= set(shown)
    assert not {"Any", "Dict", "List", "Tuple", "TYPE_CHECKING", "importlib", "annotations"} & set(shown)
    assert [name for name in shown if not name.startswith("__")] == sorted(n for n in objcomm.__all__ if n[0] != "_")


ERRORS = [
    "ObjcommError",
    "SerializationError",
    "EncodeError",
    "DecodeError",
    "UnknownSerializerError",
    "ContentRefusedError",
    "FrameError",
    "TooLargeError",
    "CommunicationError",
    "WaitTimeoutError",
    "RemoteError",
]

UNPICKLE = """
import pickle, sys
errors = pickle.loads(sys.stdin.buffer.read())
print(" ".join(f"{type(e).__module__}.{type(e).__qualname__}:{e.args[0] if e.args else ''}" for e in errors))
assert "torch" not in sys.modules, "torch was imported"
"""


def _instance(name: str) -> BaseException:
    cls = getattr(objcomm, name)
    if name == "RemoteError":  # (what it says of the call: every rank raised, unless a liar split the group)
        return cls("all_gather", {1: ("KeyError", "boom")}, "so the ranks below rank 1 received no result")
    return cls(f"{name}-message")


@pytest.mark.parametrize("name", ERRORS)
def test_errors_show_their_public_names(name):
    cls = getattr(objcomm, name)
    assert cls.__module__ == "objcomm" and getattr(objcomm, cls.__qualname__) is cls
    error = _instance(name)
    assert repr(error).startswith(f"{name}(")
    shown = traceback.format_exception_only(type(error), error)[-1]
    assert shown.startswith(f"objcomm.{name}: "), shown
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls and copy.args == error.args and str(copy) == str(error)


def test_errors_unpickle_in_a_fresh_process_through_objcomm():
    """A pickled error names ``objcomm.DecodeError``; unpickling it imports objcomm (no torch) and finds it."""
    errors = [_instance(name) for name in ERRORS if name != "RemoteError"]
    data = pickle.dumps(errors)
    assert b"serializers._errors" not in data and b"objcomm._errors" not in data
    done = subprocess.run([sys.executable, "-c", UNPICKLE], input=data, capture_output=True, timeout=25)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().split() == [f"objcomm.{type(e).__name__}:{e.args[0]}" for e in errors]


def test_one_exception_root():
    errors = [getattr(objcomm, n) for n in objcomm.__all__ if n.endswith("Error")]
    assert all(issubclass(e, objcomm.ObjcommError) for e in errors)
    assert objcomm.ObjcommError is serializers.ObjcommError


def test_public_callables_have_docstrings():
    for module in (objcomm, serializers):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj):
                assert obj.__doc__ and obj.__doc__.strip(), f"{module.__name__}.{name} has no docstring"


def test_configure_validates_and_restores():
    before = objcomm.settings()
    previous = objcomm.configure(max_bytes=1 << 20, accept=["msgpack"])
    try:
        assert objcomm.settings().max_bytes == 1 << 20 and objcomm.settings().accept == frozenset({"msgpack"})
        with pytest.raises(TypeError, match="unknown settings"):
            objcomm.configure(colour="blue")
        with pytest.raises(ValueError, match="slot_bytes must be at least"):
            objcomm.configure(slot_bytes=8)
    finally:
        objcomm.restore(previous)
    assert objcomm.settings() == before


def test_communicator_validates_eagerly():
    with pytest.raises(objcomm.UnknownSerializerError):
        objcomm.Communicator(serializer="yaml")
    with pytest.raises(ValueError, match="max_bytes"):
        objcomm.Communicator(max_bytes=0)


@pytest.mark.parametrize("method", ["all_gather", "broadcast", "send", "recv"])
def test_a_method_that_tries_the_express_path_first_gates_it_on_every_option_it_takes(method):
    """all_gather, broadcast and recv take the communicator's defaults without resolving anything (and send the
    express path) only where no per-call option is given: each option a method takes must be in that test, or a new
    one would be dropped silently (objcomm._settings.CALL_KNOBS)."""
    from objcomm._api.point_to_point import PointToPoint
    from objcomm._settings import CALL_KNOBS

    fn = getattr(objcomm.Communicator, method)
    taken = [name for name in inspect.signature(fn).parameters if name in CALL_KNOBS]
    assert taken, method
    source = inspect.getsource(PointToPoint._short_send if method == "send" else inspect.unwrap(fn))
    assert [name for name in taken if f"{name} is None" not in source and f"{name} is not None" not in source] == []
