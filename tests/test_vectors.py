"""The conformance vectors of spec/FORMAT.md: every valid file decodes to its expected JSON, every
invalid file raises its expected error class (through both the in-memory and the file path), and the
generator reproduces the valid and invalid files byte for byte (format stability)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import safetensors
import torch
import xxhash

import kvformat as K
from kvformat.format._header import decode_header
from kvformat import errors

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "spec" / "vectors"
VALID = sorted(p.stem for p in (VECTORS / "valid").glob("*.kvf"))
INVALID = sorted(p.stem for p in (VECTORS / "invalid").glob("*.kvf"))


def _gen():
    spec = importlib.util.spec_from_file_location("gen_vectors", ROOT / "tools" / "gen_vectors.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _keys(exp):
    """The reader's keyring a vector names (sealed files, spec §12); None when it names none."""
    return K.Keyring.of(bytes.fromhex(k) for k in exp["keys"]) if exp.get("keys") else None


def test_folders_are_populated():
    assert len(VALID) >= 6 and len(INVALID) >= 30
    for d, names in (("valid", VALID), ("invalid", INVALID)):
        for n in names:
            assert (VECTORS / d / f"{n}.json").is_file(), f"{d}/{n}.kvf has no expected-result JSON"


@pytest.mark.parametrize("name", VALID)
def test_valid_vector(name, tmp_path):
    path = VECTORS / "valid" / f"{name}.kvf"
    exp = json.loads((VECTORS / "valid" / f"{name}.json").read_text())
    raw = path.read_bytes()
    assert xxhash.xxh3_64_hexdigest(raw) == exp["file_xxh3"]
    keys = _keys(exp)
    hdr, payload = K.decode(raw, keys=keys)
    assert hdr.to_dict() == exp["header"]
    assert dict(hdr.extra) == exp["extra"]
    assert K.block_relpath(hdr.layout, hdr.key) == exp["relpath"]
    got = {l.name: xxhash.xxh3_64_hexdigest(bytes(payload[o:o + n]))
           for l, o, n in zip(hdr.layout.layers, hdr.layout.layer_offsets, hdr.layout.chunk_bytes_per_layer)}
    assert got == exp["layers_xxh3"]
    # The file path agrees with the in-memory path.
    assert K.read_header(path) == hdr
    out = bytearray(hdr.raw_bytes)
    assert K.read_into(path, out, expect=hdr.layout, key=hdr.key, keys=keys) == hdr
    assert bytes(out) == bytes(payload)
    tensors = K.load_file(path, keys=keys)
    assert list(tensors) == [l.name for l in hdr.layout.layers]
    for l in hdr.layout.layers:
        t = tensors[l.name]
        assert tuple(t.shape) == (hdr.layout.blocks_per_chunk, *l.shape)
        assert xxhash.xxh3_64_hexdigest(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()) \
            == exp["layers_xxh3"][l.name]
    if hdr.layout.seal == "encrypt":  # F-12.4: an encrypted file is a safetensors file with one U8 tensor
        with safetensors.safe_open(str(path), "pt") as f:
            assert list(f.keys()) == ["kvf.sealed"]
            assert f.get_slice("kvf.sealed").get_dtype() == "U8"
            assert f.get_slice("kvf.sealed").get_shape() == [hdr.raw_bytes]
    elif hdr.codec == "none":  # F-3: an uncompressed file is a safetensors file with one tensor per layer
        with safetensors.safe_open(str(path), "pt") as f:
            assert sorted(f.keys()) == sorted(l.name for l in hdr.layout.layers)
            for l in hdr.layout.layers:
                assert f.get_slice(l.name).get_shape() == [hdr.layout.blocks_per_chunk, *l.shape]
                assert f.get_slice(l.name).get_dtype() == l.dtype
            meta = f.metadata()
            assert meta["kvformat"] == hdr.version and meta["kvf.hxxh3"] == hdr.header_xxh3
    else:  # F-6: a compressed file is a safetensors file with one U8 tensor
        one = "kvf.planes" if hdr.codec == "planes" else "kvf.zstd"
        with safetensors.safe_open(str(path), "pt") as f:
            assert list(f.keys()) == [one]
            assert f.get_slice(one).get_dtype() == "U8"
    if hdr.codec == "planes":
        _check_planes_with_zstd_alone(raw, hdr, bytes(payload))


