"""GPU checks: CUDA tensors inside objects, NCCL, a ``cpu:gloo,cuda:nccl`` group; skipped without CUDA.

On a machine with CUDA (one GPU is enough)::

    pip install -e ".[test]" && python -m pytest tests/test_gpu.py -v

NCCL cannot run two ranks on one GPU, so:

- the NCCL checks run at world size 1, each in a fresh spawned process with a one-rank group of
  its own on 127.0.0.1 (never the pytest process's group: other tests expect none);
- the two-rank checks use the harness's gloo ranks, with CUDA tensors inside the objects. gloo
  moves bytes on the CPU, so tensors arrive there unless ``map_location`` says otherwise.

Where several GPUs exist, each rank makes the last GPU (NCCL) or GPU ``rank % count`` (gloo) its
current device, so "the receiver's current device" differs from ``cuda:0`` and from the sender's.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
from _child import run_in_child
from _ranks import free_port, get_pool

import objcomm
from objcomm._device import group_backend, resolve_device

COMMAND = 'pip install -e ".[test]" && python -m pytest tests/test_gpu.py -v'
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason=f"needs CUDA; run on a GPU machine: {COMMAND}"),
    pytest.mark.timeout(300),
]

BIG = 2 << 20  # float32 elements: 8 MiB, out of band and above the 2 MiB shared-memory threshold
CHILD_TIMEOUT = 240.0  # a fresh process: import torch, start CUDA, start NCCL, then the checks
SERIALIZERS = ["pickle", "msgpack"]  # json carries no tensors
# Tiny slots and chunks: overflowing frames and tensors moved in 1 MiB pieces, on the wire's device.
LAYOUTS: Dict[str, Dict[str, Any]] = {"default": {}, "tiny": {"slot_bytes": 128, "chunk_bytes": 1 << 20}}
# Slots, votes and frames of these calls come to a few KiB; a tensor through the host would be MiBs.
HOST_COPY_LIMIT = 1 << 20
PROFILED_BYTES = 64 << 20  # the tensor whose path the profiler watches
CONTROL_BYTES = (3 << 20) + 4096  # a copy to the host the profiler must see, of a size nothing else has


# -- objects and what must come back -----------------------------------------------------------
def sample(rank: int, device: Any) -> dict:
    """An object with CUDA (or ``device``) tensors of every kind objcomm keeps, plus a CPU tensor."""
    return {
        "rank": rank,
        "small": torch.arange(6, dtype=torch.int64, device=device).reshape(2, 3) + rank,  # inline
        "big": torch.arange(BIG, dtype=torch.float32, device=device) + rank,  # out of band
        "bf16": torch.full((3, 4), float(rank), dtype=torch.bfloat16, device=device),
        "grad": torch.ones(4, device=device, requires_grad=True),
        "param": torch.nn.Parameter(torch.zeros(3, device=device)),
        "host": torch.arange(3) + rank,  # a CPU tensor in the same object
        "nested": [{"strided": torch.arange(40.0, device=device).reshape(5, 8)[:, ::2] + rank}],
    }


def tensors_of(obj: dict) -> List[Tuple[str, torch.Tensor]]:
    keys = ("small", "big", "bf16", "grad", "param", "host")
    return [(k, obj[k]) for k in keys] + [("nested[0].strided", obj["nested"][0]["strided"])]


def placed(where: Any) -> torch.device:
    """``where`` as a tensor's ``.device`` reports it: ``"cuda"`` is the current CUDA device."""
    device = torch.device(where)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check(got: Any, rank: int, where: Any) -> None:
    """``got`` is ``sample(rank, ...)`` with every tensor, the CPU one too, on ``where``."""
    want = sample(rank, "cpu")
    assert isinstance(got, dict) and got.keys() == want.keys(), got
    assert got["rank"] == rank
    device = placed(where)
    for (path, g), (_, w) in zip(tensors_of(got), tensors_of(want)):
        assert g.device == device, f"{path} arrived on {g.device}, expected {device}"
        assert type(g) is type(w), f"{path}: {type(g).__name__}, expected {type(w).__name__}"
        assert (g.dtype, tuple(g.shape), g.requires_grad) == (w.dtype, tuple(w.shape), w.requires_grad), path
        assert torch.equal(g.detach().cpu(), w.detach()), f"{path}: values differ"


