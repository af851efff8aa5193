"""A gloo collective returns before gloo has let go of its tensors; objcomm's calls return after.

gloo runs a collective on a worker thread of its process group, which marks the collective done, and only then
drops its own references to the call's tensors. The caller wakes at the first step: here about one call in four
returns while the worker still holds a tensor (``tests/transport/test_let_go.py`` counts them).
If Python lets go of that tensor first, the worker's drop is the last, and it must take the GIL to free the
tensor's Python object; while the interpreter shuts down, taking the GIL ends the thread (``pthread_exit``), which
unwinds through gloo's C++ frames: ``terminate called without an active exception``, and the process aborts at exit
(seen here in about 1 run in 30 of a program whose last call was objcomm's, through its same-host channel's
send/recv vote, which runs on a thread of its own and ends with a collective at exit). So a call on a CPU group
that returned no work (it completed) waits, polling, until each tensor it was given is back to the references
it had before the call (:meth:`torch.Tensor._use_count`): microseconds. One still held after :data:`PATIENCE`
seconds is kept alive here instead (never freed by Python first), so the worker's drop needs no GIL.

NCCL is left alone: its watchdog thread lets go of a collective's work up to a poll period later, which a call
must not wait for.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any, Deque, List, Mapping, Sequence, Tuple

import torch

PATIENCE = 1.0  # seconds a call waits for gloo's worker before it keeps the tensors alive instead
_yield = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))  # (no sched_yield on some platforms)
_COUNTS = hasattr(torch.Tensor, "_use_count")  # (a private method: where a torch lacks it, calls return at once)
_KEPT: Deque[torch.Tensor] = collections.deque(maxlen=4096)  # tensors a worker held past PATIENCE

Held = List[Tuple[torch.Tensor, int]]  # each tensor of a call, and its references before the call


def held_by(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Held:
    """The CPU tensors among a call's arguments, each with its references now (``_use_count``: its owners in C++,
    its Python object counting as one): each tensor alone, and of a list or tuple of them (a gather's W rows) the
    first and the last. gloo's worker drops a collective's tensors together, when it destroys the collective's work:
    once those it is checked on are dropped, that destruction is under way on a running thread, which ends it in
    microseconds. O(1) a call, where every row would be O(W)."""
    held: Held = []
    if not _COUNTS:
        return held
    # (loops, not comprehensions, and the count asked inline: every gloo collective of a call asks)
    for values in (args, kwargs.values()):
        for value in values:
            if isinstance(value, torch.Tensor):
                if value.is_cpu:  # (is_cpu: ~80 ns, device.type: ~500)
                    held.append((value, value._use_count()))  # type: ignore[attr-defined]  # (private: not in stubs)
            elif isinstance(value, (list, tuple)) and value:
                for tensor in (value[0], value[-1]) if len(value) > 1 else value:
                    if isinstance(tensor, torch.Tensor) and tensor.is_cpu:
                        held.append((tensor, tensor._use_count()))  # type: ignore[attr-defined]
    return held


def wait_let_go(held: Held) -> None:
    """Return once no tensor of ``held`` has more references than it had before the call (gloo's worker dropped
    its own), or after :data:`PATIENCE` seconds, keeping those still held alive (:data:`_KEPT`)."""
    deadline = None
    for tensor, before in held:
        while tensor._use_count() > before:  # type: ignore[attr-defined]
            now = time.monotonic()
            if deadline is None:
                deadline = now + PATIENCE
            elif now > deadline:
                _KEPT.append(tensor)
                break
            _yield()  # the worker may need this CPU (2 ranks on 2 cores: it often does)
