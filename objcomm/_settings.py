"""Process-wide defaults, and how a call resolves its settings.

Each setting resolves per call, then per :class:`~objcomm.Communicator`, then process-wide
(:func:`configure`). The process-wide values live in one object replaced atomically.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Collection, FrozenSet, Optional

DEFAULT_MAX_BYTES = 8 << 30  # 8 GiB
DEFAULT_SLOT_BYTES = 4096
DEFAULT_CHUNK_BYTES = 256 << 20  # 256 MiB
DEFAULT_INLINE_TENSOR_BYTES = 64 << 10  # tensors up to 64 KiB ride inside the frame
MIN_SLOT_BYTES = 128
# Second-round bytes from which same-host ranks use shared memory. Measured: at 1 MiB the two extra
# small control collectives cost about what shared memory saves.
DEFAULT_SHM_THRESHOLD = 4 << 20


@dataclass(frozen=True)
class Settings:
    """The process-wide defaults.

    - ``serializer``: name used when a call names none (``"pickle"``).
    - ``accept``: serializer names this rank decodes; ``None`` accepts every registered one.
    - ``max_bytes``: largest frame sent or accepted (default 8 GiB); checked before allocating.
    - ``slot_bytes``: per-rank bytes of the first round; smaller frames take one collective.
    - ``chunk_bytes``: largest single transfer of the second round; caps the extra memory a call needs.
      ``slot_bytes`` and ``chunk_bytes`` shape the messages, so every rank of a group must use the same.
    - ``inline_tensor_bytes``: tensors up to this size are copied into the frame; larger ones
      travel as tensors with native collectives.
    - ``compression``: ``None``, ``"zstd"``, ``"lz4"`` or ``"auto"`` for payloads a rank sends.
    - ``shm``: ranks on one host move large payloads through shared memory (``OBJCOMM_SHM=0`` turns it off);
      ``shm_threshold``: from how many bytes; ``shm_dir``: where segments live (``None``: ``/dev/shm``).
      All ranks of a group must agree on these, as on ``slot_bytes``.
    """

    serializer: str = "pickle"
    accept: Optional[FrozenSet[str]] = None
    max_bytes: int = DEFAULT_MAX_BYTES
    slot_bytes: int = DEFAULT_SLOT_BYTES
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    inline_tensor_bytes: int = DEFAULT_INLINE_TENSOR_BYTES
    compression: Optional[str] = None
    shm: bool = True
    shm_threshold: int = DEFAULT_SHM_THRESHOLD
    shm_dir: Optional[str] = None

    def __post_init__(self) -> None:
        check_positive("max_bytes", self.max_bytes)
        check_positive("chunk_bytes", self.chunk_bytes)
        check_slot(self.slot_bytes)
        if not isinstance(self.inline_tensor_bytes, int) or self.inline_tensor_bytes < 0:
            raise ValueError(f"inline_tensor_bytes must be an int >= 0, got {self.inline_tensor_bytes!r}")
        if not isinstance(self.shm_threshold, int) or self.shm_threshold < 0:
            raise ValueError(f"shm_threshold must be an int >= 0, got {self.shm_threshold!r}")


def check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_slot(value: Any) -> None:
    check_positive("slot_bytes", value)
    if value < MIN_SLOT_BYTES:
        raise ValueError(f"slot_bytes must be at least {MIN_SLOT_BYTES} (an error report must fit), got {value}")


def normalize_accept(accept: Optional[Collection[str]]) -> Optional[FrozenSet[str]]:
    if accept is None:
        return None
    if isinstance(accept, str):
        return frozenset([accept])
    return frozenset(accept)


_lock = threading.Lock()
_current = Settings()


def settings() -> Settings:
    """The process-wide defaults in force now."""
    return _current


def configure(**changes: Any) -> Settings:
    """Change process-wide defaults; return the previous :class:`Settings` (pass it to :func:`restore`).

    Example::

        previous = objcomm.configure(accept=["msgpack", "json"], max_bytes=1 << 30)
        ...
        objcomm.restore(previous)
    """
    global _current
    known = [f.name for f in dataclasses.fields(Settings)]
    unknown = set(changes) - set(known)
    if unknown:
        raise TypeError(f"configure() got unknown settings {sorted(unknown)}; known: {known}")
    if "accept" in changes:
        changes["accept"] = normalize_accept(changes["accept"])
    with _lock:
        previous = _current
        _current = dataclasses.replace(_current, **changes)
    return previous


def restore(previous: Settings) -> None:
    """Put back settings returned by :func:`configure`."""
    global _current
    with _lock:
        _current = previous
