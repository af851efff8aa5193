"""objcomm where users already are: torchrun on two "nodes", bare init, the example, a plugin package, the docs.

The launch tests start real ``torchrun`` agents (``python -m torch.distributed.run``, the module
behind the ``torchrun`` command, so the interpreter running the tests is the one launched) and
read what every rank observed from files the ranks write. Agents and their workers are always
stopped and reaped, even when a test fails or times out.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Dict, List, Sequence

import pytest
from _ranks import free_port

REPO = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT = 150  # seconds for one launch (startup of 4 ranks on 2 cores takes ~10 s)

# Runs on every rank. Records what it saw in <out>/rank<R>.pkl; the tests judge it.
ALL_OPS = r"""
import os, pickle, sys, traceback, warnings
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import objcomm
from objcomm import _device, compat

out_dir, backend = sys.argv[1], sys.argv[2]
seen = {"env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}}
if backend == "none":
    dist.init_process_group()  # no arguments at all: torch picks the backend
else:
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
local, node = int(os.environ["LOCAL_RANK"]), int(os.environ["GROUP_RANK"])
seen["backend"] = str(dist.get_backend())
seen["backend_config"] = dist.get_backend_config() if hasattr(dist, "get_backend_config") else None

# objcomm's transport device: the current CUDA device for NCCL, never cuda:{RANK}. This machine
# has no GPU, so torch.cuda.current_device stands for what torch.cuda.set_device(LOCAL_RANK) sets.
with mock.patch.object(torch.cuda, "current_device", return_value=local):
    first = str(_device.resolve_device("nccl"))
    os.environ["RANK"], saved = "999", os.environ["RANK"]
    again = str(_device.resolve_device("nccl"))  # a different RANK changes nothing
    os.environ["RANK"] = saved
seen["nccl_device"] = (first, again)

partner = (rank + world // 2) % world  # the same local rank on the other node
try:
    me = {"rank": rank, "local": local, "node": node, "tuple": (rank, "t")}
    seen["all_gather"] = objcomm.all_gather(me)
    seen["gather"] = objcomm.gather(me, dst=world - 1)
    seen["broadcast"] = objcomm.broadcast(me if rank == world // 2 else None, src=world // 2)
    seen["scatter"] = objcomm.scatter([{"to": r} for r in range(world)] if rank == 1 else None, src=1)
    if rank < partner:
        objcomm.send(me, dst=partner)
        seen["recv"] = objcomm.recv(src=partner)
    else:
        seen["recv"] = objcomm.recv(src=partner)
        objcomm.send(me, dst=partner)

    sampler = DistributedSampler(range(11), shuffle=True, seed=5)
    seen["collect_shuffled"] = objcomm.collect_results([i * i for i in sampler], 11, indices=sampler)
    ordered = DistributedSampler(range(11), shuffle=False)
    seen["collect_strided"] = objcomm.collect_results([i * i for i in ordered], 11, dst=None, serializer="msgpack")

    out = [None] * world
    compat.all_gather_object(out, me)
    seen["all_gather_object"] = out
    box = [rank, "x"] if rank == world - 1 else [None, None]
    compat.broadcast_object_list(box, src=world - 1)
    seen["broadcast_object_list"] = box
    box = [None]
    if rank < partner:
        compat.send_object_list([me], dst=partner)
        seen["recv_object_list"] = (compat.recv_object_list(box, src=partner), box)
    else:
        seen["recv_object_list"] = (compat.recv_object_list(box, src=partner), box)
        compat.send_object_list([me], dst=partner)
    seen["ok"] = True
except Exception:
    seen["error"] = traceback.format_exc()
finally:
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(seen, f)
    dist.destroy_process_group()
"""


def torchrun(*args: str) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def run_agents(commands: Sequence[List[str]], workdir: Path, timeout: float = LAUNCH_TIMEOUT) -> List[tuple]:
    """Start every command at once, wait for all; kill and reap them all on a timeout or an error.

    Returns ``(returncode, output)`` per command. Output goes to files, not pipes, so an agent
    that writes a lot cannot block while the test waits on another one.
    """
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs: List[subprocess.Popen] = []
    logs = []
    try:
        for i, cmd in enumerate(commands):
            log = open(workdir / f"agent{i}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        for proc in procs:
            proc.wait(timeout=timeout)  # one shared budget in practice: they finish together
    except BaseException:
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read()[-4000:])
        _kill_all(procs)
        if isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
            raise AssertionError("torchrun agents timed out; their output:\n" + "\n---\n".join(outputs)) from None
        raise
    finally:
        _kill_all(procs)
    results = []
    for proc, log in zip(procs, logs):
        log.seek(0)
        results.append((proc.returncode, log.read()))
        log.close()
    return results


def _kill_all(procs: Sequence[subprocess.Popen]) -> None:
    """Stop agents that are still running, and every process under them, by pid.

    torchrun starts each worker in a session of its own, so signalling the agent's process group
    would miss them: the whole tree is collected first, then asked to stop, then killed.
    """
    import psutil

    victims: List[psutil.Process] = []
    for proc in procs:
        if proc.poll() is None:
            try:
                agent = psutil.Process(proc.pid)
                victims += [agent, *agent.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
    for victim in victims:  # SIGTERM first: the agent then stops its workers the way it knows
        try:
            victim.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(victims, timeout=5)
    for victim in alive:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    for proc in procs:  # reap our own children
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def ranks_saw(out_dir: Path, world: int, outputs: List[tuple]) -> List[Dict[str, Any]]:
    files = [out_dir / f"rank{r}.pkl" for r in range(world)]
    missing = [f.name for f in files if not f.exists()]
    said = "\n---\n".join(o[-3000:] for _, o in outputs)
    assert not missing, f"ranks wrote no result {missing}; agents said:\n{said}"
    return [pickle.loads(f.read_bytes()) for f in files]


def check_all_ops(seen: List[Dict[str, Any]], world: int, local_world: int) -> None:
    errors = {r: s["error"] for r, s in enumerate(seen) if "error" in s}
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
    me = [{"rank": r, "local": r % local_world, "node": r // local_world, "tuple": (r, "t")} for r in range(world)]
    squares = [i * i for i in range(11)]
    for r, s in enumerate(seen):
        assert s["all_gather"] == me
        assert s["gather"] == (me if r == world - 1 else None)
        assert s["broadcast"] == me[world // 2]
        assert s["scatter"] == {"to": r}
        assert s["recv"] == me[(r + world // 2) % world]
        assert s["collect_shuffled"] == (squares if r == 0 else None)
        assert s["collect_strided"] == squares
        assert s["all_gather_object"] == me
        assert s["broadcast_object_list"] == [world - 1, "x"]
        assert s["recv_object_list"] == ((r + world // 2) % world, [me[(r + world // 2) % world]])


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
def test_two_nodes_of_two_ranks(tmp_path):
    """Two torchrun agents, one per "node", meet at a c10d rendezvous; every op spans both nodes."""
    script = tmp_path / "all_ops.py"
    script.write_text(ALL_OPS)
    out = tmp_path / "out"
    out.mkdir()
    port, run_id = free_port(), f"objcomm-{uuid.uuid4().hex[:8]}"
    common = [
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=join_timeout=60",
        "--max-restarts=0",
    ]
    agents = [torchrun(*common, f"--node_rank={node}", str(script), str(out), "gloo") for node in (0, 1)]
    outputs = run_agents(agents, tmp_path)
    seen = ranks_saw(out, 4, outputs)
    assert [rc for rc, _ in outputs] == [0, 0], outputs

    env = [s["env"] for s in seen]
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"]) for e in env] == [
        ("0", "0", "0"),
        ("1", "1", "0"),
        ("2", "0", "1"),
        ("3", "1", "1"),
    ]
    assert all(e["WORLD_SIZE"] == "4" and e["LOCAL_WORLD_SIZE"] == "2" for e in env)
    for e, s in zip(env, seen):
        if e["GROUP_RANK"] == "1":
            assert e["LOCAL_RANK"] != e["RANK"]
        # NCCL bytes would go to the local GPU, whatever the global rank is
        assert s["nccl_device"] == (f"cuda:{e['LOCAL_RANK']}",) * 2
        assert s["backend"] == "gloo"
    check_all_ops(seen, world=4, local_world=2)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_init_process_group_without_arguments(tmp_path):
    """``torchrun --standalone`` and ``init_process_group()`` with no backend: torch picks one, objcomm copes."""
    script = tmp_path / "all_ops.py"
    script.write_text(ALL_OPS)
    out = tmp_path / "out"
    out.mkdir()
    outputs = run_agents([torchrun("--standalone", "--nproc_per_node=2", str(script), str(out), "none")], tmp_path)
    seen = ranks_saw(out, 2, outputs)
    # what torch reports for the default it chose (torch 2.13 on a CPU machine: "undefined", "cpu:gloo")
    backends = {(s["backend"], s["backend_config"]) for s in seen}
    assert len(backends) == 1
    assert "gloo" in (seen[0]["backend_config"] or seen[0]["backend"])
    assert not [s["error"] for s in seen if s.get("error")]
    check_all_ops(seen, world=2, local_world=2)
    assert outputs[0][0] == 0, outputs[0][1][-3000:]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 30)
def test_gather_dicts_example(tmp_path):
    """``torchrun --nproc_per_node=4 examples/gather_dicts.py`` prints each rank's dict and the merge."""
    port = free_port()
    cmd = torchrun("--nproc_per_node=4", f"--master_port={port}", "examples/gather_dicts.py")
    [(rc, output)] = run_agents([cmd], tmp_path)
    assert rc == 0, output[-3000:]
    # four processes share one stdout: find each message wherever the lines interleave
    said = dict(re.findall(r"P (\d): (\{[^}]*\})", output))
    assert said == {"0": "{0: 1}", "1": "{}", "2": "{2: 1}", "3": "{}"}
    assert re.findall(r"All: \{[^}]*\}", output) == ["All: {0: 1, 2: 1}"]


def test_agents_are_reaped_when_they_hang(tmp_path):
    """The helper kills a launch that outlives its timeout, workers included, and reports it."""
    script = tmp_path / "hang.py"
    script.write_text("import os, time\nprint('worker', os.getpid(), flush=True)\ntime.sleep(600)\n")
    with pytest.raises(AssertionError, match="timed out"):
        run_agents([torchrun("--standalone", "--nproc_per_node=1", str(script))], tmp_path, timeout=15)
    pids = [int(p) for p in re.findall(r"worker (\d+)", (tmp_path / "agent0.log").read_text())]
    assert pids, "the worker never started"
    for pid in pids:
        assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive; only our own children could be ours to reap
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


# -- a serializer package, installed, found through its entry point --------------------------

PLUGIN_CHECK = r"""
import json, sys
import serializers
report = {"loaded_at_import": "objcomm_literal" in sys.modules}  # entry points load on first need
try:
    s = serializers.get("literal")
except serializers.UnknownSerializerError as exc:
    print(json.dumps({**report, "found": False, "error": str(exc)}))
    sys.exit(0)
import objcomm
value = {"a": (1, 2.5), "b": {3}, 5: [None, b"x", 1j]}
report.update(
    found=True,
    cls=f"{type(s).__module__}.{type(s).__qualname__}",
    safe=serializers.available(safe=True),
    roundtrip=s.loads(s.dumps(value)) == value,
    through_objcomm=objcomm.all_gather(value, serializer="literal") == [value],
)
try:
    s.dumps(object())
except serializers.EncodeError as exc:
    report["refused"] = str(exc)
print(json.dumps(report))
"""


def _plugin_report(pythonpath: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PLUGIN_CHECK],
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_custom_serializer_package_is_found_through_its_entry_point(tmp_path):
    """pip-install examples/custom_serializer into a temporary target; a fresh process finds "literal"."""
    pytest.importorskip("setuptools")
    source = tmp_path / "src"  # build from a copy: setuptools leaves build/ and *.egg-info behind
    shutil.copytree(
        REPO / "examples" / "custom_serializer",
        source,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    site = tmp_path / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    [entry_points] = site.glob("objcomm_literal-*.dist-info/entry_points.txt")
    assert "[objcomm.serializers]" in entry_points.read_text()

    found = _plugin_report(f"{site}{os.pathsep}{REPO}")
    assert found["loaded_at_import"] is False
    assert found["found"] is True and found["cls"] == "objcomm_literal.LiteralSerializer"
    assert "literal" in found["safe"]
    assert found["roundtrip"] is True and found["through_objcomm"] is True
    assert "literal cannot encode builtins.object" in found["refused"]

    absent = _plugin_report(str(REPO))  # the same check without the package: not there
    assert absent["found"] is False and "no serializer named 'literal'" in absent["error"]


# -- the docs name only things that exist ------------------------------------------------------

DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, AttributeError):  # a parent that is a module, not a package
        return False


@pytest.mark.timeout(30)
def test_docs_name_only_things_that_exist():
    """Every ``objcomm.X``/``serializers.X`` a page names resolves, every repo path and test it cites exists."""
    import importlib

    import serializers

    assert DOCS, "no docs found"
    for page in DOCS + [REPO / "examples" / "custom_serializer" / "README.md"]:
        text = page.read_text()
        for dotted in sorted(set(re.findall(r"\b(?:objcomm|serializers)\.[A-Za-z_][\w.]*\w", text))):
            if dotted.endswith(".md"):
                continue  # a link such as custom-serializers.md
            if dotted == serializers.ENTRY_POINT_GROUP:
                continue  # the entry-point group "objcomm.serializers", not an attribute
            parts = dotted.split(".")
            depth = len(parts)  # the longest importable module prefix, then attributes
            while depth > 1 and not _importable(".".join(parts[:depth])):
                depth -= 1
            target: Any = importlib.import_module(".".join(parts[:depth]))
            for attr in parts[depth:]:
                assert hasattr(target, attr), f"{page.name} names {dotted}, which does not exist"
                target = getattr(target, attr)
        for path, test in re.findall(r"\b((?:tests|examples|docs)/[\w./-]*\w)(?:::(\w+))?", text):
            assert (REPO / path).exists(), f"{page.name} cites {path}, which does not exist"
            if test:
                assert f"def {test}(" in (REPO / path).read_text(), f"{page.name} cites {path}::{test}"
        for link in re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]+)?\)", text):
            assert (REPO / "docs" / link).exists(), f"{page.name} links {link}, which does not exist"


