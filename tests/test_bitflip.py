"""Spec §5: ANY single-bit flip anywhere in a file (length field, header, padding, payload) is detected.

Exhaustive for small files (every bit, uncompressed and zstd), and a dense seeded sample for a
DeepSeek-V3-shaped 4.5 MB block (every bit of its 8 KiB header region plus 20,000 payload bits; 200,000 with KVFORMAT_SLOW=1).
Flips are applied in memory and decoded with ``kvformat.decode`` (the same checks as ``read_into``),
so ~200k decodes stay within seconds. Counts are printed (``pytest -s``) and recorded as properties.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest

import kvformat as K
from kvformat.format._header import decode_header
from kvformat.errors import KVFormatError

DATA_BITS = 200_000 if os.environ.get("KVFORMAT_SLOW") == "1" else 20_000  # seeded payload bits per big file
PROV = K.Provenance(tp=8, row="replicated", writer="kvformat-test", created=1767225600)


def _names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def _file(layout: K.CanonicalLayout, payload: bytes, codec: str = "none") -> bytearray:
    hdr, data = K.encode(payload, layout, K.BlockKey("5a" * 16), provenance=PROV, codec=codec)
    return bytearray(hdr + bytes(data))


def _flip_all(buf: bytearray, bits: "np.ndarray | range") -> collections.Counter:
    """Flip each listed bit (one at a time, restored after), decode, and count the error classes."""
    K.decode(buf)  # the unflipped file is valid
    seen: collections.Counter = collections.Counter()
    undetected = []
    for b in bits:
        i, m = int(b) >> 3, 1 << (int(b) & 7)
        buf[i] ^= m
        try:
            K.decode(buf)
        except KVFormatError as e:
            seen[type(e).__name__] += 1
        else:
            undetected.append(int(b))
        finally:
            buf[i] ^= m
    assert not undetected, f"{len(undetected)} flips not detected, first bits {undetected[:10]}"
    K.decode(buf)  # every flip was restored
    return seen


def _report(record_property, label: str, n: int, seen: collections.Counter) -> None:
    assert sum(seen.values()) == n
    print(f"\n{label}: {n} single-bit flips, {n} detected: {dict(sorted(seen.items()))}")
    record_property(label, f"{n} flips, all detected: {dict(seen)}")


def test_every_bit_of_a_small_file(record_property):
    L = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16", _names(2), 16, 256)
    pay = np.random.default_rng(1).integers(0, 256, L.payload_bytes, dtype=np.uint8).tobytes()
    buf = _file(L, pay)
    assert len(buf) == 4096 + 16384
    n = len(buf) * 8
    seen = _flip_all(buf, range(n))
    _report(record_property, "uncompressed 2-layer file (20 KiB)", n, seen)
    assert seen["ChecksumError"] > 0.9 * n  # almost all flips are caught by a checksum, not by luck of the parser


def test_every_bit_of_a_small_zstd_file(record_property):
    L = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16", _names(2), 16, 256)
    pay = np.random.default_rng(2).integers(0, 8, L.payload_bytes, dtype=np.uint8).tobytes()  # compressible
    buf = _file(L, pay, "zstd")
    assert len(buf) < 4096 + L.payload_bytes
    n = len(buf) * 8
    seen = _flip_all(buf, range(n))
    _report(record_property, f"zstd 2-layer file ({len(buf)} bytes)", n, seen)


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_dense_sample_of_a_deepseek_v3_block(codec, record_property):
    L = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16", _names(61), 64, 576)
    assert L.payload_bytes == 4_497_408
    rng = np.random.default_rng(3)
    pay = rng.integers(0, 256 if codec == "none" else 16, L.payload_bytes, dtype=np.uint8).tobytes()
    buf = _file(L, pay, codec)
    hdr = decode_header(buf)
    header_bits = np.arange(hdr.data_offset * 8)  # length field, JSON, padding: every bit
    data_bits = hdr.data_offset * 8 + np.random.default_rng(4).choice(hdr.data_bytes * 8, DATA_BITS, replace=False)
    bits = np.concatenate([header_bits, np.sort(data_bits)])
    seen = _flip_all(buf, bits)
    _report(record_property, f"DeepSeek-V3 block codec={codec} ({len(buf)} bytes): all {len(header_bits)} header "
            f"bits + {DATA_BITS} seeded data bits", len(bits), seen)
