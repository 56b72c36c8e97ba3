"""Tests that kill the mutants tools/mutate.py found surviving (each named after the check it pins).

Files are forged with tools/fuzz.py's helpers (header checksum recomputed, so the check under test is
the one that fires); the file-path races use a real file truncated between the header and the payload
read.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import random
import sys

import pytest

import kvformat as K
from kvformat.format import _fused, _read
from kvformat.errors import ChecksumError, SchemaError, TruncatedError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import fuzz  # noqa: E402

SEEDS = {s.name: s for s in fuzz.make_seeds(0)}
PLAIN = SEEDS["mla3.none"]


def forged(seed: fuzz.Seed, edit) -> bytes:
    doc, data = fuzz.parse(seed)
    edit(doc)
    return fuzz.assemble(doc, data)


# -- F-4.7: a tensor entry holds exactly dtype, shape, data_offsets --------------------------------------
def test_f47_tensor_entry_with_an_extra_key_is_refused():
    name = PLAIN.layout.layers[0].name
    raw = forged(PLAIN, lambda d: d[name].update(extra=1))
    with pytest.raises(SchemaError) as ei:
        K.decode(raw)
    assert ei.value.field == f"tensor {name}" and "exactly dtype, shape and data_offsets" in ei.value.message


# -- F-4.4: every required key, not only the layout's ------------------------------------------------
@pytest.mark.parametrize("key", ["kvf.key", "kvf.dxxh3", "kvf.created"])
def test_f44_missing_required_key_names_that_key(key):
    raw = forged(PLAIN, lambda d: d["__metadata__"].pop(key))
    with pytest.raises(SchemaError) as ei:
        K.decode(raw)
    assert ei.value.field == key and ei.value.message.endswith("missing from __metadata__")


# -- F-4.12: names without control characters, key hashes of 2..128 hex digits ---------------------------
def test_f412_control_characters_in_a_name_are_refused():
    with pytest.raises(SchemaError, match="control characters"):
        K.CanonicalLayout.uniform("org/m\x01", "bfloat16", ["l0"], 4, 8)
    raw = forged(PLAIN, lambda d: d["__metadata__"].update({"kvf.model": "org/m\x07"}))
    with pytest.raises(SchemaError) as ei:
        K.decode(raw)
    assert "control characters" in ei.value.message


@pytest.mark.parametrize("h", ["a", "ab" * 64 + "a", "ab" * 65])
def test_f412_key_hash_length_is_bounded(h):
    with pytest.raises(SchemaError) as ei:
        K.BlockKey(h)
    assert ei.value.field == "key.hash" and "2..128 hex digits" in ei.value.message


# -- F-3.4/F-5.2/F-5.5 on the file path: a file that shrinks between the header and the payload read ------
@pytest.fixture
def shrinking(monkeypatch):
    """Truncate the file right after read_into validated its header (another process rewriting it)."""
    real = _read.read_header_from
    cut: dict[str, int] = {}

    def read_header_then_truncate(src, verify=True):
        hdr = real(src, verify)
        os.truncate(f"/proc/self/fd/{src.fd}", hdr.data_offset + cut["keep"])  # the fd is read-only
        return hdr

    monkeypatch.setattr(_read, "read_header_from", read_header_then_truncate)
    return cut


def test_f55_short_payload_read_zeroes_the_destination(tmp_path, shrinking):
    p = tmp_path / "b.kvf"
    p.write_bytes(PLAIN.file)
    shrinking["keep"] = len(PLAIN.payload) // 2
    out = bytearray(b"\xaa" * len(PLAIN.payload))
    with pytest.raises(TruncatedError) as ei:
        K.read_into(p, out, expect=PLAIN.layout, key=PLAIN.key)
    assert ei.value.region == "data"
    assert bytes(out) == bytes(len(out)), "the half that was read stayed in the destination"


def test_f52_short_compressed_read_is_truncated_not_a_checksum_error(tmp_path, shrinking):
    z = SEEDS["mla3.zstd"]
    p = tmp_path / "z.kvf"
    p.write_bytes(z.file)
    shrinking["keep"] = (len(z.file) - z.hdr_end) // 2
    out = bytearray(b"\xaa" * len(z.payload))
    with pytest.raises(TruncatedError) as ei:
        K.read_into(p, out, expect=z.layout, key=z.key)
    assert ei.value.region == "data" and bytes(out) == bytes(len(out))


# -- the O_DIRECT branch runs when asked for on a filesystem that allows it ------------------------------
def _o_direct_supported(d: str) -> bool:
    probe = os.path.join(d, ".odirect-probe")
    with open(probe, "wb") as f:
        f.write(bytes(8192))
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        os.unlink(probe)


@pytest.mark.parametrize("o_direct", [True, False])
def test_o_direct_read_takes_the_o_direct_branch(tmp_path, monkeypatch, o_direct):
    if not _o_direct_supported(str(tmp_path)):
        pytest.skip(f"{tmp_path} does not allow O_DIRECT (tmpfs?): run on a disk filesystem")
    layout = K.CanonicalLayout.uniform("org/od", "bfloat16", ["l0", "l1"], 16, 128)  # 2 x 4,096 bytes
    key = K.BlockKey("cd" * 32)
    payload = random.Random(3).randbytes(layout.payload_bytes)
    p = tmp_path / "od.kvf"
    K.save_file(payload, p, layout, key)
    flags: list[int] = []
    real_open, real_fcntl = os.open, fcntl.fcntl

    def spy_open(path, fl, *a, **kw):
        flags.append(fl)
        return real_open(path, fl, *a, **kw)

    def spy_fcntl(fd, cmd, arg=0, *rest):
        if cmd == fcntl.F_SETFL:
            flags.append(int(arg))
        return real_fcntl(fd, cmd, arg, *rest)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(fcntl, "fcntl", spy_fcntl)
    buf = mmap.mmap(-1, layout.payload_bytes)  # page-aligned: O_DIRECT's requirement
    K.read_into(p, memoryview(buf), expect=layout, key=key, o_direct=o_direct)
    assert bytes(buf) == payload
    assert any(f & os.O_DIRECT for f in flags) == o_direct


# -- 1.1 roles and pins (F-4.11, F-4.13, F-4.14, F-4.15): the survivors of the post-merge mutation run ----
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gen_vectors as GV  # noqa: E402


def _vector(name: str) -> bytes:
    with open(os.path.join(ROOT, "spec", "vectors", "valid", name + ".kvf"), "rb") as f:
        return f.read()


def test_f411_opaque_name_without_roles_is_a_reserved_name():
    raw = GV.with_meta(_vector("opaque-region-1.1"), kvf__roles=None)
    with pytest.raises(SchemaError) as ei:
        K.decode(raw)
    assert ei.value.field == "layer.name" and "kvf.opaque" in ei.value.message


def test_f415_empty_pins_are_refused():
    raw = GV.with_meta(_vector("opaque-region-1.1"), kvf__pins="{}")
    with pytest.raises(SchemaError) as ei:
        K.decode(raw)
    assert ei.value.field == "kvf.pins" and "empty" in ei.value.message


@pytest.mark.parametrize("roles,pattern", [("not json", "not valid JSON"), ('{"a": 1}', "expected a JSON list")])
def test_f413_roles_must_be_a_json_list(roles, pattern):
    raw = GV.with_meta(_vector("dsa-fp8-mla-indexer-1.1"), kvf__roles=roles)
    with pytest.raises(SchemaError) as ei:
        K.decode(raw)
    assert ei.value.field == "kvf.roles" and pattern in ei.value.message


@pytest.mark.parametrize("name,dtype", [("model.layers.0.self_attn.attn", "U8"), ("kvf.opaque", "BF16")])
def test_f414_an_opaque_layer_is_the_u8_tensor_kvf_opaque(name, dtype):
    with pytest.raises(SchemaError) as ei:
        K.LayerSpec(name, dtype, (8,), role="opaque")
    assert ei.value.field == "kvf.roles" and "kvf.opaque" in ei.value.message


def test_f55_decode_of_a_bad_zstd_frame_into_out_zeroes_it():
    with open(os.path.join(ROOT, "spec", "vectors", "invalid", "zstd-raw-mismatch.kvf"), "rb") as f:
        raw = f.read()
    n = K.decode(raw, verify=False)[0].raw_bytes
    out = bytearray(b"\xaa" * n)
    with pytest.raises(ChecksumError):
        K.decode(raw, out)
    assert bytes(out) == bytes(n), "decoded bytes stayed in out"


def test_f52_fused_read_of_a_file_that_shrank_is_truncated_and_zeroed(tmp_path, monkeypatch):
    from kvformat.format import _native  # the fused read works on either implementation (native or fallback)

    p = tmp_path / "b.kvf"
    p.write_bytes(PLAIN.file)
    real = _native.pread_hash

    def shrink_then_read(fd, head, body, offset, **kw):
        os.truncate(f"/proc/self/fd/{fd}", len(PLAIN.file) - len(PLAIN.payload) // 2)
        return real(fd, head, body, offset, **kw)

    monkeypatch.setattr(_native, "pread_hash", shrink_then_read)
    # the shrink is injected between the open and the read, which the one-call native read does inside C
    monkeypatch.setattr(_native, "read_file_hash", None)
    out = bytearray(b"\xaa" * len(PLAIN.payload))
    with pytest.raises(TruncatedError) as ei:  # verify off: only the length check can tell
        _fused.read_into_fused(p, out, expect=PLAIN.layout, key=PLAIN.key, verify=False)
    assert ei.value.region == "data" and bytes(out) == bytes(len(out))


def test_f52_fused_read_of_a_flipped_payload_bit_is_a_checksum_error_and_zeroed(tmp_path):
    raw = bytearray(PLAIN.file)
    raw[len(raw) - len(PLAIN.payload) // 3] ^= 0x10
    p = tmp_path / "flip.kvf"
    p.write_bytes(bytes(raw))
    out = bytearray(b"\xaa" * len(PLAIN.payload))
    with pytest.raises(ChecksumError) as ei:
        _fused.read_into_fused(p, out, expect=PLAIN.layout, key=PLAIN.key, verify=True)
    assert ei.value.region == "data" and bytes(out) == bytes(len(out))


# -- F-8.5 before the product (G-1.4): a 1 MB shape list is refused on its length -------------------------
def test_f85_a_1mb_shape_list_is_refused_before_its_product(tmp_path):
    """A 1 MB header (valid checksum) whose shape list holds 50,000 large dimensions held the GIL for 10-16 s:
    the product of the dimensions was formed before their number was checked (G-1.4: work linear in the file
    size). The bound is structural: the F-8.5 error on the list's length comes first, so no product of more
    than MAX_DIMS + 1 factors is ever formed; its message counts the dimensions it refused. (Without the
    check the same header fails later, on F-4.7, after the quadratic product: this test then fails.)"""
    for s in fuzz.make_seeds(0):
        data = fuzz.long_shape(s)
        assert int.from_bytes(data[:8], "little") > 1_000_000  # the header's length field
        p = tmp_path / f"{s.name}.kvf"
        p.write_bytes(data)
        out = bytearray(len(s.payload))
        for call, arg in ((lambda d, out=out: K.decode(d, out=out), data), (K.read_header, p)):
            with pytest.raises(SchemaError) as e:
                call(arg)
            assert e.value.field == "layer.shape", e.value
            assert e.value.message.endswith(f"... {len(fuzz.LONG_SHAPE)} dimensions)"), e.value.message[:200]


def test_f85_the_layer_table_of_a_compressed_file_is_checked_too():
    """F-8.5 has two checks: a tensor's shape (uncompressed files, before its product: G-1.4) and a LayerSpec's
    (the kvf.layers table of a compressed file, whose one tensor is [bytes], and the API). This pins the second."""
    z = SEEDS["mla3.zstd"]
    layers = [["model.layers.0.self_attn.attn", "BF16", [16, 4, 2, 2, 4]]]
    raw = forged(z, lambda d: d["__metadata__"].update({"kvf.layers": json.dumps(layers)}))
    with pytest.raises(SchemaError) as ei:
        K.decode(raw)
    assert ei.value.field == "layer.shape" and "expected 1..4 positive ints, got (16, 4, 2, 2, 4)" in ei.value.message
    with pytest.raises(SchemaError, match="expected 1..4 positive ints"):
        K.LayerSpec("l0", "BF16", (16, 4, 2, 2, 4))
