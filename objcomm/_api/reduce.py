"""Reductions of Python objects: named operations and the tree that combines ranks in order.

A reduction combines every rank's object with ``op(a, b) -> c``, assumed associative, never
assumed commutative: the result is ``op(...op(op(obj_0, obj_1), obj_2)..., obj_{n-1})`` in group-rank
order. :func:`tree` runs a binomial tree towards group rank 0: in round ``k`` a rank whose rank has
bit ``k`` set sends what it holds to ``rank - 2**k`` and is done; the others receive from
``rank + 2**k`` and combine ``op(mine, theirs)``, so lower ranks stay on the left. That is
⌈log2 W⌉ rounds, and a rank decodes at most one object per round.

A failure (encoding, decoding, ``op`` raising, an unknown name, a child whose op differs: :func:`check_op`) never
stops a rank from taking part: it sends an error report up the tree instead of a value, and the caller's final
collective tells every rank which ranks failed (see :meth:`objcomm.Communicator.reduce`). When ``op`` raises, the
report is an :class:`~objcomm._errors.OpError` that names the function, where it raised and which ranks' objects it
was combining: the caller's code failed, not a serializer.
"""

from __future__ import annotations

import copy
import operator
import os
import zlib
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple, Union

from objcomm._errors import CommunicationError, ObjcommError, OpError
from objcomm._format import frame as _frame
from objcomm._format.message import Incoming
from objcomm._transport import p2p as _p2p
from objcomm._transport.base import INTERNAL_TAG, TreeLevels, Wire
from objcomm._transport.patterns import binomial

Op = Union[str, Callable[[Any, Any], Any]]


def _merge(a: Dict[Any, Any], b: Dict[Any, Any]) -> Dict[Any, Any]:
    merged = copy.copy(a)  # of a's type (a Counter, a defaultdict), as a group of one returns it
    merged.update(b)
    return merged


def _merge_sum(a: Dict[Any, Any], b: Dict[Any, Any]) -> Dict[Any, Any]:
    merged = copy.copy(a)
    for key, value in b.items():
        merged[key] = merged[key] + value if key in merged else value
    return merged


NAMED_OPS: Dict[str, Callable[[Any, Any], Any]] = {
    "sum": operator.add,  # numbers, tensors, arrays; concatenates lists, tuples and strings
    "prod": operator.mul,
    "min": min,
    "max": max,
    "merge": _merge,  # dicts: the union, a later rank's value wins for a key both have
    "merge_sum": _merge_sum,  # dicts of counts: the union, values of a key both have added
}


_NAMES = {id(function): name for name, function in NAMED_OPS.items()}


def resolve(op: Op) -> Callable[[Any, Any], Any]:
    """The function ``op`` names (one of :data:`NAMED_OPS`), or ``op`` itself when callable."""
    if callable(op):
        return op
    if isinstance(op, str) and op in NAMED_OPS:
        return NAMED_OPS[op]
    hint = ""
    if isinstance(op, str) and op.lower() in _MPI_ONLY:  # mpi4py's MPI.MAXLOC, MPI.LAND, ... written as a string
        hint = (
            f"; mpi4py's MPI.{op.upper()} has no name here: pass a function, e.g. {_MPI_ONLY[op.lower()]} "
            '(docs/from-mpi4py.md, "Reductions and their ops")'
        )
    raise ValueError(f"op must be a callable op(a, b) -> c or one of {sorted(NAMED_OPS)}, got {op!r}{hint}")


def taking_part(op: Op) -> Tuple[Callable[[Any, Any], Any], Optional[BaseException]]:
    """``(the function op names, None)``; where it names none, ``(operator.add, why)``: the rank takes part all the
    same (the function is never called, nothing being complete there), and reports why at the end."""
    try:
        return resolve(op), None
    except ValueError as exc:
        return operator.add, exc


_MPI_ONLY = {  # mpi4py's ops that objcomm does not name, and a function that does what each does
    "maxloc": "op=lambda a, b: b if b[0] > a[0] else a on (value, rank) pairs",
    "minloc": "op=lambda a, b: b if b[0] < a[0] else a on (value, rank) pairs",
    "land": "op=lambda a, b: a and b",
    "lor": "op=lambda a, b: a or b",
    "lxor": "op=lambda a, b: bool(a) != bool(b)",
    "band": "op=operator.and_",
    "bor": "op=operator.or_",
    "bxor": "op=operator.xor",
}


