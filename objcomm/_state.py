"""What objcomm keeps between calls in one process, all in one place.

- :func:`group_facts`: what never changes for a group's lifetime, learned once per group and
  forgotten with the group (a weak cache): its membership and transport device, which ranks share a
  host, which send/recv peers turned out to be on another host, and whether its readers could not
  open sealed shared-memory segments (:mod:`objcomm._samehost.sealed`: files from then on); its same-host channel and
  the state around it (:class:`objcomm._samehost.p2p_state.SameHost`: the
  :class:`objcomm._samehost.channel.LocalChannel`, opened by the first collective that may use it and again after it
  failed, closed with the group or at exit; none when the group spans hosts); and, once this rank issues a
  non-blocking operation on it, its async state (:class:`objcomm._api.requests._Lanes`: the shadow group,
  the lanes and which point-to-point keys are busy); the wires of the calls made on it, one per
  set of options (:func:`objcomm._api.call.wire_for`); and the one thing that follows its calls rather than the group,
  the slot its next all_gather, broadcast or all_reduce result's broadcast takes
  (:class:`objcomm._transport.rounds.SlotMemory`: the same on every rank); and the route its calls take through the
  backend, one per slot setting, device and the routes a communicator's test hooks force
  (:class:`objcomm._transport.routes.CallRoute`).

The one other piece of process state is the ``configure()`` layer of the settings, which
:mod:`objcomm._settings` owns with its lock. Besides these there are only pure memos
(``functools.lru_cache``: this host's key, the combined exception classes of
:func:`objcomm._errors.also_instance_of`; the settings' memo of resolved calls, kept on the state it
was resolved against) and locks.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Set, Tuple


@dataclass
class GroupFacts:
    """What one process learned about one group (none of it changes while the group lives), and its async state.

    The fields that hold an upper module's objects are typed ``Any`` here, so that this module imports nothing
    above it; each owner reads its field into a variable of its own type."""

    membership: Dict[Any, Tuple[Any, ...]] = field(default_factory=dict)  # device asked for -> (ranks, rank, device)
    hosts: Dict[int, Any] = field(default_factory=dict)  # separate -> Hosts (objcomm._samehost.hosts)
    remote_peers: Set[Tuple[int, int]] = field(default_factory=set)  # (peer, separate): send/recv crosses hosts
    unsealed: Set[Tuple[int, int]] = field(default_factory=set)  # (peer or -1: collectives, separate): files only
    swept: Set[str] = field(default_factory=set)  # shared-memory folders whose dead jobs' files this group cleared
    requests: Any = None  # _Lanes, made on the first non-blocking call (objcomm._api.requests)
    local: Dict[int, Any] = field(default_factory=dict)  # separate -> SameHost (objcomm._samehost.channel_slots)
    levels: Dict[int, Any] = field(default_factory=dict)  # separate -> Levels or None (objcomm._samehost.two_level)
    # (device, options, segments) -> a wire less its group
    wires: Dict[Any, Tuple[Any, ...]] = field(default_factory=dict)
    # (op, the settings' slot) -> what the op's last calls on it suggest for the next: a SlotMemory
    slots: Dict[Tuple[str, int], Any] = field(default_factory=dict)
    # (the settings' slot, the device, a communicator's hooks) -> the group's calls' route (a routes.CallRoute)
    routes: Dict[Tuple[int, Any, Any], Any] = field(default_factory=dict)
    # (the settings' slot, the device, local: the same-host channel may take round 1) that every rank of the group was
    # found to use alike (Operations._route, rounds.agree_on_round_one)
    round_one_agreed: Set[Tuple[int, Any, bool]] = field(default_factory=set)
    # a communicator's own settings -> what its calls without per-call options use (a resolving.Held), shared by the
    # communicators made alike: a module-level function or an objcomm.compat shim makes one a call on a given group
    held: Dict[Any, Any] = field(default_factory=dict)
    # tag -> this rank's blocking receives from any rank that wait now (objcomm._api.own_box.AnySourceWait)
    any_source: Dict[int, int] = field(default_factory=dict)


_GROUPS: weakref.WeakKeyDictionary[Any, GroupFacts] = weakref.WeakKeyDictionary()
_GROUPS_LOCK = threading.Lock()


def group_facts(group: Any) -> GroupFacts:
    """The facts kept for ``group`` (a process group object), created empty on first use."""
    try:
        found = _GROUPS.get(group)
        if found is None:
            with _GROUPS_LOCK:
                found = _GROUPS.setdefault(group, GroupFacts())
        return found
    except TypeError:  # an object that cannot be weakly referenced: learn afresh each call, keep nothing
        return GroupFacts()


def known_groups() -> List[Tuple[Any, GroupFacts]]:
    """Every group this process keeps facts on and that is still alive, with its facts."""
    with _GROUPS_LOCK:
        return list(_GROUPS.items())
