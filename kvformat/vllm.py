"""kvformat as a vLLM (0.33, 0.34) secondary offloading tier: :class:`KVFormatTier`.

Enable it in the tiering config of vLLM's ``OffloadingConnector`` (docs/vllm.md has every parameter)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 68719476736,
        "secondary_tiers": [{"type": "KVFormatTier", "module_path": "kvformat.vllm",
                             "root": "/mnt/kvcache", "max_bytes": "500GiB"}]}}'

What it does, per chunk of the primary (CPU) tier:

* store: exactly ONE canonical copy (the single replicated slot, or slot 0 of a per-worker row after
  checking every worker slot holds the same bytes), at ``<root>/<namespace>/<h[:2]>/<h[2:4]>/<hash>.kvf``.
  The namespace is a digest of TP-invariant identity only, so deployments of any TP size and either
  row layout share files. Existing files are skipped; writes are atomic (temp file + rename).
* load: header and layout checked (fail closed), checksums verified, payload placed into the slot
  (and copied into every worker slot of a per-worker row). A bad file is a miss, is moved to
  ``<root>/.quarantine/``, counted, and logged once per reason.
* capacity: ``max_bytes`` bounds the files under ``root`` (LRU, rebuilt from file mtimes at start-up
  in a background thread); files being loaded are never evicted; evictions are KV events.

vLLM is imported only by this module.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

# Probe first, so a missing vLLM (or one missing an import-time dependency of its own) says how to fix it.
try:
    import vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics  # noqa: F401
    import vllm.v1.kv_offload.tiering.async_lookup  # noqa: F401
except ImportError as _e:
    raise ImportError(f'kvformat.vllm needs vLLM 0.33 or 0.34 with tiered KV offloading: pip install "kvformat[vllm]" '
                      f'(import failed: {_e})', name=_e.name) from _e

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality, LookupResult, Medium, OffloadingCounterMetadata, OffloadingEvent, OffloadingGaugeMetadata,
    OffloadingMetricMetadata, OffloadKey, ReqContext, get_offload_block_hash, get_offload_group_idx, make_offload_key,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import (
    JobResult, RequestOffloadingContext, ScheduleEndContext, SecondaryTierManager, TransferJob,
)

from . import __version__
from ._paths import block_path_parts
from ._spec import CanonicalLayout, Provenance
from .layout import (
    ROLE_INDEXER, ROLE_MLA, DeploymentFacts, GroupFacts, LayerFacts, ParallelFacts, RowPlan, formula_layer,
    plan_groups, pp_stage_names, stage_layer_facts,
    role_from_name,
)
from ._tier._config import TierConfig
from ._tier._lru import LRUIndex
from ._tier._pool import DualPool
from ._tier._jobs import CounterReport, Job, JobBook, shutdown_bounded
from ._tier._rows import RowEngine
from .errors import SchemaError
from .storage import open_store

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger("kvformat.vllm")

METRIC_PREFIX = "vllm:kv_offload_kvformat_"
_COUNTER_DOCS = {
    "bytes_written": "Bytes of kvformat files written (header + data, one canonical copy per chunk).",
    "files_written": "kvformat files written.",
    "bytes_read": "Bytes of kvformat files read into the primary tier.",
    "files_read": "kvformat files loaded into the primary tier.",
    "checksum_failures": "Files whose header or data checksum did not match (served as misses).",
    "corrupt_files": "Corrupt, truncated or mismatched files quarantined (served as misses).",
    "layout_mismatches": "Files whose layout or key did not match this deployment (quarantined).",
    "replica_mismatches": "Chunks not stored because the per-worker slots of the row differed.",
    "evictions": "Files deleted to keep the root under max_bytes.",
    "evicted_bytes": "Bytes of files deleted to keep the root under max_bytes.",
    "dedup_saved_bytes": "Row bytes not written because they duplicate stored bytes (worker replicas, "
                         "chunks already on storage).",
    "missing_files": "Files gone at load time (deleted by another instance or by hand).",
    "io_errors": "Loads that failed with an OS error (served as misses).",
}
_GAUGE_DOCS = {
    "used_bytes": "Bytes of kvformat files under the root, as this tier accounts them.",
    "files": "kvformat files under the root, as this tier accounts them.",
}


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
        kvd = getattr(spec, "cache_dtype_str", None) or (kv_dtype if role == ROLE_MLA else "")
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


def deployment_facts(spec: "OffloadingSpec", revision: str | None = None, *, vllm_config: Any = None,
                     kv_cache_config: Any = None) -> DeploymentFacts:
    """What ``spec``'s deployment stores per chunk, from vLLM's own objects (see :mod:`kvformat.layout`).

    ``vllm_config``/``kv_cache_config`` default to those of the connector constructing the tier (found
    in the caller's frames). Raises SchemaError for deployments kvformat does not store (pipeline or
    context parallelism, a group that is not MLA).
    """
    cfg = spec.config
    par = cfg.parallel
    if par.pcp_size != 1:
        raise SchemaError("parallel", f"prefill context parallelism (pcp={par.pcp_size}) is not supported: vLLM 0.34 "
                          "admits it with secondary tiers, but which tokens a PCP rank's block holds (the scheduler "
                          "block is scaled by DCP only, the canonical mapping interleaves over DCP x PCP) could not "
                          "be established from vLLM's sources; refused rather than guessed")
    sharded = par.pp_size > 1 or par.dcp_size > 1
    if kv_cache_config is None:
        vllm_config, kv_cache_config = _vllm_context(cfg)
    if sharded and (vllm_config is None or kv_cache_config is None):
        raise SchemaError("parallel", f"pipeline/decode-context parallelism (pp={par.pp_size}, dcp={par.dcp_size}): "
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
                           replicated_kv_known=known, parallel=parallel)


def _sharded_facts(cfg: Any, vc: Any, groups: tuple[GroupFacts, ...], layers: dict[str, LayerFacts]
                   ) -> tuple[ParallelFacts, tuple[GroupFacts, ...], dict[str, LayerFacts]]:
    """The placement of a pipeline and/or decode-context parallel deployment (see :class:`ParallelFacts`)."""
    par = cfg.parallel
    if len(groups) != 1:
        raise SchemaError("parallel", f"pipeline/decode-context parallelism with {len(groups)} KV-cache groups is "
                          "not supported; not stored")
    if par.world_size != par.tp_size * par.pp_size:
        raise SchemaError("parallel", f"world_size {par.world_size} is not tp x pp = {par.tp_size * par.pp_size}")
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
                          stage_layers=counts)
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


# vLLM 0.34 added ``req_context`` to OffloadingEvent (0.33's tracker takes request data from the scheduler
# instead); fields are probed, not versions compared.
_EVENT_TAKES_REQ_CONTEXT = "req_context" in getattr(OffloadingEvent, "__dataclass_fields__", {})


class _Lookups(AsyncLookupManager):
    """Existence checks of blocks the index does not know (written by another instance), off-thread."""

    def __init__(self, tier: "KVFormatTier", tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._probe_many(keys)


class KVFormatTier(SecondaryTierManager):
    """vLLM secondary tier storing each MLA KV chunk once, as a checksummed, TP-independent kvformat file.

    Parameters (the tier dict; see docs/vllm.md)
    ----------
    root: directory (or, with a remote-storage backend installed, URL) holding the namespaces.
    read_threads, write_threads: I/O threads preferring loads / stores (default 8 / 8).
    compression: ``"none"`` (default) or ``"zstd"``; compression_level: zstd level (default 3).
    verify: verify checksums on every load (default true).
    max_bytes: bound on the files under ``root`` (int or "500GiB"); default unbounded.
    o_direct: ``"off"`` (default: buffered I/O), ``"auto"``/``"on"`` (O_DIRECT payload reads where the
        filesystem allows them).
    fsync: fsync each file and its directory before it counts as stored (default false).
    replica_policy: ``"verify"`` (default: per-worker slots must hash equal, else the chunk is not
        stored) or ``"trust_rank0"`` (store worker 0's slot unchecked).
    model_revision: optional model revision, part of the namespace identity.
    storage_options: dict passed to the storage backend (remote roots).
    enable_kv_events: emit stored/removed KV events (when vLLM's KV events are on); default false.
    locality: ``"LOCAL"`` or ``"REMOTE"`` (passed by vLLM's factory; reported on events).

    Raises
    ------
    SchemaError (a ValueError) for a bad parameter or a deployment this tier cannot store (not pure
    MLA with tensor parallelism only); TypeError for an unknown parameter.
    """

    medium: ClassVar[Medium] = Medium.STORAGE
    #: Bound on :meth:`shutdown` (seconds): a remote root must not hold a vLLM shutdown for minutes.
    shutdown_timeout_s: float = 10.0

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        out: dict[str, OffloadingMetricMetadata] = {
            METRIC_PREFIX + k: OffloadingCounterMetadata(documentation=d) for k, d in _COUNTER_DOCS.items()}
        out.update({METRIC_PREFIX + k: OffloadingGaugeMetadata(documentation=d) for k, d in _GAUGE_DOCS.items()})
        return out

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview, tier_type: str, root: str,
                 read_threads: int = 8, write_threads: int = 8, compression: str = "none",
                 compression_level: int = 3, verify: bool = True, max_bytes: int | str | None = None,
                 o_direct: str = "off", fsync: bool = False, replica_policy: str = "verify",
                 model_revision: str | None = None, storage_options: dict[str, Any] | None = None,
                 enable_kv_events: bool = False, locality: str | None = None,
                 backpressure_detector: "BackpressureDetector | None" = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = TierConfig.parse(root, read_threads=read_threads, write_threads=write_threads,
                                       compression=compression, compression_level=compression_level, verify=verify,
                                       max_bytes=max_bytes, o_direct=o_direct, fsync=fsync,
                                       replica_policy=replica_policy, model_revision=model_revision,
                                       storage_options=storage_options, enable_kv_events=enable_kv_events,
                                       locality=locality)
        self.locality = Locality(locality) if locality is not None else None
        self.plans, self.facts = derive_plans(offloading_spec, model_revision)
        self.copies, self.row_kind = self.facts.copies, self.facts.row
        if self.config.replica_policy == "trust_rank0" and self.copies > 1 and not self.facts.replicated_kv_known:
            raise SchemaError("replica_policy", "trust_rank0 stores worker 0's slot unchecked, but nothing vLLM "
                              "passed proves this model's KV is replicated on every worker (MLA); use \"verify\"")
        first = offloading_spec.config.groups[0].group_id
        self.layout = self.plans[first].layout  # the first group's (most deployments have one group)
        self.namespace = self.layout.namespace()
        self._ns_group = {p.layout.namespace(): g for g, p in self.plans.items()}
        if "://" not in root or root.startswith("file://"):
            self.store = open_store(root, o_direct=o_direct)  # storage_options are for URL roots only
        else:
            self.store = open_store(root, **self.config.storage_options)
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                logger.warning("enable_kv_events is set on tier '%s' but KV cache events are disabled globally; "
                               "the tier will not emit events.", tier_type)
        self._events_lock = threading.Lock()
        # This tier evicts and announces it, so vLLM's event tracker must count it as a holder of each
        # chunk it stored (a residency of its own, keyed by medium + ownership): the tracker then keeps the
        # chunk's block hashes after the CPU tier drops it and expands this tier's removals to them.
        self._event_owner: dict[str, Any] = {"ownership": tier_type, "removal_expected": True}
        par = offloading_spec.config.parallel
        pf = self.facts.parallel
        prov = Provenance(tp=max(1, par.tp_size), pp=max(1, par.pp_size), dcp=max(1, par.dcp_size), pcp=1,
                          row=self.row_kind, writer=f"kvformat {__version__} (vllm tier)",
                          pp_layers=pf.stage_layers if pf is not None and pf.pp > 1 else (),
                          cp_interleave=pf.interleave if pf is not None and pf.dcp > 1 else 1)
        self._flat = primary_kv_view.cast("B")
        self.index = LRUIndex(self.config.max_bytes)
        self.engines: dict[int, RowEngine] = {}
        for g, plan in self.plans.items():
            shared = self.engines[first] if self.engines else None
            self.engines[g] = RowEngine(self.store, plan, self._flat, self.block_size_bytes, self.copies,
                                        self.config, prov, self.index, self._on_removed, share=shared)
        self.engine = self.engines[first]
        self._pool = DualPool(self.config.read_threads, self.config.write_threads)
        self._lookups = _Lookups(self, tier_type)
        self._jobs = JobBook(self._pool, self._target, self.engine.warn_once, JobResult,
                             self._on_stored if self.events is not None else None, self._lookups.mark_miss)
        self._report = CounterReport(self.engine.counters, self.index)
        self._stop = threading.Event()
        self._scan = threading.Thread(target=self.engine.scan, args=(self._stop,), name="kvformat_tier_scan",
                                      daemon=True)
        self._scan.start()
        for g, plan in self.plans.items():
            logger.info("KVFormatTier at %s: group %d -> namespace %s, %s rows (%d slot(s)), %s, max_bytes=%s",
                        root, g, plan.layout.namespace(), self.row_kind, self.copies, plan.describe(),
                        self.config.max_bytes)

    # -- helpers ---------------------------------------------------------------------------------
    def _target(self, key: OffloadKey) -> tuple[RowEngine | None, str | None]:
        """The engine of the key's KV-cache group and its block hash (None, None for a group not stored)."""
        eng = self.engines.get(get_offload_group_idx(key))
        if eng is None:
            return None, None
        return eng, str(get_offload_block_hash(key).hex())

    def _probe_many(self, keys: list[OffloadKey]) -> list[bool]:
        out = [False] * len(keys)
        if self._stop.is_set():  # shutting down: no more storage round trips
            return out
        by_engine: dict[int, list[tuple[int, str]]] = {}
        for i, k in enumerate(keys):
            eng, h = self._target(k)
            if eng is not None and h is not None:
                by_engine.setdefault(id(eng), []).append((i, h))
        for eng in self.engines.values():
            todo = by_engine.get(id(eng))
            if todo:
                for (i, _), ok in zip(todo, eng.probe_many([h for _, h in todo])):
                    out[i] = ok
        return out

    def _on_removed(self, relpaths: list[str]) -> None:
        if self.events is None:
            return
        keys = []
        for rel in relpaths:
            parts = block_path_parts(rel, strict=False)
            group = self._ns_group.get(parts[0]) if parts is not None else None
            if parts is not None and group is not None:
                try:
                    keys.append(make_offload_key(bytes.fromhex(parts[1]), group))
                except ValueError:  # an odd number of hex digits: no vLLM key
                    continue
        if keys:
            with self._events_lock:
                self.events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=True,
                                                   locality=self.locality, **self._event_owner))

    def _on_stored(self, job: Job, stored: list[OffloadKey]) -> None:
        extra = dict(self._event_owner)
        if _EVENT_TAKES_REQ_CONTEXT:
            extra["req_context"] = job.req_context  # lets vLLM's tracker describe the chunk
        with self._events_lock:
            if self.events is not None:
                self.events.append(OffloadingEvent(keys=stored, medium=self.medium, removed=False,
                                                   locality=self.locality, **extra))

    # -- SecondaryTierManager ----------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        eng, h = self._target(key)
        if eng is None or h is None or key in self._jobs.failed:
            return LookupResult.MISS
        rel = eng.relpath(h)
        if rel in self.index:
            return LookupResult.HIT
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found and rel in self.index else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=True)

    def _submit(self, job_metadata: TransferJob, *, load: bool) -> None:
        self._jobs.submit(job_metadata.job_id, list(job_metadata.keys), job_metadata.chunk_ids, load=load,
                          req_context=getattr(job_metadata, "req_context", None))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return self._jobs.take_finished()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return ()
        with self._events_lock:
            out, self.events = self.events, []
        return out

    def drain_jobs(self) -> None:
        self._pool.wait_idle()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._refresh_recency(req_context)
        self._lookups.cleanup(req_context.req_id)

    def _refresh_recency(self, req_context: ReqContext) -> None:
        """Count the chunks a finished request used as recently used, CPU-tier hits included.

        vLLM never asks a secondary tier about a CPU-tier hit (and ``touch`` was never called, then
        removed in 0.34), so the request's end is the one hook that sees every chunk it used: the scheduler
        records each offload key's end-token position in the request context (0.33 and 0.34). Keys past
        the tokens actually processed are skipped, as vLLM's kvcr tier does.
        """
        positions = getattr(req_context, "_offload_key_positions", None)
        if not positions:
            return
        done = None
        counts = [getattr(req_context, a, None) for a in
                  ("num_computed_tokens", "num_in_flight_tokens", "num_prompt_tokens", "num_tokens")]
        if None not in counts:
            computed, in_flight, prompt, total = (int(c) for c in counts if c is not None)
            done = min(max(0, computed - in_flight), max(prompt, total - 1))
        # Deepest chunk first, so a request's shortest prefix ends up most recent: a longer prefix is
        # useless without the chunks before it, so those are the last to go.
        for key, pos in sorted(positions.items(), key=lambda kv: -kv[1]):
            if done is not None and pos > done:
                continue
            eng, h = self._target(key)
            if eng is not None and h is not None:
                self.index.touch(eng.relpath(h))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        for k, d in self._report.deltas().items():
            stats.increase_counter(METRIC_PREFIX + k, d)
        stats.set_gauge(METRIC_PREFIX + "used_bytes", self.index.used)
        stats.set_gauge(METRIC_PREFIX + "files", len(self.index))
        return stats

    def counters(self) -> dict[str, int]:
        """Cumulative counters since start (plus ``quarantined:<reason>`` counts, ``used_bytes``, ``files``)."""
        return self._report.totals()

    def wait_scanned(self, timeout: float | None = None) -> bool:
        """Block until the start-up scan of the root has finished (tests, tools)."""
        self._scan.join(timeout)
        return not self._scan.is_alive()

    def shutdown(self) -> None:
        """Stop within ``shutdown_timeout_s``: queued jobs fail (each reported once), running ones finish.

        The start-up scan and the async lookups stop at their next step; a remote call already in
        flight is not waited for past the deadline (its threads are daemons). Jobs submitted after
        shutdown fail at once. The primary buffer is released only when no tier thread can touch it any
        more; otherwise it is left to the garbage collector (a warning says so), never unmapped under a
        running copy.
        """
        if not shutdown_bounded(self.shutdown_timeout_s, self._stop, self.engines.values(), self._pool, self._scan,
                                self._lookups.shutdown, self._flat):
            logger.warning("kvformat tier: shutdown gave up after %.0f s waiting for storage I/O at %s; "
                           "the primary buffer is left to the garbage collector", self.shutdown_timeout_s,
                           self.store.root)


__all__ = ["KVFormatTier", "derive_layout", "METRIC_PREFIX"]
