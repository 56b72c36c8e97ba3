"""kvformat's SGLang backend against SGLang's built-in file backend (HiCacheFile), side by side in one run.

Both run through SGLang 0.5.23's real classes (tests/sglang_harness.py): an MLA host pool of DeepSeek-V3's
shape (61 layers x 64 tokens x 576 bf16: 4.5 MB pages) in each host layout. kvformat is driven the way SGLang's
controller drives a v1 backend (``batch_set_v1`` / ``batch_get_v1`` on host indices); HiCacheFile the way it drives
the file backend (``_generic_page_set``: ``get_data_page`` + ``batch_set``; ``_generic_page_get``: ``batch_get``
into dummy pages + ``set_from_flat_data_page``). Each round stores a batch of fresh pages, then loads them into a
second pool; rounds alternate the two backends, and the table gives medians (min-max) of wall GB/s and of CPU
seconds per GB (getrusage, all threads of this process). Reads hit the page cache for both (written just before).

    .venv/bin/python tools/bench_sglang.py [--pages 32] [--rounds 3] [--roots /dev/shm,/tmp]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # noqa: E402
from sglang_harness import LAYOUTS, PAGE, attach, fill, host_pool, page_keys, storage_config  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    c0, t0 = _cpu(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, _cpu() - c0


def _file_backend_round(root: str, wpool: Any, widx: Any, rpool: Any, ridx: Any, keys: list[str]) -> tuple[float, ...]:
    hf = HiCacheFile(storage_config(wpool, {"file_storage_path": root}))

    def store() -> bool:
        data = [wpool.get_data_page(widx[i * PAGE]) for i in range(len(keys))]
        return hf.batch_set(keys, data)

    def load() -> int:
        dummy = [rpool.get_dummy_flat_data_page() for _ in keys]
        got = hf.batch_get(keys, dummy)
        for i, page in enumerate(got):
            assert page is not None
            rpool.set_from_flat_data_page(ridx[i * PAGE], page)
        return len(got)

    ok, ts, cs = _timed(store)
    assert ok
    _, tl, cl = _timed(load)
    return ts, cs, tl, cl


def _kvformat_round(root: str, wpool: Any, widx: Any, rpool: Any, ridx: Any, keys: list[str]) -> tuple[float, ...]:
    w = attach(wpool, root, read_threads=2, write_threads=2)
    r = attach(rpool, root, tp=2, rank=1, read_threads=2, write_threads=2)
    try:
        got, ts, cs = _timed(lambda: w.batch_set_v1(keys, widx))
        assert all(got)
        got, tl, cl = _timed(lambda: r.batch_get_v1(keys, ridx))
        assert all(got)
    finally:
        w.close()
        r.close()
    return ts, cs, tl, cl


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=32, help="pages per batch (SGLang batches up to 128)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--roots", default="/dev/shm," + tempfile.gettempdir(), help="comma-separated parent dirs")
    a = ap.parse_args()
    page_bytes = a.layers * PAGE * 576 * 2
    gb = a.pages * page_bytes / 1e9
    print(f"# {a.pages} pages of {page_bytes} bytes ({gb:.2f} GB) per batch, {a.rounds} rounds, CPU torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs (shared machine: medians and min-max)")
    print("| root | layout | backend | store GB/s | store CPU s/GB | load GB/s | load CPU s/GB |")
    print("|---|---|---|---|---|---|---|")
    ratios = []
    for parent in a.roots.split(","):
        for layout in LAYOUTS:
            # SGLang's page_first_direct pool indexes its per-layer views by page (pool/mla.py
            # _initialize_transfer_views), so it needs at least as many pages as layers.
            n = max(a.pages, a.layers // 2 + 1)
            wpool = host_pool(layout, layers=a.layers, pages=n)
            rpool = host_pool(layout, layers=a.layers, pages=n)
            widx = fill(wpool, a.pages, seed=1)
            ridx = rpool.alloc(a.pages * PAGE)
            res: dict[str, list[tuple[float, ...]]] = {"SGLang HiCacheFile": [], "kvformat": []}
            for rnd in range(a.rounds):
                keys = page_keys(list(range(rnd * 7 + 1, rnd * 7 + 1 + a.pages * PAGE)))
                for name, fn in (("SGLang HiCacheFile", _file_backend_round), ("kvformat", _kvformat_round)):
                    root = tempfile.mkdtemp(prefix="kvf-bench-sgl-", dir=parent)
                    try:
                        res[name].append(fn(root, wpool, widx, rpool, ridx, keys))
                    finally:
                        shutil.rmtree(root, ignore_errors=True)
            med = {}
            for name, rows in res.items():
                cols = list(zip(*rows))
                ts, cs, tl, cl = ([gb / t for t in cols[0]], [c / gb for c in cols[1]],
                                  [gb / t for t in cols[2]], [c / gb for c in cols[3]])

                def f(xs: list[float]) -> str:
                    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"
                med[name] = [statistics.median(x) for x in (ts, cs, tl, cl)]
                print(f"| {parent} | {layout} | {name} | {f(ts)} | {f(cs)} | {f(tl)} | {f(cl)} |")
            k, s = med["kvformat"], med["SGLang HiCacheFile"]
            ratios.append((parent, layout, k[0] / s[0], k[1] / s[1], k[2] / s[2], k[3] / s[3]))
    print("\n| root | layout | store speed kvformat/file | store CPU kvformat/file | load speed | load CPU |")
    print("|---|---|---|---|---|---|")
    for parent, layout, *r in ratios:
        print(f"| {parent} | {layout} | " + " | ".join(f"{x:.2f}x" for x in r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
