"""objcomm: move Python objects between PyTorch ranks, with the serializer of your choice.

Example (under ``torchrun``, or in a plain process where every call acts as a group of one)::

    import objcomm

    parts = objcomm.all_gather({"rank": rank, "loss": loss}, serializer="msgpack")
    config = objcomm.broadcast(config if rank == 0 else None, src=0)

Serializers live in the torch-free ``serializers`` package; see ``serializers.available()``.
"""

from __future__ import annotations

from . import compat
from ._api import all_gather, all_reduce, all_to_all, broadcast, gather, recv, reduce, scatter, send
from ._collect import collect_results
from ._communicator import Communicator
from ._compression import MissingDependencyError
from ._device import device_for_backend
from ._errors import (
    CommunicationError,
    ContentRefusedError,
    DecodeError,
    EncodeError,
    FrameError,
    ObjcommError,
    RemoteError,
    SerializationError,
    TooLargeError,
    UnknownSerializerError,
)
from ._settings import Settings, configure, restore, settings

__version__ = "0.1.0"

__all__ = [
    "CommunicationError",
    "Communicator",
    "ContentRefusedError",
    "DecodeError",
    "EncodeError",
    "FrameError",
    "MissingDependencyError",
    "ObjcommError",
    "RemoteError",
    "SerializationError",
    "Settings",
    "TooLargeError",
    "UnknownSerializerError",
    "__version__",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "collect_results",
    "compat",
    "configure",
    "device_for_backend",
    "gather",
    "recv",
    "reduce",
    "restore",
    "scatter",
    "send",
    "settings",
]
