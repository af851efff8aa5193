"""A one-line progress bar on stderr, drawn only on a terminal so CI logs stay clean."""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO

_WIDTH = 28
_MIN_INTERVAL_S = 0.1


class ProgressBar:
    """``update(done, total, label)`` redraws ``[#####.....]  12/40  label  0:07`` in place.

    Disabled (every call a no-op) unless ``stream`` is a TTY or ``enabled=True`` is given.
    """

    def __init__(self, stream: Optional[TextIO] = None, *, enabled: Optional[bool] = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self._start = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def update(self, done: int, total: int, label: str) -> None:
        """Draw the bar (at most ten times a second, and always for the last step)."""
        now = time.monotonic()
        if not self.enabled or (now - self._last < _MIN_INTERVAL_S and done < total):
            return
        self._last = now
        filled = _WIDTH * done // max(total, 1)
        elapsed = int(now - self._start)
        bar = "#" * filled + "." * (_WIDTH - filled)
        line = f"[{bar}] {done:>3}/{total}  {elapsed // 60}:{elapsed % 60:02d}  {label}"
        self.stream.write("\r\x1b[2K" + line[:160])
        self.stream.flush()
        self._drawn = True

    def message(self, message: Any) -> None:
        """Take a ``("progress", done, total, label)`` message as the ranks send it."""
        if isinstance(message, tuple) and len(message) == 4 and message[0] == "progress":
            self.update(message[1], message[2], message[3])

    def close(self) -> None:
        """Erase the bar so the table starts on a clean line."""
        if self._drawn:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self._drawn = False
