"""Optional payload compression: ``"zstd"``, ``"lz4"`` or ``"auto"``; recorded in the frame.

``"auto"`` compresses a sample of the payload first and compresses the whole only when the
sample shrinks by at least 10 % — the way Dask's protocol decides (``maybe_compress``).
The libraries are optional: ``pip install zstandard`` / ``lz4`` (the extras ``.[zstd]`` / ``.[lz4]`` from a clone).
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Optional

from objcomm._errors import DecodeError, ObjcommError
from objcomm._format.limits import too_large
from serializers._errors import PUBLIC_MODULE

NONE, ZSTD, LZ4 = 0, 1, 2
CODES: Dict[str, int] = {"zstd": ZSTD, "lz4": LZ4}
NAMES = {code: name for name, code in CODES.items()}
_MODULES = {ZSTD: "zstandard", LZ4: "lz4.frame"}
AUTO_MIN_BYTES = 4096
AUTO_SAMPLE_BYTES = 64 << 10
AUTO_MIN_GAIN = 0.9


class MissingDependencyError(ObjcommError, ImportError):
    """An optional library (a compressor) is not installed."""

    __module__ = PUBLIC_MODULE


def _module(code: int) -> Any:
    try:
        return importlib.import_module(_MODULES[code])
    except ImportError:
        name, package = NAMES[code], _MODULES[code].split(".")[0]
        raise MissingDependencyError(
            f"compression={name!r} needs the {package} package: pip install {package}"
        ) from None


def check(setting: Optional[str]) -> None:
    """Validate a ``compression=`` setting (and that its library is importable)."""
    if setting in (None, "none", "auto"):
        return
    if setting not in CODES:
        raise ValueError(f"compression must be one of None, 'zstd', 'lz4', 'auto'; got {setting!r}")
    _module(CODES[setting])


def _compress(code: int, data: Any) -> bytes:
    if code == ZSTD:
        return _module(ZSTD).ZstdCompressor(level=1).compress(data)  # type: ignore[no-any-return]  # module as Any
    return _module(LZ4).compress(data)  # type: ignore[no-any-return]  # _module() imports it: Any


def _auto_code() -> Optional[int]:
    for code in (LZ4, ZSTD):
        try:
            _module(code)
            return code
        except MissingDependencyError:
            continue
    return None


def compress(setting: Optional[str], payload: memoryview) -> tuple[int, Any]:
    """``(code, data)``: the payload compressed as ``setting`` asks, or ``(NONE, payload)``."""
    if setting in (None, "none"):
        return NONE, payload
    if setting != "auto":
        return CODES[setting], _compress(CODES[setting], payload)
    code = _auto_code()
    if code is None or payload.nbytes < AUTO_MIN_BYTES:
        return NONE, payload
    half = AUTO_SAMPLE_BYTES // 2
    sample = payload if payload.nbytes <= AUTO_SAMPLE_BYTES else bytes(payload[:half]) + bytes(payload[-half:])
    if len(_compress(code, sample)) > AUTO_MIN_GAIN * len(sample):
        return NONE, payload
    compressed = _compress(code, payload)
    return (code, compressed) if len(compressed) < payload.nbytes else (NONE, payload)


def decompress(code: int, data: memoryview, raw_len: int, max_bytes: int) -> Any:
    """Decompress to exactly ``raw_len`` bytes, refusing more than ``max_bytes`` before allocating.

    Streaming, with the output capped at ``raw_len + 1``: a payload whose own header claims more
    (zstd's content size, lz4's) never gets a larger buffer; longer or shorter output is a DecodeError.
    """
    if code not in NAMES:
        raise DecodeError(f"frame uses unknown compression code {code}")
    if raw_len > max_bytes:
        raise too_large(
            f"a compressed payload expands to {raw_len:,} bytes, above this rank's max_bytes={max_bytes:,}",
            outcome="it was not decompressed",
            where="here",
        )
    module = _module(code)
    try:
        out = _zstd_exact(module, data, raw_len) if code == ZSTD else _lz4_exact(module, data, raw_len)
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"{NAMES[code]} could not decompress the payload: {exc}") from exc
    if len(out) != raw_len:
        raise DecodeError(f"{NAMES[code]} payload expanded to {len(out):,} bytes, the frame declared {raw_len:,}")
    return out


# a zstd payload's buffer to begin with (then doubled as output comes, up to raw_len + 1): this many times its
# compressed size, which holds the usual ratios at once, and at least FIRST_BUFFER
FIRST_RATIO, FIRST_BUFFER = 64, 1 << 20


def _zstd_exact(zstandard: Any, data: memoryview, raw_len: int) -> Any:
    """Read at most ``raw_len + 1`` bytes into one buffer; the window is capped near ``raw_len`` too. The buffer
    doubles as output comes, from :data:`FIRST_RATIO` times the payload: a frame that declares gigabytes but
    expands to little costs little (an attacker's find: a 57-byte frame declaring 2 GiB had its 2 GiB zeroed
    first)."""
    window = 1 << min(31, max(10, (raw_len - 1).bit_length()))
    reader = zstandard.ZstdDecompressor(max_window_size=window).stream_reader(data, read_across_frames=True)
    out = bytearray(min(raw_len + 1, max(FIRST_BUFFER, FIRST_RATIO * data.nbytes)))
    view, filled = memoryview(out), 0
    while filled <= raw_len:
        if filled == len(out):  # full, and less than raw_len + 1 (else the loop ended): twice as long
            view.release()
            out += bytes(min(len(out), raw_len + 1 - len(out)))
            view = memoryview(out)
        got = reader.readinto(view[filled:])
        if not got:
            break
        filled += got
    view.release()
    del out[filled:]
    return out


def _lz4_exact(lz4_frame: Any, data: memoryview, raw_len: int) -> Any:
    """Ask for at most what is still missing plus one byte per call, until the frame ends."""
    decompressor = lz4_frame.LZ4FrameDecompressor()
    out = decompressor.decompress(data, max_length=raw_len + 1)
    while len(out) <= raw_len and not decompressor.eof and not decompressor.needs_input:
        out = bytes(out) + decompressor.decompress(b"", max_length=raw_len + 1 - len(out))
    if not decompressor.eof and len(out) <= raw_len:
        raise DecodeError(f"lz4 payload is truncated: it ended after {len(out):,} of {raw_len:,} bytes")
    if decompressor.unused_data:
        raise DecodeError(f"lz4 payload has {len(decompressor.unused_data):,} bytes after its frame")
    return out
