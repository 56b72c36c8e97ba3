"""The byte-plane codec (spec §6.2, ``kvf.codec = "planes"``): round trips against the original bytes, a decoder
made of the zstandard library and the spec's plane rule only, corrupt files that never reach the destination, the
decompression cap, and the writer's choices."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import kvformat as K
from kvformat import errors
from kvformat.format import _planes

KEY = K.BlockKey("5a" * 16)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def _kv_like(n_bytes: int, itemsize: int, seed: int = 0) -> bytes:
    """Normal values with a per-channel scale (a KV latent's shape of distribution), as bf16 or f32 bytes."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n_bytes // itemsize // 64, 64)) * np.exp(rng.standard_normal(64))).astype(np.float32)
    w = x.reshape(-1).view(np.uint32)
    return (w >> 16).astype(np.uint16).tobytes() if itemsize == 2 else w.tobytes()


def _layout(kv_dtype: str = "bfloat16", width: int = 576, tokens: int = 16) -> K.CanonicalLayout:
    return K.CanonicalLayout.uniform("test/planes", kv_dtype, NAMES, tokens, width)


def _meta(f: bytes) -> dict:
    n = int.from_bytes(f[:8], "little")
    return json.loads(f[8:8 + n])["__metadata__"]


def _independent_decode(f: bytes, payload_bytes: int) -> bytes:
    """§6.2 read with the spec and zstandard alone: plane p holds payload bytes p, p+w, p+2w, ..."""
    n = int.from_bytes(f[:8], "little")
    data, table = f[8 + n:], json.loads(_meta(f)["kvf.plane_table"])
    out, pos = bytearray(payload_bytes), 0
    for p, (method, size) in enumerate(table):
        stored = data[pos:pos + size]
        pos += size
        out[p::len(table)] = stored if method == "raw" else zstandard.ZstdDecompressor().decompress(stored)
    assert pos == len(data)
    return bytes(out)


@pytest.mark.parametrize("kv_dtype,itemsize,planes", [
    ("bfloat16", 2, ["raw", "zstd"]), ("float16", 2, None), ("float32", 4, ["raw", "raw", "raw", "zstd"]),
])
def test_kv_like_payloads_round_trip_through_every_reader(tmp_path, kv_dtype, itemsize, planes):
    L = _layout(kv_dtype)
    pay = _kv_like(L.payload_bytes, itemsize)
    path = tmp_path / "b.kvf"
    hdr = K.save_file(pay, path, L, KEY, codec="planes")
    assert hdr.codec == "planes" and len(hdr.planes) == itemsize and hdr.level == 1
    if planes is not None:  # the high plane is a frame, the near-random low planes are stored as they are
        assert [m for m, _ in hdr.planes] == planes
    f = path.read_bytes()
    assert _independent_decode(f, L.payload_bytes) == pay
    assert _meta(f)["kvf.raw_xxh3"] == xxhash.xxh3_64_hexdigest(pay)
    for verify in (True, False):
        out = bytearray(b"\xaa" * L.payload_bytes)
        assert K.read_into(path, out, expect=L, key=KEY, verify=verify) == hdr
        assert bytes(out) == pay
        got_hdr, got = K.decode(f, verify=verify)
        assert bytes(got) == pay and got_hdr == hdr
    assert hdr.ratio > 1.1  # the exponent plane really compressed (a real frame went through the decoder)


def test_packed_and_mixed_layouts_use_one_plane():
    # fp8_ds_mla (U8 tokens of 656 bytes) and a DSA chunk (two U8 widths): one plane, i.e. one zstd frame
    L = _layout("fp8_ds_mla", 656, 4)
    pay = bytes(np.random.default_rng(3).integers(0, 16, L.payload_bytes, dtype=np.uint8))
    hdr, data = K.encode(pay, L, KEY, codec="planes")
    got_hdr, got = K.decode(bytes(hdr) + bytes(data))
    assert got_hdr.planes == (("zstd", len(data)),) and bytes(got) == pay
    assert _planes.width_for(["U8", "BF16"]) == 1 and _planes.width_for(["BF16", "BF16"]) == 2


def test_random_planes_are_stored_raw_and_still_verified():
    L = _layout()
    pay = np.random.default_rng(4).integers(0, 256, L.payload_bytes, dtype=np.uint8).tobytes()
    hdr, data = K.encode(pay, L, KEY, codec="planes")
    got_hdr, got = K.decode(bytes(hdr) + bytes(data))
    assert [m for m, _ in got_hdr.planes] == ["raw", "raw"] and bytes(got) == pay


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.sampled_from(["bfloat16", "float32", "fp8", "float16"]), st.integers(0, 2 ** 32 - 1),
       st.integers(0, 8))
