"""XXH3-64 (seed 0, default secret) of a tensor's bytes, computed on the tensor's device with Triton.

The format's data checksum (``kvf.dxxh3``) is XXH3-64 of the stored bytes; this computes the same value where
the bytes are (a GPU's memory after the host-to-device copy), so a verified load needs no CPU pass over them.

Two kernels. XXH3's long-input loop adds, per 64-byte stripe, ``swap(data) + lo32(d ^ k) * hi32(d ^ k)`` to
8 lanes and scrambles the lanes after every 16 stripes (1 KiB). The sum over one block's stripes does not
depend on the lanes' value, so ``_stripes`` computes every block's 8 contributions in parallel; ``_final``
(one program) folds them in order (``acc = scramble(acc + contribution)``), adds the last partial block and
the last stripe, and merges. Inputs of 0..240 bytes take XXH3's short paths in ``_final`` alone: every
length runs on the device, no input goes back to the host. 128-bit products are built from 32-bit halves in
uint64 arithmetic (Triton has no 128-bit integers).

Triton is optional (``pip install triton``) and imported on first use. Each kernel exists twice: compiled
(``triton.jit``) for CUDA tensors, and run by Triton's interpreter for CPU tensors, so the same code is
checked bit-exact against python-xxhash on a host without a GPU. The interpreter is chosen per call from the
tensor's device (or for every call when ``TRITON_INTERPRET=1``, Triton's own switch), never from the
environment at import time, so importing this module in either setting is harmless.

The fold is one dependent chain per lane (one scramble per KiB): it bounds the rate of a single input, not
the kernels' memory traffic.
"""

from __future__ import annotations

import functools
import os
import threading
import types
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import StagingError

if TYPE_CHECKING:
    import torch

__all__ = ["xxh3_64_device", "xxh3_64_gathered"]

# Triton names the kernel bodies use; bound to the real modules when the kernels are built (_build).
tl: Any = None
triton: Any = None
constexpr = int  # Triton reads a parameter annotated "constexpr" as a compile-time constant

# The XXH3 specification's constants (the primes and the default 192-byte secret).
P32_1 = 0x9E3779B1
P32_2 = 0x85EBCA77
P32_3 = 0xC2B2AE3D
P64_1 = 0x9E3779B185EBCA87
P64_2 = 0xC2B2AE3D27D4EB4F
P64_3 = 0x165667B19E3779F9
P64_4 = 0x85EBCA77C2B2AE63
P64_5 = 0x27D4EB2F165667C5
PMX_1 = 0x165667919E3779F9
PMX_2 = 0x9FB21C651E98DF25
M32 = 0xFFFFFFFF
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
_SEC_WORDS = len(_SECRET) - 7  # table entry o = the secret's 8 bytes at byte offset o (any offset, aligned or not)
_INIT = 185  # the table's entries 185..192: the 8 lanes' initial values
_INIT_ACC = (P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1)
_INTERP_ROWS = 64  # blocks per program under the interpreter: fewer, larger numpy steps
_DEVICE_ROWS = 4  # blocks per program on a GPU (4 KiB: 16 bytes per thread and load at 4 warps)
# Triton's interpreter patches triton.language's module attributes for the length of a run: two runs at once
# (loads on several I/O threads) would restore each other's patches mid-run.
_INTERPRETER = threading.Lock()
_UNROLL = 8  # blocks folded per loop iteration on the device (their loads issue together)


# -- the kernels (Triton language; bound and compiled in _build) -------------------------------------------------
def _rd64(src: Any, offs: Any, ok: Any) -> Any:
    # little-endian uint64 at each byte offset (any alignment: built from byte loads)
    byte = tl.arange(0, 8)
    b = tl.load(src + offs[:, None] + byte[None, :], mask=ok[:, None], other=0).to(tl.uint64)
    return _sum(b << (byte * 8).to(tl.uint64)[None, :], 1)


def _sum(x: Any, axis: constexpr) -> Any:
    # tl.reduce with Triton's own sum combiner, not tl.sum: tl.sum is itself a jit function, interpretable
    # only when Triton was imported with TRITON_INTERPRET=1, while the interpreter runs this combiner natively
    return tl.reduce(x, axis, tl.standard._sum_combine)


def _sec(sec: Any, offs: Any) -> Any:
    return tl.load(sec + offs).to(tl.uint64, bitcast=True)


