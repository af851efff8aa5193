"""What the rank pool's workers print, and the failure reports that quote it.

Each worker's stdout/stderr (C++ output from torch/gloo included) goes to its own append-mode
file that is unlinked at once, so nothing is left on disk even after SIGKILL. The pool reads
it with ``pread`` (the file offset is shared with the worker) and quotes the part written
during a failed call, or during a failed startup, in the exception message.
"""

from __future__ import annotations

import fcntl
import os
import signal
import tempfile
from contextlib import suppress
from typing import Optional, Sequence

__all__ = ["RankLogs"]

_OUTPUT_TAIL_CHARS = 6000


class RankLogs:
    """One captured output per rank (or none when ``capture`` is off: workers write to the terminal)."""

    def __init__(self, world_size: int, capture: bool) -> None:
        self.fds: list[Optional[int]] = [_anonymous_log() if capture else None for _ in range(world_size)]

    def size(self, rank: int) -> int:
        """How much rank ``rank`` wrote so far (where the output of the next call starts)."""
        fd = self.fds[rank]
        try:
            return os.fstat(fd).st_size if fd is not None else 0
        except OSError:
            return 0

    def read(self, rank: int, offset: int = 0) -> str:
        """What rank ``rank`` wrote from ``offset`` on (empty if not captured or closed)."""
        fd = self.fds[rank] if rank < len(self.fds) else None
        chunks = []
        with suppress(OSError):
            while fd is not None and (chunk := os.pread(fd, 1 << 20, offset)):
                chunks.append(chunk)
                offset += len(chunk)
        return b"".join(chunks).decode("utf-8", "replace")

    def close(self) -> None:
        fds, self.fds = self.fds, [None] * len(self.fds)
        for fd in fds:
            if fd is not None:
                with suppress(OSError):
                    os.close(fd)

    def call_report(
        self, headline: str, failures: dict[int, str], pending: Sequence[int], offsets: Sequence[int]
    ) -> str:
        """``headline``, each failing rank's traceback, each silent rank, and their output since ``offsets``."""
        lines = [headline, ""]
        # Root causes (ranks that raised) first, then the ranks that never answered.
        for rank in sorted(range(len(self.fds)), key=lambda r: (r not in failures, r)):
            if rank in failures:
                lines.append(f"--- rank {rank} ---")
                lines.append(_indent(failures[rank]).rstrip("\n"))
            elif rank in pending:
                lines.append(f"--- rank {rank}: no answer ---")
            else:
                continue
            out = self.read(rank, offsets[rank])
            if out.strip():
                lines.append(f"--- rank {rank} output during this call (includes its stack dump if it hung) ---")
                lines.append(_indent(_tail(out)).rstrip("\n"))
            lines.append("")
        return "\n".join(lines)

    def startup_report(
        self, headline: str, errors: dict[int, str], waiting: Sequence[int], exitcodes: Sequence[Optional[int]]
    ) -> str:
        """``headline``, then the error, output and exit code of every rank that failed or never got ready."""
        lines = [headline]
        for rank, exitcode in enumerate(exitcodes):
            parts = []
            if rank in errors:
                parts.append(f"--- rank {rank} error ---\n" + _indent(errors[rank]))
            out = self.read(rank)
            if out.strip() and (rank in errors or rank in waiting):
                parts.append(f"--- rank {rank} output ---\n" + _indent(_tail(out)))
            if parts or exitcode not in (None, -signal.SIGKILL):
                lines.append(f"rank {rank}: exitcode {exitcode}")
                lines.extend(parts)
        return "\n".join(lines)


def _anonymous_log() -> int:
    """An append-mode fd on an already-unlinked temp file: nothing is left on disk even after SIGKILL."""
    fd, path = tempfile.mkstemp(prefix="rankpool-", suffix=".log")
    os.unlink(path)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    return fd


def _tail(text: str, limit: int = _OUTPUT_TAIL_CHARS) -> str:
    return text if len(text) <= limit else f"[... {len(text) - limit} chars cut ...]\n" + text[-limit:]


def _indent(text: str, prefix: str = "    ") -> str:
    return "".join(prefix + line for line in text.rstrip("\n").splitlines(True)) + "\n"
