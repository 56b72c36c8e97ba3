#!/usr/bin/env python
"""What KVFormatTier stores for today's MLA model families, through vLLM's real grouping and offloading config.

For each family (tests/vllm_models.py: per-layer KV-cache specs as vLLM's attention layers report them) and
row layout, vLLM's own planning builds the KV-cache config and the OffloadingConfig, and kvformat derives its
layout the way the tier does when vLLM's connector constructs it (the scheduler's KV-cache config in scope).
Printed: the outcome (a per-layer table, opaque, or refused with the reason), the same without vLLM's
KV-cache config (what the formulas alone give), and whether the two agree.

Then the cost of reordering a block-outer row into the canonical payload (the price of one namespace for
both row orders), next to a plain copy of the same bytes.

Then the page sub-layout table (kvformat.layout._sublayout): for every role and KV dtype kvformat stores, per
platform and block size, where a token's bytes sit inside a page as vLLM's writer puts them, the vLLM source it
is transcribed from, and whether tokens may move (DCP, reorders) or the layer is stored as whole pages only. And
the cost of converting a ROCm deployment's shuffled indexer pages into the file's order (what sharing one
namespace with CUDA costs), next to a plain copy, as CPU seconds per GB.

Usage: python tools/layout_table.py [--layers N] [--reorder-layers 61] [--repeats 20] [--platform cuda]
       python tools/layout_table.py --sublayouts-only
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


def table(n_layers: int, platform: str) -> None:
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
            truth = derive(spec, vllm_config=vc, kv_cache_config=skc, platform=platform)
            alone = derive(spec, platform=platform)
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


SUB_CASES = [("mla", "bfloat16", 1152), ("mla", "float16", 1152), ("mla", "fp8", 576), ("mla", "fp8_ds_mla", 656),
             ("dsa_indexer", "dsa_indexer_fp8", 132)]


def sublayouts() -> None:
    from kvformat.layout import PLATFORMS, describe

    print("\npage sub-layouts (where token t's bytes sit inside a page; kvformat/layout/_sublayout.py)")
    print(f"{'role':<12} {'KV dtype':<16} {'platform':<10} {'tokens':>6}  {'order':<14} {'encoding':<15} "
          f"{'token movement':<17} source in vLLM 0.34")
    for role, kvd, tb in SUB_CASES:
        for platform in (*PLATFORMS, None):
            for tokens in ((64, 128, 32, 1) if role == "dsa_indexer" else (64,)):
                sub = describe(role, kvd, tb, platform, tokens)
                if sub is None:
                    order, enc, move, src = "—", "—", "whole pages only", "no description: DCP refused by name"
                else:
                    order, enc, move = sub.name, sub.encoding, "yes"
                    src = sub.source.split(":")[0]
                print(f"{role:<12} {kvd:<16} {platform or 'other':<10} {tokens:>6}  {order:<14} {enc:<15} "
                      f"{move:<17} {src}")
    print("file order: rows (mla), split (dsa_indexer) at tokens_per_block; the encoding is pinned (form.<kv dtype>)")


def canonicalise_cost(n_layers: int, repeats: int) -> None:
    """CPU seconds per GB of turning a ROCm DSA row (shuffled indexer tiles) into the file's payload, against the
    CUDA row (already the file's order) and a memcpy of the same bytes, interleaved repeats."""
    import resource

    import numpy as np

    from kvformat.layout import DeploymentFacts, GroupFacts, LayerFacts, plan_groups

    names = tuple(x for i in range(n_layers) for x in (f"model.layers.{i}.self_attn.attn",
                                                       f"model.layers.{i}.self_attn.indexer.k_cache"))

    def facts(platform: str, bpc: int) -> DeploymentFacts:
        lf = {n: (LayerFacts(n, "mla", "fp8_ds_mla", "U8", (64, 656), 64 * 656) if n.endswith("attn") else
                  LayerFacts(n, "dsa_indexer", "dsa_indexer_fp8", "U8", (64, 132), 64 * 132)) for n in names}
        return DeploymentFacts(model="deepseek-ai/DeepSeek-V3.2", kv_dtype="fp8_ds_mla", tokens_per_hash=64,
                               blocks_per_chunk=bpc, worker_bytes_per_block=n_layers * (41984 + 8448),
                               groups=(GroupFacts(0, 64, names),), layers=lf, platform=platform)

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    print(f"\ncanonicalisation cost: DeepSeek-V3.2 fp8 ({n_layers} + {n_layers} layers, 64-token blocks), "
          f"{repeats} interleaved repeats, CPU s/GB median [min-max] (getrusage; a shared 2-core machine)")
    print(f"{'blocks/chunk':>12} {'chunk bytes':>12} {'rocm gather':>24} {'rocm scatter':>24} {'memcpy':>24} "
          f"{'cuda (no copy)':>15}")
    for bpc in (1, 4):
        rocm, cuda = plan_groups(facts("rocm", bpc))[0], plan_groups(facts("cuda", bpc))[0]
        assert cuda.contiguous and not rocm.contiguous and rocm.layout.namespace() == cuda.layout.namespace()
        n = rocm.layout.payload_bytes
        src = memoryview(np.random.default_rng(0).integers(0, 256, rocm.slot_bytes, dtype=np.uint8))
        dst = memoryview(bytearray(n))
        back = memoryview(bytearray(rocm.slot_bytes))
        inner = max(1, (256 << 20) // n)  # enough bytes per sample for getrusage's resolution
        samples: dict[str, list[float]] = {"gather": [], "scatter": [], "memcpy": []}
        for _ in range(repeats):
            for what, fn in (("gather", lambda: rocm.gather(src, dst)), ("scatter", lambda: rocm.scatter(dst, back)),
                             ("memcpy", lambda: dst.__setitem__(slice(None), src[:n]))):
                c0 = cpu()
                for _ in range(inner):
                    fn()
                samples[what].append((cpu() - c0) / (inner * n / 1e9))

        def fmt(v: list[float]) -> str:
            v = sorted(v)
            return f"{v[len(v) // 2]:.3f} [{v[0]:.3f}-{v[-1]:.3f}]"

        print(f"{bpc:>12} {n:>12,} {fmt(samples['gather']):>24} {fmt(samples['scatter']):>24} "
              f"{fmt(samples['memcpy']):>24} {'0 (one read)':>15}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="layers per family in the table (default 4)")
    ap.add_argument("--reorder-layers", type=int, default=61, help="layers of the reorder measurement (default 61)")
    ap.add_argument("--repeats", type=int, default=20, help="repeats of the reorder measurement (default 20)")
    ap.add_argument("--platform", default="cuda", help="the platform the deployments' writers run on (default cuda)")
    ap.add_argument("--sublayouts-only", action="store_true", help="only the sub-layout table and its cost")
    a = ap.parse_args()
    if not a.sublayouts_only:
        table(a.layers, a.platform)
        reorder_cost(a.reorder_layers, a.repeats)
    sublayouts()
    canonicalise_cost(a.reorder_layers, a.repeats)


if __name__ == "__main__":
    main()