def _fold(a: Any, b: Any) -> Any:
    # mul128_fold64: the 128-bit product's low half xor its high half, from 32-bit halves
    al = a & M32
    ah = a >> 32
    bl = b & M32
    bh = b >> 32
    ll = al * bl
    lh = al * bh
    hl = ah * bl
    hh = ah * bh
    cross = (ll >> 32) + (lh & M32) + hl  # cannot overflow: at most (2^32-1)^2 + 2 (2^32-1) = 2^64 - 1
    hi = hh + (lh >> 32) + (cross >> 32)
    lo = (cross << 32) | (ll & M32)
    return lo ^ hi


def _avalanche3(h: Any) -> Any:
    h = h ^ (h >> 37)
    h = h * PMX_1
    return h ^ (h >> 32)


def _avalanche64(h: Any) -> Any:
    h = h ^ (h >> 33)
    h = h * P64_2
    h = h ^ (h >> 29)
    h = h * P64_3
    return h ^ (h >> 32)


def _mix16(src: Any, sec: Any, io: Any, so: Any, ok: Any) -> Any:
    lo = _rd64(src, io, ok) ^ _sec(sec, so)
    hi = _rd64(src, io + 8, ok) ^ _sec(sec, so + 8)
    return tl.where(ok, _fold(lo, hi), 0)


def _stripes(src: Any, n_stripes: Any, n_rows: Any, sec: Any, out: Any, ROWS: constexpr) -> Any:
    # contributions of blocks (rows) pid*ROWS.. : lanes split into even (2i) and odd (2i+1) halves, because a
    # lane takes its own product and its neighbour's data (acc[i ^ 1] += data[i])
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    s = tl.arange(0, 16)
    i = tl.arange(0, 4)
    byte = tl.arange(0, 8)
    stripe = rows.to(tl.int64)[:, None] * 16 + s[None, :]
    ok = (stripe < n_stripes)[:, :, None, None]
    at = stripe[:, :, None, None] * 64 + (i * 16)[None, None, :, None] + byte[None, None, None, :]
    shift = (byte * 8).to(tl.uint64)[None, None, None, :]
    even = _sum(tl.load(src + at, mask=ok, other=0).to(tl.uint64) << shift, 3)
    odd = _sum(tl.load(src + at + 8, mask=ok, other=0).to(tl.uint64) << shift, 3)
    so = s[:, None] * 8 + i[None, :] * 16
    ke = even ^ _sec(sec, so)[None, :, :]
    ko = odd ^ _sec(sec, so + 8)[None, :, :]
    live = stripe[:, :, None] < n_stripes
    ce = _sum(tl.where(live, odd + (ke & M32) * (ke >> 32), 0), 1)
    co = _sum(tl.where(live, even + (ko & M32) * (ko >> 32), 0), 1)
    at_out = rows.to(tl.int64)[:, None] * 8 + i[None, :] * 2
    keep = (rows < n_rows)[:, None]
    tl.store(out + at_out, ce, mask=keep)
    tl.store(out + at_out + 1, co, mask=keep)


def _long(src: Any, n: Any, n_full: Any, n_main: Any, parts: Any, sec: Any, UNROLL: constexpr) -> Any:
    """XXH3's long path (over 240 bytes): the blocks' contributions folded in order, the last stripe, the merge."""
    i = tl.arange(0, 4)
    n64 = (tl.full([4], 0, tl.int64) + n).to(tl.uint64)
    e = _sec(sec, _INIT + 2 * i)
    o = _sec(sec, _INIT + 2 * i + 1)
    se = _sec(sec, 128 + 16 * i)
    sod = _sec(sec, 136 + 16 * i)
    for b0 in range(0, n_main, UNROLL):
        for u in tl.static_range(UNROLL):
            at = (b0 + u) * 8 + 2 * i
            e = e + tl.load(parts + at)
            o = o + tl.load(parts + at + 1)
            e = ((e ^ (e >> 47)) ^ se) * P32_1
            o = ((o ^ (o >> 47)) ^ sod) * P32_1
    for b in range(n_main, n_full):
        at = b * 8 + 2 * i
        e = e + tl.load(parts + at)
        o = o + tl.load(parts + at + 1)
        e = ((e ^ (e >> 47)) ^ se) * P32_1
        o = ((o ^ (o >> 47)) ^ sod) * P32_1
    at = n_full * 8 + 2 * i  # the partial block's stripes: added, never scrambled
    e = e + tl.load(parts + at)
    o = o + tl.load(parts + at + 1)
    last = (n - 64) + 16 * i.to(tl.int64)  # the last stripe, overlapping the previous ones
    yes = i >= 0
    de = _rd64(src, last, yes)
    do = _rd64(src, last + 8, yes)
    ke = de ^ _sec(sec, 121 + 16 * i)
    ko = do ^ _sec(sec, 129 + 16 * i)
    e = e + do + (ke & M32) * (ke >> 32)
    o = o + de + (ko & M32) * (ko >> 32)
    m = _fold(e ^ _sec(sec, 11 + 16 * i), o ^ _sec(sec, 19 + 16 * i))
    h = _avalanche3(n64 * P64_1 + _sum(m, 0))
    return h