_MARK_SHIFT = 1  # a message's op mark: its frame header's flags, bits 1-7 (bit 0: an error report)


def op_flags(op: Op) -> int:
    """The frame flags that mark ``op`` in the messages of a reduction's tree and a scan's steps: a number from 1 to
    127 in bits 1-7, alike on every rank that passes the same op (:func:`op_name`, through crc32: ``hash()`` of a str
    differs between processes). A receiver whose own op's mark differs fails the call on every rank
    (:func:`check_op`), where ranks that passed different ops (``"sum"`` on one, ``"max"`` on another) returned a
    mixture of both. Two different ops share a mark once in 127."""
    return (zlib.crc32(op_name(op).encode("utf-8", "replace")) % 127 + 1) << _MARK_SHIFT


def op_name(op: Op) -> str:
    """What ``op`` is, alike on every rank that passes the same op: a name of :data:`NAMED_OPS` (also for the function
    it stands for: ``operator.add`` where another rank wrote ``"sum"``), else the function's module, name and, where
    it has code, first line (two lambdas of one module differ)."""
    if isinstance(op, str):
        return op
    named = _NAMES.get(id(op))
    if named is not None:
        return named
    code = getattr(op, "__code__", None)
    module = getattr(op, "__module__", None) or type(op).__module__
    return f"{module}.{_name_of(op)}" + (f":{code.co_firstlineno}" if code is not None else "")


def check_op(item: Incoming, flags: int, op: Op, peer: int) -> None:
    """Raise :class:`ValueError` where ``item`` from group rank ``peer`` (decoded: its header was checked) marks
    another op than this rank's, ``flags`` (:func:`op_flags`); a frame that marks none (an older objcomm's) passes."""
    theirs = item.frame[5] & (0x7F << _MARK_SHIFT)
    if theirs and theirs != flags:
        raise ValueError(
            f"group rank {peer} passed another op than this rank's {op_name(op)!r}: every rank of a reduction or a "
            "scan must pass the same op (the same name, or the same function)"
        )


