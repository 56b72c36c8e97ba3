"""The tier's own fixed CPU per chunk: ``RowEngine.load_chunk`` / ``store_chunk`` on one thread, through vLLM's real
manager set-up, for a DeepSeek-V3-shaped layout (61 layers, so the header is the real one) whose payload is tiny
(61 x 1 token x 8 bf16 = 976 bytes), so the I/O of the payload is negligible and what is left is the per-chunk
path: open, header check, index, counters, publish. Medians (min) of interleaved rounds, CPU us per chunk.

    python tools/bench_chunk_overhead.py [--rounds 7]

Run it in another checkout (``cd other && python /path/to/tools/bench_chunk_overhead.py``) to compare: it imports
kvformat from the current directory first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, os.getcwd())

from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args(argv)
    import kvformat

    root = tempfile.mkdtemp(dir=a.dir)
    dep = Deployment([kvformat_tier(root, read_threads=1, write_threads=1)], tp=8, replicated=True, n_layers=61,
                     tokens_per_block=1, width=8, dtype="bfloat16", model="deepseek-ai/DeepSeek-V3", num_chunks=4)
    try:
        keys = make_keys(64, "overhead")
        dep.store({k: make_payload(i, dep.slot_bytes) for i, k in enumerate(keys)})
        t = dep.tier()
        eng = t._target(keys[0])[0]
        hs = [t._target(k)[1] for k in keys]
        more = [t._target(k)[1] for k in make_keys(80 * a.rounds, "overhead-stores")]
        dep._write_row(0, make_payload("s", dep.slot_bytes))
        for h in hs:
            assert eng.load_chunk(h, 0)
        load, store = [], []
        for r in range(a.rounds):
            c = time.thread_time()
            for _ in range(10):
                for h in hs:
                    eng.load_chunk(h, 0)
            load.append((time.thread_time() - c) / (10 * len(hs)) * 1e6)
            c = time.thread_time()
            for h in more[r * 80:(r + 1) * 80]:
                eng.store_chunk(h, 0)
            store.append((time.thread_time() - c) / 80 * 1e6)
    finally:
        dep.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"kvformat from {os.path.dirname(kvformat.__file__)}; payload {dep.slot_bytes} B; CPU us per chunk, "
          f"median (min) of {a.rounds} rounds")
    print(f"  load_chunk  {statistics.median(load):7.1f} ({min(load):.1f})")
    print(f"  store_chunk {statistics.median(store):7.1f} ({min(store):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