def _final(src: Any, n: Any, n_full: Any, n_main: Any, parts: Any, sec: Any, out: Any, UNROLL: constexpr) -> Any:
    i = tl.arange(0, 4)
    first = i == 0
    n64 = (tl.full([4], 0, tl.int64) + n).to(tl.uint64)  # the length as a tile: no scalar arithmetic to overflow
    if n > 240:
        h = _long(src, n, n_full, n_main, parts, sec, UNROLL)
        tl.store(out + i, h, mask=first)
    elif n > 128:
        j = tl.arange(0, 16)
        io = (j * 16).to(tl.int64)
        head = _sum(_mix16(src, sec, io, j * 16, j < 8), 0)
        h = _avalanche3(n64 * P64_1 + head)
        rounds = n // 16
        tail = _mix16(src, sec, io, (j - 8) * 16 + 3, (j >= 8) & (j < rounds))
        lastm = _mix16(src, sec, (n - 16) + 0 * i.to(tl.int64), 119 + 0 * i, first)
        h = _avalanche3(h + _sum(tail, 0) + _sum(lastm, 0))
        tl.store(out + i, h, mask=first)
    elif n > 16:
        j = tl.arange(0, 8)
        k = j // 2
        io = tl.where(j % 2 == 0, 16 * k, n - 16 * (k + 1)).to(tl.int64)
        so = 32 * k + 16 * (j % 2)
        acc = _sum(_mix16(src, sec, io, so, n > 32 * k), 0)
        h = _avalanche3(n64 * P64_1 + acc)
        tl.store(out + i, h, mask=first)
    elif n > 8:
        lo = _rd64(src, 0 * i.to(tl.int64), first) ^ (_sec(sec, 24 + 0 * i) ^ _sec(sec, 32 + 0 * i))
        hi = _rd64(src, n - 8 + 0 * i.to(tl.int64), first) ^ (_sec(sec, 40 + 0 * i) ^ _sec(sec, 48 + 0 * i))
        sw = ((lo & 0xFF) << 56) | (((lo >> 8) & 0xFF) << 48) | (((lo >> 16) & 0xFF) << 40) \
            | (((lo >> 24) & 0xFF) << 32) | (((lo >> 32) & 0xFF) << 24) | (((lo >> 40) & 0xFF) << 16) \
            | (((lo >> 48) & 0xFF) << 8) | (lo >> 56)
        h = _avalanche3(n64 + sw + hi + _fold(lo, hi))
        tl.store(out + i, h, mask=first)
    elif n >= 4:
        z = 0 * i.to(tl.int64)
        a = _word32(src, z)
        b = _word32(src, n - 4 + z)
        flip = _sec(sec, 8 + 0 * i) ^ _sec(sec, 16 + 0 * i)
        h = (b + (a << 32)) ^ flip
        h = h ^ (((h << 49) | (h >> 15)) ^ ((h << 24) | (h >> 40)))
        h = h * PMX_2
        h = h ^ ((h >> 35) + n64)
        h = h * PMX_2
        h = h ^ (h >> 28)
        tl.store(out + i, h, mask=first)
    elif n > 0:
        c1 = _byte(src, 0 * i.to(tl.int64))
        c2 = _byte(src, (n >> 1) + 0 * i.to(tl.int64))
        c3 = _byte(src, n - 1 + 0 * i.to(tl.int64))
        comb = (c1 << 16) | (c2 << 24) | c3 | (n64 << 8)
        flip = (_sec(sec, 0 * i) & M32) ^ (_sec(sec, 4 + 0 * i) & M32)
        h = _avalanche64(comb ^ flip)
        tl.store(out + i, h, mask=first)
    else:
        h = _avalanche64(_sec(sec, 56 + 0 * i) ^ _sec(sec, 64 + 0 * i))
        tl.store(out + i, h, mask=first)


def _byte(src: Any, offs: Any) -> Any:
    return tl.load(src + offs).to(tl.uint64)


def _word32(src: Any, offs: Any) -> Any:
    byte = tl.arange(0, 4)
    b = tl.load(src + offs[:, None] + byte[None, :]).to(tl.uint64)
    return _sum(b << (byte * 8).to(tl.uint64)[None, :], 1)


