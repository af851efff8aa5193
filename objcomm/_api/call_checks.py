"""Every rank compares its collective before anything moves (``check_calls``, ``OBJCOMM_CHECK_CALLS=1``): for debugging.

Ranks that call different collectives, or the same one with another root, reduction or round-1 setting, are a bug in
the program; through the backend they wait until the group's timeout (gloo's default: 30 minutes) and then say
only that a peer did not come. With ``check_calls`` on, each collective first votes on a fingerprint of its call
(in the vote every group holds at its first collective, :func:`objcomm._transport.rounds.agree_on_round_one`: eight
words through the group's backend, a doubling on gloo, one all_reduce on NCCL; a rank without ``check_calls`` meets
it there, and every rank raises saying so); where the fingerprints differ, every
rank gathers every rank's description (one all_gather of 512 bytes a rank) and raises
:class:`~objcomm.CommunicationError` naming which ranks called what. It costs one small collective a call (and
turns the express path off), so it is off by default. torch's own check (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) does
not serve here: it counts point-to-point messages into its sequence numbers, so it fails every program whose ranks
sent different numbers of them (objcomm's trees do) before it compares anything.

Example::

    OBJCOMM_CHECK_CALLS=1 torchrun --nproc_per_node=2 train.py
    # objcomm.CommunicationError: all_gather: the ranks of this group did not make the same call
    # (check_calls): rank 0: all_gather(); rank 1: broadcast(src=0). ...

send/recv are not checked (two ranks take part, not the group).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Optional

import torch

from objcomm._api import reduce as _reduce
from objcomm._api.call import Call
from objcomm._errors import KINDS_SHOWN, CommunicationError, spans
from objcomm._transport.base import Wire
from objcomm._transport.bytes import all_gather_table
from objcomm._transport.rounds import agree_on_round_one

ROW_BYTES = 512  # one rank's description in the all_gather that follows a disagreement
_SHARED = ("slot_bytes", "local", "shm", "shm_threshold", "shm_zero_copy", "shm_dir")  # what shapes a call's rounds


def check(call: Call, op: str, root: Optional[int] = None, reduction: Any = None, root_name: str = "") -> None:
    """Raise :class:`~objcomm.CommunicationError` on every rank where the group's ranks called different collectives
    (``op``), or with another root (``root_name``'s global rank ``root``), reduction or setting that shapes the
    call's rounds; nothing when ``check_calls`` is off or the group is this rank alone."""
    wire = call.wire
    if wire is None or wire.size == 1 or not call.options.check_calls:
        return
    described = _described(call, op, root, reduction, root_name)
    text = json.dumps(described, sort_keys=True).encode()[:ROW_BYTES]
    fingerprint = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2
    # the vote of a group's first call, every call: a rank without check_calls meets this one there, of one shape
    if agree_on_round_one(wire, op, check_calls=True, fingerprint=fingerprint):
        raise CommunicationError(_message(op, _gathered(wire, text, op)))


def _described(call: Call, op: str, root: Optional[int], reduction: Any, root_name: str) -> Dict[str, Any]:
    described: Dict[str, Any] = {"op": op}
    if root_name:
        described[root_name] = root
    if reduction is not None:
        described["reduce_op"] = _reduce.op_name(reduction)[:60]  # ("sum" where another rank wrote operator.add)
    for name in _SHARED:
        value = getattr(call.options, name)
        described[name] = value if value is None or isinstance(value, (bool, int)) else str(value)[:100]
    return described


def _gathered(wire: Wire, text: bytes, op: str) -> List[Dict[str, Any]]:
    """Every rank's description (only after a vote found them different: a rank that lies breaks only this call)."""
    table = all_gather_table(wire, torch.frombuffer(bytearray(text), dtype=torch.uint8), ROW_BYTES, op)
    rows = table.cpu().numpy().tobytes()
    described = []
    for rank in range(wire.size):
        try:
            described.append(json.loads(rows[rank * ROW_BYTES : (rank + 1) * ROW_BYTES].rstrip(b"\0")))
        except ValueError:
            described.append({"op": "(a description this rank could not read)"})
    return described


def _message(op: str, described: List[Dict[str, Any]]) -> str:
    keys = {k for d in described for k in d} - {"op"}  # (each key's values once: O(W), not a pass over pairs)
    differ = {k for k in keys if len({repr(d.get(k)) for d in described}) > 1}
    by_call: Dict[str, List[int]] = {}
    for rank, d in enumerate(described):
        args = [f"{k}={d[k]!r}" for k in ("dst", "src") if k in d]
        args += [f"op={d['reduce_op']!r}"] if "reduce_op" in d else []
        shown = f"{d.get('op')}({', '.join(args)})"
        settings = [f"{k}={d.get(k)!r}" for k in _SHARED if k in differ]
        by_call.setdefault(shown + (f" with {', '.join(settings)}" if settings else ""), []).append(rank)
    calls = "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {spans(r)}: {c}" for c, r in list(by_call.items())[:KINDS_SHOWN]
    )
    return (
        f"{op}: the ranks of this group did not make the same call (check_calls): {calls}"
        f"{'; and others' if len(by_call) > KINDS_SHOWN else ''}. Nothing was moved, and every rank raises this. Every "
        "rank of a group must call its collectives in the same order, with the same root, reduction and settings "
        '(slot_bytes, local, shm...: docs/same-host.md, "Settings"); the group can be used again'
    )
