"""Every setting in one place: defaults, environment, :func:`configure`, and how one call resolves them.

Precedence, the same for every knob (the first layer that gives a value wins):

============  ==========================================  =============================================
layer         how it is given                             scope
============  ==========================================  =============================================
1. call       ``comm.all_gather(x, max_bytes=...)``        that call (the knobs a call takes)
2. object     ``Communicator(..., max_bytes=...)``          every call through that communicator
3. process    ``objcomm.configure(max_bytes=...)``          every call in the process
4. env        ``OBJCOMM_SHM=0`` (table below)               every call in the process
5. default    :class:`Settings`' field defaults             —
============  ==========================================  =============================================

``None`` given to a call or a :class:`~objcomm.Communicator` means "not given" (the next layer
decides); given to :func:`configure` it is a value (``accept=None``: accept every serializer).
``map_location`` and ``device`` have no process-wide layer: call, then communicator, then the
transport device.

The environment is read when objcomm is imported and again by :func:`configure` and
:func:`restore`, never per collective. The variables objcomm reads:

================================  ==========================================================
variable                          effect
================================  ==========================================================
``OBJCOMM_SHM``                   ``shm``: ``0``/``false``/``no``/``off`` turn it off, ``1``/``true``/``yes``/``on`` on
``OBJCOMM_SHM_DIR``               ``shm_dir``: where shared-memory segment files live (default ``/dev/shm``)
``OBJCOMM_SHM_ZERO_COPY``         ``shm_zero_copy``: ``0``/``false``/``no``/``off`` copy what arrives through shared
                                  memory into private memory instead of mapping it, ``1``/... map it (default)
``OBJCOMM_LOCAL``                 ``local`` (same-host channel): ``0``/``false``/``no``/``off`` off, ``1``/... on
``OBJCOMM_CHECK_CALLS``           ``check_calls``: ``1``/``true``/``yes``/``on`` make every collective compare its call
                                  across the group first (a debugging aid: one small collective a call), ``0``/... off
``OBJCOMM_LOCAL_SPIN_US``         ``local_spin_us``: microseconds a rank waiting on the channel polls before it
                                  sleeps (a whole number up to 1,000,000; ``auto`` or unset: automatic; anything
                                  else raises when objcomm's settings are first used, naming the variable)
``OBJCOMM_FORCE_SEPARATE_HOSTS``  tests only: ``1`` treats every rank as on its own host (no shared memory,
                                  no same-host channel)
``OBJCOMM_TEST_RANKS_PER_HOST``   tests only: ``k`` treats each run of ``k`` consecutive global ranks as one
                                  host (``1``: as ``OBJCOMM_FORCE_SEPARATE_HOSTS=1``)
``LOCAL_RANK``                    set by torchrun; NCCL groups check the current CUDA device against it
``WORLD_SIZE``                    with ``RANK`` and ``MASTER_ADDR``, set by torchrun (or any env:// launcher):
                                  ``objcomm bench`` runs inside that launch instead of spawning ranks
``OBJCOMM_FUZZ_SCALE``            test suite only: multiplies the hostile-input fuzz counts
================================  ==========================================================

Validation lives here too: :func:`check` is the one judge of a knob's value, so
``Communicator(inline_tensor_bytes=-1)``, ``configure(inline_tensor_bytes=-1)`` and a call's
``max_bytes=0`` fail with the same message.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, FrozenSet, Hashable, Mapping, Optional, Union

from objcomm._format import compression as _compression
from objcomm._format.limits import MAX_SIZE
from serializers import SerializerLike, registry

DEFAULT_MAX_BYTES = 8 << 30  # 8 GiB
DEFAULT_SLOT_BYTES = 4096
DEFAULT_CHUNK_BYTES = 256 << 20  # 256 MiB
DEFAULT_INLINE_TENSOR_BYTES = 64 << 10  # tensors up to 64 KiB ride inside the frame
MIN_SLOT_BYTES = 128
# Second-round bytes from which same-host ranks use shared memory. Measured (`bench_shm.py --lower-threshold`,
# benchmarks/history/RESULTS-log-2026-11.md), now that its control words take the same-host channel: from
# 256 KiB up an all_gather through shared memory takes 0.34-0.91x the time, a broadcast 0.68-1.17x, and
# 1.04-1.45x at 1 MiB; from 2 MiB both gain or hold (0.34-0.99x in that run).
DEFAULT_SHM_THRESHOLD = 2 << 20


@dataclass(frozen=True)
class Settings:
    """The process-wide defaults (see the precedence in :mod:`objcomm._settings`).

    - ``serializer``: name used when a call names none (``"pickle"``).
    - ``accept``: serializer names this rank decodes; ``None`` accepts every registered one.
    - ``max_bytes``: largest frame sent or accepted (default 8 GiB); checked before allocating (a frame that fits
      the first-round slot arrives with it, and is accepted whatever the receiver's limit).
    - ``slot_bytes``: per-rank bytes of the first round; smaller frames take one collective.
    - ``chunk_bytes``: largest single transfer of the second round, rounded down to a power of two (at most
      2 GiB); caps the extra memory a call needs. A sender's slot announces its pieces and receivers take them in
      those, so ranks may differ; ``slot_bytes`` shapes round 1, so every rank of a group must use the same.
    - ``inline_tensor_bytes``: tensors up to this size are copied into the frame; larger ones
      travel as tensors with native collectives.
    - ``compression``: ``None``, ``"zstd"``, ``"lz4"`` or ``"auto"`` for payloads a rank sends.
    - ``shm``: ranks on one host move large payloads through shared memory (``OBJCOMM_SHM=0`` turns it off);
      ``shm_threshold``: from how many bytes; ``shm_dir``: where segments live (``None``: ``OBJCOMM_SHM_DIR``,
      else ``/dev/shm``). ``shm_zero_copy`` (default on): tensors and numpy arrays received through shared
      memory are views on the sender's sealed memory file, mapped copy-on-write (no copy; see
      :mod:`objcomm._samehost.sealed`); off, or where ``/proc/<pid>/fd`` of the peers cannot be opened, segments
      are files in ``shm_dir`` that receivers copy. All ranks of a group must agree on these, as on ``slot_bytes``.
    - ``local``: when every rank of a group runs on one host, the first round of collectives (the slots)
      moves through Unix-domain sockets between the processes instead of the backend, and so does that of
      send/recv once a collective has opened them (:mod:`objcomm._samehost.channel_slots`). On by default
      (``OBJCOMM_LOCAL=0`` turns it off); NCCL groups too (their slots then never touch the GPU), and the
      small votes and control words of large collectives and the answers of send/recv, and on CPU wires the
      second round of every collective and of send/recv below
      ``shm_threshold`` and 16 MiB (:mod:`objcomm._samehost.channel_rests`). All ranks of a group must agree.
    - ``local_spin_us``: microseconds a rank waiting for a message of the same-host channel polls its sockets
      before it sleeps in the kernel (a sleeping rank's wake-up costs ~50 µs here; spinning, ~3 µs). ``None``
      (automatic): 1,000. A polling rank yields the CPU between polls (``sched_yield``), which lets the peer it
      waits for, or anything else, run. At most
      once per call, so a rank waiting long spends little CPU.
    - ``check_calls``: before anything moves, every collective checks that each rank of the group called the same
      one, with the same root, reduction and the settings above that every rank must share, and raises
      :class:`~objcomm.CommunicationError` on every rank naming which ranks called what where they differ (off by
      default: it costs one small collective a call; :mod:`objcomm._api.call_checks`). Turn it on on every rank.
    """

    serializer: SerializerLike = "pickle"
    accept: Optional[FrozenSet[str]] = None
    max_bytes: int = DEFAULT_MAX_BYTES
    slot_bytes: int = DEFAULT_SLOT_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    inline_tensor_bytes: int = DEFAULT_INLINE_TENSOR_BYTES
    compression: Optional[str] = None
    shm: bool = True
    shm_threshold: int = DEFAULT_SHM_THRESHOLD
    shm_dir: Optional[str] = None
    shm_zero_copy: bool = True
    local: bool = True
    local_spin_us: Optional[int] = None
    check_calls: bool = False

    def __post_init__(self) -> None:
        for field in dataclasses.fields(Settings):
            check(field.name, getattr(self, field.name))


KNOBS = tuple(f.name for f in dataclasses.fields(Settings))


@dataclass(frozen=True)
class CallOptions(Settings):
    """Everything one call uses, resolved by :func:`resolve`: the knobs above plus placement and a test switch.

    Built only by :func:`resolve`, from layers already checked, so it does not check again.
    """

    map_location: Any = None  # a torch.device, or None: the transport device
    separate_hosts: Union[bool, int] = False  # tests: True, every rank its own host; k, hosts of k ranks

    def __post_init__(self) -> None:
        pass


# -- validation ---------------------------------------------------------------------------------
def check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_limit(name: str, value: Any) -> None:
    check_positive(name, value)
    if value >= MAX_SIZE:
        raise ValueError(f"{name} must be below 2**62 bytes (no size objcomm moves reaches that), got {value:,}")


def check_slot(value: Any) -> None:
    check_positive("slot_bytes", value)
    if value < MIN_SLOT_BYTES:
        raise ValueError(f"slot_bytes must be at least {MIN_SLOT_BYTES} (an error report must fit), got {value}")


def _check_not_negative(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


MAX_SPIN_US = 1_000_000


def _check_spin(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SPIN_US):
        raise ValueError(
            f"{name} must be a whole number of microseconds from 0 to {MAX_SPIN_US:,}, or None "
            f"(automatic), got {value!r}"
        )


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _check_hosts(name: str, value: Any) -> None:
    if not isinstance(value, int) or value < 0:
        raise TypeError(f"{name} must be True, False or a number of ranks per host, got {value!r}")


def _check_accept(name: str, value: Any) -> None:
    if value is not None and not all(isinstance(n, str) for n in value):
        raise TypeError(f"{name} must be serializer names, got {sorted(map(repr, value))}")


def _check_directory(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a directory path or None, got {value!r}")


def _check_device(name: str, value: Any) -> None:
    """A device torch knows, and for CUDA one this process has (else received tensors would fail to land there
    only once they arrived, as a decoding error)."""
    import torch  # (imported already: objcomm imports it)

    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f'{name} must be a device ("cpu", "cuda", "cuda:1", a torch.device), got {value!r}') from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{name}={value!r}, but this process has no CUDA device (torch.cuda.is_available() is False; torch "
            f'{torch.__version__}): pass {name}="cpu"'
        )


def _check_serializer(name: str, value: Any) -> None:
    registry.get(value)  # raises UnknownSerializerError naming what is registered


_CHECKS: Dict[str, Callable[[str, Any], None]] = {
    "serializer": _check_serializer,
    "accept": _check_accept,
    "max_bytes": _check_limit,
    "slot_bytes": lambda name, value: check_slot(value),
    "chunk_bytes": check_positive,
    "inline_tensor_bytes": _check_not_negative,
    "compression": lambda name, value: _compression.check(value),
    "shm": _check_bool,
    "shm_threshold": _check_not_negative,
    "shm_dir": _check_directory,
    "shm_zero_copy": _check_bool,
    "local": _check_bool,
    "local_spin_us": _check_spin,
    "check_calls": _check_bool,
    "map_location": lambda name, value: _check_device(name, value),
    "device": lambda name, value: _check_device(name, value),  # a Communicator's (not a knob: no layers)
    "separate_hosts": _check_hosts,
}


def check(name: str, value: Any) -> Any:
    """``value`` for knob ``name``, normalised (``accept`` becomes a frozenset); raise if it is not valid."""
    if name == "accept":
        value = normalize_accept(value)
    _CHECKS[name](name, value)
    return value


def given(**values: Any) -> Dict[str, Any]:
    """The checked values of the knobs that were given (not ``None``): one layer of the precedence."""
    return {name: check(name, value) for name, value in values.items() if value is not None}


# The knobs a call takes. A public function passes them on with ``**call_kwargs(locals())``, so a
# new per-call option is its name here plus the parameter in each signature that offers it, and, in the methods that
# try the express path first (all_gather, broadcast, send's _short_send, recv), its test that no option is given
# (tests/api/test_public_api.py checks that each option a method takes is in it).
CALL_KNOBS = ("serializer", "accept", "max_bytes", "map_location", "compression")


def call_kwargs(scope: Mapping[str, Any]) -> Dict[str, Any]:
    """The per-call options among a public function's arguments (its ``locals()`` on entry)."""
    return {name: scope[name] for name in CALL_KNOBS if name in scope}


def normalize_accept(accept: Optional[Collection[str]]) -> Optional[FrozenSet[str]]:
    if accept is None:
        return None
    if isinstance(accept, str):
        return frozenset([accept])
    return frozenset(accept)


# -- the environment and the process-wide layer -----------------------------------------------
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(variable: str) -> Optional[bool]:
    """``True``/``False`` for a recognised word, ``None`` when unset, empty or ``auto``; anything else raises, naming
    the variable (a typo such as ``fasle`` was once read as unset)."""
    word = os.environ.get(variable, "").strip().lower()
    if word in ("", "auto"):
        return None
    if word not in _ON and word not in _OFF:
        raise ValueError(
            f"{variable}={os.environ[variable]!r} is not a yes or a no: use one of {', '.join(_ON + _OFF)} "
            "(or leave it unset)"
        )
    return word in _ON


def _microseconds(variable: str) -> Optional[int]:
    """A whole number of microseconds; ``None`` when unset or ``auto``; anything else raises, naming the variable."""
    word = os.environ.get(variable, "").strip().lower()
    if word in ("", "auto"):
        return None
    if not word.isdigit() or int(word) > MAX_SPIN_US:
        raise ValueError(
            f"{variable}={os.environ[variable]!r}: expected a whole number of microseconds from 0 to "
            f"{MAX_SPIN_US:,}, or 'auto'"
        )
    return int(word)


@dataclass(frozen=True)
class _Environment:
    """What the environment says, read at import and by :func:`configure`."""

    knobs: Mapping[str, Any]  # the environment layer: only the knobs a variable sets
    separate_hosts: Union[bool, int]

    @staticmethod
    def read() -> _Environment:
        knobs = {
            "shm": _flag("OBJCOMM_SHM"),
            "shm_dir": os.environ.get("OBJCOMM_SHM_DIR") or None,
            "shm_zero_copy": _flag("OBJCOMM_SHM_ZERO_COPY"),
            "local": _flag("OBJCOMM_LOCAL"),
            "local_spin_us": _microseconds("OBJCOMM_LOCAL_SPIN_US"),
            "check_calls": _flag("OBJCOMM_CHECK_CALLS"),
        }
        return _Environment(
            knobs={name: value for name, value in knobs.items() if value is not None},
            separate_hosts=_ranks_per_host() or bool(_flag("OBJCOMM_FORCE_SEPARATE_HOSTS")),
        )


def _ranks_per_host() -> int:
    """``OBJCOMM_TEST_RANKS_PER_HOST`` (tests: simulated hosts of k consecutive global ranks), 0 when unset."""
    word = os.environ.get("OBJCOMM_TEST_RANKS_PER_HOST", "").strip()
    if not word:
        return 0
    if not word.isdigit() or int(word) < 1:
        raise ValueError(f"OBJCOMM_TEST_RANKS_PER_HOST={word!r}: expected a whole number of ranks per host, 1 or more")
    return int(word)


@dataclass(frozen=True)
class _State:
    """The process-wide layers, replaced atomically: the environment, what configure() set, their merge;
    and :func:`resolve`'s memo of the calls resolved against them, which goes when they are replaced."""

    environment: _Environment
    configured: Mapping[str, Any]
    settings: Settings
    resolved: Dict[Hashable, CallOptions] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def build(environment: _Environment, configured: Mapping[str, Any]) -> _State:
        return _State(environment, configured, Settings(**{**environment.knobs, **configured}))


_lock = threading.Lock()
_state = _State.build(_Environment.read(), {})


def settings_state() -> object:
    """The process-wide layers in force: a new object after every :func:`configure` or :func:`restore`,
    so that what was worked out from resolved settings can be kept while this stays the same object."""
    return _state


def settings() -> Settings:
    """The process-wide defaults in force now (environment and :func:`configure` applied)."""
    return _state.settings


def configure(**changes: Any) -> Settings:
    """Change process-wide defaults and re-read the environment; return the previous :class:`Settings`.

    A value given here beats the environment; pass the returned object to :func:`restore` to undo.

    Example::

        previous = objcomm.configure(accept=["msgpack", "json"], max_bytes=1 << 30)
        ...
        objcomm.restore(previous)
    """
    global _state
    unknown = set(changes) - set(KNOBS)
    if unknown:
        raise TypeError(f"configure() got unknown settings {sorted(unknown)}; known: {list(KNOBS)}")
    checked = {name: check(name, value) for name, value in changes.items()}
    environment = _Environment.read()
    with _lock:
        previous = _state
        _state = _State.build(environment, {**previous.configured, **checked})
    return previous.settings


def restore(previous: Settings) -> None:
    """Put back settings returned by :func:`configure` (re-reading the environment, as it does).

    Values that equal what the environment gives follow the environment again; the others stay set.
    """
    global _state
    environment = _Environment.read()
    from_environment = Settings(**environment.knobs)
    configured = {n: getattr(previous, n) for n in KNOBS if getattr(previous, n) != getattr(from_environment, n)}
    with _lock:
        _state = _State(environment, configured, previous)


# resolve() memoizes a call whose layers hold only values of these exact types (so that 1 and True,
# equal as keys, never share an entry); a memo entry is a CallOptions, which is immutable.
_MEMO_TYPES = frozenset({type(None), str, int, bool, frozenset})
_MEMO_SIZE = 64


def resolve(call: Mapping[str, Any], communicator: Mapping[str, Any]) -> CallOptions:
    """The one resolution of a call's settings: call > communicator > configure() > environment > default.

    ``call`` holds the call's keyword arguments (``None``: not given; checked here); ``communicator``
    a layer already checked by :func:`given`. A call resolved before against the same process-wide
    state (no :func:`configure` or :func:`restore` since) gets the same :class:`CallOptions` object.
    """
    state = _state
    values = (*call.values(), *communicator.values())
    types = tuple(map(type, values))
    key = (tuple(call), tuple(communicator), values, types) if _MEMO_TYPES.issuperset(types) else None
    if key is not None:
        found = state.resolved.get(key)
        if found is not None:
            # The one check that asks something outside the settings and the call: whether a compression
            # library imports. (A serializer name is looked up in the registry by every call anyway.)
            if call.get("compression") is not None:
                _compression.check(call["compression"])
            return found
    base = {name: getattr(state.settings, name) for name in KNOBS}
    separate = state.environment.separate_hosts
    options = CallOptions(**{**base, "separate_hosts": separate, **communicator, **given(**call)})
    if key is not None:
        if len(state.resolved) >= _MEMO_SIZE:
            state.resolved.clear()
        state.resolved[key] = options
    return options
