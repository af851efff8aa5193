"""Sibling process groups: a second group with a group's ranks, made without ``dist.new_group``.

objcomm makes two: the *shadow* that async collectives run on (:mod:`objcomm._api.requests`), and the same-host
channel's *control* group, which carries the channel's own collectives after set-up (votes, reopening after a
failure: :mod:`objcomm._samehost.channel_slots`), so that they never meet a collective of the group itself that another
rank is still in (a gloo collective of another size there aborts the process).

Not ``dist.new_group``: it names a group after a counter that every rank of the world must advance in the same
order, or (``use_local_synchronization``) after the groups this rank knows; ranks that make a sibling at different
points of their own group creation would disagree. A sibling's name is its group's own (the same on all its
members: torch's store keys are named by it) plus a suffix torch's names never have, so two groups with the same
ranks get two siblings. torch's private ``_new_process_group_helper`` makes it, as ``new_group`` does (these
arguments and the ``(group, store)`` result are those of torch 2.2 to 2.13), talking only to the members, through a
clone of the default store (one a thread for gloo siblings: :func:`_own_store`), for at most the group's timeout.
``Store.clone`` came with torch 2.8; before it a sibling shares the caller's store connection, which serves one
request at a time.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Optional, Sequence

import torch.distributed as dist

from objcomm._device import group_backend, group_timeout


def sibling(group: Any, suffix: str, backend: Optional[str] = None, ranks: Optional[Sequence[int]] = None) -> Any:
    """A process group with ``group``'s ranks (in its order), named ``<group's name>:<suffix>``, on ``backend``
    (``None``: ``group``'s); every member calls this once, and it waits for the others up to the group's timeout.
    ``ranks``: only these global ranks of ``group`` (a host's, or its leaders': :mod:`objcomm._samehost.two_level`);
    only they call it, and the suffix must tell this subset from the others."""
    c10d: Any = dist.distributed_c10d  # private names, typed differently across torch versions
    world = c10d._world
    ranks = list(dist.get_process_group_ranks(group)) if ranks is None else list(ranks)
    timeout = group_timeout(group)
    if timeout is None:
        from torch.distributed.constants import default_pg_timeout as timeout
    chosen = dist.Backend(backend or group_backend(group))
    reuse = chosen == dist.Backend.GLOO and os.environ.get("TORCH_GLOO_LAZY_INIT", "0").lower() in ("", "0", "false")
    store = _own_store(reuse=reuse)  # waiting for peers here holds up no other thread
    made, _ = c10d._new_process_group_helper(
        len(ranks),
        ranks.index(dist.get_rank()),
        ranks,
        chosen,
        store,
        group_name=f"{world.pg_names[group]}:{suffix}",
        timeout=timeout,
    )
    world.pg_group_ranks[made] = {rank: index for index, rank in enumerate(ranks)}
    return made


def arrive(group: Any, suffix: str, stopping: threading.Event, timeout: float) -> bool:
    """Wait, through the store, until every member of ``group`` has called this with ``suffix`` (True), or until
    ``stopping`` is set or ``timeout`` seconds pass (False): in short steps, never long inside torch, so that a
    thread waiting here for ranks that may never come can stop at once (one left inside torch at exit aborts the
    process). A sibling's own rendezvous, which cannot be stopped, then finds every member there.

    Every member ends on the same answer: the first to see them all, or to give up, sets the outcome (one
    ``compare_set``, which the others then read), so a rank that gave up after it was counted never leaves the others
    in a rendezvous it does not join (they waited for it there until the group's timeout), and one that gives up after
    the others went on goes on with them."""
    store, names = _own_store(reuse=True), dist.distributed_c10d._world.pg_names
    key, members = f"objcomm/{names[group]}:{suffix}/arrived", dist.get_world_size(group)
    start = time.monotonic()
    count, pause, deadline = store.add(key, 1), 1e-3, start + timeout
    while count < members:
        if stopping.wait(pause) or time.monotonic() > deadline:
            return bool(store.compare_set(f"{key}/outcome", "", "stop") == b"go")
        # ranks come within ms (a first collective may be waiting); one that never does: 4 store calls a second
        pause = min(2 * pause, 0.05 if time.monotonic() < start + 2 else 0.25)
        count = store.add(key, 0)
    return bool(store.compare_set(f"{key}/outcome", "", "go") == b"go")


def store_clones() -> bool:
    """Whether the default group's store can be cloned (torch 2.8 on): a sibling made in a background thread then
    waits for its peers on a connection of its own, holding up no other user of the store."""
    try:
        return hasattr(_default_store(), "clone")
    except Exception:  # no default group
        return False


def _default_store() -> Any:
    c10d: Any = dist.distributed_c10d  # private names, typed differently across torch versions
    return c10d._world.pg_map[c10d._get_default_group()][1]


_HELD = threading.local()  # .store: (a weak reference to the default store, this thread's clone of it)


def _own_store(reuse: bool = False) -> Any:
    """The default group's store, on a connection of its own where it can be cloned (:func:`store_clones`).
    ``reuse``: this thread's one clone, made at its first call (again once the default group is another): where the
    store is used only while a group is made (gloo, unless ``TORCH_GLOO_LAZY_INIT`` makes it connect at its first
    collective, on gloo's threads), by the thread that makes it. A new connection to torch's store
    took 5 s in 3 of 100 tries here (torch 2.13, a new client of an idle store on 127.0.0.1; a plain
    socket, never), and two levels make several siblings a group; else (NCCL, whose communicators ask the
    store when first used, on any thread) a clone of its own."""
    store = _default_store()
    if not hasattr(store, "clone"):
        return store
    if not reuse:
        return store.clone()
    held = getattr(_HELD, "store", None)
    if held is None or held[0]() is not store:
        held = _HELD.store = (weakref.ref(store), store.clone())
    return held[1]


def forget(made: Any) -> None:
    """Destroy a sibling (its group is gone): its connections close, and torch forgets it."""
    try:
        dist.destroy_process_group(made)
    except Exception:  # torch torn down already (at exit), or the sibling never finished
        pass
