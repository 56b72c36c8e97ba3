"""The fused one-read / one-write paths (kvformat.format._fused.read_into_fused, write_block_fused), native or not."""

from __future__ import annotations

import os
import random

import pytest
import xxhash

import kvformat as K
from kvformat import errors
from kvformat.format import _fused, _native
from kvformat.format._write import TMP_PREFIX
from kvformat.format._block import encode_block

L = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16", [f"model.layers.{i}.self_attn.attn" for i in range(3)],
                              64, 576)
KEY = K.BlockKey("5e" * 32)


def _fused_file(path: str, payload: bytes, *, overwrite: bool = True) -> tuple[bool, str]:
    hdr, data, _ = encode_block(payload, L, KEY, payload_xxh3=0)
    assert b'"kvf.dxxh3":"0000000000000000"' in hdr
    return _fused.write_block_fused(path, hdr, data, overwrite=overwrite)


def test_fused_write_is_byte_identical_to_save_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pay = os.urandom(L.payload_bytes)
    prov = K.Provenance(writer="t", created=5)
    hdr, data, _ = encode_block(pay, L, KEY, provenance=prov, payload_xxh3=0)
    a, b = str(tmp_path / "sub" / "a.kvf"), str(tmp_path / "b.kvf")  # "sub": the directory is created
    assert _fused.write_block_fused(a, hdr, data) == (True, xxhash.xxh3_64_hexdigest(pay))
    K.save_file(pay, b, L, KEY, provenance=prov)
    assert open(a, "rb").read() == open(b, "rb").read()
    assert not [n for n in os.listdir(tmp_path / "sub") if n.startswith(TMP_PREFIX)]
    # first writer wins: a second fused write with overwrite=False leaves the file alone
    assert _fused_file(a, os.urandom(L.payload_bytes), overwrite=False)[0] is False
    assert open(a, "rb").read() == open(b, "rb").read()


