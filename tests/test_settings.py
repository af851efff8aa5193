"""One precedence for every knob (call > Communicator > configure() > environment > default), one validation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from _ranks import get_pool

import objcomm
import serializers
from objcomm import _settings
from objcomm._api.resolving import Hooks

pytestmark = pytest.mark.timeout(60)

VARIABLES = (
    "OBJCOMM_SHM",
    "OBJCOMM_SHM_DIR",
    "OBJCOMM_SHM_ZERO_COPY",
    "OBJCOMM_LOCAL",
    "OBJCOMM_LOCAL_SPIN_US",
    "OBJCOMM_CHECK_CALLS",
    "OBJCOMM_FORCE_SEPARATE_HOSTS",
    "OBJCOMM_TEST_RANKS_PER_HOST",
)
NOT_GIVEN: Any = object()

# knob: (default, (variable, text, value) or None, configure(), Communicator(), a call — NOT_GIVEN where none)
LAYERS = {
    "serializer": ("pickle", None, "msgpack", "json", "cloudpickle"),
    "accept": (None, None, frozenset({"json"}), frozenset({"msgpack"}), frozenset({"pickle"})),
    "max_bytes": (8 << 30, None, 1 << 20, 1 << 21, 1 << 22),
    "slot_bytes": (4096, None, 256, 512, NOT_GIVEN),
    "chunk_bytes": (256 << 20, None, 4096, 8192, NOT_GIVEN),
    "inline_tensor_bytes": (64 << 10, None, 0, 10, NOT_GIVEN),
    "compression": (None, None, "zstd", "lz4", "auto"),
    "shm": (True, ("OBJCOMM_SHM", "0", False), True, False, NOT_GIVEN),
    "shm_threshold": (2 << 20, None, 1, 2, NOT_GIVEN),
    "shm_dir": (None, ("OBJCOMM_SHM_DIR", "/from-env", "/from-env"), "/configured", "/communicator", NOT_GIVEN),
    "shm_zero_copy": (True, ("OBJCOMM_SHM_ZERO_COPY", "0", False), True, False, NOT_GIVEN),
    "local": (True, ("OBJCOMM_LOCAL", "0", False), True, False, NOT_GIVEN),
    "local_spin_us": (None, ("OBJCOMM_LOCAL_SPIN_US", "7", 7), 5, 0, NOT_GIVEN),
    "check_calls": (False, ("OBJCOMM_CHECK_CALLS", "1", True), False, True, NOT_GIVEN),
}


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No objcomm variables and nothing configured; everything put back afterwards."""
    previous = objcomm.configure()
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    objcomm.restore(objcomm.Settings())
    try:
        yield monkeypatch
    finally:
        monkeypatch.undo()
        objcomm.restore(previous)


def _resolved(comm: objcomm.Communicator, **call: Any) -> _settings.CallOptions:
    return comm._call(call).usable().options  # (a call whose settings fail carries the failure: raised here)


def test_every_knob_has_a_row():
    assert sorted(LAYERS) == sorted(_settings.KNOBS)
    assert set(_settings.CALL_KNOBS) - {"map_location"} == {k for k, row in LAYERS.items() if row[4] is not NOT_GIVEN}


@pytest.mark.parametrize("knob", sorted(LAYERS))
def test_each_layer_overrides_the_one_before(clean, knob):
    default, env, configured, communicator, call = LAYERS[knob]
    assert getattr(_resolved(objcomm.Communicator()), knob) == default
    if env is not None:
        variable, text, value = env
        clean.setenv(variable, text)
        assert getattr(_resolved(objcomm.Communicator()), knob) == default  # not read per call
        objcomm.configure()
        assert getattr(objcomm.settings(), knob) == value
        assert getattr(_resolved(objcomm.Communicator()), knob) == value
    objcomm.configure(**{knob: configured})
    assert getattr(_resolved(objcomm.Communicator()), knob) == configured
    objcomm.configure()  # re-reading the environment keeps what configure() set
    assert getattr(_resolved(objcomm.Communicator()), knob) == configured
    comm = objcomm.Communicator(**{knob: communicator})
    assert getattr(_resolved(comm), knob) == communicator
    assert getattr(_resolved(comm, **{knob: None}), knob) == communicator  # None: not given
    if call is not NOT_GIVEN:
        assert getattr(_resolved(comm, **{knob: call}), knob) == call


def test_map_location_is_call_then_communicator(clean):
    assert _resolved(objcomm.Communicator()).map_location is None
    comm = objcomm.Communicator(map_location="cpu")
    assert _resolved(comm).map_location == "cpu"
    assert _resolved(comm, map_location="meta").map_location == "meta"


def test_separate_hosts_is_a_private_switch(clean):
    assert "separate_hosts" not in objcomm.Communicator.__init__.__code__.co_varnames
    assert _resolved(objcomm.Communicator()).separate_hosts is False
    clean.setenv("OBJCOMM_FORCE_SEPARATE_HOSTS", "1")
    objcomm.configure()
    assert _resolved(objcomm.Communicator()).separate_hosts is True
    comm = objcomm.Communicator(_hooks=Hooks(separate_hosts=False))
    assert _resolved(comm).separate_hosts is False


