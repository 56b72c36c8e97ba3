"""The layout model: how a deployment's primary row holds a chunk, and the canonical payload it maps to.

One module for every user of the rule (the vLLM tier, the legacy converter, the CLI, the staging path),
so a compacted file and a stored one name the same namespace. No vLLM import: callers describe what
they know as :class:`LayerFacts` / :class:`DeploymentFacts` and get one :class:`RowPlan` per KV-cache
group (spec/FORMAT.md §2, §4.3, §9).

What vLLM's offloading worker places in a CPU row (``offloading/worker.py``, ``cpu/gpu_worker.py``,
``cpu/shared_offload_region.py``; vLLM 0.33/0.34):

* layer-outer KV layouts (``LBNHC``, ``LBHNC``…): one region per distinct GPU tensor, in the order of
  the selected groups' layer names, layers aliasing the same bytes (several groups overlaid from byte
  0) sharing one region; a region holds ``page * blocks_per_chunk`` bytes, block ``j`` at ``j * page``.
* block-outer layouts (``BLHNC``…, every layer of a block packed side by side): ONE region of
  ``bytes_per_block * blocks_per_chunk``, block ``j`` at ``j * bytes_per_block``, each layer at its
  offset inside the block.
* vLLM's canonical layout: the canonical tensors from offset 0 of the row, shared by every worker.

The file's payload is always canonical: the group's layers in layer order, each ``page *
blocks_per_chunk`` bytes with block ``j`` at ``j * page``. A plan knows the runs that copy between the
two, so a block-outer and a layer-outer deployment share files. When the per-layer truth cannot be
established, the plan is *opaque*: the row region is stored as one ``U8`` tensor ``kvf.opaque`` and
the layout's ``pins`` name every input of its byte order, so only identical deployments share it.
"""

from __future__ import annotations

from typing import Any

from ._parallel import plan_parallel, pp_stage_names, stage_layer_facts
from ._sublayout import platform_dependent
from ._types import (
    _ITEMSIZE, MLA_WIDTHS, PACKED_DTYPES, ROLE_INDEXER, ROLE_MLA, ROLE_OPAQUE, DeploymentFacts, GroupFacts, LayerFacts,
    ParallelFacts, RowPlan, Run, Shard, _coalesce, _family, _layout, cp_canonical_token, form_pins, layer_forms,
    page_runs, role_from_name,
)
from ..format import OPAQUE_LAYER, LayerSpec, st_dtype_for
from ..errors import SchemaError

__all__ = [
    "ROLE_MLA", "ROLE_INDEXER", "ROLE_OPAQUE", "PACKED_DTYPES", "LayerFacts", "GroupFacts", "DeploymentFacts",
    "RowPlan", "Shard", "ParallelFacts", "plan_groups", "role_from_name", "formula_layer", "cp_canonical_token",
    "pp_stage_names", "stage_layer_facts",
]

