"""The registry: register/get/unregister/available, replace=, entry points loaded lazily."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from _builtins import BUILTINS

import serializers
from serializers import DecodeError, EncodeError, Serializer, SerializerRegistry, UnknownSerializerError

pytestmark = pytest.mark.timeout(60)


def test_builtins_available():
    assert {"pickle", "cloudpickle", "restricted-pickle", "msgpack", "json", "msgspec", "auto"} <= set(
        serializers.available()
    )
    fresh = subprocess.run(
        [sys.executable, "-c", "import serializers; print(*serializers.available())"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert set(fresh) == set(BUILTINS) | {"auto"}  # tests/_builtins.py is the one list of them
    assert serializers.available(safe=True) == ["json", "msgpack", "msgspec", "restricted-pickle"]


def test_register_name_with_functions():
    reg = SerializerRegistry()
    s = reg.register("upper", dumps=lambda o: o.upper().encode(), loads=lambda b: bytes(b).decode(), safe=True)
    assert reg.get("upper") is s and s.safe and reg.available() == ["upper"]
    assert s.loads(s.dumps("hi")) == "HI"
    with pytest.raises(ValueError, match="already registered"):
        reg.register("upper", dumps=str.encode, loads=bytes.decode)
    reg.register("upper", dumps=str.encode, loads=lambda b: bytes(b).decode(), replace=True)
    assert reg.get("upper").loads(reg.get("upper").dumps("hi")) == "hi"
    reg.unregister("upper")
    with pytest.raises(UnknownSerializerError, match="no serializer named 'upper'"):
        reg.get("upper")


def test_register_object_and_bad_objects():
    class Rev(Serializer):
        name, safe, description = "rev", True, "reversed utf-8"

        def dumps(self, obj, /, **_):
            return obj[::-1].encode()

        def loads(self, data, /, **_):
            return bytes(data).decode()[::-1]

    reg = SerializerRegistry()
    reg.register(Rev())
    assert reg.get("rev").loads(reg.get("rev").dumps("abc")) == "abc"
    with pytest.raises(TypeError, match="lacks"):
        reg.register(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="both dumps and loads"):
        reg.register("half", dumps=str.encode)


def test_foreign_serializers_are_wrapped_once_when_registered():
    class Bare:  # the least a serializer needs: no base class, no keyword hooks, no supports_external
        name = "bare"

        def dumps(self, obj, /):
            return str(obj).encode() if type(obj) is int else obj.no_such_attribute

        def loads(self, data, /):
            return int(bytes(data))

    reg = SerializerRegistry()
    bare = Bare()
    assert reg.register(bare) is bare and reg.get("bare") is bare, "get() returns what was registered"
    s = reg.guarded("bare")
    assert s is reg.guarded("bare") is reg.guarded(bare) and not s.supports_external
    assert s.loads(s.dumps(7, lift=lambda value: None), restore=lambda key: None) == 7
    with pytest.raises(EncodeError, match="bare cannot encode str: AttributeError") as encoding:
        s.dumps("x")
    with pytest.raises(DecodeError, match="bare cannot decode 1 bytes: ValueError") as decoding:
        s.loads(b"x")
    assert isinstance(encoding.value.__cause__, AttributeError) and isinstance(decoding.value.__cause__, ValueError)
    assert serializers.registry.guarded("msgpack") is serializers.get("msgpack"), "built-ins are not wrapped"


def test_unknown_name_lists_registered():
    with pytest.raises(UnknownSerializerError) as info:
        serializers.get("yaml")
    assert "msgpack" in str(info.value) and "pickle" in str(info.value)
    assert isinstance(info.value, LookupError)
    with pytest.raises(UnknownSerializerError, match=r"no serializer named 'msgpak' .*; did you mean 'msgpack'\?"):
        serializers.get("msgpak")


def test_get_passes_serializer_objects_through():
    s = serializers.get("json")
    assert serializers.get(s) is s
    assert serializers.get(None).name == "pickle"


def test_entry_point_is_discovered_lazily(tmp_path):
    """A package advertising a serializer under objcomm.serializers is found on first lookup."""
    pkg = tmp_path / "rot13_serializer.py"
    pkg.write_text(
        textwrap.dedent("""
        import codecs
        from serializers import Serializer
        LOADED = []
        class Rot13(Serializer):
            name, safe, description = "rot13", True, "str only"
            def __init__(self):
                LOADED.append(1)
            def dumps(self, obj, /, **_):
                return codecs.encode(obj, "rot13").encode()
            def loads(self, data, /, **_):
                return codecs.decode(bytes(data).decode(), "rot13")
    """)
    )
    dist_info = tmp_path / "rot13_serializer-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: rot13-serializer\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[objcomm.serializers]\nrot13 = rot13_serializer:Rot13\n")
    code = textwrap.dedent("""
        import sys, serializers, rot13_serializer
        assert rot13_serializer.LOADED == [], "loaded at import time"
        s = serializers.get("rot13")
        assert rot13_serializer.LOADED == [1]
        assert s.loads(s.dumps("hello")) == "hello" and bytes(s.dumps("hello")) == b"uryyb"
        assert "rot13" in serializers.available(safe=True)
        print("ok")
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{__import__('os').getcwd()}"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