SEND_RECV_ONLY = """
import sys, time
import torch.distributed as dist
import objcomm
from objcomm import _state

def on_channel():
    state = _state.group_facts(dist.group.WORLD).local.get(False)
    return bool(state is not None and state.channel is not None and state.channel.p2p)

dist.init_process_group("gloo")
rank, mode = dist.get_rank(), sys.argv[1]
brief = mode in ("one", "destroy", "idle")  # one message, then exit (the channel still opening)
go, deadline = True, time.monotonic() + 60
while go:  # else rank 0 goes on until both ranks have send/recv on the channel
    if rank == 0:
        go = not brief and time.monotonic() < deadline
        objcomm.send({"go": go}, dst=1)
        go = go and not (objcomm.recv(src=1) and on_channel())
        if not go and not brief:
            objcomm.send({"go": False}, dst=1)
            objcomm.recv(src=1)
    elif rank == 1:
        go = objcomm.recv(src=0)["go"]
        if not brief:
            objcomm.send(on_channel(), dst=0)
    else:  # (mode "idle": a third rank that never calls objcomm, so the channel can never open)
        go = False
print(f"rank {rank} on the channel: {on_channel()}", flush=True)
if mode == "destroy":
    dist.destroy_process_group()
"""


@pytest.mark.timeout(4 * (LAUNCH_TIMEOUT + 30))
def test_a_program_of_only_send_recv_gets_the_channel_and_exits_cleanly(tmp_path):
    """Under torchrun, a program that only calls send/recv: its ranks' first calls open the same-host channel in the
    background, and send/recv move onto it; one that exits right after its first message (or destroys the group
    first) while the channel is still opening ends cleanly (a thread left in torch at exit aborts the process), and
    so does one with a rank that never calls objcomm (the others' threads wait for it, and stop at exit)."""
    script = tmp_path / "send_recv_only.py"
    script.write_text(SEND_RECV_ONLY)
    modes = ("many", "one", "destroy", "idle")  # (many: until both ranks are on the channel)
    commands = [
        torchrun("--standalone", f"--nproc_per_node={3 if mode == 'idle' else 2}", str(script), mode) for mode in modes
    ]
    for mode, (rc, output) in zip(modes, run_agents(commands, tmp_path)):  # four jobs at once, each its own store
        assert rc == 0, (mode, output[-3000:])
        if mode == "many":
            assert sorted(re.findall(r"rank (\d) on the channel: (True|False)", output)) == [
                ("0", "True"),
                ("1", "True"),
            ], output[-3000:]
