"""What a vLLM deployment stores per chunk, read from vLLM's own objects (the tier's fact extraction).

:func:`deployment_facts` turns vLLM's offloading spec, and the KV-cache config and vllm_config of the
connector constructing the tier, into :class:`kvformat.layout.DeploymentFacts`; :func:`derive_plans` adds
the row plans. vLLM is imported here only inside functions (the package imports without vLLM), and only
``kvformat.vllm`` imports this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import re

from ..cache import ROPE_STYLES, chain_layout
from ..format import CanonicalLayout
from ..errors import SchemaError
from ..layout import (
    ROLE_INDEXER, ROLE_MLA, DeploymentFacts, GroupFacts, LayerFacts, ParallelFacts, RowPlan, formula_layer,
    plan_groups, pp_stage_names, role_from_name, stage_layer_facts,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

__all__ = ["deployment_facts", "derive_plans", "derive_layout", "token_chain_layout", "vllm_platform"]


def _vllm_context(cfg: Any) -> tuple[Any, Any]:
    """``(vllm_config, kv_cache_config)`` of the vLLM connector that is constructing this tier, or Nones.

    vLLM 0.33/0.34 build secondary tiers inside ``OffloadingConnectorScheduler.__init__(spec, vllm_config,
    kv_cache_config)`` (via ``spec.get_manager()``): the scheduler's KV-cache config is in scope there and
    is the only place the per-layer placement is. It is taken only if its groups are exactly this
    spec's groups (same indices, same layer names), never guessed.
    """
    import sys

    from vllm.v1.kv_cache_interface import KVCacheConfig

    f: Any = sys._getframe(1)
    vc: Any = None
    for _ in range(64):
        if f is None:
            break
        loc = f.f_locals
        kc = loc.get("kv_cache_config")
        if isinstance(kc, KVCacheConfig) and _same_groups(kc, cfg):
            v = loc.get("vllm_config")
            vc = v if hasattr(v, "model_config") and hasattr(v, "cache_config") else None
            return vc, kc
        f = f.f_back
    return None, None


def _same_groups(kc: Any, cfg: Any) -> bool:
    groups = kc.kv_cache_groups
    return all(0 <= g.group_id < len(groups) and tuple(groups[g.group_id].layer_names) == tuple(g.layer_names)
               for g in cfg.groups)


_TORCH_ST = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "uint8": "U8", "int8": "I8",
             "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def _facts_from_kv_config(kc: Any, cfg: Any, dcp: int = 1) -> tuple[dict[str, LayerFacts], dict[int, str], bool]:
    """Per-layer facts from vLLM's KV-cache config (scheduler or worker form) and the group kinds.

    The scheduler's config flattens a group's ``UniformTypeKVCacheSpecs`` to its first layer's spec, so
    a layer's own spec is known when the group is not mixed, or when the layer shares the first layer's
    tensor (vLLM puts exactly the layers of one spec in one tensor). Otherwise its page is the tensor's
    placement and the formulas must agree with it (role from the name, :func:`formula_layer`).
    """
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, UniformTypeKVCacheSpecs

    import vllm.v1.kv_cache_interface as kvi

    SlidingWindowMLASpec: Any = getattr(kvi, "SlidingWindowMLASpec", None)  # vLLM 0.34
    tensor_of: dict[str, tuple[Any, int]] = {}
    for t in kc.kv_cache_tensors:
        names: Any = getattr(t, "layers", None) or getattr(t, "shared_by", ())
        for i, n in enumerate(names):
            tensor_of[n] = (t, i)
    mla_types = (MLAAttentionSpec, SlidingWindowMLASpec) if SlidingWindowMLASpec else (MLAAttentionSpec,)
    all_specs = True  # every layer's own spec was in the config (none came from placement + formulas)
    out: dict[str, LayerFacts] = {}
    kinds: dict[int, str] = {}
    for g in cfg.groups:
        grp = kc.kv_cache_groups[g.group_id]
        gspec = grp.kv_cache_spec
        per_layer = dict(gspec.kv_cache_specs) if isinstance(gspec, UniformTypeKVCacheSpecs) else {}
        first = grp.layer_names[0]
        kinds[g.group_id] = "sliding_window" if isinstance(gspec, SlidingWindowMLASpec) else "full"
        for n in grp.layer_names:
            t, i = tensor_of.get(n, (None, 0))
            spec = per_layer.get(n)
            if spec is None and not per_layer and (t is None or tensor_of.get(first, (None,))[0] is t):
                # The scheduler's flattened spec is the first layer's; vLLM's planner puts exactly the
                # layers of one spec into one tensor, so it is also the spec of that tensor's layers.
                spec = gspec
            all_specs = all_specs and spec is not None
            # A worker's block holds tokens_per_block / dcp tokens: vLLM scales the offloading block by DCP.
            lf = _layer_fact(n, spec, t, i, g.tokens_per_block // dcp, cfg.model.dtype, mla_types)
            if isinstance(lf, str):
                kinds[g.group_id] = lf
                continue
            out[n] = lf
    return out, kinds, all_specs


def _layer_fact(n: str, spec: Any, t: Any, i: int, tpb: int, kv_dtype: str, mla_types: tuple[Any, ...]
                ) -> LayerFacts | str:
    """A layer's facts, or the group kind that refuses it (a non-MLA spec)."""
    gpu_offset = t.offset + i * t.layer_stride if t is not None and t.layer_stride is not None else None
    block_stride = t.block_stride if t is not None else None
    if spec is not None:
        if not isinstance(spec, mla_types):
            return f"{type(spec).__name__} (not MLA)"
        role = ROLE_INDEXER if str(getattr(spec, "cache_role", "sparse")) == "indexer" else ROLE_MLA
        page = spec.page_size_bytes
        unpadded = getattr(spec, "unpadded_page_size_bytes", page)
        st = _TORCH_ST.get(str(spec.dtype).removeprefix("torch."), "U8")
        kvd = getattr(spec, "cache_dtype_str", None) or ""
        if kvd in ("", "auto"):  # vLLM's default "auto" is the model's dtype, not a KV dtype: recorded as is, it
            kvd = kv_dtype if role == ROLE_MLA else ""  # gave the layout a roles entry nothing else computes
        if role == ROLE_INDEXER:
            kvd = "dsa_indexer_fp8" if unpadded == tpb * 132 and st == "U8" else f"indexer_{st.lower()}"
        elif kvd in ("fp8", "fp8_e4m3") and st == "U8":
            st = "F8_E4M3"
        elif kvd == "fp8_e5m2" and st == "U8":
            st = "F8_E5M2"
        if kvd == "fp8_ds_mla":
            st = "U8"
        item = {"BF16": 2, "F16": 2, "F32": 4}.get(st, 1)
        if page != unpadded or getattr(spec, "tokens_per_state", 1) != 1 or unpadded % (tpb * item):
            return LayerFacts(n, "opaque", kvd, "U8", (max(1, page),), page, gpu_offset, block_stride)
        return LayerFacts(n, role, kvd, st, (tpb, unpadded // (tpb * item)), page, gpu_offset, block_stride)
    # No spec of its own: its placement gives the page; the formulas must name the format exactly.
    if t is None:
        return LayerFacts(n, "opaque", kv_dtype, "U8", (1,), 0)
    block_outer = t.block_stride is not None and t.layer_stride is not None and t.layer_stride < t.block_stride
    page = t.layer_stride if block_outer and len(t.layers) > 1 else t.block_stride
    lf = formula_layer(n, role_from_name(n), kv_dtype, tpb, page)
    if lf is None:
        return LayerFacts(n, "opaque", kv_dtype, "U8", (max(1, page),), page, gpu_offset, block_stride)
    return LayerFacts(n, lf.role, lf.kv_dtype, lf.st_dtype, lf.shape, page, gpu_offset, block_stride)


def _pins_from_vllm(vc: Any) -> dict[str, str]:
    """Identity vLLM knows and kvformat would otherwise miss: weight quantization, hf_overrides."""
    import hashlib
    import json

    pins: dict[str, str] = {}
    mc = getattr(vc, "model_config", None)
    q = getattr(mc, "quantization", None)
    if q:
        pins["quantization"] = str(q)
    ov = getattr(mc, "hf_overrides", None)
    if ov and isinstance(ov, dict):
        pins["hf_overrides_sha256"] = hashlib.sha256(
            json.dumps(ov, sort_keys=True, default=str).encode()).hexdigest()[:32]
    elif callable(ov):
        pins["hf_overrides_callable"] = f"{getattr(ov, '__module__', '')}.{getattr(ov, '__qualname__', '')}"[:256]
    return pins


def _pp_stages(cfg: Any, vc: Any) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...], dict[str, str],
                                           tuple[int, ...]]:
    """Per pipeline stage, the layer names its workers hold; the group's layers in canonical (model) order;
    each layer's stage-0 counterpart; the decoder layers per stage (:func:`kvformat.layout.pp_stage_names`).

    The scheduler's KV-cache config and offloading config are stage 0's (``generate_scheduler_kv_cache_config``
    takes worker 0's). The other stages' layers follow from vLLM's own partition, ``get_pp_indices``
    (which honours ``VLLM_PP_LAYER_PARTITION``), over the model's ``num_hidden_layers``.
    """
    from vllm.distributed.utils import get_pp_indices

    pp = cfg.parallel.pp_size
    mc = getattr(vc, "model_config", None)
    hf = getattr(mc, "hf_text_config", None)
    n_layers = getattr(hf, "num_hidden_layers", None)
    if not isinstance(n_layers, int) or n_layers < pp:
        raise SchemaError("parallel", "pipeline parallelism: the model's num_hidden_layers (vLLM's "
                          "hf_text_config) is not known, so which layers each stage holds is unknown; not stored")
    if getattr(vc, "speculative_config", None) is not None:
        raise SchemaError("parallel", "pipeline parallelism with speculative decoding (MTP layers outside the "
                          "decoder stack, on the last stage only) is not supported; not stored")
    ranges = [get_pp_indices(n_layers, s, pp) for s in range(pp)]
    stages, canonical, twin = pp_stage_names(tuple(cfg.groups[0].layer_names), ranges)
    return stages, canonical, twin, tuple(b - a for a, b in ranges)


