"""The codec examples of docs/codecs.md, run as written, refuse hostile payloads quickly.

Users copy these examples; a codec's ``decode`` gets whatever a peer sent. The examples' code blocks
are taken from the page itself (every top-level ```` ```python ```` block, in order), run in a child
process (codecs are registered process-wide) whose CPU time is capped, and then fed payloads a hostile
peer could send: each must be a ``DecodeError`` within a fraction of a second, and must import nothing.
"""

from __future__ import annotations

import ast
import re
import resource
import sys
import time
import types
from pathlib import Path
from typing import Any, Dict, List, Tuple

import msgpack
import orjson
import pytest
from _child import ChildCrashed, run_in_child

PAGE = Path(__file__).resolve().parent.parent / "docs" / "codecs.md"
CODEC_EXT = 13  # serializers._msgpack.CODEC: a registered codec's value, [name, value]
TAG = "__objcomm_type__"  # serializers._json.TAG
CPU_CAP_S = 30  # the child's CPU limit (RLIMIT_CPU) on top of what it used to start: no test can hang
QUICK_S = 0.5  # CPU seconds a refusal may take

HOSTILE: Dict[str, Tuple[str, Any]] = {  # case -> (codec name, what a peer sends as its value)
    "fraction: a 30-million-digit power": ("fractions.Fraction", ["1e30000000"]),
    "fraction: a power in the denominator": ("fractions.Fraction", [1, "1e-30000000"]),
    "tensor: a lazily imported torch submodule as dtype": (
        "torch.Tensor",
        {"dtype": "_inductor", "shape": [1], "data": [0]},
    ),
    "tensor: a dtype name that is not a dtype": ("torch.Tensor", {"dtype": "load", "shape": [1], "data": [0]}),
    "tensor: more elements announced than sent": (
        "torch.Tensor",
        {"dtype": "float64", "shape": [1 << 40], "data": [0.0]},
    ),
    "tensor: nested data": ("torch.Tensor", {"dtype": "float64", "shape": [1], "data": [[[0.0] * 4] * 4]}),
    "point: fields that are not numbers": ("geometry.Point", {"x": "x" * 1000, "y": [1, 2, 3]}),
    "point: another field": ("geometry.Point", {"x": 1.0, "y": 2.0, "z": 3.0}),
}


def example_blocks(text: str) -> List[str]:
    """The page's top-level python code blocks, in order (indented ones, inside a list, only repeat a line)."""
    return re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)


def payload(serializer: str, name: str, value: Any) -> bytes:
    """What a peer sends for one codec value, built by hand as serializers/_msgpack.py and _json.py describe."""
    if serializer == "msgpack":
        return msgpack.packb(msgpack.ExtType(CODEC_EXT, msgpack.packb([name, value])))
    return orjson.dumps({TAG: name, "value": value})


class _OneRank:
    """Stands in for ``objcomm`` in the examples: ``all_gather`` on one rank is a round trip through the
    serializer it names."""

    @staticmethod
    def all_gather(obj: Any, serializer: str = "pickle") -> List[Any]:
        import serializers

        chosen = serializers.get(serializer)
        return [chosen.loads(chosen.dumps(obj))]


def run_examples(blocks: List[str]) -> Dict[str, Any]:
    """Run ``blocks`` in one namespace; check the value a block's last comment shows (``expr`` then ``# value``)."""
    module = sys.modules["codecs_md"] = types.ModuleType("codecs_md")  # dataclasses look their module up
    namespace: Dict[str, Any] = module.__dict__
    namespace["objcomm"] = _OneRank()
    shown: Dict[str, Any] = {}
    for number, block in enumerate(blocks, 1):
        exec(compile(block, f"<docs/codecs.md, python block {number}>", "exec"), namespace)
        lines = [line for line in block.strip().splitlines() if line.strip()]
        if len(lines) >= 2 and lines[-1].startswith("# ") and not lines[-2].startswith("#"):
            try:
                expected = ast.literal_eval(lines[-1][2:])
            except (ValueError, SyntaxError):
                continue
            got = eval(lines[-2], namespace)
            shown[lines[-2]] = (bytes(got) if isinstance(got, (bytes, bytearray, memoryview)) else got, expected)
    return {
        "namespace_names": sorted(k for k in namespace if not k.startswith("__")),
        "shown": shown,
        "round trips": round_trips(namespace),
    }