def test_fused_read_round_trip_and_header(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pay = os.urandom(L.payload_bytes)
    p = str(tmp_path / "r.kvf")
    _fused_file(p, pay)
    out = bytearray(L.payload_bytes + 100)  # larger than the payload: only the first raw bytes are written
    out[-100:] = b"\x09" * 100
    hdr = _fused.read_into_fused(p, out, expect=L, key=KEY)
    assert out[:L.payload_bytes] == pay and out[-100:] == b"\x09" * 100
    assert hdr == K.read_header(p) and hdr.data_xxh3 == xxhash.xxh3_64_hexdigest(pay)
    assert _fused.read_into_fused(p, bytearray(L.payload_bytes), expect=L, verify=False).key == KEY


def test_fused_read_zero_fills_on_every_failure(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pay = os.urandom(L.payload_bytes)
    p = tmp_path / "c.kvf"
    _fused_file(str(p), pay)
    good = p.read_bytes()
    hl = len(good) - L.payload_bytes
    rng = random.Random(7)
    for bit in [rng.randrange(hl * 8) for _ in range(40)] + [hl * 8 + rng.randrange(L.payload_bytes * 8) for _ in range(40)]:
        bad = bytearray(good)
        bad[bit // 8] ^= 1 << (bit % 8)
        p.write_bytes(bad)
        out = bytearray(b"\x55" * L.payload_bytes)
        with pytest.raises(errors.KVFormatError) as fused:
            _fused.read_into_fused(p, out, expect=L, key=KEY)
        assert out == bytearray(L.payload_bytes), bit  # zeroed, never the file's bytes
        with pytest.raises(errors.KVFormatError) as plain:
            K.read_into(p, bytearray(L.payload_bytes), expect=L, key=KEY)
        assert type(fused.value) is type(plain.value) and fused.value.path == str(p), bit
    p.write_bytes(good)
    out = bytearray(b"\x55" * L.payload_bytes)
    with pytest.raises(errors.LayoutMismatchError):
        _fused.read_into_fused(p, out, expect=L, key=K.BlockKey("00" * 32))
    assert out == bytearray(L.payload_bytes)
    p.write_bytes(good[:-1])  # truncated: the size guess no longer fits, read_into decides
    with pytest.raises(errors.KVFormatError):
        _fused.read_into_fused(p, bytearray(L.payload_bytes), expect=L, key=KEY)


def test_fused_read_falls_back_for_compressed_and_other_layouts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pay = bytes(L.payload_bytes)  # compressible
    p = tmp_path / "z.kvf"
    K.save_file(pay, p, L, KEY, codec="zstd")
    out = bytearray(b"\x01" * L.payload_bytes)
    assert _fused.read_into_fused(p, out, expect=L, key=KEY).codec == "zstd" and out == pay
    other = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16", ["a"], 64, 576)
    with pytest.raises(errors.LayoutMismatchError):
        _fused.read_into_fused(p, bytearray(L.payload_bytes), expect=other)


def test_header_hash_matches_fallback() -> None:
    from kvformat.format import _header

    buf = os.urandom(100_000)
    assert _header.xxh3_hex(buf) == xxhash.xxh3_64_hexdigest(buf)
    assert ("xxhash" in _header.xxh3_hex.__code__.co_names) == (not _native.HAVE_NATIVE)


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_fused_read_o_direct(tmp_path, where: str) -> None:  # type: ignore[no-untyped-def]
    """O_DIRECT one-read into a page-aligned destination (a row of the tier), and the buffered fall-backs."""
    import mmap
    import tempfile

    d = tempfile.mkdtemp(dir="/dev/shm") if where == "shm" else str(tmp_path)
    try:
        pay = os.urandom(L.payload_bytes)
        assert L.payload_bytes % 4096 == 0
        p = os.path.join(d, "d.kvf")
        _fused_file(p, pay)
        row = memoryview(mmap.mmap(-1, L.payload_bytes + 4096))
        assert _fused.read_into_fused(p, row, expect=L, key=KEY, o_direct=True).key == KEY
        assert row[:L.payload_bytes] == pay
        odd = row[1:1 + L.payload_bytes]  # unaligned: buffered, same result
        assert _fused.read_into_fused(p, odd, expect=L, key=KEY, o_direct=True).key == KEY and odd == pay
        bad = bytearray(open(p, "rb").read())
        bad[-5] ^= 0x10
        open(p, "wb").write(bad)
        with pytest.raises(errors.ChecksumError):
            _fused.read_into_fused(p, row, expect=L, key=KEY, o_direct=True)
        assert row[:L.payload_bytes] == bytes(L.payload_bytes)
    finally:
        if where == "shm":
            import shutil

            shutil.rmtree(d)


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_fused_write_o_direct_is_byte_identical(tmp_path, where: str) -> None:  # type: ignore[no-untyped-def]
    import mmap
    import shutil
    import tempfile

    d = tempfile.mkdtemp(dir="/dev/shm") if where == "shm" else str(tmp_path)
    try:
        pay = os.urandom(L.payload_bytes)
        row = memoryview(mmap.mmap(-1, L.payload_bytes + 4096))
        row[:L.payload_bytes] = pay
        prov = K.Provenance(writer="t", created=9)
        for name, src in (("aligned", row[:L.payload_bytes]), ("unaligned", memoryview(bytearray(b"\0" + pay))[1:])):
            hdr, data, _ = encode_block(src, L, KEY, provenance=prov, payload_xxh3=0)
            a = os.path.join(d, f"{name}.kvf")
            assert _fused.write_block_fused(a, hdr, data, o_direct=True, fsync=True) == (True, xxhash.xxh3_64_hexdigest(pay))
            b = os.path.join(d, "ref.kvf")
            K.save_file(pay, b, L, KEY, provenance=prov)
            assert open(a, "rb").read() == open(b, "rb").read(), name
    finally:
        if where == "shm":
            shutil.rmtree(d)


def test_read_file_hash_statuses_and_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The one-call read: a file whose header region fits is read and hashed (0); a directory or FIFO is not read
    (1, and the FIFO's open does not block); a size the guess does not fit (2) or a header region larger than the
    buffer (3) reads nothing; a failed open raises its OSError naming the path."""
    if not _native.HAVE_NATIVE:  # no pure-Python twin: the fused read then opens, reads and closes itself
        assert _native.read_file_hash is None
        return
    pay = os.urandom(L.payload_bytes)
    p = str(tmp_path / "a.kvf")
    _fused_file(p, pay)
    hdr_len = os.path.getsize(p) - len(pay)
    head, dst = bytearray(1 << 16), bytearray(len(pay))
    status, size, hgot, dgot, digest = _native.read_file_hash(p, head, dst)
    want = (0, os.path.getsize(p), hdr_len, len(pay), xxhash.xxh3_64_intdigest(pay))
    assert (status, size, hgot, dgot, digest) == want
    assert bytes(dst) == pay and bytes(head[:hgot]) == open(p, "rb").read(hdr_len)
    assert _native.read_file_hash(p, head, dst, hash=False)[4] is None
    d = tmp_path / "d.kvf"
    d.mkdir()
    os.mkfifo(tmp_path / "f.kvf")
    for odd in (str(d), str(tmp_path / "f.kvf")):
        assert _native.read_file_hash(odd, head, dst)[0] == 1
    assert _native.read_file_hash(p, head, bytearray(len(pay) + 1))[0] == 2  # header region not page-aligned
    assert _native.read_file_hash(p, head, dst, max_head=hdr_len - 4096)[0] == 2
    assert _native.read_file_hash(p, bytearray(hdr_len - 1), dst)[:2] == (3, os.path.getsize(p))
    with pytest.raises(FileNotFoundError) as e:
        _native.read_file_hash(str(tmp_path / "missing.kvf"), head, dst)
    assert e.value.filename == str(tmp_path / "missing.kvf")


def test_fused_read_of_odd_files_raises_what_the_general_read_raises(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Through the one-call read or not: a directory is an IsADirectoryError, a FIFO a NotKVFormatError (never a
    blocked open), a missing file a FileNotFoundError; a header region larger than any seen so far is read too."""
    d = tmp_path / "d.kvf"
    d.mkdir()
    os.mkfifo(tmp_path / "f.kvf")
    out = bytearray(L.payload_bytes)
    for p, err in ((d, IsADirectoryError), (tmp_path / "f.kvf", errors.NotKVFormatError),
                   (tmp_path / "missing.kvf", FileNotFoundError)):
        with pytest.raises(err):
            _fused.read_into_fused(p, out, expect=L, key=KEY)
        with pytest.raises(err):
            K.read_into(str(p), out, expect=L, key=KEY)
    names = [f"layer.with.a.long.name.{i:04d}" for i in range(900)]
    big = K.CanonicalLayout.uniform("m", "bfloat16", names, 1, 8)
    pay = os.urandom(big.payload_bytes)
    p = str(tmp_path / "big.kvf")
    K.save_file(pay, p, big, KEY)
    assert os.path.getsize(p) - len(pay) > 1 << 16  # more than the per-thread buffer starts with
    got = bytearray(len(pay))
    assert _fused.read_into_fused(p, got, expect=big, key=KEY).key == KEY and got == pay


def test_fused_read_zero_fills_on_an_eio_part_way(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A read that fails part-way (EIO from the filesystem after some pieces landed) zero-fills the destination:
    it raised from inside pread_hash, before the read path had noted that the destination was written."""
    from faulty_fs import FaultyFS

    why = FaultyFS.mount_error()
    if why:
        pytest.skip(f"no FUSE view here: {why}")
    big = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16",
                                    [f"model.layers.{i}.self_attn.attn" for i in range(61)], 64, 576)
    (tmp_path / "backing").mkdir()
    K.save_file(os.urandom(big.payload_bytes), tmp_path / "backing" / "b.kvf", big, KEY)
    for eio_from in (8192 + 300_000, 8192 + 4_000_000, 100):  # after one piece, after many, within the header
        with FaultyFS(str(tmp_path / "backing"), str(tmp_path / "mnt"), eio_from=eio_from) as mnt:
            out = bytearray(b"\x55" * big.payload_bytes)
            with pytest.raises(OSError) as e:
                _fused.read_into_fused(os.path.join(mnt, "b.kvf"), out, expect=big, key=KEY)
            assert e.value.errno == 5 and not isinstance(e.value, errors.KVFormatError)
            assert out == bytearray(big.payload_bytes), f"file bytes left in the destination (EIO at {eio_from})"


