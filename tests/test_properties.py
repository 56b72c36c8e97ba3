"""Property round-trips (hypothesis) over random layouts and payloads.

Layouts: 1-128 layers; bf16, fp16, fp32 and packed U8 (kv_dtype fp8_ds_mla); 1-256 tokens per block;
1-8 blocks per chunk. The per-token width is bounded so one payload stays under ~1 MiB, which keeps
the file under a minute on 2 cores.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvformat as K
from kvformat.format._header import decode_header, encode_header
from kvformat.format._consts import DTYPE_SIZES

BUDGET = 512 * 1024  # payload bytes the width is chosen to fit (a width of 1 may exceed it: at most 1 MiB)
KV_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "fp8_ds_mla": "U8"}
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw: st.DrawFn) -> K.CanonicalLayout:
    kv_dtype = draw(st.sampled_from(sorted(KV_DTYPES)))
    n_layers = draw(st.integers(1, 128))
    tpb = draw(st.integers(1, 256))
    bpc = draw(st.integers(1, 8))
    item = DTYPE_SIZES[KV_DTYPES[kv_dtype]]
    max_w = max(1, min(1024, BUDGET // (n_layers * tpb * bpc * item)))
    width = 656 if kv_dtype == "fp8_ds_mla" and max_w >= 656 and draw(st.booleans()) else draw(st.integers(1, max_w))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(n_layers)]
    extra = draw(st.fixed_dictionaries({}, optional={
        "revision": st.text("0123456789abcdef", min_size=1, max_size=40),
        "group": st.integers(0, 3),
        "family": st.sampled_from(["mla", "mla_sparse"]),
    }))
    tph = tpb * draw(st.integers(1, 4))
    L = K.CanonicalLayout.uniform(draw(st.sampled_from(["deepseek-ai/DeepSeek-V3", "org/m", "ü/模型"])), kv_dtype,
                                  names, tpb, width, blocks_per_chunk=bpc, tokens_per_hash=tph, **extra)
    assert L.layers[0].dtype == KV_DTYPES[kv_dtype]
    return L


@st.composite
def cases(draw: st.DrawFn) -> tuple[K.CanonicalLayout, K.BlockKey, K.Provenance, bytes]:
    L = draw(layouts())
    key = K.BlockKey(draw(st.text("0123456789abcdef", min_size=2, max_size=128)), L.group)
    prov = K.Provenance(tp=draw(st.integers(1, 16)), pp=draw(st.integers(1, 4)), row=draw(st.sampled_from(
        ["replicated", "per_worker", "canonical", "unknown"])), writer="prop", created=draw(st.integers(0, 2**40)))
    kind = draw(st.sampled_from(["random", "zeros", "low-entropy"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = L.payload_bytes
    if kind == "random":
        pay = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    elif kind == "zeros":
        pay = bytes(n)
    else:
        pay = rng.integers(0, 3, n, dtype=np.uint8).tobytes()
    return L, key, prov, pay


@SETTINGS
@given(cases())
def test_save_load_is_byte_identical(case):
    L, key, prov, pay = case
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "b.kvf")
        written = K.save_file(pay, p, L, key, provenance=prov)
        assert os.path.getsize(p) == written.file_bytes and written.data_offset % K.ALIGNMENT == 0
        out = bytearray(L.payload_bytes)
        hdr = K.read_into(p, out, expect=L, key=key)
        assert bytes(out) == pay
        assert hdr == written == K.read_header(p)
        tensors = K.load_file(p, expect=L)
        assert list(tensors) == [l.name for l in L.layers]
        joined = b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())
        assert joined == pay
        for l in L.layers:
            assert tuple(tensors[l.name].shape) == (L.blocks_per_chunk, *l.shape)


@SETTINGS
@given(cases())
def test_header_round_trip(case):
    L, key, prov, pay = case
    hdr_bytes, data = K.encode(pay, L, key, provenance=prov)
    assert len(hdr_bytes) % K.ALIGNMENT == 0
    hdr = decode_header(hdr_bytes)
    assert (hdr.layout, hdr.key, hdr.provenance, hdr.codec) == (L, key, prov, "none")
    assert hdr.layout.namespace() == L.namespace() and hdr.extra == {}
    assert K.CanonicalLayout.from_dict(L.to_dict()) == L
    # encode_header is a pure function of its inputs: re-encoding the decoded header gives the same bytes.
    again = encode_header(hdr.layout, hdr.key, hdr.provenance, codec=hdr.codec, data_bytes=hdr.data_bytes,
                            data_xxh3=hdr.data_xxh3, raw_xxh3=hdr.raw_xxh3)
    assert again == hdr_bytes
    # The namespace ignores provenance (F-9: tp/pp/row are not identity).
    hdr2, _ = K.encode(pay, L, key, provenance=K.Provenance(tp=prov.tp % 16 + 1, row="canonical"))
    assert decode_header(hdr2).layout.namespace() == L.namespace()


@SETTINGS
@given(cases(), st.integers(1, 9))
def test_compressed_round_trip(case, level):
    L, key, prov, pay = case
    hdr_bytes, frame = K.encode(pay, L, key, provenance=prov, codec="zstd", level=level)
    f = hdr_bytes + bytes(frame)
    hdr, out = K.decode(f, expect=L, key=key)
    assert bytes(out) == pay
    assert (hdr.codec, hdr.level, hdr.raw_bytes, hdr.layout) == ("zstd", level, len(pay), L)
    dst = torch.empty(len(pay), dtype=torch.uint8)
    K.decode(f, dst)
    assert dst.numpy().tobytes() == pay
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "z.kvf")
        K.save_file(pay, p, L, key, provenance=prov, codec="zstd", level=level)
        buf = bytearray(len(pay))
        assert K.read_into(p, buf, expect=L).codec == "zstd"
        assert bytes(buf) == pay
