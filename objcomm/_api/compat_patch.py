"""What ``objcomm.compat.patch()`` does to ``torch.distributed``: torch's six object functions replaced by the
shims, with the patch's settings in force, and torch's own put back by ``unpatch()``.
"""

from __future__ import annotations

import functools
import importlib
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
from serializers import SerializerLike

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
    """Who holds torch's six names: torch's originals, while patched, and the settings in force."""

    def __init__(self, shims: Dict[str, Callable[..., Any]]) -> None:
        """``shims``: ``objcomm.compat``'s six functions, by name (what the patched names show)."""
        self._lock = threading.Lock()
        self._originals: Dict[Tuple[ModuleType, str], Any] = {}
        self.settings: Optional[Dict[str, Options]] = None  # per name; None: not patched
        self.functions = {name: _patched(self, name, shim) for name, shim in shims.items()}
        self._blocks: List[Any] = []  # the with blocks entered and not left, in the order of their patch() calls
        self._made: weakref.WeakSet[Any] = weakref.WeakSet()  # patch() results not entered (nor left) yet
        self._patches = 0  # patch() calls so far: each one's place among them

    def begin(self, block: Any, settings: Optional[Dict[str, Options]]) -> None:
        """A ``patch()``: put ``settings`` in force, ``block`` (what it returns) remembering what was before."""
        with self._lock:
            self._patches += 1
            block.previous, block.settings, block.order = self._switch(settings), settings, self._patches
            block.state, block.displaced = "made", False
            self._made.add(block)

    def enter(self, block: Any) -> None:
        """``block``'s ``with`` begins (a second ``with`` of one block does nothing). Where a block that began
        before it ended in between (threads) and put back what was in force before that one, its settings come back
        in force."""
        with self._lock:
            if block.state != "made":
                return
            block.state = "open"
            self._made.discard(block)
            at = len(self._blocks)
            while at and self._blocks[at - 1].order > block.order:
                at -= 1
            self._blocks.insert(at, block)
            if block.displaced:
                self._switch(block.settings)

    def leave(self, block: Any) -> None:
        """Put back what was in force before ``block``'s patch() (its ``previous``), unless a block whose patch()
        came after it is still open (threads, or exits by hand): that one then puts back what was in force before
        this one when it ends. A patch() made after it and not entered yet (another thread's block between its
        patch() and its ``with``, or a global patch() inside this block, undone here) now stands on what was before
        this block. A block left twice does nothing the second time; one never entered puts its ``previous`` back."""
        with self._lock:
            if block.state == "left":
                return
            was_open, block.state = block.state == "open", "left"
            self._made.discard(block)
            if was_open:
                at = self._blocks.index(block)
                del self._blocks[at]
                if at < len(self._blocks):
                    self._blocks[at].previous = block.previous
                    return
            for later in self._made:
                if later.order > block.order and later.previous is block.settings:
                    later.previous, later.displaced = block.previous, True
            self._switch(block.previous)

    def switch(self, settings: Optional[Dict[str, Options]]) -> Optional[Dict[str, Options]]:
        """Put ``settings`` in force (``None``: torch's own functions back, ``unpatch()``); return what was."""
        with self._lock:
            return self._switch(settings)

    def _switch(self, settings: Optional[Dict[str, Options]]) -> Optional[Dict[str, Options]]:
        previous = self.settings
        if settings is not None and previous is None:
            self._install()
        elif settings is None and previous is not None:
            self._restore()
        self.settings = settings
        return previous

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


def _patched(patcher: _Patcher, name: str, shim: Callable[..., Any]) -> Callable[..., Any]:
    """What :func:`objcomm.compat.patch` puts in torch's place: the shim, with ``patcher``'s settings in force when
    called."""
    implementation = _IMPLEMENTATIONS[name]
    receives = name == "recv_object_list"

    @functools.wraps(shim)
    def patched(*args: Any, serializer: Optional[SerializerLike] = None, **kwargs: Any) -> Any:
        settings = patcher.settings
        options = {} if settings is None else settings[name]
        if serializer is not None:  # a call that names one, as with the shim
            options = {**options, **(_only(serializer) if receives else {"serializer": serializer})}
        return implementation(*args, options=options, **kwargs)

    return patched
