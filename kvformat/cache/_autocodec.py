"""``compression="auto"``: the rule that picks a root's codec from measured numbers (no I/O here; the measurements
are ``_measure``'s).

A load of a compressed file reads ``size / r`` bytes and decodes ``size`` bytes; a raw load reads ``size`` bytes.
So ``planes`` is chosen when ``size/(r*R) + size/D <= size/R`` (R: the root's read GB/s, D: the planes codec's
verified decode GB/s on one core, r: its ratio), i.e. when the root is slow enough that the bytes compression saves
take longer to read than the decode takes. docs/benchmarks/codec.md ("When to compress") has the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["EXPECTED_RATIO", "CompressionChoice", "choose_compression", "expected_ratio"]

# What planes stores KV at, per kv_dtype (docs/benchmarks/codec.md, 2026-12-06: an engine's bf16 and fp32 KV,
# synthetic fp8). A real engine's KV, not the synthetic chunk the decode is timed on: random latents compress
# differently from a model's, so the ratio is taken from the measured table wherever it has the dtype.
EXPECTED_RATIO = {"bfloat16": 1.44, "float32": 1.18, "float": 1.18, "fp8": 1.15, "fp8_e4m3": 1.15,
                  "fp8_e5m2": 1.15, "fp8_ds_mla": 1.15}


def expected_ratio(kv_dtype: str) -> float | None:
    """The documented planes ratio of ``kv_dtype``'s KV; None for a dtype the benchmark did not measure."""
    return EXPECTED_RATIO.get(kv_dtype)


@dataclass(frozen=True)
class CompressionChoice:
    """The codec a tier writes with, and why: ``mode`` is ``"fixed"`` (the operator's setting) or ``"auto"``
    (chosen at start-up; ``reason`` and the measured numbers say from what)."""

    codec: str
    mode: str = "fixed"
    reason: str = ""
    read_gbps: float | None = None
    decode_gbps: float | None = None
    ratio: float | None = None

    def describe(self) -> str:
        """The start-up line's text: ``planes (auto: root reads 0.31 GB/s, …)``, or the codec alone if fixed."""
        return f"{self.codec} ({self.reason})" if self.reason else self.codec

    def gauges(self) -> dict[str, float]:
        """The measured speeds (GB/s), for metrics; empty when nothing was measured."""
        out = {"root_read_gbps": self.read_gbps, "codec_decode_gbps": self.decode_gbps}
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def failed(cls, why: str, *, decode_gbps: float | None = None) -> "CompressionChoice":
        """No decision could be measured: files are written raw, readable by every kvformat."""
        return cls("none", "auto", f"auto: {why}; writing uncompressed files", decode_gbps=decode_gbps)


def _g(x: float) -> str:
    return f"{x:.3g}"


def choose_compression(read_gbps: float, decode_gbps: float, ratio: float, *,
                       ratio_source: str = "") -> CompressionChoice:
    """The ``auto`` rule on measured numbers: ``planes`` when ``1/(ratio*R) + 1/D <= 1/R``, else ``none``.

    Parameters
    ----------
    read_gbps: R, the root's read speed through its store (GB/s).
    decode_gbps: D, the planes codec's verified decode speed on one core (GB/s of payload).
    ratio: r, payload bytes / stored bytes of planes on this dtype.
    ratio_source: where ``ratio`` came from, for the reason (``"expected for bfloat16"``).

    Returns
    -------
    The choice (mode ``"auto"``) with a reason naming the three numbers and the load time planes would take
    relative to a raw load; a number that is not a positive finite value chooses ``none`` and says which.
    """
    for name, v in (("root read speed", read_gbps), ("decode speed", decode_gbps), ("ratio", ratio)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            return CompressionChoice.failed(f"the {name} measured is {v!r}, not a positive number")
    # Per byte of payload: a raw load reads it; a planes load reads 1/ratio of it, then decodes it.
    raw_s = 1.0 / read_gbps
    planes_s = 1.0 / (ratio * read_gbps) + 1.0 / decode_gbps
    codec = "planes" if planes_s <= raw_s else "none"
    src = f" ({ratio_source})" if ratio_source else ""
    reason = (f"auto: root reads {_g(read_gbps)} GB/s, planes decodes {_g(decode_gbps)} GB/s verified, "
              f"ratio {ratio:.2f}{src}: a planes load takes {planes_s / raw_s:.2f}x a raw one")
    return CompressionChoice(codec, "auto", reason, read_gbps, decode_gbps, ratio)
