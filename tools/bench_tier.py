"""Side-by-side: vLLM's built-in ``fs`` tier vs ``KVFormatTier``, through vLLM's real tiering manager.

Same chunks, same medium, same thread counts, verification ON for kvformat; TP in {1, 4, 8} x {replicated row,
one slot per worker}; chunk shapes:

* ``v3``: 1 DeepSeek-V3 block, 61 layers x 64 tokens x 576 bf16 = 4,497,408 bytes;
* ``dsa``: a DeepSeek-V3.2 (DSA) block, 61 x (41,984 MLA fp8_ds_mla + 8,448 indexer) = 3,076,352 bytes, with
  vLLM's layer names (``…self_attn.attn`` and ``…self_attn.indexer.k_cache`` interleaved): kvformat derives the
  true 122-entry per-layer table (kvformat.layout's DSA rule), so the header is the real one;
* ``small``: 1 bf16 block of 16 tokens (vLLM's old default block size), 61 x 16 x 576 x 2 = 1,124,352 bytes.

Timings:

* store GB/s: logical bytes (one copy of each chunk) / time from ``complete_store`` (the cascade) until every
  tier job has finished; with ``--requests N`` the chunks are split over N requests completed together, so the
  built-in tier (one task per job) uses its pool too.
* load GB/s: logical bytes / time from the first ``lookup`` after the primary was emptied until every chunk is
  a HIT in the primary (lookup RETRY steps, promotion, verification and fan-out included).
* CPU s/GB: the process's CPU time (user + system, ``getrusage``: every thread, the tiers' I/O threads and the
  scheduler thread alike) over the same timed section, per logical GB. On a shared machine this is the stable
  figure (wall-clock ratios swing with what else runs). ``budget`` = the built-in tier's CPU s/GB plus one hash
  pass (1 / the in-cache xxh3 rate measured in the same cell): what a verified transfer should cost at most if
  hashing were free of memory traffic; ``with the pass from DRAM`` uses the rate of the same pass over bytes in
  no cache (``xxh3 from DRAM``), the cost of one extra trip through memory. A store hashes a row that is in
  DRAM, then copies each piece while it is in cache, so its floor lies between the two; a load hashes what its
  read just brought into cache (the first budget).
* Medians with min-max over ``--repeats`` interleaved repeats (fs, kvf, fs, kvf, ...; ``os.sync()`` before each);
  ratios are taken repeat by repeat (kvf of repeat i over fs of repeat i), then their median.
* limits, measured in the same run on the same medium, interleaved with the repeats: memcpy of one slot, and
  dd-style sequential write (temp file, one ``write`` per chunk, unlink) and read (one ``readv`` per chunk) of the
  same bytes, buffered and with O_DIRECT where the medium takes it. ``frac`` = tier GB/s / limit (store: the
  write limit of the same mode; load: the read limit).

``--rows pp2,dcp2`` add pipeline- and decode-context-parallel rows planned by vLLM itself
(tests/vllm_parallel.py): ``pp2`` is PP=2 x TP=tp/2, ``dcp2`` DCP=2 x TP=tp (GPU blocks of 32 tokens, the
same 64-token logical block), so a cell of TP=8 compares 8-worker rows of every kind; kvformat assembles the
stages / de-interleaves the DCP ranks' tokens into the one canonical file, the built-in tier writes the row.

``--seal`` runs, instead of the comparison with the built-in tier, kvformat's clear files against its sealed
ones (spec §12: ``authenticate``, ``encrypt``) in the same cells, interleaved: store and load GB/s and CPU
seconds per GB (``getrusage`` of the whole process: every tier thread), and checks that two threads seal
concurrently (the AEAD calls release the GIL).

``--peer c|python`` picks the built-in tier's path: ``c`` needs ``vllm.fs_io_C`` (a CUDA torch build, see
../shared/reference/vllm-fastpath.md); ``python`` forces its pure-Python fallback. Counters around
``batch_store_block_C`` / ``batch_load_block_C`` and the Python per-block functions show which one ran.

The built-in tier probes O_DIRECT at start-up and uses it wherever the probe succeeds: on ext4 and also on
/dev/shm on this kernel (tmpfs accepts O_DIRECT since Linux 6.6). ``--kvf-o-direct`` and ``--kvf-fsync`` set
kvformat's modes (o_direct: stores and loads through O_DIRECT descriptors for page-aligned rows; fsync: of file + directory per store). Usage::

    python tools/bench_tier.py [--chunks 24] [--threads 4] [--media shm,disk] [--tp 1,4,8] [--requests 1,4]
        [--rows replicated,per_worker] [--shapes v3,dsa,small] [--repeats 5] [--peer c|python]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import mmap
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from vllm_harness import _STEP, Deployment, fs_tier, kvformat_tier, make_keys, make_payload  # noqa: E402

import kvformat as K  # noqa: E402

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402
from vllm.v1.kv_offload.tiering.fs import io as fs_io  # noqa: E402

MODEL = "deepseek-ai/DeepSeek-V3"
# name: (layers, tokens per block, width, dtype, label)
SHAPES = {"v3": (61, 64, 576, "bfloat16", "DeepSeek-V3 1 block"),
          "dsa": (122, 64, 394, "fp8", "DeepSeek-V3.2 DSA 1 block"),  # 122 x 64 x 394 = 61 x (656 + 132) x 64
          "small": (61, 16, 576, "bfloat16", "bf16 1 block x 16 tok")}

CALLS = {"C store": 0, "C load": 0, "py store": 0, "py load": 0}


def _count(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **kw: Any) -> Any:
        CALLS[name] += 1
        return f(*a, **kw)
    return wrapper


def install_peer(peer: str) -> str:
    """Select and instrument the built-in tier's I/O path; returns its label."""
    if peer == "c":
        if not fs_io._HAS_FSIO_C:
            sys.exit("--peer c: vllm.fs_io_C does not import here (it needs a CUDA torch build); use --peer python")
        fs_io.batch_store_block_C = _count("C store", fs_io.batch_store_block_C)
        fs_io.batch_load_block_C = _count("C load", fs_io.batch_load_block_C)
    else:
        fs_io._HAS_FSIO_C = False
    fs_io._store_block = _count("py store", fs_io._store_block)
    fs_io._load_block = _count("py load", fs_io._load_block)
    return "C fast path (vllm.fs_io_C)" if peer == "c" else "pure-Python fallback"


