"""The zstd codec (spec §6). Bytes in, bytes out; never opens files."""

from __future__ import annotations

import threading
from typing import Any

from ..errors import CodecError

_zstd: Any = None

# The decompression cap (docs/cli.md): a frame may decode to at most MAX_RATIO times its own size (plus a
# small floor, so an all-zero block still compresses) and never past MAX_DECODED_BYTES. Checked from the
# header's sizes before any payload-sized allocation: a 36 KB frame cannot make a reader allocate 1 GiB.
MAX_RATIO = 256
RATIO_FLOOR_BYTES = 1 << 20
MAX_DECODED_BYTES = 1 << 32


def decoded_limit(compressed_bytes: int) -> int:
    """The most bytes a frame of ``compressed_bytes`` may decode to (the ratio cap and the size cap)."""
    return min(MAX_DECODED_BYTES, max(RATIO_FLOOR_BYTES, MAX_RATIO * compressed_bytes))


def check_bounds(compressed_bytes: int, decoded_bytes: int) -> None:
    """Raise CodecError if ``decoded_bytes`` is over the cap for a frame of ``compressed_bytes``."""
    if decoded_bytes > decoded_limit(compressed_bytes):
        raise CodecError(f"a zstd frame of {compressed_bytes} bytes declares {decoded_bytes} decoded bytes: over "
                         f"the decompression cap (ratio {MAX_RATIO}, at most {MAX_DECODED_BYTES} bytes)")


def _mod() -> Any:
    global _zstd
    if _zstd is None:
        try:
            import zstandard
        except ImportError as e:  # pragma: no cover - a hard dependency, kept lazy for import time
            raise ImportError("kvformat compression needs zstandard: pip install zstandard") from e
        _zstd = zstandard
    return _zstd


_LOCAL = threading.local()


def _decompressor(z: Any) -> Any:
    # One per thread (a zstd context is not safe to share between threads): building one per frame cost 90 us,
    # a third of the decode of a 150 KB plane (docs/benchmarks/codec.md).
    d = getattr(_LOCAL, "dctx", None)
    if d is None:
        d = _LOCAL.dctx = z.ZstdDecompressor()
    return d


def compress(payload: Any, level: int = 3) -> bytes:
    """One zstd frame with the content size in its header (§6)."""
    z = _mod()
    frame: bytes = z.ZstdCompressor(level=level, write_content_size=True, write_checksum=False).compress(payload)
    return frame


def decompress_into(frame: Any, out: memoryview, *, bounded: bool = True) -> None:
    """Decode ``frame`` into ``out``, which must be exactly the decoded size.

    Refuses a frame whose declared content size differs from ``len(out)`` before decoding,
    so a frame lying about its size can never write past ``out`` or allocate more. ``bounded=False``:
    the caller has applied the decompression cap to the whole data section this frame is a part of
    (a plane-coded file, §6.2, whose frames need not each meet it).
    """
    if bounded:
        check_bounds(len(frame), len(out))
    z = _mod()
    try:
        declared = z.frame_content_size(frame)
    except z.ZstdError as e:
        raise CodecError(f"not a zstd frame: {e}") from None
    if declared != len(out):
        raise CodecError(f"zstd frame declares {declared} decoded bytes, the layout needs {len(out)}")  # F-6.3
    try:
        # Closed on every exit, an error included, so the thread's context is free for its next frame.
        with _decompressor(z).stream_reader(frame, read_across_frames=False, closefd=False) as reader:
            got = 0
            while got < len(out):
                n = reader.readinto(out[got:])
                if n == 0:
                    break
                got += n
            extra = reader.read(1)
    except z.ZstdError as e:
        raise CodecError(f"zstd frame does not decode: {e}") from None
    if got != len(out) or extra:
        raise CodecError(f"zstd frame decoded to {got}{'+' if extra else ''} bytes, expected {len(out)}")  # F-6.4
