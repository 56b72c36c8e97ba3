"""Page sub-layouts (kvformat.layout._sublayout) against vLLM's own writers, and the identity they pin (issue 20).

Each transcription is checked byte for byte against vLLM 0.34's fused DeepSeek-V3.2 / GLM-5 cache writer run by
Triton's interpreter (tests/vllm_writers.py): a token's record (its bytes in record order) is what the writer
leaves in a one-token block, and a description must place those records exactly where the writer, given a
bigger block, puts them. The cited index arithmetic is also checked against the installed vLLM's source text,
so a vLLM change is noticed even where a writer cannot run here.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvformat.errors import SchemaError
from kvformat.format._native import copy_runs
from kvformat.layout import DeploymentFacts, GroupFacts, LayerFacts, ParallelFacts, plan_groups
from kvformat.layout._sublayout import SubLayout, canonical, describe, identity_pins, token_runs
from kvformat.layout._types import cp_canonical_token


def _vllm_has_dsa_writers() -> bool:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return bool(spec and spec.origin and os.path.exists(os.path.join(os.path.dirname(spec.origin),
                                                                     "models/deepseek_v32/common/kernels.py")))


needs_writers = pytest.mark.skipif(not _vllm_has_dsa_writers() or not __import__("importlib").util.find_spec("triton"),
                                   reason="vLLM 0.34's DeepSeek-V3.2 writers and triton are needed")


def _place(sub: SubLayout, records: list[bytes], tokens: int) -> bytes:
    page = bytearray(tokens * sub.token_bytes)
    for t, rec in enumerate(records):
        at = 0
        for off, n in sub.segments(t, tokens):
            page[off:off + n] = rec[at:at + n]
            at += n
    return bytes(page)


# -- the transcriptions against vLLM's writers --------------------------------------------------------
@needs_writers
@pytest.mark.parametrize("mla", ["fp8_ds_mla", "auto"])
def test_every_described_order_is_where_vllms_writer_puts_each_token(mla):
    from vllm_writers import job, write_pages

    seeds = ["s0"]
    jobs = [job(mla_dtype=mla, shuffle=False, block=1, seeds=seeds, blocks=64),  # one token per page: records
            job(mla_dtype=mla, shuffle=False, block=64, seeds=seeds, blocks=1),  # CUDA: split at the block
            job(mla_dtype=mla, shuffle=False, block=64, seeds=seeds, blocks=1, kernel_block=32),  # 2 kernel blocks
            job(mla_dtype=mla, shuffle=True, block=64, seeds=seeds, blocks=1),  # ROCm: 16 x 16 tiles
            job(mla_dtype=mla, shuffle=True, block=32, seeds=seeds, blocks=2),
            job(mla_dtype=mla, shuffle=False, block=1, seeds=["s1"], blocks=128),
            job(mla_dtype=mla, shuffle=False, block=128, seeds=["s1"], blocks=1, kernel_block=64)]  # CUDA at 128
    recs, split, split32, shuffled, shuffled32, recs128, cuda128 = write_pages(jobs)
    assert _place(describe("dsa_indexer", "dsa_indexer_fp8", 132, "cuda", 128),
                  [recs128["indexer"][0][t] for t in range(128)], 128) == cuda128["indexer"][0][0]
    idx = [recs["indexer"][0][t] for t in range(64)]
    lat = [recs["mla"][0][t] for t in range(64)]
    enc = "e4m3fn+f32"
    assert _place(SubLayout("split", 132, enc), idx, 64) == split["indexer"][0][0]
    assert _place(SubLayout("split", 132, enc, 32), idx, 64) == split32["indexer"][0][0]
    assert _place(describe("dsa_indexer", "dsa_indexer_fp8", 132, "rocm", 64), idx, 64) == shuffled["indexer"][0][0]
    for j in range(2):
        assert _place(describe("dsa_indexer", "dsa_indexer_fp8", 132, "rocm", 32), idx[32 * j:32 * (j + 1)],
                      32) == shuffled32["indexer"][0][j]
    width = len(lat[0])
    rows = describe("mla", mla if mla != "auto" else "bfloat16", width, "cuda", 64)
    assert rows.order == "rows" and _place(rows, lat, 64) == split["mla"][0][0] == shuffled["mla"][0][0]
    # The old assumption (every page is 132-byte token rows) is not vLLM's indexer page.
    assert _place(SubLayout("rows", 132, enc), idx, 64) != split["indexer"][0][0]


@needs_writers
def test_dcp_ranks_pages_from_vllm_assemble_into_the_tp1_page():
    """vLLM's slot mapping (DCP4, interleave 8) and writer fill each rank's shuffled page; the runs built from
    the sub-layouts put every byte where a TP=1 writer puts it for the logical block."""
    from vllm_writers import job, write_pages

    jobs = [job(mla_dtype="fp8_ds_mla", shuffle=False, block=64, seeds=["d"], blocks=1)]
    jobs += [job(mla_dtype="fp8_ds_mla", shuffle=True, block=16, seeds=["d"], blocks=1, cp_size=4, cp_rank=r,
                 interleave=8) for r in range(4)]
    logical, *ranks = write_pages(jobs)
    for role, kvd, tb in (("dsa_indexer", "dsa_indexer_fp8", 132), ("mla", "fp8_ds_mla", 656)):
        key = "indexer" if role == "dsa_indexer" else "mla"
        out = bytearray(64 * tb)
        for r, pages in enumerate(ranks):
            loc = describe(role, kvd, tb, "rocm", 16)
            runs = token_runs(loc, 16, canonical(role, kvd, tb, loc.encoding), 64,
                              [cp_canonical_token(t, r, 4, 8) for t in range(16)])
            copy_runs(out, pages[key][0][0], np.asarray(runs, dtype=np.int64).tobytes())
        assert bytes(out) == logical[key][0][0], role


@needs_writers
@pytest.mark.parametrize("interleave", [1, 8])
def test_the_dcp_plan_assembles_vllms_rank_pages_into_the_tp1_page(interleave):
    """The tier's plan (plan_groups over DCP4 facts on ROCm) gathers each DCP rank's slot, filled with the pages
    vLLM's slot mapping and writer give that rank, into exactly the page vLLM's writer gives a TP=1 worker."""
    from vllm_writers import job, write_pages

    jobs = [job(mla_dtype="fp8_ds_mla", shuffle=False, block=64, seeds=["p"], blocks=1)]
    jobs += [job(mla_dtype="fp8_ds_mla", shuffle=True, block=16, seeds=["p"], blocks=1, cp_size=4, cp_rank=r,
                 interleave=interleave) for r in range(4)]
    logical, *ranks = write_pages(jobs)
    facts = _dsa_facts("rocm", dcp=4, tp=4)
    facts = DeploymentFacts(**{**facts.__dict__, "parallel": ParallelFacts(tp=4, dcp=4, interleave=interleave,
                                                                          stages=facts.parallel.stages)})
    plan = plan_groups(facts)[0]
    out = memoryview(bytearray(plan.layout.payload_bytes))
    for shard in plan.shards:
        (w,) = shard.slots
        r = w % 4
        slot = ranks[r]["mla"][0][0] + ranks[r]["indexer"][0][0]
        plan.gather_shard(shard, memoryview(bytearray(slot)), out)
    assert bytes(out) == logical["mla"][0][0] + logical["indexer"][0][0]


def test_the_cited_writer_code_is_in_the_installed_vllm():
    """A transcription stands only while the code it was read from does."""
    from vllm_writers import vllm_source

    if not _vllm_has_dsa_writers():
        pytest.skip("vLLM 0.34's DeepSeek-V3.2 writers are needed")
    k = vllm_source("models/deepseek_v32/common/kernels.py")
    for line in ("value_off = block_offset * HEAD_DIM + offsets",
                 "scale_byte_off = block_start + cache_block_size * HEAD_DIM + block_offset * 4",
                 "block_offset // BLOCK_TILE * BLOCK_TILE * HEAD_DIM",
                 "+ block_offset % BLOCK_TILE * HEAD_TILE",
                 "+ offsets // HEAD_TILE * BLOCK_TILE * HEAD_TILE",
                 "_INDEXER_CACHE_BLOCK_TILE = 16", "_INDEXER_CACHE_HEAD_TILE_BYTES = 16",
                 "+ mla_block_off * mla_cache_entry_stride",
                 "bytes [KV_DIM, KV_DIM + 16)  : MLA_NUM_TILES float32 scales",
                 "_FP8_DTYPE = current_platform.fp8_dtype()"):
        assert line in k, line
    assert "return [1, MultipleOf(16)] if current_platform.is_rocm() else [64]" in vllm_source(
        "v1/attention/backends/mla/indexer.py")
    rocm = vllm_source("v1/attention/ops/rocm_aiter_mla_sparse.py")
    assert "def indexer_k_cache_is_shuffled(block_size: int) -> bool:" in rocm and "return block_size > 1" in rocm
    assert "return self.kv_cache.ndim == 3 and self.kv_cache.shape[1] != 1" in vllm_source(
        "models/deepseek_v32/amd/rocm.py")
    assert "FP8 indexer K caches then store each\n    token's power-of-two scale as four equal UE8M0 bytes" in \
        vllm_source("utils/deep_gemm.py")
    bt = vllm_source("v1/worker/gpu/block_table.py")
    for line in ("is_local = virtual_block_offsets // CP_INTERLEAVE % CP_SIZE == cp_rank",
                 "local_offsets = rounds * CP_INTERLEAVE + remainder"):
        assert line in bt, line


# -- what the layout model does with them -----------------------------------------------------------
def _dsa_facts(platform, *, dcp=1, tpb=64, tp=2):
    local = tpb // dcp
    names = ("model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer.k_cache")
    layers = {names[0]: LayerFacts(names[0], "mla", "fp8_ds_mla", "U8", (local, 656), local * 656),
              names[1]: LayerFacts(names[1], "dsa_indexer", "dsa_indexer_fp8", "U8", (local, 132), local * 132)}
    par = ParallelFacts(tp=tp, dcp=dcp, stages=(names,)) if dcp > 1 else None
    return DeploymentFacts(model="deepseek-ai/DeepSeek-V3.2", kv_dtype="fp8_ds_mla", tokens_per_hash=tpb,
                           blocks_per_chunk=1, worker_bytes_per_block=local * (656 + 132),
                           groups=(GroupFacts(0, tpb, names),), row="per_worker", copies=tp, layers=layers,
                           parallel=par, platform=platform)


def test_dcp_over_pages_of_no_known_order_is_refused_by_name():
    with pytest.raises(SchemaError, match=r"layer model\.layers\.0\.self_attn\.attn: where a token's bytes sit "
                                          r"in a mla fp8_ds_mla page on platform unknown is not described .* "
                                          r"decode-context parallelism .* refused"):
        plan_groups(_dsa_facts(None, dcp=2))  # which FP8 the platform writes is unknown too
    with pytest.raises(SchemaError, match=r"layer model\.layers\.0\.self_attn\.indexer\.k_cache: where a token's "
                                          r"bytes sit in a dsa_indexer dsa_indexer_fp8 page on platform cuda is not "
                                          r"described"):
        plan_groups(_dsa_facts("cuda", dcp=2))  # vLLM's CUDA indexer takes 64-token kernel blocks only
    plan_groups(_dsa_facts("rocm", dcp=2))  # 32-token pages: ROCm's shuffled tiles are described


def test_whole_pages_of_no_known_order_get_their_own_namespace():
    unknown = plan_groups(_dsa_facts(None))[0].layout
    cuda = plan_groups(_dsa_facts("cuda"))[0].layout
    assert unknown.pins == {"form.dsa_indexer_fp8": "unknown:unknown", "form.fp8_ds_mla": "unknown:unknown"}
    assert unknown.namespace() != cuda.namespace()


def test_rocm_and_cuda_share_a_namespace_and_fnuz_or_mx_scales_never_do():
    ns = {p: plan_groups(_dsa_facts(p))[0] for p in ("cuda", "rocm", "rocm-fnuz", "cuda-mx")}
    assert ns["cuda"].layout.namespace() == ns["rocm"].layout.namespace()
    assert ns["cuda"].layout.pins == {"form.dsa_indexer_fp8": "split/e4m3fn+f32"}
    assert ns["rocm-fnuz"].layout.pins == {"form.dsa_indexer_fp8": "split/e4m3fnuz+f32",
                                           "form.fp8_ds_mla": "rows/e4m3fnuz"}
    assert ns["cuda-mx"].layout.pins == {"form.dsa_indexer_fp8": "split/e4m3fn+ue8m0x4"}
    assert len({p.layout.namespace() for p in ns.values()}) == 3
    # CUDA stores its pages as they are (one read straight into the row); ROCm reorders its indexer tiles.
    assert ns["cuda"].contiguous and not ns["rocm"].contiguous


def test_rocm_reorder_round_trips_through_the_plan():
    plan = plan_groups(_dsa_facts("rocm"))[0]
    rng = np.random.default_rng(1)
    slot = memoryview(bytearray(rng.integers(0, 256, plan.slot_bytes, dtype=np.uint8).tobytes()))
    pay = memoryview(bytearray(plan.layout.payload_bytes))
    plan.gather(slot, pay)
    back = memoryview(bytearray(plan.slot_bytes))
    plan.scatter(pay, back)
    assert bytes(back) == bytes(slot)
    assert bytes(pay) != bytes(slot[:plan.layout.payload_bytes])  # the indexer tiles did move


def test_latent_pages_need_no_platform():
    for p in (None, "cuda", "rocm-fnuz"):
        assert describe("mla", "bfloat16", 1152, p, 64) is not None
    assert describe("mla", "fp8", 576, None, 64) is None  # which FP8 is platform's
    assert identity_pins([("mla", "bfloat16", describe("mla", "bfloat16", 1152, None, 64))], None) == {}


def test_token_runs_refuse_what_does_not_match():
    a = describe("dsa_indexer", "dsa_indexer_fp8", 132, "rocm", 16)
    fnuz = describe("dsa_indexer", "dsa_indexer_fp8", 132, "rocm-fnuz", 32)
    with pytest.raises(SchemaError, match="do not hold the same token bytes"):
        token_runs(a, 16, canonical("dsa_indexer", "dsa_indexer_fp8", 132, fnuz.encoding), 32, list(range(16)))
    can = canonical("dsa_indexer", "dsa_indexer_fp8", 132, a.encoding)
    with pytest.raises(SchemaError, match="distinct positions"):
        token_runs(a, 16, can, 32, [0] * 16)
    with pytest.raises(SchemaError, match="distinct positions"):
        token_runs(a, 16, can, 32, list(range(17, 33)))
    with pytest.raises(SchemaError, match="not whole shuffle16 kernel blocks"):
        token_runs(SubLayout("shuffle16", 132, a.encoding), 8, can, 8, list(range(8)))


def test_token_runs_cut_a_token_wherever_either_order_cuts_it():
    """The load direction as its own runs (file order -> ROCm tiles): the destination cuts a token's keys finer
    than the source does, so each piece must end where either side's piece ends."""
    rng = np.random.default_rng(3)
    recs = [rng.integers(0, 256, 132, dtype=np.uint8).tobytes() for _ in range(32)]
    shuffled = describe("dsa_indexer", "dsa_indexer_fp8", 132, "rocm", 32)
    split = canonical("dsa_indexer", "dsa_indexer_fp8", 132, shuffled.encoding)
    out = bytearray(32 * 132)
    runs = token_runs(split, 32, shuffled, 32, list(range(32)))
    copy_runs(out, _place(split, recs, 32), np.asarray(runs, dtype=np.int64).tobytes())
    assert bytes(out) == _place(shuffled, recs, 32)
