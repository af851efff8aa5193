"""``python -m objcomm`` and the ``objcomm`` command: ``bench``, ``serializers`` and ``demo``."""

from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``objcomm`` command line with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    from objcomm._tools.cli import run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
