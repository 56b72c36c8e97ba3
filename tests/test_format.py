"""API tests of the core: safetensors compatibility, packed dtypes, zero-copy decode targets, the error
classes and their structured fields, OS errors passing through, header size, and the writer rules (§10)."""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
import xxhash

import kvformat as K
from kvformat.format._header import decode_header
from kvformat import errors
from kvformat.format._files import iter_files
from kvformat.format._write import TMP_PREFIX, write_atomic

PROV = K.Provenance(tp=8, row="replicated", writer="kvformat-test", created=1767225600)
KEY = K.BlockKey("9f" * 32)


def _names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def _ds(kv_dtype: str = "bfloat16", width: int = 576, n: int = 61, tpb: int = 64, bpc: int = 1) -> K.CanonicalLayout:
    return K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", kv_dtype, _names(n), tpb, width, blocks_per_chunk=bpc)


def _pay(L: K.CanonicalLayout, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, L.payload_bytes, dtype=np.uint8)


def _file(L: K.CanonicalLayout, pay, codec: str = "none") -> bytes:
    h, d = K.encode(pay, L, KEY, provenance=PROV, codec=codec)
    return h + bytes(d)


# ------------------------------------------------------------------ safetensors compatibility (§3, §4.2)

def test_safe_open_lists_every_layer_with_dtype_shape_and_bytes(tmp_path):
    L = _ds(bpc=2, n=61, tpb=16)
    pay = _pay(L)
    p = tmp_path / "b.kvf"
    K.save_file(pay, p, L, KEY, provenance=PROV)
    with safetensors.safe_open(str(p), "pt") as f:
        assert sorted(f.keys()) == sorted(_names(61))
        assert f.metadata()["kvformat"] == "1.0" and f.metadata()["kvf.kv_dtype"] == "bfloat16"
        for l, off, n in zip(L.layers, L.layer_offsets, L.chunk_bytes_per_layer):
            t = f.get_tensor(l.name)
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == (2, 16, 576)
            assert t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() == pay[off:off + n].tobytes()
    # and safetensors' own loader agrees with kvformat's
    ours = K.load_file(p)
    theirs = safetensors.torch.load_file(str(p))
    assert all(torch.equal(ours[k].view(torch.uint8), theirs[k].view(torch.uint8)) for k in ours)


def test_packed_fp8_ds_mla_is_stored_as_u8(tmp_path):
    L = _ds("fp8_ds_mla", 656, n=4)
    assert L.layers[0].dtype == "U8" and L.layers[0].page_bytes == 64 * 656
    pay = _pay(L, 1)
    p = tmp_path / "p.kvf"
    hdr = K.save_file(pay, p, L, KEY, provenance=PROV)
    assert hdr.layout.kv_dtype == "fp8_ds_mla"
    with safetensors.safe_open(str(p), "pt") as f:
        t = f.get_tensor(_names(4)[2])
        assert t.dtype == torch.uint8 and tuple(t.shape) == (1, 64, 656)
        assert f.metadata()["kvf.kv_dtype"] == "fp8_ds_mla"
        off = L.layer_offsets[2]
        assert t.numpy().tobytes() == pay[off:off + 64 * 656].tobytes()
    assert K.load_file(p)[_names(4)[0]].dtype == torch.uint8


def test_compressed_file_is_safetensors_with_one_u8_tensor(tmp_path):
    L = _ds(n=8)
    pay = np.random.default_rng(2).integers(0, 4, L.payload_bytes, dtype=np.uint8)
    p = tmp_path / "z.kvf"
    hdr = K.save_file(pay, p, L, KEY, codec="zstd", level=5)
    assert hdr.ratio > 2 and hdr.level == 5
    with safetensors.safe_open(str(p), "pt") as f:
        assert list(f.keys()) == ["kvf.zstd"]
        assert f.get_tensor("kvf.zstd").numel() == hdr.data_bytes


