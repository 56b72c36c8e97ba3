"""Store and load throughput of kvformat's remote store against raw s3fs and raw boto3, on a loopback S3 server.

Starts moto's S3 server (tests/s3_server.py) on 127.0.0.1 in its own process, or uses Ceph's RADOS gateway
(``--rgw ENV``: the env file tools/rgw_up.sh wrote), and moves the same file bytes both ways, with 1, 4 and 16
requests in flight:

* store: kvformat ``FsspecStore.put_many`` (encode = header + xxh3 of the payload, then one conditional
  PUT per block) vs raw ``S3FileSystem.pipe({path: bytes}, batch_size=N)`` of the already-encoded files.
* load: kvformat ``FsspecStore.read_many_into`` (one GET per block, header/layout/key checks, xxh3
  verification, copy into a preallocated destination) vs raw ``S3FileSystem.cat(paths, batch_size=N)``
  (which sends a HEAD before each GET) and raw single-GET ``_cat_file(max_concurrency=1)`` gathered N at a
  time, the tighter limit. The ratio is against the faster raw variant.
* raw boto3 (what ``aws s3 cp`` does per object, without its multipart split: every file is under 8 MiB):
  ``put_object``/``get_object`` from N threads sharing one client, for both directions; also a raw variant.

Each cell is the best of ``--reps`` runs (interleaved kvformat/raw). Usage::

    .venv/bin/python tools/bench_remote.py [--blocks 64] [--layers 27] [--reps 3] [--rgw /tmp/kvf-rgw/env]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import kvformat as K  # noqa: E402
from kvformat import block_relpath  # noqa: E402
from kvformat.storage._fsspec import FsspecStore  # noqa: E402
from s3_server import S3Server, rgw_env  # noqa: E402


@contextlib.contextmanager
def gateway(env_file: str):  # type: ignore[no-untyped-def]
    """tools/rgw_up.sh's gateway as a server object (started and stopped by rgw_up.sh/rgw_down.sh, not here)."""
    from s3_server import RGWServer

    env = rgw_env(env_file)
    assert env is not None
    srv = RGWServer(env)
    srv.start()
    yield srv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64, help="blocks per measurement")
    ap.add_argument("--layers", type=int, default=27, help="DeepSeek-V2-Lite has 27 (a 486 KiB block)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inflight", default="1,4,16")
    ap.add_argument("--rgw", default=os.environ.get("KVFORMAT_RGW_ENV"), help="tools/rgw_up.sh's env file")
    a = ap.parse_args(argv)
    import boto3
    from botocore.config import Config

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
    with (gateway(a.rgw) if a.rgw else S3Server()) as srv:
        bucket = srv.make_bucket()
        opts = srv.storage_options()
        kind = f"Ceph RADOS gateway ({a.rgw})" if a.rgw else "moto S3 server"
        print(f"{kind} at {srv.endpoint} (own process); {a.blocks} blocks of {len(files[0]):,} bytes "
              f"({nbytes / 2**20:.1f} MiB) per measurement, best of {a.reps}; {os.cpu_count()} CPUs")
        for n in [int(x) for x in a.inflight.split(",")]:
            raw = s3fs.S3FileSystem(**opts, skip_instance_cache=True, use_listings_cache=False,
                                    config_kwargs={"max_pool_connections": max(10, n)})
            best = {"kvf_put": 1e9, "raw_pipe": 1e9, "boto_put": 1e9, "kvf_get": 1e9, "raw_cat": 1e9,
                    "raw_get": 1e9, "boto_get": 1e9}
            bc = boto3.client("s3", endpoint_url=opts["endpoint_url"], aws_access_key_id=opts["key"],
                              aws_secret_access_key=opts["secret"], region_name="us-east-1",
                              config=Config(max_pool_connections=max(10, n), retries={"max_attempts": 1}))
            pool = concurrent.futures.ThreadPoolExecutor(n)
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

                bkeys = [f"boto-{n}-{tag}/{block_relpath(L, k)}" for k in keys]

                def boto_put() -> None:
                    list(pool.map(lambda kf: bc.put_object(Bucket=bucket, Key=kf[0], Body=kf[1]), zip(bkeys, files)))

                def boto_get() -> None:
                    got = pool.map(lambda k: bc.get_object(Bucket=bucket, Key=k)["Body"].read(), bkeys)
                    assert sum(len(b) for b in got) == nbytes

                # alternate who goes first: the server's state grows, and neither side should always pay for it
                order = [("kvf_put", kvf_put), ("raw_pipe", raw_pipe), ("boto_put", boto_put), ("kvf_get", kvf_get),
                         ("raw_cat", raw_cat), ("raw_get", raw_get), ("boto_get", boto_get)]
                if rep % 2:
                    order = [order[2], order[1], order[0], order[6], order[5], order[4], order[3]]
                for name, fn in order:
                    c0, t0 = time.process_time(), time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - t0)
                    cpu[name] = min(cpu[name], time.process_time() - c0)
                assert bytes(outs[-1]) == bytes(pays[-1])
            pool.shutdown()
            mb = nbytes / 2**20
            raw_store = min(best["raw_pipe"], best["boto_put"])
            raw_load = min(best["raw_cat"], best["raw_get"], best["boto_get"])
            rows.append((n, mb / best["kvf_put"], mb / best["raw_pipe"], mb / best["boto_put"],
                         raw_store / best["kvf_put"], mb / best["kvf_get"], mb / best["raw_cat"],
                         mb / best["raw_get"], mb / best["boto_get"], raw_load / best["kvf_get"]))
            cpus.append((n, cpu["kvf_put"], cpu["raw_pipe"], cpu["boto_put"], cpu["kvf_get"], cpu["raw_cat"],
                         cpu["raw_get"], cpu["boto_get"]))
    print()
    print("| in flight | kvformat store MiB/s | raw s3fs pipe MiB/s | raw boto3 put MiB/s | store ratio (vs faster raw) "
          "| kvformat load MiB/s | raw s3fs cat MiB/s | raw s3fs 1-GET MiB/s | raw boto3 get MiB/s "
          "| load ratio (vs fastest raw) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, kp, rp, bp, sr, kg, rc, rg, bg, lr in rows:
        print(f"| {n} | {kp:.1f} | {rp:.1f} | {bp:.1f} | {sr:.2f}x | {kg:.1f} | {rc:.1f} | {rg:.1f} | {bg:.1f} "
              f"| {lr:.2f}x |")
    print()
    print("client CPU per measurement (ms, best of runs; the part kvformat adds, free of server noise):")
    print()
    print("| in flight | kvformat store | raw pipe | boto3 put | kvformat load | raw cat | raw 1-GET | boto3 get |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, *ms in cpus:
        print(f"| {n} | " + " | ".join(f"{x * 1e3:.0f}" for x in ms) + " |")
    worst = min(min(r[4], r[9]) for r in rows)
    print(f"\nworst ratio {worst:.2f}x (target >= 0.8x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