def vllm_platform() -> str | None:
    """The platform whose writers fill this deployment's pages (``kvformat.layout.PLATFORMS``), from vLLM's
    ``current_platform`` (the engine core, which builds the tier, runs on the workers' platform): its FP8
    flavour (``fp8_dtype()``, what every vLLM FP8 cache write uses) and, on CUDA, whether the DSA indexer
    stores UE8M0-packed scales (``deep_gemm.mqa_logits_use_mx_scales``). None when vLLM reports another
    platform or an answer kvformat has no description for."""
    import torch
    from vllm.platforms import current_platform as p

    try:
        if p.is_cuda():
            from vllm.utils.deep_gemm import mqa_logits_use_mx_scales

            if p.fp8_dtype() != torch.float8_e4m3fn:
                return None
            return "cuda-mx" if mqa_logits_use_mx_scales() else "cuda"
        if p.is_rocm():
            fp8 = p.fp8_dtype()
            return {torch.float8_e4m3fnuz: "rocm-fnuz", torch.float8_e4m3fn: "rocm"}.get(fp8)
    except Exception:  # noqa: BLE001 - a platform query that fails (no device) is no answer
        return None
    return None


_DETECT: Any = object()


def deployment_facts(spec: "OffloadingSpec", revision: str | None = None, *, vllm_config: Any = None,
                     kv_cache_config: Any = None, platform: Any = _DETECT) -> DeploymentFacts:
    """What ``spec``'s deployment stores per chunk, from vLLM's own objects (see :mod:`kvformat.layout`).

    ``vllm_config``/``kv_cache_config`` default to those of the connector constructing the tier (found
    in the caller's frames); ``platform`` to :func:`vllm_platform`. Raises SchemaError for deployments
    kvformat does not store (a group that is not MLA, DCP over pages whose token order is not described).
    """
    cfg = spec.config
    par = cfg.parallel
    if platform is _DETECT:
        platform = vllm_platform()
    # PCP ranks hold replicas of their TP group's KV, not token shards: vLLM 0.34's scheduler scales the
    # block by DCP only (v1/core/sched/scheduler.py passes pcp_world_size=1 to the KV cache manager), the
    # worker's slot mapping shards tokens over DCP only (v1/worker/gpu/model_runner.py: BlockTables(cp_size=
    # dcp_size, cp_rank=dcp_rank)), and PCPManager writes the KV gathered from every PCP rank into every PCP
    # rank's cache through the global batch's slot mappings (v1/worker/gpu/pcp_manager.py
    # prepare_slot_mappings). vLLM's offloading canonical_mapping (cp_size = dcp * pcp) disagrees with its
    # own runner; tests/test_pcp.py runs the runner's slot mapping. Every store still checks PCP replicas.
    sharded = par.pp_size > 1 or par.dcp_size > 1 or par.pcp_size > 1
    if kv_cache_config is None:
        vllm_config, kv_cache_config = _vllm_context(cfg)
    if sharded and (vllm_config is None or kv_cache_config is None):
        raise SchemaError("parallel", f"pipeline/context parallelism (pp={par.pp_size}, dcp={par.dcp_size}, "
                          f"pcp={par.pcp_size}): "
                          "the stage partition, the DCP interleave and each layer's page come from vLLM's config "
                          "and KV-cache config, which the tier did not find; not stored")
    layers = None
    kinds: dict[int, str] = {}
    all_specs = False
    source = "offloading-config"
    if kv_cache_config is not None:
        if not _same_groups(kv_cache_config, cfg):
            raise SchemaError("groups", "the KV-cache config given does not hold this deployment's groups")
        replicas = getattr(kv_cache_config, "kv_tp_replicas", None)
        if replicas is not None and par.dcp_size > 1:
            # vLLM counts CONSECUTIVE identical TP ranks, and DCP ranks are consecutive: with DCP it is 1 by
            # construction. Head sharding is what must be ruled out: count without DCP, by vLLM's own rule.
            from vllm.v1.core import kv_cache_planning  # kv_tp_replicas and this rule came together (0.34)

            replicas = kv_cache_planning.kv_cache_groups_tp_replicas(kv_cache_config.kv_cache_groups, par.tp_size, 1)
        if replicas is not None and par.tp_size > 1 and replicas < par.tp_size:
            # vLLM's own count of consecutive TP ranks holding identical KV for EVERY layer: below the TP
            # size, some layer is head-sharded (a hybrid model), whatever its page size looks like.
            raise SchemaError("groups", f"vLLM's KV-cache config says only {replicas} of {par.tp_size} TP ranks "
                              "hold identical KV (kv_tp_replicas): some layers are head-sharded, not MLA; "
                              "kvformat stores replicated (MLA) KV only")
        layers, kinds, all_specs = _facts_from_kv_config(kv_cache_config, cfg, par.dcp_size)
        source = "vLLM KV-cache config"
    pins = _pins_from_vllm(vllm_config) if vllm_config is not None else {}
    # Replicated KV is proven by vLLM's single-slot row (it requires every layer replicated on every TP
    # rank) or by every layer's own MLA spec. model_config.use_mla is not enough: a hybrid model is MLA
    # too, and the scheduler's config hides which of its layers are head-sharded when pages coincide.
    known = bool(getattr(spec, "replicated_layout", False)) or (layers is not None and all_specs)
    if revision is None and vllm_config is not None:
        revision = getattr(getattr(vllm_config, "model_config", None), "revision", None) or None
    canonical = None
    if cfg.canonical_layout:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id

        canonical = canonical_format_id(cfg.kv_cache_layout)
    if cfg.canonical_layout:
        row, copies = "canonical", 1  # every worker shares the canonical area at the row start
    elif getattr(spec, "replicated_layout", False):
        row, copies = "replicated", 1
    else:
        row, copies = "per_worker", max(1, par.world_size)
    groups = tuple(GroupFacts(g.group_id, g.tokens_per_block, tuple(g.layer_names),
                              kinds.get(g.group_id, "sliding_window"
                                        if getattr(g, "sliding_window_size_in_chunks", None) else "full"))
                   for g in cfg.groups)
    parallel = None
    if sharded:
        parallel, groups, layers = _sharded_facts(cfg, vllm_config, groups, layers or {})
    return DeploymentFacts(model=cfg.model.name, kv_dtype=cfg.model.dtype, tokens_per_hash=cfg.cache.tokens_per_hash,
                           blocks_per_chunk=spec.blocks_per_chunk, worker_bytes_per_block=cfg.worker_kv_bytes_per_block,
                           groups=groups, row=row, copies=copies, kv_cache_layout=cfg.kv_cache_layout,
                           canonical_family=canonical, revision=revision, pins=pins, layers=layers, source=source,
                           replicated_kv_known=known, parallel=parallel, platform=platform)