def test_header_of_a_deepseek_v3_block_fits_8kib_and_costs_under_0_2_percent():
    L = _ds()
    assert L.payload_bytes == 61 * 64 * 576 * 2 == 4_497_408
    h, _ = K.encode(_pay(L), L, KEY, provenance=PROV)
    assert len(h) <= 8192 and len(h) % 4096 == 0
    body = h[8:].rstrip(b" ")
    assert len(h) == -(-(8 + len(body)) // 4096) * 4096  # W-3.1: the fewest spaces that align the data
    assert len(h) / (len(h) + L.payload_bytes) < 0.002
    hz, _ = K.encode(bytes(L.payload_bytes), L, KEY, provenance=PROV, codec="zstd")
    assert len(hz) <= 8192


# ------------------------------------------------------------------ zero-copy decode targets

def test_decode_without_out_is_a_view_of_the_input():
    L = _ds(n=2, tpb=4)
    f = bytearray(_file(L, _pay(L)))
    hdr, view = K.decode(f)
    assert view.obj is f or bytes(view) == bytes(f[hdr.data_offset:])
    f[hdr.data_offset] ^= 0xFF  # the view sees the caller's bytes: nothing was copied
    assert view[0] == f[hdr.data_offset]


@pytest.mark.parametrize("target", ["bytearray", "memoryview", "mmap", "torch_u8", "torch_bf16", "numpy"])
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_decode_and_read_into_every_buffer_kind(target, codec, tmp_path):
    L = _ds(n=3, tpb=8)
    pay = _pay(L, 3)
    f = _file(L, pay, codec)
    p = tmp_path / "b.kvf"
    p.write_bytes(f)
    n = L.payload_bytes
    for fn in (lambda out: K.decode(f, out)[0], lambda out: K.read_into(p, out)):
        keep = None
        if target == "bytearray":
            out = bytearray(n)
            get = lambda: bytes(out)  # noqa: E731
        elif target == "memoryview":
            backing = bytearray(n + 100)
            out = memoryview(backing)[50:50 + n]
            get = lambda: bytes(backing[50:50 + n])  # noqa: E731
        elif target == "mmap":
            keep = mmap.mmap(-1, n + 4096)
            out = memoryview(keep)[4096:4096 + n]  # a page-aligned slice of an anonymous mapping
            get = lambda: bytes(keep[4096:4096 + n])  # noqa: E731
        elif target == "torch_u8":
            out = torch.empty(n, dtype=torch.uint8)
            get = lambda: out.numpy().tobytes()  # noqa: E731
        elif target == "torch_bf16":
            out = torch.empty(n // 2, dtype=torch.bfloat16)
            get = lambda: out.view(torch.uint8).numpy().tobytes()  # noqa: E731
        else:
            out = np.empty(n, dtype=np.uint8)
            get = lambda: out.tobytes()  # noqa: E731
        assert fn(out).raw_bytes == n
        assert get() == pay.tobytes()
        if isinstance(out, memoryview):
            out.release()
        if keep is not None:
            keep.close()


def test_decode_returns_a_view_of_out():
    L = _ds(n=2, tpb=4)
    f = _file(L, _pay(L))
    out = bytearray(L.payload_bytes)
    _, view = K.decode(f, out)
    assert view.obj is out


def test_destination_too_small_is_a_kvformat_error():
    L = _ds(n=2, tpb=4)
    with pytest.raises(errors.LayoutMismatchError) as e:
        K.decode(_file(L, _pay(L)), bytearray(10))
    assert e.value.field == "payload_bytes"


def test_o_direct_read_matches(tmp_path):
    L = _ds(n=4)
    pay = _pay(L, 4)
    p = tmp_path / "d.kvf"
    K.save_file(pay, p, L, KEY)
    m = mmap.mmap(-1, L.payload_bytes)  # page-aligned destination
    K.read_into(p, m, o_direct=True)
    assert m[:] == pay.tobytes()
    m.close()


# ------------------------------------------------------------------ errors and their structured fields

def test_checksum_error_fields_and_invalidation(tmp_path):
    L = _ds(n=2, tpb=4)
    pay = _pay(L)
    f = bytearray(_file(L, pay))
    hdr = decode_header(f)
    f[-1] ^= 0x01
    p = tmp_path / "c.kvf"
    p.write_bytes(f)
    out = bytearray(b"\x55" * L.payload_bytes)
    with pytest.raises(errors.ChecksumError) as e:
        K.read_into(p, out)
    assert (e.value.region, e.value.expected) == ("data", hdr.data_xxh3)
    assert e.value.actual == xxhash.xxh3_64_hexdigest(bytes(f[hdr.data_offset:]))
    assert e.value.path == str(p) and str(p) in str(e.value) and e.value.reason == "ChecksumError"
    assert out == bytearray(len(out))  # F-5.5
    g = bytearray(_file(L, pay))
    g[100] ^= 0x04
    with pytest.raises(errors.ChecksumError) as e:
        K.decode(g)
    assert e.value.region == "header" and e.value.path is None


def test_layout_mismatch_names_the_field_and_leaves_out_untouched(tmp_path):
    L = _ds(n=2, tpb=4)
    p = tmp_path / "m.kvf"
    K.save_file(_pay(L), p, L, KEY)
    out = bytearray(b"\x77" * L.payload_bytes)
    other = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "fp8_ds_mla", _names(2), 4, 576)
    with pytest.raises(errors.LayoutMismatchError) as e:
        K.read_into(p, out, expect=other)
    assert (e.value.field, e.value.expected, e.value.found) == ("kv_dtype", "fp8_ds_mla", "bfloat16")
    assert out == bytearray(b"\x77" * L.payload_bytes)
    renamed = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16", ["a", "b"], 4, 576)
    with pytest.raises(errors.LayoutMismatchError) as e:
        K.read_into(p, out, expect=renamed)
    assert e.value.field == "layers[0]"
    with pytest.raises(errors.LayoutMismatchError) as e:
        K.read_into(p, out, key=K.BlockKey("00" * 32))
    assert e.value.field == "key" and e.value.found == KEY.to_str()


def test_truncated_oversized_version_and_schema_fields():
    L = _ds(n=2, tpb=4)
    f = _file(L, _pay(L))
    with pytest.raises(errors.TruncatedError) as e:
        K.decode(f[:-10])
    assert (e.value.region, e.value.needed, e.value.available) == ("data", len(f), len(f) - 10)
    with pytest.raises(errors.OversizedHeaderError) as e:
        K.decode(struct.pack("<Q", 1 << 40) + f[8:])
    assert (e.value.limit, e.value.found) == (K.MAX_HEADER_BYTES, 1 << 40)
    with pytest.raises(errors.UnsupportedVersionError) as e:
        K.decode(f.replace(b'"kvformat":"1.0"', b'"kvformat":"3.1"'))
    assert (e.value.found, e.value.supported) == ("3.1", 1)
    with pytest.raises(errors.SchemaError) as e:
        K.decode(f.replace(b'"kvf.row":"replicated"', b'"kvf.row":"zzzzzzzzzz"'), verify=False)
    assert e.value.field == "kvf.row"
    with pytest.raises(errors.NotKVFormatError):
        K.decode(safetensors.torch.save({"x": torch.zeros(3)}))


def test_os_errors_pass_through(tmp_path):
    missing = tmp_path / "nope.kvf"
    for call in (lambda: K.read_header(missing), lambda: K.read_into(missing, bytearray(8)),
                 lambda: K.load_file(missing), lambda: K.open_block(missing)):
        with pytest.raises(FileNotFoundError):
            call()
    with pytest.raises(IsADirectoryError):
        K.read_header(tmp_path)


def test_save_into_a_file_path_is_an_os_error(tmp_path):
    L = _ds(n=1, tpb=1)
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(OSError) as e:  # FileExistsError from makedirs: the OS's word, unwrapped
        K.save_file(bytes(L.payload_bytes), tmp_path / "afile" / "b.kvf", L, KEY)
    assert not isinstance(e.value, errors.KVFormatError)


def test_bad_payload_size_is_a_layout_mismatch(tmp_path):
    L = _ds(n=2, tpb=4)
    with pytest.raises(errors.LayoutMismatchError) as e:
        K.save_file(bytes(L.payload_bytes - 1), tmp_path / "x.kvf", L, KEY)
    assert e.value.field == "payload_bytes"
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------ writing (§10) and the rest of the API

def test_atomic_write_leaves_no_temp_and_first_writer_wins(tmp_path):
    p = str(tmp_path / "a" / "b.kvf")
    assert write_atomic(p, [b"one"], fsync=True)
    assert not write_atomic(p, [b"two"], overwrite=False)
    assert open(p, "rb").read() == b"one"
    assert write_atomic(p, [b"three", memoryview(b"!")])
    assert open(p, "rb").read() == b"three!"
    assert [e.name for e in os.scandir(tmp_path / "a")] == ["b.kvf"]
    (tmp_path / "a" / f"{TMP_PREFIX}123-abcd.kvf").write_bytes(b"partial")
    assert [rel for rel, _ in iter_files(str(tmp_path))] == ["a/b.kvf"]  # W-10.2


def test_save_file_from_a_tensor_dict_and_open_block(tmp_path):
    L = _ds(n=3, tpb=4, bpc=2)
    tensors = {l.name: torch.randn(2, 4, 576).to(torch.bfloat16) for l in L.layers}
    p = tmp_path / "t.kvf"
    hdr = K.save_file(tensors, p, L, KEY, fsync=True)
    assert hdr.provenance.writer.startswith("kvformat ") and hdr.provenance.created > 0
    with K.open_block(p) as b:
        assert b.header == hdr
        back = b.tensors()
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    out = torch.empty(L.payload_bytes, dtype=torch.uint8)
    with K.open_block(p) as b:
        b.read_into(out, expect=L)
    assert torch.equal(out[:L.chunk_bytes_per_layer[0]].view(torch.bfloat16).reshape(2, 4, 576),
                       tensors[_names(3)[0]])


def test_header_dict_and_path(tmp_path):
    L = _ds(n=2, tpb=4)
    hdr = K.save_file(_pay(L), tmp_path / "h.kvf", L, KEY, provenance=PROV)
    d = hdr.to_dict()
    assert d["namespace"] == L.namespace() and d["file_bytes"] == 4096 + L.payload_bytes
    assert K.CanonicalLayout.from_dict(d["layout"]) == L
    rel = K.block_relpath(L, KEY)
    assert rel == f"{L.namespace()}/9f/9f/{KEY.hash}.kvf"
    assert L.namespace().startswith("deepseek-ai_DeepSeek-V3-") and len(L.namespace().rsplit("-", 1)[1]) == 16


def test_verify_false_still_checks_the_schema():
    L = _ds(n=2, tpb=4)
    f = bytearray(_file(L, _pay(L)))
    f[-1] ^= 1
    hdr, view = K.decode(f, verify=False)  # payload corruption is not looked for
    assert hdr.raw_bytes == len(view)
    with pytest.raises(errors.SchemaError):
        K.decode(bytes(f).replace(b'"kvf.codec":"none"', b'"kvf.codec":"lz44"'), verify=False)


def test_a_zstd_level_the_reader_would_refuse_is_refused_at_write(tmp_path):
    L = _ds(n=1, tpb=1)
    for level in (-1, 23):
        with pytest.raises(errors.SchemaError) as e:
            K.save_file(bytes(L.payload_bytes), tmp_path / "z.kvf", L, KEY, codec="zstd", level=level)
        assert e.value.field == "kvf.level"
    assert not list(tmp_path.iterdir())
    K.save_file(bytes(L.payload_bytes), tmp_path / "z.kvf", L, KEY, codec="zstd", level=22)
    assert K.read_header(tmp_path / "z.kvf").level == 22
