"""First known-answer checks of the core API; the conformance suites live beside this file."""

import numpy as np
import pytest
import safetensors
import torch

import kvformat as K
from kvformat.errors import ChecksumError, LayoutMismatchError


def _layout(n_layers=3, tpb=16, width=576, bpc=1):
    return K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                                     [f"model.layers.{i}.self_attn.attn" for i in range(n_layers)], tpb, width,
                                     blocks_per_chunk=bpc)


def test_roundtrip_and_safetensors_view(tmp_path):
    L = _layout(bpc=2)
    pay = np.random.default_rng(0).integers(0, 256, L.payload_bytes, dtype=np.uint8)
    p = tmp_path / "b.kvf"
    K.save_file(pay, p, L, K.BlockKey("ab" * 32))
    out = bytearray(L.payload_bytes)
    hdr = K.read_into(p, out, expect=L, key=K.BlockKey("ab" * 32))
    assert bytes(out) == pay.tobytes() and hdr.data_offset % K.ALIGNMENT == 0
    with safetensors.safe_open(str(p), "pt") as f:
        assert list(f.keys()) == [l.name for l in L.layers]
        t = f.get_tensor(L.layers[1].name)
        assert tuple(t.shape) == (2, 16, 576)
        off = L.layer_offsets[1]
        got = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert got == pay[off:off + L.chunk_bytes_per_layer[1]].tobytes()


def test_flip_and_mismatch(tmp_path):
    L = _layout()
    pay = np.zeros(L.payload_bytes, dtype=np.uint8)
    p = tmp_path / "b.kvf"
    K.save_file(pay, p, L, K.BlockKey("cd" * 32))
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0x10
    p.write_bytes(raw)
    out = bytearray(b"\x01" * L.payload_bytes)
    with pytest.raises(ChecksumError):
        K.read_into(p, out)
    assert not any(out)  # invalidated, never left holding wrong bytes
    with pytest.raises(LayoutMismatchError) as e:
        K.decode(bytes(raw), expect=_layout(tpb=32), verify=False)
    assert e.value.field == "tokens_per_block"


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_save_file_returns_the_header_it_wrote(tmp_path, codec):
    # save_file builds its BlockHeader from what it encoded (no re-parse): it must equal what a reader sees.
    L = _layout(bpc=2)
    pay = np.random.default_rng(1).integers(0, 256, L.payload_bytes, dtype=np.uint8)
    p = tmp_path / "b.kvf"
    written = K.save_file(pay, p, L, K.BlockKey("ef" * 32), codec=codec,
                          provenance=K.Provenance(tp=4, row="per_worker", writer="t", created=7))
    assert written == K.read_header(p)