def _sharded_facts(cfg: Any, vc: Any, groups: tuple[GroupFacts, ...], layers: dict[str, LayerFacts]
                   ) -> tuple[ParallelFacts, tuple[GroupFacts, ...], dict[str, LayerFacts]]:
    """The placement of a pipeline and/or decode-context parallel deployment (see :class:`ParallelFacts`)."""
    par = cfg.parallel
    if len(groups) != 1:
        raise SchemaError("parallel", f"pipeline/decode-context parallelism with {len(groups)} KV-cache groups is "
                          "not supported; not stored")
    want = par.tp_size * par.pp_size * par.pcp_size
    if par.world_size != want:
        raise SchemaError("parallel", f"world_size {par.world_size} is not tp x pp x pcp = {want}")
    if par.tp_size % par.dcp_size:
        raise SchemaError("parallel", f"dcp={par.dcp_size} does not divide tp={par.tp_size}")
    pc = getattr(vc, "parallel_config", None)
    inter = getattr(pc, "cp_kv_cache_interleave_size", None) or getattr(pc, "dcp_kv_cache_interleave_size", 1)
    g = groups[0]
    stage0 = tuple(g.layer_names)
    if par.pp_size > 1:
        stages, canonical, twin, counts = _pp_stages(cfg, vc)
        layers = stage_layer_facts(layers, canonical, twin)
    else:
        stages, canonical, counts = (stage0,), stage0, ()
    facts = ParallelFacts(tp=par.tp_size, pp=par.pp_size, dcp=par.dcp_size, interleave=int(inter or 1), stages=stages,
                          stage_layers=counts, pcp=par.pcp_size)
    return facts, (GroupFacts(g.group, g.tokens_per_block, canonical, g.kind),), layers


