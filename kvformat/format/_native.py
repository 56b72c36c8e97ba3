"""The optional C extension (``kvformat.format._kvfnative``) behind one API, with pure-Python fallbacks.

``HAVE_NATIVE`` says which ran. ``KVFORMAT_NO_NATIVE=1`` in the environment forces the fallback (CI runs
both). Every function here has the same results either way; the native one releases the GIL for the
whole call and hashes each piece of a read or write while it is still in cache.
"""

from __future__ import annotations

import os
from typing import Any

import xxhash

from ._write import advance_views

PIECE = 256 * 1024  # read/write piece: hashed while it is still in L2 (tools/bench_native.py measures sizes)

_native: Any = None
if os.environ.get("KVFORMAT_NO_NATIVE") != "1":
    try:
        import importlib

        _native = importlib.import_module("kvformat.format._kvfnative")
    except ImportError:  # not built (no compiler at install time): the fallback below
        _native = None

HAVE_NATIVE: bool = _native is not None


def simd() -> str:
    """The native hash kernel in use (``"avx2"`` or ``"scalar"``), or ``"python-xxhash"`` without the extension."""
    return _native.simd() if _native is not None else "python-xxhash"


def _py_xxh3_64(data: Any) -> int:
    """xxh3-64 (seed 0) of a bytes-like object, as an int (python-xxhash)."""
    return xxhash.xxh3_64_intdigest(data)


def _py_pread_hash(fd: int, head: Any, dst: Any, offset: int, *, hash: bool = True,
                   piece: int = PIECE) -> tuple[int, int, int | None]:
    head, dst = memoryview(head).cast("B"), memoryview(dst).cast("B")
    got = 0
    want = len(head) + len(dst)
    bufs = [head, dst] if len(head) else [dst]
    while got < want:  # one preadv for both; loop only on a short read
        n = os.preadv(fd, bufs, offset + got)
        if n == 0:
            break
        got += n
        bufs = advance_views(bufs, n)
    hgot = min(got, len(head))
    dgot = got - hgot
    digest = xxhash.xxh3_64_intdigest(dst) if hash and dgot == len(dst) else None
    return hgot, dgot, digest