def _name_of(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else f"{type(fn).__qualname__} object"  # a callable object, a partial


def _ranks(first: int, last: int) -> str:
    return f"group rank {first}" if first == last else f"group ranks {first}-{last}"


def op_error(op: Op, fn: Callable[[Any, Any], Any], exc: BaseException, left: str, right: str) -> OpError:
    """The :class:`OpError` for ``fn`` (what ``op`` names) raising ``exc`` on ``op(a, b)``, where ``a``
    combines the objects of ``left`` and ``b`` those of ``right``."""
    raised = f"{type(exc).__name__}: {exc}"
    combining = f"combining op(a, b) with a from {left} and b from {right}"
    if isinstance(op, str):  # a named op: the objects do not support it
        return OpError(
            f"op {op!r} raised {raised}, {combining}; {op!r} cannot combine these objects: "
            "choose another op or pass a function op(a, b)"
        )
    code = getattr(fn, "__code__", None)
    name = _name_of(fn)
    if code is None and hasattr(fn, "__qualname__") and getattr(fn, "__module__", None) not in (None, "builtins"):
        name = f"{fn.__module__}.{name}"  # no file to show
    tb, where = exc.__traceback__, ""
    while tb is not None and code is not None:
        if tb.tb_frame.f_code is code:
            where = f" ({os.path.basename(code.co_filename)}, line {tb.tb_lineno})"
            break
        tb = tb.tb_next
    return OpError(
        f"the op function {name}{where} raised {raised}, {combining}; that is the caller's code, "
        f"not objcomm's: fix {name}"
    )


class Reduced(NamedTuple):
    """What :func:`tree` leaves on a rank."""

    value: Optional[Any]  # the reduction, on group rank 0 when complete
    complete: bool  # no failure anywhere at or below this rank
    own: Optional[BaseException]  # what failed on this rank (its report travelled up the tree in place of a value)
    lowest: int  # the smallest max_bytes at or below this rank (group rank 0: of every rank that reported one)


def tree(call: Any, obj: Any, op: Op, levels: Optional[TreeLevels] = None) -> Reduced:
    """Combine every rank's ``obj`` onto group rank 0 over ``call.wire`` (``levels``: its two levels, or None).

    Each message up the tree announces, in its slot's limit, the smallest ``max_bytes`` of the subtree it
    comes from, so that group rank 0 learns the group's smallest (:attr:`Reduced.lowest`): the result that
    goes back down the tree (:func:`objcomm._transport.broadcast.down_tree`) is then refused once, at the
    root, for every rank alike, rather than by one rank in the middle of the tree.

    On two levels (``levels``, from :meth:`~objcomm._transport.base.SlotMedium.tree_levels`: a CPU group across
    hosts, each host's ranks consecutive) each host's ranks climb a tree over the host's channel to its leader, then
    the leaders climb theirs through the backend: the same order of ranks, and only the leaders call the backend.
    """
    wire = call.wire
    fn, own = taking_part(op)
    held = Reduced(obj, own is None, own, wire.max_bytes)
    mine = None if isinstance(op, str) else obj  # a function of the caller's may update its first argument in place
    if levels is None:
        ranks = range(wire.size)
        return _climb(call, wire, wire.rank, ranks, ranks, held, fn, op, mine)
    host = levels.home
    if levels.host is not None:  # the host's ranks, consecutive
        ranks = range(levels.leaders[host], levels.lasts[host] + 1)
        held = _climb(call, levels.host, wire.rank - ranks[0], ranks, ranks, held, fn, op, mine)
    if wire.rank != levels.leaders[host]:  # what this rank held went up to its leader
        return held
    reduced: Reduced = levels.lead(_climb, call, wire, host, levels.leaders, levels.lasts, held, fn, op, mine)
    return reduced


def _copy_of(obj: Any) -> Any:
    """A deep copy of this rank's own object, for ``op`` to combine (and update in place, as mpi4py, which combines
    unpickled copies, lets it); the object itself where it cannot be copied."""
    try:
        return copy.deepcopy(obj)
    except Exception:
        return obj


def _climb(
    call: Any,
    wire: Wire,
    me: int,
    ranks: Sequence[int],
    lasts: Sequence[int],
    held: Reduced,
    fn: Callable[[Any, Any], Any],
    op: Op,
    mine: Any = None,
) -> Reduced:
    """One binomial tree towards ``ranks[0]`` over the group ranks ``ranks`` of ``wire`` (this rank: ``ranks[me]``),
    from what this rank holds (``held``); ``lasts[i]``: the highest group rank whose object ``ranks[i]`` holds.
    ``mine``: the caller's own object where ``op`` is its function, which then combines a copy of it."""
    wire = wire._replace(tag=INTERNAL_TAG)  # above every tag a caller may pass (objcomm._api.call.MAX_TAG)
    value, complete, own, lowest = held
    tree, flags = binomial(me, len(ranks)), op_flags(op)
    for child, end in zip(tree.children, tree.ends):
        peer = ranks[child]
        try:
            _, item, is_error = _p2p.recv(wire, peer, _frame.tensor_sizes, tree=True)
            lowest = min(lowest, item.sender_limit)
            if is_error:
                complete = False
            elif complete:
                theirs = call.decode(item, peer)
                check_op(item, flags, op, peer)
                if mine is not None and value is mine:  # (its first combination here: never the caller's object)
                    value = _copy_of(value)
                try:
                    value = fn(value, theirs)
                except Exception as exc:
                    left, right = _ranks(ranks[me], lasts[child - 1]), _ranks(peer, lasts[end - 1])
                    raise op_error(op, fn, exc, left, right) from exc
        except CommunicationError:
            raise
        except Exception as exc:  # refused, undecodable, or op raised: reported at the end
            own, complete = own or exc, False
    if tree.parent is not None:  # send what this subtree holds to the parent
        if complete:
            out, failed = call.encode(value, flags=flags)
            own = own or failed
        else:
            out = _frame.error_frame(own or ObjcommError("a rank below failed"), wire.inline_capacity)
        refused = _p2p.tree_send(wire._replace(max_bytes=lowest), out, ranks[tree.parent])  # (sent whatever this
        own = own or refused  # rank's own failure; a refusal: the parent knows, and so will everyone else)
        return Reduced(None, False, own, lowest)
    return Reduced(value if complete else None, complete, own, lowest)
