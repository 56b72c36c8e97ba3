"""Latency of the tier's LRU index at 10k, 100k and 1M files: today's index next to the one before issue 11.

Each size: an index full to ``max_bytes``; the main thread runs the store cycle (``reserve`` one file's
bytes -> victims -> ``add`` the new file), while ``--loaders`` threads run the load cycle (``pin``,
``touch``, ``unpin``) on random indexed files the whole time. Prints median and p99 per operation
and the ratio old/new (a ratio above 1 means the new index is faster).

The old index is imported from git history (``--old-rev``, default 62b3639, the last commit before the
rewrite) into a temporary module, so both run in one process on the same machine.

    python tools/bench_index.py                 # 10k, 100k, 1M
    python tools/bench_index.py --sizes 10000 --seconds 1
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvformat.cache._lru import LRUIndex as NewIndex  # noqa: E402

SIZE = 4_505_600  # one DeepSeek-V3 block file


def old_index_class(rev: str) -> Any:
    src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:kvformat/_tier/_lru.py"], check=True,
                         capture_output=True, text=True).stdout
    d = tempfile.mkdtemp(prefix="bench_index_")
    path = os.path.join(d, "old_lru.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("old_lru", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.LRUIndex


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(cls: Any, n: int, seconds: float, loaders: int, max_stores: int) -> dict[str, list[float]]:
    idx = cls(max_bytes=n * SIZE)
    names = [f"ns/{i:02x}/{i:08x}.kvf" for i in range(n)]
    for r in names:
        idx.add(r, SIZE)
    lat: dict[str, list[float]] = {"reserve": [], "pin": [], "touch": []}
    stop = threading.Event()
    forget = getattr(idx, "forget", None)

    def loader(seed: int) -> None:
        rnd = random.Random(seed)
        pins, touches = [], []
        clock = time.perf_counter
        while not stop.is_set():
            r = names[rnd.randrange(n)]
            t0 = clock()
            idx.pin(r)
            t1 = clock()
            idx.touch(r)
            t2 = clock()
            idx.unpin(r)
            pins.append(t1 - t0)
            touches.append(t2 - t1)
        lat["pin"] += pins
        lat["touch"] += touches

    threads = [threading.Thread(target=loader, args=(s,), daemon=True) for s in range(loaders)]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < deadline and i < max_stores:
        new = f"new/{i:08x}.kvf"
        t0 = time.perf_counter()
        victims = idx.reserve(SIZE)
        idx.add(new, SIZE, reserved=SIZE)
        lat["reserve"].append(time.perf_counter() - t0)
        if forget is not None:
            forget(r for r, _ in victims)  # the new index's bookkeeping after the deletes
        names[random.randrange(n)] = new  # loaders keep hitting files that exist
        i += 1
    stop.set()
    for t in threads:
        t.join()
    return lat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--seconds", type=float, default=3.0, help="measuring time per size and index")
    ap.add_argument("--loaders", type=int, default=2, help="threads running the load cycle meanwhile")
    ap.add_argument("--max-stores", type=int, default=20_000)
    ap.add_argument("--old-rev", default="62b3639")
    a = ap.parse_args(argv)
    old_cls = old_index_class(a.old_rev)
    print(f"LRU index latency, {a.loaders} loader threads, {a.seconds:g} s per cell "
          "(median, p99, max: microseconds; ops: how many ran)")
    hdr = f"{'files':>9} {'op':>8} {'old p50':>10} {'old p99':>10} {'new p50':>10} {'new p99':>10} " \
          f"{'p50 x':>8} {'p99 x':>8} {'old max':>10} {'new max':>10} {'ops old/new':>15}"
    print(hdr)
    print("-" * len(hdr))
    for n in a.sizes:
        got = {}
        for label, cls in (("old", old_cls), ("new", NewIndex)):
            got[label] = run(cls, n, a.seconds, a.loaders, a.max_stores)
        for op in ("reserve", "pin", "touch"):
            o, w = got["old"][op], got["new"][op]
            o50, o99, n50, n99 = (pct(o, 0.5) * 1e6, pct(o, 0.99) * 1e6, pct(w, 0.5) * 1e6, pct(w, 0.99) * 1e6)
            counts = f"{len(o)}/{len(w)}"
            print(f"{n:>9} {op:>8} {o50:>10.1f} {o99:>10.1f} {n50:>10.1f} {n99:>10.1f} "
                  f"{o50 / n50:>8.1f} {o99 / n99:>8.1f} {max(o) * 1e6:>10.0f} {max(w) * 1e6:>10.0f} {counts:>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