def derive_plans(spec: "OffloadingSpec", revision: str | None = None,
                 **kw: Any) -> tuple[dict[int, RowPlan], DeploymentFacts]:
    """One :class:`~kvformat.layout.RowPlan` per KV-cache group of ``spec`` and the facts behind them."""
    facts = deployment_facts(spec, revision, **kw)
    return plan_groups(facts), facts


def derive_layout(spec: "OffloadingSpec", revision: str | None = None) -> tuple[CanonicalLayout, int, str]:
    """The canonical layout of ``spec``'s first group, the slots per primary row and the row kind."""
    plans, facts = derive_plans(spec, revision)
    return plans[spec.config.groups[0].group_id].layout, facts.copies, facts.row


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ST_KV = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "fp8_e4m3", "F8_E5M2": "fp8_e5m2"}
# Architectures whose MLA vLLM 0.33/0.34 always runs with interleaved RoPE (deepseek_v2.py: is_neox_style=False,
# whatever the config's rope_interleave says).
_INTERLEAVED_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                      "KimiK2ForCausalLM")


def token_chain_layout(spec: "OffloadingSpec", plans: dict[int, RowPlan], facts: DeploymentFacts,
                       rope: str | None) -> CanonicalLayout:
    """The token-chain namespace's layout for this deployment (kvformat.cache._keyscheme.chain_layout): what an
    SGLang deployment of the same model computes. Raises SchemaError when the deployment cannot share it: not one
    pure-MLA group of the model's decoder layers in order, speculative decoding (draft KV depends on tokens past
    the chunk), or a RoPE convention neither vLLM's config nor ``rope`` establishes."""
    cfg = spec.config
    if len(plans) != 1:
        raise SchemaError("key_scheme", f"token-chain names one pure-MLA KV-cache group, this deployment has "
                          f"{len(plans)}")
    plan = next(iter(plans.values()))
    if plan.order == "opaque":
        raise SchemaError("key_scheme", f"token-chain: the chunk's per-layer layout is unknown ({plan.source})")
    vc, _ = _vllm_context(cfg)
    if vc is not None and (getattr(vc, "speculative_config", None) is not None
                           or bool(getattr(vc, "num_hash_lookahead_tokens", 0))):
        raise SchemaError("key_scheme", "token-chain with speculative decoding: draft KV depends on tokens past the "
                          "chunk, which its name does not cover")
    names = [l.name for l in plan.layout.layers]
    found = [_LAYER_INDEX.search(n) for n in names]
    if not all(found):
        raise SchemaError("key_scheme", f"token-chain: layer {names[found.index(None)]!r} names no decoder layer")
    if rope is None and vc is not None:
        hf = getattr(getattr(vc, "model_config", None), "hf_config", None)
        if any(a in _INTERLEAVED_ARCHS for a in (getattr(hf, "architectures", None) or ())):
            rope = "interleaved"
    if rope not in ROPE_STYLES:
        raise SchemaError("rope", "token-chain: vLLM's config does not establish this model's RoPE convention; set "
                          f"the tier's \"rope\" to one of {', '.join(ROPE_STYLES)} (got {rope!r})")
    st = {l.dtype for l in plan.layout.layers}
    kvd = _ST_KV.get(st.pop()) if len(st) == 1 else None
    if kvd is None:
        raise SchemaError("key_scheme", "token-chain: the layers do not share one latent dtype")
    pins = {"rope": str(rope)}
    if kvd.startswith("fp8"):
        pins["kv_scale"] = "k_scale"  # vLLM divides the latent by k_scale before the cast (SGLang does not)
    for k in ("quantization", "hf_overrides_sha256", "hf_overrides_callable"):
        if k in facts.pins:
            pins[k] = facts.pins[k]
    tokens = plan.layout.tokens_per_block * plan.layout.blocks_per_chunk
    return chain_layout(facts.model, kvd, tokens, [int(m.group(1)) for m in found if m], plan.layout.layers,
                        facts.revision, pins)