def disk_bytes(root: Path, suffix: str) -> tuple[int, int]:
    n = used = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(suffix):
                n += 1
                used += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return n, used


def cpu_s() -> float:
    """CPU seconds (user + system) of this process so far: every thread, the tier's I/O threads included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cycle(dep: Deployment, salt: str, chunks: int, requests: int, payloads: list[bytes], root: Path,
          suffix: str, on_phase: Callable[[str | None], None] | None = None, drop: bool = True) -> dict[str, float]:
    """One store of ``chunks`` new keys over ``requests`` requests, then one load of them: GB/s and CPU s/GB.
    ``on_phase`` is called as each timed section starts ("store", "load") and ends (None). ``drop``: delete the
    files stored (untimed, after their sizes are taken), so the next contender's writes reuse memory freed a
    moment ago, as this one's did (see ``--keep-files``)."""
    mark = on_phase or (lambda phase: None)
    keys = make_keys(chunks, salt)
    parts = [keys[i::requests] for i in range(requests)]
    mgr = dep.mgr
    ctxs, outs = [], []
    with mgr.lock:
        for part in parts:
            ctx = dep._ctx()
            mgr.on_new_request(ctx)
            out = mgr.prepare_store(part, ctx)
            assert out is not None and len(out.keys_to_store) == len(part)
            for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
                dep._write_row(int(cid), payloads[keys.index(k) % len(payloads)])
            ctxs.append(ctx)
            outs.append(out)
    mark("store")
    c0, t0 = cpu_s(), time.perf_counter()
    with mgr.lock:
        for ctx, out in zip(ctxs, outs):
            mgr.complete_store(list(out.keys_to_store), ctx)
            mgr.on_request_finished(ctx)
        mgr.on_schedule_end(_STEP)
    dep.flush(timeout=600)
    t_store, c_store = time.perf_counter() - t0, cpu_s() - c0
    mark(None)
    dep.evict_primary()
    with mgr.lock:
        ctxs = [dep._ctx() for _ in parts]
        for ctx in ctxs:
            mgr.on_new_request(ctx)
    pending = [set(p) for p in parts]
    mark("load")
    c0, t0 = cpu_s(), time.perf_counter()
    while any(pending):
        with mgr.lock:
            for ctx, pend in zip(ctxs, pending):
                for k in list(pend):
                    r = mgr.lookup(k, ctx)
                    if r is LookupResult.HIT:
                        pend.discard(k)
                    elif r is LookupResult.MISS:
                        raise RuntimeError("a stored chunk missed")
            mgr.on_schedule_end(_STEP)
        if any(pending):
            time.sleep(0.0005)
    t_load, c_load = time.perf_counter() - t0, cpu_s() - c0
    mark(None)
    with mgr.lock:
        for ctx, part in zip(ctxs, parts):
            spec = mgr.prepare_load(part, ctx)
            for k, cid in zip(part, spec.chunk_ids):
                assert dep._read_row(int(cid), raw=False) == payloads[keys.index(k) % len(payloads)]
            mgr.complete_load(part, ctx)
            mgr.on_request_finished(ctx)
        mgr.on_schedule_end(_STEP)
    dep.evict_primary()
    logical = chunks * getattr(dep, "logical_bytes", dep.slot_bytes)
    gb = logical / 1e9
    nfiles, used = disk_bytes(root, suffix)
    if drop:  # behind the tier's back: the next cycle uses new keys, so neither tier looks for these again
        for dirpath, _, names in os.walk(root):
            for name in names:
                if name.endswith(suffix):
                    os.unlink(os.path.join(dirpath, name))
    return {"store": gb / t_store, "load": gb / t_load, "store cpu": c_store / gb, "load cpu": c_load / gb,
            "files": nfiles, "bytes": used}


