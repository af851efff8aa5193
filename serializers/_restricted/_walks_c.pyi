"""Types of the compiled walks (``_walks_c.c``, built by setup.py where a compiler was at hand)."""

def is_plain(raw: bytes, /) -> bool: ...
def full_walk(raw: bytes, noted: list[int] | None = ..., /) -> bool | None: ...
def configure(
    arguments: bytes,
    effects: bytes,
    pushed: bytes,
    max_nesting: int,
    hash_work_per_byte: int,
    compared_bytes: int,
    container_work: int = ...,
    /,
) -> None: ...
