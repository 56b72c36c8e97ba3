"""One cache for vLLM and SGLang (``key_scheme: "token-chain"`` on both sides).

vLLM side: its real ``OffloadingConnectorScheduler`` and ``TieringOffloadingManager`` (tests/vllm_models.py), a
real vLLM ``Request`` with vLLM's own block hasher, registered with the scheduler (``on_new_request``), its offload
keys and their positions set by vLLM's own ``update_offload_keys``; the GPU pages and what the worker reads back
are vLLM's (the harness plays the GPU copy through vLLM's captured regions). SGLang side: its real dynamic loader,
storage config, MLA host pool and page key function (tests/sglang_harness.py). Expected bytes come from each
engine: the pages vLLM's model wrote, the pages SGLang's ``get_data_page`` returns.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

pytest.importorskip("sglang_harness", reason="SGLang is installed by tools/setup.sh")

from sglang.srt.mem_cache.utils import storage_namespace_seed  # noqa: E402
from sglang_harness import attach, fill, host_pool, page_keys, pages  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm_harness import kvformat_tier  # noqa: E402
from vllm_models import ModelDeployment  # noqa: E402

PAGE = 64
LAYERS = 4
FAMILY = "deepseek-v3-bf16"
MODEL = "deepseek-ai/DeepSeek-V3"
CHAIN = {"key_scheme": "token-chain", "rope": "interleaved"}


def _tokens(seed: int, n_pages: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 129_000, (n_pages * PAGE + 5,), generator=g).tolist()  # a partial page at the end


def _vllm(root: str, tp: int, row: str) -> ModelDeployment:
    return ModelDeployment(FAMILY, [kvformat_tier(root, read_threads=2, write_threads=2, **CHAIN)], tp=tp, row=row,
                           n_layers=LAYERS, block_size=PAGE)


def _request(dep: ModelDeployment, tokens: list[int], **kw: object) -> tuple[list[object], object]:
    """A vLLM request of ``tokens`` admitted by vLLM's offloading scheduler: its offload keys and context."""
    init_none_hash(sha256)
    req = Request(request_id=f"r-{uuid.uuid4().hex[:8]}", prompt_token_ids=tokens,
                  sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                  block_hasher=get_request_block_hasher(PAGE, sha256), **kw)  # type: ignore[arg-type]
    dep.scheduler.on_new_request(req)
    status = dep.scheduler._req_status[req.request_id]
    status.update_offload_keys()
    return list(status.group_states[0].offload_keys), status.req_context


def _layers(page: torch.Tensor) -> dict[str, bytes]:
    """An SGLang page ([layer, token, latent]) as vLLM's per-layer bytes."""
    return {f"model.layers.{i}.self_attn.attn": page[i].contiguous().view(torch.uint8).numpy().tobytes()
            for i in range(page.shape[0])}


@pytest.mark.parametrize("tp,row,layout", [(1, "replicated", "page_first"), (4, "per_worker", "layer_first"),
                                           (8, "replicated", "page_first_direct")])
def test_vllm_writes_sglang_reads_and_back(tmp_path, tp: int, row: str, layout: str) -> None:
    root = str(tmp_path)
    tokens = _tokens(tp, 3)
    # vLLM (TP=tp) stores a plain request's chunks ...
    dep = _vllm(root, tp, row)
    try:
        keys, ctx = _request(dep, tokens)
        assert len(keys) == 3
        seeds = {k: f"v{tp}-{i}" for i, k in enumerate(keys)}
        dep.store(seeds, req_context=ctx)
        want = [dep.expected(seeds[k]) for k in keys]
    finally:
        dep.close()
    names = sorted(os.path.basename(f)[:-4] for d, _, fs in os.walk(root) for f in fs if f.endswith(".kvf"))
    # ... as files named by SGLang's own page keys of the same tokens,
    assert names == sorted(page_keys(tokens)[:3])
    # which an SGLang deployment (TP=2, another host layout) loads into its host pool, page for page.
    pool = host_pool(layout)
    idx = pool.alloc(3 * PAGE)
    r = attach(pool, root, tp=2, rank=1, **CHAIN)
    try:
        assert r.batch_exists(page_keys(tokens)) == 3
        assert r.batch_get_v1(page_keys(tokens)[:3], idx) == [True] * 3
        assert [_layers(p) for p in pages(pool, idx)] == want
    finally:
        r.close()

    # The reverse: SGLang (TP=2's writer) stores pages of other tokens; vLLM (TP=tp) loads them.
    other = _tokens(100 + tp, 2)
    spool = host_pool(layout)
    sidx = fill(spool, 2, seed=tp)
    w = attach(spool, root, tp=2, rank=0, **CHAIN)
    try:
        assert w.batch_set_v1(page_keys(other)[:2], sidx) == [True, True]
    finally:
        w.close()
    dep = _vllm(root, tp, row)
    try:
        keys, ctx = _request(dep, other)
        got = dep.load(keys, req_context=ctx)
        assert [got[k] for k in keys] == [_layers(p) for p in pages(spool, sidx)]
        assert dep.tier().counters()["files_read"] == 2
    finally:
        dep.close()


def test_salted_and_lora_requests_never_share(tmp_path) -> None:
    """A vLLM request with a cache salt (or a LoRA adapter) keeps vLLM's keys in vLLM's own namespace: SGLang
    finds nothing under the tokens' plain chain, nor under its own salted chain; a plain request still shares."""
    from vllm.lora.request import LoRARequest

    root = str(tmp_path)
    tokens = _tokens(11, 2)
    dep = _vllm(root, 1, "replicated")
    try:
        salted, sctx = _request(dep, tokens, cache_salt="tenant-a")
        dep.store({k: f"s{i}" for i, k in enumerate(salted)}, req_context=sctx)
        lora, lctx = _request(dep, tokens, lora_request=LoRARequest("ad", 1, "/nonexistent/adapter"))
        dep.store({k: f"l{i}" for i, k in enumerate(lora)}, req_context=lctx)
        assert dep.tier().counters()["files_written"] == 4
        chain_ns = dep.tier().chain_engine.ns
        spaces = {os.path.relpath(d, root).split(os.sep)[0] for d, _, fs in os.walk(root)
                  for f in fs if f.endswith(".kvf")}
        assert spaces == {dep.tier().namespace} and chain_ns not in spaces
    finally:
        dep.close()
    pool = host_pool("page_first")
    r = attach(pool, root, **CHAIN)
    try:
        assert r.batch_exists(page_keys(tokens)) == 0
        assert r.batch_exists(page_keys(tokens, prior=storage_namespace_seed(None, "tenant-a"))) == 0
    finally:
        r.close()
    dep = _vllm(root, 1, "replicated")
    try:
        plain, pctx = _request(dep, tokens)
        got = dep.load(plain, req_context=pctx)
        assert all(v is None for v in got.values())  # the salted request's KV is not the plain request's
    finally:
        dep.close()


def test_engine_scheme_namespaces_stay_apart(tmp_path) -> None:
    """Without the opt-in, neither engine finds the other's files, even for the same tokens."""
    root = str(tmp_path)
    tokens = _tokens(21, 2)
    dep = ModelDeployment(FAMILY, [kvformat_tier(root)], tp=1, n_layers=LAYERS, block_size=PAGE)
    try:
        keys, ctx = _request(dep, tokens)
        dep.store({k: str(i) for i, k in enumerate(keys)}, req_context=ctx)
    finally:
        dep.close()
    r = attach(host_pool("page_first"), root)
    try:
        assert r.batch_exists(page_keys(tokens)) == 0
    finally:
        r.close()
