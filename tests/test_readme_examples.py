"""The README's python examples, and the docs' runnable ones, run as written; the failure rules they state hold.

Every top-level ```` ```python ```` block of the pages below runs, in order, in one namespace per page (as a reader
runs them one after another):

- ``pair`` pages on two live gloo ranks (``get_pool(2)``), the README among them: most of its examples need ranks;
- ``alone`` pages at world size 1, in a child process that has no process group (their blocks register serializers
  and change process-wide settings, which must not leak into pytest or the shared pool).

What a page's text leaves to the reader (``records``, ``loss``, a ``dataset`` and a ``model``, ...) is defined by
the page's ``prelude`` below, before its first block. Under the pool the README's ``init_process_group("gloo")``
finds the pool's group already there and does nothing (it stands in for the group torchrun's launch would create).

A block runs unless it is named in its page's ``skip``, with why it cannot run as written; a block that is not
skipped and fails is a failing test, so a new example is never skipped silently. Values shown in a comment after an
expression (``expr  # Verdict(verdict='converted', ...)``) are compared with what the expression gave, where the
comment reads as a Python literal or as that value's repr. ``expect`` lists what must hold after a block, per rank
(``_stdout``: what the block printed; ``_raises(call)``: the objcomm error a call raises, or ``None``).

Not here: docs/codecs.md (tests/test_docs_examples.py runs its blocks and feeds them hostile values), and the blocks
of compat.md, non-blocking.md and wire-format.md, not yet taken in.

Besides the examples, this file checks claims the docs make in prose: the failure table of docs/security.md ("Which
failures reach every rank": its example's printed output, through the same-host channel and the backend, and a rank
killed mid-job), which tensors msgpack carries, the fidelity table of docs/choosing-a-serializer.md, and that the
bench output the README and docs/bench.md show is one run's, with the current ``objcomm serializers`` listing.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import os
import re
import signal
import sys
import time
import tokenize
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
from _child import run_group_losing_a_rank, run_in_child
from _ranks import get_pool

ROOT = Path(__file__).resolve().parents[1]
PAIR, ALONE = "pair", "alone"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)
SECURITY_SECTION = "## Which failures reach every rank"


class PerRank(list):
    """An expected value that differs by rank: element r is rank r's."""


class Anything:
    """An expected value the test checks itself, across ranks."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__


@dataclass(frozen=True)
class Page:
    path: str
    run: str  # PAIR or ALONE
    prelude: str = ""  # names the page's text leaves to the reader, defined before its first block
    section: Optional[str] = None  # only the blocks under this heading (up to the next "## ")
    skip: Dict[str, str] = field(default_factory=dict)  # a block's first line -> why it cannot run as written
    expect: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # a block's first line -> {expression: value}


README_PRELUDE = """
import torch
import torch.distributed as dist

loss, grad = 0.25, torch.ones(4)                              # "Non-blocking calls"
logits, ids = torch.full((2, 3), float(dist.get_rank())), torch.arange(2)   # "Tensors inside objects"
"""

EXAMPLE = "# torchrun --nproc_per_node=4 examples/gather_dicts.py"
README = Page(
    "README.md",
    PAIR,
    README_PRELUDE,
    expect={
        EXAMPLE: {
            "_stdout": PerRank(["P 0: {0: 1}\nAll: {0: 1}\n", "P 1: {}\n"]),  # two ranks: rank 0 alone is even
            "merged": {0: 1},
            "config": {"lr": 3e-4},
            "everyone": PerRank([[{"rank": 0}, {"rank": 1}], None]),
            "shard": PerRank([0, 10]),
            "status if rank == 0 else None": PerRank([{"done": True}, None]),
        },
        'pending = objcomm.all_gather({"rank": rank, "loss": loss}, async_op=True)': {
            "everyone": [{"rank": 0, "loss": 0.25}, {"rank": 1, "loss": 0.25}],
            "step if rank == 1 else None": PerRank([None, {"step": 1}]),
        },
        'out = objcomm.all_gather({"logits": logits, "ids": ids}, serializer="msgpack", map_location="cpu")': {
            "[(type(o['logits']).__name__, o['logits'].device.type, o['logits'][0, 0].item()) for o in out]": [
                ("Tensor", "cpu", 0.0),
                ("Tensor", "cpu", 1.0),
            ]
        },
        "# from torch.distributed import all_gather_object, broadcast_object_list": {
            "callable(all_gather_object) and callable(broadcast_object_list)": True
        },
    },
)

SAME_HOST_PRELUDE = """
import numpy as np
import torch.distributed as dist
import objcomm

