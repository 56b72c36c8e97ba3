"""Side-by-side: vLLM's built-in ``fs`` tier vs ``KVFormatTier``, through vLLM's real tiering manager.

Same chunks, same medium, same thread counts; DeepSeek-V3-shaped blocks (61 layers x 64 tokens x 576 bf16,
4,497,408 bytes a block, one copy); TP in {1, 4, 8} x {replicated row, one slot per worker}.

* store GB/s: logical bytes (one copy of each chunk) / time from ``complete_store`` (the cascade) until
  every tier job has finished.
* load GB/s: logical bytes / time from the first ``lookup`` after the primary was emptied until every
  chunk is a HIT in the primary (lookup RETRY steps, promotion, verification and fan-out included).
* disk/block: bytes on the medium per block (``st_blocks`` x 512 summed over the files / blocks).

vLLM's C fast path (``vllm.fs_io_C``) does not load without CUDA, so the built-in tier runs its pure-Python
fallback here; the script says which path it measured. Usage::

    .venv/bin/python tools/bench_tier.py [--chunks 24] [--threads 4] [--media shm,disk] [--tp 1,4,8]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from vllm_harness import _STEP, Deployment, fs_tier, kvformat_tier, make_keys, make_payload  # noqa: E402

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402
from vllm.v1.kv_offload.tiering.fs import io as fs_io  # noqa: E402

LAYERS, TOKENS, WIDTH, DTYPE, MODEL = 61, 64, 576, "bfloat16", "deepseek-ai/DeepSeek-V3"


def disk_bytes(root: Path, suffix: str) -> tuple[int, int]:
    n = used = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(suffix):
                n += 1
                used += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return n, used


def run_one(tier: dict, root: Path, tp: int, replicated: bool, bpc: int, chunks: int, payloads: list[bytes],
            suffix: str) -> dict:
    keys = make_keys(chunks, f"bench{tp}{replicated}")
    with Deployment([tier], tp=tp, replicated=replicated, blocks_per_chunk=bpc, n_layers=LAYERS,
                    tokens_per_block=TOKENS, width=WIDTH, dtype=DTYPE, model=MODEL, num_chunks=chunks + 2) as dep:
        t = dep.tier()
        if hasattr(t, "wait_scanned"):
            t.wait_scanned(30)
        mgr = dep.mgr
        ctx = dep._ctx()
        with mgr.lock:
            mgr.on_new_request(ctx)
            out = mgr.prepare_store(keys, ctx)
            assert out is not None and len(out.keys_to_store) == chunks
            for i, cid in enumerate(out.store_spec.chunk_ids):
                dep._write_row(int(cid), payloads[i])
        t0 = time.perf_counter()
        with mgr.lock:
            mgr.complete_store(list(out.keys_to_store), ctx)
            mgr.on_request_finished(ctx)
            mgr.on_schedule_end(_STEP)
        dep.flush(timeout=600)
        t_store = time.perf_counter() - t0
        files, used = disk_bytes(root, suffix)
        assert files == chunks, (files, chunks)
        dep.evict_primary()
        ctx = dep._ctx()
        with mgr.lock:
            mgr.on_new_request(ctx)
        pending = set(keys)
        t0 = time.perf_counter()
        while pending:
            with mgr.lock:
                for k in list(pending):
                    r = mgr.lookup(k, ctx)
                    if r is LookupResult.HIT:
                        pending.discard(k)
                    elif r is LookupResult.MISS:
                        raise RuntimeError("a stored chunk missed")
                mgr.on_schedule_end(_STEP)
            if pending:
                time.sleep(0.0005)
        t_load = time.perf_counter() - t0
        with mgr.lock:
            spec = mgr.prepare_load(keys, ctx)
            for k, cid in zip(keys, spec.chunk_ids):
                assert dep._read_row(int(cid), raw=False) == payloads[keys.index(k)]
            mgr.complete_load(keys, ctx)
            mgr.on_request_finished(ctx)
            mgr.on_schedule_end(_STEP)
        logical = chunks * dep.slot_bytes
    return {"store": logical / t_store / 1e9, "load": logical / t_load / 1e9, "disk": used / (chunks * bpc)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--bpc", type=int, default=1, help="blocks per chunk")
    ap.add_argument("--threads", type=int, default=4, help="read and write threads of both tiers")
    ap.add_argument("--media", default="shm,disk")
    ap.add_argument("--tp", default="1,4,8")
    ap.add_argument("--disk-dir", default=None, help="a directory on the local disk (default: the system temp dir)")
    ap.add_argument("--verify", default="true", choices=["true", "false"])
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; the best is reported")
    ap.add_argument("--kvf-o-direct", default="off", choices=["off", "auto"],
                    help="KVFormatTier's o_direct (default: its default, off)")
    a = ap.parse_args(argv)
    path = "C fast path (vllm.fs_io_C)" if fs_io._HAS_FSIO_C else "pure-Python fallback (vllm.fs_io_C needs CUDA)"
    slot = LAYERS * TOKENS * WIDTH * 2 * a.bpc
    print(f"vLLM built-in fs tier: {path}. Chunks of {a.bpc} DeepSeek-V3 block(s): {LAYERS} layers x {TOKENS} tokens x "
          f"{WIDTH} {DTYPE} = {slot:,} logical bytes; {a.chunks} chunks per run; {a.threads} read + {a.threads} "
          f"write threads per tier; kvformat verify={a.verify}, compression none, o_direct={a.kvf_o_direct}; "
          f"best of {a.repeats} runs.")
    if fs_io.O_DIRECT:
        print("On media that accept O_DIRECT (not tmpfs) the built-in tier writes and reads with O_DIRECT (its probe); "
              "kvformat writes buffered and reads as its o_direct says.")
    print("GB/s are logical bytes (one copy of each chunk) per second; disk/block is allocated bytes per block.")
    payloads = [make_payload(f"p{i}", slot) for i in range(a.chunks)]
    media = {"shm": "/dev/shm", "disk": a.disk_dir or tempfile.gettempdir()}
    hdr = (f"{'medium':6} {'TP':>2} {'row':10} | {'fs store':>8} {'kvf store':>9} {'ratio':>6} | {'fs load':>8} "
           f"{'kvf load':>8} {'ratio':>6} | {'fs disk/blk':>11} {'kvf disk/blk':>12} {'ratio':>6}")
    print(hdr)
    print("-" * len(hdr))
    for medium in a.media.split(","):
        for tp in (int(x) for x in a.tp.split(",")):
            for replicated in (True, False):
                res: dict[str, dict] = {}
                for rep in range(a.repeats):  # interleaved; best of the repeats (the machine is shared)
                    for name in ("fs", "kvf"):
                        os.sync()  # neither contender pays for the other's (or a previous run's) writeback
                        root = Path(tempfile.mkdtemp(prefix=f"bench_{name}_", dir=media[medium]))
                        try:
                            if name == "fs":
                                tier = fs_tier(str(root), n_read_threads=a.threads, n_write_threads=a.threads)
                            else:
                                tier = kvformat_tier(str(root), read_threads=a.threads, write_threads=a.threads,
                                                     verify=a.verify == "true", o_direct=a.kvf_o_direct)
                            r = run_one(tier, root, tp, replicated, a.bpc, a.chunks, payloads,
                                        ".bin" if name == "fs" else ".kvf")
                        finally:
                            shutil.rmtree(root, ignore_errors=True)
                            gc.collect()
                        best = res.setdefault(name, r)
                        best["store"] = max(best["store"], r["store"])
                        best["load"] = max(best["load"], r["load"])
                f, k = res["fs"], res["kvf"]
                row = "replicated" if replicated else "per_worker"
                print(f"{medium:6} {tp:>2} {row:10} | {f['store']:8.2f} {k['store']:9.2f} {k['store'] / f['store']:6.2f} | "
                      f"{f['load']:8.2f} {k['load']:8.2f} {k['load'] / f['load']:6.2f} | {f['disk'] / 1e6:9.2f}MB "
                      f"{k['disk'] / 1e6:10.2f}MB {k['disk'] / f['disk']:6.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
