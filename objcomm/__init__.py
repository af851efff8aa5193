"""objcomm: move Python objects between PyTorch ranks, with the serializer of your choice.

Example (under ``torchrun``, or in a plain process where every call acts as a group of one)::

    import objcomm

    parts = objcomm.all_gather({"rank": rank, "loss": loss}, serializer="msgpack")
    config = objcomm.broadcast(config if rank == 0 else None, src=0)
    pending = objcomm.all_gather(stats, async_op=True)   # a Request; pending.wait() gives the list

Serializers live in the torch-free ``serializers`` package, reached as ``objcomm.serializers``
(``from objcomm import serializers``; the same module object as ``import serializers``); see
``serializers.available()``. Exceptions carry their public names (``objcomm.DecodeError``).

Each public name is imported from its private module on first use (PEP 562), so ``import objcomm``
and ``objcomm --help`` do not import torch; ``_PUBLIC`` says where each name lives.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

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
    "all_reduce",
    "all_to_all",
    "broadcast",
    "collect_results",
    "compat",
    "configure",
    "connect",
    "device_for_backend",
    "exscan",
    "gather",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "restore",
    "scan",
    "scatter",
    "send",
    "sendrecv",
    "serializers",
    "settings",
]

# Where each public name lives: a module is imported the first time one of its names is used.
_PUBLIC: Dict[str, Tuple[str, ...]] = {
    "._api.functions": (
        "all_gather",
        "all_reduce",
        "all_to_all",
        "broadcast",
        "exscan",
        "gather",
        "reduce",
        "scan",
        "scatter",
    ),
    "._api.p2p_functions": ("connect", "irecv", "isend", "recv", "send", "sendrecv"),
    "._api.collect": ("collect_results",),
    "._api.communicator": ("Communicator",),
    "._format.compression": ("MissingDependencyError",),
    "._device": ("device_for_backend",),
    "._errors": (
        "CommunicationError",
        "ContentRefusedError",
        "DecodeError",
        "EncodeError",
        "FrameError",
        "ObjcommError",
        "RemoteError",
        "SerializationError",
        "TooLargeError",
        "UnknownSerializerError",
        "WaitTimeoutError",
    ),
    "._api.handles": ("Request",),
    "._settings": ("Settings", "configure", "restore", "settings"),
}
_SUBMODULES = ("compat", "serializers")  # public modules
_HOME = {name: module for module, names in _PUBLIC.items() for name in names}

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from objcomm import compat, serializers
    from objcomm._api.collect import collect_results
    from objcomm._api.communicator import Communicator
    from objcomm._api.functions import (
        all_gather,
        all_reduce,
        all_to_all,
        broadcast,
        exscan,
        gather,
        reduce,
        scan,
        scatter,
    )
    from objcomm._api.handles import Request
    from objcomm._api.p2p_functions import connect, irecv, isend, recv, send, sendrecv
    from objcomm._device import device_for_backend
    from objcomm._errors import (
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
    from objcomm._format.compression import MissingDependencyError
    from objcomm._settings import Settings, configure, restore, settings
else:

    def __getattr__(name: str) -> Any:
        """Import the module that defines public ``name`` on its first use, and keep the name here."""
        if name in _SUBMODULES:
            return importlib.import_module(f".{name}", __name__)  # the import binds it here too
        home = _HOME.get(name)
        if home is None:
            if name.startswith("_"):  # probes such as __path__ or __wrapped__: no torch import for them
                raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
            # mpi4py names: "did you mean"
            raise importlib.import_module("._api.functions", __name__).no_attribute(name)
        value = getattr(importlib.import_module(home, __name__), name)
        globals()[name] = value
        return value


def __dir__() -> List[str]:
    """The public names (and the module's dunders): not the helpers this file imports (``Any``, ``importlib``)."""
    return sorted(set(__all__) | {name for name in globals() if name.startswith("__") and name.endswith("__")})
