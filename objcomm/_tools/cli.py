"""The ``objcomm`` command line: argument parsing, validation and dispatch.

Subcommands: ``bench`` (the serializer trade-off benchmark), ``serializers`` (what is
registered, and what each round-trips), ``demo`` (the gather-and-merge scenario on local ranks).
Exit status: 0 done, 1 the run failed, 2 bad arguments, 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any, Dict, List, NoReturn, Optional, Sequence, cast

import serializers
from objcomm._tools.bench import launch as _launch
from objcomm._tools.bench.config import DEFAULT_OPS, OPS, BenchConfig, cwd_first, import_modules
from objcomm._tools.bench.payloads import BUILTIN, parse_size, resolve_payload

DEFAULT_SIZES = "1KB,64KB,1MB"
QUICK_SIZES = "1KB"
DEFAULT_REPEAT, QUICK_REPEAT = 5, 2


class UsageError(Exception):
    """Bad arguments: reported as one line, exit status 2; ``prog`` names the (sub)command."""

    def __init__(self, message: str, prog: Optional[str] = None) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self.prog)


def _parser() -> _Parser:
    parser = _Parser(prog="objcomm", description="Move Python objects between PyTorch ranks: tools.")
    sub = parser.add_subparsers(dest="command", metavar="{bench,serializers,demo}")
    bench = sub.add_parser(
        "bench",
        help="benchmark serializers x payloads x ops against torch's object collectives",
        description="Benchmark objcomm's serializers on payloads x sizes x ops, against torch.distributed's "
        "object collectives, on local gloo ranks (or the launcher's, under torchrun).",
    )
    add = bench.add_argument
    add("--world-size", type=int, metavar="N", help="local ranks to start (default 2; torchrun sets its own)")
    add("--backend", default="gloo", metavar="NAME", help="process group backend: gloo (default), nccl, mpi")
    add("--serializers", action="append", metavar="NAMES", help="comma-separated names (default: all registered)")
    add("--payloads", action="append", metavar="NAMES", help=f"comma-separated built-ins: {', '.join(BUILTIN)}")
    add(
        "--payload",
        action="append",
        default=[],
        metavar="MODULE:FUNCTION",
        help="your own object: FUNCTION(rank) (or FUNCTION(rank, size)) returns it; repeatable",
    )
    add(
        "--ops",
        action="append",
        metavar="OPS",
        help=f"comma-separated: {', '.join(OPS)} (default: {', '.join(DEFAULT_OPS)}); torch has no object "
        "all_to_all or all_reduce, so those are timed against all_gather_object and picking or reducing locally",
    )
    add("--sizes", metavar="SIZES", help=f"payload sizes, e.g. 1KB,1MB,16MB (default {DEFAULT_SIZES})")
    add(
        "--repeat",
        type=int,
        metavar="N",
        help=f"timed runs per cell (default: up to {DEFAULT_REPEAT}, fewer (at least 3) for slow cells)",
    )
    add(
        "--quick",
        action="store_true",
        help=f"smoke run: sizes {QUICK_SIZES}, {QUICK_REPEAT} repeats (unless given), one call a sample",
    )
    add("--json", metavar="FILE", help="write every row (and the run's context) as JSON")
    add("--csv", metavar="FILE", help="write every row as CSV")
    add(
        "--plot",
        metavar="FILE.png",
        help="plot each serializer's time as a ratio of torch's, one panel per op and payload (needs matplotlib)",
    )
    _add_import(bench)
    add("--timeout", type=float, default=600.0, metavar="SECONDS", help="give up after this long (default 600)")

    listing = sub.add_parser(
        "serializers",
        help="list registered serializers and what they round-trip",
        description="List the registered serializers: safe flag, fidelity summary, description.",
    )
    _add_import(listing)

    demo = sub.add_parser(
        "demo",
        help="gather sparse per-rank dicts on local ranks and merge them",
        description="Each rank holds {rank: 1} if its rank is even, else {}; all ranks "
        "all_gather with objcomm and merge.",
    )
    demo.add_argument("--world-size", type=int, default=4, metavar="N", help="local ranks to start (default 4)")
    demo.add_argument("--serializer", metavar="NAME", help="serializer to use (default: objcomm's default, pickle)")
    demo.add_argument(
        "--timeout", type=float, default=120.0, metavar="SECONDS", help="give up after this long (default 120)"
    )
    _add_import(demo)
    return parser


def _add_import(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (on every rank), e.g. one that calls serializers.register()",
    )


def run(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` and run the subcommand; return the exit status."""
    parser = _parser()
    command = "objcomm"
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        command = f"objcomm {args.command}" if args.command else command
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        if getattr(args, "imports", None) or getattr(args, "payload", None):
            cwd_first()  # the user's modules are found in the current directory, as under python -m
        return {"bench": _bench, "serializers": _serializers, "demo": _demo}[args.command](args)
    except UsageError as exc:
        print(f"{exc.prog or command}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        stopped = "" if _launch.launched() else "; every rank it started was stopped"
        print(f"\n{command}: interrupted{stopped}", file=sys.stderr)
        return 130
    except _launch.LaunchError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `objcomm bench | head`: stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


# -- bench -----------------------------------------------------------------------------------
def _bench(args: argparse.Namespace) -> int:
    config = _bench_config(args)
    world_size = _world_size(args.world_size, default=2)
    ops = [op for op in config.ops if not (op == "send/recv" and world_size == 1 and not args.ops)]
    if world_size == 1 and "send/recv" in ops:
        raise UsageError("send/recv needs --world-size 2 or more")
    config = dataclasses.replace(config, ops=tuple(ops))
    _check_backend(args.backend, world_size)
    _check_outputs(args)
    from objcomm._tools.bench.progress import ProgressBar
    from objcomm._tools.bench.report import format_table, write_csv, write_json
    from objcomm._tools.bench.runner import bench_task

    bar = ProgressBar()
    start = time.monotonic()
    try:
        result = _launch_task(bench_task, config, args.backend, world_size, args.timeout, bar.message)
    finally:
        bar.close()
    if result is None:  # a rank other than 0 under a launcher: rank 0 reports
        return 0
    result.meta["launcher"] = "env" if _launch.launched() else "local"
    result.meta["seconds"] = round(time.monotonic() - start, 3)
    print(format_table(result), flush=True)
    for path, write in ((args.json, write_json), (args.csv, write_csv)):
        if path:
            write(result, path)
            print(f"wrote {path}", file=sys.stderr)
    if args.plot:
        from objcomm._tools.bench.plot import plot

        plot(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _bench_config(args: argparse.Namespace) -> BenchConfig:
    _import(args.imports)
    known = serializers.available()
    names = _choices(args.serializers, known, "serializer") if args.serializers else known
    if args.payloads:
        payloads = _choices(args.payloads, list(BUILTIN), "payload", hint=" (or --payload MODULE:FUNCTION)")
    else:
        payloads = [] if args.payload else list(BUILTIN)
    for spec in args.payload:
        try:
            resolve_payload(spec)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    aliases = {"send": "send/recv", "recv": "send/recv"}
    ops = _choices(args.ops, list(OPS), "op", aliases=aliases) if args.ops else DEFAULT_OPS
    try:
        sizes = [parse_size(s) for s in _split([args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)])]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    repeat = args.repeat if args.repeat is not None else (QUICK_REPEAT if args.quick else DEFAULT_REPEAT)
    if repeat < 1:
        raise UsageError(f"--repeat must be at least 1, got {repeat}")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout}")
    return BenchConfig(
        payloads=tuple(payloads + list(args.payload)),
        sizes=tuple(dict.fromkeys(sizes)),
        serializers=tuple(names),
        ops=tuple(ops),
        repeat=repeat,
        adaptive=args.repeat is None,
        imports=tuple(args.imports),
        min_sample_s=0.0 if args.quick else BenchConfig.min_sample_s,
    )


