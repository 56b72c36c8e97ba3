#!/usr/bin/env python
"""GPU check of kvformat.staging: DeepSeek-V3-shaped paged KV on the GPU -> pinned shared row -> file -> back.

One short run (well under a few minutes on one GPU) for a brief loan of a GPU machine:

1. ``--tp`` ranks (2 by default, one process each, all on the one GPU) build the same paged MLA KV:
   61 layers x (num_blocks, 64 tokens, 576) bf16 (DeepSeek-V3);
2. they stage ``--chunks`` chunks out through a /dev/shm row pinned with cudaHostRegister: rank 0
   alone copies (D2H), the others wait; rank 0 saves the chunks as kvformat files with the store the
   vLLM tier uses;
3. the files are loaded into a fresh pinned row and every rank stages them into zeroed KV at other
   block ids (H2D);
4. every rank checks every byte; rank 0's D2H/H2D GB/s are printed next to a plain pinned-tensor
   copy of the same bytes (the bandwidth limit of the link), with bytes copied per rank;
5. (issue 47, ``--verify-cells``) the device hash ``xxh3_64_device`` is checked against python-xxhash on the
   device for every length class, and timed against a plain device-to-device copy of the same bytes; the
   whole load path (file -> row -> every rank's KV) is timed three ways, with rank 0's CPU seconds per GB:
   no checksum, today's CPU xxh3, and ``verify="device"`` (no CPU hash, the writer checks on its GPU).
   The files are in the page cache (just written): the reads are memory copies, so the cells compare the
   checksum's cost, not a disk's speed.

Without a GPU it prints ``not run: no GPU available`` and exits 0. ``--device cpu`` runs the same
logic on the CPU (the test suite does this with small shapes, so this script is not dead code).
Exit status: 0 when the bytes match and the device hash equals xxhash (or not run), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: Any, repeat: int) -> float:
    """Best wall time of ``repeat`` runs of ``fn`` (device synchronized around each)."""
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def rank_check(rank: int, tp: int, cfg: dict[str, Any], names: tuple[str, str], root: str, *,
               barrier: Any) -> dict[str, Any]:
    """One TP rank: stage out through the shared row, save, load into a fresh row, stage in, check.

    Every rank builds the same KV (same seed), as TP ranks of an MLA model hold the same latent; TP
    rank 0 is the writer. Returns this rank's timings (seconds), byte counts and check result.
    """
    import torch

    import kvformat as K
    from kvformat.staging import AsyncStager, SharedRow, Stager
    from kvformat.storage import open_store

    device = torch.device(cfg["device"])
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    else:  # ranks share the cores: oversubscribed OpenMP pools spin against each other
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    layers, tokens, latent, bpc, chunks, nb = (cfg[k] for k in ("layers", "tokens", "latent", "blocks_per_chunk",
                                                                 "chunks", "num_blocks"))
    repeat = cfg["repeat"]
    layout = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16",
                                       [f"model.layers.{i}.self_attn.attn" for i in range(layers)], tokens, latent,
                                       blocks_per_chunk=bpc)
    payload = layout.payload_bytes
    g = torch.Generator(device=device).manual_seed(0)
    # Random bits (any bf16 pattern, NaNs included): the check compares bytes, never values.
    kv = [torch.randint(-128, 128, (nb, tokens * latent * 2), dtype=torch.int8, device=device, generator=g)
          .view(torch.bfloat16).view(nb, tokens, latent) for _ in range(layers)]
    if cfg["ids"] == "scattered":  # what engines hand over: chunk c holds every chunks-th block
        src = [[c + chunks * j for j in range(bpc)] for c in range(chunks)]
    else:
        src = [list(range(c * bpc, (c + 1) * bpc)) for c in range(chunks)]
    # Other block ids on the way back (reversed, from the top half): the payload is where-independent.
    dst = [[nb - 1 - b for b in ids] for ids in src]
    keys = [K.BlockKey(f"{c + 1:04x}" * 8) for c in range(chunks)]
    store = open_store(root)
    pin = "on" if cuda else "off"
    t: dict[str, float] = {}

    row = SharedRow.open(names[0], rank=rank, world_size=tp, num_chunks=chunks, slot_bytes=payload, pin=pin)
    st = Stager(row, kv, layout)
    pinned = row.pinned
    st.stage_out(src[0], 0)  # warm-up: CUDA context, allocator, kernels
    before = st.stats.bytes_out
    t["stage_out"] = _timed(lambda s=st: [s.stage_out(src[c], c) for c in range(chunks)], device, repeat)
    out_round = (st.stats.bytes_out - before) // repeat
    # The lambdas bind what they time as defaults: the names are deleted below (before each row closes).
    a = AsyncStager(st)  # every chunk in flight at once, one wait at the end
    t["stage_out_async"] = _timed(lambda a=a: _all_ok(a.wait([a.submit_stage_out(src[c], c) for c in range(chunks)])),
                                  device, repeat)
    a.shutdown()
    del a
    t0 = time.perf_counter()
    for c in range(chunks):
        st.save(c, keys[c], store, overwrite=True)  # the writer saves, the other ranks return at once
    t["save"] = time.perf_counter() - t0
    out_stats = st.stats.to_dict()
    del st
    row.close()

    kv2 = [torch.zeros_like(x) for x in kv]
    row2 = SharedRow.open(names[1], rank=rank, world_size=tp, num_chunks=chunks, slot_bytes=payload, pin=pin)
    st2 = Stager(row2, kv2, layout)
    t0 = time.perf_counter()
    for c in range(chunks):
        st2.load(c, keys[c], store)
    t["load"] = time.perf_counter() - t0
    st2.stage_in(0, dst[0])  # warm-up
    before = st2.stats.bytes_in
    t["stage_in"] = _timed(lambda s=st2: [s.stage_in(c, dst[c]) for c in range(chunks)], device, repeat)
    in_round = (st2.stats.bytes_in - before) // repeat
    _sync(device)
    equal = _equal(kv, kv2, src, dst)
    for x in kv2:
        x.zero_()
    a2 = AsyncStager(st2)
    t["stage_in_async"] = _timed(lambda a=a2: _all_ok(a.wait([a.submit_stage_in(c, dst[c]) for c in range(chunks)])),
                                 device, repeat)
    a2.shutdown()
    del a2
    _sync(device)
    equal = equal and _equal(kv, kv2, src, dst)
    in_stats = st2.stats.to_dict()
    if cfg["verify_cells"]:
        from kvformat.staging import xxh3_64_device

        if rank == st2.writer_of(0):  # the writer checks: compile its kernels outside the timings
            xxh3_64_device(torch.zeros(payload, dtype=torch.uint8, device=device))
        # The whole load path (file -> row -> every rank's KV) three ways: no checksum, today's CPU xxh3 pass,
        # and the GPU-verified mode (no CPU hash; the writer checks kvf.dxxh3 on its device before DONE).
        for mode, name in ((False, "load_unverified"), (True, "load_cpu_verified"), ("device", "load_device_verified")):
            for x in kv2:
                x.zero_()
            t[name], t[name + "_cpu"] = _timed_cpu(lambda m=mode, s=st2: _load_round(s, keys, store, dst, m, barrier),
                                                   device, repeat)
            _sync(device)
            equal = equal and _equal(kv, kv2, src, dst)
    del st2
    row2.close()

    hash_equal = True
    barrier.wait()  # the limit is measured by rank 0 alone, with the other ranks idle
    if rank == 0:
        # One plain copy of the same bytes between a device tensor and a pinned host tensor.
        host = torch.empty(payload, dtype=torch.uint8, pin_memory=cuda)
        dev = torch.empty(payload, dtype=torch.uint8, device=device)
        t["plain_d2h"] = _timed(lambda: [host.copy_(dev, non_blocking=True) for _ in range(chunks)], device, repeat)
        t["plain_h2d"] = _timed(lambda: [dev.copy_(host, non_blocking=True) for _ in range(chunks)], device, repeat)
        if cfg["verify_cells"]:
            from kvformat.staging import xxh3_64_device

            dev.copy_(torch.randint(0, 256, (payload,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
                      .to(device))
            dev2 = torch.empty_like(dev)
            hash_equal = _hash_equal(dev)  # first: it also compiles the kernels for every length class
            t["plain_d2d"] = _timed(lambda: [dev2.copy_(dev) for _ in range(chunks)], device, repeat)
            t["hash"] = _timed(lambda: [xxh3_64_device(dev) for _ in range(chunks)], device, repeat)
    barrier.wait()
    return {"rank": rank, "times": t, "equal": equal, "hash_equal": hash_equal, "pinned": pinned, "payload": payload,
            "bytes_out": out_round, "bytes_in": in_round,
            "bytes_to_file": out_stats["bytes_to_file"], "bytes_from_file": in_stats["bytes_from_file"],
            "device_name": torch.cuda.get_device_name(device) if cuda else "cpu"}


def _timed_cpu(fn: Callable[[], Any], device: Any, repeat: int) -> tuple[float, float]:
    """Best wall time and best process CPU time (every thread of this rank) of ``repeat`` runs of ``fn``."""
    wall = cpu = float("inf")
    for _ in range(repeat):
        _sync(device)
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        _sync(device)
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.process_time() - c0)
    return wall, cpu


def _load_round(st: Any, keys: Sequence[Any], store: Any, dst: Sequence[Sequence[int]], verify: Any,
                barrier: Any) -> None:
    for c, key in enumerate(keys):
        st.load(c, key, store, verify=verify)  # collective: the writer reads, the others wait for DONE
        st.stage_in(c, dst[c])
    barrier.wait()  # every rank has its KV: only then may the next round republish the chunks


def _hash_equal(dev: Any) -> bool:
    """The device hash against python-xxhash on this device, for every length class and the whole buffer."""
    import xxhash

    from kvformat.staging import xxh3_64_device

    host = dev.cpu()
    lengths = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 1025, 4096 + 65, host.numel()]
    return all(xxh3_64_device(dev[:n]) == xxhash.xxh3_64_intdigest(host[:n].numpy().tobytes())
               for n in lengths if n <= host.numel())


def _all_ok(results: Sequence[Any]) -> None:
    for r in results:
        if r.error is not None:
            raise r.error


def _equal(kv: Sequence[Any], kv2: Sequence[Any], src: Sequence[Sequence[int]], dst: Sequence[Sequence[int]]) -> bool:
    import torch

    return all(torch.equal(b[d].view(torch.uint8), a[s].view(torch.uint8))
               for s, d in zip(src, dst) for a, b in zip(kv, kv2))


def resolve_device(name: str, *, available: bool, count: int, current: int = 0) -> str | None:
    """The device the ranks use, as ``cpu`` or ``cuda:N`` (torch.cuda.set_device needs an index); None when a
    GPU was asked for (``auto``, ``cuda``, ``cuda:N``) and there is none. SystemExit for anything else."""
    if name == "cpu":
        return "cpu"
    if name in ("auto", "cuda"):
        return f"cuda:{current}" if available and count > 0 else None
    head, _, index = name.partition(":")
    if head != "cuda" or not index.isdigit():
        raise SystemExit(f"--device: expected auto, cuda, cuda:N or cpu, got {name!r}")
    if not available or count == 0:
        return None
    if int(index) >= count:
        raise SystemExit(f"--device: expected cuda:0..cuda:{count - 1}, got {name!r}")
    return f"cuda:{int(index)}"


_CPU_VERIFY_BYTES = 1 << 20


class _NoBarrier:
    def wait(self) -> None:
        return None


def run_check(device_name: str, *, tp: int, layers: int, tokens: int, latent: int, blocks_per_chunk: int,
              chunks: int, num_blocks: int, root: str | None, repeat: int, ids: str = "contiguous",
              verify_cells: str = "auto") -> int:
    """Run every rank (in this process for TP=1, else spawned), print the table; returns the exit status."""
    if num_blocks < 2 * chunks * blocks_per_chunk:
        raise SystemExit(f"--num-blocks must be >= 2 * chunks * blocks_per_chunk = {2 * chunks * blocks_per_chunk}")
    total = layers * tokens * latent * 2 * blocks_per_chunk * chunks
    # The device hash runs in Triton's interpreter on the CPU (~1 s per MiB): there, only small shapes.
    verify = verify_cells == "on" or (verify_cells == "auto" and (device_name != "cpu" or total <= _CPU_VERIFY_BYTES))
    if verify:
        try:
            import triton  # noqa: F401
        except ImportError:
            if verify_cells == "on":
                raise SystemExit("--verify-cells on needs Triton: pip install triton") from None
            verify = False
    cfg = {"device": device_name, "layers": layers, "tokens": tokens, "latent": latent,
           "blocks_per_chunk": blocks_per_chunk, "chunks": chunks, "num_blocks": num_blocks, "repeat": repeat,
           "ids": ids, "verify_cells": verify}
    names = (f"gpucheck-{uuid.uuid4().hex[:12]}", f"gpucheck-{uuid.uuid4().hex[:12]}")
    tmp = root or tempfile.mkdtemp(prefix="kvformat-gpu-check-")
    try:
        if tp == 1:
            res = {0: rank_check(0, 1, cfg, names, tmp, barrier=_NoBarrier())}
        else:
            from kvformat.testing.ranks import RankError, run_ranks

            try:
                res = run_ranks(rank_check, tp, tp, cfg, names, tmp, barrier=True, timeout_s=540, threads=None)
            except RankError as e:
                print(e)
                return 1
    finally:
        if root is None:
            shutil.rmtree(tmp, ignore_errors=True)
    _print(res, cfg, tp)
    return 0 if all(r["equal"] and r["hash_equal"] for r in res.values()) else 1


def _print(res: dict[int, dict[str, Any]], cfg: dict[str, Any], tp: int) -> None:
    r0 = res[0]
    rows = r0["times"]
    payload = r0["payload"]
    total = payload * cfg["chunks"]
    gbs = {k: total / v / 1e9 for k, v in rows.items() if not k.endswith("_cpu")}
    cuda = r0["device_name"] != "cpu"
    print(f"kvformat gpu_check on {r0['device_name']}: TP={tp}, {cfg['layers']} layers x {cfg['tokens']} tokens x "
          f"{cfg['latent']} bf16, {cfg['blocks_per_chunk']} blocks/chunk, {cfg['chunks']} chunks, "
          f"{cfg['ids']} block ids, {payload / 2**20:.1f} MiB/chunk, {total / 2**20:.1f} MiB in all, row pinned: "
          f"{'yes' if r0['pinned'] else 'no'}, best of {cfg['repeat']} (rank 0 = writer)")
    plain = "plain pinned" if cuda else "plain host"
    table = [
        ("D2H stage_out (KV -> shared row)", "stage_out", "plain_d2h"),
        ("D2H AsyncStager, all in flight", "stage_out_async", "plain_d2h"),
        (f"D2H {plain} tensor copy", "plain_d2h", None),
        ("H2D stage_in (shared row -> KV)", "stage_in", "plain_h2d"),
        ("H2D AsyncStager, all in flight", "stage_in_async", "plain_h2d"),
        (f"H2D {plain} tensor copy", "plain_h2d", None),
        ("row -> kvformat file (put_block)", "save", None),
        ("kvformat file -> row (read_into)", "load", None),
    ]
    if "hash" in rows:
        table += [
            ("device-to-device copy", "plain_d2d", None),
            ("xxh3_64_device (device hash)", "hash", "plain_d2d"),
            ("load + stage_in, no checksum", "load_unverified", None),
            ("load + stage_in, CPU xxh3 (today)", "load_cpu_verified", "load_unverified"),
            ("load + stage_in, GPU-verified", "load_device_verified", "load_unverified"),
        ]
    print(f"{'path':36} {'seconds':>9} {'GB/s':>8} {'vs plain':>9}")
    for label, k, ref in table:
        ratio = f"{gbs[k] / gbs[ref]:.2f}x" if ref else ""
        print(f"{label:36} {rows[k]:9.4f} {gbs[k]:8.2f} {ratio:>9}")
    for r in sorted(res):
        x = res[r]
        print(f"rank {r}: copied out {x['bytes_out'] / 2**20:.1f} MiB/round, copied in "
              f"{x['bytes_in'] / 2**20:.1f} MiB/round, file bytes written {x['bytes_to_file'] / 2**20:.1f} "
              f"MiB, read {x['bytes_from_file'] / 2**20:.1f} MiB, bytes equal: {'yes' if x['equal'] else 'NO'}")
    cpu_per_gb = {k[:-4]: round(v / (total / 1e9), 4) for k, v in rows.items() if k.endswith("_cpu")}
    if cpu_per_gb:
        print("rank 0 CPU seconds per GB loaded: " + ", ".join(f"{k} {v:.3f}" for k, v in cpu_per_gb.items()) +
              f"; device hash equals xxhash on this device: {'yes' if r0['hash_equal'] else 'NO'}")
    print(f"bytes equal: {'yes' if all(x['equal'] for x in res.values()) else 'NO'}")
    ratios = {k: round(gbs[k] / gbs[ref], 3) for _, k, ref in table if ref}
    if cpu_per_gb and cpu_per_gb["load_cpu_verified"] > 0:
        ratios["cpu_s_device_vs_cpu_verified"] = round(cpu_per_gb["load_device_verified"]
                                                       / cpu_per_gb["load_cpu_verified"], 3)
    print(json.dumps({"device": r0["device_name"], "tp": tp, "ids": cfg["ids"], "chunks": cfg["chunks"],
                      "chunk_mib": round(payload / 2**20, 2), "equal": all(x["equal"] for x in res.values()),
                      "hash_equal": r0["hash_equal"], "gbs": {k: round(v, 2) for k, v in gbs.items()},
                      "ratios": ratios, "cpu_s_per_gb": cpu_per_gb}))


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, say "not run" without a GPU, else run the check. Returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cuda, cuda:N or cpu")
    p.add_argument("--tp", type=int, default=2, help="ranks sharing the row, one process each (1: in this process)")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--tokens", type=int, default=64, help="tokens per block")
    p.add_argument("--latent", type=int, default=576, help="latent width (bf16 elements per token)")
    p.add_argument("--blocks-per-chunk", type=int, default=16)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ids", choices=("contiguous", "scattered"), default="contiguous",
                   help="each chunk's block ids: one run, or every chunks-th block (what engines hand over)")
    p.add_argument("--root", default=None, help="directory for the kvformat files (default: a temp dir, removed)")
    p.add_argument("--verify-cells", choices=("auto", "on", "off"), default="auto",
                   help="the device-hash and GPU-verified load cells (auto: on a GPU, or on the CPU for <= 1 MiB)")
    a = p.parse_args(argv)
    import torch

    avail = torch.cuda.is_available()
    dev = resolve_device(a.device, available=avail, count=torch.cuda.device_count() if avail else 0,
                         current=torch.cuda.current_device() if avail else 0)
    if dev is None:
        print("not run: no GPU available")
        return 0
    return run_check(dev, tp=a.tp, layers=a.layers, tokens=a.tokens, latent=a.latent,
                     blocks_per_chunk=a.blocks_per_chunk, chunks=a.chunks, num_blocks=a.num_blocks, root=a.root,
                     repeat=a.repeat, ids=a.ids, verify_cells=a.verify_cells)


if __name__ == "__main__":
    sys.exit(main())
