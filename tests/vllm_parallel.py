"""Pipeline (PP) and decode-context (DCP) parallel deployments through vLLM's REAL planning and manager.

``ParallelDeployment(family, tiers, tp=, pp=, dcp=, block_size=, bpc=, n_layers=, interleave=)`` plans
the model the way vLLM's engine core does for every worker: per-worker layer specs (a stage holds the
layers of vLLM's own ``get_pp_indices`` partition, which honours ``VLLM_PP_LAYER_PARTITION``) go through
``get_global_kv_cache_groups`` -> ``get_kv_cache_configs`` (one KV-cache config per worker) ->
``generate_scheduler_kv_cache_config`` (stage 0's) -> ``build_offloading_config``; the scheduler side is
vLLM's real ``OffloadingConnectorScheduler`` (it builds the ``TieringOffloadingManager`` and so the tiers).

Workers cannot run without CUDA, so the harness plays them: worker ``w`` (stage ``w // (pcp x tp)``, TP rank
``w % tp``, DCP rank ``tp rank % dcp``) has its own KV cache (CPU tensors through vLLM's
``create_kv_cache_views``) and the regions vLLM's real ``OffloadingConnectorWorker.register_kv_caches``
derives from it; a store copies each worker's blocks into ITS slot of the row, a load copies each slot
back into that worker's KV cache and reads every layer through vLLM's own layer views.

The model's KV is a function of (seed, layer, logical block, token). With ``oracle=True`` (every DSA
family's test) the pages are written by vLLM's OWN code (tests/vllm_writers.py: its slot-mapping kernel
places each DCP rank's tokens, its fused cache writer encodes and places their bytes, in the order the
deployment's platform uses: shuffled indexer pages on ROCm), so neither what a worker holds nor what a file
must hold comes from kvformat's model of a page. Without the oracle (latent-only families, whose pages are
token rows on every platform) pages are random bytes and a DCP rank's local token ``l`` is the logical
token vLLM's ``canonical_mapping._local_to_canonical_token`` names. ``load`` checks every worker of the
reader holds exactly its part (its stage's layers, its DCP rank's tokens) and returns the logical per-layer
bytes; ``expected(seed)`` gives them (what a file must hold: what a TP=1 deployment's writer produces for the
logical block).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from types import SimpleNamespace as NS
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from vllm_harness import Deployment, make_payload
from vllm_models import FAMILIES, Family, capture_regions, vllm_config


def _rank_ctx(tp: int, dcp: int, interleave: int, rank: int) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import _RankContext

    return _RankContext(tp_size=tp, dcp_size=dcp, pcp_size=1, interleave=interleave, total_kv_heads=1, rank=rank)


def stage_ranges(n_layers: int, pp: int) -> list[tuple[int, int]]:
    """vLLM's own pipeline partition (``get_pp_indices``) of ``n_layers`` decoder layers."""
    from vllm.distributed.utils import get_pp_indices

    return [get_pp_indices(n_layers, s, pp) for s in range(pp)]


