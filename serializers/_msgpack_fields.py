"""What msgpack's payloads and extension fields must hold, checked before anything is built from them
(:mod:`serializers._msgpack` decodes; these only refuse, as :class:`~serializers.DecodeError`)."""

from __future__ import annotations

from typing import Any, List, Optional

from serializers._errors import DecodeError


def check_complete(msgpack: Any, raw: Any) -> None:
    """Walk ``raw`` in C without building anything: it must hold every element its headers declare.

    The unpacker allocates each array and map at its declared length before reading the elements;
    nested truncated headers would multiply that by the nesting depth (5 KB asking for 40 MB).
    A complete message declares no more elements than it has bytes.
    """
    walker = msgpack.Unpacker(None, max_buffer_size=max(memoryview(raw).nbytes, 1))
    walker.feed(raw)
    try:
        walker.skip()
    except msgpack.OutOfData:
        raise DecodeError("msgpack payload is truncated: its headers declare more than it holds") from None


def array_of(value: Any, length: Optional[int] = None) -> List[Any]:
    if type(value) is not list or (length is not None and len(value) != length):
        expected = f"an array of {length} items" if length is not None else "an array"
        raise DecodeError(f"msgpack extension holds {type(value).__name__}, expected {expected}")
    return value


def pairs_of(value: Any) -> List[Any]:
    """An OrderedDict's items as the encoder writes them: an array of [key, value] arrays. OrderedDict takes any
    2-item iterable as a pair, and a tensor given as one is iterated row by row (a helper's find: a reference to an
    empty (N, 0) tensor, a 93-byte frame, built N views before OrderedDict refused it)."""
    items = array_of(value)
    if not all(type(item) is list and len(item) == 2 for item in items):
        raise DecodeError("msgpack OrderedDict extension holds items other than [key, value] arrays")
    return items


def numbers_of(value: Any, most: int) -> List[float]:
    if type(value) is not list or len(value) > most or any(type(v) not in (int, float) for v in value):
        raise DecodeError(f"msgpack extension expected up to {most} numbers")
    return value


def short_text(raw: bytes) -> str:
    if len(raw) > 64:
        raise DecodeError("msgpack date/time text longer than 64 bytes")
    return raw.decode("ascii")
