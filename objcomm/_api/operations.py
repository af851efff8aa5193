"""What each operation of a :class:`~objcomm.Communicator` does once its call is resolved (:class:`Operations`,
between :class:`~objcomm._api.resolving.Resolving` and :class:`~objcomm.Communicator`): encode, move frames and tensors
through the transport's rounds, raise failures on every rank alike, decode; and a rank's messages to itself.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

from objcomm._api import call_checks as _call_checks
from objcomm._api import reduce as _reduce
from objcomm._api import requests as _requests
from objcomm._api import scan as _scan
from objcomm._api.call import (
    SOURCE_KEEPS_ITS_OWN,
    WIRES_KEPT,
    Call,
    encode_each,
    encode_pattern,
    final_report,
    only,
    per_rank,
    sends,
)
from objcomm._api.express import Express
from objcomm._api.handles import Request, completed
from objcomm._api.own_box import NOTHING, AnySourceWait, wake_any_source
from objcomm._api.resolving import Resolving
from objcomm._device import is_cpu
from objcomm._errors import NO_RESULT, CommunicationError, ObjcommError, TooLargeError, with_original_type
from objcomm._format import frame as _frame
from objcomm._format import limits as _limits
from objcomm._format.message import Incoming, Outgoing
from objcomm._state import group_facts
from objcomm._transport import any_source, call_words, patterns, routes
from objcomm._transport import broadcast as _broadcast_rounds
from objcomm._transport import gather as _gather_rounds
from objcomm._transport import p2p as _p2p
from objcomm._transport import parts as _parts
from objcomm._transport import pending as _pending
from objcomm._transport import rounds as _rounds
from objcomm._transport.base import BACKEND, Wire, largest_of
from objcomm._transport.tree_reports import reports_over_tree

# The ops whose slots through the backend the group's last calls teach (rounds.SlotMemory): the most their slots may
# hold together, and the narrower slot they may take (0: none)
_REMEMBERED = {
    "all_gather": (routes.LEARNED_TABLE_MOST, routes.NARROW_SLOT),
    "broadcast": (routes.LEARNED_BROADCAST_MOST, 0),
    "all_reduce": (routes.LEARNED_BROADCAST_MOST, 0),
}

# What a rank that refused the result its parent relayed (a rank above lied about a limit, or the sizes) says: the
# failure began there, and only its subtree of the reduce tree heard of it (tree_reports.reports_over_tree)
_SUBTREE_ONLY = (
    "so rank {0} and the ranks below it in the reduce tree received no result, where the other ranks did: a rank "
    "above it relayed a result that it had to refuse"
)


class Operations(Resolving):
    """The base of :class:`~objcomm.Communicator` that does its operations: each ``_<op>_call`` takes the call its
    public method resolved (see :mod:`objcomm._api.communicator` for what each one returns and raises)."""

    # -- collectives ---------------------------------------------------------------------------
    def _all_gather_call(self, call: Call, obj: Any, serialized: Any, express: Optional[Express]) -> Any:
        if call.wire is None:
            return [call.roundtrip(obj)]
        wire = call.wire
        _call_checks.check(call, "all_gather")
        call_words.enter("all_gather")  # (each collective's word, which its channel messages carry)
        out, local = call.encode(obj, _still(serialized, express, call))
        route, memory = self._route(call, "all_gather")
        incoming = _rounds.all_gather(wire, out, _frame.tensor_sizes, route=route, memory=memory)
        call.raise_failures("all_gather", incoming, local)
        return call.decode_all(incoming)

    def _gather_call(self, call: Call, obj: Any, dst: int) -> Any:
        if call.wire is None:
            self._check_single(dst, "dst")
            return [call.roundtrip(obj)]
        _call_checks.check(call, "gather", dst, root_name="dst")
        root = self._group_rank(call.wire, dst, "dst")
        call_words.enter("gather", root)
        out, local = call.encode(obj)
        route = self._route(call, op="gather")[0]
        incoming = _gather_rounds.gather(call.wire, out, _frame.tensor_sizes, root, route)
        if incoming is None:
            if local is not None:  # dst said go over this rank's error report (only a lying dst does)
                raise local
            return None
        call.raise_failures("gather", incoming, local)
        if call.wire.rank != root:
            return None
        return call.decode_all(incoming, own=root)

    def _broadcast_call(self, call: Call, obj: Any, src: int, serialized: Any, express: Optional[Express]) -> Any:
        if call.wire is None:
            self._check_single(src, "src")
            return call.roundtrip(obj)
        _call_checks.check(call, "broadcast", src, root_name="src")
        root = self._group_rank(call.wire, src, "src")
        call_words.enter("broadcast", root)
        out, local = call.encode(obj, _still(serialized, express, call)) if call.wire.rank == root else (None, None)
        route, memory = self._route(call, "broadcast")
        item = _broadcast_rounds.broadcast(call.wire, out, _frame.tensor_sizes, root, route=route, memory=memory)
        if item.error:  # the root's error report (its own encode failure among them)
            call.raise_failures("broadcast", only(root, item, call.wire.size), local)
        if call.wire.rank == root and SOURCE_KEEPS_ITS_OWN.get():  # objcomm.compat's source keeps its list: a copy
            if not call.refuses_nothing():  # is decoded only where that may refuse it (as on the receivers)
                call.decode(item, root, own=True)
            return None
        return call.decode(item, root, own=call.wire.rank == root)

    def _scatter_call(self, call: Call, objs: Optional[Sequence[Any]], src: int) -> Any:
        if call.wire is None:
            self._check_single(src, "src")
            return call.roundtrip(per_rank(objs, 1, "scatter")[0])
        _call_checks.check(call, "scatter", src, root_name="src")
        call = self._parts_of(call, "scatter")
        wire = call.wire
        assert wire is not None
        root = self._group_rank(wire, src, "src")
        call_words.enter("scatter", root)
        outs: Optional[List[Outgoing]] = None
        local: Optional[BaseException] = None
        if wire.rank == root:
            outs, local = encode_each(call, objs, wire.size, "scatter")
        item = _parts.scatter(wire, outs, _frame.tensor_sizes, root)
        call.raise_failures("scatter", only(root, item, wire.size), local)
        return call.decode(item, root, own=wire.rank == root)

    def _all_to_all_call(self, call: Call, objs: Sequence[Any]) -> Any:
        if call.wire is None:
            return [call.roundtrip(per_rank(objs, 1, "all_to_all")[0])]
        _call_checks.check(call, "all_to_all")
        call_words.enter("all_to_all")
        call = self._parts_of(call, "all_to_all")
        assert call.wire is not None
        outs, local = encode_each(call, objs, call.wire.size, "all_to_all")
        incoming = _parts.all_to_all(call.wire, outs, _frame.tensor_sizes)
        call.raise_failures("all_to_all", incoming, local)
        return call.decode_all(incoming, own=call.wire.rank)

    def _reduce_call(self, call: Call, obj: Any, op: _reduce.Op, dst: int) -> Any:
        if call.wire is None:
            self._check_single(dst, "dst")
            _reduce.resolve(op)
            return call.roundtrip(obj)
        _call_checks.check(call, "reduce", dst, op, root_name="dst")
        root = self._group_rank(call.wire, dst, "dst")
        call_words.enter("reduce", root)
        route = self._route(call, op="reduce")[0]  # (its slot agreed before the tree's first message)
        levels = call.wire.slot_medium.tree_levels(call.wire, "reduce")
        value, complete, own, _ = _reduce.tree(call, obj, op, levels)
        out, local = final_report(call, value, complete, own, carries=root != 0)  # root 0 holds the result
        try:
            incoming = _gather_rounds.gather(call.wire, out, _frame.tensor_sizes, root, route)
        except TooLargeError as exc:  # the result, from group rank 0, over dst's limit: alike on every rank
            raise TooLargeError(f"reduce: its result goes from group rank 0 to dst in a gather, and {exc}") from None
        if incoming is None:
            if local is not None:  # dst said go over this rank's error report (only a lying dst does)
                raise local
            return None
        call.raise_failures("reduce", incoming, local)
        if call.wire.rank != root:
            return None
        return _not_own(call, value, obj) if root == 0 else call.decode(incoming[0], 0)  # rank 0 combined it

    def _all_reduce_call(self, call: Call, obj: Any, op: _reduce.Op) -> Any:
        if call.wire is None:
            _reduce.resolve(op)
            return call.roundtrip(obj)
        wire = call.wire
        _call_checks.check(call, "all_reduce", reduction=op)
        call_words.enter("all_reduce")
        route, memory = self._route(call, "all_reduce")  # (its slot agreed before the tree's first message)
        levels = wire.slot_medium.tree_levels(wire, "all_reduce")
        value, complete, own, lowest = _reduce.tree(call, obj, op, levels)
        out, local = final_report(call, value, complete, own) if wire.rank == 0 else (None, None)
        if out is not None and not complete and local is None:  # a rank below failed: say so to every rank
            out = _frame.error_frame(ObjcommError("a rank below group rank 0 failed"), wire.inline_capacity)
        elif out is not None and local is None and not out.complete(wire) and out.total > lowest:  # once, for all
            local = _limits.too_large(
                f"all_reduce: the result is {out.total:,} bytes, above max_bytes={lowest:,} of a rank in the group",
                where="on every rank",
            )
            out = _frame.error_frame(local, wire.inline_capacity)
        # group rank 0 combined it; off the same-host channel on NCCL (and on gloo's two levels from 64 leaders), it
        # goes back down the reduce tree
        tree = route.result_down(0 if levels is None else len(levels.leaders))
        # else, where it takes the backend's broadcast, in the slot the group's last two all_reduce results suggest
        # (their own memory: a loop's results of about one size take one broadcast, where they took two)
        result = _broadcast_rounds.broadcast(
            wire, out, _frame.tensor_sizes, 0, tree=tree, levels=levels, route=route, memory=memory
        )
        if result.error:  # a rank failed (rank 0 knows that much): every rank's own report, to all
            report, failed = final_report(call, None, False, own or local or result.refused)
            began_here = result.refused is not None  # (what a rank above relayed, this one refused: a liar's doing)
            # learnt from a parent alone (down the tree): never into a collective of the group
            incoming: Sequence[Optional[Incoming]] = (
                reports_over_tree(wire, report, levels if tree else None, began_here=began_here)
                if result.relayed
                else _rounds.all_gather(wire, report, _frame.tensor_sizes, route=route)
            )
            outcome = _SUBTREE_ONLY.format(wire.rank) if began_here else NO_RESULT
            call.raise_failures("all_reduce", incoming, failed, outcome)
            call.raise_failures("all_reduce", only(0, result, wire.size), failed, outcome)
        return _not_own(call, value, obj, out) if wire.rank == 0 else call.decode(result, 0)

    def _scan_call(self, call: Call, obj: Any, op: _reduce.Op, exclusive: bool) -> Any:
        name = "exscan" if exclusive else "scan"
        if call.wire is None:
            _reduce.resolve(op)
            return None if exclusive else call.roundtrip(obj)
        wire = call.wire
        _call_checks.check(call, name, reduction=op)
        call_words.enter(name)
        route = self._route(call, op=name)[0]  # (its slot agreed before its first message)
        value, complete, own = _scan.prefix(call, obj, op, exclusive)
        if largest_of(wire, [0 if complete else 1], name)[0]:  # a rank failed: every rank's own report, to all
            report, failed = final_report(call, None, False, own)
            incoming = _rounds.all_gather(wire, report, _frame.tensor_sizes, route=route)
            call.raise_failures(name, incoming, failed)
            raise CommunicationError(  # a rank passed on an error report that no rank's own report holds
                f"{name}: a rank reported a failure to the ranks above it, and no rank's own report names it; "
                f"nothing was returned on any rank"
            )
        return value if value is not obj else _not_own(call, value, obj)

    def _pattern_call(self, call: Call, op: str, mine: Any, root: Any = None) -> Dict[int, Any]:
        """A collective carried out by its row of :data:`patterns.ROWS` alone (see docs/internals.md, "Adding a
        collective"): this rank's ``mine`` (with the row's ``each``, one object per group rank, on a rank that sends)
        to the pattern's receivers, as one all_to_all whose other parts are empty; returns what each of its sources
        sent this rank, by group rank (this rank's own part is the caller's). ``root``: the global rank of the row's
        root, where it has one. Its failures, limits and media are an all_to_all's: every rank raises alike; a part
        where the pattern has none, or none where it has one (ranks that passed different roots), raises here."""
        row = patterns.row_of(op)
        if not row.root and root is not None:
            raise ValueError(f"{op} takes no root, got {root!r}")
        if call.wire is None:
            if row.root:
                self._check_single(root, row.root)
            if row.each and sends(op, 0, 0):
                per_rank(mine, 1, op)
            return {}
        _call_checks.check(call, op, root, root_name=row.root)
        at_root = self._group_rank(call.wire, root, row.root) if row.root else None
        call_words.enter(op, at_root)
        call = self._parts_of(call, op)
        wire = call.wire
        assert wire is not None
        at, outs, local = encode_pattern(call, op, at_root, mine)
        incoming = _parts.all_to_all(wire, outs, _no_part_or_sizes)
        call.raise_failures(op, incoming, local)
        assert at is not None  # (else this rank's own report, raised above)
        sources = set(at.sources)
        for r, item in enumerate(incoming):
            if r != wire.rank and item is not None and (memoryview(item.frame).nbytes == 0) == (r in sources):
                said = "nothing, where its row has it send a part" if r in sources else "a part, where its row has none"
                raise CommunicationError(
                    f"{op}: group rank {r} sent this rank {said} (its pattern: objcomm._transport.patterns.ROWS); "
                    f"every rank of the group must call {op} at once"
                    + (f", with the same {row.root}" if row.root else "")
                )
        return {r: call.decode(incoming[r], r) for r in at.sources}

    def _route(
        self, call: Call, remembered: str = "", op: str = ""
    ) -> Tuple[routes.CallRoute, Optional[_rounds.SlotMemory]]:
        """The route of this communicator's calls on ``wire``'s group (:class:`routes.CallRoute`: by its size, device
        and slot, and the routes the hooks force), made once and kept on the group; and the group's slot memory of
        ``remembered``'s calls with this slot setting (an op of :data:`_REMEMBERED`: :class:`_rounds.SlotMemory`),
        else None. Where the group first takes this slot through a medium that does not check slots, and at its first
        call wherever its slots go, every rank checks that all use it, the same ``local`` and ``check_calls`` (a
        vote before anything moves: :func:`_rounds.agree_on_round_one`; with ``check_calls`` the same vote runs every
        call, in :mod:`objcomm._api.call_checks`); ``op`` (else ``remembered``) names the call in its error."""
        wire = call.wire
        assert wire is not None
        facts = group_facts(wire.group)
        kept, key = facts.routes, (wire.slot, wire.device, self._hooks)
        route: Optional[routes.CallRoute] = kept.get(key)
        if route is None:
            agreed, shape = facts.round_one_agreed, (wire.slot, wire.device, wire.slot_medium is not BACKEND)
            # a group's first vote runs wherever its slots go (the channel, two levels): ranks whose check_calls differ
            # meet there, each in a vote of one shape (call_checks votes every call, with the same words)
            if shape not in agreed and (not agreed or not wire.slot_medium.checks_slots(wire)):
                if not call.options.check_calls:
                    _rounds.agree_on_round_one(wire, op or remembered)
                agreed.add(shape)
            if len(kept) >= WIRES_KEPT:
                kept.clear()
            forced = self._hooks.forced
            route = kept[key] = routes.call_route(
                world=wire.size, cpu=is_cpu(wire.device), slot=wire.slot, forced=forced
            )
        if not remembered:
            return route, None
        slots, at = facts.slots, (remembered, wire.slot)
        memory: Optional[_rounds.SlotMemory] = slots.get(at)
        if memory is None:
            memory = slots.setdefault(at, _rounds.SlotMemory(wire.slot, *_REMEMBERED[remembered]))
        return route, memory

    def _parts_of(self, call: Call, op: str = "all_to_all") -> Call:
        """``call`` for a scatter or an all_to_all: each part's slot the route's (:attr:`routes.CallRoute.part_slot`:
        the settings' up to :data:`routes.PARTS_TABLE` a rank, smaller past it), its error reports made to fit."""
        wire = call.wire
        assert wire is not None
        slot = self._route(call, op=op)[0].part_slot
        return call if slot == wire.slot else call._replace(wire=wire._replace(slot=slot))

    # -- point to point ------------------------------------------------------------------------
    def _send_call(self, call: Call, obj: Any, dst: int, tag: int, serialized: Any, express: Optional[Express]) -> None:
        wire, peer = self._destination(call, dst, tag, "send")
        if wire is None or peer == wire.rank:
            local = self._send_own(call, wire, obj, tag, _still(serialized, express, call))
            if local is not None:
                raise with_original_type(local)
            return
        _requests.check_blocking(wire.group, "send", dst, tag)
        out, local = call.encode(obj, _still(serialized, express, call))
        self._deliver(wire, out, local, peer)

    @staticmethod
    def _deliver(wire: Wire, out: Outgoing, local: Optional[BaseException], peer: int, eager: bool = True) -> None:
        """Send what encoding gave (``local``: its failure, whose report ``out`` is) to group rank ``peer``."""
        _pending.check(wire.group, "send")
        _p2p.send(wire, out, peer, eager)
        if local is not None:
            raise with_original_type(local)

    def _recv_call(self, call: Call, src: Optional[int], tag: int, return_sender: bool) -> Any:
        wire, peer = self._source(call.usable(), src, tag, "recv")  # (a receive that raises takes nothing)
        if wire is not None:
            if peer is None and not is_cpu(wire.device):
                raise ValueError(
                    f"recv(src=None) needs a backend that can receive from any rank (gloo); this group moves bytes on "
                    f"{wire.device} — pass the sender's rank as src"
                )
            _requests.check_blocking(wire.group, "recv", src, tag)
            _pending.check(wire.group, "recv")
        while True:
            if wire is None or peer is None or peer == wire.rank:  # this rank's own message, where one waits
                message = _requests.own_message(None if wire is None else wire.group, tag)
                if message is not NOTHING:
                    return call.own(message, return_sender)
                if wire is None or peer is not None:
                    raise _requests.nothing_waiting("recv", src, tag)
            got = _p2p.recv(wire, peer, _frame.tensor_sizes) if peer is not None else _from_any_rank(wire)
            if got is not None:
                break
        sender, item, is_error = got
        obj = call._replace(wire=wire).received(sender, item, is_error)
        return (wire.ranks[sender], obj) if return_sender else obj

    def _isend_call(
        self, call: Call, obj: Any, dst: int, tag: int, express: Optional[Express] = None, serialized: Any = None
    ) -> Request:
        """``serialized``: what ``express`` serialized already (sendrecv, whose short path declined)."""
        wire, peer = self._destination(call, dst, tag, "isend")
        if wire is None or peer == wire.rank:
            local = self._send_own(call, wire, obj, tag, _still(serialized, express, call))
            return completed("isend", functools.partial(_raise, local))
        out, local = call.encode(obj, _still(serialized, express, call))
        out = _pending.captured(out)
        # eager where a blocking send is (a small message: wait() returns once it is posted, as MPI's isend of a
        # small message completes; a later send on its dst and tag waits for it: requests.check_blocking)
        return _requests.point_to_point(self.group, "send", dst, tag, lambda: self._deliver(wire, out, local, peer))

    # -- messages to oneself: held by objcomm._api.own_box._OwnBox, encoded, until this rank receives them
    # -------------
    @staticmethod
    def _send_own(
        call: Call, wire: Optional[Wire], obj: Any, tag: int, serialized: Any = None
    ) -> Optional[BaseException]:
        """Send ``obj`` to this rank itself under ``tag``: encoded as for a peer (a failure: its report, which the
        receive raises as ``RemoteError``), and owning its bytes, tensors included, so that the receiver decodes a
        copy of ``obj`` as it was now. Returns the encoding's failure, for the caller to raise."""
        if wire is not None:
            _pending.check(wire.group, "send")
        out, local = call.encode(obj, serialized)
        _requests.own_box(None if wire is None else wire.group).post(tag, _pending.captured(out))
        if wire is not None:  # a receive from any rank waiting for the others takes it, as under MPI
            wake_any_source(wire.group)
        return local


def _from_any_rank(wire: Wire) -> Optional[_p2p.Received]:
    """A receive from any rank under ``wire.tag``, or None where a message this rank sent itself came first: where the
    same-host channel carries it, its wait stops for that message (objcomm._transport.any_source)."""
    try:
        with AnySourceWait(group_facts(wire.group), wire.tag):
            return _p2p.recv(wire, None, _frame.tensor_sizes)
    except any_source.OwnMessage:
        return None


def _no_part_or_sizes(frame: memoryview) -> List[int]:
    """A pattern's all_to_all's ``sizes_of``: an empty frame (no part: ``encode_pattern``) announces no tensors."""
    return _frame.tensor_sizes(frame) if frame.nbytes else []


def _raise(error: Optional[BaseException]) -> None:
    if error is not None:
        raise with_original_type(error)


def _not_own(call: Call, value: Any, obj: Any, out: Optional[Outgoing] = None) -> Any:
    """Group rank 0's result of a reduction, which it combined itself (no decoding): a copy where ``op`` returned
    this rank's own object (``max``, ``min``, a user's ``op`` returning an argument), as every other rank gets one
    (a helper's find: mutating the result changed rank 0's input, there only). ``out``: the result encoded."""
    if value is not obj:
        return value
    if out is not None:
        return call.decode(Incoming(out.frame, list(out.tensors)), 0, own=True)
    try:
        return call.roundtrip(obj)
    except ObjcommError:  # it cannot be encoded (a reduce to rank 0 needs it nowhere else): the object, as before
        return value


def _still(serialized: Any, express: Optional[Express], call: Call) -> Any:
    """What the express path serialized, for the general path to encode, unless the settings changed
    meanwhile (another thread): then None, to serialize again."""
    return None if express is None or call.serializer is not express.call.serializer else serialized
