"""The measurements behind ``compression="auto"`` (the edge; the rule is ``_autocodec``'s pure function): the planes
codec's verified decode speed on a synthetic chunk of the layout, and the root's read speed through its store,
both on one thread bounded by a deadline so a hung root cannot hold the tier's start-up."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np

from ..format import BlockKey, CanonicalLayout, decode, encode_block
from ..storage import Store, measure_read
from ._autocodec import CompressionChoice, choose_compression, expected_ratio

__all__ = ["AUTO_DEADLINE_S", "auto_compression", "measure_decode", "synthetic_payload"]

# The whole measurement's bound: a root that has not written and read one chunk back by then is hung or far too
# slow to judge at start-up, and the tier starts writing raw files (the choice every reader can read).
AUTO_DEADLINE_S = 2.0
# Time spent timing each side past its first pass: start-up stays well under half a second on a healthy root.
DECODE_BUDGET_S = 0.1
READ_BUDGET_S = 0.15
# The synthetic chunk's cap: beyond a few MB the per-file costs are amortised and the speed no longer changes
# (docs/benchmarks/codec.md: 2.00 GB/s at 4.5 MB), while making and encoding the chunk would cost more.
SYNTHETIC_MAX_BYTES = 4 << 20


_FLOATS = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


def _minifloat(x: np.ndarray, ebits: int, mbits: int) -> np.ndarray:
    """float32 -> an fp8 bit pattern (sign, ``ebits`` exponent, ``mbits`` mantissa; truncated, no subnormals)."""
    bits = x.astype(np.float32).view(np.uint32)
    bias = (1 << (ebits - 1)) - 1
    e = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + bias
    m = (bits >> (23 - mbits)) & ((1 << mbits) - 1)
    out = ((bits >> 31) << 7) | (np.clip(e, 0, (1 << ebits) - 1).astype(np.uint32) << mbits) | m
    return np.where(e > 0, out, (bits >> 31) << 7).astype(np.uint8)


def _values(n: int, width: int, rng: np.random.Generator) -> np.ndarray:
    # An MLA latent's shape of data: normal per channel, channels spread by a log-normal scale.
    scale = np.exp(rng.standard_normal(width, dtype=np.float32) * 0.7)
    rows = -(-n // width)
    v: np.ndarray = (rng.standard_normal((rows, width), dtype=np.float32) * scale).reshape(-1)[:n]
    return v


def synthetic_payload(layout: CanonicalLayout, seed: int = 0) -> bytearray:
    """A chunk of ``layout``'s bytes shaped like KV (what the decode is timed on; not a model's KV)."""
    rng = np.random.default_rng(seed)
    out = bytearray(layout.payload_bytes)
    off = 0
    for layer, n in zip(layout.layers, layout.chunk_bytes_per_layer):
        width = layer.shape[-1]
        if layer.dtype == "BF16":  # bf16 is float32's high half
            b = (_values(n // 2, width, rng).view(np.uint32) >> 16).astype(np.uint16).tobytes()
        elif layer.dtype in _FLOATS:
            t = _FLOATS[layer.dtype]
            b = _values(n // np.dtype(t).itemsize, width, rng).astype(t).tobytes()
        elif layer.dtype in ("F8_E4M3", "F8_E5M2", "U8"):  # U8: packed fp8 (fp8_ds_mla) or an opaque row
            v = _values(n, width, rng)
            v *= 448.0 / max(float(np.abs(v).max()), 1e-30)
            b = _minifloat(v, 5, 2).tobytes() if layer.dtype == "F8_E5M2" else _minifloat(v, 4, 3).tobytes()
        else:
            b = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        out[off:off + len(b)] = b
        off += n
    return out


def _capped(layout: CanonicalLayout) -> CanonicalLayout:
    keep, total = 0, 0
    for n in layout.chunk_bytes_per_layer:
        if keep and total + n > SYNTHETIC_MAX_BYTES:
            break
        keep, total = keep + 1, total + n
    return layout if keep == len(layout.layers) else dataclasses.replace(layout, layers=layout.layers[:keep])


def measure_decode(layout: CanonicalLayout, level: int = 1, budget_s: float = DECODE_BUDGET_S) -> tuple[float, float]:
    """(GB/s, ratio) of planes on a synthetic chunk of ``layout`` (at most ``SYNTHETIC_MAX_BYTES``): the best of
    a few verified decodes (header parsed, stored bytes and payload checked, as a load does), on this thread."""
    small = _capped(layout)
    payload = synthetic_payload(small)
    key = BlockKey("0" * 64, small.group)
    hdr, data, _ = encode_block(payload, small, key, codec="planes", level=level)
    buf = bytes(hdr) + bytes(data)
    out = bytearray(small.payload_bytes)
    best, spent, reps = float("inf"), 0.0, 0
    while reps < 3 or spent < budget_s:
        t0 = time.perf_counter()
        decode(buf, out, expect=small, key=key, verify=True)
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
        if reps >= 50:
            break
    if out != payload:  # a codec that does not round trip must never be chosen
        raise ValueError("the planes round trip of the synthetic chunk differs from its payload")
    return small.payload_bytes / best / 1e9, small.payload_bytes / len(data)


def _measure(store: Store, layout: CanonicalLayout, level: int, out: dict[str, Any]) -> None:
    try:
        out["decode"] = measure_decode(layout, level)
        out["read"] = measure_read(store, layout.payload_bytes, budget_s=READ_BUDGET_S,
                                   timeout_s=AUTO_DEADLINE_S)
    except Exception as e:  # reported by auto_compression: any failure means "none"
        out["error"] = e


def auto_compression(store: Store, layout: CanonicalLayout, level: int = 1, *,
                     deadline_s: float = AUTO_DEADLINE_S) -> CompressionChoice:
    """The ``auto`` choice for ``store``'s root and ``layout``'s chunks: measured, then
    :func:`~kvformat.cache._autocodec.choose_compression`. A measurement that fails or runs past ``deadline_s``
    chooses ``none`` and says why (its thread is a daemon: a hung read is left behind, never waited for)."""
    out: dict[str, Any] = {}
    t = threading.Thread(target=_measure, args=(store, layout, level, out), name="kvformat_auto_codec", daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(deadline_s)
    decode_gbps = out["decode"][0] if "decode" in out else None
    if t.is_alive():
        return CompressionChoice.failed(f"measuring the root did not finish within {deadline_s:g} s (a hung or very "
                                        "slow root?)", decode_gbps=decode_gbps)
    if "error" in out:
        e = out["error"]
        return CompressionChoice.failed(f"measuring the root failed ({type(e).__name__}: {e})",
                                        decode_gbps=decode_gbps)
    gbps, measured = out["decode"]
    ratio = expected_ratio(layout.kv_dtype)
    source = f"expected for {layout.kv_dtype}" if ratio is not None else "measured on a synthetic chunk"
    choice = choose_compression(out["read"].gbps, gbps, ratio if ratio is not None else measured,
                                ratio_source=source)
    return dataclasses.replace(choice, reason=f"{choice.reason}; measured in {time.monotonic() - t0:.2f} s")
