"""The native extension against python-xxhash and the pure-Python fallback (both paths, every SIMD kernel the CPU
runs; the AVX-512 kernel also through SIMDe's portable intrinsics, so a CPU without AVX-512 checks its logic)."""

from __future__ import annotations

import json
import ctypes
import os
import random
import subprocess
import sys
import tempfile

import pytest
import xxhash

from kvformat.format import _native

N = _native._native  # the compiled module, or None
needs_native = pytest.mark.skipif(N is None, reason="kvformat.format._kvfnative not built (test_native_is_built says why)")
KERNELS = ["scalar"] + (["avx2"] if N is not None and N.have_avx2() else []) + \
    (["avx512"] if N is not None and N.have_avx512() else [])
RNG = random.Random(1313)
DATA = bytes(RNG.getrandbits(8) for _ in range(1 << 16)) + os.urandom(1 << 16)


def test_native_is_built() -> None:
    """In CI (CI=true or KVFORMAT_REQUIRE_NATIVE=1) a missing extension fails here, never a silent fallback;
    elsewhere the extension is in use exactly when its shared object sits in the package."""
    import glob

    import kvformat

    if os.environ.get("KVFORMAT_NO_NATIVE") == "1":
        assert not _native.HAVE_NATIVE and N is None
        return
    if os.environ.get("KVFORMAT_REQUIRE_NATIVE") == "1" or os.environ.get("CI") == "true":
        assert _native.HAVE_NATIVE, "the C extension kvformat.format._kvfnative did not build or import"
    built = glob.glob(os.path.join(os.path.dirname(kvformat.__file__), "format", "_kvfnative*.so"))
    assert _native.HAVE_NATIVE == bool(built), built