def test_restore_lets_the_environment_speak_again(clean):
    previous = objcomm.configure(shm=True)
    objcomm.restore(previous)
    clean.setenv("OBJCOMM_SHM", "off")
    objcomm.configure()
    assert objcomm.settings().shm is False


BAD = [
    ("max_bytes", 0, ValueError, "max_bytes must be a positive int, got 0"),
    ("max_bytes", 1 << 64, ValueError, r"max_bytes must be below 2\*\*62 bytes"),  # slots carry it in 64 bits
    ("slot_bytes", 8, ValueError, "slot_bytes must be at least 128"),
    ("chunk_bytes", -1, ValueError, "chunk_bytes must be a positive int, got -1"),
    ("inline_tensor_bytes", -1, ValueError, r"inline_tensor_bytes must be an int >= 0, got -1"),
    ("shm_threshold", -1, ValueError, r"shm_threshold must be an int >= 0, got -1"),
    ("compression", "gzip", ValueError, "compression must be one of"),
    ("serializer", "yaml", objcomm.UnknownSerializerError, "yaml"),
    ("shm", "yes", TypeError, "shm must be True or False"),
    ("shm_dir", 3, TypeError, "shm_dir must be a directory path"),
    ("shm_zero_copy", "yes", TypeError, "shm_zero_copy must be True or False"),
    ("accept", [1], TypeError, "accept must be serializer names"),
    ("local_spin_us", -1, ValueError, "local_spin_us must be a whole number of microseconds from 0 to 1,000,000"),
    ("local_spin_us", 0.5, ValueError, "local_spin_us must be a whole number of microseconds"),
]


