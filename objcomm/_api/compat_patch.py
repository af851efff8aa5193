"""What ``objcomm.compat.patch()`` does to ``torch.distributed``: torch's six object functions replaced by the
shims, with the patch's settings in force, and torch's own put back by ``unpatch()``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
import weakref
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from objcomm._api.compat_calls import (
    Options,
    _all_gather_object,
    _broadcast_object_list,
    _gather_object,
    _only,
    _recv_object_list,
    _scatter_object_list,
    _send_object_list,
)
from objcomm._settings import settings as current_settings
from serializers import ContentRefusedError, SerializerLike

# The per-call settings each of the six hands on (a sender decodes nothing, a receiver encodes nothing).
_TAKES: Dict[str, Tuple[str, ...]] = {
    "send_object_list": ("serializer", "max_bytes", "compression"),
    "recv_object_list": ("accept", "max_bytes", "map_location"),
}
_IMPLEMENTATIONS: Dict[str, Callable[..., Any]] = {
    "all_gather_object": _all_gather_object,
    "gather_object": _gather_object,
    "broadcast_object_list": _broadcast_object_list,
    "scatter_object_list": _scatter_object_list,
    "send_object_list": _send_object_list,
    "recv_object_list": _recv_object_list,
}


def _modules() -> Tuple[ModuleType, ...]:
    """Where torch's six names live: ``torch.distributed`` and ``torch.distributed.distributed_c10d``."""
    return dist, importlib.import_module("torch.distributed.distributed_c10d")


class _Patcher:
    """Who holds torch's six names: torch's originals, while patched, and the settings in force.

    The settings in force are those of the latest *layer*: each ``patch()`` adds one (its block's, whether or not
    a ``with`` enters it), an ``unpatch()`` inside an open block one of no settings (torch's functions; outside
    every block it takes every layer away). A block that ends takes away its layer and every layer made after it
    that no ``with`` holds open: patches and unpatches made inside it, and other threads' blocks made and not
    entered yet, whose layers come back at their ``with``. So in whatever order threads take their blocks, once
    every block has ended what is in force is what the patch() and unpatch() calls outside every block say.
    """

    def __init__(self, shims: Dict[str, Callable[..., Any]]) -> None:
        """``shims``: ``objcomm.compat``'s six functions, by name (what the patched names show)."""
        self._lock = threading.Lock()
        self._originals: Dict[Tuple[ModuleType, str], Any] = {}
        self.settings: Optional[Dict[str, Options]] = None  # per name; None: not patched
        self.functions = {name: _patched(self, name, shim) for name, shim in shims.items()}
        self._layers: List[_Layer] = []  # in force, in the order they were made
        self._away: weakref.WeakSet[_Layer] = weakref.WeakSet()  # taken away before their block's ``with``
        self._made = 0  # layers made so far: each one's place among them

    def begin(self, block: Any, settings: Dict[str, Options]) -> None:
        """A ``patch()``: ``settings`` in force now, ``block`` (what it returns) holding its layer."""
        with self._lock:
            block.layer = self._add(settings, block)

    def enter(self, block: Any) -> None:
        """``block``'s ``with`` begins (a second ``with`` of one block does nothing); where its layer was taken
        away (a block that began before it ended in between), it comes back, in its place."""
        with self._lock:
            layer: _Layer = block.layer
            if layer.state != "made":
                return
            layer.state = "open"
            if layer in self._away:
                self._away.discard(layer)
                self._layers.append(layer)
                self._layers.sort(key=lambda each: each.order)
            self._settle()

    def leave(self, block: Any) -> None:
        """``block`` ends: its layer and every later one no ``with`` holds open go (a second exit does nothing)."""
        with self._lock:
            layer: _Layer = block.layer
            if layer.state == "left":
                return
            layer.state = "left"
            self._away.discard(layer)
            self._keep(lambda each: each.order < layer.order or each.state == "open")

    def unpatch(self) -> None:
        """Torch's functions back: for good outside every block; inside one, until it ends."""
        with self._lock:
            opened = max((each.order for each in self._layers if each.state == "open"), default=None)
            if opened is None:
                self._keep(lambda each: False)
            else:
                self._keep(lambda each: each.order <= opened or each.state == "open")
                self._add(None, None)

    def _add(self, settings: Optional[Dict[str, Options]], block: Any) -> _Layer:
        self._made += 1
        layer = _Layer(self._made, settings, block)
        self._layers.append(layer)
        # of two bare layers in a row (repeated patch() calls) the first never shows again, unless a block whose
        # layer went away between them comes back
        away = [each.order for each in self._away]
        self._layers = [
            each
            for each, after in zip(self._layers, self._layers[1:] + [None])
            if after is None
            or not (each.bare() and after.bare() and not any(each.order < o < after.order for o in away))
        ]
        self._settle()
        return layer

    def _keep(self, kept: Callable[[_Layer], bool]) -> None:
        """Keep the layers ``kept`` says; a block's layer taken away before its ``with`` may come back there."""
        layers = []
        for each in self._layers:
            if kept(each):
                layers.append(each)
            elif each.state == "made" and not each.bare():
                self._away.add(each)
        self._layers = layers
        self._settle()

    def _settle(self) -> None:
        """Put the latest layer's settings in force (none: torch's own functions)."""
        settings = self._layers[-1].settings if self._layers else None
        if settings is not None and self.settings is None:
            self._install()
        elif settings is None and self.settings is not None:
            self._restore()
        self.settings = settings

    def original(self, name: str) -> Callable[..., Any]:
        """Torch's function of that name (while patched, the one the patch put aside)."""
        with self._lock:
            found = self._originals.get((dist, name))
        function: Callable[..., Any] = found if found is not None else getattr(_modules()[1], name)
        return function

    def _install(self) -> None:
        if not dist.is_available():
            raise RuntimeError("objcomm.compat.patch(): this torch build has no torch.distributed")
        for module in _modules():
            for name, function in self.functions.items():
                current = getattr(module, name)
                if current is not function:
                    self._originals[(module, name)] = current
                    setattr(module, name, function)

    def _restore(self) -> None:
        for (module, name), original in self._originals.items():
            if getattr(module, name) is self.functions[name]:  # a name someone else replaced since stays theirs
                setattr(module, name, original)
        self._originals.clear()


