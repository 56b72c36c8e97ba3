#!/usr/bin/env python
"""Stage-out cost per TP rank: kvformat.staging (one writer per chunk) vs a per-rank copy (CPU).

For TP in {1, 2, 4, 8}, TP real processes each hold the same paged MLA KV (DeepSeek-V3 shape by
default: 61 layers x 64 tokens x 576 bf16) and stage ``--chunks`` chunks out:

- ``staged``: one shared /dev/shm row for the group, kvformat.staging elects one writer per chunk
  (TP rank 0), the other ranks only wait for completion;
- ``rotate``: the same, with the writer rotated by chunk id (``chunk % TP``), so the busiest rank
  copies 1/TP of the bytes too;
- ``per_rank``: the baseline, as vLLM does without its replicated layout: every rank copies its own
  replica into its own row (the same Stager copy code, on a private one-rank row).

Printed: bytes copied by the busiest rank, bytes copied by the whole group, and wall time of a round
(first rank starts -> last rank returns, best of ``--repeat``), with staged/per_rank ratios. On this
2-core machine, TP > 2 ranks share cores, so the per-rank baseline's wall time also shows the
contention that one writer avoids.

    .venv/bin/python tools/bench_staging.py [--tp 1 2 4 8] [--chunks 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _layout(layers: int, tokens: int, latent: int, blocks_per_chunk: int) -> Any:
    import kvformat as K

    return K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16",
                                     [f"model.layers.{i}.self_attn.attn" for i in range(layers)], tokens, latent,
                                     blocks_per_chunk=blocks_per_chunk)


def _rank(rank: int, tp: int, mode: str, name: str, cfg: dict[str, int], *, barrier: Any) -> dict[str, Any]:
    import torch

    from kvformat.staging import SharedRow, Stager

    layout = _layout(cfg["layers"], cfg["tokens"], cfg["latent"], cfg["blocks_per_chunk"])
    bpc, chunks = cfg["blocks_per_chunk"], cfg["chunks"]
    g = torch.Generator().manual_seed(0)  # identical KV on every rank (the replicated MLA latent)
    kv = [torch.randint(-128, 128, (bpc * chunks, l.page_bytes), dtype=torch.int8, generator=g)
          for l in layout.layers]
    if mode != "per_rank":
        row = SharedRow.open(name, rank=rank, world_size=tp, num_chunks=chunks, slot_bytes=layout.payload_bytes)
    else:
        row = SharedRow.open(f"{name}-r{rank}", rank=0, world_size=1, num_chunks=chunks,
                             slot_bytes=layout.payload_bytes)
    st = Stager(row, kv, layout, rotate=mode == "rotate")
    ids = [list(range(c * bpc, (c + 1) * bpc)) for c in range(chunks)]
    spans = []
    for rep in range(cfg["repeat"] + 1):  # round 0 warms up (first touch of the row's pages)
        if rep == 1:
            before = st.stats.bytes_out
        barrier.wait()
        t0 = time.perf_counter()
        for c in range(chunks):
            st.stage_out(ids[c], c)
        t1 = time.perf_counter()
        barrier.wait()
        if rep:
            spans.append((t0, t1))
    per_round = (st.stats.bytes_out - before) // cfg["repeat"]
    del st
    row.close()
    return {"bytes": per_round, "spans": spans}


def _group(tp: int, mode: str, cfg: dict[str, int]) -> dict[str, Any]:
    from kvformat.testing.ranks import run_ranks

    name = f"bench-{uuid.uuid4().hex[:12]}"
    # one core per rank, as one process per GPU would have
    res = run_ranks(_rank, tp, tp, mode, name, cfg, barrier=True, timeout_s=600, threads=1)
    walls = [max(res[r]["spans"][i][1] for r in res) - min(res[r]["spans"][i][0] for r in res)
             for i in range(cfg["repeat"])]
    per_rank = [res[r]["bytes"] for r in range(tp)]
    return {"tp": tp, "mode": mode, "max_rank_bytes": max(per_rank), "total_bytes": sum(per_rank),
            "ranks_copying": sum(b > 0 for b in per_rank), "wall_s": min(walls)}


def run(tps: Sequence[int] = (1, 2, 4, 8), *, layers: int = 61, tokens: int = 64, latent: int = 576,
        blocks_per_chunk: int = 4, chunks: int = 8, repeat: int = 3) -> list[dict[str, Any]]:
    """Run both modes for each TP; returns one dict per (tp, mode)."""
    cfg = {"layers": layers, "tokens": tokens, "latent": latent, "blocks_per_chunk": blocks_per_chunk,
           "chunks": chunks, "repeat": repeat}
    return [_group(tp, mode, cfg) for tp in tps for mode in ("per_rank", "staged", "rotate")]


def table(rows: list[dict[str, Any]], payload_bytes: int, chunks: int) -> str:
    """The printed table, one line per (tp, mode), ratios on the staged lines."""
    mib = 2 ** 20
    out = [f"stage-out of {chunks} chunks x {payload_bytes / mib:.1f} MiB (one round = {chunks * payload_bytes / mib:.1f}"
           f" MiB of canonical payload)",
           f"{'TP':>3} {'mode':9} {'ranks copying':>13} {'MiB busiest rank':>16} {'MiB all ranks':>13} "
           f"{'wall s':>8} {'all/base':>9} {'busiest/base':>12} {'wall/base':>9}"]
    base = {r["tp"]: r for r in rows if r["mode"] == "per_rank"}
    for r in rows:
        b = base[r["tp"]]
        base_line = r["mode"] == "per_rank"
        ratio_b = "" if base_line else f"{r['total_bytes'] / b['total_bytes']:.3f}"
        ratio_m = "" if base_line else f"{r['max_rank_bytes'] / b['max_rank_bytes']:.3f}"
        ratio_w = "" if base_line else f"{r['wall_s'] / b['wall_s']:.2f}"
        out.append(f"{r['tp']:>3} {r['mode']:9} {r['ranks_copying']:>13} {r['max_rank_bytes'] / mib:>16.1f} "
                   f"{r['total_bytes'] / mib:>13.1f} {r['wall_s']:>8.3f} {ratio_b:>9} {ratio_m:>12} {ratio_w:>9}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="kvformat.staging stage-out vs a per-rank copy (CPU)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--latent", type=int, default=576)
    p.add_argument("--blocks-per-chunk", type=int, default=4)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true", help="also print the rows as one JSON line at the end")
    a = p.parse_args(argv)
    rows = run(a.tp, layers=a.layers, tokens=a.tokens, latent=a.latent, blocks_per_chunk=a.blocks_per_chunk,
               chunks=a.chunks, repeat=a.repeat)
    print(table(rows, _layout(a.layers, a.tokens, a.latent, a.blocks_per_chunk).payload_bytes, a.chunks))
    if a.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
