"""objcomm: move Python objects between PyTorch ranks, with the serializer of your choice.

Example (under ``torchrun``, or in a plain process where every call acts as a group of one)::

    import objcomm

    parts = objcomm.all_gather({"rank": rank, "loss": loss}, serializer="msgpack")
    config = objcomm.broadcast(config if rank == 0 else None, src=0)
    pending = objcomm.all_gather(stats, async_op=True)   # a Request; pending.wait() gives the list

Serializers live in the torch-free ``serializers`` package; see ``serializers.available()``.
"""

from __future__ import annotations

from . import compat
from ._api import all_gather, broadcast, gather, irecv, isend, recv, scatter, send
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
    WaitTimeoutError,
)
from ._requests import Request
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
    "Request",
    "SerializationError",
    "Settings",
    "TooLargeError",
    "UnknownSerializerError",
    "WaitTimeoutError",
    "__version__",
    "all_gather",
    "broadcast",
    "collect_results",
    "compat",
    "configure",
    "device_for_backend",
    "gather",
    "irecv",
    "isend",
    "recv",
    "restore",
    "scatter",
    "send",
    "settings",
]