def _check_planes_with_zstd_alone(raw, hdr, payload):
    """§6.2 is readable with the spec and zstd alone: the planes decoded with the zstandard library and put in
    place by the spec's rule (plane p = bytes p, p+w, ...) are the payload; no kvformat decoder involved."""
    import zstandard

    table = json.loads(_meta(raw)["kvf.plane_table"])
    data, w = raw[hdr.data_offset:], len(table)
    out, pos = bytearray(len(payload)), 0
    for p, (method, n) in enumerate(table):
        stored = data[pos:pos + n]
        pos += n
        plane = stored if method == "raw" else zstandard.ZstdDecompressor().decompress(stored)
        assert len(plane) == len(payload) // w
        out[p::w] = plane
    assert pos == len(data) and bytes(out) == payload
    assert xxhash.xxh3_64_hexdigest(bytes(out)) == _meta(raw)["kvf.raw_xxh3"]


def _meta(raw):
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n])["__metadata__"]


@pytest.mark.parametrize("name", INVALID)
def test_invalid_vector(name, tmp_path):
    path = VECTORS / "invalid" / f"{name}.kvf"
    exp = json.loads((VECTORS / "invalid" / f"{name}.json").read_text())
    assert re.fullmatch(r"F-\d+\.\d+", exp["must"])
    cls = getattr(errors, exp["error"])
    expect = K.CanonicalLayout.from_dict(exp["expect_layout"]) if "expect_layout" in exp else None
    key = K.BlockKey(**exp["expect_key"]) if "expect_key" in exp else None
    keys = _keys(exp)
    raw = path.read_bytes()
    with pytest.raises(errors.KVFormatError) as ei:
        K.decode(raw, expect=expect, key=key, keys=keys)
    assert type(ei.value) is cls, f"{name}: expected {cls.__name__}, got {type(ei.value).__name__}: {ei.value}"
    for attr in ("field", "region"):
        # Every error that names its field or region has it pinned: a check that starts failing on another
        # field (a later check catching what an earlier one let through) is a different failure.
        if hasattr(ei.value, attr):
            assert attr in exp, f"{name}: the vector does not pin {attr} ({getattr(ei.value, attr)!r})"
        if attr in exp:
            assert getattr(ei.value, attr) == exp[attr]
    assert re.search(exp["message"], ei.value.message), f"{name}: {ei.value.message!r} !~ {exp['message']!r}"
    # Same class through the file path; a checksum failure leaves the destination zero-filled (F-5.5).
    out = bytearray(b"\xaa" * (1 << 20))
    with pytest.raises(errors.KVFormatError) as ei2:
        K.read_into(path, out, expect=expect, key=key, keys=keys)
    assert type(ei2.value) is cls and ei2.value.path == str(path)
    assert re.search(exp["message"], ei2.value.message), f"{name} (file path): {ei2.value.message!r}"
    for attr in ("field", "region"):
        if attr in exp:
            assert getattr(ei2.value, attr) == exp[attr]
    if exp.get("untouched"):  # F-12.5: refused before anything reaches the destination
        assert bytes(out) == b"\xaa" * len(out)
    if exp.get("zero_filled"):
        # read_into gets the payload size from the header, so invalidation covers exactly that prefix.
        n = decode_header(raw, verify=False).raw_bytes
        assert bytes(out[:n]) == bytes(n), "destination not invalidated after a checksum failure"


def test_every_must_has_an_invalid_vector():
    text = (ROOT / "spec" / "FORMAT.md").read_text()
    musts = set(re.findall(r"\*\*(F-\d+\.\d+)\*\*", text))
    covered = set()
    for n in INVALID:
        exp = json.loads((VECTORS / "invalid" / f"{n}.json").read_text())
        covered |= {exp["must"], *exp.get("also", [])}
    accept_only = {"F-7.2"}  # a MUST-accept rule: proven by the valid vector minor-1.9-extra-keys
    assert musts, "FORMAT.md declares no MUST ids"
    assert musts - accept_only <= covered, f"MUSTs without an invalid vector: {sorted(musts - accept_only - covered)}"
    assert covered <= musts, f"vectors cite unknown MUST ids: {sorted(covered - musts)}"


def test_generator_reproduces_vectors_byte_for_byte(tmp_path):
    written = _gen().generate(str(tmp_path))
    on_disk = sorted(str(p.relative_to(VECTORS)) for p in VECTORS.rglob("*") if p.is_file())
    assert sorted(written) == on_disk, "the committed vector set differs from what the generator writes"
    for rel in written:
        assert (tmp_path / rel).read_bytes() == (VECTORS / rel).read_bytes(), f"{rel} changed: the format moved"


def test_vectors_stay_small():
    total = sum(os.path.getsize(p) for p in VECTORS.rglob("*") if p.is_file())
    assert total < 2 << 20