def check_each(results: Dict[str, Any], rank: int, where: Any, context: str) -> None:
    """:func:`check` on what each collective returned; a failure names the collective and ``context``."""
    for op, got in results.items():
        try:
            check(got, rank, where)
        except AssertionError as exc:
            raise AssertionError(f"{op}, {context}: {exc}") from exc


def current_cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


# -- world size 1 in a fresh process -------------------------------------------------------------
def _one_rank_group(backend: Optional[str], port: int, scenario: Callable[..., Any], *args: Any) -> Any:
    """In a spawned child: a one-rank group of ``backend`` on 127.0.0.1:``port``, then ``scenario(*args)``."""
    import torch.distributed as dist

    os.environ.pop("LOCAL_RANK", None)  # the child is no launcher's rank
    torch.cuda.set_device(torch.cuda.device_count() - 1)  # not cuda:0 where there is a choice
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        return scenario(*args)
    finally:
        dist.destroy_process_group()


def in_one_rank_group(backend: Optional[str], scenario: Callable[..., Any], *args: Any) -> Any:
    """Run ``scenario`` at world size 1 in a fresh process; it is reaped, and killed past the timeout."""
    return run_in_child(_one_rank_group, backend, free_port(), scenario, *args, timeout=CHILD_TIMEOUT)


def _every_collective(comm: objcomm.Communicator, obj: Any, **call: Any) -> Dict[str, Any]:
    """What each collective returns for ``obj`` at world size 1."""
    return {
        "all_gather": comm.all_gather(obj, **call)[0],
        "gather": comm.gather(obj, 0, **call)[0],
        "broadcast": comm.broadcast(obj, 0, **call),
        "scatter": comm.scatter([obj], 0, **call),
        "all_to_all": comm.all_to_all([obj], **call)[0],
    }


# -- NCCL at world size 1 ------------------------------------------------------------------------
def _nccl_objects(serializer: str) -> None:
    import torch.distributed as dist

    assert str(dist.get_backend()) == "nccl"
    device = current_cuda()
    mine = sample(0, device)
    plain = {"text": "x" * 100_000, "numbers": list(range(1000))}  # no tensors, larger than a slot
    for layout, knobs in LAYOUTS.items():
        comm = objcomm.Communicator(serializer=serializer, **knobs)
        results = _every_collective(comm, mine)
        check_each(results, 0, device, f"{layout} layout")
        for op, got in results.items():
            assert got["big"].data_ptr() != mine["big"].data_ptr(), f"{op}: the result aliases the input"
        moved = _every_collective(comm, plain)
        assert all(got == plain for got in moved.values()), f"{layout} layout: {moved}"


def _nccl_map_location() -> None:
    device = current_cuda()
    mine = sample(0, device)
    for where in ("cpu", torch.device("cpu"), "cuda", device):
        check_each(
            _every_collective(objcomm.Communicator(), mine, map_location=where), 0, where, f"map_location={where!r}"
        )
    # the module-level functions and a Communicator's own default
    check(objcomm.all_gather(mine, map_location="cpu")[0], 0, "cpu")
    check(objcomm.Communicator(map_location="cpu").broadcast(mine), 0, "cpu")
    check(objcomm.broadcast(mine), 0, device)