def _split(values: Sequence[str]) -> List[str]:
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _choices(values: Sequence[str], valid: List[str], what: str, hint: str = "", aliases: Any = None) -> List[str]:
    chosen = []
    for value in _split(values):
        value = (aliases or {}).get(value, value)
        if value not in valid:
            raise UsageError(f"unknown {what} {value!r}; choose from: {', '.join(valid)}{hint}")
        if value not in chosen:
            chosen.append(value)
    if not chosen:
        raise UsageError(f"no {what} given; choose from: {', '.join(valid)}")
    return chosen


def _world_size(given: Optional[int], default: int) -> int:
    if _launch.launched():
        launcher = int(os.environ["WORLD_SIZE"])
        if given is not None and given != launcher:
            raise UsageError(f"--world-size {given} conflicts with the launcher's WORLD_SIZE={launcher}; drop it")
        return launcher
    size = default if given is None else given
    if size < 1:
        raise UsageError(f"--world-size must be at least 1, got {size}")
    return size


def _check_backend(backend: str, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    valid = [name for name in ("gloo", "nccl", "mpi") if dist.is_backend_available(name)]
    if backend not in valid:
        raise UsageError(f"backend {backend!r} is not available in this torch; choose from: {', '.join(valid)}")
    if backend == "nccl" and not _launch.launched() and torch.cuda.device_count() < world_size:
        raise UsageError(
            f"--backend nccl with {world_size} local ranks needs {world_size} GPUs; {torch.cuda.device_count()} found"
        )


def _check_outputs(args: argparse.Namespace) -> None:
    for flag, path in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise UsageError(f"{flag} {path}: the directory {os.path.dirname(os.path.abspath(path))} does not exist")
    if args.plot:
        from objcomm._tools.bench.plot import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as exc:
            raise UsageError(str(exc)) from None


def _launch_task(task: Any, arg: Any, backend: str, world_size: int, timeout: float, on_message: Any) -> Any:
    if _launch.launched():
        return _launch.run_in_env(task, arg, backend=backend, on_message=on_message, timeout_s=timeout)
    return _launch.run_local(
        task, arg, world_size=world_size, backend=backend, on_message=on_message, timeout_s=timeout
    )


def _import(modules: Sequence[str]) -> None:
    try:
        import_modules(modules)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# -- serializers and demo ----------------------------------------------------------------------
def _serializers(args: argparse.Namespace) -> int:
    _import(args.imports)
    verdicts = ("exact", "converted", "lossy", "refused")
    names = serializers.available()
    width = max([len("name"), *map(len, names)])
    print(f"{'name':<{width}}  safe  {'exact':>5}  {'converted':>9}  {'lossy':>5}  {'refused':>7}  description")
    for name in names:
        found = cast(Dict[str, serializers.Verdict], serializers.fidelity(name))
        exact, converted, lossy, refused = (sum(v.verdict == verdict for v in found.values()) for verdict in verdicts)
        s = serializers.get(name)
        print(
            f"{name:<{width}}  {'yes' if s.safe else 'no':<4}  {exact:>5}  {converted:>9}  {lossy:>5}  {refused:>7}  "
            f"{s.description}"
        )
    print(f"\ncounts are over {len(serializers.PROBES)} probe types; serializers.fidelity_table() shows each one")
    return 0


def _demo(args: argparse.Namespace) -> int:
    _import(args.imports)
    if args.serializer is not None and args.serializer not in serializers.available():
        raise UsageError(f"unknown serializer {args.serializer!r}; choose from: {', '.join(serializers.available())}")
    world_size = _world_size(args.world_size, default=4)
    from objcomm._tools.bench.demo import demo_task, format_demo

    result = _launch_task(demo_task, (args.serializer, tuple(args.imports)), "gloo", world_size, args.timeout, None)
    if result is not None:
        print(format_demo(result))
    return 0