@pytest.fixture(params=KERNELS)
def kernel(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    prev = N.set_simd(request.param)
    assert N.simd() == request.param
    yield request.param
    N.set_simd(prev)


@needs_native
def test_every_length_to_4096(kernel: str) -> None:
    for n in range(4097):
        assert N.xxh3_64(DATA[:n]) == xxhash.xxh3_64_intdigest(DATA[:n]), n


@needs_native
def test_unaligned_and_large(kernel: str) -> None:
    mv = memoryview(DATA)
    for n in (240, 241, 1023, 1024, 1025, 1088, 1089, 16384, 65535, len(DATA) - 8):
        for off in range(8):
            assert N.xxh3_64(mv[off:off + n]) == xxhash.xxh3_64_intdigest(mv[off:off + n]), (n, off)
    big = os.urandom(4_497_408 + 77)
    for n in [RNG.randrange(4097, len(big)) for _ in range(20)] + [4_497_408, 3_076_352]:
        assert N.xxh3_64(big[:n]) == xxhash.xxh3_64_intdigest(big[:n]), n


@needs_native
def test_kernels_agree_and_fallback_agrees() -> None:
    buf = os.urandom(1 << 20)
    want = xxhash.xxh3_64_intdigest(buf)
    got = set()
    for k in KERNELS:
        prev = N.set_simd(k)
        got.add(N.xxh3_64(buf))
        N.set_simd(prev)
    assert got == {want} and _native._py_xxh3_64(buf) == want
    with pytest.raises(ValueError):
        N.set_simd("sse9")
    if not N.have_avx512():  # asked for a kernel the CPU lacks: refused, the one in use is kept
        before = N.simd()
        with pytest.raises(ValueError, match="AVX-512"):
            N.set_simd("avx512")
        assert N.simd() == before


class _State(ctypes.Structure):  # kvf_xxh3_state (csrc/kvf_xxh3.h)
    _fields_ = [("acc", ctypes.c_uint64 * 8), ("base", ctypes.c_void_p), ("len", ctypes.c_size_t),
                ("stripes_done", ctypes.c_size_t), ("stripes_total", ctypes.c_size_t)]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """csrc/kvf_xxh3.c built with KVF_XXH3_SIMDE: every kernel from SIMDe's portable intrinsics."""
    import simde_py

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    so = str(tmp_path_factory.mktemp("simde") / "kvf_xxh3_simde.so")
    subprocess.run(["gcc", "-O2", "-std=c11", "-shared", "-fPIC", "-Wno-psabi", "-DKVF_XXH3_SIMDE",
                    "-I", simde_py.get_include(), os.path.join(here, "csrc", "kvf_xxh3.c"), "-o", so],
                   check=True, capture_output=True, timeout=300)
    lib = ctypes.CDLL(so)
    lib.kvf_xxh3_64.restype = ctypes.c_uint64
    lib.kvf_xxh3_64.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.kvf_xxh3_init.argtypes = [ctypes.POINTER(_State), ctypes.c_char_p, ctypes.c_size_t]
    lib.kvf_xxh3_update.argtypes = [ctypes.POINTER(_State), ctypes.c_size_t]
    lib.kvf_xxh3_digest.restype = ctypes.c_uint64
    lib.kvf_xxh3_digest.argtypes = [ctypes.POINTER(_State)]
    return lib


@pytest.mark.parametrize("path,name", [(0, "scalar"), (1, "avx2"), (2, "avx512")])
def test_emulated_kernels_every_length_alignment_and_piece(emulated: ctypes.CDLL, path: int, name: str) -> None:
    """The AVX-512 kernel's logic on any CPU: one-shot hashes of every length to 4096 at 8 alignments, then
    piecewise updates (as pread_hash/pwrite_hash feed it) at piece sizes that split the 16-stripe blocks."""
    assert emulated.kvf_xxh3_select(path) == path, name
    for off in range(8):
        for n in range(4097):
            b = DATA[off:off + n]
            assert emulated.kvf_xxh3_64(b, n) == xxhash.xxh3_64_intdigest(b), (name, off, n)
    for n in (65_536 + 3, 1_000_003, 4_497_408):
        big = (DATA * (n // len(DATA) + 1))[1:n + 1]
        for piece in (64, 1000, 4096, 65_536 + 64, 262_144):
            st = _State()
            emulated.kvf_xxh3_init(ctypes.byref(st), big, n)
            for done in range(piece, n, piece):
                emulated.kvf_xxh3_update(ctypes.byref(st), done)
            assert emulated.kvf_xxh3_digest(ctypes.byref(st)) == xxhash.xxh3_64_intdigest(big), (name, n, piece)


def _impls() -> list:  # type: ignore[type-arg]
    out = [("python", _native._py_pread_hash, _native._py_pwrite_hash)]
    if N is not None:
        out.append(("native", N.pread_hash, N.pwrite_hash))
    return out


@pytest.mark.parametrize("name,pread_hash,pwrite_hash", _impls(), ids=[i[0] for i in _impls()])
@pytest.mark.parametrize("size", [0, 100, 4096, 300_000, 4_497_408])
def test_fused_write_then_read(name: str, pread_hash, pwrite_hash, size: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    header = bytearray(b"H" * 8192)
    header[40:56] = b"X" * 16  # where the payload checksum goes
    header[100:116] = b"Y" * 16  # where the header checksum goes
    payload = os.urandom(size)
    p = tmp_path / "f"
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        dh, hh = pwrite_hash(fd, bytes(header), payload, 40, 100, piece=65536) if name == "native" else \
            pwrite_hash(fd, bytes(header), payload, 40, 100)
        assert dh == xxhash.xxh3_64_intdigest(payload)
        on_disk = p.read_bytes()
        assert len(on_disk) == 8192 + size and on_disk[8192:] == payload
        assert on_disk[40:56] == f"{dh:016x}".encode() and on_disk[100:116] == f"{hh:016x}".encode()
        zeroed = on_disk[:100] + b"0" * 16 + on_disk[116:8192]
        assert hh == xxhash.xxh3_64_intdigest(zeroed)
        head, dst = bytearray(8192), bytearray(size)
        assert pread_hash(fd, head, dst, 0) == (8192, size, dh)
        assert bytes(head) == on_disk[:8192] and bytes(dst) == payload
        assert pread_hash(fd, head, dst, 0, hash=False)[2] is None
        if size:  # a file shorter than asked: counts say so, no hash
            short = bytearray(size + 1)
            assert pread_hash(fd, bytearray(8192), short, 0) == (8192, size, None)
    finally:
        os.close(fd)


@needs_native
def test_pread_hash_pieces_and_offsets(kernel: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = os.urandom(1_000_003)
    p = tmp_path / "g"
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        for piece in (4096, 65536, 262144, 1 << 20, 1 << 22):
            for off, hl in ((0, 0), (3, 5), (4096, 4096), (999_000, 0)):
                dst = bytearray(len(data) - off - hl)
                head = bytearray(hl)
                got = N.pread_hash(fd, head, dst, off, piece=piece)
                assert got == (hl, len(dst), xxhash.xxh3_64_intdigest(data[off + hl:])), (piece, off)
                assert dst == data[off + hl:]
    finally:
        os.close(fd)


@needs_native
def test_os_errors_pass_through(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fd = os.open(tmp_path / "h", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError):  # EBADF: not opened for reading
            N.pread_hash(fd, bytearray(8), bytearray(8), 0)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        N.pwrite_hash(fd, b"h" * 64, b"p", 0, 16)  # closed fd
    with pytest.raises(ValueError):
        N.pwrite_hash(0, b"h" * 20, b"p", 0, 8)  # overlapping checksum fields


def test_no_native_env_forces_fallback() -> None:
    """A subprocess with KVFORMAT_NO_NATIVE=1 runs a real save/read round trip on the fallback."""
    code = (
        "import os, kvformat as K, kvformat.format._native as n, kvformat.format._header as h\n"
        "assert not n.HAVE_NATIVE and n.simd() == 'python-xxhash', n.simd()\n"
        "assert 'xxhash' in h.xxh3_hex.__code__.co_names, 'the native xxh3_hex is in use'\n"
        "L = K.CanonicalLayout.uniform('m', 'bfloat16', ['l0', 'l1'], 4, 8)\n"
        "p = os.path.join(os.environ['D'], 'b.kvf'); data = os.urandom(L.payload_bytes)\n"
        "K.save_file(data, p, L, K.BlockKey('ab' * 8)); out = bytearray(L.payload_bytes)\n"
        "K.read_into(p, out, expect=L, key=K.BlockKey('ab' * 8)); assert out == data\n"
        "print('fallback-ok')\n")
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "KVFORMAT_NO_NATIVE": "1", "D": d}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "fallback-ok" in r.stdout, r.stderr


def test_fused_io_suite_on_the_fallback() -> None:
    """tests/test_native_io.py again in a subprocess with KVFORMAT_NO_NATIVE=1: CI runs both paths."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "KVFORMAT_NO_NATIVE": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(here, "test_native_io.py"), os.path.join(here, "test_native.py") + "::test_native_is_built"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.parametrize("impl", ["native", "fallback"])
def test_copy_runs_moves_strided_pieces_and_refuses_runs_outside_the_buffers(impl: str) -> None:
    import numpy as np

    copy = _native.copy_runs if impl == "native" else _native._py_copy_runs
    rng = random.Random(5)
    src = bytes(rng.randrange(256) for _ in range(4096))
    # A DCP-style de-interleave: 16 pieces of 24 bytes, every other slot of 48 in the destination.
    runs = np.array([(0, 24, 24, 16, 24, 48), (384, 1000, 7, 1, 7, 7), (500, 2000, 0, 3, 1, 1)], dtype=np.int64)
    dst = bytearray(4096)
    copy(dst, src, runs.tobytes())
    want = bytearray(4096)
    for k in range(16):
        want[24 + 48 * k:48 + 48 * k] = src[24 * k:24 * (k + 1)]
    want[1000:1007] = src[384:391]
    assert dst == want
    for bad in ((0, 4090, 8, 1, 8, 8), (4000, 0, 8, 13, 8, 8), (-1, 0, 1, 1, 1, 1)):
        before = bytes(dst)
        with pytest.raises(ValueError, match="outside its buffer"):
            copy(dst, src, np.array([(0, 0, 1, 1, 1, 1), bad], dtype=np.int64).tobytes())
        assert bytes(dst) == before  # checked before anything is copied
    with pytest.raises((TypeError, BufferError)):
        copy(bytes(16), src, np.array([(0, 0, 8, 1, 8, 8)], dtype=np.int64).tobytes())  # a writable destination


# Extreme values whose bounds sums wrap a signed 64-bit integer: the old checks formed so + (cnt - 1) * ss + nb
# and dpos + 16, which wrap negative, passed, and let the copy or the patch write far outside the buffers
# (SIGSEGV). Each case runs in a child process, so that such a crash fails this test instead of the run.
I64 = (1 << 63) - 1
OVERFLOWING_RUNS = [
    (0, 0, 8, 2, I64, 8),  # (cnt - 1) * ss + nb wraps
    (0, 0, 8, 2, 8, I64),  # the same on the destination
    (1 << 62, 0, 1 << 62, 1, 0, 0),  # so + nb wraps
    (0, 1 << 62, 16, 3, 0, 1 << 61),  # po + 2 * ps wraps
    (I64, I64, I64, I64, I64, I64),
    (8, 8, I64 - 4, 1, 0, 0),
]
_OVERFLOW_CHILD = """
import json, os, sys
import numpy as np
from kvformat.format import _native as n
impl = sys.argv[1]
copy = n.copy_runs if impl == "native" else n._py_copy_runs
pwrite = n.pwrite_hash if impl == "native" else n._py_pwrite_hash
out = []
for run in json.loads(sys.argv[2]):
    try:
        copy(bytearray(4096), bytes(4096), np.array([run], dtype=np.int64).tobytes())
        out.append("copied")
    except ValueError as e:
        out.append(str(e))
fd = os.open(os.devnull, os.O_WRONLY)
for d, h in json.loads(sys.argv[3]):
    hdr = b"h" * 64
    try:
        pwrite(fd, hdr, b"payload", d, h)
        out.append("written")
    except ValueError as e:
        out.append(str(e))
print(json.dumps(out))
"""


@pytest.mark.parametrize("impl", ["native", "fallback"])
def test_native_bounds_checks_do_not_overflow(impl: str) -> None:
    if impl == "native" and N is None:
        pytest.skip("kvformat.format._kvfnative not built (test_native_is_built says why)")
    ssize_max = sys.maxsize
    positions = [(ssize_max - 8, 0), (0, ssize_max - 8), (ssize_max, ssize_max - 20), (64, 0), (49, 0), (-1, 16)]
    r = subprocess.run([sys.executable, "-c", _OVERFLOW_CHILD, impl, json.dumps(OVERFLOWING_RUNS),
                        json.dumps(positions)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"the {impl} path crashed (signal {-r.returncode}): {r.stderr[-2000:]}"
    got = json.loads(r.stdout)
    assert got[:len(OVERFLOWING_RUNS)] == ["a copy run lies outside its buffer"] * len(OVERFLOWING_RUNS)
    assert got[len(OVERFLOWING_RUNS):] == ["checksum positions outside the header or overlapping"] * len(positions)


@pytest.mark.parametrize("name,pread_hash,pwrite_hash", _impls(), ids=[i[0] for i in _impls()])
def test_fused_write_compares_the_other_copies(name: str, pread_hash, pwrite_hash, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The per-worker store's replica check inside the write: every copy equal -> the file and digests of a plain
    fused write; one byte off anywhere in any copy (first piece, a later piece, the very last byte) -> None and
    no header written."""
    header = bytearray(b"H" * 4096)
    header[40:56] = b"X" * 16
    header[100:116] = b"Y" * 16
    size, stride, count = 300_000, 300_000 + 4096, 3  # 300 KB: two 256 KiB pieces; gaps between the copies
    payload = os.urandom(size)
    row = bytearray(os.urandom(stride * count))  # the gaps hold noise that must not be compared
    for r in range(count):
        row[r * stride:r * stride + size] = payload
    fd = os.open(tmp_path / "same", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        got = pwrite_hash(fd, bytes(header), payload, 40, 100, others=row, count=count, stride=stride)
        assert got is not None and got[0] == xxhash.xxh3_64_intdigest(payload)
        assert (tmp_path / "same").read_bytes()[4096:] == payload
    finally:
        os.close(fd)
    for r, at in ((0, 0), (1, 270_000), (count - 1, size - 1)):
        bad = bytearray(row)
        bad[r * stride + at] ^= 1
        p = tmp_path / f"bad{r}"
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            assert pwrite_hash(fd, bytes(header), payload, 40, 100, others=bad, count=count, stride=stride) is None
            assert p.read_bytes()[:4] != bytes(header[:4])  # the header never went out
        finally:
            os.close(fd)
    for kw in ({"count": 3, "stride": stride}, {"others": row, "count": 4, "stride": stride},
               {"others": row, "count": 2, "stride": size - 1}, {"others": row, "count": -1, "stride": stride}):
        with pytest.raises(ValueError, match="others does not hold"):
            pwrite_hash(0, bytes(header), payload, 40, 100, **kw)
