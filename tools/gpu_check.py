#!/usr/bin/env python
"""GPU check of kvformat.staging: DeepSeek-V3-shaped paged KV on the GPU -> pinned shared row -> file -> back.

One short run (well under a few minutes on one GPU) for a brief loan of a GPU machine:

1. builds paged MLA KV on the GPU: 61 layers x (num_blocks, 64 tokens, 576) bf16 (DeepSeek-V3);
2. stages ``--chunks`` chunks out through a /dev/shm row pinned with cudaHostRegister (D2H) and saves
   them as kvformat files with the store the vLLM tier uses;
3. loads the files into a fresh pinned row and stages them into zeroed KV at other block ids (H2D);
4. checks every byte, and prints D2H/H2D GB/s next to a plain pinned-tensor copy of the same bytes
   (the bandwidth limit of the link).

Without a GPU it prints ``not run: no GPU available`` and exits 0. ``--device cpu`` runs the same
logic on the CPU (the test suite does this with small shapes, so this script is not dead code).
Exit status: 0 when the bytes match (or not run), 1 otherwise.
"""

from __future__ import annotations

import argparse
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


def run_check(device_name: str, *, layers: int, tokens: int, latent: int, blocks_per_chunk: int, chunks: int,
              num_blocks: int, root: str | None, repeat: int) -> int:
    """Stage out, save, load, stage in; check bytes; print the table. Returns the exit status."""
    import torch

    import kvformat as K
    from kvformat.staging import SharedRow, Stager
    from kvformat.storage import open_store

    device = torch.device(device_name)
    if num_blocks < 2 * chunks * blocks_per_chunk:
        raise SystemExit(f"--num-blocks must be >= 2 * chunks * blocks_per_chunk = {2 * chunks * blocks_per_chunk}")
    cuda = device.type == "cuda"
    layout = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16",
                                       [f"model.layers.{i}.self_attn.attn" for i in range(layers)], tokens, latent,
                                       blocks_per_chunk=blocks_per_chunk)
    payload = layout.payload_bytes
    g = torch.Generator(device=device).manual_seed(0)
    # Random bits (any bf16 pattern, NaNs included): the check compares bytes, never values.
    kv = [torch.randint(-128, 128, (num_blocks, tokens * latent * 2), dtype=torch.int8, device=device, generator=g)
          .view(torch.bfloat16).view(num_blocks, tokens, latent) for _ in range(layers)]
    src = [list(range(c * blocks_per_chunk, (c + 1) * blocks_per_chunk)) for c in range(chunks)]
    # Other block ids on the way back (reversed, from the top half): the payload is where-independent.
    dst = [[num_blocks - 1 - b for b in ids] for ids in src]
    keys = [K.BlockKey(f"{c + 1:04x}" * 8) for c in range(chunks)]
    tmp = root or tempfile.mkdtemp(prefix="kvformat-gpu-check-")
    store = open_store(tmp)
    pin = "on" if cuda else "off"
    rows: dict[str, float] = {}
    try:
        row = SharedRow.open(f"gpucheck-{uuid.uuid4().hex[:12]}", rank=0, world_size=1, num_chunks=chunks,
                             slot_bytes=payload, pin=pin)
        st = Stager(row, kv, layout)
        pinned = row.pinned
        st.stage_out(src[0], 0)  # warm-up: CUDA context, allocator, kernels
        rows["stage_out"] = _timed(lambda: [st.stage_out(src[c], c) for c in range(chunks)], device, repeat)
        t0 = time.perf_counter()
        for c in range(chunks):
            st.save(c, keys[c], store, overwrite=True)
        rows["save"] = time.perf_counter() - t0
        del st
        row.close()

        kv2 = [torch.zeros_like(t) for t in kv]
        row2 = SharedRow.open(f"gpucheck-{uuid.uuid4().hex[:12]}", rank=0, world_size=1, num_chunks=chunks,
                              slot_bytes=payload, pin=pin)
        st2 = Stager(row2, kv2, layout)
        t0 = time.perf_counter()
        for c in range(chunks):
            st2.load(c, keys[c], store)
        rows["load"] = time.perf_counter() - t0
        st2.stage_in(0, dst[0])  # warm-up
        rows["stage_in"] = _timed(lambda: [st2.stage_in(c, dst[c]) for c in range(chunks)], device, repeat)
        _sync(device)
        equal = all(torch.equal(kv2[i][dst[c]].view(torch.uint8), kv[i][src[c]].view(torch.uint8))
                    for c in range(chunks) for i in range(layers))
        del st2
        row2.close()

        # The limit: one plain copy of the same bytes between a device tensor and a pinned host tensor.
        host = torch.empty(payload, dtype=torch.uint8, pin_memory=cuda)
        dev = torch.empty(payload, dtype=torch.uint8, device=device)
        rows["plain_d2h"] = _timed(lambda: [host.copy_(dev, non_blocking=True) for _ in range(chunks)], device, repeat)
        rows["plain_h2d"] = _timed(lambda: [dev.copy_(host, non_blocking=True) for _ in range(chunks)], device, repeat)
    finally:
        if root is None:
            shutil.rmtree(tmp, ignore_errors=True)

    total = payload * chunks
    gbs = {k: total / v / 1e9 for k, v in rows.items()}
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"kvformat gpu_check on {name}: {layers} layers x {tokens} tokens x {latent} bf16, "
          f"{blocks_per_chunk} blocks/chunk, {chunks} chunks, {payload / 2**20:.1f} MiB/chunk, "
          f"{total / 2**20:.1f} MiB in all, row pinned: {'yes' if pinned else 'no'}, best of {repeat}")
    plain = "plain pinned" if cuda else "plain host"
    table = [
        ("D2H stage_out (KV -> shared row)", "stage_out", "plain_d2h"),
        (f"D2H {plain} tensor copy", "plain_d2h", None),
        ("H2D stage_in (shared row -> KV)", "stage_in", "plain_h2d"),
        (f"H2D {plain} tensor copy", "plain_h2d", None),
        ("row -> kvformat file (put_block)", "save", None),
        ("kvformat file -> row (read_into)", "load", None),
    ]
    print(f"{'path':36} {'seconds':>9} {'GB/s':>8} {'vs plain':>9}")
    for label, k, ref in table:
        ratio = f"{gbs[k] / gbs[ref]:.2f}x" if ref else ""
        print(f"{label:36} {rows[k]:9.4f} {gbs[k]:8.2f} {ratio:>9}")
    print(f"bytes equal: {'yes' if equal else 'NO'}")
    return 0 if equal else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, say "not run" without a GPU, else run the check. Returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cuda, cuda:N or cpu")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--tokens", type=int, default=64, help="tokens per block")
    p.add_argument("--latent", type=int, default=576, help="latent width (bf16 elements per token)")
    p.add_argument("--blocks-per-chunk", type=int, default=16)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--root", default=None, help="directory for the kvformat files (default: a temp dir, removed)")
    a = p.parse_args(argv)
    import torch

    dev = a.device
    if dev != "cpu":
        if not torch.cuda.is_available():
            print("not run: no GPU available")
            return 0
        dev = "cuda" if dev == "auto" else dev
    return run_check(dev, layers=a.layers, tokens=a.tokens, latent=a.latent, blocks_per_chunk=a.blocks_per_chunk,
                     chunks=a.chunks, num_blocks=a.num_blocks, root=a.root, repeat=a.repeat)


if __name__ == "__main__":
    sys.exit(main())
