"""The public surface is what __init__ exports, on purpose."""

from __future__ import annotations

import inspect

import pytest

import objcomm
import serializers

pytestmark = pytest.mark.timeout(30)


def test_objcomm_exports():
    assert sorted(objcomm.__all__) == sorted([
        "all_gather", "gather", "broadcast", "scatter", "send", "recv", "all_to_all", "reduce", "all_reduce",
        "Communicator", "collect_results",
        "compat", "device_for_backend", "ObjcommError", "EncodeError", "DecodeError", "RemoteError", "FrameError",
        "TooLargeError", "UnknownSerializerError", "ContentRefusedError", "CommunicationError", "SerializationError",
        "MissingDependencyError", "configure", "restore", "settings", "Settings", "__version__",
        "isend", "irecv", "Request", "WaitTimeoutError",
    ])
    for name in objcomm.__all__:
        assert hasattr(objcomm, name), name
    assert not [n for n in objcomm.__all__ if n.startswith("_") and n != "__version__"]


def test_serializers_exports():
    for name in serializers.__all__:
        assert hasattr(serializers, name), name
    assert sorted(serializers.__all__) == sorted([
        "register", "get", "available", "unregister", "registry", "SerializerRegistry", "SerializerLike",
        "ENTRY_POINT_GROUP", "register_type", "unregister_type", "codecs", "CodecRegistry", "TypeCodec",
        "fidelity", "fidelity_table", "PROBES", "Verdict", "Serializer", "SerializerProtocol", "FunctionSerializer",
        "PickleSerializer", "CloudpickleSerializer", "RestrictedPickleSerializer", "MsgpackSerializer",
        "JsonSerializer", "ObjcommError", "SerializationError", "EncodeError", "DecodeError",
        "UnknownSerializerError", "ContentRefusedError",
    ])


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
