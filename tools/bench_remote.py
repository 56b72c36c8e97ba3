"""Store and load throughput of kvformat's remote store against raw s3fs, on a loopback S3 server.

Starts moto's S3 server (tests/s3_server.py) on 127.0.0.1 in its own process and moves the same
file bytes both ways, with 1, 4 and 16 requests in flight:

* store: kvformat ``FsspecStore.put_many`` (encode = header + xxh3 of the payload, then one conditional
  PUT per block) vs raw ``S3FileSystem.pipe({path: bytes}, batch_size=N)`` of the already-encoded files.
* load: kvformat ``FsspecStore.read_many_into`` (one GET per block, header/layout/key checks, xxh3
  verification, copy into a preallocated destination) vs raw ``S3FileSystem.cat(paths, batch_size=N)``
  (which sends a HEAD before each GET) and raw single-GET ``_cat_file(max_concurrency=1)`` gathered N at a
  time, the tighter limit. The ratio is against the faster raw variant.

Each cell is the best of ``--reps`` runs (interleaved kvformat/raw). Usage::

    .venv/bin/python tools/bench_remote.py [--blocks 64] [--layers 27] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import kvformat as K  # noqa: E402
from kvformat import block_relpath  # noqa: E402
from kvformat.storage._fsspec import FsspecStore  # noqa: E402
from s3_server import S3Server  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64, help="blocks per measurement")
    ap.add_argument("--layers", type=int, default=27, help="DeepSeek-V2-Lite has 27 (a 486 KiB block)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inflight", default="1,4,16")
    a = ap.parse_args(argv)

    import s3fs
    from fsspec.asyn import sync

    L = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                                  [f"model.layers.{i}.self_attn.attn" for i in range(a.layers)], 16, 576)
    rng = np.random.default_rng(0)
    pays = [rng.integers(0, 256, L.payload_bytes, dtype=np.uint8) for _ in range(a.blocks)]
    keys = [K.BlockKey(uuid.UUID(int=i + 1).hex * 2) for i in range(a.blocks)]
    files = [b"".join(bytes(p) for p in K.encode(pay, L, k)) for pay, k in zip(pays, keys)]
    nbytes = sum(len(f) for f in files)
    rows = []
    cpus: list[tuple[int, float, float, float, float, float]] = []
    with S3Server() as srv:
        bucket = srv.make_bucket()
        opts = srv.storage_options()
        print(f"moto S3 server at {srv.endpoint} (own process); {a.blocks} blocks of {len(files[0]):,} bytes "
              f"({nbytes / 2**20:.1f} MiB) per measurement, best of {a.reps}; {os.cpu_count()} CPUs")
        for n in [int(x) for x in a.inflight.split(",")]:
            raw = s3fs.S3FileSystem(**opts, skip_instance_cache=True, use_listings_cache=False,
                                    config_kwargs={"max_pool_connections": max(10, n)})
            best = {"kvf_put": 1e9, "raw_pipe": 1e9, "kvf_get": 1e9, "raw_cat": 1e9, "raw_get": 1e9}
            cpu = dict(best)  # client-process CPU seconds (the server runs in its own process)
            outs = [bytearray(L.payload_bytes) for _ in range(a.blocks)]
            # one client each, warmed up (session, connection pool), as in a running deployment
            st = FsspecStore(f"s3://{bucket}/kvf-{n}", **opts, max_in_flight=n)
            st.put_many([(f"warm/{i}.kvf", [files[0]]) for i in range(n)], overwrite=True)
            raw.pipe({f"{bucket}/warm-{n}/{i}": files[0] for i in range(n)}, batch_size=n)
            for rep in range(a.reps):
                tag = uuid.uuid4().hex[:8]
                base = f"{bucket}/raw-{n}-{tag}"
                paths = [f"{base}/{block_relpath(L, k)}" for k in keys]
                items: list = []

                def kvf_put() -> None:
                    for pay, k in zip(pays, keys):
                        hdr, data = K.encode(pay, L, k)
                        items.append((f"{tag}/{block_relpath(L, k)}", [hdr, data]))
                    res = st.put_many(items)
                    assert res == [True] * a.blocks, res[:3]

                def raw_pipe() -> None:
                    raw.pipe(dict(zip(paths, files)), batch_size=n)

                def kvf_get() -> None:
                    got = st.read_many_into([(rel, o, k) for (rel, _), o, k in zip(items, outs, keys)], expect=L)
                    assert all(isinstance(g, K.BlockHeader) for g in got), got[:3]

                def raw_cat() -> None:
                    blobs = raw.cat(paths, batch_size=n)
                    assert sum(len(b) for b in blobs.values()) == nbytes

                async def gets() -> list[bytes]:
                    sem = asyncio.Semaphore(n)

                    async def one(p: str) -> bytes:
                        async with sem:
                            return await raw._cat_file(p, max_concurrency=1)

                    return await asyncio.gather(*(one(p) for p in paths))

                def raw_get() -> None:
                    assert sum(len(b) for b in sync(raw.loop, gets)) == nbytes

                # alternate who goes first: the server's state grows, and neither side should always pay for it
                order = [("kvf_put", kvf_put), ("raw_pipe", raw_pipe), ("kvf_get", kvf_get), ("raw_cat", raw_cat),
                         ("raw_get", raw_get)]
                if rep % 2:
                    order = [order[1], order[0], order[4], order[3], order[2]]
                for name, fn in order:
                    c0, t0 = time.process_time(), time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - t0)
                    cpu[name] = min(cpu[name], time.process_time() - c0)
                assert bytes(outs[-1]) == bytes(pays[-1])
            mb = nbytes / 2**20
            raw_load = min(best["raw_cat"], best["raw_get"])
            rows.append((n, mb / best["kvf_put"], mb / best["raw_pipe"], best["raw_pipe"] / best["kvf_put"],
                         mb / best["kvf_get"], mb / best["raw_cat"], mb / best["raw_get"],
                         raw_load / best["kvf_get"]))
            cpus.append((n, cpu["kvf_put"], cpu["raw_pipe"], cpu["kvf_get"], cpu["raw_cat"], cpu["raw_get"]))
    print()
    print("| in flight | kvformat store MiB/s | raw s3fs pipe MiB/s | store ratio | kvformat load MiB/s "
          "| raw s3fs cat MiB/s | raw s3fs 1-GET MiB/s | load ratio (vs faster raw) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, kp, rp, sr, kg, rc, rg, lr in rows:
        print(f"| {n} | {kp:.1f} | {rp:.1f} | {sr:.2f}x | {kg:.1f} | {rc:.1f} | {rg:.1f} | {lr:.2f}x |")
    print()
    print("client CPU per measurement (ms, best of runs; the part kvformat adds, free of server noise):")
    print()
    print("| in flight | kvformat store | raw pipe | kvformat load | raw cat | raw 1-GET |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, a1, a2, a3, a4, a5 in cpus:
        print(f"| {n} | {a1 * 1e3:.0f} | {a2 * 1e3:.0f} | {a3 * 1e3:.0f} | {a4 * 1e3:.0f} | {a5 * 1e3:.0f} |")
    worst = min(min(r[3], r[7]) for r in rows)
    print(f"\nworst ratio {worst:.2f}x (target >= 0.8x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