def _py_pwrite_hash(fd: int, header: Any, payload: Any, dxxh3_pos: int, hxxh3_pos: int, offset: int = 0,
                    piece: int = PIECE, others: Any = None, count: int = 0,
                    stride: int = 0) -> tuple[int, int] | None:
    n = len(memoryview(header).cast("B"))
    # The native checks, word for word: a slice assignment past the end would grow the header instead.
    if (n < 16 or dxxh3_pos < 0 or hxxh3_pos < 0 or dxxh3_pos > n - 16 or hxxh3_pos > n - 16
            or (dxxh3_pos < hxxh3_pos + 16 and hxxh3_pos < dxxh3_pos + 16)):
        raise ValueError("checksum positions outside the header or overlapping")
    body = memoryview(payload).cast("B")
    size = len(body)
    if count:
        o = memoryview(others).cast("B") if others is not None else None
        if (count < 0 or o is None or stride < size or stride <= 0 or len(o) < size
                or (len(o) - size) // stride < count - 1):
            raise ValueError("others does not hold count copies of the payload, stride apart")
        if any(o[r * stride:r * stride + size] != body for r in range(count)):
            return None  # nothing written: the native call stops at the first piece that differs
    dh = xxhash.xxh3_64_intdigest(payload)
    hdr = bytearray(header)
    hdr[dxxh3_pos:dxxh3_pos + 16] = f"{dh:016x}".encode()
    hdr[hxxh3_pos:hxxh3_pos + 16] = b"0" * 16
    hh = xxhash.xxh3_64_intdigest(hdr)
    hdr[hxxh3_pos:hxxh3_pos + 16] = f"{hh:016x}".encode()
    views = [memoryview(hdr), memoryview(payload).cast("B")]
    done, total = 0, len(hdr) + len(views[1])
    while done < total:
        n = os.pwritev(fd, views, offset + done)
        done += n
        views = advance_views(views, n)
    return dh, hh


_HEX = frozenset(b"0123456789abcdef")


def _py_header_match(head: Any, template: Any, spans: Any, hxxh3_pos: int, verify: bool) -> tuple[int, int]:
    import numpy as np

    h, t = bytes(head), bytes(template)
    sp = np.frombuffer(spans, dtype=np.int64).reshape(-1, 3).tolist()
    prev = 0
    for a, b, kind in sp:
        if a < prev or b < a or b > len(t) or kind not in (0, 1):
            raise ValueError("spans: out of order, outside the template or of an unknown kind")
        prev = b
    if [hxxh3_pos, hxxh3_pos + 16, 0] not in sp:
        raise ValueError("hxxh3_pos: not one of the hex spans of 16 digits")
    if len(h) != len(t):
        return 1, 0
    pos = 0
    for a, b, kind in sp:
        v = h[a:b]
        if h[pos:a] != t[pos:a] or not v:
            return 1, 0
        if kind == 0 and not set(v) <= _HEX or kind == 1 and (not v.isdigit() or (len(v) > 1 and v[:1] == b"0")):
            return 1, 0
        pos = b
    if h[pos:] != t[pos:]:
        return 1, 0
    if not verify:
        return 0, 0
    hh = xxhash.xxh3_64_intdigest(h[:hxxh3_pos] + b"0" * 16 + h[hxxh3_pos + 16:])
    return (0, 0) if f"{hh:016x}".encode() == h[hxxh3_pos:hxxh3_pos + 16] else (2, hh)


def _py_copy_runs(dst: Any, src: Any, runs: Any) -> None:
    import numpy as np

    d, s = memoryview(dst).cast("B"), memoryview(src).cast("B")
    r = np.frombuffer(runs, dtype=np.int64).reshape(-1, 6)
    for so, po, nb, cnt, ss, ps in r.tolist():
        if min(so, po, nb, cnt, ss, ps) < 0 or (cnt and (so + (cnt - 1) * ss + nb > len(s)
                                                          or po + (cnt - 1) * ps + nb > len(d))):
            raise ValueError("a copy run lies outside its buffer")
    for so, po, nb, cnt, ss, ps in r.tolist():
        if nb == 0:
            continue
        for k in range(cnt):
            d[po + k * ps:po + k * ps + nb] = s[so + k * ss:so + k * ss + nb]


if _native is not None:
    xxh3_64 = _native.xxh3_64
    pread_hash = _native.pread_hash
    pwrite_hash = _native.pwrite_hash
    copy_runs = _native.copy_runs
    header_match = _native.header_match
    read_file_hash: Any = _native.read_file_hash  # no fallback: without it the tier opens, reads and closes
else:
    xxh3_64 = _py_xxh3_64
    pread_hash = _py_pread_hash
    pwrite_hash = _py_pwrite_hash
    copy_runs = _py_copy_runs
    header_match = _py_header_match
    read_file_hash = None

_py_pread_hash.__doc__ = ("Fallback of the native pread_hash: one preadv into head and dst, then xxh3 of dst. "
                          "Returns (head bytes read, dst bytes read, xxh3 of dst or None).")
_py_pwrite_hash.__doc__ = ("Fallback of the native pwrite_hash: hash the payload, patch both checksums into a copy "
                           "of the header, one pwritev of header+payload. Returns (dxxh3, hxxh3).")

_py_copy_runs.__doc__ = "Fallback of the native copy_runs: the same checks, then one slice copy per piece."
_py_header_match.__doc__ = ("Fallback of the native header_match: the template compared outside the per-file spans, "
                            "each span's syntax, then the header checksum. Returns (status, computed hxxh3 or 0).")

__all__ = ["HAVE_NATIVE", "PIECE", "simd", "xxh3_64", "pread_hash", "pwrite_hash", "copy_runs", "header_match",
           "read_file_hash"]
