"""Hand-assembled hostile payloads for the safe serializers, shared by the adversarial tests.

Pickle payloads are written opcode by opcode (``glob``, ``call``, ``build``...), so a test can
name any global and feed any state without the attacker's side importing or running anything.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import pickletools
import struct
from typing import Any, Callable, Iterator

import msgpack

# Multiplies every fuzz test's example count: benchmarks/fuzz_hostile.py sets it for a longer run.
FUZZ_SCALE = int(os.environ.get("OBJCOMM_FUZZ_SCALE", "1"))


def v(value: Any) -> bytes:
    """The opcodes that push a plain value (protocol 3: no frame)."""
    return pickle.dumps(value, protocol=3)[2:-1]


def plain(value: Any) -> bytes:
    """Like :func:`v`, without memo writes (slower): for payloads that keep their own memo slots."""
    return pickletools.optimize(pickle.dumps(value, protocol=3))[2:-1]


def glob(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def tup(*parts: bytes) -> bytes:
    return b"(" + b"".join(parts) + b"t"


def call(fn: bytes, *parts: bytes) -> bytes:
    return fn + tup(*parts) + b"R"


def build(obj: bytes, state: bytes) -> bytes:
    return obj + state + b"b"


def newobj(cls: bytes, *parts: bytes) -> bytes:
    return cls + tup(*parts) + b"\x81"


def dict_of(*pairs: tuple[bytes, bytes]) -> bytes:
    return b"}(" + b"".join(k + val for k, val in pairs) + b"u"


def put(index: int) -> bytes:
    return b"r" + struct.pack("<I", index)


def get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)


def dag(depth: int, base: int = 0, leaf: bytes = b"]") -> bytes:
    """A list of two references to a list of two references to ... ``depth`` levels: its repr and
    any walk that does not remember what it saw take 2**depth steps. Uses memo ``base..base+depth``."""
    out = leaf + put(base) + b"0"
    for i in range(depth):
        out += b"](" + get(base + i) + get(base + i) + b"e" + put(base + i + 1) + b"0"
    return out + get(base + depth)


def tuple_dag(depth: int) -> bytes:
    """The same with tuples: not hash-cached, so hashing it takes 2**depth steps."""
    out = b")" + put(0) + b"0"
    for i in range(depth):
        out += get(i) + get(i) + b"\x86" + put(i + 1) + b"0"
    return out + get(depth)


def payload(body: bytes) -> bytes:
    return b"\x80\x05" + body + b"."


def numpy_dtype(spec: str, state: bytes) -> bytes:
    """numpy's own dtype pickle: ``numpy.dtype(spec, False, True)`` then BUILD with ``state``."""
    return build(call(glob("numpy", "dtype"), v(spec), v(False), v(True)), state)


def forged_object_field() -> bytes:
    """A structured array whose field 'a' is an object pointer made of attacker bytes (0x4141...)."""
    obj = numpy_dtype("O", v((3, "|", None, None, None, -1, -1, 63)))
    raw = numpy_dtype("V8", v((3, "|", None, None, None, 8, 1, 0)))
    fields = dict_of((v("a"), tup(obj, v(0))), (v("b"), tup(raw, v(0))))
    dtype = numpy_dtype("V8", tup(v(3), v("|"), v(None), v(("a", "b")), fields, v(8), v(1), v(0)))
    array = call(glob("numpy.core.multiarray", "_reconstruct"), glob("numpy", "ndarray"), v((0,)), v(b"b"))
    return payload(build(array, tup(v(1), v((1,)), dtype, v(False), v(b"\x41" * 8))))


def nested_ext(code: int, depth: int, leaf: Callable[[bytes], bytes] | None = None) -> bytes:
    """msgpack: ``depth`` extension values of type ``code``, each holding the next."""
    inner = msgpack.packb([1])
    for _ in range(depth):
        body = leaf(inner) if leaf is not None else inner
        inner = msgpack.packb(msgpack.ExtType(code, body))
    return inner


def outcome(fn: Callable[[], Any]) -> str:
    """``"ok"``, or the exception's type name; ``"MemoryError"`` if one is anywhere in its causes."""
    try:
        fn()
        return "ok"
    except Exception as exc:
        seen: Any = exc
        while seen is not None:
            if isinstance(seen, MemoryError):
                return "MemoryError"
            seen = seen.__cause__ or seen.__context__
        return type(exc).__name__


@contextlib.contextmanager
def _replaced(owner: Any, name: str, replacement: Any, active: bool) -> Iterator[None]:
    """Inside, where ``active`` (one rank: pool workers have no monkeypatch), ``owner.name`` is ``replacement``."""
    real = getattr(owner, name)
    if active:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, real)


