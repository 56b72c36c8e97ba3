#!/usr/bin/env python
"""What KVFormatTier stores for today's MLA model families, through vLLM's real grouping and offloading config.

For each family (tests/vllm_models.py: per-layer KV-cache specs as vLLM's attention layers report them) and
row layout, vLLM's own planning builds the KV-cache config and the OffloadingConfig, and kvformat derives its
layout the way the tier does when vLLM's connector constructs it (the scheduler's KV-cache config in scope).
Printed: the outcome (a per-layer table, opaque, or refused with the reason), the same without vLLM's
KV-cache config (what the formulas alone give), and whether the two agree.

Then the cost of reordering a block-outer row into the canonical payload (the price of one namespace for
both row orders), next to a plain copy of the same bytes.

Usage: python tools/layout_table.py [--layers N] [--reorder-layers 61] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]

ROWS = ("replicated", "per_worker", "canonical", "block_outer")


def outcome(plans_or_err) -> str:
    if isinstance(plans_or_err, Exception):
        msg = getattr(plans_or_err, "message", str(plans_or_err))
        return f"refused: {msg[:90]}"
    parts = []
    for g, p in sorted(plans_or_err.items()):
        roles = sorted({l.role for l in p.layout.layers})
        if p.order == "opaque":
            why = p.source.split("opaque: ", 1)[-1]
            parts.append(f"g{g} opaque ({why[:60]})")
        else:
            dts = sorted({f"{l.dtype}{list(l.shape)}" for l in p.layout.layers})
            parts.append(f"g{g} table: {len(p.layout.layers)} layers {'+'.join(roles)} {' '.join(dts)}"
                         f"{' (reordered)' if not p.contiguous else ''}")
    return "; ".join(parts)


def derive(spec, **kw):
    from kvformat.errors import SchemaError
    from kvformat.vllm import derive_plans

    try:
        return derive_plans(spec, **kw)[0]
    except SchemaError as e:
        return e


def table(n_layers: int) -> None:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
    from vllm_models import FAMILIES, plan_model

    print(f"{'family':<22} {'row':<12} {'with vLLM KV-cache config (what the tier does)':<78} {'formulas only':<14}")
    for name, fam in FAMILIES.items():
        for row in ROWS:
            try:
                vc, kc, skc, ocfg, _ = plan_model(fam, tp=4, row=row, bpc=2, n_layers=n_layers,
                                                  tiers=[{"type": "KVFormatTier", "module_path": "kvformat.vllm",
                                                          "root": "/tmp/unused"}])
            except Exception as e:  # vLLM itself refuses the deployment
                print(f"{name:<22} {row:<12} vLLM refuses: {str(e)[:70]}")
                continue
            spec = TieringOffloadingSpec(ocfg)
            truth = derive(spec, vllm_config=vc, kv_cache_config=skc)
            alone = derive(spec)
            if isinstance(truth, Exception) or isinstance(alone, Exception):
                same = "—" if isinstance(alone, Exception) else "differs"
            else:
                same = "same" if all(truth[g].layout == alone.get(g, truth[g]).layout and g in alone
                                     for g in truth) else "differs"
            alone_s = "refused" if isinstance(alone, Exception) else (
                "opaque" if any(p.order == "opaque" for p in alone.values()) else "table")
            print(f"{name:<22} {row:<12} {outcome(truth):<78} {alone_s:<8} {same}")


def reorder_cost(n_layers: int, repeats: int) -> None:
    import numpy as np

    from kvformat.layout import DeploymentFacts, GroupFacts, plan_groups

    names = tuple(x for i in range(n_layers) for x in (f"model.layers.{i}.self_attn.attn",
                                                       f"model.layers.{i}.self_attn.indexer.k_cache"))
    print(f"\nreorder cost: DeepSeek-V3.2 fp8 ({n_layers} MLA + {n_layers} indexer layers, 64 tokens per block), "
          f"median of {repeats}")
    print(f"{'blocks/chunk':>12} {'chunk bytes':>12} {'runs':>6} {'gather (block-outer)':>22} {'memcpy same bytes':>18} "
          f"{'ratio':>6}")
    for bpc in (1, 4):
        facts = DeploymentFacts(model="deepseek-ai/DeepSeek-V3.2", kv_dtype="fp8_ds_mla", tokens_per_hash=64,
                                blocks_per_chunk=bpc, worker_bytes_per_block=n_layers * (41984 + 8448),
                                groups=(GroupFacts(0, 64, names),), kv_cache_layout="BLHNC")
        plan = plan_groups(facts)[0]
        n = plan.layout.payload_bytes
        src = memoryview(np.random.default_rng(0).integers(0, 256, plan.slot_bytes, dtype=np.uint8))
        dst = memoryview(bytearray(n))
        g, c = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan.gather(src, dst)
            g.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst[:] = src[:n]
            c.append(time.perf_counter() - t0)
        gm, cm = sorted(g)[len(g) // 2], sorted(c)[len(c) // 2]
        runs = sum(r[3] for r in plan.runs)
        print(f"{bpc:>12} {n:>12,} {runs:>6} {gm * 1e6:>19.0f} us {cm * 1e6:>15.0f} us {gm / cm:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="layers per family in the table (default 4)")
    ap.add_argument("--reorder-layers", type=int, default=61, help="layers of the reorder measurement (default 61)")
    ap.add_argument("--repeats", type=int, default=20, help="repeats of the reorder measurement (default 20)")
    a = ap.parse_args()
    table(a.layers)
    reorder_cost(a.reorder_layers, a.repeats)


if __name__ == "__main__":
    main()