rank = dist.get_rank()
loss = 0.25
steps = 3                                                     # the short-path loop
def should_stop():
    return False
"""
SAME_HOST = Page(
    "docs/same-host.md",
    PAIR,
    SAME_HOST_PRELUDE,
    expect={
        "comm = objcomm.Communicator()": {"'arrays' in dir()": False},
        'comm = objcomm.Communicator(serializer="msgpack")   # set once': {
            "report if rank == 0 else None": PerRank([{"step": 2, "loss": 0.25}, None]),
            "stop": False,
        },
    },
)

MPI4PY_PRELUDE = """
import torch.distributed as dist

records = [{"key": f"k{i}", "value": i} for i in range(8)]   # what all_to_all routes
n_seen, n_correct = 10, 7
record = {"score": float(dist.get_rank())}                   # reduce keeps the best
"""
ROUTED = "import zlib"
MPI4PY = Page(
    "docs/from-mpi4py.md",
    PAIR,
    MPI4PY_PRELUDE,
    skip={
        "# mpi4py": "mpi4py is no dependency of objcomm; the next block is its objcomm translation, and runs",
        "# under mpiexec: torch's variables from the launcher's": "mpiexec's variables: the pool's ranks have none",
    },
    expect={
        "# objcomm: under torchrun, or in a plain process, where every call acts as a world of one": {
            "got": PerRank([{"from": 1}, {"from": 0}]),
            "total": 1,
        },
        ROUTED: {
            "len(mine)": Anything(),  # the test checks the sum and that each key has one owner
            "mine": Anything(),
            "totals": {"seen": 20, "correct": 14},
            "best": PerRank([{"score": 1.0}, None]),
            "text": "01",
            "upto": PerRank(["0", "01"]),
            "start": PerRank([0, 8]),  # rank 0's 8 records come first
            "(sender, status) if rank == 0 else None": PerRank([(1, {"step": 7}), None]),
        },
    },
)

COLLECT_PRELUDE = """
import torch
import objcomm
from torch.utils.data import DataLoader, DistributedSampler

dataset = torch.arange(11.0)   # 11 items on 2 ranks: the sampler pads the last round
def model(batch):
    return batch * 2
