"""Types of the compiled walk (``_exact_tree_c.c``, built by setup.py where a compiler was at hand)."""

from typing import Any, Optional, Tuple

def carried_exactly(
    obj: Any, leaves: Tuple[type, ...], large: Optional[type] = ..., large_above: int = ..., /
) -> bool: ...