def test_property_any_payload_round_trips(blocks, kv_dtype, seed, alphabet_bits):
    L = K.CanonicalLayout.uniform("test/planes", kv_dtype, ["a", "b"], 4, 24, blocks_per_chunk=blocks)
    rng = np.random.default_rng(seed)
    pay = (rng.integers(0, 1 << alphabet_bits, L.payload_bytes, dtype=np.uint16) & 0xFF).astype(np.uint8).tobytes()
    hdr, data = K.encode(pay, L, KEY, codec="planes")
    f = bytes(hdr) + bytes(data)
    _, got = K.decode(f)
    assert bytes(got) == pay
    if _meta(f)["kvf.codec"] == "planes":  # an all-equal payload over the cap is stored plain
        assert _independent_decode(f, L.payload_bytes) == pay


def _planes_file() -> tuple[bytes, K.CanonicalLayout, bytes, int]:
    L = _layout()
    pay = _kv_like(L.payload_bytes, 2, seed=9)
    hdr, data = K.encode(pay, L, KEY, codec="planes")
    return bytes(hdr) + bytes(data), L, pay, len(hdr)


@pytest.mark.parametrize("where", ["raw plane", "frame"])
def test_a_flipped_stored_bit_never_reaches_the_destination(tmp_path, where):
    f, L, pay, start = _planes_file()
    plane = L.payload_bytes // 2
    b = bytearray(f)
    b[start + (100 if where == "raw plane" else plane + 50)] ^= 0x10
    path = tmp_path / "bad.kvf"
    path.write_bytes(bytes(b))
    out = bytearray(b"\xaa" * L.payload_bytes)
    with pytest.raises(errors.ChecksumError) as ei:
        K.read_into(path, out, expect=L)
    assert ei.value.region == "data"  # F-5.2, before any decoding
    assert bytes(out) == bytes(len(out))  # F-5.5


