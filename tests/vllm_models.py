"""Today's MLA model families through vLLM's REAL KV-cache grouping and offloading config (test/tool helper).

Per family, the per-layer ``KVCacheSpec`` objects vLLM's attention layers report (``MLAAttentionSpec`` with
``cache_role=INDEXER`` for DSA indexer caches, ``SlidingWindowMLASpec``, ``FullAttentionSpec`` for a hybrid)
go through vLLM's own planning: ``get_global_kv_cache_groups`` -> ``get_kv_cache_config_from_groups``
(the worker's config) -> ``generate_scheduler_kv_cache_config`` -> ``build_offloading_config``. The
scheduler side is vLLM's real ``OffloadingConnectorScheduler(spec, vllm_config, kv_cache_config)`` (which
builds the ``TieringOffloadingManager`` and the secondary tiers, kvformat's among them). The worker side
cannot run without CUDA, so the row placement comes from vLLM's real ``OffloadingConnectorWorker.
register_kv_caches`` run over CPU views of the KV cache (``create_kv_cache_views``): the captured
``CanonicalKVCaches`` are the regions vLLM's ``CPUOffloadingWorker`` copies into each row slot. The
harness plays the GPU copy with those regions, so the bytes in each row are exactly those vLLM's worker
places there, and every layer's expected bytes are known independently of kvformat.

``ModelDeployment(family, tiers, tp=, row=, kv_layout=, bpc=, n_layers=)`` is a ``vllm_harness.Deployment``
whose items are seeds: ``store({key: seed})`` writes every layer's pages of that seed, ``load(keys)``
returns ``{key: {layer: bytes}}`` read back from every worker slot (all slots must agree), and
``expected(seed, group)`` gives the per-layer bytes a file must hold.
"""

from __future__ import annotations

import dataclasses
import uuid
from types import SimpleNamespace as NS
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs

try:
    from vllm.v1.kv_cache_interface import SparseCacheRole
except ImportError:  # vLLM 0.33 has no DSA roles
    SparseCacheRole = None  # type: ignore[assignment,misc]

from vllm_harness import Deployment, make_payload

ROW_KINDS = ("replicated", "per_worker", "canonical", "block_outer")


def _mla(bs: int, dtype: str) -> Any:
    if dtype == "fp8_ds_mla":
        return MLAAttentionSpec(block_size=bs, num_kv_heads=1, max_tp_shards=1, head_size=656, dtype=torch.uint8,
                                cache_dtype_str="fp8_ds_mla")
    if dtype == "fp8":
        return MLAAttentionSpec(block_size=bs, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.uint8,
                                cache_dtype_str="fp8")
    # vLLM's MLA layers pass their kv_cache_dtype, "auto" by default (mla_attention.py: cache_dtype_str=...)
    return MLAAttentionSpec(block_size=bs, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.bfloat16,
                            cache_dtype_str="auto")


def _indexer(bs: int) -> Any:
    return MLAAttentionSpec(block_size=bs, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
                            cache_role=SparseCacheRole.INDEXER)


