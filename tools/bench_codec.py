#!/usr/bin/env python
"""Throughput of kvformat on a DeepSeek-V3-shaped block (61 layers x 64 tokens x 576 bf16 = 4,497,408 bytes)
against the limit (raw os.write / os.readv of the same payload bytes into a preallocated buffer) and the peer
(safetensors.torch.save_file / load_file of the same 61 tensors), on /dev/shm and on the local disk.

Method: for each medium, every method writes its own set of FILES files (steady state, not one hot file) and
then reads them back (new files every pass, deleted untimed after it); each timed pass covers all files of a method; passes of the methods are interleaved
(method order rotates each repetition) and the median pass is reported. GB/s counts payload bytes
(4,497,408 per file) for every method, so the header and padding count as overhead.

- write: open + write + close (kvformat: encode = header + xxh3, temp file + rename), no fsync.
- read: open + read into a preallocated buffer + close; kvformat also checks the header and the xxh3
  of the payload (read+decode+verify); safetensors load_file allocates its tensors (its API) and verifies
  nothing.
- disk (cold): the disk read pass after posix_fadvise(DONTNEED) on every file, so reads come from the
  device, not the page cache (same treatment for every method). disk (warm) reads hit the page cache.

Usage: python tools/bench_codec.py [--files 24] [--reps 7] [--disk-dir DIR] [--no-cold]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import safetensors.torch  # noqa: E402

import kvformat as K  # noqa: E402
from kvformat.format._header import decode_header  # noqa: E402

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(61)]
LAYOUT = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16", NAMES, 64, 576)
PAYLOAD = LAYOUT.payload_bytes
PROV = K.Provenance(tp=8, row="replicated", writer="bench", created=1767225600)


def _payload() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(PAYLOAD // 2, generator=g) * 0.5).to(torch.bfloat16).view(torch.uint8)


def _keys(n: int) -> list[K.BlockKey]:
    return [K.BlockKey(f"{i:064x}") for i in range(n)]


# ---------------------------------------------------------------- methods

def raw_write(path: str, flat: torch.Tensor, tensors: dict[str, torch.Tensor], key: K.BlockKey) -> None:
    mv = memoryview(flat.numpy())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(mv):
            done += os.write(fd, mv[done:])
    finally:
        os.close(fd)


def raw_read(path: str, dst: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < len(dst):
            n = os.readv(fd, [dst[got:]])
            if n == 0:
                raise EOFError(path)
            got += n
    finally:
        os.close(fd)


def st_write(path: str, flat: torch.Tensor, tensors: dict[str, torch.Tensor], key: K.BlockKey) -> None:
    safetensors.torch.save_file(tensors, path)


def st_read(path: str, dst: memoryview) -> None:
    safetensors.torch.load_file(path)


def kvf_write(path: str, flat: torch.Tensor, tensors: dict[str, torch.Tensor], key: K.BlockKey) -> None:
    K.save_file(flat, path, LAYOUT, key, provenance=PROV)


def kvf_read(path: str, dst: memoryview) -> None:
    K.read_into(path, dst, expect=LAYOUT)


def kvz_write(path: str, flat: torch.Tensor, tensors: dict[str, torch.Tensor], key: K.BlockKey) -> None:
    K.save_file(flat, path, LAYOUT, key, provenance=PROV, codec="zstd", level=3)


METHODS: dict[str, tuple[Callable[..., None], Callable[[str, memoryview], None]]] = {
    "raw os.write/readv": (raw_write, raw_read),
    "safetensors.torch": (st_write, st_read),
    "kvformat": (kvf_write, kvf_read),
    "kvformat zstd-3": (kvz_write, kvf_read),
}


def _drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_medium(root: str, files: int, reps: int, cold: bool, stat: str = "median") -> dict[str, dict[str, float]]:
    flat = _payload()
    tensors = {n: t.view(torch.bfloat16).reshape(1, 64, 576)
               for n, t in zip(NAMES, flat.split(LAYOUT.chunk_bytes_per_layer))}
    keys = _keys(files)
    dst = memoryview(torch.empty(PAYLOAD, dtype=torch.uint8).numpy())
    for i in range(files):
        os.makedirs(os.path.join(root, f"{i}"), exist_ok=True)
    w: dict[str, list[float]] = {m: [] for m in METHODS}
    r: dict[str, list[float]] = {m: [] for m in METHODS}
    rc: dict[str, list[float]] = {m: [] for m in METHODS}
    order = list(METHODS)
    for rep in range(reps + 1):  # pass 0 warms up (allocations, first-touch of files) and is dropped
        order = order[1:] + order[:1]
        for m in order:
            write, read = METHODS[m]
            # New files every pass, as a tier stores new blocks (an overwrite would time freeing the old
            # file's pages too); the previous pass's files are deleted after the reads, untimed.
            paths = {m: [os.path.join(root, f"{i}", f"{m.split()[0]}-{i}-{rep}.kvf") for i in range(files)]}
            t0 = time.perf_counter()
            for p, k in zip(paths[m], keys):
                write(p, flat, tensors, k)
            t1 = time.perf_counter()
            for p in paths[m]:
                read(p, dst)
            t2 = time.perf_counter()
            if rep:
                w[m].append(t1 - t0)
                r[m].append(t2 - t1)
            if cold and rep:
                _drop_cache(paths[m])
                t3 = time.perf_counter()
                for p in paths[m]:
                    read(p, dst)
                rc[m].append(time.perf_counter() - t3)
            if rep == 0 and m == "kvformat":  # the kvformat read really produced the payload
                K.read_into(paths[m][0], dst, expect=LAYOUT)
                assert bytes(dst[:4096]) == flat.numpy()[:4096].tobytes()
            for p in paths[m]:
                os.unlink(p)
    pick = min if stat == "best" else statistics.median
    gbs = lambda ts: files * PAYLOAD / pick(ts) / 1e9  # noqa: E731
    out = {m: {"write": gbs(w[m]), "read": gbs(r[m])} for m in METHODS}
    if cold:
        for m in METHODS:
            out[m]["read_cold"] = gbs(rc[m])
    return out


def _fstype(path: str) -> str:
    """The filesystem type of the longest mount point above ``path`` (from /proc/mounts)."""
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                mp = parts[1]
                if os.path.realpath(path).startswith(mp.rstrip("/") + "/") or os.path.realpath(path) == mp:
                    if len(mp) >= len(best):
                        best, kind = mp, f"{parts[2]} on {parts[0]}"
    except OSError:
        pass
    return kind


def components(root: str, n: int = 300) -> None:
    """Where a read+verify of one block goes: best and median microseconds of each step (one hot file)."""
    import xxhash

    flat = _payload()
    p = os.path.join(root, "c.kvf")
    K.save_file(flat, p, LAYOUT, _keys(1)[0], provenance=PROV)
    raw = os.path.join(root, "c.raw")
    raw_write(raw, flat, {}, _keys(1)[0])
    dst = memoryview(torch.empty(PAYLOAD, dtype=torch.uint8).numpy())
    with open(p, "rb") as fh:
        head = fh.read(8192)
    counter = iter(range(1 << 30))

    def fresh(write: Callable[..., None]) -> Callable[[], None]:
        def run() -> None:
            q = os.path.join(root, f"w{next(counter)}")
            write(q, flat, {}, _keys(1)[0])
            os.unlink(q)  # inside the timing for both, so the pair stays comparable
        return run

    steps: dict[str, Callable[[], Any]] = {
        "raw create+write+close+unlink": fresh(raw_write),
        "save_file+unlink": fresh(kvf_write),
        "encode (xxh3 + header)": lambda: K.encode(flat, LAYOUT, _keys(1)[0], provenance=PROV),
        "raw open+readv+close": lambda: raw_read(raw, dst),
        "xxh3 of the payload": lambda: xxhash.xxh3_64_hexdigest(dst),
        "decode_header (61 layers)": lambda: decode_header(head),
        "read_into verify=False": lambda: K.read_into(p, dst, verify=False),
        "read_into verify=True": lambda: K.read_into(p, dst),
    }
    print(f"components on {root} ({_fstype(root)}), {n} runs each, load average {os.getloadavg()[0]:.1f}")
    for name, f in steps.items():
        f()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        ts.sort()
        print(f"  {name:<28} best {ts[0] * 1e6:8.1f} us   median {ts[n // 2] * 1e6:8.1f} us")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=24)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--disk-dir", default="/var/tmp", help="a directory on the local disk (not tmpfs)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache disk read pass")
    ap.add_argument("--stat", choices=["median", "best"], default="median",
                    help="which pass to report (best = fastest pass: less sensitive to other load on the machine)")
    ap.add_argument("--components", action="store_true", help="only time the steps of one read (best/median us)")
    a = ap.parse_args(argv)
    if a.components:
        root = tempfile.mkdtemp(prefix="kvf-bench-", dir="/dev/shm")
        try:
            components(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return 0
    media = [("/dev/shm", "/dev/shm", False), ("disk", a.disk_dir, not a.no_cold)]
    print(f"DeepSeek-V3 block: 61 layers x 64 tokens x 576 bf16 = {PAYLOAD:,} payload bytes; "
          f"{a.files} files per method, {a.stat} of {a.reps} passes; torch {torch.__version__}, "
          f"safetensors {safetensors.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    rows = []
    for label, base, cold in media:
        os.makedirs(base, exist_ok=True)
        root = tempfile.mkdtemp(prefix="kvf-bench-", dir=base)
        try:
            res = bench_medium(root, a.files, a.reps, cold, a.stat)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        rows.append((label, base, _fstype(base), res))
    raw, st = "raw os.write/readv", "safetensors.torch"
    hdr = f"{'medium':<18}{'method':<22}{'write GB/s':>11}{'vs raw':>8}{'vs st':>7}{'read GB/s':>11}{'vs raw':>8}{'vs st':>7}"
    print(hdr)
    print("-" * len(hdr))
    for label, base, fstype, res in rows:
        print(f"{label}: {base} ({fstype})")
        kinds = [("read", label)] + ([("read_cold", label + " (cold)")] if "read_cold" in res[raw] else [])
        for rk, lab in kinds:
            for m, v in res.items():
                wcol = (f"{v['write']:>11.2f}{v['write'] / res[raw]['write']:>7.2f}x"
                        f"{v['write'] / res[st]['write']:>6.2f}x") if rk == "read" else f"{'':>11}{'':>8}{'':>7}"
                print(f"{lab:<18}{m:<22}{wcol}{v[rk]:>11.2f}{v[rk] / res[raw][rk]:>7.2f}x{v[rk] / res[st][rk]:>6.2f}x")
            print()
    print(f"load average {os.getloadavg()[0]:.1f} at end (other processes on this machine share its CPUs)")
    print("targets: kvformat write >= 0.9x raw, read+verify >= 0.85x raw (both media), >= 1.0x safetensors both ways")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