def tensor_tables_that_lie(active: bool = True) -> contextlib.AbstractContextManager[None]:
    """Inside, where ``active`` (one rank), objcomm's encoder sends an object's two out-of-band tensors split
    150,000 bytes / the rest, whatever its frame's tensor table says (the same total): a sender whose slot and
    frame disagree."""
    import torch

    from objcomm._format import frame as _frame

    real = _frame.encode

    def lying(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        if len(out.tensors) == 2:
            both = torch.cat([t.reshape(-1) for t in out.tensors])
            out.tensors = [both[:150_000], both[150_000:]]
        return out

    return _replaced(_frame, "encode", lying, active)


def result_or_error(call: Callable[[], Any], message: bool = False) -> Any:
    """What ``call()`` returned, or the type name of the objcomm error it raised (``"CommunicationError"`` for every
    kind of it, ``OutOfStep`` among them); ``message``: ``[type name, message]``."""
    import objcomm

    try:
        return call()
    except objcomm.CommunicationError as exc:
        return ["CommunicationError", str(exc)] if message else "CommunicationError"
    except objcomm.ObjcommError as exc:
        return [type(exc).__name__, str(exc)] if message else type(exc).__name__


def a_relay_that_lies(
    lie: str, to: Callable[[Any, int], bool], active: bool = True
) -> contextlib.AbstractContextManager[None]:
    """Inside, where ``active`` (the liar's rank), objcomm's messages along the reduce tree (its internal tag) to the
    group ranks that ``to(wire, dst)`` names lie: ``forged``, an error report in place of what they carry (the
    result, on the way down); ``hidden limit``, a limit of 2**61 for the sender's subtree (on the way up), hiding
    the max_bytes of the ranks below it."""
    from objcomm._errors import ObjcommError
    from objcomm._format.frame import error_frame
    from objcomm._transport import p2p as _p2p
    from objcomm._transport.base import INTERNAL_TAG

    real = _p2p.send

    def lying_send(wire: Any, out: Any, dst: int, eager: bool = True, tree: bool = False) -> None:
        if wire.tag == INTERNAL_TAG and to(wire, dst):
            if lie == "forged":
                out = error_frame(ObjcommError(f"forged by rank {wire.rank}"), wire.inline_capacity)
            else:
                wire = wire._replace(max_bytes=1 << 61)
        real(wire, out, dst, eager, tree)

    return _replaced(_p2p, "send", lying_send, active)


def a_vote_relay_that_hides(hidden_from: int, active: bool = True) -> contextlib.AbstractContextManager[None]:
    """Inside, where ``active`` (the liar's rank), a vote's recursive doubling through the backend
    (``objcomm._transport.base._largest_by_doubling``) sends group rank ``hidden_from`` this rank's own words instead of
    the maximum it has learnt: the words of the ranks that reach ``hidden_from`` only through this rank (in a group of
    8 or 4, rank 2 relays rank 3's to rank 0) are dropped from the answer, which the broadcast then gives everyone."""
    import torch
    import torch.distributed as dist

    from objcomm._transport import base as _base

    def lying(wire: Any, mine: Any, op: str) -> Any:
        me, size, tag = wire.rank, wire.size, 2 * _base.INTERNAL_TAG + 1
        below, own, theirs = 1 << (size.bit_length() - 1), mine.clone(), torch.zeros_like(mine)

        assert me < below and me + below >= size, "the liar takes part in every exchange (no hand-over)"
        step = 1
        while step < below:
            peer = wire.ranks[me ^ step]
            sent = own if me ^ step == hidden_from else mine.clone()
            ops = [
                dist.P2POp(dist.isend, sent, peer, wire.group, tag),
                dist.P2POp(dist.irecv, theirs, peer, wire.group, tag),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            torch.maximum(mine, theirs, out=mine)
            step *= 2
        dist.broadcast(mine, src=wire.ranks[0], group=wire.group)
        return mine.tolist()

    return _replaced(_base, "_largest_by_doubling", lying, active)


def all_reduce_under(lie: str, comm: Any, rank: int, world: int, limited: Any = None, message: bool = False) -> Any:
    """What ``comm``'s all_reduce gives this rank (:func:`result_or_error`, with ``message``) on a group of ``world``
    ranks where a relay lies (:func:`a_relay_that_lies`): ``forged``, the sum of every rank's rank + 1; ``hidden
    limit``, the length of 160,000 bytes (``world`` parts), which rank ``limited`` (max_bytes 100,000) refuses."""
    import operator

    if lie == "forged":
        return result_or_error(lambda: comm.all_reduce(rank + 1, "sum"), message)
    limit = 100_000 if rank == limited else None
    reduced = lambda: len(comm.all_reduce(b"x" * (160_000 // world), operator.add, max_bytes=limit))  # noqa: E731
    return result_or_error(reduced, message)