def _attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _idx(i: int) -> str:
    return f"model.layers.{i}.self_attn.indexer.k_cache"


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: its HF id, the KV cache dtype the user sets, and the per-layer specs it reports."""

    name: str
    model: str
    cache_dtype: str  # vLLM's --kv-cache-dtype ("auto" = the model dtype, bf16 here)
    specs: Callable[[int, int], dict[str, Any]]  # (n_layers, block_size) -> {layer name: spec}
    note: str = ""


def _v3(dtype: str) -> Callable[[int, int], dict[str, Any]]:
    return lambda n, bs: {_attn(i): _mla(bs, dtype) for i in range(n)}


def _dsa(dtype: str, indexer_every: int = 1, mtp: bool = False) -> Callable[[int, int], dict[str, Any]]:
    def build(n: int, bs: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i in range(n + (1 if mtp else 0)):
            out[_attn(i)] = _mla(bs, dtype)
            if i % indexer_every == 0:
                out[_idx(i)] = _indexer(bs)
        return out
    return build


def _swa(n: int, bs: int) -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    out: dict[str, Any] = {}
    for i in range(n):
        if i % 2:
            out[_attn(i)] = SlidingWindowMLASpec(block_size=bs, num_kv_heads=1, max_tp_shards=1, head_size=576,
                                                 dtype=torch.bfloat16, sliding_window=4 * bs)
        else:
            out[_attn(i)] = _mla(bs, "bfloat16")
    return out


def _hybrid(n: int, bs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i in range(n):
        if i % 2:  # head-sharded attention: 2 KV heads of 144 (same page as the MLA layers)
            out[_attn(i)] = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=144, dtype=torch.bfloat16,
                                              max_tp_shards=2)
        else:
            out[_attn(i)] = _mla(bs, "bfloat16")
    return out


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("deepseek-v3-bf16", "deepseek-ai/DeepSeek-V3", "auto", _v3("bfloat16")),
    Family("deepseek-v3-fp8", "deepseek-ai/DeepSeek-V3", "fp8", _v3("fp8")),
    Family("kimi-k2-bf16", "moonshotai/Kimi-K2-Instruct", "auto", _v3("bfloat16")),
    Family("deepseek-v3.2-bf16", "deepseek-ai/DeepSeek-V3.2", "auto", _dsa("bfloat16"), "MLA + DSA indexer, one group"),
    Family("deepseek-v3.2-fp8", "deepseek-ai/DeepSeek-V3.2", "fp8", _dsa("fp8_ds_mla"), "fp8_ds_mla + DSA indexer"),
    Family("glm-5-fp8", "zai-org/GLM-5", "fp8", _dsa("fp8_ds_mla"), "fp8_ds_mla + DSA indexer"),
    Family("dsa-shared-indexer", "example/DSA-shared-indexer", "fp8", _dsa("fp8_ds_mla", indexer_every=2),
           "an indexer on every other layer"),
    Family("deepseek-v3.2-mtp", "deepseek-ai/DeepSeek-V3.2", "fp8", _dsa("fp8_ds_mla", mtp=True),
           "one more (MTP) layer with its indexer"),
    Family("sliding-window-mla", "example/SWA-MLA", "auto", _swa, "full + sliding-window MLA groups"),
    Family("hybrid-mla-gqa", "example/Hybrid-MLA-GQA", "auto", _hybrid, "MLA + head-sharded attention"),
)}


def vllm_config(family: Family, *, tp: int, row: str, kv_layout: str, bpc: int, tiers: Sequence[Mapping[str, Any]],
                block_size: int, cpu_bytes: int) -> Any:
    """The few VllmConfig fields vLLM's planning, build_offloading_config and the scheduler read."""
    from vllm.v1.kv_cache_interface import KVCacheLayout

    layout = "LBNHC" if kv_layout is None else kv_layout
    extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes, "secondary_tiers": [dict(t) for t in tiers],
                             "spec_name": "TieringOffloadingSpec"}
    if bpc > 1:
        extra["blocks_per_chunk"] = bpc
    if row == "canonical":
        extra["canonical_layout"] = True
    cache = NS(cache_dtype=family.cache_dtype, kv_cache_layout=layout, prefix_cache_retention_interval=None,
               num_gpu_blocks_override=None, block_size=block_size, prefix_match_unit=None, enable_prefix_caching=True,
               enable_extensible_kv_cache=False, get_resolved_kv_cache_layout=lambda: KVCacheLayout[layout])
    par = NS(tensor_parallel_size=tp, pipeline_parallel_size=1, prefill_context_parallel_size=1,
             decode_context_parallel_size=1, world_size=tp,
             distributed_executor_backend="ray" if row == "per_worker" else "mp", nnodes_within_dp=1, rank=0,
             data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None, cp_kv_cache_interleave_size=1)
    model = NS(use_mla=True, model=family.model, dtype=torch.bfloat16, max_model_len=4096, original_max_model_len=4096,
               get_total_num_kv_heads=lambda: 1, supports_kv_cache_grouping=False, revision=None, quantization=None,
               hf_overrides=None)
    return NS(cache_config=cache, parallel_config=par, model_config=model,
              scheduler_config=NS(disable_hybrid_kv_cache_manager=False), attention_config=NS(hisparse_config=None),
              kv_transfer_config=NS(kv_connector_extra_config=extra, engine_id=f"kvfm_{uuid.uuid4().hex[:12]}"),
              kv_events_config=None, num_prefill_lookahead_tokens=0, num_hash_lookahead_tokens=0,
              speculative_config=None)