_FUNCS = (_rd64, _sum, _sec, _fold, _avalanche3, _avalanche64, _mix16, _byte, _word32, _stripes, _long, _final)
_CONSTS = ("P32_1", "P32_2", "P32_3", "P64_1", "P64_2", "P64_3", "P64_4", "P64_5", "PMX_1", "PMX_2", "M32",
           "_INIT")


def _triton() -> tuple[Any, Any]:
    try:
        import triton as t  # type: ignore[import-untyped]
        import triton.language as lang  # type: ignore[import-untyped]
    except ImportError as e:
        raise ImportError("kvformat's device checksum (xxh3_64_device, verify='device') needs Triton: "
                          "pip install triton") from e
    return t, lang


@functools.lru_cache(maxsize=2)
def _build(interpret: bool) -> types.SimpleNamespace:
    """The kernels, bound to Triton: run by its interpreter (CPU tensors), or compiled (CUDA tensors)."""
    t, lang = _triton()
    # A namespace of their own: the same functions are bound twice (interpreted and compiled), and the
    # interpreter adds its names to the globals of what it runs.
    # The compiler evaluates parameter annotations as names of the kernel's globals: "Any" (the annotation
    # mypy needs) must be a compile-time constant there; "constexpr" marks the compile-time parameters.
    ns: dict[str, Any] = {"__name__": __name__, "tl": lang, "triton": t, "Any": lang.constexpr(None),
                          "constexpr": lang.constexpr}
    ns.update({k: lang.constexpr(globals()[k]) for k in _CONSTS})
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction  # type: ignore[import-untyped]

        def wrap(f: Any) -> Any:
            return InterpretedFunction(f)
    else:
        wrap = t.jit
    for f in _FUNCS:
        g = types.FunctionType(f.__code__, ns, f.__name__, f.__defaults__, f.__closure__)
        g.__qualname__ = f.__qualname__
        g.__module__ = __name__
        ns[f.__name__] = wrap(g)
    return types.SimpleNamespace(stripes=ns["_stripes"], final=ns["_final"])


def _table(device: "torch.device") -> "torch.Tensor":
    return _tables(str(device))


@functools.lru_cache(maxsize=16)
def _tables(device: str) -> "torch.Tensor":
    import torch

    words = [int.from_bytes(_SECRET[o:o + 8], "little") for o in range(_SEC_WORDS)] + list(_INIT_ACC)
    signed = [w - (1 << 64) if w >= 1 << 63 else w for w in words]  # torch has no uint64 constructor on every build
    return torch.tensor(signed, dtype=torch.int64, device=device)


def _interpreted(device: "torch.device") -> bool:
    return device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch(t: "torch.Tensor") -> "torch.Tensor":
    """Queue the hash of ``t`` (contiguous uint8) on its device; a one-element int64 tensor holding the digest."""
    if _interpreted(t.device):
        with _INTERPRETER:
            return _launch_on(t, True)
    return _launch_on(t, False)