def _with_stored(f: bytes, start: int, data: bytes, table: list) -> bytes:
    """The file over other stored bytes, its tensor size, plane table, data checksum and header checksum fixed, so
    only the codec's own checks stand between them and the destination."""
    n = int.from_bytes(f[:8], "little")
    doc = json.loads(f[8:8 + n])
    doc["__metadata__"]["kvf.plane_table"] = json.dumps(table)
    doc["__metadata__"]["kvf.dxxh3"] = xxhash.xxh3_64_hexdigest(data)
    doc["__metadata__"]["kvf.hxxh3"] = "0" * 16
    doc["kvf.planes"] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}
    body = json.dumps(doc, separators=(",", ":")).encode()
    total = -(-(8 + len(body)) // 4096) * 4096
    region = bytearray((total - 8).to_bytes(8, "little") + body + b" " * (total - 8 - len(body)))
    i = region.find(b'"kvf.hxxh3":"') + 13
    region[i:i + 16] = xxhash.xxh3_64_hexdigest(bytes(region)).encode()
    return bytes(region) + data


@pytest.mark.parametrize("verify", [True, False])
def test_a_forged_frame_is_a_codec_error_and_the_destination_is_zeroed(tmp_path, verify):
    f, L, pay, start = _planes_file()
    plane = L.payload_bytes // 2
    frame = f[start + plane:]
    cut = frame[:len(frame) // 2]  # the frame header still declares a whole plane
    forged = _with_stored(f, start, f[start:start + plane] + cut, [["raw", plane], ["zstd", len(cut)]])
    path = tmp_path / "cut.kvf"
    path.write_bytes(forged)
    out = bytearray(b"\xaa" * L.payload_bytes)
    with pytest.raises(errors.CodecError):
        K.read_into(path, out, expect=L, verify=verify)
    assert bytes(out) == bytes(len(out))


def test_a_frame_declaring_more_than_a_plane_is_refused_before_decoding(tmp_path):
    f, L, pay, start = _planes_file()
    plane = L.payload_bytes // 2
    big = zstandard.ZstdCompressor(level=1).compress(bytes(1 << 24))  # 16 MiB of zeros in a few hundred bytes
    forged = _with_stored(f, start, f[start:start + plane] + big, [["raw", plane], ["zstd", len(big)]])
    with pytest.raises(errors.CodecError, match=r"^plane 1: zstd frame declares 16777216 decoded bytes"):
        K.decode(forged)


def test_the_decompression_cap_holds_for_the_whole_data_section():
    # All-zero planes fit in a few bytes each; over the cap (ratio 256, 1 MiB floor) the writer stores the
    # payload plain, and a forged plane file that small is refused before any payload-sized allocation.
    L = K.CanonicalLayout.uniform("test/planes", "bfloat16", NAMES, 64, 4096)  # 2 MiB
    hdr, data = K.encode(bytes(L.payload_bytes), L, KEY, codec="planes")
    assert K.decode(bytes(hdr) + bytes(data))[0].codec == "none"
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(L.payload_bytes // 2))
    hdr_big, _ = K.encode(_kv_like(L.payload_bytes, 2), L, KEY, codec="planes")
    forged = _with_stored(bytes(hdr_big), len(hdr_big), frame + frame, [["zstd", len(frame)], ["zstd", len(frame)]])
    with pytest.raises(errors.CodecError, match="decompression cap"):
        K.decode(forged)


def test_a_sealed_layout_refuses_planes():
    with pytest.raises(errors.SchemaError):
        K.encode(bytes(_layout().payload_bytes), _layout().with_seal("authenticate"), KEY, codec="planes",
                 keys=K.Keyring.of([bytes(32)]))


def test_every_single_bit_flip_of_a_planes_file_is_refused():
    """§5.6 for §6.2: every bit of a small plane-coded file (header, raw plane, frame) flipped in turn is refused
    with a kvformat error; the destination is zeroed or untouched, never left with wrong bytes."""
    L = K.CanonicalLayout.uniform("test/planes", "bfloat16", ["a", "b"], 16, 64)
    pay = _kv_like(L.payload_bytes, 2, seed=11)
    hdr, data = K.encode(pay, L, KEY, codec="planes")
    f = bytearray(bytes(hdr) + bytes(data))
    assert [m for m, _ in K.decode(bytes(f))[0].planes] == ["raw", "zstd"]
    out = bytearray(L.payload_bytes)
    for byte in range(len(f)):
        for bit in range(8):
            f[byte] ^= 1 << bit
            out[:] = b"\xaa" * len(out)
            with pytest.raises(errors.KVFormatError):
                K.decode(bytes(f), out=out)
            assert bytes(out) in (bytes(len(out)), b"\xaa" * len(out)), (byte, bit)
            f[byte] ^= 1 << bit


def test_the_vllm_tier_stores_and_loads_planes_files(tmp_path, caplog):
    """compression "planes" through vLLM's real tiering classes: the files are plane-coded at level 1 (the
    setting's default), the loaded rows are the stored bytes, and the start-up line names the codec."""
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is installed by .ci/run")
    import logging

    from vllm_harness import Deployment, kvf, kvf_files, make_keys

    caplog.set_level(logging.INFO)
    with Deployment([kvf(tmp_path, compression="planes")], tp=2, replicated=False, n_layers=3) as dep:
        keys = make_keys(2, "planes")
        items = {k: _kv_like(dep.slot_bytes, 2, seed=i) for i, k in enumerate(keys)}
        dep.store(items)
        dep.evict_primary()
        assert dep.load(list(items)) == items
        files = kvf_files(tmp_path)
        assert len(files) == 2
        for p in files:
            hdr = K.read_header(p)
            assert hdr.codec == "planes" and hdr.level == 1 and p.stat().st_size < 4096 + dep.slot_bytes
    assert "compression=planes" in caplog.text