_COLD: list[memoryview] = []


def _cold_buffer() -> memoryview:
    """256 MiB of random bytes, made once: more than the L3 of this VM (32 MiB) and of current server CPUs, so a
    pass over it reads from DRAM."""
    if not _COLD:
        _COLD.append(memoryview(np.frombuffer(os.urandom(256 << 20), dtype=np.uint8)))
    return _COLD[0]


def limits(dirpath: str, slot: int, chunks: int, src: np.ndarray, dst: list[np.ndarray],
           threads: int, flip: bool = False) -> dict[str, float]:
    """memcpy and dd-style write/read GB/s of ``chunks`` x ``slot`` bytes in ``dirpath`` (buffered, O_DIRECT),
    one file per chunk over ``threads`` threads like the tiers (os.write/readv release the GIL). ``flip``: O_DIRECT
    first (alternated by repeat: the second mode reuses the memory the first one's files just freed)."""
    from concurrent.futures import ThreadPoolExecutor
    out: dict[str, float] = {}
    t = time.perf_counter()
    for _ in range(chunks):
        ctypes.memmove(dst[0].ctypes.data, src.ctypes.data, slot)
    out["memcpy"] = slot * chunks / (time.perf_counter() - t) / 1e9
    # One hash pass as the fused paths run it: 256 KiB pieces, each hashed while in L2. Its CPU s/GB added to
    # the built-in tier's CPU s/GB is the CPU budget of a verified transfer.
    from kvformat.format import _native
    piece = memoryview(src)[:_native.PIECE]
    n = max(1, slot * chunks // len(piece))
    c = time.thread_time()
    for _ in range(n):
        _native.xxh3_64(piece)
    out["xxh3 in-cache"] = len(piece) * n / max(1e-9, time.thread_time() - c) / 1e9
    # The same pass over bytes in no cache: a store hashes a row that the GPU copy left in DRAM (a load hashes
    # what its read just brought into cache). Pieces of a buffer larger than the L3, walked once.
    cold = _cold_buffer()
    c = time.thread_time()
    for off in range(0, len(cold), _native.PIECE):
        _native.xxh3_64(cold[off:off + _native.PIECE])
    out["xxh3 from DRAM"] = len(cold) / max(1e-9, time.thread_time() - c) / 1e9
    aligned = slot - slot % 4096
    modes = (("buf", 0), ("direct", getattr(os, "O_DIRECT", 0)))
    for mode, flag in modes[::-1] if flip else modes:
        if mode == "direct" and not flag:
            continue
        os.sync()
        names = [os.path.join(dirpath, f".dd-{mode}-{i}") for i in range(chunks)]
        n = aligned if mode == "direct" else slot
        def put(i: int) -> None:
            fd = os.open(names[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
            try:
                os.write(fd, memoryview(src)[:n])
            finally:
                os.close(fd)

        def get(i: int) -> None:
            fd = os.open(names[i], os.O_RDONLY | flag)
            try:
                os.readv(fd, [memoryview(dst[i % len(dst)])[:n]])
            finally:
                os.close(fd)

        try:
            with ThreadPoolExecutor(threads) as ex:
                t = time.perf_counter()
                list(ex.map(put, range(chunks)))
                out[f"write {mode}"] = n * chunks / (time.perf_counter() - t) / 1e9
                os.sync()
                t = time.perf_counter()
                list(ex.map(get, range(chunks)))
                out[f"read {mode}"] = n * chunks / (time.perf_counter() - t) / 1e9
        except OSError:
            pass  # the medium refuses O_DIRECT
        finally:
            for p in names:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
    return out


class Fallback:
    """Swap kvformat's native functions for its pure-Python ones for the duration of a ``with``."""

    def __enter__(self) -> None:
        from kvformat.format import _header, _native
        from kvformat.cache import _rows

        self.saved = [(m, n, getattr(m, n)) for m, n in ((_native, "pread_hash"), (_native, "pwrite_hash"),
                                                         (_native, "xxh3_64"), (_rows, "xxh3_64"),
                                                         (_native, "header_match"))]
        self.saved.append((_header, "xxh3_hex", _header.xxh3_hex))
        self.saved.append((_native, "read_file_hash", _native.read_file_hash))  # no fallback: set to None below
        for m, n, _ in self.saved[:-2]:
            setattr(m, n, getattr(_native, "_py_" + n))
        _native.read_file_hash = None
        _header.xxh3_hex = lambda d: f"{_native._py_xxh3_64(d):016x}"
        import kvformat.format._block as F
        self.saved.append((F, "xxh3_hex", F.xxh3_hex))
        F.xxh3_hex = _header.xxh3_hex

    def __exit__(self, *exc: Any) -> None:
        for m, n, f in self.saved:
            setattr(m, n, f)


def med(v: list[float]) -> str:
    return f"{statistics.median(v):5.3g} ({min(v):.3g}-{max(v):.3g})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--threads", type=int, default=4, help="read and write threads of both tiers")
    ap.add_argument("--media", default="shm,disk")
    ap.add_argument("--tp", default="1,4,8")
    ap.add_argument("--rows", default="replicated,per_worker",
                    help="comma list of replicated, per_worker, pp2 (PP=2 x TP=tp/2), dcp2 (DCP=2 x TP=tp)")
    ap.add_argument("--requests", default="4", help="comma list: concurrent requests the chunks are split over")
    ap.add_argument("--shapes", default="v3", help=f"comma list of {','.join(SHAPES)}")
    ap.add_argument("--disk-dir", default=None, help="a directory on the local disk (default: the system temp dir)")
    ap.add_argument("--verify", default="true", choices=["true", "false"])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved runs per cell; median (min-max) reported")
    ap.add_argument("--peer", default="c" if fs_io._HAS_FSIO_C else "python", choices=["c", "python"])
    ap.add_argument("--kvf-o-direct", default="off", choices=["off", "auto", "on"])
    ap.add_argument("--kvf-fsync", action="store_true")
    ap.add_argument("--seal", action="store_true",
                    help="kvformat clear vs sealed (authenticate, encrypt) files instead of kvformat vs the built-in "
                         "tier: GB/s and CPU s/GB of store and load, and two threads sealing vs one")
    ap.add_argument("--keep-files", action="store_true",
                    help="keep every cycle's files to the end of the cell (default: each cycle deletes its own, "
                         "untimed: on a VM whose freed memory is reported to the host (virtio-balloon free page "
                         "reporting), whoever writes into memory freed seconds ago pays to fault it back in, so "
                         "the contender that ran second in each repeat paid more per byte stored)")
    ap.add_argument("--kvf-first", action="store_true",
                    help="run kvformat before the built-in tier in each repeat (order effects: on a VM whose freed "
                         "memory goes back to the host, whoever allocates next pays to fault it back in)")
    ap.add_argument("--kvf-fallback", action="store_true",
                    help="also run kvformat with its pure-Python fallbacks (python-xxhash, os.preadv/pwritev) "
                         "as a third contender 'kvpy', interleaved: what the C extension buys")
    a = ap.parse_args(argv)
    path = install_peer(a.peer)
    from kvformat.format import _native

    media = {"shm": "/dev/shm", "disk": a.disk_dir or tempfile.gettempdir()}
    print(f"vLLM built-in fs tier: {path} (O_DIRECT probe: "
          + ", ".join(f"{m} {fs_io.probe_o_direct(media[m])}" for m in a.media.split(",")) + "). "
          f"kvformat: native={_native.HAVE_NATIVE} ({_native.simd()}), verify={a.verify}, compression none, "
          f"o_direct={a.kvf_o_direct}, fsync={a.kvf_fsync}. {a.chunks} chunks per run, {a.threads} read + "
          f"{a.threads} write threads per tier, median (min-max) of {a.repeats} interleaved repeats.")
    print("GB/s are logical bytes (one copy of each chunk) per second. frac = GB/s / the medium's limit measured in "
          "the same cell (store: dd write, load: dd read; O_DIRECT limits where the built-in tier uses O_DIRECT).")
    for medium in a.media.split(","):
        for shape in a.shapes.split(","):
            layers, tpb, width, dtype, label = SHAPES[shape]
            slot = layers * tpb * width * (2 if dtype == "bfloat16" else 1)
            payloads = [make_payload(f"p{i}", slot) for i in range(min(a.chunks, 8))]
            # page-aligned (anonymous mmap): the O_DIRECT limits need aligned buffers
            src = np.frombuffer(mmap.mmap(-1, slot), dtype=np.uint8)
            src[:] = np.frombuffer(payloads[0], dtype=np.uint8)
            buf = [np.frombuffer(mmap.mmap(-1, slot), dtype=np.uint8) for _ in range(a.threads)]
            direct = bool(fs_io.probe_o_direct(media[medium]))
            if a.seal:
                for tp in (int(x) for x in a.tp.split(",")):
                    for nreq in (int(x) for x in a.requests.split(",")):
                        run_seal_cell(a, medium, media[medium], label, slot, layers, tpb, width, dtype, tp, nreq,
                                      payloads)
                continue
            for tp in (int(x) for x in a.tp.split(",")):
                for row in a.rows.split(","):
                    for nreq in (int(x) for x in a.requests.split(",")):
                        run_cell(a, medium, media[medium], shape, label, slot, layers, tpb, width, dtype, tp,
                                 row, nreq, payloads, src, buf, direct)
    if a.seal:
        seal_steps(payloads_for_threads(a), a.repeats)
        seal_threads(payloads_for_threads(a))
    return 0


PARALLEL_ROWS = {"pp2": "PP=2 x TP=tp/2 (per-worker rows, each stage half the layers)",
                 "dcp2": "DCP=2 x TP=tp (per-worker rows, each DCP rank half of each block's tokens)"}
PARALLEL_FAMILY = {"v3": "deepseek-v3-bf16", "dsa": "deepseek-v3.2-fp8"}


def parallel_deployment(tier: dict[str, Any], row: str, tp: int, shape: str, num_chunks: int,
                        n_payloads: int) -> tuple[Any, list[bytes]]:
    """A PP or DCP deployment planned by vLLM (tests/vllm_parallel.py) with the same logical chunk as the TP-only
    cells (61 layers x 64 tokens), and ``n_payloads`` full rows as its workers would fill them (precomputed: the
    timed cycle copies rows, as the GPU copy would, and compares whole rows after the load)."""
    from vllm_parallel import ParallelDeployment

    if shape not in PARALLEL_FAMILY:
        raise SystemExit(f"--rows {row}: shapes {','.join(PARALLEL_FAMILY)} only")
    pp, dcp, tp_ = (2, 1, tp // 2) if row == "pp2" else (1, 2, tp)
    if tp_ < 1 or (dcp > 1 and tp_ % dcp):
        raise SystemExit(f"--rows {row} needs a larger --tp than {tp}")
    dep = ParallelDeployment(PARALLEL_FAMILY[shape], [tier], tp=tp_, pp=pp, dcp=dcp, block_size=64 // dcp, bpc=1,
                             n_layers=61, num_chunks=num_chunks)
    assert dep._rows is not None
    rows = []
    for i in range(n_payloads):
        ParallelDeployment._write_row(dep, 0, (None, f"bench{i}"))
        rows.append(dep._rows[0].tobytes())
    dep._rows[0] = 0
    dep.logical_bytes = sum(len(v) for v in dep.expected("bench0").values())

    def write_row(chunk_id: int, payload: bytes) -> None:
        assert dep._rows is not None
        dep._rows[chunk_id] = np.frombuffer(payload, dtype=np.uint8)

    def read_row(chunk_id: int, raw: bool = False) -> bytes:
        assert dep._rows is not None
        return dep._rows[chunk_id].tobytes()

    dep._write_row, dep._read_row = write_row, read_row
    return dep, rows


def run_cell(a: argparse.Namespace, medium: str, mdir: str, shape: str, label: str, slot: int, layers: int,
             tpb: int, width: int, dtype: str, tp: int, row: str, nreq: int, payloads: list[bytes],
             src: np.ndarray, buf: list[np.ndarray], direct: bool) -> None:
    replicated = row == "replicated"
    cell_payloads = payloads
    deps: dict[str, Any] = {}
    roots: dict[str, Path] = {}
    names: tuple[str, ...] = ("fs", "kvf", "kvpy") if a.kvf_fallback else ("fs", "kvf")
    if a.kvf_first:
        names = names[1:] + names[:1]
    res: dict[str, dict[str, list[float]]] = {n: {"store": [], "load": [], "store cpu": [], "load cpu": []}
                                              for n in names}
    lim: dict[str, list[float]] = {}
    files: dict[str, tuple[int, int]] = {}
    before = dict(CALLS)
    try:
        for name in names:
            roots[name] = Path(tempfile.mkdtemp(prefix=f"bench_{name}_", dir=mdir))
            if name == "fs":
                tier = fs_tier(str(roots[name]), n_read_threads=a.threads, n_write_threads=a.threads)
            else:
                tier = kvformat_tier(str(roots[name]), read_threads=a.threads, write_threads=a.threads,
                                     verify=a.verify == "true", o_direct=a.kvf_o_direct, fsync=a.kvf_fsync)
            lnames = ([x for i in range(layers // 2) for x in (f"model.layers.{i}.self_attn.attn",
                                                              f"model.layers.{i}.self_attn.indexer.k_cache")]
                     if shape == "dsa" else None)
            if row in PARALLEL_ROWS:
                deps[name], cell_payloads = parallel_deployment(tier, row, tp, shape, a.chunks + 2, len(payloads))
            else:
                deps[name] = Deployment([tier], tp=tp, replicated=replicated, blocks_per_chunk=1, n_layers=layers,
                                        tokens_per_block=tpb, width=width, dtype=dtype,
                                        model="deepseek-ai/DeepSeek-V3.2" if shape == "dsa" else MODEL,
                                        num_chunks=a.chunks + 2, layer_names=lnames)
            if name == "kvf" and shape == "dsa":
                roles = {l.role for l in deps[name].tier().layout.layers}
                assert roles == {"mla", "dsa_indexer"}, roles  # the real DSA table, not uniform pages
            t = deps[name].tier()
            if hasattr(t, "wait_scanned"):
                t.wait_scanned(30)
        for rep in range(a.repeats):
            for name in names:
                os.sync()  # neither contender pays for the other's (or a previous run's) writeback
                with Fallback() if name == "kvpy" else contextlib.nullcontext():
                    r = cycle(deps[name], f"{name}{rep}{tp}{row}{nreq}{shape}", a.chunks, nreq, cell_payloads,
                              roots[name], ".bin" if name == "fs" else ".kvf", drop=not a.keep_files)
                for k, v in r.items():
                    if k in ("files", "bytes"):
                        files[name] = (int(r["files"]), int(r["bytes"]))
                    else:
                        res[name][k].append(v)
                gc.collect()
            for k, v in limits(mdir, slot, min(a.chunks, 16), src, buf, a.threads, flip=rep % 2 == 1).items():
                lim.setdefault(k, []).append(v)
    finally:
        for name, d in deps.items():
            d.close()
        for r in roots.values():
            shutil.rmtree(r, ignore_errors=True)
    mode = "direct" if direct and "write direct" in lim else "buf"
    wlim, rlim = statistics.median(lim[f"write {mode}"]), statistics.median(lim[f"read {mode}"])
    calls = {k: CALLS[k] - before[k] for k in CALLS}
    f, k = res["fs"], res["kvf"]
    if row in PARALLEL_ROWS:
        row = PARALLEL_ROWS[row].replace("tp/2", str(tp // 2)).replace("TP=tp", f"TP={tp}")
    print(f"\n[{medium} {label} ({slot:,} B) TP={tp} {row} requests={nreq}]  built-in calls: "
          + ", ".join(f"{n} {c}" for n, c in calls.items() if c)
          + f"; disk/chunk fs {files['fs'][1] / max(1, files['fs'][0]) / 1e6:.2f} MB, "
            f"kvf {files['kvf'][1] / max(1, files['kvf'][0]) / 1e6:.2f} MB")
    print("  limits GB/s: " + ", ".join(f"{n} {med(v)}" for n, v in lim.items()) + f"  (frac uses {mode})")
    hash_cpu = 1.0 / statistics.median(lim["xxh3 in-cache"])  # CPU s per GB of one hash pass
    cold_cpu = 1.0 / statistics.median(lim["xxh3 from DRAM"])
    for op, limit in (("store", wlim), ("load", rlim)):
        ratios = [x / y for x, y in zip(k[op], f[op])]
        print(f"  {op:5} GB/s fs {med(f[op])} frac {statistics.median(f[op]) / limit:4.2f} | kvf {med(k[op])} frac "
              f"{statistics.median(k[op]) / limit:4.2f} | kvf/fs {med(ratios)}", flush=True)
        fc, kc = f[op + " cpu"], k[op + " cpu"]
        # interleaved repeat by repeat, like the GB/s ratios
        print(f"        CPU s/GB fs {med(fc)} | kvf {med(kc)} | kvf/fs {med([x / y for x, y in zip(kc, fc)])} | "
              f"budget fs + 1 hash pass {statistics.median(fc) + hash_cpu:.3f} "
              f"(kvf/budget {statistics.median(kc) / (statistics.median(fc) + hash_cpu):.2f}; "
              f"with the pass from DRAM {statistics.median(kc) / (statistics.median(fc) + cold_cpu):.2f})", flush=True)
        if "kvpy" in res:
            p = res["kvpy"][op]
            print(f"  {op:5} kvformat pure-Python fallback {med(p)} | kvf/fs {med([x / y for x, y in zip(p, f[op])])}"
                  f" | native/fallback {med([x / y for x, y in zip(k[op], p)])}", flush=True)


# -- --seal: clear vs sealed kvformat files (issue 24) -----------------------------------------------------------
SEAL_LEVELS = ("clear", "authenticate", "encrypt")


def run_seal_cell(a: argparse.Namespace, medium: str, mdir: str, label: str, slot: int, layers: int, tpb: int,
                  width: int, dtype: str, tp: int, nreq: int, payloads: list[bytes]) -> None:
    """kvformat tiers storing clear, authenticated and encrypted files of the same chunks, interleaved repeats."""
    keydir = Path(tempfile.mkdtemp(prefix="bench_seal_keys_"))
    keyfile = keydir / "seal.key"
    keyfile.write_text(os.urandom(32).hex())
    keyfile.chmod(0o600)
    deps: dict[str, Any] = {}
    roots: dict[str, Path] = {}
    res: dict[str, dict[str, list[float]]] = {n: {k: [] for k in ("store", "load", "store_cpu", "load_cpu")}
                                              for n in SEAL_LEVELS}
    try:
        for name in SEAL_LEVELS:
            roots[name] = Path(tempfile.mkdtemp(prefix=f"bench_seal_{name}_", dir=mdir))
            seal = {} if name == "clear" else {"seal": name, "seal_key": str(keyfile)}
            tier = kvformat_tier(str(roots[name]), read_threads=a.threads, write_threads=a.threads,
                                 verify=a.verify == "true", o_direct=a.kvf_o_direct, fsync=a.kvf_fsync, **seal)
            deps[name] = Deployment([tier], tp=tp, replicated=True, blocks_per_chunk=1, n_layers=layers,
                                    tokens_per_block=tpb, width=width, dtype=dtype, model=MODEL,
                                    num_chunks=a.chunks + 2)
            deps[name].tier().wait_scanned(30)
        for rep in range(a.repeats):
            for name in SEAL_LEVELS:
                os.sync()
                r = cycle(deps[name], f"seal{name}{rep}{tp}{nreq}", a.chunks, nreq, payloads, roots[name], ".kvf",
                          drop=False)  # kept: the files are checked to be sealed below
                for k in ("store", "load"):
                    res[name][k].append(r[k])
                    res[name][f"{k}_cpu"].append(r[f"{k} cpu"])  # CPU s/GB
                gc.collect()
        for name in SEAL_LEVELS[1:]:  # the files really are sealed
            hdr = K.read_header(next(roots[name].rglob("*.kvf")))
            assert hdr.layout.seal == name and hdr.seal is not None
    finally:
        for d in deps.values():
            d.close()
        for r in roots.values():
            shutil.rmtree(r, ignore_errors=True)
        shutil.rmtree(keydir, ignore_errors=True)
    print(f"\n[{medium} {label} ({slot:,} B) TP={tp} replicated requests={nreq}] kvformat clear vs sealed files, "
          f"{a.chunks} chunks per run, median (min-max) of {a.repeats} interleaved repeats")
    c = res["clear"]
    for op in ("store", "load"):
        for name in SEAL_LEVELS:
            r = res[name]
            ratio = [x / y for x, y in zip(r[op], c[op])]
            cpu_ratio = [x / y for x, y in zip(r[f"{op}_cpu"], c[f"{op}_cpu"])]
            print(f"  {op:5} {name:12} GB/s {med(r[op])} | CPU s/GB {med(r[f'{op}_cpu'])}"
                  + ("" if name == "clear" else f" | vs clear: GB/s x{med(ratio)}, CPU x{med(cpu_ratio)}"),
                  flush=True)


def payloads_for_threads(a: argparse.Namespace) -> tuple[bytes, Any]:
    layers, tpb, width, dtype, _ = SHAPES[a.shapes.split(",")[0]]
    L = K.CanonicalLayout.uniform("bench/seal", dtype, [f"model.layers.{i}.self_attn.attn" for i in range(layers)],
                                  tpb, width, seal="encrypt")
    return make_payload("seal-threads", L.payload_bytes), L


def seal_steps(args: tuple[bytes, Any], repeats: int, n: int = 16) -> None:
    """CPU seconds per GB of the format step alone, on this thread (``time.thread_time``: no harness polling, no
    other thread): store = encode a chunk (checksums, and the seal), load = decode it into a buffer (copy,
    checksums, and the tag / decryption). What sealing adds to a tier's CPU per GB is the difference."""
    from kvformat.format._block import encode_block

    payload, L = args
    keys = K.Keyring.of([os.urandom(32)])
    key = K.BlockKey("cd" * 8)
    out, dst = memoryview(bytearray(len(payload))), bytearray(len(payload))
    files = {}
    for level in SEAL_LEVELS:
        lay = L.with_seal(None if level == "clear" else level)
        hdr, data, _ = encode_block(payload, lay, key, keys=keys, out=out)
        files[level] = (lay, hdr + bytes(data))
    res: dict[str, dict[str, list[float]]] = {lv: {"store": [], "load": []} for lv in SEAL_LEVELS}
    gb = n * len(payload) / 1e9
    for _ in range(repeats):
        for level in SEAL_LEVELS:
            lay, f = files[level]
            t = time.thread_time()
            for _ in range(n):
                encode_block(payload, lay, key, keys=keys, out=out)
            res[level]["store"].append((time.thread_time() - t) / gb)
            t = time.thread_time()
            for _ in range(n):
                K.decode(f, out=dst, keys=keys)
            res[level]["load"].append((time.thread_time() - t) / gb)
    print(f"\n[seal step] CPU s/GB of the format step on one thread ({n} x {len(payload):,} B, median (min-max) of "
          f"{repeats}); store = encode (xxh3 + seal), load = decode into a buffer (copy + xxh3 + tag/decrypt)")
    for op in ("store", "load"):
        c = res["clear"][op]
        print(f"  {op:5} " + " | ".join(f"{lv} {med(res[lv][op])}" for lv in SEAL_LEVELS)
              + " | added by the seal: " + ", ".join(f"{lv} {med([x - y for x, y in zip(res[lv][op], c)])}"
                                                      for lv in SEAL_LEVELS[1:]), flush=True)


def seal_threads(args: tuple[bytes, Any], n: int = 64) -> None:
    """Seal (``encrypt``) ``n`` payloads in one thread, then split over two threads: with the GIL released by
    the AEAD calls, two threads finish in about half the wall time on two free cores."""
    from concurrent.futures import ThreadPoolExecutor

    from kvformat.format._block import encode_block

    payload, L = args
    keys = K.Keyring.of([os.urandom(32)])
    outs = [memoryview(bytearray(len(payload))) for _ in range(2)]

    def work(i: int, count: int) -> None:
        for _ in range(count):
            encode_block(payload, L, K.BlockKey("ab" * 8), keys=keys, out=outs[i])

    rows = []
    for rep in range(5):
        for threads in (1, 2):
            t0, c0 = time.perf_counter(), cpu_s()
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(work, range(threads), [n // threads] * threads))
            dt, dc = time.perf_counter() - t0, cpu_s() - c0
            rows.append((threads, n * len(payload) / dt / 1e9, dc / dt))
    one = [g for t, g, _ in rows if t == 1]
    two = [g for t, g, _ in rows if t == 2]
    print(f"\n[seal threads] encrypt {n} x {len(payload):,} B: 1 thread {med(one)} GB/s, 2 threads {med(two)} GB/s "
          f"(x{med([y / x for x, y in zip(one, two)])}); CPU busy per wall second with 2 threads "
          f"{med([c for t, _, c in rows if t == 2])} (2.0 = both cores sealing at once: the GIL is released)",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