@pytest.mark.parametrize("knob, value, error, message", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_one_validation_for_every_layer(clean, knob, value, error, message):
    with pytest.raises(error, match=message):
        objcomm.configure(**{knob: value})
    with pytest.raises(error, match=message):
        objcomm.Communicator(**{knob: value})
    with pytest.raises(error, match=message):
        objcomm.Settings(**{knob: _settings.normalize_accept(value) if knob == "accept" else value})
    if knob in _settings.CALL_KNOBS:
        with pytest.raises(error, match=message):
            objcomm.Communicator().all_gather("x", **{knob: value})
    assert objcomm.settings() == objcomm.Settings()  # a refused configure() changes nothing


@pytest.mark.parametrize("value", ["nodevice", "cuda"])
def test_map_location_is_checked_where_it_is_given(clean, value):
    if value == "cuda" and torch.cuda.is_available():
        pytest.skip("this process has CUDA: map_location='cuda' is valid here")
    message = "map_location must be a device" if value == "nodevice" else "this process has no CUDA device"
    with pytest.raises(ValueError, match=message):
        objcomm.Communicator(map_location=value)
    with pytest.raises(ValueError, match=message):
        objcomm.Communicator().all_gather("x", map_location=value)
    with pytest.raises(ValueError, match=message.replace("map_location", "device")):
        objcomm.Communicator(device=value)  # (before: at its first call, where one rank's failure shifted the others)


def test_a_yes_or_no_variable_with_another_word_is_an_error(clean):
    clean.setenv("OBJCOMM_LOCAL", "fasle")
    with pytest.raises(ValueError, match="OBJCOMM_LOCAL='fasle' is not a yes or a no: use one of 1, true"):
        objcomm.configure()
    for word, local in (("OFF", False), (" yes ", True), ("", True), ("auto", True)):
        clean.setenv("OBJCOMM_LOCAL", word)
        objcomm.configure()
        assert objcomm.settings().local is local, word


def test_a_repeated_call_sees_configure_and_restore(clean):
    comm = objcomm.Communicator(serializer="json")
    for _ in range(2):  # the second call is answered from resolve()'s memo
        assert _resolved(comm, compression="lz4").max_bytes == 8 << 30
        assert _resolved(objcomm.Communicator(), serializer="msgpack").max_bytes == 8 << 30
    previous = objcomm.configure(max_bytes=1 << 20)
    assert _resolved(comm, compression="lz4").max_bytes == 1 << 20
    assert _resolved(objcomm.Communicator(), serializer="msgpack").max_bytes == 1 << 20
    objcomm.restore(previous)
    assert _resolved(comm, compression="lz4").max_bytes == 8 << 30
    assert _resolved(objcomm.Communicator(), serializer="msgpack").max_bytes == 8 << 30


def test_a_repeated_call_sees_the_environment_once_configure_reads_it(clean):
    assert [_resolved(objcomm.Communicator()).shm for _ in range(2)] == [True, True]
    clean.setenv("OBJCOMM_SHM", "0")
    assert _resolved(objcomm.Communicator()).shm is True  # not read per call, memoized or not
    objcomm.configure()
    assert _resolved(objcomm.Communicator()).shm is False


def test_a_repeated_call_is_checked_again(clean):
    comm = objcomm.Communicator()
    assert [_resolved(comm, max_bytes=1).max_bytes for _ in range(2)] == [1, 1]
    with pytest.raises(ValueError, match="max_bytes must be a positive int, got True"):
        _resolved(comm, max_bytes=True)  # True == 1 as a key: it must not be served what 1 resolved to
    serializers.register("memo-probe", dumps=lambda obj: b"", loads=lambda data: None)
    try:
        assert [_resolved(comm, serializer="memo-probe").serializer for _ in range(2)] == ["memo-probe"] * 2
    finally:
        serializers.unregister("memo-probe")
    with pytest.raises(objcomm.UnknownSerializerError, match="memo-probe"):
        _resolved(comm, serializer="memo-probe")


def test_a_repeated_call_uses_the_serializer_registered_now(clean):
    comm = objcomm.Communicator()  # it keeps each call's serializer object until the registry changes
    serializers.register("memo-probe", dumps=lambda obj: b"1", loads=lambda data: bytes(data))
    try:
        assert [comm.broadcast("x", serializer="memo-probe") for _ in range(2)] == [b"1", b"1"]
        serializers.register("memo-probe", dumps=lambda obj: b"2", loads=lambda data: bytes(data), replace=True)
        assert comm.broadcast("x", serializer="memo-probe") == b"2"
    finally:
        serializers.unregister("memo-probe")


def test_a_registration_during_a_lookup_is_not_hidden_by_the_memo(clean, monkeypatch):
    """Another thread registers the name again while a call looks it up: the entry kept is stale, not the
    old serializer filed under the new registry version (later calls would keep the old one)."""
    from serializers import registry

    comm = objcomm.Communicator()
    serializers.register("memo-race", dumps=lambda obj: b"1", loads=lambda data: bytes(data))
    real = registry.guarded

    def then_another_thread_registers(name: Any) -> Any:
        found = real(name)
        if name == "memo-race":
            monkeypatch.setattr(registry, "guarded", real)  # once
            serializers.register("memo-race", dumps=lambda obj: b"2", loads=lambda data: bytes(data), replace=True)
        return found

    monkeypatch.setattr(registry, "guarded", then_another_thread_registers)
    try:
        assert comm.broadcast("x", serializer="memo-race") == b"1"  # looked up before the registration
        assert [comm.broadcast("x", serializer="memo-race") for _ in range(2)] == [b"2", b"2"]
    finally:
        serializers.unregister("memo-race")


def _configure_between_calls() -> list:
    """Calls on a live group before, during and after a configure() that makes them fail."""
    obj = "x" * 100
    assert [objcomm.all_gather(obj) for _ in range(2)] == [[obj] * objcomm.Communicator()._call({}).wire.size] * 2
    previous = objcomm.configure(max_bytes=64)
    try:
        with pytest.raises(objcomm.TooLargeError, match="above max_bytes=64"):
            objcomm.all_gather(obj)
    finally:
        objcomm.restore(previous)
    return objcomm.all_gather(obj)


@pytest.mark.parametrize("world", [1, 2])
def test_a_live_group_sees_configure_between_calls(world):
    assert get_pool(world).run(_configure_between_calls) == [["x" * 100] * world] * world


def _a_group_is_forgotten_after_calls() -> bool:
    """What a call on a group keeps between calls (its wire, less the group) does not keep the group alive."""
    import gc
    import weakref

    import torch.distributed as dist

    from objcomm import _state

    group = dist.new_group(backend="gloo")
    for _ in range(2):
        assert objcomm.all_gather("x", group=group) == ["x"] * dist.get_world_size()
    assert len(_state.group_facts(group).wires) == 1
    alive = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return alive() is None


def test_a_group_is_forgotten_after_calls():
    assert get_pool(2).run(_a_group_is_forgotten_after_calls) == [True, True]


def test_the_environment_is_read_at_import():
    env = {
        **os.environ,
        "OBJCOMM_SHM": "0",
        "OBJCOMM_SHM_DIR": "/from-env",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    code = "import objcomm; s = objcomm.settings(); print(s.shm, s.shm_dir)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "/from-env"]


def test_a_bad_spin_in_the_environment_says_which_variable(clean):
    clean.setenv("OBJCOMM_LOCAL_SPIN_US", "fast")
    with pytest.raises(ValueError, match=r"OBJCOMM_LOCAL_SPIN_US='fast': expected a whole number of microseconds"):
        objcomm.configure()
    clean.setenv("OBJCOMM_LOCAL_SPIN_US", "2000000")
    with pytest.raises(ValueError, match=r"OBJCOMM_LOCAL_SPIN_US='2000000': expected .* from 0 to 1,000,000"):
        objcomm.configure()
    clean.setenv("OBJCOMM_LOCAL_SPIN_US", "auto")
    objcomm.configure()
    assert objcomm.settings().local_spin_us is None


def test_every_variable_is_documented():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for variable in VARIABLES:
        assert variable in (_settings.__doc__ or ""), variable
        assert variable in readme, variable