def _nccl_numpy(serializer: str) -> None:
    small = np.arange(10, dtype=np.int32)  # inline
    big = np.arange(BIG, dtype=np.float32)  # out of band: through NCCL, so on the GPU on the way
    obj = {"small": small, "big": big, "tensor": torch.ones(3, device=current_cuda())}
    for where in (None, "cuda", "cpu"):
        comm = objcomm.Communicator(serializer=serializer)
        for op, got in _every_collective(comm, obj, map_location=where).items():
            for key, want in (("small", small), ("big", big)):
                arrived = got[key]
                assert type(arrived) is np.ndarray, f"{op}, map_location={where}: {key} is {type(arrived)}"
                assert arrived.dtype == want.dtype and np.array_equal(arrived, want), f"{op}: {key} differs"
            assert got["tensor"].device == placed(where or "cuda"), f"{op}: the tensor is on {got['tensor'].device}"
    whole = bytes(range(256)) * 4096  # 1 MiB given as the whole object: out of band too
    for kind in (bytes, bytearray):
        for op, got in _every_collective(objcomm.Communicator(serializer=serializer), kind(whole)).items():
            assert type(got) is kind and got == whole, f"{op}: {kind.__name__} came back as {type(got).__name__}"


def _nccl_profiled() -> Dict[str, Any]:
    """Every collective on a 64 MiB CUDA tensor under the profiler; the memory copies it saw."""
    from torch.profiler import ProfilerActivity, profile

    device = current_cuda()
    weights = torch.randn(PROFILED_BYTES // 4, device=device)
    obj = {"weights": weights, "step": 7}
    control = torch.ones(CONTROL_BYTES, dtype=torch.uint8, device=device)
    comms = [objcomm.Communicator(**knobs) for knobs in LAYOUTS.values()]
    for comm in comms:  # warm up: NCCL's communicator, CUDA's kernels and allocator
        _every_collective(comm, obj)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        results = [got for comm in comms for got in _every_collective(comm, obj).values()]
        torch.cuda.synchronize()
        control.cpu()  # the one copy to the host the profiler must report
        torch.cuda.synchronize()
    for got in results:
        assert got["weights"].device == device and torch.equal(got["weights"], weights) and got["step"] == 7
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    copies = [
        (str(e["name"]), e.get("args", {}).get("bytes")) for e in events if str(e.get("name", "")).startswith("Memcpy")
    ]
    return {"copies": copies, "calls": len(results)}


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_nccl_world_size_1_moves_objects_with_cuda_tensors(serializer):
    """Every collective, default and tiny slots/chunks: CUDA (and CPU) tensors inside the object come
    back on the current CUDA device with dtype, shape, requires_grad and Parameter kept, never
    aliasing the input; objects without tensors move too."""
    in_one_rank_group("nccl", _nccl_objects, serializer)


def test_nccl_world_size_1_map_location():
    """map_location "cpu" / "cuda" (strings and devices, per call and per Communicator) places every tensor."""
    in_one_rank_group("nccl", _nccl_map_location)


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_nccl_world_size_1_numpy_and_bytes_come_back_on_the_cpu(serializer):
    """numpy arrays inside objects come back as numpy on the CPU whatever map_location says;
    a large bytes/bytearray given as the whole object comes back as itself."""
    in_one_rank_group("nccl", _nccl_numpy, serializer)


def test_nccl_tensor_path_does_not_pass_through_host_memory():
    """No device-to-host (or host-to-device) copy of a tensor's size while every collective moves a
    64 MiB CUDA tensor inside an object, as CUPTI sees it through torch.profiler. A 3 MiB ``.cpu()``
    in the same profile proves the profiler reports such copies with their sizes."""
    report = in_one_rank_group("nccl", _nccl_profiled)
    copies = report["copies"]
    host = [(name, n) for name, n in copies if "DtoH" in name or "HtoD" in name]
    controls = [c for c in host if "DtoH" in c[0] and c[1] == CONTROL_BYTES]
    assert controls, f"the profiler did not report the control copy of {CONTROL_BYTES} bytes; it saw {copies}"
    host.remove(controls[0])
    unknown = [c for c in host if not isinstance(c[1], int)]
    assert not unknown, f"host copies of unknown size: {unknown}"
    moved = sum(n for _, n in host)
    assert moved < HOST_COPY_LIMIT, (
        f"{report['calls']} calls on a {PROFILED_BYTES >> 20} MiB CUDA tensor copied {moved:,} bytes between "
        f"the GPU and the host: {sorted(host, key=lambda c: -c[1])[:10]}"
    )


# -- a group with a CPU and a CUDA backend -------------------------------------------------------
def _mixed_group() -> None:
    import torch.distributed as dist

    world = dist.group.WORLD
    assert resolve_device(group_backend(world), world) == torch.device("cpu")  # bytes on the gloo side
    device = current_cuda()
    mine = sample(0, device)
    plain = {"text": "x" * 100_000, "numbers": list(range(1000))}
    comm = objcomm.Communicator()
    for where, expected in ((None, "cpu"), ("cuda", device), ("cpu", "cpu")):  # default: the transport device
        check_each(_every_collective(comm, mine, map_location=where), 0, expected, f"map_location={where!r}")
    moved = _every_collective(comm, plain)
    assert all(got == plain for got in moved.values()), moved
    got = objcomm.all_gather({"a": np.arange(BIG, dtype=np.float32)})[0]["a"]
    assert type(got) is np.ndarray and np.array_equal(got, np.arange(BIG, dtype=np.float32))
    # device="cuda" puts the bytes on the NCCL side of the same group
    cuda = objcomm.Communicator(device="cuda")
    check_each(_every_collective(cuda, mine), 0, device, "Communicator(device='cuda')")
    assert cuda.all_gather(plain) == [plain]


@pytest.mark.parametrize("backend", ["cpu:gloo,cuda:nccl", None], ids=["cpu:gloo,cuda:nccl", "no-backend"])
def test_cpu_gloo_cuda_nccl_group(backend):
    """``init_process_group("cpu:gloo,cuda:nccl")`` (and without a backend, which means the same on a
    GPU machine): bytes move on the CPU side, CUDA tensors arrive on the CPU or on map_location,
    plain objects and numpy arrays move, and ``device="cuda"`` moves the bytes through NCCL."""
    in_one_rank_group(backend, _mixed_group)


# -- two gloo ranks on one GPU -------------------------------------------------------------------
OPS = ["all_gather", "gather", "broadcast", "scatter", "all_to_all", "send_recv"]
PATHS: Dict[str, Dict[str, Any]] = {
    "shm": {},  # the 8 MiB tensor is above the threshold: same-host shared memory
    "gloo": {"shm": False},
    "gloo-tiny": {"shm": False, "slot_bytes": 128, "chunk_bytes": 1 << 20},
}


def _gloo_cuda_objects(op: str, map_location: Optional[str], knobs: Dict[str, Any]) -> None:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = current_cuda()
    where = map_location or "cpu"  # gloo's transport device unless map_location says otherwise
    comm = objcomm.Communicator(**knobs)
    call = {"map_location": map_location}
    mine = sample(rank, device)
    if op == "all_gather":
        for r, got in enumerate(comm.all_gather(mine, **call)):
            check(got, r, where)
    elif op == "gather":
        gathered = comm.gather(mine, 1, **call)
        if rank == 1:
            for r, got in enumerate(gathered):
                check(got, r, where)
        else:
            assert gathered is None
    elif op == "broadcast":
        check(comm.broadcast(mine if rank == 1 else None, 1, **call), 1, where)
    elif op == "scatter":
        objs = [sample(r, device) for r in range(world)] if rank == 0 else None
        check(comm.scatter(objs, 0, **call), rank, where)
    elif op == "all_to_all":
        got = comm.all_to_all([sample(10 * j + rank, device) for j in range(world)], **call)
        for r in range(world):
            check(got[r], 10 * rank + r, where)
    elif op == "send_recv":
        if rank == 0:
            comm.send(mine, 1)
            check(comm.recv(1, **call), 1, where)
        else:
            check(comm.recv(0, **call), 0, where)
            comm.send(mine, 0)
    else:
        raise ValueError(op)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("map_location", [None, "cpu", "cuda"], ids=["default", "cpu", "cuda"])
@pytest.mark.parametrize("op", OPS)
def test_gloo_two_ranks_cuda_tensors_in_objects(op, map_location, path):
    """Two gloo ranks sharing the GPU: CUDA tensors inside objects arrive on the CPU (gloo's device) by
    default and on the receiver's current CUDA device with map_location="cuda", values and kinds kept,
    through shared memory, plain gloo and 1 MiB chunks."""
    get_pool(2).run(_gloo_cuda_objects, op, map_location, PATHS[path], timeout=120)


# -- NCCL with two ranks: round 1 through the same-host channel (needs a GPU per rank) -------------
def _nccl_two_ranks(_: Any, send: Any) -> Dict[str, Any]:
    """Small objects through the channel, a CUDA-tensor object's tensors through NCCL, on each rank."""
    import torch.distributed as dist

    from objcomm import _state

    rank, device = dist.get_rank(), current_cuda()
    comm = objcomm.Communicator()
    assert comm.all_gather({"rank": rank}) == [{"rank": 0}, {"rank": 1}]
    assert comm.broadcast("from 0" if rank == 0 else None) == "from 0"
    assert comm.all_to_all([(rank, r) for r in range(2)]) == [(0, rank), (1, rank)]
    if rank == 0:
        comm.send({"ping": 0}, 1)
        assert comm.recv(1) == {"pong": 1}
    else:
        assert comm.recv(0) == {"ping": 0}
        comm.send({"pong": 1}, 0)
    for other, got in enumerate(comm.all_gather(sample(rank, device))):
        check(got, other, device)
    channel = _state.group_facts(dist.group.WORLD).local[False].channel
    assert channel is not None and not channel.closed and channel.p2p, "round 1 did not go through the channel"
    return {"channel": True}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two GPUs")
def test_nccl_two_ranks_take_the_same_host_channel():
    from objcomm._tools.launch import run_local

    assert run_local(_nccl_two_ranks, None, world_size=2, backend="nccl", timeout_s=CHILD_TIMEOUT) == {"channel": True}


def _nccl_summed_slots(_: Any, send: Any) -> Dict[str, Any]:
    """all_gather on NCCL with the slots summed (one all_reduce of the uint8 table, as from 64 ranks), each rank its
    own host: objects in the slot, past it, and a CUDA tensor."""
    import torch.distributed as dist

    from objcomm._api.resolving import Hooks

    rank, device = dist.get_rank(), current_cuda()
    comm = objcomm.Communicator(local=False, shm=False, _hooks=Hooks(separate_hosts=True, summed=True))
    assert comm.all_gather({"rank": rank}) == [{"rank": 0}, {"rank": 1}]
    assert comm.all_gather("x" * (10_000 * (rank + 1))) == ["x" * 10_000, "x" * 20_000]
    for other, got in enumerate(comm.all_gather(sample(rank, device))):
        check(got, other, device)
    return {"summed": True}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two GPUs")
def test_nccl_summed_slots_read_as_the_all_gathers_would():
    from objcomm._tools.launch import run_local

    got = run_local(_nccl_summed_slots, None, world_size=2, backend="nccl", timeout_s=CHILD_TIMEOUT)
    assert got == {"summed": True}


def _nccl_tree_messages(_: Any, send: Any) -> Dict[str, Any]:
    """all_reduce, reduce and scan on NCCL off the channel (each rank its own host): the trees' messages, each the
    envelope, the slot and 60 KiB of room (routes.backend_room), with values in the slot, within the room (one
    message an edge), past it, and a CUDA tensor out of band (never in the message: it stays on the GPU)."""
    import torch.distributed as dist

    from objcomm._api.resolving import Hooks

    rank, device = dist.get_rank(), current_cuda()
    comm = objcomm.Communicator(local=False, shm=False, _hooks=Hooks(separate_hosts=True))
    for size in (10, 20_000, 100_000):
        obj = f"{rank}" + "v" * size
        assert comm.all_reduce(obj, "max") == "1" + "v" * size
        assert comm.reduce(obj, "max", dst=1) == ("1" + "v" * size if rank == 1 else None)
        assert comm.scan(obj, "max") == obj
    oob = objcomm.Communicator(local=False, shm=False, inline_tensor_bytes=0, _hooks=Hooks(separate_hosts=True))
    summed = oob.all_reduce({"t": torch.full((4000,), rank, device=device)}, "merge")
    assert summed["t"].device == device and torch.equal(summed["t"].cpu(), torch.full((4000,), 1))
    return {"trees": True}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two GPUs")
def test_nccl_tree_messages_are_one_length():
    from objcomm._tools.launch import run_local

    got = run_local(_nccl_tree_messages, None, world_size=2, backend="nccl", timeout_s=CHILD_TIMEOUT)
    assert got == {"trees": True}


def _nccl_narrow_slot_and_broadcast_limits(_: Any, send: Any) -> Dict[str, Any]:
    """NCCL off the channel (each rank its own host): an all_gather whose frames all pass the slot narrows round 1 to
    routes.NARROW_SLOT (the summed table's too; its gate lowered for 2 ranks), objects within slot_bytes still taken
    whatever the limit there; a broadcast past 1 MiB whose round 1 brings the receivers' limits: taken, then refused
    by both ranks alike (no vote), and the group goes on."""
    import torch.distributed as dist

    from objcomm._api.resolving import Hooks
    from objcomm._state import group_facts
    from objcomm._transport import routes

    rank = dist.get_rank()
    saves, routes.cutoffs.NARROW_SAVES_LEAST = routes.cutoffs.NARROW_SAVES_LEAST, 0
    try:
        for summed in (False, True):
            group_facts(dist.group.WORLD).slots.clear()
            comm = objcomm.Communicator(
                local=False, shm=False, chunk_bytes=64 << 10, _hooks=Hooks(separate_hosts=True, summed=summed)
            )
            for _ in range(3):
                assert comm.all_gather("v" * (100_000 + rank)) == ["v" * 100_000, "v" * 100_001]
            memory = group_facts(dist.group.WORLD).slots[("all_gather", 4096)]
            assert memory.slot == routes.NARROW_SLOT, (summed, memory.last)
            small = comm.all_gather("s" * 2_000 if rank == 0 else 1, max_bytes=1_500 if rank == 1 else None)
            assert small == ["s" * 2_000, 1]
    finally:
        routes.cutoffs.NARROW_SAVES_LEAST = saves
    comm = objcomm.Communicator(local=False, shm=False, _hooks=Hooks(separate_hosts=True))
    big = "b" * 2_000_000
    assert comm.broadcast(big if rank == 0 else None, src=0) == big
    try:
        comm.broadcast(big if rank == 0 else None, src=0, max_bytes=10_000 if rank == 1 else None)
        refused = "no error"
    except objcomm.TooLargeError as exc:
        refused = str(exc)
    assert "the smallest receiver's max_bytes: 10,000" in refused, refused
    assert comm.broadcast(rank, src=1) == 1
    return {"narrow": True}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two GPUs")
def test_nccl_narrow_slot_and_a_broadcasts_limits_in_round_one():
    from objcomm._tools.launch import run_local

    got = run_local(_nccl_narrow_slot_and_broadcast_limits, None, world_size=2, backend="nccl", timeout_s=CHILD_TIMEOUT)
    assert got == {"narrow": True}
