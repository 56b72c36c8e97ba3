"""The oracle: KV pages written by vLLM 0.34's OWN code, run on this CPU by Triton's interpreter.

Nothing here models a page layout. For a deployment's worker (DCP size and rank, interleave, block size) and a
list of sequences, the pages are what vLLM itself produces:

* which local slot each token of a sequence goes to: vLLM's slot-mapping kernel
  (``vllm/v1/worker/gpu/block_table.py`` ``_compute_slot_mappings_kernel``, with the worker's ``cp_size`` /
  ``cp_rank`` / ``cp_interleave`` as the model runner passes DCP to ``BlockTables``); a token another DCP rank
  owns gets vLLM's PAD slot and is not written;
* the bytes at those slots: vLLM's fused DeepSeek-V3.2 / GLM-5 cache writer
  (``vllm/models/deepseek_v32/common/kernels.py`` ``fused_norm_rope``: the MLA latent in bf16, fp8 or
  ``fp8_ds_mla`` and the DSA indexer's FP8 keys and scales, shuffled or not, exactly as its
  ``indexer_cache_shuffled`` / ``mla_kv_cache_dtype`` arguments select).

The token inputs (latent, rope, indexer key) are a deterministic function of (sequence seed, position), so
every worker layout writes the same model KV. The writers run in a fresh interpreter (``TRITON_INTERPRET=1``,
and ``CUDA_VISIBLE_DEVICES=""`` so vLLM keeps Triton without a GPU driver: vllm/triton_utils/importing.py),
never in the test process; results are cached on disk by the request and the sha256 of the two vLLM source
files, so a vLLM change re-runs them.

    python tests/vllm_writers.py REQUEST.json OUTDIR    (what :func:`write_pages` runs)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Sequence

import numpy as np

KERNELS = "models/deepseek_v32/common/kernels.py"
SLOTS = "v1/worker/gpu/block_table.py"
MLA_WIDTH = {"auto": 576 * 2, "fp8": 576, "fp8_ds_mla": 656}  # bytes per token of vLLM's MLA cache


def vllm_source(rel: str) -> str:
    """The text of an installed vLLM source file (found without importing vLLM)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vLLM is not installed"
    with open(os.path.join(os.path.dirname(spec.origin), rel), encoding="utf-8") as f:
        return f.read()


def job(*, mla_dtype: str, shuffle: bool, block: int, seeds: Sequence[str], blocks: int, cp_size: int = 1,
        cp_rank: int = 0, interleave: int = 1, kernel_block: int | None = None) -> dict[str, Any]:
    """One writer run: ``seeds`` sequences of ``blocks`` logical blocks (``block * cp_size`` tokens each), as
    the worker of DCP rank ``cp_rank`` holds them in pages of ``block`` tokens (``kernel_block``: vLLM's
    kernel block, when it splits a page)."""
    return {"mla_dtype": mla_dtype, "shuffle": shuffle, "block": block, "seeds": list(seeds), "blocks": blocks,
            "cp_size": cp_size, "cp_rank": cp_rank, "interleave": interleave, "kernel_block": kernel_block or block}


def write_pages(jobs: Sequence[dict[str, Any]]) -> list[dict[str, list[list[bytes]]]]:
    """Per job, ``{"mla": pages, "indexer": pages}``: per seed, per block, one page of bytes as vLLM's writer
    left it (``block`` tokens; a DCP rank's page holds only its tokens). Jobs not cached yet run together in
    one fresh interpreter."""
    src = hashlib.sha256((vllm_source(KERNELS) + vllm_source(SLOTS)).encode()).hexdigest()
    cache = os.path.join(tempfile.gettempdir(), "kvformat-oracle-cache")
    os.makedirs(cache, exist_ok=True)
    paths = [os.path.join(cache, hashlib.sha256(json.dumps([jb, src], sort_keys=True).encode()).hexdigest()[:32]
                          + ".npz") for jb in jobs]
    todo = sorted({p: jb for p, jb in zip(paths, jobs) if not os.path.exists(p)}.items())
    if todo:
        with tempfile.TemporaryDirectory() as tmp:
            req = os.path.join(tmp, "req.json")
            with open(req, "w") as f:
                json.dump([jb for _, jb in todo], f)
            env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
            r = subprocess.run([sys.executable, os.path.abspath(__file__), req, tmp], env=env, capture_output=True,
                               text=True, cwd=tmp, timeout=3600)
            if r.returncode != 0:
                raise RuntimeError(f"vLLM's writers failed under Triton's interpreter:\n{r.stdout}\n{r.stderr}")
            for i, (p, _) in enumerate(todo):
                os.replace(os.path.join(tmp, f"{i}.npz"), p)
    res = []
    for p, jb in zip(paths, jobs):
        data = np.load(p)
        page_mla = jb["block"] * MLA_WIDTH[jb["mla_dtype"]]
        page_idx = jb["block"] * 132
        mla, idx = data["mla"].tobytes(), data["idx"].tobytes()
        per: dict[str, list[list[bytes]]] = {"mla": [], "indexer": []}
        for s in range(len(jb["seeds"])):
            first = s * jb["blocks"]
            per["mla"].append([mla[(first + j) * page_mla:(first + j + 1) * page_mla] for j in range(jb["blocks"])])
            per["indexer"].append([idx[(first + j) * page_idx:(first + j + 1) * page_idx]
                                   for j in range(jb["blocks"])])
        res.append(per)
    return res


