"""Pipeline (PP) and decode-context (DCP) parallel rows: the stages' layer names and the sharded plan.

A PP stage's workers hold a contiguous range of the group's layers, a DCP rank holds interleaved tokens
of every block; :func:`plan_parallel` maps every worker slot to its part of the canonical payload
(docs/layout.md). No I/O and no vLLM: the tier and the legacy converter feed it what vLLM says.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from ._types import (
    ROLE_OPAQUE, DeploymentFacts, GroupFacts, LayerFacts, RowPlan, Run, Shard, _coalesce, _family, _layout,
    cp_canonical_token, form_pins, layer_forms, page_runs,
)
from ..errors import SchemaError

def _split_index(name: str) -> tuple[str, int] | None:
    """``name`` as (template with ``{}`` for its layer index, the index), by vLLM's rule for layer names
    (``extract_layer_index``: exactly one dot-separated integer component); None otherwise."""
    parts = name.split(".")
    pos = [i for i, p in enumerate(parts) if p.isdigit()]
    if len(pos) != 1:
        return None
    idx = int(parts[pos[0]])
    parts[pos[0]] = "{}"
    return ".".join(parts), idx


def pp_stage_names(stage0: Sequence[str], ranges: Sequence[tuple[int, int]]
                   ) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...], dict[str, str]]:
    """The layer names of every pipeline stage, from stage 0's names and the partition ``ranges``
    (``[(first layer, end)]`` per stage: vLLM's ``get_pp_indices``, or a legacy tree's recorded partition).

    Stage 0 must hold exactly layers ``ranges[0]``, each with the same modules (name templates), in
    layer-major or module-major order; the other stages are named and ordered the same way. Returns
    (names per stage, the group's names in model order, each name's stage-0 counterpart). Raises
    SchemaError when stage 0's names are not of that form (the other stages cannot then be named).
    """
    split = [_split_index(n) for n in stage0]
    if not stage0 or any(x is None for x in split):
        raise SchemaError("parallel", "pipeline parallelism: a layer name without exactly one layer index; the "
                          "other stages' layers cannot be named; not stored")
    templates = list(dict.fromkeys(x[0] for x in split if x is not None))
    lo, hi = ranges[0]

    def order(idx: range, major: str) -> list[str]:
        if major == "index":
            return [t.format(i) for i in idx for t in templates]
        return [t.format(i) for t in templates for i in idx]

    major = next((m for m in ("index", "template") if order(range(lo, hi), m) == list(stage0)), None)
    if major is None or lo != 0 or any(b < a for a, b in ranges):
        raise SchemaError("parallel", f"pipeline parallelism: stage 0's layers are not layers {lo}..{hi - 1} of the "
                          "partition with the same modules each; not stored")
    if any(ranges[i][1] != ranges[i + 1][0] for i in range(len(ranges) - 1)):
        raise SchemaError("parallel", f"the partition {list(ranges)} is not contiguous")
    stages = tuple(tuple(order(range(a, b), major)) for a, b in ranges)
    canonical = tuple(order(range(0, ranges[-1][1]), major))
    twin = {}
    for n in canonical:
        sp = _split_index(n)
        assert sp is not None
        twin[n] = sp[0].format(lo)
    return stages, canonical, twin


def stage_layer_facts(stage0: Mapping[str, LayerFacts], canonical: Sequence[str],
                      twin: Mapping[str, str]) -> dict[str, LayerFacts]:
    """Every stage's LayerFacts from stage 0's (each layer is its stage-0 counterpart's module, renamed).

    Raises SchemaError when two stage-0 layers of one module differ (then stage 0 does not describe the
    others)."""
    for n, lf in stage0.items():
        b = stage0.get(twin.get(n, n), lf)
        if (lf.role, lf.kv_dtype, lf.st_dtype, lf.shape, lf.page) != (b.role, b.kv_dtype, b.st_dtype, b.shape, b.page):
            raise SchemaError("parallel", f"layers {n} and {b.name} (one module, two layers) differ: the other "
                              "stages' layers cannot be described from stage 0's; not stored")
    return {n: stage0[n] if n in stage0 else replace(stage0[twin[n]], name=n, gpu_offset=None, gpu_block_stride=None)
            for n in canonical}


def plan_parallel(facts: DeploymentFacts, g: GroupFacts, all_facts: dict[str, LayerFacts]) -> RowPlan:
    """A chunk assembled from pipeline stages and decode-context ranks (vLLM's per-worker rows).

    Each layer's facts are those of ONE worker's block (``tokens_per_block / dcp`` tokens); the file holds
    the logical block of ``tokens_per_block`` tokens in token order, layers in the group's canonical order,
    so a PP x TP, a DCP x TP and a TP-only deployment of the same model store the same payload.
    """
    par = facts.parallel
    assert par is not None
    cp, inter, bpc = par.dcp, par.interleave, facts.blocks_per_chunk
    if facts.row != "per_worker":
        raise SchemaError("parallel", f"pipeline/decode-context parallel rows are per-worker rows in vLLM, got "
                          f"{facts.row!r} rows; not stored")
    if facts.block_outer:
        raise SchemaError("parallel", "pipeline/decode-context parallelism with a block-outer KV layout "
                          f"({facts.kv_cache_layout}) is not supported; not stored")
    if len(facts.groups) != 1:
        raise SchemaError("parallel", f"pipeline/decode-context parallelism with {len(facts.groups)} KV-cache "
                          "groups is not supported; not stored")
    local_tpb = g.tokens_per_block // cp
    if local_tpb * cp != g.tokens_per_block or local_tpb % inter:
        raise SchemaError("parallel", f"a {g.tokens_per_block}-token block does not split into {cp} DCP ranks "
                          f"of whole interleave runs of {inter} tokens")
    if len(par.stages) != par.pp or sorted(n for st in par.stages for n in st) != sorted(g.layer_names):
        raise SchemaError("parallel", "the pipeline stages do not hold exactly the group's layers")
    canon: list[LayerFacts] = []
    forms = {}
    for n in g.layer_names:
        lf = all_facts[n]
        if lf.role == ROLE_OPAQUE or len(lf.shape) < 2 or lf.shape[0] != local_tpb or lf.page % local_tpb:
            raise SchemaError("parallel", f"layer {n}: a {lf.page}-byte page is not {local_tpb} tokens; "
                              "its tokens cannot be placed across DCP ranks")
        forms[n] = layer_forms(lf, facts.platform, local_tpb)
        if cp > 1 and forms[n][0] is None:
            # Where a token's bytes sit in such a page is not known: moving tokens would be a guess.
            raise SchemaError("parallel", f"layer {n}: where a token's bytes sit in a {lf.role} {lf.kv_dtype} page "
                              f"on platform {facts.platform or 'unknown'} is not described (kvformat.layout."
                              "_sublayout); decode-context parallelism moves tokens, so it is refused for it; "
                              "not stored")
        canon.append(LayerFacts(n, lf.role, lf.kv_dtype, lf.st_dtype, (lf.shape[0] * cp, *lf.shape[1:]), lf.page * cp))
    specs = tuple(lf.spec(facts.kv_dtype) for lf in canon)
    layout = _layout(facts, g, specs, _family(facts),
                     {**facts.pins, **form_pins(facts, [all_facts[n] for n in g.layer_names], local_tpb)})
    pay_off = dict(zip(g.layer_names, layout.layer_offsets))
    slot = facts.worker_bytes_per_block * bpc
    by_part: dict[tuple[int, int], list[int]] = {}
    for w in range(par.pp * par.pcp * par.tp):
        by_part.setdefault((w // (par.pcp * par.tp), (w % par.tp) % cp), []).append(w)
    shards = []
    for (stage, cp_rank), slots in sorted(by_part.items()):
        runs: list[Run] = []
        region = 0
        # Local token l of this DCP rank is logical token cp_canonical_token(l) (vLLM's slot mapping).
        tmap = tuple(cp_canonical_token(t, cp_rank, cp, inter) for t in range(local_tpb))
        for n in par.stages[stage]:
            lf = all_facts[n]
            local, can = forms[n]
            for j in range(bpc):
                src, dst = region + j * lf.page, pay_off[n] + j * lf.page * cp
                if cp == 1 and (local is None or can is None or local.name == can.name):
                    runs.append((src, dst, lf.page, 1, lf.page, lf.page))  # whole pages: nothing moves inside
                else:
                    runs += page_runs(local, local_tpb, can, g.tokens_per_block, tmap, src, dst)
            region += lf.page * bpc
        if region > slot:
            raise SchemaError("parallel", f"pipeline stage {stage} holds {region} bytes per chunk, more than vLLM's "
                              f"per-worker slot ({slot} bytes, sized from stage 0's layers): vLLM's CPU row cannot "
                              "hold this partition either; not stored")
        shards.append(Shard(tuple(slots), _coalesce(runs), region))
    return RowPlan(layout, slot, (), "layer_outer", facts.source, tuple(shards))