class ParallelDeployment(Deployment):
    """A TP x PP x DCP deployment of a model family; items are seeds (see the module docstring)."""

    def __init__(self, family: str | Family, tiers: Sequence[Mapping[str, Any]], *, tp: int = 1, pp: int = 1,
                 dcp: int = 1, block_size: int = 64, bpc: int = 1, n_layers: int = 8, interleave: int = 1,
                 num_chunks: int = 8, partition: str | None = None, pcp: int = 1,
                 oracle: bool | None = False) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
        from vllm.v1.core import kv_cache_planning as P
        from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        fam = FAMILIES[family] if isinstance(family, str) else family
        self.family, self.tp, self.pp, self.dcp, self.interleave = fam, tp, pp, dcp, interleave
        from kvformat.vllm._facts import vllm_platform

        self.platform = vllm_platform()  # what the tier will read (tests/conftest.py: the platform played)
        self.oracle = oracle
        self._pages: dict[tuple[Any, ...], bytes] = {}
        self.pcp = pcp
        self.world = tp * pp * pcp  # vLLM's rank order: pp, pcp, tp
        old = os.environ.get("VLLM_PP_LAYER_PARTITION")
        if partition is not None:
            os.environ["VLLM_PP_LAYER_PARTITION"] = partition
        try:
            self.ranges = stage_ranges(n_layers, pp)
            vc = vllm_config(fam, tp=tp, row="per_worker", kv_layout="LBNHC", bpc=bpc, tiers=tiers,
                             block_size=block_size, cpu_bytes=1 << 30)
            vc.parallel_config = NS(**{**vars(vc.parallel_config), "pipeline_parallel_size": pp,
                                       "decode_context_parallel_size": dcp, "world_size": tp * pp * pcp,
                                       "prefill_context_parallel_size": pcp,
                                       "cp_kv_cache_interleave_size": interleave})
            vc.model_config = NS(**{**vars(vc.model_config), "max_model_len": 256, "original_max_model_len": 256,
                                    "hf_text_config": NS(num_hidden_layers=n_layers)})
            vc.cache_config = NS(**{**vars(vc.cache_config), "num_gpu_blocks_override": 8})
            specs = fam.specs(n_layers, block_size)
            stage_specs = []
            for a, b in self.ranges:
                stage_specs.append({n: s for n, s in specs.items() if a <= int(n.split(".")[2]) < b})
            per_worker = [stage_specs[w // (tp * pcp)] for w in range(self.world)]
            groups = P.get_global_kv_cache_groups(vc, per_worker)
            kcs = P.get_kv_cache_configs(vc, per_worker, [1 << 30] * self.world, groups)
            skc = generate_scheduler_kv_cache_config(kcs)
            ocfg = build_offloading_config(vc, skc)
            self.slot_bytes = ocfg.worker_kv_bytes_per_block * bpc
            row_bytes = -(-self.slot_bytes * self.world // 4096) * 4096
            ocfg = dataclasses.replace(ocfg, extra_config={**ocfg.extra_config,
                                                           "cpu_bytes_to_use": row_bytes * num_chunks})
            self.vllm_config, self.kv_cache_configs, self.scheduler_kv_cache_config = vc, kcs, skc
            self.cfg = ocfg
            self.engine_id = ocfg.engine_id
            self.n_layers, self.blocks_per_chunk, self.group = n_layers, bpc, 0
            self.spec = TieringOffloadingSpec(ocfg)
            self.scheduler = OffloadingConnectorScheduler(self.spec, vc, skc)
        finally:
            if partition is not None:
                if old is None:
                    os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
                else:
                    os.environ["VLLM_PP_LAYER_PARTITION"] = old
        self._attach(self.scheduler.manager)
        assert not self.replicated, "vLLM never uses the single-slot row with PP or DCP"
        self.copies = self.world
        assert self.spec.cpu_page_size_per_worker == self.slot_bytes
        self.logical_tokens = block_size * dcp
        # One "GPU" per distinct (stage) KV-cache config: TP ranks of a stage share the geometry.
        self.gpus = [capture_regions(vc, kcs[s * tp * pcp], "per_worker") for s in range(pp)]
        self.stage_layers = [tuple(kcs[s * tp * pcp].kv_cache_groups[0].layer_names) for s in range(pp)]
        self.layers = tuple(n for st in self.stage_layers for n in st) if pp > 1 else self.stage_layers[0]
        self.layers = tuple(sorted(self.layers, key=lambda n: (int(n.split(".")[2]), n.endswith("k_cache"))))
        if self.oracle is None:  # wherever vLLM's writers run here: MLA and DSA indexer layers
            self.oracle = self.oracle_covers()

    # -- the model's KV and what each worker holds -------------------------------------------------
    def oracle_covers(self) -> bool:
        """Whether vLLM's own writers (tests/vllm_writers.py) write every layer of this deployment: the DSA
        families (MLA latent + indexer layers). Latent-only families keep the token-row model (their pages are
        token rows on every platform; the writers' FP8 MLA page is not every fp8 family's page)."""
        specs = self.family.specs(2, 64)
        return (any("indexer" in n for n in specs)
                and all(type(spec).__name__ == "MLAAttentionSpec" for spec in specs.values()))

    def _page(self, gpu: Any, name: str) -> int:
        v = gpu.layers[name][0]
        return int(v.numel() * v.element_size())

    def prepare(self, seeds: Sequence[Any]) -> None:
        """Have vLLM's writers produce every page of ``seeds`` this deployment's workers hold, and the logical
        pages a file must hold (one batch of writer runs; cached on disk by tests/vllm_writers.py)."""
        if not self.oracle:
            return
        from vllm_writers import write_pages

        if any("k_cache" not in n and "attn" not in n for n in self.layers):
            raise AssertionError("the oracle writes MLA and DSA indexer layers only")
        decoders = sorted({int(n.split(".")[2]) for n in self.layers})
        out = write_pages(oracle_jobs(self.family.cache_dtype, self.platform, self.logical_tokens, self.dcp,
                                      self.interleave, self.blocks_per_chunk, seeds, decoders))
        for k, s in enumerate(seeds):
            for d, i in enumerate(decoders):
                at = k * len(decoders) + d
                for j in range(self.blocks_per_chunk):
                    for role, n in (("mla", f"model.layers.{i}.self_attn.attn"),
                                    ("indexer", f"model.layers.{i}.self_attn.indexer.k_cache")):
                        self._pages[("logical", s, n, j)] = out[0][role][at][j]
                        for r in range(self.dcp):
                            self._pages[("local", s, n, j, r)] = out[1 + r][role][at][j]

    def logical(self, seed: Any, name: str, block: int) -> bytes:
        """The logical block ``block`` of layer ``name`` (all ``block_size x dcp`` tokens, in order)."""
        if self.oracle:
            return self._pages[("logical", seed, name, block)]
        stage = self.stage_of(name)
        return make_payload(f"{seed}/{name}/{block}", self._page(self.gpus[stage], name) * self.dcp)

    def stage_of(self, name: str) -> int:
        i = int(name.split(".")[2])
        return next(s for s, (a, b) in enumerate(self.ranges) if a <= i < b)

    def local(self, seed: Any, name: str, block: int, worker: int) -> bytes:
        """Worker ``worker``'s local page of a block: its DCP rank's tokens, placed by vLLM's own mapping."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
            _local_to_canonical_token,
        )

        if self.oracle:
            return self._pages[("local", seed, name, block, (worker % self.tp) % self.dcp)]
        full = self.logical(seed, name, block)
        page = len(full) // self.dcp
        local_tokens = self.logical_tokens // self.dcp
        row = page // local_tokens
        ctx = _rank_ctx(self.tp, self.dcp, self.interleave, worker % self.tp)
        return b"".join(full[_local_to_canonical_token(l, ctx) * row:(_local_to_canonical_token(l, ctx) + 1) * row]
                        for l in range(local_tokens))

    def expected(self, seed: Any, group: int = 0) -> dict[str, bytes]:
        """Per layer (model order): the bytes a canonical file must hold (logical blocks in order)."""
        return {n: b"".join(self.logical(seed, n, j) for j in range(self.blocks_per_chunk)) for n in self.layers}

    # -- the workers' copies, as CPUOffloadingWorker does them -----------------------------------------
    def store(self, items: Mapping[Any, Any], *, timeout: float = 60.0, **kw: Any) -> list[Any]:  # type: ignore[override]
        self.prepare([s for s in items.values() if not callable(s)])
        return super().store({k: (k, s) for k, s in items.items()}, timeout=timeout, **kw)

    def _regions(self, stage: int) -> list[tuple[Any, int, int]]:
        gpu = self.gpus[stage]
        pages = [t.page_size_bytes for t in gpu.caches.tensors]
        refs = gpu.caches.group_data_refs[0]
        return [(ref, sum(pages[:ref.tensor_idx]) * self.blocks_per_chunk, pages[ref.tensor_idx]) for ref in refs]

    def _write_row(self, chunk_id: int, payload: Any) -> None:  # type: ignore[override]
        assert self._rows is not None
        _, seed = payload
        row = self._rows[int(chunk_id)]
        row[:] = 0
        for w in range(self.world):
            stage = w // (self.tp * self.pcp)
            gpu = self.gpus[stage]
            for n in self.stage_layers[stage]:
                for j in range(self.blocks_per_chunk):
                    page = self.local(seed, n, j, w) if not callable(seed) else seed(w, n, j)
                    gpu.layers[n][j].view(torch.uint8).reshape(-1)[:] = torch.frombuffer(bytearray(page),
                                                                                         dtype=torch.uint8)
            base = w * self.slot_bytes
            for ref, off, stride in self._regions(stage):
                src = gpu.caches.tensors[ref.tensor_idx].tensor
                for j in range(self.blocks_per_chunk):
                    data = src[j, :ref.page_size_bytes].view(torch.uint8).numpy()
                    row[base + off + j * stride:base + off + j * stride + ref.page_size_bytes] = data

    def worker_layers(self, chunk_id: int, w: int) -> dict[str, bytes]:
        """What worker ``w`` reads through its own layer views after loading its slot of ``chunk_id``."""
        assert self._rows is not None
        row = self._rows[int(chunk_id)]
        stage = w // (self.tp * self.pcp)
        gpu = self.gpus[stage]
        gpu.raw.zero_()
        base = w * self.slot_bytes
        for ref, off, stride in self._regions(stage):
            dst = gpu.caches.tensors[ref.tensor_idx].tensor
            for j in range(self.blocks_per_chunk):
                piece = row[base + off + j * stride:base + off + j * stride + ref.page_size_bytes]
                dst[j, :ref.page_size_bytes] = torch.from_numpy(piece.copy()).view(torch.int8)
        return {n: b"".join(gpu.layers[n][j].view(torch.uint8).numpy().tobytes()
                            for j in range(self.blocks_per_chunk)) for n in self.stage_layers[stage]}

    def load_checked(self, seeds: Mapping[Any, Any], *, timeout: float = 60.0) -> dict[Any, bool | None]:
        """Load every key; per key: None (a miss), or whether EVERY worker holds exactly its part of ``seed``."""
        self._check = dict(seeds)
        self.prepare(list(seeds.values()))
        got = self.load(list(seeds), timeout=timeout)
        return {k: (None if v is None else bool(v)) for k, v in got.items()}

    def _read_row(self, chunk_id: int, raw: bool) -> Any:  # type: ignore[override]
        if raw:
            assert self._rows is not None
            return self._rows[chunk_id].tobytes()
        seed = self._check[self._loading_key]
        ok = True
        for w in range(self.world):
            held = self.worker_layers(chunk_id, w)
            for n, data in held.items():
                want = b"".join(self.local(seed, n, j, w) for j in range(self.blocks_per_chunk))
                ok = ok and data == want
        return ok

    def _load_batch(self, keys: list[Any], timeout: float, raw: bool) -> dict[Any, Any]:  # type: ignore[override]
        out: dict[Any, Any] = {}
        for k in keys:  # one key per request so _read_row knows whose seed it checks
            self._loading_key = k
            out.update(super()._load_batch([k], timeout, raw))
        return out


def oracle_jobs(cache_dtype: str, platform: str | None, logical: int, dcp: int, interleave: int, bpc: int,
                seeds: Sequence[Any], decoders: Sequence[int]) -> list[dict[str, Any]]:
    """vLLM writer runs that give a deployment's pages (tests/vllm_writers.py): the logical block as a TP=1
    writer fills it, then one run per DCP rank in the platform's page order (ROCm: shuffled indexer tiles;
    CUDA: 64-token indexer kernel blocks)."""
    from vllm_writers import job

    mla = {"auto": "auto", "fp8": "fp8_ds_mla"}[cache_dtype]
    names = [f"{s}/{i}" for s in seeds for i in decoders]
    local = logical // dcp
    rocm = (platform or "").startswith("rocm")
    kernel = 64 if platform and platform.startswith("cuda") and local > 64 else local
    jobs = [job(mla_dtype=mla, shuffle=False, block=logical, seeds=names, blocks=bpc)]
    jobs += [job(mla_dtype=mla, shuffle=rocm and kernel > 1, block=local, seeds=names, blocks=bpc, cp_size=dcp,
                 cp_rank=r, interleave=interleave, kernel_block=kernel) for r in range(dcp)]
    return jobs


def layout_name(tp: int, pp: int = 1, dcp: int = 1) -> str:
    parts = ([f"PP{pp}"] if pp > 1 else []) + ([f"DCP{dcp}"] if dcp > 1 else []) + [f"TP{tp}"]
    return "x".join(parts)


def new_engine_id() -> str:
    return f"kvfp_{uuid.uuid4().hex[:12]}"
