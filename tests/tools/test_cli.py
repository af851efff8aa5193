"""The ``objcomm`` command, run for real in subprocesses: bench, serializers, demo, torchrun, Ctrl-C."""

from __future__ import annotations

import csv
import json
import os
import pty
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

import serializers
from objcomm._tools.bench.config import DEFAULT_OPS, OPS
from objcomm._tools.bench.payloads import BUILTIN

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["bench", "--quick", "--sizes", "1KB"]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _env(*paths: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(ROOT)])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background shell may have ignored it for us


def run_cli(*args: str, paths: tuple = (), timeout: float = 120, launcher: tuple = ("-m", "objcomm")):
    """Run the command; return ``(pid, returncode, stdout, stderr)``."""
    proc = subprocess.Popen(
        [sys.executable, *launcher, *args],
        env=_env(*paths),
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.pid, proc.returncode, out, err


def write_module(directory: Path, name: str, source: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.py").write_text(textwrap.dedent(source))


def _num(text: str):
    return None if text == "" else float(text)


# -- bench -----------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_bench_prints_table_and_writes_json_csv_plot(tmp_path):
    payloads = ["config", "tensors"]
    out_json, out_csv, out_png = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.png"
    pid, rc, out, err = run_cli(
        *QUICK, "--payloads", ",".join(payloads), "--json", str(out_json), "--csv", str(out_csv), "--plot", str(out_png)
    )
    assert rc == 0, err
    assert out.count("objcomm bench: 2 ranks (local") == 1
    for payload in payloads:
        assert re.search(rf"^{payload} \(", out, re.M), out
    assert "torch.distributed" in out and "recommendations" in out
    assert "\r" not in err, "no progress bar when stderr is not a terminal"

    data = json.loads(out_json.read_text())
    meta, rows = data["meta"], data["rows"]
    assert meta["world_size"] == 2 and meta["launcher"] == "local"
    assert [r["ppid"] for r in meta["ranks"]] == [pid, pid], "the ranks are this command's own children"
    names = serializers.available()
    expected = sorted((p, s, op) for p in payloads for s in names for op in DEFAULT_OPS)
    assert sorted((r["payload"], r["serializer"], r["op"]) for r in rows) == expected
    for r in rows:
        assert r["torch_latency_s"] > 0
        if r["fidelity"] == "refused":
            assert r["latency_s"] is None and r["ratio"] is None and r["note"]
        else:
            assert r["latency_s"] > 0 and r["encoded_bytes"] > 0
            assert r["ratio"] == pytest.approx(r["latency_s"] / r["torch_latency_s"])
            assert r["throughput_Bps"] == pytest.approx(r["nbytes"] / r["latency_s"])
    verdict = {(r["payload"], r["serializer"]): (r["fidelity"], r["note"]) for r in rows}
    assert verdict[("tensors", "json")][0] == "refused"  # JSON has no word for a tensor
    assert verdict[("config", "json")] == ("converted", "tuple → list at $['model']['layers'][0]['kernel']")
    assert all(verdict[(p, "pickle")][0] == "exact" for p in payloads)
    recommended = {rec["payload"]: rec for rec in data["recommendations"]}
    assert set(recommended) == set(payloads)
    for payload, rec in recommended.items():
        assert verdict[(payload, rec["exact"]["serializer"])][0] == "exact"
        if rec["safe"] is not None:
            assert serializers.get(rec["safe"]["serializer"]).safe
        assert rec["auto"]["fidelity"] == "exact" and rec["exact"]["serializer"] != "auto"  # auto: a row, not a pick
    assert len(re.findall(r"auto: \d+\.\d\d× the fastest exact \(exact\)", out)) == len(payloads), out

    with open(out_csv, newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    for line, row in zip(table, rows):
        assert (line["payload"], line["serializer"], line["op"]) == (row["payload"], row["serializer"], row["op"])
        assert _num(line["latency_s"]) == row["latency_s"]

    png = out_png.read_bytes()
    assert png[:8] == PNG_SIGNATURE and len(png) < 1_000_000
    import matplotlib.image

    image = matplotlib.image.imread(str(out_png))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, expected",
    [
        (["--serializers", "nope"], ["unknown serializer 'nope'", *serializers.available()]),
        (["--world-size", "0"], ["--world-size must be at least 1"]),
        (["--payloads", "records,nope"], ["unknown payload 'nope'", *BUILTIN]),
        (["--ops", "all_gather,allreduce"], ["unknown op 'allreduce'", *OPS]),
        (["--sizes", "12XB"], ["bad size '12XB'", "KB", "MB"]),
    ],
    ids=["serializer", "world-size", "payload", "op", "size"],
)
def test_bench_rejects_bad_arguments_in_one_line(args, expected):
    _, rc, out, err = run_cli("bench", *args, timeout=45)
    assert rc == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("objcomm bench: error: ")
    for text in expected:
        assert text in err


NO_TORCH = """
import sys
import objcomm
from objcomm.__main__ import main
codes = [main(argv) for argv in (["--help"], ["bench", "--help"], ["bench", "--sizes", "12XB"], ["demo", "--bogus"])]
assert codes == [0, 0, 2, 2], codes
assert "torch" not in sys.modules, "torch was imported"
"""


@pytest.mark.timeout(60)
def test_help_and_bad_arguments_do_not_import_torch():
    """``objcomm --help`` (and a typo) answer at once: parsing and checking arguments need no torch."""
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=45
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(60)
def test_bench_plot_without_matplotlib_says_how_to_install(tmp_path):
    write_module(tmp_path / "hide" / "matplotlib", "__init__", 'raise ImportError("hidden for this test")\n')
    _, rc, out, err = run_cli(*QUICK, "--plot", str(tmp_path / "p.png"), paths=(tmp_path / "hide",), timeout=45)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert "pip install matplotlib" in err
    assert not (tmp_path / "p.png").exists()


@pytest.mark.timeout(180)
def test_user_payload_and_user_serializers_join_the_matrix(tmp_path):
    made = tmp_path / "made"
    made.mkdir()
    code = tmp_path / "code"
    write_module(
        code,
        "bench_user_payload",
        f"""
        import os

        def make(rank):
            open(os.path.join({str(made)!r}, f"{{rank}}-{{os.getpid()}}"), "w").close()
            return {{"rank": rank, "pairs": [(rank, i) for i in range(20)]}}
        """,
    )
    write_module(
        code,
        "bench_user_serializer",
        """
        import json
        import serializers

        serializers.register("test-json", dumps=lambda o: json.dumps(o).encode(),
                             loads=lambda b: json.loads(bytes(b)), safe=True, description="stdlib json")
        """,
    )
    # an installed plugin: a dist-info with an objcomm.serializers entry point
    write_module(
        code,
        "objcomm_test_plugin",
        """
        import pickle
        import serializers

        SERIALIZER = serializers.FunctionSerializer("test-ep", lambda o: pickle.dumps(o), pickle.loads)
        """,
    )
    dist_info = code / "objcomm_test_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: objcomm-test-plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[objcomm.serializers]\ntest-ep = objcomm_test_plugin:SERIALIZER\n")

    out_json = tmp_path / "r.json"
    _, rc, out, err = run_cli(
        *QUICK,
        "--payload",
        "bench_user_payload:make",
        "--import",
        "bench_user_serializer",
        "--ops",
        "all_gather,broadcast",
        "--json",
        str(out_json),
        paths=(code,),
    )
    assert rc == 0, err
    data = json.loads(out_json.read_text())
    rows = data["rows"]
    assert {r["payload"] for r in rows} == {"bench_user_payload:make"}, "only the user's payload was asked for"
    by_serializer = {(r["serializer"], r["op"]): r for r in rows}
    for name in ("test-json", "test-ep", "pickle"):
        for op in ("all_gather", "broadcast"):
            assert by_serializer[(name, op)]["latency_s"] > 0, (name, op)
    assert by_serializer[("test-json", "all_gather")]["fidelity"] == "converted"
    assert "tuple → list" in by_serializer[("test-json", "all_gather")]["note"]
    assert by_serializer[("test-ep", "all_gather")]["fidelity"] == "exact"
    assert by_serializer[("test-json", "all_gather")]["safe"] is True
    ranks = data["meta"]["ranks"]
    assert sorted(p.name for p in made.iterdir()) == sorted(f"{r['rank']}-{r['pid']}" for r in ranks), (
        "each rank built its own object, in its own process"
    )
    assert "bench_user_payload:make" in out


CONSOLE_SCRIPT = """
import sys
from objcomm.__main__ import main
if __name__ == "__main__":
    sys.exit(main())
"""  # what pip writes for the ``objcomm`` entry point


@pytest.mark.timeout(180)
def test_the_command_finds_user_modules_in_the_current_directory(tmp_path):
    """``objcomm bench --payload mymodule:make_obj`` where mymodule.py is, as ``python -m objcomm`` does.

    Run as pip's console script runs: a script in another folder (so ``sys.path[0]`` is that folder,
    not the current directory), with only objcomm's source on ``PYTHONPATH``."""
    script = tmp_path / "bin" / "objcomm-script.py"
    script.parent.mkdir()
    script.write_text(CONSOLE_SCRIPT)
    work, made = tmp_path / "work", tmp_path / "made"
    made.mkdir()
    write_module(
        work,
        "mymodule",
        f"""
        import os

        def make_obj(rank):
            open(os.path.join({str(made)!r}, str(os.getpid())), "w").close()
            return {{"rank": rank, "tags": ["a", "b"]}}
        """,
    )
    write_module(
        work,
        "my_serializers",
        """
        import json
        from objcomm import serializers

        serializers.register("cwd-json", dumps=lambda o: json.dumps(o).encode(),
                             loads=lambda b: json.loads(bytes(b)), safe=True, description="from the cwd")
        """,
    )
    out_json = tmp_path / "r.json"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            *QUICK,
            "--payload",
            "mymodule:make_obj",
            "--import",
            "my_serializers",
            "--serializers",
            "pickle,cwd-json",
            "--ops",
            "all_gather",
            "--json",
            str(out_json),
        ],
        env=_env(),
        cwd=work,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(out_json.read_text())["rows"]
    assert {(r["payload"], r["serializer"]) for r in rows} == {
        ("mymodule:make_obj", "pickle"),
        ("mymodule:make_obj", "cwd-json"),
    }
    assert all(r["latency_s"] > 0 for r in rows)
    ranks = json.loads(out_json.read_text())["meta"]["ranks"]
    assert {int(p.name) for p in made.iterdir()} >= {r["pid"] for r in ranks}, "each rank imported mymodule"


