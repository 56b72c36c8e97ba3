"""The byte-plane codec (spec §6.2, ``kvf.codec = "planes"``). Bytes in, bytes out; never opens files.

Why planes: a bf16 value's high byte (sign and 7 exponent bits) takes a few distinct values in a KV latent, its low
byte (the exponent's last bit and the 7 mantissa bits) is close to random. Coded as one stream, zstd spends its time
on the random half and its Huffman tables on a mixture of both; split, the high plane is coded alone (about 3 bits a
byte on engine KV) and the low plane is stored as it is, so decoding is one zstd frame of half the payload and a copy.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any, Sequence

import numpy as np

from . import _codec
from ._consts import DTYPE_SIZES, MAX_PLANES, PLANE_METHODS
from ..errors import CodecError, SchemaError

# A plane is stored as a zstd frame only when the frame saves at least 1/16 of it: a near-random plane that
# compresses by 1 % would cost a whole entropy decode on every read for almost no bytes (docs/benchmarks/codec.md).
KEEP_FRAME_BELOW = 15 / 16
_LITTLE = sys.byteorder == "little"


def width_for(layer_dtypes: Sequence[str]) -> int:
    """The plane count a writer uses for a layout: the layers' item size when they all share one, else 1."""
    sizes = {DTYPE_SIZES[d] for d in layer_dtypes}
    w = sizes.pop() if len(sizes) == 1 else 1
    return w if w <= MAX_PLANES else 1


def compress(payload: memoryview, width: int, level: int = 1) -> tuple[list[tuple[str, int]], bytes]:
    """Split ``payload`` into ``width`` byte planes and code each: ``(plane table, data section)`` (§6.2)."""
    if not 1 <= width <= MAX_PLANES or len(payload) % width:
        raise SchemaError("kvf.plane_table", f"{width} planes do not divide a payload of {len(payload)} bytes")
    arr = np.frombuffer(payload, dtype=np.uint8)
    table: list[tuple[str, int]] = []
    parts: list[bytes] = []
    for p in range(width):
        plane = np.ascontiguousarray(arr[p::width]) if width > 1 else arr
        frame = _codec.compress(plane, level)
        if len(frame) <= KEEP_FRAME_BELOW * len(plane):
            table.append(("zstd", len(frame)))
            parts.append(frame)
        else:
            table.append(("raw", len(plane)))
            parts.append(plane.tobytes())
    return table, b"".join(parts)


def table_json(table: Sequence[tuple[str, int]]) -> str:
    """``kvf.plane_table`` as written: JSON text of ``[[method, stored bytes], ...]``, no spaces."""
    return json.dumps([[m, n] for m, n in table], separators=(",", ":"))


def parse_table(text: Any, payload_bytes: int, data_bytes: int) -> tuple[tuple[str, int], ...]:
    """Check ``kvf.plane_table`` against the layout and the data section (F-6.5) and return it."""
    try:
        raw = json.loads(text) if isinstance(text, str) and len(text) <= 4096 else None
    except (ValueError, RecursionError):
        raw = None
    if (not isinstance(raw, list) or not 1 <= len(raw) <= MAX_PLANES
            or not all(isinstance(x, list) and len(x) == 2 and x[0] in PLANE_METHODS and type(x[1]) is int
                       and x[1] >= 0 for x in raw)):
        raise SchemaError("kvf.plane_table", f"expected a list of 1..{MAX_PLANES} [method, stored bytes] pairs, method "
                                        f"one of {PLANE_METHODS}")  # F-6.5
    width = len(raw)
    if payload_bytes % width:
        raise SchemaError("kvf.plane_table",
                          f"{width} planes do not divide the payload of {payload_bytes} bytes")  # F-6.5
    plane = payload_bytes // width
    for i, (method, n) in enumerate(raw):
        if method == "raw" and n != plane:
            raise SchemaError("kvf.plane_table", f"raw plane {i} stores {n} bytes, a plane is {plane}")  # F-6.5
    if sum(n for _, n in raw) != data_bytes:
        raise SchemaError("kvf.plane_table", f"the planes store {sum(n for _, n in raw)} bytes, the data section "
                                        f"holds {data_bytes}")  # F-6.5
    return tuple((m, n) for m, n in raw)


def decompress_into(table: Sequence[tuple[str, int]], data: Any, out: memoryview) -> None:
    """Decode the data section ``data`` of plane table ``table`` into ``out`` (exactly the payload size).

    Every zstd frame's declared size is checked before it is decoded (F-6.6) and must decode to exactly one plane
    (F-6.7); ``out`` is written only through these checks, and the caller zero-fills it on any error (F-5.5).
    """
    width = len(table)
    if width == 0 or len(out) % width or sum(n for _, n in table) != len(data):
        raise CodecError("the plane table does not describe this data section")  # parse_table checked it first
    plane_bytes = len(out) // width
    src = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    planes: list[Any] = []
    pos = 0
    for i, (method, n) in enumerate(table):
        stored = src[pos:pos + n]
        pos += n
        if method == "raw":
            planes.append(np.frombuffer(stored, dtype=np.uint8))
            continue
        if width == 1:
            _plane_frame(stored, out, i)
            return
        scratch = _scratch(len(planes), plane_bytes)  # not zeroed: every byte is decoded or the read fails
        _plane_frame(stored, memoryview(scratch), i)
        planes.append(scratch)
    dst = np.frombuffer(out, dtype=np.uint8)
    if width == 1:
        dst[:] = planes[0]
    elif width == 2 and _LITTLE:
        # Two vector passes over uint16 words instead of two strided byte scatters (3x faster here).
        words = dst.view(np.uint16)
        np.left_shift(planes[1], 8, out=words, dtype=np.uint16)
        np.bitwise_or(words, planes[0], out=words)
    else:
        items = dst.reshape(-1, width)
        for p in range(width):
            items[:, p] = planes[p]


_LOCAL = threading.local()


def _scratch(slot: int, n: int) -> Any:
    """A reused per-thread buffer for a decoded plane: a fresh one per read costs its page faults every time
    (a quarter of the decode on a 4.5 MB block here); held: one plane per zstd plane per I/O thread."""
    bufs: list[Any] = getattr(_LOCAL, "bufs", None) or []
    _LOCAL.bufs = bufs
    while len(bufs) <= slot:
        bufs.append(np.empty(0, dtype=np.uint8))
    if len(bufs[slot]) < n:
        bufs[slot] = np.empty(n, dtype=np.uint8)
    return bufs[slot][:n]


def _plane_frame(frame: memoryview, out: memoryview, index: int) -> None:
    try:
        # F-6.6 (declared size first), F-6.7 (exactly one plane); the cap was applied to the whole data section
        _codec.decompress_into(frame, out, bounded=False)
    except CodecError as e:
        raise CodecError(f"plane {index}: {e.message}") from None