def round_trips(namespace: Dict[str, Any]) -> Dict[str, bool]:
    """Whether each example's type comes back equal through msgpack and json, with the example's codecs."""
    import torch

    import serializers

    values = {
        "Fraction": namespace["Fraction"](-7, 3),
        "Point": namespace["Point"](1.0, 2.5),
        "tensor": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "bool tensor": torch.tensor([[True], [False]]),
        "scalar tensor": torch.tensor(3, dtype=torch.int16),
    }
    found = {}
    for kind in ("msgpack", "json"):
        chosen = serializers.get(kind)
        for label, value in values.items():
            got = chosen.loads(chosen.dumps({"v": value}))["v"]
            same = (
                type(got) is type(value) and got.dtype == value.dtype and torch.equal(got, value)
                if isinstance(value, torch.Tensor)
                else type(got) is type(value) and got == value
            )
            found[f"{label} [{kind}]"] = bool(same)
    return found


def examples_then_hostile(blocks: List[str], cases: Dict[str, Tuple[str, Any]]) -> Dict[str, Any]:
    """In the child: cap CPU time, run the examples, then decode each hostile payload with msgpack and json."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    cap = int(used.ru_utime + used.ru_stime) + CPU_CAP_S
    resource.setrlimit(resource.RLIMIT_CPU, (cap, cap + 5))  # SIGXCPU, then SIGKILL: the child cannot run on
    import serializers

    report: Dict[str, Any] = {"examples": run_examples(blocks), "cases": {}}
    for case, (name, value) in cases.items():
        for kind in ("msgpack", "json"):
            before = set(sys.modules)
            start = time.process_time()
            try:
                serializers.get(kind).loads(payload(kind, name, value))
                outcome = "decoded"
            except Exception as exc:
                outcome = type(exc).__name__
            report["cases"][f"{case} [{kind}]"] = {
                "outcome": outcome,
                "cpu_s": time.process_time() - start,
                "imported": sorted(set(sys.modules) - before)[:5],
            }
    return report


@pytest.fixture(scope="module")
def report() -> Dict[str, Any]:
    blocks = example_blocks(PAGE.read_text())
    try:
        return run_in_child(examples_then_hostile, blocks, HOSTILE, timeout=240, preload=("numpy", "torch"))
    except ChildCrashed as exc:  # SIGXCPU: a C-level computation (a huge power) is not interrupted before
        pytest.fail(
            f"running docs/codecs.md's examples on hostile values took over {CPU_CAP_S} s of CPU: "
            f"one of them is not refused ({exc})"
        )


@pytest.mark.timeout(300)
def test_the_codec_examples_run_as_written(report):
    names = report["examples"]["namespace_names"]
    assert {"Fraction", "Point", "check", "check_point", "check_tensor"} <= set(names), names
    shown = report["examples"]["shown"]
    assert shown, "the page no longer shows an encoded value after an example"
    for expression, (got, expected) in shown.items():
        assert got == expected, f"docs/codecs.md shows {expected!r} for {expression}, it gives {got!r}"
    trips = report["examples"]["round trips"]
    assert trips and all(trips.values()), trips


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["msgpack", "json"])
@pytest.mark.parametrize("case", list(HOSTILE))
def test_the_codec_examples_refuse_hostile_values_quickly(report, case, kind):
    found = report["cases"][f"{case} [{kind}]"]
    assert found["outcome"] == "DecodeError", found
    assert found["cpu_s"] < QUICK_S, f"{case} took {found['cpu_s']:.2f} s of CPU to refuse"
    assert found["imported"] == [], f"{case} made the receiver import {found['imported']}"


def test_the_docs_say_what_to_do_after_a_timeout():
    """Issue 25: after a timeout the ranks may be at different calls, and the docs said neither that objcomm detects
    it nor that the group must be rebuilt. docs/security.md now says which (and what stays usable), and the README's
    failure table links there."""
    root = PAGE.parent.parent
    security = (root / "docs" / "security.md").read_text()
    section = security.split("## After a timeout", 1)[1].split("\n## ", 1)[0]
    assert "**After a `CommunicationError`, rebuild the group**" in section
    assert "OutOfStep" in section and "stays usable" in section
    assert "docs/security.md#after-a-timeout" in (root / "README.md").read_text()