class _Layer:
    """One patch(), or an unpatch() inside a block, in force (see :class:`_Patcher`)."""

    def __init__(self, order: int, settings: Optional[Dict[str, Options]], block: Any) -> None:
        self.order, self.settings, self.state = order, settings, "made"  # made, open, left
        self._block = None if block is None else weakref.ref(block)

    def bare(self) -> bool:
        """Whether no ``with`` can hold it any more: an unpatch(), or a patch() whose result is gone."""
        return self.state == "made" and (self._block is None or self._block() is None)


def _patched(patcher: _Patcher, name: str, shim: Callable[..., Any]) -> Callable[..., Any]:
    """What :func:`objcomm.compat.patch` puts in torch's place: the shim, with ``patcher``'s settings in force when
    called."""
    implementation = _IMPLEMENTATIONS[name]
    receives = name == "recv_object_list"
    signature = inspect.signature(shim)
    at = list(signature.parameters).index("group")  # where a positional group comes

    @functools.wraps(shim)
    def patched(*args: Any, serializer: Optional[SerializerLike] = None, **kwargs: Any) -> Any:
        settings = patcher.settings
        options = {} if settings is None else settings[name]
        group = kwargs["group"] if "group" in kwargs else args[at] if len(args) > at else None
        if serializer is None and _foreign(group):  # torch.distributed.rpc's own group: only torch's functions run
            _unpickling_allowed(options, name)
            return patcher.original(name)(*args, **kwargs)
        if serializer is not None:  # a call that names one, as with the shim
            options = {**options, **(_only(serializer) if receives else {"serializer": serializer})}
        try:
            return implementation(*args, options=options, **kwargs)
        except TypeError:  # arguments torch's function does not take: said as torch says it, in its name
            try:
                signature.bind(*args, **kwargs)
            except TypeError as wrong:
                raise TypeError(f"{name}() {wrong}") from None
            raise

    return patched


def _foreign(group: Any) -> bool:
    """Whether ``group`` is a process group torch does not list (``torch.distributed.rpc`` makes one straight from its
    store and calls ``all_gather_object`` on it, with or without a default group): objcomm, which asks torch about a
    group's ranks, cannot run on it; torch's own functions can."""
    if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
        return False
    return not dist.is_initialized() or group not in dist.distributed_c10d._world.pg_map


def _unpickling_allowed(options: Options, name: str) -> None:
    """Raise where the settings in force refuse pickle (``accept=`` without ``"pickle"``) and ``name`` receives:
    torch's function, which a group torch does not list must take, unpickles whatever arrives."""
    accept = options["accept"] if "accept" in options else current_settings().accept
    if name != "send_object_list" and accept is not None and "pickle" not in accept:
        raise ContentRefusedError(
            f"{name} on a process group torch does not list (torch.distributed.rpc makes one of its own) can only run "
            f"as torch's own function, which unpickles what arrives; the settings in force accept only "
            f"{sorted(accept)}. Patch without accept= around such calls (rpc.init_rpc), or unpatch() there"
        )
