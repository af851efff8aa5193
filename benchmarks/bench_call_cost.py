"""Where a small call's own time goes: objcomm's per-call Python work, piece by piece, in one process.

    PYTHONPATH=. python benchmarks/bench_call_cost.py [--calls 500] [--serializers pickle msgpack] [--write]

One process, no network: a gloo group of world size 1 on a ``HashStore``. For a small dict it times

- **whole calls**: ``all_gather`` and ``broadcast`` of a ``Communicator(serializer=...)`` end to end
  (gloo included: at world size 1 its collective is a thread hand-off, tens to hundreds of µs, and
  noisy), the same through a ``Communicator`` whose round 1 loops back in process (the pure Python
  cost of a call, the bound issue 14 runs into once the collective is cheap; once more with the
  serializer given per call, which resolves the call's settings each time), and a raw gloo
  ``all_gather_single`` of one slot;
- **the pieces of one all_gather**, staged as :meth:`objcomm.Communicator.all_gather` runs them, with
  a clock read between pieces (so every piece runs with the caches as warm or cold as in a real
  call, not in a tight loop of its own): settings resolution (the communicator, the per-call
  options, the serializer and the wire), encode (serializer ``dumps`` and framing), slot fill (the
  slot and its tensor), the collective, slot read (the slot checks and what round 1 delivered),
  decode (framing checks and ``loads``) and result assembly;
- **send and recv** without a peer: the sender's settings, encode and slot, and the receiver's
  settings, slot checks and decode (the backend's send/recv themselves are left out, and so is
  finding the peer's group rank, which a group of one cannot have).

Every time is µs per call in the quickest of 30 rounds of ``--calls`` calls (other processes only
ever add time; a clock read costs about 0.1 µs), so the sum of stages is not a whole call's time;
two rows count the function calls (Python and C) one call makes, which noise does not change. The
machine is shared: compare numbers within one run, or runs of two revisions made back to back
(``PYTHONPATH=<other checkout> python benchmarks/bench_call_cost.py``). ``--write`` appends the
table to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from time import perf_counter_ns
from typing import Any, Callable, Dict, List, Optional, Sequence

OBJ = {"rank": 0, "loss": 0.25, "step": 1000, "tag": "train", "ok": True}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
ROUNDS = 30


class _Loopback:
    """A slot medium whose round 1 moves nothing (world size 1: every pattern has no peer to send to or hear from)."""

    def exchange(self, wire: Any, at: Any, mine: Any, op: str) -> Dict[int, Any]:
        return {}


def _loopback_communicator(serializer: str) -> Any:
    from objcomm import Communicator

    class LoopbackCommunicator(Communicator):
        def _wire(self, options: Any) -> Any:
            return super()._wire(options)._replace(slot_medium=_Loopback())

    return LoopbackCommunicator(serializer=serializer)


def _per_call(fn: Callable[[], Any], calls: int) -> float:
    """µs per call in the quickest of ROUNDS rounds of ``calls`` calls."""
    for _ in range(min(calls, 500)):
        fn()
    rounds = []
    for _ in range(ROUNDS):
        start = perf_counter_ns()
        for _ in range(calls):
            fn()
        rounds.append((perf_counter_ns() - start) / calls / 1e3)
    return min(rounds)


def _function_calls(fn: Callable[[], Any]) -> float:
    """Python and C function calls one call of ``fn`` makes (a count, so free of the machine's noise)."""
    fn()
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count - 1  # the profiler sees its own sys.setprofile(None)


def _staged(stages: Callable[[List[int]], Any], names: Sequence[str], calls: int) -> Dict[str, float]:
    """µs per call of each stage in its quickest round; ``stages(stamps)`` appends a clock read after each stage."""
    for _ in range(min(calls, 500)):
        stages([])
    totals: Dict[str, List[float]] = {name: [] for name in names}
    for _ in range(ROUNDS):
        sums = [0] * len(names)
        for _ in range(calls):
            stamps = [perf_counter_ns()]
            stages(stamps)
            for i in range(len(names)):
                sums[i] += stamps[i + 1] - stamps[i]
        for name, total in zip(names, sums):
            totals[name].append(total / calls / 1e3)
    return {name: min(values) for name, values in totals.items()}


ALL_GATHER_STAGES = (
    "settings resolution",
    "encode (dumps + framing)",
    "slot fill (+ tensor)",
    "collective",
    "slot read (+ checks)",
    "decode (framing + loads)",
    "result assembly",
)


def all_gather_stages(serializer: str) -> Callable[[List[int]], Any]:
    """:meth:`objcomm.Communicator.all_gather` of OBJ through gloo, cut into ALL_GATHER_STAGES."""
    from objcomm import Communicator, _settings
    from objcomm._api import functions as _functions
    from objcomm._format import frame as _frame
    from objcomm._format import limits as _limits
    from objcomm._format.slot import read_slots
    from objcomm._transport import bytes as _bytes
    from objcomm._transport import rounds as _rounds
    from objcomm._transport.base import all_gather_single, guarded
    from objcomm._transport.bytes import empty, host_view

    # as objcomm.all_gather gets its communicator; getattr: revisions before these existed (to compare with)
    communicator = getattr(_functions, "_communicator", Communicator)
    receive_buffer = getattr(_bytes, "receive_buffer", None)

    def stages(stamps: List[int]) -> Any:
        kwargs = _settings.call_kwargs(
            {"serializer": serializer, "accept": None, "max_bytes": None, "map_location": None, "compression": None}
        )
        call = communicator(None)._call(kwargs)
        wire = call.wire
        stamps.append(perf_counter_ns())
        out, local = call.encode(OBJ)
        stamps.append(perf_counter_ns())
        raw = _rounds._slot(wire, out)
        mine = _rounds._on_device(wire, raw)
        received, host = (
            receive_buffer(wire.slot * wire.size, wire)
            if receive_buffer
            else (empty(wire.slot * wire.size, wire), None)
        )
        stamps.append(perf_counter_ns())
        guarded("all_gather", wire, all_gather_single, received, mine, group=wire.group)
        stamps.append(perf_counter_ns())
        infos = read_slots(host if host is not None else host_view(received), wire.size, wire.slot)
        _limits.plans(infos, _frame.tensor_sizes, "all_gather")
        assert not any(info.error for info in infos) and all(_limits.complete(info) for info in infos)
        incoming = _rounds._round_one(infos)
        call.raise_failures("all_gather", incoming, local)
        stamps.append(perf_counter_ns())
        objs = [call.decode(item, r) for r, item in enumerate(incoming)]
        stamps.append(perf_counter_ns())
        result = list(objs)
        stamps.append(perf_counter_ns())
        return result

    return stages


SEND_RECV_STAGES = (
    "send: settings (+ tag, async check)",
    "send: encode",
    "send: slot fill (+ tensor, check)",
    "recv: settings (+ tag, async check)",
    "recv: slot read (+ checks)",
    "recv: decode",
)


def send_recv_stages(serializer: str) -> Callable[[List[int]], Any]:
    """A sender's and a receiver's own work for OBJ, without the backend's send and recv between them."""
    from objcomm import Communicator, _settings
    from objcomm._api import functions as _functions
    from objcomm._api import requests as _requests
    from objcomm._api.call import tagged
    from objcomm._format import limits as _limits
    from objcomm._format.slot import read_slot
    from objcomm._transport import rounds as _rounds
    from objcomm._transport.bytes import host_view

    communicator = getattr(_functions, "_communicator", Communicator)  # as objcomm.send and objcomm.recv get it

    def stages(stamps: List[int]) -> Any:
        call = communicator(None)._call(
            _settings.call_kwargs({"serializer": serializer, "max_bytes": None, "compression": None})
        )
        wire = tagged(call.wire, 0, "send")
        _requests.check_blocking(wire.group, "send", 0, 0)
        stamps.append(perf_counter_ns())
        out, _ = call.encode(OBJ)
        stamps.append(perf_counter_ns())
        raw = _rounds._slot(wire, out)
        slot = _rounds._on_device(wire, raw)
        info = read_slot(memoryview(raw))
        assert _limits.slot_problem_of(info) is None and _limits.complete(info)
        stamps.append(perf_counter_ns())
        call = communicator(None)._call(
            _settings.call_kwargs({"accept": None, "max_bytes": None, "map_location": None})
        )
        wire = tagged(call.wire, 0, "recv")
        _requests.check_blocking(wire.group, "recv", 0, 0)
        stamps.append(perf_counter_ns())
        info = read_slot(host_view(slot))
        assert _limits.slot_problem_of(info) is None and _limits.complete(info)
        assert info.inline is not None
        item = _rounds.Incoming(info.inline, error=info.error)
        stamps.append(perf_counter_ns())
        obj = call.decode(item, 0)
        stamps.append(perf_counter_ns())
        return obj

    return stages


def measure(serializers: Sequence[str], calls: int) -> Dict[str, Dict[str, float]]:
    import torch
    import torch.distributed as dist

    import objcomm
    from objcomm._transport.base import all_gather_single

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    slot = objcomm.settings().slot_bytes
    send, recv = torch.zeros(slot, dtype=torch.uint8), torch.empty(slot, dtype=torch.uint8)
    table: Dict[str, Dict[str, float]] = {}
    for name in serializers:
        # a communicator that holds the serializer (no per-call option: the settings are not resolved per call)
        comm, loop = objcomm.Communicator(serializer=name), _loopback_communicator(name)
        assert comm.all_gather(OBJ) == [OBJ] and loop.all_gather(OBJ) == [OBJ] and loop.broadcast(OBJ) == OBJ
        column = {
            label: _per_call(functools.partial(fn, OBJ), calls)
            for label, fn in (
                ("objcomm all_gather (gloo, W=1)", comm.all_gather),
                ("objcomm broadcast (gloo, W=1)", comm.broadcast),
                ("all_gather, round 1 looped back", loop.all_gather),
                ("broadcast, round 1 looped back", loop.broadcast),
            )
        }
        column["all_gather, round 1 looped back, serializer given per call"] = _per_call(
            functools.partial(_loopback_communicator("pickle").all_gather, OBJ, serializer=name), calls
        )
        raw = functools.partial(all_gather_single, recv, send)
        column["raw gloo all_gather_single (1 slot)"] = _per_call(raw, calls)
        column["function calls in one all_gather (a count)"] = _function_calls(functools.partial(comm.all_gather, OBJ))
        column["function calls in one broadcast (a count)"] = _function_calls(functools.partial(comm.broadcast, OBJ))
        staged = _staged(all_gather_stages(name), ALL_GATHER_STAGES, calls)
        column.update({f"all_gather: {k}": v for k, v in staged.items()})
        column["all_gather: sum of stages"] = sum(staged.values())
        column["all_gather: sum without the collective"] = sum(staged.values()) - staged["collective"]
        column.update(_staged(send_recv_stages(name), SEND_RECV_STAGES, calls))
        table[name] = column
    return table


def report(table: Dict[str, Dict[str, float]], calls: int) -> str:
    names = list(table)
    rows = list(next(iter(table.values())))
    lines = [
        f"### A small dict, one process ({os.cpu_count()} CPUs, quickest of {ROUNDS} rounds of {calls} calls)",
        "",
        "| µs per call | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for row in rows:
        cells = [f"{table[n][row]:.0f}" if "(a count)" in row else f"{table[n][row]:.1f}" for n in names]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per timed round")
    parser.add_argument("--serializers", nargs="+", default=["pickle", "msgpack"])
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    text = report(measure(args.serializers, args.calls), args.calls)
    print(text, flush=True)
    if args.write:
        with open(RESULTS, "a") as f:
            f.write(
                "\n## Per-call cost of a small call, piece by piece (issue 14)\n\n"
                "`PYTHONPATH=. python benchmarks/bench_call_cost.py`: one process, gloo at world size 1 "
                "(`HashStore`); see the script's docstring.\n\n" + text
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