def plan_model(family: Family, *, tp: int = 1, row: str = "replicated", bpc: int = 1, n_layers: int = 4,
               block_size: int = 64, tiers: Sequence[Mapping[str, Any]] = (), cpu_bytes: int = 32 << 20,
               num_blocks: int = 8) -> tuple[Any, Any, Any, Any, Any]:
    """``(vllm_config, worker kv config, scheduler kv config, OffloadingConfig, captured CanonicalKVCaches)``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    from vllm.v1.core import kv_cache_planning as P
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    kv_layout = "BLHNC" if row == "block_outer" else "LBNHC"
    vc = vllm_config(family, tp=tp, row="replicated" if row == "block_outer" else row, kv_layout=kv_layout, bpc=bpc,
                     tiers=tiers, block_size=block_size, cpu_bytes=cpu_bytes)
    specs = family.specs(n_layers, block_size)
    groups = P.get_global_kv_cache_groups(vc, [specs])
    kc = P.get_kv_cache_config_builder(vc).get_kv_cache_config_from_groups(vc, groups, num_blocks)
    kc.kv_tp_replicas = P.kv_cache_groups_tp_replicas(kc.kv_cache_groups, tp, 1)
    skc = generate_scheduler_kv_cache_config([kc])
    ocfg = build_offloading_config(vc, skc)
    return vc, kc, skc, ocfg, capture_regions(vc, kc, row)


def capture_regions(vc: Any, kc: Any, row: str) -> Any:
    """The ``CanonicalKVCaches`` vLLM's worker derives from this KV cache (regions and per-group refs)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
    from vllm.v1.kv_cache_interface import KVCacheLayout, create_kv_cache_views

    raw = torch.zeros(kc.kv_cache_tensors[0].size, dtype=torch.int8)
    layout = KVCacheLayout[vc.cache_config.kv_cache_layout]
    kv: dict[str, torch.Tensor] = {}
    for t in kc.kv_cache_tensors:
        g = next(g for g in kc.kv_cache_groups if t.layers[0] in g.layer_names)
        gs = g.kv_cache_spec
        spec = gs.kv_cache_specs[t.layers[0]] if isinstance(gs, UniformTypeKVCacheSpecs) else gs
        for n, v in zip(t.layers, create_kv_cache_views(raw, spec, kc.num_blocks, layout, t)):
            kv[n] = v

    class _Capture(OffloadingConnectorWorker):
        def _init_worker(self, kv_caches: Any) -> None:  # the GPU worker itself needs CUDA
            self.captured = kv_caches

    fake = NS(replicated_layout=False, config=NS(canonical_layout=row == "canonical", parallel=NS(rank=0)))
    w = _Capture(fake, vc, kc)  # type: ignore[arg-type]
    w.register_kv_caches(kv)
    return NS(caches=w.captured, raw=raw, layers=kv)


