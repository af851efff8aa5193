"""``objcomm demo``: the seed scenario — sparse per-rank dicts, gathered everywhere and merged."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from objcomm._api.functions import all_gather
from objcomm._tools.bench.config import import_modules


def demo_task(arg: Tuple[Optional[str], Sequence[str]], send: Callable[[Any], None]) -> Dict[str, Any]:
    """Each rank holds ``{rank: 1}`` if its rank is even, else ``{}``; all_gather them and merge.

    ``arg`` is ``(serializer or None, modules to import first)``.
    """
    serializer, imports = arg
    import_modules(imports)
    rank = dist.get_rank()
    held = {rank: 1} if rank % 2 == 0 else {}
    everyone: List[Dict[int, int]] = all_gather(held, serializer=serializer)
    merged: Dict[int, int] = {}
    for part in everyone:
        merged.update(part)
    return {"held": everyone, "merged": merged}


def format_demo(result: Dict[str, Any]) -> str:
    """``P 0: {0: 1}`` per rank, then ``All: {...}``."""
    lines = [f"P {rank}: {held}" for rank, held in enumerate(result["held"])]
    lines.append(f"All: {result['merged']}")
    return "\n".join(lines)