# -- the subprocess: vLLM's code under Triton's interpreter ------------------------------------------------------
def _load(rel: str, name: str) -> Any:
    """A vLLM source file as a module: its package's __init__ imports every DeepSeek model (einops and more
    that this machine lacks); the file itself imports only vllm.platforms / triton_utils / kv_cache_interface."""
    import importlib.util

    import vllm

    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(vllm.__file__), rel))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(seed: str, positions: Any) -> dict[str, Any]:
    import torch

    rows: dict[str, list[Any]] = {"kv_c": [], "k_pe": [], "index_k": [], "q_c": []}
    for p in positions.tolist():
        g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}@{p}".encode()).digest()[:8], "little"))
        rows["kv_c"].append(torch.randn(512, generator=g) * 3)
        rows["k_pe"].append(torch.randn(64, generator=g))
        rows["index_k"].append(torch.randn(128, generator=g) * 2)
        rows["q_c"].append(torch.randn(64, generator=g))
    return {k: torch.stack(v).to(torch.bfloat16) for k, v in rows.items()}


def _slots(BT: Any, positions: Any, block_table: Any, kernel_block: int, cp: tuple[int, int, int]) -> Any:
    import torch

    n = positions.numel()
    out = torch.full((1, n), -7, dtype=torch.int64)
    size, rank, inter = cp
    table = block_table.to(torch.int32).reshape(1, -1).contiguous()
    BT._compute_slot_mappings_kernel[(1, 2)](
        n, torch.tensor([0], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), positions,
        torch.tensor([table.data_ptr()], dtype=torch.uint64), torch.tensor([table.stride(0)], dtype=torch.int64),
        torch.tensor([kernel_block], dtype=torch.int32), torch.tensor([True]), torch.tensor([True]), out,
        out.stride(0), rank, CP_SIZE=size, CP_INTERLEAVE=inter, PAD_ID=-1, TRITON_BLOCK_SIZE=64)
    return out[0]


def _run(jb: dict[str, Any], K: Any, BT: Any) -> tuple[Any, Any]:
    import torch

    B, kb, D = jb["block"], jb["kernel_block"], jb["cp_size"]
    ratio = B // kb
    nseq, nblk = len(jb["seeds"]), jb["blocks"]
    kblocks = nseq * nblk * ratio
    idx = torch.zeros(kblocks, kb, 132, dtype=torch.uint8)
    width = MLA_WIDTH[jb["mla_dtype"]]
    mla = torch.zeros(kblocks, kb, 576, dtype=torch.bfloat16) if jb["mla_dtype"] == "auto" else \
        torch.zeros(kblocks, kb, width, dtype=torch.uint8)
    logical = B * D
    for s, seed in enumerate(jb["seeds"]):
        positions = torch.arange(nblk * logical, dtype=torch.int64)
        # Sequence s holds manager blocks s * nblk + j; each is `ratio` kernel blocks (vLLM's kernel block table).
        table = torch.tensor([(s * nblk + j) * ratio + k for j in range(nblk) for k in range(ratio)])
        slot = _slots(BT, positions, table, kb, (D, jb["cp_rank"], jb["interleave"]))
        x = _inputs(seed, positions)
        n = positions.numel()
        cos_sin = torch.randn(int(positions.max()) + 1, 64, generator=torch.Generator().manual_seed(7))
        K.fused_norm_rope(positions, x["q_c"], torch.ones(64, dtype=torch.bfloat16), 1e-6, x["kv_c"],
                          torch.ones(512, dtype=torch.bfloat16), 1e-6, x["k_pe"], cos_sin, x["index_k"],
                          torch.ones(128, dtype=torch.float32), torch.zeros(128, dtype=torch.float32), 1e-6, cos_sin,
                          torch.zeros(n, 16, dtype=torch.int32), slot_mapping=slot, indexer_k_cache=idx,
                          indexer_cache_shuffled=jb["shuffle"], mla_kv_cache=mla, mla_kv_cache_dtype=jb["mla_dtype"])
    return mla.view(torch.uint8).numpy().copy(), idx.numpy().copy()


def main(argv: list[str]) -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from vllm.v1.worker.gpu import block_table as BT

    K = _load(KERNELS, "vllm_dsv32_kernels")
    with open(argv[1]) as f:
        jobs = json.load(f)
    for i, jb in enumerate(jobs):
        mla, idx = _run(jb, K, BT)
        np.savez(os.path.join(argv[2], f"{i}.npz"), mla=mla, idx=idx)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