epoch = 1
"""
COLLECT = Page(
    "docs/collect-results.md",
    PAIR,
    COLLECT_PRELUDE,
    skip={
        "objcomm.collect_results(part, size=None, dst=0, *, indices=None, group=None, serializer=None)": (
            "the function's signature, not a call"
        )
    },
    expect={
        "sampler = DistributedSampler(dataset, shuffle=False)": {
            "results": PerRank([[2.0 * i for i in range(11)], None])
        },
        "sampler = DistributedSampler(dataset, shuffle=True, seed=0)": {
            "results": PerRank([[2.0 * i for i in range(11)], None])
        },
    },
)

SECURITY = Page(
    "docs/security.md",
    PAIR,
    "import objcomm\nimport torch.distributed as dist\nrank = dist.get_rank()\n",
    section=SECURITY_SECTION,
    expect={"class Unpicklable:": {"failed": [1], "got": PerRank([[0, 1], None])}},
)

CHOOSING = Page(
    "docs/choosing-a-serializer.md",
    ALONE,
    "class MyRecord:\n    pass\nobj = {'loss': 0.25}\n",
    expect={
        'objcomm.all_gather(obj, serializer="auto")  # any serializer this rank may use': {
            "objcomm.all_gather(obj, serializer='auto') == [obj]": True,  # under accept=["msgpack", "json"] above
            "serializers.get('auto').choose(obj)": "msgspec",  # JSON-like
            "serializers.get('auto').choose({'kernel': (3, 3)})": "pickle",
            "serializers.AutoSerializer(safe=True).choose({'kernel': (3, 3)})": "restricted-pickle",
        },
        "import msgspec": {
            "objcomm.gather(records, dst=0, serializer='records', accept=['records']) == [records]": True,
            "_raises(lambda: serializers.get('records').loads(serializers.get('msgspec').dumps([0])))": "DecodeError",
        },
        "import objcomm": {
            "sorted(objcomm.settings().accept)": ["json", "msgpack"],
            "_raises(lambda: objcomm.all_gather(1))": "ContentRefusedError",  # pickle, by default
            "_raises(lambda: objcomm.all_gather(1, serializer='msgpack'))": None,
            "_raises(lambda: comm.all_gather(1, serializer='msgpack'))": "ContentRefusedError",
            "_raises(lambda: comm.all_gather(1, serializer='restricted-pickle'))": None,
        },
        'serializers.get("restricted-pickle").allow(MyRecord, "mypkg.types.Other")': {
            '"mypkg.types.Other" in serializers.get("restricted-pickle").allowed()': True
        },
    },
)

CUSTOM = Page(
    "docs/custom-serializers.md",
    ALONE,
    'big_dict = {"losses": list(range(10_000))}\n',
    skip={
        "dumps(obj, /) -> bytes-like          # raise serializers.EncodeError when obj cannot be encoded": (
            "the protocol's two signatures, not code"
        ),
        "from objcomm import serializers": "needs the examples/custom_serializer package installed; "
        "tests/tools/test_launch.py::test_custom_serializer_package_is_found_through_its_entry_point runs it so",
    },
    expect={
        "import pickle": {'objcomm.all_gather(big_dict, serializer="zlib-pickle") == [big_dict]': True},
        "from objcomm.serializers import DecodeError, EncodeError, Serializer": {
            'serializers.get("upper").loads(serializers.get("upper").dumps("ab"))': "AB",
            'serializers.get("upper").safe': True,
        },
    },
)

MULTINODE = Page(
    "docs/multinode.md",
    ALONE,
    skip={"import os": "torchrun on GPUs: needs LOCAL_RANK and CUDA for NCCL (tests/test_gpu.py checks NCCL on a GPU)"},
)


# -- reading pages ------------------------------------------------------------------------------------------------
def page_text(page: Page) -> str:
    text = (ROOT / page.path).read_text()
    if page.section is not None:
        assert text.count(page.section + "\n") == 1, f"{page.path} has no single section {page.section!r}"
        text = text.split(page.section + "\n", 1)[1].split("\n## ", 1)[0]
    return text


def blocks(page: Page) -> List[str]:
    """The page's top-level python blocks, in order (indented ones, inside a list, are not taken)."""
    return BLOCK.findall(page_text(page))


def first_line(block: str) -> str:
    return next(line for line in block.splitlines() if line.strip()).rstrip()


# -- running them (on a rank of the pool, or in a child) ----------------------------------------------------------
def _comments(source: str) -> Dict[int, str]:
    """Line number -> the comment that ends it."""
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string[1:].strip()
    return found


def _shown_mismatch(value: Any, comment: str) -> Optional[str]:
    """Whether a comment after an expression shows its value: a literal equal to it, or its repr."""
    try:
        shown = ast.literal_eval(comment)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        if not comment.startswith(type(value).__name__ + "("):
            return None  # an explanation, not a value
        return None if repr(value) == comment else f"shows {comment}, gives {value!r}"
    return None if shown == value else f"shows {comment}, gives {value!r}"


def _run_block(source: str, name: str, namespace: Dict[str, Any]) -> List[str]:
    """Run one block statement by statement; return the shown values it contradicts."""
    tree = ast.parse(source, name)
    comments = _comments(source)
    mismatches = []
    for statement in tree.body:
        if isinstance(statement, ast.Expr):
            value = eval(compile(ast.Expression(statement.value), name, "eval"), namespace)
            comment = comments.get(statement.end_lineno or statement.lineno)
            problem = None if comment is None else _shown_mismatch(value, comment)
            if problem:
                mismatches.append(f"{name}, line {statement.lineno}: {problem}")
        else:
            exec(compile(ast.Module([statement], type_ignores=[]), name, "exec"), namespace)
    return mismatches


def _raises(call: Any) -> Optional[str]:
    """For ``expect``: the name of the objcomm error ``call()`` raised, or ``None``."""
    import objcomm

    try:
        call()
    except objcomm.ObjcommError as exc:
        return type(exc).__name__
    return None