class ModelDeployment(Deployment):
    """A Deployment of a model family (see the module docstring). Items are seeds, loads per-layer bytes."""

    def __init__(self, family: str | Family, tiers: Sequence[Mapping[str, Any]], *, tp: int = 1,
                 row: str = "replicated", bpc: int = 1, n_layers: int = 4, block_size: int = 64,
                 num_chunks: int = 8) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        fam = FAMILIES[family] if isinstance(family, str) else family
        self.family = fam
        vc, kc, skc, ocfg, regions = plan_model(fam, tp=tp, row=row, bpc=bpc, n_layers=n_layers,
                                                block_size=block_size, tiers=tiers, cpu_bytes=1 << 30)
        copies = 1 if (row in ("replicated", "block_outer", "canonical") and tp > 1) or tp == 1 else tp
        slot = ocfg.worker_kv_bytes_per_block * bpc
        row_bytes = -(-slot * (1 if ocfg.replicated_layout or row == "canonical" else tp) // 4096) * 4096
        ocfg = dataclasses.replace(ocfg, extra_config={**ocfg.extra_config, "cpu_bytes_to_use": row_bytes * num_chunks})
        self.vllm_config, self.kv_cache_config, self.scheduler_kv_cache_config = vc, kc, skc
        self.cfg = ocfg
        self.regions = regions
        self.tp, self.n_layers, self.blocks_per_chunk, self.group = tp, n_layers, bpc, 0
        self.engine_id = ocfg.engine_id
        self.row = row
        self.spec = TieringOffloadingSpec(ocfg)
        # vLLM's own scheduler-side connector builds the manager (and so the tiers) with its configs in scope.
        self.scheduler = OffloadingConnectorScheduler(self.spec, vc, skc)
        self._attach(self.scheduler.manager)
        self.copies = 1 if (self.replicated or row == "canonical") else tp
        del copies
        self.slot_bytes = self.spec.cpu_page_size_per_worker
        self.gpu = regions  # the GPU KV cache (CPU memory here): raw buffer, per-layer views, regions
        pages = [t.page_size_bytes for t in regions.caches.tensors]
        self._region_off = [sum(pages[:i]) * bpc for i in range(len(pages))]
        self._region_page = pages
        self.group_layers = {g.group_id: tuple(g.layer_names) for g in ocfg.groups}

    # -- what vLLM's worker holds ----------------------------------------------------------------
    def page(self, seed: Any, layer: str, block: int, nbytes: int) -> bytes:
        """The GPU page of ``layer``'s block ``block`` for ``seed`` (distinct per layer and block)."""
        return make_payload(f"{seed}/{layer}/{block}", nbytes)

    def expected(self, seed: Any, group: int = 0) -> dict[str, bytes]:
        """Per layer of ``group``: the bytes a canonical file must hold (its pages, block by block)."""
        return {n: b"".join(self.page(seed, n, j, self._layer_page(n)) for j in range(self.blocks_per_chunk))
                for n in self.group_layers[group]}

    def _layer_page(self, name: str) -> int:
        v = self.gpu.layers[name][0]
        return v.numel() * v.element_size()

    def _gpu_block(self, name: str, block: int) -> Any:
        import torch

        return self.gpu.layers[name][block].view(torch.uint8).reshape(-1)

    def _group_index(self, group: int) -> int:
        return [g.group_id for g in self.cfg.groups].index(group)

    def _key_group(self, key: Any) -> int:
        from vllm.v1.kv_offload.base import get_offload_group_idx

        return int(get_offload_group_idx(key))

    # -- the GPU copy, as CPUOffloadingWorker's direct layout does it ----------------------------
    def store(self, items: Mapping[Any, Any], *, timeout: float = 60.0, **kw: Any) -> list[Any]:  # type: ignore[override]
        self._groups_of = {k: self._key_group(k) for k in items}
        return super().store({k: (k, s) for k, s in items.items()}, timeout=timeout, **kw)

    def _write_row(self, chunk_id: int, payload: Any) -> None:  # type: ignore[override]
        import torch

        assert self._rows is not None
        key, seed = payload
        g = self._groups_of[key]
        # The model writes its KV into GPU blocks 0..bpc-1 (every layer, through vLLM's own layer views) ...
        for n in self.group_layers[g]:
            for j in range(self.blocks_per_chunk):
                page = self.page(seed, n, j, self._layer_page(n))
                self._gpu_block(n, j)[:] = torch.frombuffer(bytearray(page), dtype=torch.uint8)
        # ... and CPUOffloadingWorker copies each of the group's refs, block by block, into every slot.
        row = self._rows[int(chunk_id)]
        refs = self.gpu.caches.group_data_refs[self._group_index(g)]
        for r in range(self.copies):
            base = r * self.slot_bytes
            for ref in refs:
                src = self.gpu.caches.tensors[ref.tensor_idx].tensor
                off = base + self._region_off[ref.tensor_idx]
                stride = self._region_page[ref.tensor_idx]
                for j in range(self.blocks_per_chunk):
                    data = src[j, :ref.page_size_bytes].view(torch.uint8).numpy()
                    row[off + j * stride:off + j * stride + ref.page_size_bytes] = data

    def load(self, keys: Any, *, timeout: float = 60.0, raw: bool = False, **kw: Any) -> dict[Any, Any]:  # type: ignore[override]
        self._load_groups = {k: self._key_group(k) for k in keys}
        self._loading = list(keys)
        return super().load(keys, timeout=timeout, raw=raw, **kw)

    def _read_row(self, chunk_id: int, raw: bool) -> Any:  # type: ignore[override]
        import torch

        assert self._rows is not None
        row = self._rows[chunk_id]
        if raw:
            return row.tobytes()
        groups = set(self._load_groups.values())
        assert len(groups) == 1, "load one group's keys per call"
        g = groups.pop()
        refs = self.gpu.caches.group_data_refs[self._group_index(g)]
        out_by_worker = []
        for r in range(self.copies):
            # The worker's load: each ref's pages from this slot into GPU blocks 0..bpc-1 ...
            self.gpu.raw.zero_()
            base = r * self.slot_bytes
            for ref in refs:
                dst = self.gpu.caches.tensors[ref.tensor_idx].tensor
                off = base + self._region_off[ref.tensor_idx]
                stride = self._region_page[ref.tensor_idx]
                for j in range(self.blocks_per_chunk):
                    piece = row[off + j * stride:off + j * stride + ref.page_size_bytes]
                    dst[j, :ref.page_size_bytes] = torch.from_numpy(piece.copy()).view(torch.int8)
            # ... then what each layer reads through its own view.
            out_by_worker.append({n: b"".join(self._gpu_block(n, j).numpy().tobytes()
                                              for j in range(self.blocks_per_chunk))
                                  for n in self.group_layers[g]})
        for r, layers in enumerate(out_by_worker[1:], 1):
            if layers != out_by_worker[0]:
                raise AssertionError(f"worker slot {r} of chunk {chunk_id} differs from slot 0 (fan-out broken)")
        return out_by_worker[0]

    def close(self) -> None:
        if self._closed:
            return
        super().close()
