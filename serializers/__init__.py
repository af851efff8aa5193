"""Interchangeable serializers behind one registry; imports and works without torch.

Example::

    import serializers

    s = serializers.get("msgpack")
    s.loads(s.dumps({0: (1, 2), "tags": {"a"}}))     # {0: (1, 2), 'tags': {'a'}}
    serializers.available(safe=True)                   # ['json', 'msgpack', 'restricted-pickle']
    print(serializers.fidelity_table())                # what each one round-trips

Built-ins: ``pickle``, ``cloudpickle``, ``restricted-pickle``, ``msgpack``, ``json`` (orjson), and ``msgspec``
where msgspec is installed (``pip install msgspec``).
"""

from __future__ import annotations

from importlib.util import find_spec as _find_spec

from serializers._auto import AutoSerializer
from serializers._codecs import CodecRegistry, TypeCodec, codecs, register_type, unregister_type
from serializers._errors import (
    ContentRefusedError,
    DecodeError,
    EncodeError,
    ObjcommError,
    SerializationError,
    UnknownSerializerError,
)
from serializers._fidelity import PROBES, Verdict, fidelity, fidelity_table
from serializers._json import JsonSerializer
from serializers._msgpack import MsgpackSerializer
from serializers._msgspec import MsgspecSerializer
from serializers._pickle import CloudpickleSerializer, PickleSerializer
from serializers._protocol import FunctionSerializer, Serializer, SerializerProtocol
from serializers._registry import (
    ENTRY_POINT_GROUP,
    SerializerLike,
    SerializerRegistry,
    available,
    get,
    register,
    registry,
    unregister,
)
from serializers._restricted import RestrictedPickleSerializer

for _builtin in (
    PickleSerializer(),
    CloudpickleSerializer(),
    RestrictedPickleSerializer(),
    MsgpackSerializer(),
    JsonSerializer(),
):
    registry.register(_builtin)
del _builtin
if _find_spec("msgspec") is not None:  # optional: pip install msgspec
    registry.register(MsgspecSerializer())
registry.register(AutoSerializer())  # serializer="auto": per object, the fastest that carries it exactly

__all__ = [
    "AutoSerializer",
    "CloudpickleSerializer",
    "CodecRegistry",
    "ContentRefusedError",
    "DecodeError",
    "ENTRY_POINT_GROUP",
    "EncodeError",
    "FunctionSerializer",
    "JsonSerializer",
    "MsgpackSerializer",
    "MsgspecSerializer",
    "ObjcommError",
    "PROBES",
    "PickleSerializer",
    "RestrictedPickleSerializer",
    "SerializationError",
    "Serializer",
    "SerializerLike",
    "SerializerProtocol",
    "SerializerRegistry",
    "TypeCodec",
    "UnknownSerializerError",
    "Verdict",
    "available",
    "codecs",
    "fidelity",
    "fidelity_table",
    "get",
    "register",
    "register_type",
    "registry",
    "unregister",
    "unregister_type",
]