def _probe(expression: str, namespace: Dict[str, Any]) -> Any:
    try:
        return eval(expression, namespace)
    except Exception as exc:
        return f"<{expression} raised {type(exc).__name__}: {exc}>"


def run_page(page: Page) -> Dict[str, Any]:
    """Run the page's blocks in one namespace; return per block its output, contradicted comments and probes.
    Process-wide settings a block changes (``objcomm.configure``) are put back afterwards."""
    import torch.distributed as dist

    import objcomm

    settings_before = objcomm.configure()
    module_name = "docs_example_" + re.sub(r"\W", "_", page.path)
    module = sys.modules[module_name] = types.ModuleType(module_name)  # classes defined in blocks pickle by name
    namespace: Dict[str, Any] = module.__dict__
    exec(compile(page.prelude, f"<{page.path} prelude>", "exec"), namespace)
    namespace["_raises"] = _raises  # for the expectations (names with "_" are not the page's)
    ran: Dict[str, Any] = {}
    real_init, real_destroy = dist.init_process_group, dist.destroy_process_group

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:  # the pool's group is up
        assert dist.is_initialized() and backend in (None, "gloo"), backend

    def destroy_process_group(group: Any = None) -> None:  # and stays up for the next blocks and tests
        assert group is None and dist.is_initialized()

    if page.run == PAIR:
        dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group
    try:
        for number, source in enumerate(blocks(page), 1):
            key = first_line(source)
            if key in page.skip:
                continue
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                mismatches = _run_block(source, f"<{page.path}, python block {number}>", namespace)
            namespace["_stdout"] = out.getvalue()
            ran[key] = {
                "stdout": out.getvalue(),
                "mismatches": mismatches,
                "probes": {e: _probe(e, namespace) for e in page.expect.get(key, {})},
            }
    finally:
        dist.init_process_group, dist.destroy_process_group = real_init, real_destroy
        sys.modules.pop(module_name, None)
        objcomm.restore(settings_before)
    return ran


def run_page_on_rank(page: Page, local: Optional[bool] = None) -> Dict[str, Any]:
    """On a rank of the pool: run the page (under ``configure(local=...)`` when given), settings restored after."""
    import objcomm

    previous = objcomm.configure(local=local) if local is not None else None
    try:
        return run_page(page)
    finally:
        if previous is not None:
            objcomm.restore(previous)


def tensor_claims() -> Dict[str, str]:
    """What docs/choosing-a-serializer.md and docs/codecs.md say msgpack and json do with tensors, observed."""
    import numpy as np
    import torch

    import objcomm
    from objcomm import serializers

    class Sub(torch.Tensor):
        pass

    with_attribute = torch.ones(2)
    with_attribute.note = "kept by pickle only"

    def outcome(call: Any) -> str:
        try:
            got = call()
        except objcomm.ObjcommError as exc:
            return type(exc).__name__
        value = got[0]["v"] if isinstance(got, list) else got
        return f"{type(value).__name__}, requires_grad={getattr(value, 'requires_grad', None)}"

    return {
        "msgpack, a tensor": outcome(lambda: objcomm.all_gather({"v": torch.ones(3)}, serializer="msgpack")),
        "msgpack, a Parameter": outcome(
            lambda: objcomm.all_gather({"v": torch.nn.Parameter(torch.ones(3))}, serializer="msgpack")
        ),
        "msgpack, a numpy array": outcome(lambda: objcomm.all_gather({"v": np.ones(3)}, serializer="msgpack")),
        "msgpack, a subclass": outcome(
            lambda: objcomm.all_gather({"v": torch.ones(3).as_subclass(Sub)}, serializer="msgpack")
        ),
        "msgpack, attributes": outcome(lambda: objcomm.all_gather({"v": with_attribute}, serializer="msgpack")),
        "msgpack, sparse": outcome(lambda: objcomm.all_gather({"v": torch.eye(2).to_sparse()}, serializer="msgpack")),
        "msgpack directly": outcome(lambda: serializers.get("msgpack").dumps({"v": torch.ones(3)})),
        "json, a tensor": outcome(lambda: objcomm.all_gather({"v": torch.ones(3)}, serializer="json")),
        "json, a numpy array": outcome(lambda: objcomm.all_gather({"v": np.ones(3)}, serializer="json")),
    }


