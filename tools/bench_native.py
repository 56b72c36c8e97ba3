"""Native hash and fused I/O against python-xxhash and the plain two-pass path, on one file size.

    python tools/bench_native.py [--bytes 4497408] [--dir /dev/shm] [--repeats 7]

Prints GB/s and CPU ms per GB (this thread's CPU time) medians (min-max) of: memcpy, xxh3 (python-xxhash, native
scalar, AVX2, AVX-512 where the CPU has them), a read of header+payload then a separate hash (today's path) vs the
fused read at several piece sizes, and the same for writes. Interleaved repeats: each round runs every case once.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from kvformat.format import _native  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=4_497_408)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=20, help="operations per timing")
    a = ap.parse_args()
    N = _native._native
    if N is None:
        sys.exit("the native extension is not built: python setup.py build_ext --inplace")
    n = a.bytes
    src = np.frombuffer(os.urandom(n), dtype=np.uint8).copy()
    dst = np.empty(n, dtype=np.uint8)
    head = bytearray(8192)
    header = bytes(8192)
    path = os.path.join(a.dir, f"kvf-bench-native-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.pwritev(fd, [header, src], 0)
    mv_src, mv_dst = memoryview(src), memoryview(dst)

    def memcpy() -> None:
        ctypes.memmove(dst.ctypes.data, src.ctypes.data, n)

    def py_hash() -> None:
        xxhash.xxh3_64_intdigest(mv_src)

    def nat(kernel: str):  # type: ignore[no-untyped-def]
        def f() -> None:
            N.set_simd(kernel)
            N.xxh3_64(mv_src)
        return f

    def read_then_hash() -> None:  # today's path: one preadv, then a second pass to hash
        os.preadv(fd, [head, mv_dst], 0)
        xxhash.xxh3_64_intdigest(mv_dst)

    def fused_read(piece: int):  # type: ignore[no-untyped-def]
        return lambda: N.pread_hash(fd, head, mv_dst, 0, piece=piece)

    def read_only() -> None:
        os.preadv(fd, [head, mv_dst], 0)

    def write_then_hash() -> None:
        xxhash.xxh3_64_intdigest(mv_src)
        os.pwritev(fd, [header, mv_src], 0)

    def fused_write(piece: int):  # type: ignore[no-untyped-def]
        return lambda: N.pwrite_hash(fd, header, mv_src, 100, 200, piece=piece)

    def write_only() -> None:
        os.pwritev(fd, [header, mv_src], 0)

    kernels = ["scalar"] + (["avx2"] if N.have_avx2() else []) + (["avx512"] if N.have_avx512() else [])
    cases = {"memcpy": memcpy, "xxh3 python-xxhash": py_hash}
    cases.update({f"xxh3 native {k}": nat(k) for k in kernels})
    cases["read only (preadv)"] = read_only
    cases["read + separate xxh3"] = read_then_hash
    for p in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
        cases[f"fused read piece {p >> 10} KiB"] = fused_read(p)
    cases["write only (pwritev)"] = write_only
    cases["xxh3 + write"] = write_then_hash
    for p in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
        cases[f"fused write piece {p >> 10} KiB"] = fused_write(p)
    res: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.repeats):
        for k, f in cases.items():
            N.set_simd("auto")
            f()
            c, t = time.thread_time(), time.perf_counter()
            for _ in range(a.inner):
                f()
            res[k].append(n * a.inner / (time.perf_counter() - t) / 1e9)
            # CPU of this thread, kernel time in the syscalls included: on a shared machine the stable figure
            cpu[k].append((time.thread_time() - c) / (n * a.inner / 1e9))
    N.set_simd("auto")
    os.close(fd)
    os.unlink(path)
    print(f"{n:,} bytes on {a.dir}, {a.repeats} interleaved repeats x {a.inner} ops: GB/s and CPU ms per GB "
          f"(thread CPU time), median (min-max). xxh3 kernel in use by default: {N.simd()}")
    for k, v in res.items():
        c = [x * 1e3 for x in cpu[k]]
        print(f"  {k:28s} {statistics.median(v):6.2f}  ({min(v):.2f}-{max(v):.2f}) GB/s   "
              f"{statistics.median(c):7.1f}  ({min(c):.1f}-{max(c):.1f}) CPU ms/GB")


if __name__ == "__main__":
    main()