def _launch_on(t: "torch.Tensor", interpreted: bool) -> "torch.Tensor":
    import torch

    n = t.numel()
    k = _build(interpreted)
    sec = _table(t.device)
    out = torch.empty(4, dtype=torch.int64, device=t.device)
    src = t if n else torch.zeros(1, dtype=torch.uint8, device=t.device)  # a pointer the kernels never read
    if n > 240:
        n_stripes = (n - 1) // 64  # the stripes before the last (the last is hashed on its own, overlapping)
        n_full = n_stripes // 16
        n_rows = n_full + 1  # the full blocks, then the partial one (0..15 stripes)
        rows = _INTERP_ROWS if interpreted else _DEVICE_ROWS
        parts = torch.empty(n_rows * 8, dtype=torch.int64, device=t.device)
        k.stripes[((n_rows + rows - 1) // rows,)](src, n_stripes, n_rows, sec, parts.view(torch.uint64), ROWS=rows)
    else:
        n_full = 0
        parts = out  # unused by the short paths
    n_main = n_full - n_full % _UNROLL
    k.final[(1,)](src, n, n_full, n_main, parts.view(torch.uint64), sec, out.view(torch.uint64), UNROLL=_UNROLL,
                  num_warps=1)  # 8 lanes' chains: one warp
    return out[:1]


def _digest(d: "torch.Tensor") -> int:
    v = int(d.item())  # the one host sync of a check: 8 bytes
    return v + (1 << 64) if v < 0 else v


def xxh3_64_device(t: "torch.Tensor") -> int:
    """XXH3-64 (seed 0, default secret) of the bytes of ``t``, computed on ``t``'s device.

    Equal to ``xxhash.xxh3_64_intdigest(t.numpy().tobytes())`` for every length, and to the integer value of
    a kvformat file's ``kvf.dxxh3`` when ``t`` holds its data region. CUDA tensors run compiled Triton
    kernels on the tensor's current stream; CPU tensors run the same kernels in Triton's interpreter (slow:
    tests and checks on hosts without a GPU).

    Parameters
    ----------
    t: a contiguous ``torch.uint8`` tensor (any shape; its bytes in memory order).

    Returns
    -------
    The digest as an unsigned 64-bit int (the host waits for the device once, for 8 bytes).

    Raises
    ------
    StagingError: ``t`` is not a contiguous uint8 tensor. ImportError: Triton is not installed.
    """
    import torch

    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or not t.is_contiguous():
        got = f"{t.dtype}, contiguous={t.is_contiguous()}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise StagingError(f"xxh3_64_device: expected a contiguous torch.uint8 tensor, got {got}")
    return _digest(_launch(t.reshape(-1)))


def xxh3_64_gathered(pages: Sequence["torch.Tensor"], block_ids: Sequence[int], blocks_per_chunk: int, *,
                     buffer: "torch.Tensor | None" = None) -> int:
    """XXH3-64 of a chunk's payload in file order, read from the paged KV blocks it was written to.

    The payload of a kvformat file is, per layer in order, ``blocks_per_chunk`` pages of that layer, block
    ``j`` at ``j * page_bytes``; a chunk of fewer blocks is zero past them. This hashes exactly that byte
    sequence, taken from ``pages[layer][block_ids[j]]`` where the blocks landed (with zeros for the missing
    tail), so it equals the file's ``kvf.dxxh3`` when every block landed intact. The pages are gathered on
    their device into ``buffer`` (one gather per layer, at device-memory speed) and hashed there.

    Parameters
    ----------
    pages: one ``(num_blocks, page_bytes)`` uint8 tensor per layer (the Stager's views), all on one device.
    block_ids: the chunk's destination block ids, in chunk order (1..``blocks_per_chunk`` of them).
    blocks_per_chunk: the layout's blocks per chunk.
    buffer: a contiguous uint8 tensor of at least the payload's size on that device (allocated if None).

    Raises
    ------
    StagingError: bad block ids, pages or buffer. ImportError: Triton is not installed.
    """
    import torch

    ids = [int(b) for b in block_ids]
    if not pages or not 1 <= len(ids) <= blocks_per_chunk:
        raise StagingError(f"xxh3_64_gathered: expected pages and 1..{blocks_per_chunk} block ids, "
                           f"got {len(pages)} pages and {len(ids)} ids")
    dev = pages[0].device
    sizes = [int(p.shape[1]) * blocks_per_chunk for p in pages]
    for p in pages:
        if p.dim() != 2 or p.dtype != torch.uint8 or p.device != dev:
            raise StagingError(f"xxh3_64_gathered: expected (num_blocks, page_bytes) uint8 pages on {dev}, got "
                               f"{tuple(p.shape)} {p.dtype} on {p.device}")
        if any(not 0 <= b < int(p.shape[0]) for b in ids):
            raise StagingError(f"xxh3_64_gathered: block ids outside 0..{int(p.shape[0]) - 1}: {ids[:8]}")
    total = sum(sizes)
    if buffer is None:
        buffer = torch.empty(total, dtype=torch.uint8, device=dev)
    if buffer.dtype != torch.uint8 or not buffer.is_contiguous() or buffer.numel() < total or buffer.device != dev:
        raise StagingError(f"xxh3_64_gathered: expected a contiguous uint8 buffer of >= {total} bytes on {dev}")
    flat = buffer.reshape(-1)[:total]
    _gather(pages, ids, blocks_per_chunk, flat)
    return xxh3_64_device(flat)


def _gather(pages: Sequence["torch.Tensor"], ids: list[int], bpc: int, flat: "torch.Tensor") -> None:
    import torch

    idx = torch.tensor(ids, dtype=torch.long, device=flat.device)
    off = 0
    for p in pages:
        page = int(p.shape[1])
        view = flat[off:off + page * bpc].view(bpc, page)
        torch.index_select(p, 0, idx, out=view[:len(ids)])
        if len(ids) < bpc:
            view[len(ids):].zero_()  # the file's payload is zero past a short chunk's blocks
        off += page * bpc
