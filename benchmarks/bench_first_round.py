"""Small objects with round 1 through the same-host channel (``local=True``) and through gloo (``local=False``).

    PYTHONPATH=. python benchmarks/bench_first_round.py [--world-sizes 2 4] [--repeat 40] [--batch 25]
    PYTHONPATH=. python benchmarks/bench_first_round.py --above-round-one [--sizes 16KB 256KB 2MB 16MB]

Candidates, on the same ranks, round-robin with a gloo barrier before every sample of ``--batch`` calls
back to back (a sample is the slowest rank's time per call, a timing the median:
``objcomm._tools.bench.measure.interleaved``; ``--batch 1`` times single calls from the barrier, which on a
small machine mostly measures how far apart the ranks leave it):

- ``all_gather``/``broadcast`` of a small dict (one slot, no second round) through a
  ``Communicator(local=True)`` and a ``Communicator(local=False)``;
- ``send/recv``: a round trip of the same dict between ranks 0 and 1 (``send`` then ``recv`` on rank 0,
  the reverse on rank 1; the other ranks idle), through the channel (after an all_gather voted send/recv
  in) and through gloo; ``general path``: through the channel with a per-call option given (``max_bytes``
  at its default), which leaves out the express path of :mod:`objcomm._api.express`;
- ``raw gloo``: ``all_gather_single`` of one 4096-byte slot per rank, the baseline;
- ``bare channel``: the group's :class:`objcomm._samehost.channel.LocalChannel` itself moving 4096 bytes (an all_gather,
  a broadcast, a send/recv round trip), without objcomm's encode, slots, checks and decode: the floor the
  channel sets, so that the rest of each call is objcomm's own Python; and ``framing + bare channel``: a
  round trip of the dict as objcomm frames it (encode, slot; slot read, decode) over the bare channel, without
  the Communicator's and the transport's layers: what the frame format itself costs.

``--above-round-one``: objects whose frames overflow the slot (a ``bytes`` of each ``--sizes``, then a list
of floats of about that size), all_gather and broadcast with ``local=True`` and ``local=False``, one call per
sample (after a barrier): with the channel on, only round 1 and the small words before a second round change
route, so the ratio shows whether anything above round 1 got slower.

The machine is shared and small: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

SLOT = 4096
OBJ = {"loss": 0.25, "step": 1000, "tag": "train"}


def measure(repeat: int, batch: int = 1) -> Dict[str, float]:
    import torch
    import torch.distributed as dist

    import objcomm
    from objcomm import _state
    from objcomm._tools.bench.measure import interleaved
    from objcomm._transport.base import all_gather_single

    torch.set_num_threads(1)
    world = dist.get_world_size()
    on, off = objcomm.Communicator(local=True), objcomm.Communicator(local=False)
    on.all_gather(None)  # opens the channel; nothing in flight, so send/recv go through it from now on
    send, recv = torch.zeros(SLOT, dtype=torch.uint8), torch.empty(world * SLOT, dtype=torch.uint8)
    channel = _state.group_facts(dist.group.WORLD).local[False].channel
    assert channel is not None, "the same-host channel did not open"
    data = bytes(SLOT)
    default_max_bytes = on._call({}).options.max_bytes  # given per call: the general path, with the same limit
    candidates: Dict[str, Callable[[], Any]] = {
        "all_gather, channel": lambda: on.all_gather(OBJ),
        "all_gather, gloo": lambda: off.all_gather(OBJ),
        "broadcast, channel": lambda: on.broadcast(OBJ),
        "broadcast, gloo": lambda: off.broadcast(OBJ),
        "send/recv round trip, channel": lambda: _round_trip(on),
        "send/recv round trip, gloo": lambda: _round_trip(off),
        "send/recv round trip, channel, general path": lambda: _round_trip(on, max_bytes=default_max_bytes),
        "raw gloo all_gather (4096 B)": lambda: all_gather_single(recv, send),
        "bare channel all_gather (4096 B)": lambda: channel.all_gather(data),
        "bare channel broadcast (4096 B)": lambda: channel.broadcast(data, 0),
        "bare channel send/recv round trip (4096 B)": lambda: _bare_round_trip(channel, data),
        "framing + bare channel, send/recv round trip": lambda: _framed_round_trip(on, channel),
    }
    return {k: t.median_s for k, t in interleaved(candidates, repeat=repeat, warmup=20, batch=batch).items()}


def _round_trip(comm: Any, **options: Any) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 0:
        comm.send(OBJ, 1, **options)
        comm.recv(1, **options)
    elif rank == 1:
        comm.send(comm.recv(0, **options), 0, **options)


def _bare_round_trip(channel: Any, data: bytes) -> None:
    if channel.rank == 0:
        channel.send(data, 1)
        channel.recv(1)
    elif channel.rank == 1:
        channel.send(channel.recv(0)[1], 0)


def measure_above(repeat: int, sizes: List[int]) -> Dict[str, float]:
    """all_gather/broadcast of objects past the slot, channel on and off (see the module docstring)."""
    import torch

    import objcomm
    from objcomm._tools.bench.measure import interleaved

    torch.set_num_threads(1)
    on, off = objcomm.Communicator(local=True), objcomm.Communicator(local=False)
    on.all_gather(None)
    off.all_gather(None)
    medians: Dict[str, float] = {}
    for size in sizes:
        for kind, obj in (("bytes", bytes(size)), ("floats", [0.5] * (size // 9))):
            candidates: Dict[str, Callable[[], Any]] = {}
            for label, comm in (("channel", on), ("gloo", off)):
                candidates[f"{kind} {size:,} B all_gather, {label}"] = lambda comm=comm, obj=obj: comm.all_gather(obj)
                candidates[f"{kind} {size:,} B broadcast, {label}"] = lambda comm=comm, obj=obj: comm.broadcast(obj)
            rounds = max(3, repeat if size < 1 << 20 else repeat // 4)
            medians.update({k: t.median_s for k, t in interleaved(candidates, repeat=rounds, warmup=2).items()})
    return medians


def report_above(world: int, medians: Dict[str, float], repeat: int) -> str:
    lines = [
        f"### Above round 1, W={world} ({os.cpu_count()} CPUs, up to {repeat} rounds, one call a sample)",
        "",
        "| payload, op | channel (local=True) | gloo (local=False) | channel ÷ gloo |",
        "|---|---:|---:|---:|",
    ]
    for name, t in medians.items():
        if name.endswith(", channel"):
            gloo = medians[name.replace(", channel", ", gloo")]
            lines.append(f"| {name[: -len(', channel')]} | {t * 1e3:.2f} ms | {gloo * 1e3:.2f} ms | {t / gloo:.2f}x |")
    return "\n".join(lines) + "\n"


def _framed_round_trip(comm: Any, channel: Any) -> None:
    """A round trip of ``OBJ`` as objcomm frames it (encode, slot; slot read, decode) over the bare channel,
    without the Communicator's and transport's layers around it: what the frame format itself costs."""
    from objcomm._format import slot as _slot
    from objcomm._transport import rounds as _rounds

    call = comm._call({})

    def there(dst: int) -> None:
        channel.send(_rounds._slot(call.wire, call.encode(OBJ)[0]), dst)

    def back(src: int) -> Any:
        return call.decode(_rounds.Incoming(_slot.read_slot(memoryview(channel.recv(src)[1])).inline), src)

    if channel.rank == 0:
        there(1)
        back(1)
    elif channel.rank == 1:
        back(0)
        there(0)


def _task(plan: Tuple[int, int], send: Any) -> Dict[str, float]:
    return measure(*plan)


def _task_above(plan: Tuple[int, List[int]], send: Any) -> Dict[str, float]:
    return measure_above(*plan)


def report(world: int, medians: Dict[str, float], repeat: int, batch: int) -> str:
    gloo = medians["raw gloo all_gather (4096 B)"]
    lines = [
        f"### W={world} ({os.cpu_count()} CPUs, {repeat} rounds of {batch} calls back to back)",
        "",
        "| candidate | median | ÷ raw gloo | channel ÷ gloo |",
        "|---|---:|---:|---:|",
    ]
    for name, t in medians.items():
        pair = ""
        if name.endswith(", channel"):
            pair = f"{t / medians[name.replace('channel', 'gloo')]:.2f}x"
        lines.append(f"| {name} | {t * 1e6:.0f} µs | {t / gloo:.2f}x | {pair} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--batch", type=int, default=25, help="calls per sample, back to back after a barrier")
    parser.add_argument("--append", help="append the tables to this file")
    parser.add_argument("--above-round-one", action="store_true", help="objects past the slot, channel on and off")
    parser.add_argument("--sizes", nargs="+", default=["16KB", "256KB", "2MB", "16MB"], help="with --above-round-one")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from objcomm._tools.bench.payloads import parse_size
    from objcomm._tools.launch import run_local

    for world in args.world_sizes:
        if args.above_round_one:
            plan = (args.repeat, [parse_size(s) for s in args.sizes])
            text = report_above(world, run_local(_task_above, plan, world_size=world, timeout_s=1200), args.repeat)
        else:
            medians = run_local(_task, (args.repeat, args.batch), world_size=world, timeout_s=1200)
            text = report(world, medians, args.repeat, args.batch)
        print(text, flush=True)
        if args.append:
            with open(args.append, "a") as f:
                f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