def formula_layer(name: str, role: str, kv_dtype: str, tokens_per_block: int, page: int) -> LayerFacts | None:
    """The LayerFacts the known formulas give for a ``page``-byte block, or None if none fits exactly.

    MLA latents: a shipped latent width of ``kv_dtype`` (bf16/f16/f32/fp8 elements), or vLLM's packed
    ``fp8_ds_mla`` (656 bytes per token, also what an ``fp8`` cache of a sparse-MLA model holds). DSA
    indexer caches: 132 bytes per token.
    """
    if page <= 0 or page % tokens_per_block:
        return None
    per_token = page // tokens_per_block
    if role == ROLE_INDEXER:
        if per_token != PACKED_DTYPES["dsa_indexer_fp8"][0]:
            return None
        return LayerFacts(name, role, "dsa_indexer_fp8", "U8", (tokens_per_block, per_token), page)
    if role != ROLE_MLA:
        return None
    if kv_dtype in ("fp8_ds_mla", "fp8", "fp8_e4m3") and per_token == PACKED_DTYPES["fp8_ds_mla"][0]:
        return LayerFacts(name, role, "fp8_ds_mla", "U8", (tokens_per_block, per_token), page)
    st = st_dtype_for(kv_dtype)
    item = _ITEMSIZE.get(st)
    if item is None or st == "U8" or per_token % item or per_token // item not in MLA_WIDTHS:
        return None
    return LayerFacts(name, role, kv_dtype, st, (tokens_per_block, per_token // item), page)


def _opaque(facts: DeploymentFacts, g: GroupFacts, why: str) -> RowPlan:
    """The whole slot as one region, its identity pinning every input of its byte order."""
    bpc = facts.blocks_per_chunk
    slot = facts.worker_bytes_per_block * bpc
    import hashlib

    names = "\n".join(f"{gf.group}:{n}" for gf in facts.groups for n in gf.layer_names)
    # Stable inputs only (never the reason text): the namespace must not move with a log message.
    pins = {**facts.pins, "opaque": "v1", "row.kv_cache_layout": str(facts.kv_cache_layout or ""),
            "row.worker_bytes_per_block": str(facts.worker_bytes_per_block),
            "row.layers_sha256": hashlib.sha256(names.encode()).hexdigest()}
    if platform_dependent(ROLE_MLA, facts.kv_dtype) or any(role_from_name(n) != ROLE_MLA
                                                            for gf in facts.groups for n in gf.layer_names):
        pins["row.platform"] = facts.platform or "unknown"  # FP8 flavour, indexer order: the platform's
    spec = LayerSpec(OPAQUE_LAYER, "U8", (facts.worker_bytes_per_block,), role=ROLE_OPAQUE)
    layout = _layout(facts, g, (spec,), _family(facts), pins)
    return RowPlan(layout, slot, ((0, 0, slot, 1, slot, slot),), "opaque", f"{facts.source}; opaque: {why}")


def _group_layer_facts(facts: DeploymentFacts, g: GroupFacts) -> tuple[list[LayerFacts] | None, str]:
    """Per-layer facts of a group from vLLM's config, else from the formulas; or (None, why not)."""
    if facts.layers is not None:
        missing = [n for n in g.layer_names if n not in facts.layers]
        if missing:
            return None, f"no KV-cache spec for layer {missing[0]}"
        out = [facts.layers[n] for n in g.layer_names]
        for lf in out:
            if lf.role != role_from_name(lf.name) and lf.role in (ROLE_MLA, ROLE_INDEXER):
                return None, f"layer {lf.name} is a {lf.role} but its name says {role_from_name(lf.name)}"
        return out, facts.source
    if len(facts.groups) != 1:
        # Which bytes of a row belong to which group is only known from vLLM's placement.
        raise SchemaError("groups", f"{len(facts.groups)} KV-cache groups and no per-layer placement from vLLM's "
                          "KV-cache config: where each group's layers sit in the row is unknown; not stored")
    names = g.layer_names
    roles = [role_from_name(n) for n in names]
    n_mla, n_idx = roles.count(ROLE_MLA), roles.count(ROLE_INDEXER)
    total = facts.worker_bytes_per_block
    tpb = g.tokens_per_block
    if n_idx == 0:
        # One group of one role: vLLM merges its layers into one spec, so every page is total / n.
        if total % len(names):
            return None, f"{total} bytes per block do not split into {len(names)} equal pages"
        page = total // len(names)
        known = formula_layer("x", ROLE_MLA, facts.kv_dtype, tpb, page)
        if known is None:
            # An unknown width is still one uniform page per layer: describe it as bytes, not as values.
            st = st_dtype_for(facts.kv_dtype)
            item = _ITEMSIZE.get(st, 1)
            if st == "U8" or page % (tpb * item):
                st, item = "U8", 1
            if page % tpb:
                return None, f"a {page}-byte page does not split into {tpb} tokens"
            shape: tuple[int, ...] = (tpb, page // (tpb * item))
            kvd = facts.kv_dtype
        else:
            st, shape, kvd = known.st_dtype, known.shape, known.kv_dtype
        return [LayerFacts(n, ROLE_MLA, kvd, st, shape, page) for n in names], "uniform pages"
    idx_page = PACKED_DTYPES["dsa_indexer_fp8"][0] * tpb
    rest = total - n_idx * idx_page
    if n_mla == 0 or rest <= 0 or rest % n_mla:
        return None, "the DSA formulas do not add up to worker_kv_bytes_per_block"
    mla = formula_layer("x", ROLE_MLA, facts.kv_dtype, tpb, rest // n_mla)
    idx = formula_layer("x", ROLE_INDEXER, facts.kv_dtype, tpb, idx_page)
    if mla is None or idx is None:
        return None, f"{rest // n_mla} bytes per MLA block match no known latent format of {facts.kv_dtype}"
    out = []
    for n, r in zip(names, roles):
        t = mla if r == ROLE_MLA else idx
        out.append(LayerFacts(n, r, t.kv_dtype, t.st_dtype, t.shape, t.page))
    return out, "DSA formulas (exact sum)"


def _fallback_placement(facts: DeploymentFacts, g: GroupFacts, lfs: list[LayerFacts]) -> list[LayerFacts]:
    """GPU placement vLLM's planner gives one group (kv_cache_planning.get_kv_cache_config_from_groups):
    layers grouped by spec in order of first appearance; block-outer: side by side inside each block."""
    order: dict[tuple[Any, ...], list[LayerFacts]] = {}
    for lf in lfs:
        order.setdefault((lf.role, lf.kv_dtype, lf.st_dtype, lf.shape, lf.page), []).append(lf)
    out: dict[str, LayerFacts] = {}
    off = 0
    for members in order.values():
        for lf in members:
            out[lf.name] = LayerFacts(lf.name, lf.role, lf.kv_dtype, lf.st_dtype, lf.shape, lf.page, off,
                                      facts.worker_bytes_per_block if facts.block_outer else lf.page)
            off += lf.page
    return [out[lf.name] for lf in lfs]


def _plan_group(facts: DeploymentFacts, g: GroupFacts, all_facts: dict[str, LayerFacts]) -> RowPlan:
    lfs = [all_facts[n] for n in g.layer_names]
    bpc, tpb = facts.blocks_per_chunk, g.tokens_per_block
    specs = tuple(lf.spec(facts.kv_dtype) for lf in lfs)
    layout = _layout(facts, g, specs, _family(facts), {**facts.pins, **form_pins(facts, lfs, tpb)})
    slot = facts.worker_bytes_per_block * bpc
    # The payload: each layer's pages in layer order, block j at j * page.
    pay_off = list(layout.layer_offsets)
    # A layer whose worker pages are not in the file's order (a ROCm shuffled indexer, a CUDA indexer block of
    # several kernel blocks) moves token by token; every other layer moves as whole pages.
    forms = {lf.name: layer_forms(lf, facts.platform, tpb) for lf in lfs}
    reorder = {n for n, (loc, can) in forms.items() if loc is not None and can is not None and loc.name != can.name}
    ident = tuple(range(tpb))
    packed = any(lf.gpu_block_stride is not None and lf.gpu_block_stride != lf.page for lf in all_facts.values())
    runs: list[Run] = []
    if packed and facts.row != "canonical":
        # One region of block_stride bytes per block; each layer at its offset inside the block.
        stride = next(lf.gpu_block_stride for lf in all_facts.values() if lf.gpu_block_stride != lf.page)
        assert stride is not None
        if any(lf.gpu_offset is None or lf.gpu_offset + lf.page > stride for lf in lfs):
            raise SchemaError("layout", "a layer lies outside its packed block")
        for lf, po in zip(lfs, pay_off):
            if lf.name in reorder:
                for j in range(bpc):
                    runs += page_runs(forms[lf.name][0], tpb, forms[lf.name][1], tpb, ident,
                                      (lf.gpu_offset or 0) + j * stride, po + j * lf.page)
            else:
                runs.append((lf.gpu_offset or 0, po, lf.page, bpc, stride, lf.page))
        return RowPlan(layout, slot, tuple(runs), "block_outer", facts.source)
    # Layer-outer: one region per distinct GPU tensor (aliased layers share one), in the order of the
    # selected groups' layer names, each page * bpc bytes.
    region_of: dict[Any, int] = {}
    region_off = 0
    where: dict[str, int] = {}
    for gf in facts.groups:
        for n in gf.layer_names:
            lf = all_facts[n]
            k = (lf.gpu_offset, lf.gpu_block_stride) if lf.gpu_offset is not None else ("layer", n)
            if k not in region_of:
                region_of[k] = region_off
                region_off += lf.page * bpc
            where[n] = region_of[k]
    if region_off > slot:
        raise SchemaError("layout", f"the layers' regions ({region_off} bytes) exceed the row slot ({slot})")
    for lf, po in zip(lfs, pay_off):
        if lf.name in reorder:
            for j in range(bpc):
                runs += page_runs(forms[lf.name][0], tpb, forms[lf.name][1], tpb, ident, where[lf.name] + j * lf.page,
                                  po + j * lf.page)
        else:
            runs.append((where[lf.name], po, lf.page * bpc, 1, lf.page * bpc, lf.page * bpc))
    merged = _coalesce(runs)
    return RowPlan(layout, slot, merged, "layer_outer", facts.source)


def plan_groups(facts: DeploymentFacts) -> dict[int, RowPlan]:
    """One :class:`RowPlan` per group of ``facts``.

    A group whose per-layer truth cannot be established becomes opaque (its reason is in
    ``plan.source`` and in its pins). Raises SchemaError for deployments that must not be stored at all
    (a group that is not MLA, a packed row shared by several groups).
    """
    for g in facts.groups:
        if g.kind not in ("full", "sliding_window"):
            raise SchemaError("groups", f"group {g.group} is {g.kind}: kvformat stores MLA KV only")
    all_facts: dict[str, LayerFacts] = {}
    reasons: dict[int, str] = {}
    rules: dict[int, str] = {}
    for g in facts.groups:
        lfs, why = _group_layer_facts(facts, g)
        if lfs is None:
            reasons[g.group] = why
            continue
        rules[g.group] = why
        if facts.layers is None:
            lfs = _fallback_placement(facts, g, lfs)
        unknown = next((lf for lf in lfs if lf.role == ROLE_OPAQUE), None)
        if unknown is not None:
            reasons[g.group] = (f"layer {unknown.name}: a {unknown.page}-byte page that is padded, compressed or "
                                "of no known format")
            for lf in lfs:
                all_facts[lf.name] = lf
            continue
        for lf in lfs:
            if lf.role not in (ROLE_MLA, ROLE_INDEXER):
                raise SchemaError("layers", f"layer {lf.name} of group {g.group} is {lf.role}, not MLA KV: its "
                                  "KV is sharded across TP ranks and kvformat stores replicated (MLA) KV only")
            all_facts[lf.name] = lf
    packed = any(lf.gpu_block_stride is not None and lf.gpu_block_stride != lf.page for lf in all_facts.values())
    if packed and len(facts.groups) > 1:
        raise SchemaError("layout", f"a packed block-outer row shared by {len(facts.groups)} KV-cache groups: each "
                          "group's chunk is the whole packed block, mixing other groups' bytes; not stored")
    if facts.parallel is not None and not facts.parallel.trivial:
        g = facts.groups[0]
        if reasons:
            raise SchemaError("parallel", f"group {g.group}: {reasons[g.group]}; an opaque chunk cannot be assembled "
                              "from pipeline stages or DCP ranks; not stored")
        return {g.group: plan_parallel(facts, g, all_facts)}
    out = {}
    for g in facts.groups:
        if g.group in reasons:
            out[g.group] = _opaque(facts, g, reasons[g.group])
            continue
        try:
            plan = _plan_group(facts, g, all_facts)
            out[g.group] = RowPlan(plan.layout, plan.slot_bytes, plan.runs, plan.order, rules[g.group])
        except SchemaError as e:
            out[g.group] = _opaque(facts, g, e.message)
    return out
