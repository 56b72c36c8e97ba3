"""Drive SGLang's (0.5.23) REAL storage classes on a CPU (test/tool helper).

What SGLang's cache controller does when it attaches a storage backend (``cache_controller.py``:
``attach_storage_backend``), with its real classes: an ``MLATokenToKVPoolHost`` in one of its host layouts, a
``HiCacheStorageConfig`` as ``_generate_storage_config`` builds it for a rank, the backend created by
``StorageBackendFactory.create_backend("dynamic", ...)`` (SGLang's dynamic loader), then
``register_mem_pool_host`` and ``on_host_pools_registered``. Page keys are SGLang's own ``get_hash_str``
(its JIT-built SHA-256 chain). The controller itself needs torch.distributed groups and device events, so the
harness plays its storage threads: it calls ``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1`` with the
host indices SGLang's host allocator (``pool.alloc``) hands out.

``page(pool, start)`` is a page as SGLang's own ``get_data_page`` returns it, rearranged to ``[layer, token,
latent]`` by the layout's axes (``init_kv_buffer``): what every layout must agree on, and what a kvformat file's
tensors hold.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

MODEL = "deepseek-ai/DeepSeek-V3"
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGE = 64
WIDTH = 576
BACKEND = {"backend_name": "kvformat", "module_path": "kvformat.sglang", "class_name": "KVFormatHiCache",
           "interface_v1": 1}


def host_pool(layout: str, *, layers: int = 4, pages: int = 8, dtype: torch.dtype = torch.bfloat16,
              page: int = PAGE) -> MLATokenToKVPoolHost:
    """SGLang's MLA host pool over CPU "device" buffers of ``pages`` pages (the host holds twice as many)."""
    tokens = pages * page
    bufs = tuple(torch.zeros(tokens, 1, WIDTH, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs]),
                         layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page,
                         kv_lora_rank=512, qk_rope_head_dim=64, kv_cache_dim=WIDTH, dtype=dtype,
                         device=torch.device("cpu"))
    pool = MLATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
                                target_layer_num=layers)
    pool.kv_buffer.view(torch.uint8).fill_(0)
    return pool


def storage_config(pool: Any, extra: dict[str, Any], *, tp: int = 1, rank: int = 0, pp: int = 1,
                   model: str | None = MODEL) -> HiCacheStorageConfig:
    """The storage config SGLang's controller builds for TP rank ``rank`` of ``tp`` (an MLA model)."""
    return HiCacheStorageConfig(tp_rank=rank, tp_size=tp, pp_rank=0, pp_size=pp, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=True, enable_storage_metrics=True,
                                is_page_first_layout=pool.layout == "page_first", model_name=model,
                                extra_config=dict(extra))


def attach(pool: Any, root: str, *, tp: int = 1, rank: int = 0, pp: int = 1, model: str | None = MODEL,
           **params: Any) -> Any:
    """What ``attach_storage_backend`` does: SGLang's dynamic loader builds kvformat's backend, then registers
    the host pool with it."""
    sc = storage_config(pool, {**BACKEND, "root": str(root), **params}, tp=tp, rank=rank, pp=pp, model=model)
    backend = StorageBackendFactory.create_backend("dynamic", sc, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def page_keys(tokens: list[int], page: int = PAGE, prior: str | None = None) -> list[str]:
    """SGLang's storage page keys (its native hash chain)."""
    return list(get_hash_str(tokens, prior, page_size=page))


def fill(pool: Any, n_pages: int, seed: int) -> torch.Tensor:
    """Allocate ``n_pages`` pages in the pool (SGLang's allocator) and write seeded latents into every layer's
    tokens through SGLang's own per-token addressing of the layout; returns the host indices."""
    idx = pool.alloc(n_pages * pool.page_size)
    g = torch.Generator().manual_seed(seed)
    for start in idx[::pool.page_size].tolist():
        data = torch.randn(pool.layer_num, pool.page_size, 1, WIDTH, generator=g).to(pool.dtype) \
            if pool.dtype.is_floating_point else \
            torch.randint(0, 256, (pool.layer_num, pool.page_size, 1, WIDTH), generator=g, dtype=torch.uint8)
        set_page(pool, start, data)
    return idx


def set_page(pool: Any, start: int, data: torch.Tensor) -> None:
    """Write a ``[layer, token, 1, latent]`` page through SGLang's ``set_from_flat_data_page`` (its flat page is
    in the layout's own axis order)."""
    if pool.layout == "page_first":
        data = data.permute(1, 0, 2, 3)
    pool.set_from_flat_data_page(start, data.contiguous().flatten())


def page(pool: Any, start: int) -> torch.Tensor:
    """The page at host index ``start`` as ``[layer, token, latent]``, from SGLang's ``get_data_page``."""
    p = pool.get_data_page(start, flat=False)
    if pool.layout == "page_first":
        p = p.permute(1, 0, 2, 3)  # [token, layer, 1, latent]
    elif pool.layout == "page_first_direct":
        p = p[0]  # [1, layer, token, 1, latent]
    return p.reshape(pool.layer_num, pool.page_size, WIDTH)


def pages(pool: Any, idx: torch.Tensor) -> list[torch.Tensor]:
    return [page(pool, s) for s in idx[::pool.page_size].tolist()]
