"""Where a chunk's CPU goes: per-step accounting of vLLM's built-in fs tier and ``KVFormatTier``, side by side.

The same cycle as tools/bench_tier.py (vLLM's real tiering manager, the chunks split over ``--requests``
requests completed together, /dev/shm, replicated rows) with every step of both tiers' per-chunk paths wrapped in
counters of thread CPU time (``time.thread_time_ns``) and wall time. Steps nest (a chunk's glue holds its
open, read, parse ...): each row is the step's own time, its children's subtracted, so the rows add up.

* ``total`` is the process's CPU (getrusage, every thread) over the phase, per chunk, averaged over the repeats
  like the rows (its median and range per repeat on the last line): the same figure as bench_tier's CPU s/GB.
* ``unaccounted`` = total - the rows: thread-pool wake-ups and hand-offs, the vLLM manager's own work on the
  scheduler thread, interpreter switches, and the wrappers' own cost (estimated separately from a calibration
  loop and shown on its own row, ``instrumentation``).
* wall - CPU of a GIL-holding step is time it waited (for the GIL or for a core: with both cores busy the two
  cannot be told apart); of a GIL-free native step, time the kernel kept it off a core.
* ``minor faults``: page faults per chunk over the phase (getrusage ``ru_minflt``).

Usage::

    python tools/bench_steps.py [--shape v3|dsa] [--chunks 24] [--requests 4] [--threads 4] [--repeats 5]
        [--tp 8] [--verify true|false] [--peer python|c]
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_tier as BT  # noqa: E402  (puts tests/ and the repo on sys.path, imports vLLM)
from vllm_harness import Deployment, fs_tier, kvformat_tier, make_payload  # noqa: E402

from vllm.v1.kv_offload.tiering.fs import io as fs_io  # noqa: E402

_TL = threading.local()
# (tier, phase, step) -> [cpu ns, wall ns, calls]
ACC: dict[tuple[str, str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0])


class Phase:
    tier = "-"
    phase = "-"


def _wrap(step: str, f: Callable[..., Any]) -> Callable[..., Any]:
    tt, pc = time.thread_time_ns, time.perf_counter_ns

    def w(*a: Any, **kw: Any) -> Any:
        st = _TL.__dict__.setdefault("stack", [])
        st.append([0, 0])
        c0, w0 = tt(), pc()
        try:
            return f(*a, **kw)
        finally:
            dc, dw = tt() - c0, pc() - w0
            ch = st.pop()
            rec = ACC[(Phase.tier, Phase.phase, step)]
            rec[0] += dc - ch[0]
            rec[1] += dw - ch[1]
            rec[2] += 1
            if st:
                st[-1][0] += dc
                st[-1][1] += dw
    w.__wrapped__ = f  # type: ignore[attr-defined]
    return w


SAVED: list[tuple[Any, str, Any]] = []


def patch(obj: Any, name: str, step: str) -> None:
    f = getattr(obj, name)
    SAVED.append((obj, name, f))
    setattr(obj, name, _wrap(step, f))


def instrument() -> None:
    """Wrap every step of both tiers' per-chunk paths (module attributes, so both tiers' calls go through)."""
    from kvformat.cache import _jobs, _lru, _pool, _rows
    # The row engine's paths hold their own references to the format's calls (one module each since issue 32).
    try:
        from kvformat.cache import _row_load, _row_store
    except ImportError:  # an older checkout: one module
        _row_load = _row_store = _rows  # type: ignore[misc]
    from kvformat.cache._counters import Counters
    from kvformat.format import _fused, _native
    from kvformat.vllm import _tier
    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager
    from vllm.v1.kv_offload.tiering.fs import thread_pool as fs_pool

    # the system calls, whoever makes them
    for name, step in (("open", "open"), ("close", "close"), ("fstat", "fstat"), ("readv", "payload read (readv)"),
                       ("write", "payload write (write)"), ("replace", "publish: rename"),
                       ("link", "publish: link"), ("unlink", "publish: unlink temp"), ("fsync", "fsync"),
                       ("makedirs", "makedirs"), ("preadv", "payload read (preadv)")):
        patch(os, name, step)
    patch(os.path, "exists", "exists check")
    patch(os.path, "isdir", "parent directory check")
    # kvformat
    patch(_native, "pread_hash", "payload read + xxh3 (native, GIL free)")
    patch(_native, "pwrite_hash", "payload write + xxh3 (native, GIL free)")
    if getattr(_native, "read_file_hash", None) is not None:
        patch(_native, "read_file_hash", "open+fstat+read+xxh3+close (native, GIL free)")
    patch(_row_store, "xxh3_64", "replica xxh3")
    patch(_fused, "decode_header", "header parse + hxxh3 check")
    patch(_fused, "check_expected", "layout + key check")
    patch(_fused, "_open_regular", "open (checks)")
    patch(_row_load, "read_into_fused", "read glue (read_into_fused)")
    patch(_row_store, "write_block_fused", "write glue (write_block_fused)")
    patch(_fused, "temp_name", "temp name")
    patch(_fused, "publish", "publish glue")
    patch(_row_store, "encode_block", "header encode")
    try:  # the header templates (spec 11.1), where this checkout has them
        from kvformat.format import _template

        patch(_template.HeaderTemplates, "match", "header check by template (11.1)")
        patch(_template.HeaderTemplates, "learn", "header check by template (11.1)")
        patch(_template.HeaderEncoder, "encode", "header encode")
    except ImportError:
        pass
    patch(_rows.RowEngine, "load_chunk", "chunk glue (load_chunk)")
    patch(_rows.RowEngine, "store_chunk", "chunk glue (store_chunk)")
    patch(_rows.RowEngine, "_usable", "root health check")
    patch(_rows.RowEngine, "relpath", "key -> path")
    patch(_rows.RowEngine, "delete_victims", "eviction (LRU victims)")
    for mod in {_row_store, _row_load}:
        patch(mod, "BlockKey", "block key (checked)")
    for m in ("pin", "unpin", "touch", "add_found", "reserve", "add", "release", "victims", "remove"):
        patch(_lru.LRUIndex, m, "index (LRU, pins)")
    patch(Counters, "add", "counters")
    patch(_pool.BatchWorker, "submit", "mtime touch queue")
    patch(_jobs.JobBook, "finish", "job bookkeeping")
    patch(_jobs.JobBook, "submit", "tier API (scheduler thread)")
    patch(_jobs.JobBook, "take_finished", "tier API (scheduler thread)")
    for m in ("lookup", "get_finished_jobs", "take_events", "on_schedule_end", "on_request_finished",
              "on_new_request"):
        patch(_tier.KVFormatTier, m, "tier API (scheduler thread)")
    # vLLM's built-in fs tier
    patch(fs_io, "_load_block", "chunk glue (_load_block)")
    patch(fs_io, "_store_block", "chunk glue (_store_block)")
    patch(fs_io, "batch_load_block", "batch glue")
    patch(fs_io, "batch_store_block", "batch glue")
    patch(fs_io, "_validate_offsets", "batch glue")
    patch(fs_io, "_get_tmp_suffix", "temp name")
    patch(fs_pool.JobState, "task_done", "job bookkeeping")
    for m in ("lookup", "get_finished_jobs", "take_events", "on_schedule_end", "on_request_finished",
              "on_new_request", "submit_store", "submit_load"):
        patch(fs_manager.FileSystemTierManager, m, "tier API (scheduler thread)")


def calibrate(n: int = 200_000) -> float:
    """Wall ns a wrapped call costs beyond the call itself, measured on a no-op (single thread)."""
    def noop() -> None:
        return None
    w = _wrap("calibration", noop)
    t = time.thread_time_ns()
    for _ in range(n):
        noop()
    bare = time.thread_time_ns() - t
    t = time.thread_time_ns()
    for _ in range(n):
        w()
    ACC.pop(("-", "-", "calibration"), None)
    return max(0.0, (time.thread_time_ns() - t - bare) / n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="v3", choices=["v3", "dsa"])
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--verify", default="true", choices=["true", "false"])
    ap.add_argument("--peer", default="c" if fs_io._HAS_FSIO_C else "python", choices=["c", "python"])
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args(argv)
    peer = BT.install_peer(a.peer)
    if a.peer == "c":
        sys.exit("--peer c: its C batch loop is one opaque call; per-step accounting needs the Python path")
    layers, tpb, width, dtype, label = BT.SHAPES[a.shape]
    slot = layers * tpb * width * (2 if dtype == "bfloat16" else 1)
    payloads = [make_payload(f"p{i}", slot) for i in range(min(a.chunks, 8))]
    lnames = ([x for i in range(layers // 2) for x in (f"model.layers.{i}.self_attn.attn",
                                                      f"model.layers.{i}.self_attn.indexer.k_cache")]
              if a.shape == "dsa" else None)
    deps: dict[str, Any] = {}
    roots: dict[str, str] = {}
    for name in ("fs", "kvf"):
        roots[name] = tempfile.mkdtemp(prefix=f"steps_{name}_", dir=a.dir)
        tier = (fs_tier(roots[name], n_read_threads=a.threads, n_write_threads=a.threads) if name == "fs" else
                kvformat_tier(roots[name], read_threads=a.threads, write_threads=a.threads,
                              verify=a.verify == "true"))
        deps[name] = Deployment([tier], tp=a.tp, replicated=True, blocks_per_chunk=1, n_layers=layers,
                                tokens_per_block=tpb, width=width, dtype=dtype,
                                model="deepseek-ai/DeepSeek-V3.2" if a.shape == "dsa" else BT.MODEL,
                                num_chunks=a.chunks + 2, layer_names=lnames)
        t = deps[name].tier()
        if hasattr(t, "wait_scanned"):
            t.wait_scanned(30)
    overhead = calibrate()
    instrument()
    totals: dict[tuple[str, str], list[float]] = collections.defaultdict(list)  # per repeat, CPU us/chunk
    faults: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    gbps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    marks: dict[str, Any] = {}

    def on_phase(phase: str | None) -> None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        now = (r.ru_utime + r.ru_stime, r.ru_minflt)
        if Phase.phase in ("store", "load") and "t" in marks:
            key = (Phase.tier, Phase.phase)
            totals[key].append((now[0] - marks["t"][0]) * 1e6 / a.chunks)
            faults[key].append((now[1] - marks["t"][1]) / a.chunks)
        marks["t"] = now
        Phase.phase = phase or "-"

    try:
        for rep in range(a.repeats):
            for name in ("fs", "kvf"):
                os.sync()
                Phase.tier = name
                r = BT.cycle(deps[name], f"steps{name}{rep}", a.chunks, a.requests, payloads, Path(roots[name]),
                             ".bin" if name == "fs" else ".kvf", on_phase=on_phase)
                Phase.tier = "-"
                for op in ("store", "load"):
                    gbps[(name, op)].append(r[op])
                gc.collect()
    finally:
        for obj, name, f in reversed(SAVED):
            setattr(obj, name, f)
        for d in deps.values():
            d.close()
        import shutil

        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    n = a.repeats * a.chunks
    print(f"{label} ({slot:,} B), /dev/shm, TP={a.tp} replicated row, {a.chunks} chunks over {a.requests} requests, "
          f"{a.threads}+{a.threads} threads per tier, verify={a.verify}, {a.repeats} interleaved repeats. "
          f"Built-in tier: {peer}. Per chunk, microseconds: CPU (wall). A wrapped call costs ~{overhead / 1e3:.2f} us "
          f"of CPU itself (calibrated).")
    for op in ("store", "load"):
        print(f"\n{op}: GB/s fs {BT.med(gbps[('fs', op)])}, kvf {BT.med(gbps[('kvf', op)])}")
        steps = sorted({s for (t, p, s) in ACC if p == op},
                       key=lambda s: -max(ACC.get((t, op, s), [0])[0] for t in ("fs", "kvf")))
        print(f"  {'step':44s} {'built-in fs':>22s} {'kvformat':>22s}")
        acc_sum = {t: 0.0 for t in ("fs", "kvf")}
        calls = {t: 0 for t in ("fs", "kvf")}
        for s in steps:
            cells = []
            for t in ("fs", "kvf"):
                cpu, wall, c = ACC.get((t, op, s), [0, 0, 0])
                acc_sum[t] += cpu / 1e3 / n
                calls[t] += c
                cells.append(f"{cpu / 1e3 / n:9.1f} ({wall / 1e3 / n:8.1f})" if c else f"{'-':>22s}")
            print(f"  {s:44s} {cells[0]:>22s} {cells[1]:>22s}")
        inst = {t: overhead * calls[t] / 1e3 / n for t in ("fs", "kvf")}
        # means, like the rows (sums over every repeat): a median here would not add up with them
        tot = {t: statistics.mean(totals[(t, op)]) for t in ("fs", "kvf")}
        print(f"  {'instrumentation (calibrated x calls)':44s} {inst['fs']:9.1f}{'':13s} {inst['kvf']:9.1f}")
        print(f"  {'unaccounted (pool, manager, switches)':44s} {tot['fs'] - acc_sum['fs'] - inst['fs']:9.1f}"
              f"{'':13s} {tot['kvf'] - acc_sum['kvf'] - inst['kvf']:9.1f}")
        print(f"  {'total CPU (getrusage, all threads)':44s} {tot['fs']:9.1f}{'':13s} {tot['kvf']:9.1f}"
              f"   kvf/fs {tot['kvf'] / tot['fs']:.2f}")
        print(f"  {'minor page faults per chunk':44s} {statistics.mean(faults[('fs', op)]):9.1f}{'':13s} "
              f"{statistics.mean(faults[('kvf', op)]):9.1f}")
        print(f"  {'total CPU per repeat, median (min-max)':44s} {BT.med(totals[('fs', op)]):>22s} "
              f"{BT.med(totals[('kvf', op)]):>22s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