@pytest.mark.timeout(120)
def test_a_failing_rank_is_reported_and_every_rank_reaped(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    write_module(
        tmp_path / "code",
        "bench_bad_payload",
        f"""
        import os

        def make(rank):
            open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
            if rank == 1:
                raise ValueError("no payload on rank 1")
            return [rank]
        """,
    )
    _, rc, out, err = run_cli(*QUICK, "--payload", "bench_bad_payload:make", paths=(tmp_path / "code",))
    assert rc == 1
    assert "rank 1 failed: ValueError: no payload on rank 1" in err
    started = [int(p.name) for p in pids.iterdir()]
    assert started, "the payload function ran on the ranks"
    for pid in started:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.timeout(120)
def test_progress_bar_on_a_terminal_and_ctrl_c_reaps_the_ranks():
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "objcomm",
            "bench",
            "--payloads",
            "floats,records",
            "--sizes",
            "1KB,4MB",
            "--repeat",
            "50",
        ],
        env=_env(),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        preexec_fn=_default_sigint,
    )
    os.close(slave)
    seen: list = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            seen.append(chunk.decode("utf-8", "replace"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while not re.search(r"\[#*\.*\]\s+\d+/\d+", "".join(seen)):
            assert proc.poll() is None, "".join(seen)
            assert time.monotonic() < deadline, "no progress bar on the terminal"
            time.sleep(0.1)
        ranks = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(ranks) == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    reader.join(timeout=5)
    os.close(master)
    assert "interrupted; every rank it started was stopped" in "".join(seen)
    for rank in ranks:
        assert not rank.is_running(), f"rank process {rank.pid} outlived the command"


@pytest.mark.timeout(180)
def test_under_torchrun_it_uses_the_launchers_group(tmp_path):
    out_json = tmp_path / "r.json"
    pid, rc, out, err = run_cli(
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "objcomm",
        *QUICK,
        "--payloads",
        "metrics",
        "--ops",
        "all_gather,send/recv",
        "--json",
        str(out_json),
        launcher=("-m", "torch.distributed.run"),
    )
    assert rc == 0, err
    assert out.count("objcomm bench: 2 ranks (the launcher's process group") == 1, "only rank 0 prints"
    meta = json.loads(out_json.read_text())["meta"]
    assert meta["launcher"] == "env" and meta["world_size"] == 2
    assert [r["ppid"] for r in meta["ranks"]] == [pid, pid], "the ranks are torchrun's workers, not ours"


# -- serializers and demo ----------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_serializers_lists_safety_and_fidelity_counts():
    _, rc, out, err = run_cli("serializers", timeout=45)
    assert rc == 0, err
    lines = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.strip() and " " in line}
    for name in serializers.available():
        found = serializers.fidelity(name)
        counts = [
            str(sum(v.verdict == verdict for v in found.values()))
            for verdict in ("exact", "converted", "lossy", "refused")
        ]
        s = serializers.get(name)
        assert lines[name][1:6] == ["yes" if s.safe else "no", *counts], out
        assert s.description in out


@pytest.mark.timeout(120)
def test_demo_gathers_and_merges_on_local_ranks():
    _, rc, out, err = run_cli("demo", "--world-size", "3", timeout=100)
    assert rc == 0, err
    held = [{r: 1} if r % 2 == 0 else {} for r in range(3)]
    merged = {k: v for part in held for k, v in part.items()}
    assert out.splitlines() == [f"P {r}: {h}" for r, h in enumerate(held)] + [f"All: {merged}"]


@pytest.mark.timeout(180)
def test_bench_ops_beyond_torch_say_what_torch_users_write_instead(tmp_path):
    out_json = tmp_path / "r.json"
    pid, rc, out, err = run_cli(
        *QUICK,
        "--payloads",
        "metrics",
        "--serializers",
        "pickle,msgpack",
        "--ops",
        "all_to_all,all_reduce,iall_gather",
        "--json",
        str(out_json),
    )
    assert rc == 0, err
    assert "all_to_all: torch has none; its row is all_gather_object, then each rank keeps the parts" in out
    assert "all_reduce: torch has none; its row is all_gather_object, then functools.reduce locally" in out
    rows = json.loads(out_json.read_text())["rows"]
    assert sorted({r["op"] for r in rows}) == ["all_reduce", "all_to_all", "iall_gather"]
    assert all(r["latency_s"] > 0 and r["torch_latency_s"] > 0 for r in rows)