def serializer_listing() -> str:
    """What ``objcomm serializers`` prints, before any page registers a serializer of its own."""
    from objcomm._tools import cli as _cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert _cli.run(["serializers"]) == 0
    return out.getvalue()


def alone(pages: List[Page]) -> Dict[str, Any]:
    """In a child without a process group: the serializer listing, each page, then the tensor claims."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    listing = serializer_listing()
    return {"listing": listing, "pages": {page.path: run_page(page) for page in pages}, "tensors": tensor_claims()}


def _dies_mid_job(local: bool, rank: int, world: int, store: str, victim: int, results: Any) -> None:
    """A group of our own (the pool would kill every rank): the victim is SIGKILLed after one call; the others call."""
    from datetime import timedelta

    import torch.distributed as dist

    import objcomm

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    comm = objcomm.Communicator(local=local)
    comm.all_gather(rank)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        comm.all_gather(rank)
        results.put((rank, "returned", time.monotonic() - started))
    except objcomm.ObjcommError as exc:
        results.put((rank, type(exc).__name__, time.monotonic() - started))
    results.close()
    results.join_thread()  # the report is out; leaving through the broken group's teardown would only wait
    os._exit(0)


# -- the tests ----------------------------------------------------------------------------------------------------
def check(page: Page, per_rank: List[Dict[str, Any]]) -> None:
    """Every block not skipped ran on every rank, skips name real blocks, shown values and expectations hold."""
    keys = [first_line(b) for b in blocks(page)]
    assert keys, f"{page.path} has no python blocks"
    assert len(set(keys)) == len(keys), f"{page.path}: two blocks start alike; tell them apart in this test"
    for key in list(page.skip) + list(page.expect):
        assert key in keys, f"{page.path} has no block starting {key!r} any more: update this test"
    for rank, ran in enumerate(per_rank):
        assert list(ran) == [k for k in keys if k not in page.skip], (page.path, rank, list(ran))
        for key, result in ran.items():
            assert not result["mismatches"], result["mismatches"]
            for expression, expected in page.expect.get(key, {}).items():
                want = expected[rank] if isinstance(expected, PerRank) else expected
                got = result["probes"][expression]
                assert got == want, f"{page.path}, block {key!r}, rank {rank}: {expression} == {got!r}, not {want!r}"


@pytest.fixture(scope="module")
def pair():
    return get_pool(2)


@pytest.fixture(scope="module")
def alone_report() -> Dict[str, Any]:
    return run_in_child(alone, [CHOOSING, CUSTOM, MULTINODE], timeout=240, preload=("numpy", "torch"))


@pytest.mark.timeout(300)
def test_the_readme_examples_run_on_two_ranks(pair):
    check(README, pair.run(run_page_on_rank, README, timeout=240))


@pytest.mark.timeout(300)
def test_the_same_host_examples_run_on_two_ranks(pair):
    check(SAME_HOST, pair.run(run_page_on_rank, SAME_HOST, timeout=240))


@pytest.mark.timeout(300)
def test_the_mpi4py_and_all_to_all_examples_run_on_two_ranks(pair):
    per_rank = pair.run(run_page_on_rank, MPI4PY, timeout=240)
    check(MPI4PY, per_rank)
    # all_to_all routes each rank's 8 records by their key's crc32: every record arrives exactly once, and both
    # ranks' records of one key at the same rank (the page used hash(), seeded per process: keys split between ranks)
    assert sum(r[ROUTED]["probes"]["len(mine)"] for r in per_rank) == 2 * 8
    owners = [{rec["key"] for rec in r[ROUTED]["probes"]["mine"]} for r in per_rank]
    assert not owners[0] & owners[1] and len(owners[0] | owners[1]) == 8, owners


@pytest.mark.timeout(300)
def test_the_collect_results_examples_run_on_two_ranks(pair):
    check(COLLECT, pair.run(run_page_on_rank, COLLECT, timeout=240))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("local", [True, False], ids=["same-host channel", "backend"])
def test_which_failures_reach_every_rank_is_what_the_example_prints(pair, local):
    """docs/security.md's table, by its example: each case's outcome on each rank is the text block after it."""
    section = page_text(SECURITY)
    shown = section.split("```text\n", 1)[1].split("```", 1)[0]
    per_rank = pair.run(run_page_on_rank, SECURITY, local, timeout=240)
    check(SECURITY, per_rank)
    printed = "".join(next(iter(ran.values()))["stdout"] for ran in per_rank)
    assert printed == shown, f"docs/security.md shows\n{shown}\nthe ranks printed\n{printed}"
    assert pair.run(run_page_on_rank, SECURITY, local, timeout=240) == per_rank  # the group stayed usable


@pytest.mark.timeout(180)
@pytest.mark.parametrize("local", [True, False], ids=["same-host channel", "backend"])
def test_a_rank_that_dies_makes_the_others_raise_communication_error_at_once(local):
    """docs/security.md: a rank that dies -> CommunicationError as soon as its connection closes, not at the
    timeout (60 s here). A rank that never calls:
    tests/api/test_failures.py::test_missing_rank_ends_in_an_error_within_the_group_timeout."""
    got, victim_exit = run_group_losing_a_rank(functools.partial(_dies_mid_job, local), 2, 1, timeout=120)
    assert victim_exit == -signal.SIGKILL
    kind, seconds = got[0]
    assert kind == "CommunicationError" and seconds < 10, got


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", [CHOOSING, CUSTOM, MULTINODE], ids=lambda p: p.path)
def test_the_docs_examples_run_alone(alone_report, page):
    check(page, [alone_report["pages"][page.path]])


@pytest.mark.timeout(300)
def test_msgpack_carries_the_tensors_objcomm_lifts_and_refuses_the_rest(alone_report):
    assert alone_report["tensors"] == {
        "msgpack, a tensor": "Tensor, requires_grad=False",
        "msgpack, a Parameter": "Parameter, requires_grad=True",
        "msgpack, a numpy array": "ndarray, requires_grad=None",
        "msgpack, a subclass": "EncodeError",
        "msgpack, attributes": "EncodeError",
        "msgpack, sparse": "EncodeError",
        "msgpack directly": "EncodeError",
        "json, a tensor": "EncodeError",
        "json, a numpy array": "EncodeError",
    }


def test_the_grouped_fidelity_table_of_choosing_a_serializer_is_measured():
    import serializers

    text = (ROOT / "docs" / "choosing-a-serializer.md").read_text()
    table = text.split("## What round-trips", 1)[1].split("\n\n| type |", 1)[1].split("\n\n", 1)[0]
    lines = ("| type |" + table).splitlines()
    names = [c.strip() for c in lines[0].strip("|").split("|")][1:]
    probes = {name for name, _ in serializers.PROBES}
    seen = set()
    for line in lines[2:]:
        first, *cells = [c.strip() for c in line.strip("|").split("|")]
        group, pending = [], ""
        for part in first.split(", "):  # "dict, str keys" is one probe; "set, frozenset" two
            pending = f"{pending}, {part}" if pending else part
            if pending in probes:
                group.append(pending)
                pending = ""
        assert not pending and group, f"unknown probe in {first!r}"
        for probe in group:
            seen.add(probe)
            for name, cell in zip(names, cells):
                assert str(serializers.fidelity(name)[probe]) == cell, (probe, name)
    assert seen == probes, sorted(probes - seen)


def _text_block_after(text: str, marker: str) -> List[str]:
    return text.split(marker, 1)[1].split("```text\n", 1)[1].split("```", 1)[0].splitlines()


def test_the_bench_samples_are_one_run_and_the_serializer_listing_is_current(alone_report):
    readme = (ROOT / "README.md").read_text()
    bench = (ROOT / "docs" / "bench.md").read_text()
    sample = _text_block_after(readme, "## Quick start")
    full = _text_block_after(bench, "## Sample output")
    shown = [line for line in sample if line != "..."]
    assert len(shown) > 10 and all(line in full for line in shown), [line for line in shown if line not in full]
    listing = _text_block_after(bench, "## `objcomm serializers`")
    assert listing[0] == "$ objcomm serializers"
    assert listing[1:] == alone_report["listing"].splitlines()
