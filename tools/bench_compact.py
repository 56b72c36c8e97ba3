"""Compaction throughput vs ``cp -r`` of the same tree (the limit), and inspect's header scan rate.

    .venv/bin/python tools/bench_compact.py [--dir DIR] [--files N] [--tp 8] [--layers 61] [--scan-files 10000]

One run builds a legacy vLLM fs-tier tree (per-worker rows, DeepSeek-shaped: 64 tokens x 576 bf16 per
layer), then times, on the same tree and with the page cache warm for every contender:
  * ``cp -r SRC DST`` (copies every byte: the I/O limit for touching the whole tree);
  * ``kvformat compact SRC DST --jobs 1`` and ``--jobs 2`` (reads every byte, writes 1/TP of them);
  * ``kvformat inspect ROOT --no-verify`` (header-only) over a ``--scan-files`` kvformat tree.
Throughput is source bytes per second. Each contender writes a fresh DST, removed after its run; the
contenders run interleaved ``--repeats`` times and the median is reported (the machine may be shared).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvformat import BlockKey, CanonicalLayout, Provenance, block_relpath  # noqa: E402
from kvformat.legacy import ROW_ALIGN, legacy_fields, write_legacy_row  # noqa: E402
from kvformat.format._consts import round_up  # noqa: E402
from kvformat.storage import open_store  # noqa: E402

MODEL = "deepseek-ai/DeepSeek-V3"


def build_legacy(root: str, n_files: int, tp: int, n_layers: int) -> int:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(n_layers)]
    fields = legacy_fields(MODEL, tokens_per_hash=64, blocks_per_file=1, dtype="bfloat16",
                           kv_cache_groups=[{"tokens_per_block": 64, "layer_names": names}], tp=tp)
    slot = n_layers * 64 * 576 * 2
    row_bytes = round_up(slot * tp, ROW_ALIGN)
    rng = np.random.default_rng(0)
    total = 0
    for i in range(n_files):
        p = rng.integers(0, 256, slot, dtype=np.uint8).tobytes()
        row = bytearray(row_bytes)
        for r in range(tp):
            row[r * slot:(r + 1) * slot] = p
        write_legacy_row(root, fields, hashlib.sha256(f"b/{i}".encode()).hexdigest(), row)
        total += row_bytes
    return total


def build_kvf(root: str, n: int) -> None:
    store = open_store(root)
    lay = CanonicalLayout.uniform(MODEL, "bfloat16", [f"model.layers.{i}.self_attn.attn" for i in range(61)], 64, 576)
    store.ensure_namespace(lay)
    from kvformat.format._block import encode

    pay = np.zeros(lay.payload_bytes, dtype=np.uint8)
    hdr, _ = encode(pay, lay, BlockKey("00" * 32), provenance=Provenance(tp=8, row="per_worker"))
    # Headers are what the scan reads; payloads are sparse (truncate) so the tree stays small on disk.
    for i in range(n):
        h = hashlib.sha256(f"s/{i}".encode()).hexdigest()
        hdr, _ = encode(pay, lay, BlockKey(h), provenance=Provenance(tp=8, row="per_worker"))
        p = os.path.join(store.root, block_relpath(lay, BlockKey(h)))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(hdr)
            f.truncate(len(hdr) + lay.payload_bytes)


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds user+sys of the child): on a shared, loaded machine both matter."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def warm(root: str) -> None:
    for d, _s, fs in os.walk(root):
        for f in fs:
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(1 << 24):
                    pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir under /tmp, removed)")
    ap.add_argument("--files", type=int, default=32)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--scan-files", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs per contender (median reported)")
    a = ap.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="kvf-bench-")
    os.makedirs(base, exist_ok=True)
    kvf = [sys.executable, "-c", "import sys; from kvformat.cli import main; sys.exit(main())"]
    try:
        src = os.path.join(base, "legacy")
        total = build_legacy(src, a.files, a.tp, a.layers)
        contenders = (("cp -r", ["cp", "-r", src, "{dst}"]),
                      ("compact --jobs 1", kvf + ["compact", "-q", src, "{dst}", "--jobs", "1"]),
                      ("compact --jobs 2", kvf + ["compact", "-q", src, "{dst}", "--jobs", "2"]))
        times: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in contenders}
        out_bytes: dict[str, int] = {}
        dst = os.path.join(base, "out")
        for _rep in range(a.repeats):  # interleaved, so a burst of load elsewhere hits every contender alike
            for name, cmd in contenders:
                shutil.rmtree(dst, ignore_errors=True)
                warm(src)
                os.sync()  # start each contender with no dirty pages of the previous one
                wall, cpu = timed([c.replace("{dst}", dst) for c in cmd])
                t = time.perf_counter()
                os.sync()  # what it wrote, on disk: the durable cost
                times[name].append((wall, cpu, wall + time.perf_counter() - t))
                out_bytes[name] = sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(dst) for f in fs)
                shutil.rmtree(dst, ignore_errors=True)
        med = {name: statistics.median(x[0] for x in ts) for name, ts in times.items()}
        dur = {name: statistics.median(x[2] for x in ts) for name, ts in times.items()}
        cp, cp_dur = total / med["cp -r"], total / dur["cp -r"]
        print(f"legacy tree: {a.files} files x {total // a.files} B (TP={a.tp}, {a.layers} layers, 64 tok x 576 bf16), "
              f"{total / 2**20:.0f} MiB, page cache warm, synced before each run; times include interpreter "
              f"start-up; median of {a.repeats} interleaved runs; load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} cores")
        print(f"{'contender':<18} {'wall s':>8} {'cpu s':>7} {'MiB/s':>8} {'vs cp -r':>9} {'+sync s':>8} "
              f"{'MiB/s':>8} {'vs cp -r':>9} {'bytes written':>14}")
        for name, ts in times.items():
            cpu = statistics.median(x[1] for x in ts)
            r, rd = total / med[name], total / dur[name]
            print(f"{name:<18} {med[name]:8.3f} {cpu:7.3f} {r / 2**20:8.1f} {r / cp:8.2f}x {dur[name]:8.3f} "
                  f"{rd / 2**20:8.1f} {rd / cp_dur:8.2f}x {out_bytes[name]:14d}")
        print("target: compact --jobs 2 >= 0.70x cp -r  (wall: until the command returns; +sync: until its "
              "writes are on disk)")

        scan = os.path.join(base, "scan")
        build_kvf(scan, a.scan_files)
        scan_cmd = kvf + ["inspect", "--no-verify", scan]
        subprocess.run(scan_cmd, check=False, stdout=subprocess.DEVNULL)  # warm the page cache
        st_wall, st_cpu = timed(kvf + ["--help"])
        dt, cpu = timed(scan_cmd)
        n = a.scan_files
        print()
        print(f"{'inspect --no-verify':<24} {'files':>6} {'wall s':>8} {'files/s':>9} {'cpu s':>7} {'files/cpu-s':>12}")
        print(f"{'(whole command)':<24} {n:>6} {dt:8.3f} {n / dt:9.0f} {cpu:7.3f} {n / cpu:12.0f}")
        print(f"{'(minus interpreter start)':<24} {n:>6} {dt - st_wall:8.3f} {n / (dt - st_wall):9.0f} "
              f"{cpu - st_cpu:7.3f} {n / (cpu - st_cpu):12.0f}")
        print("target: 5000 files/s")
    finally:
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
