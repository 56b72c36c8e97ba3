"""Layout truth: today's MLA models through vLLM's real grouping, offloading config, scheduler and worker regions.

Every stored file is opened with ``safetensors.safe_open`` and each layer's tensor must hold exactly the
bytes vLLM's worker placed for that layer (tests/vllm_models.py derives those from vLLM's own
``register_kv_caches``, independently of kvformat).
"""

from __future__ import annotations

import glob
import os

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402

# vLLM 0.34's planning API (KV-cache config builder, DSA roles, block-outer placement) drives these
# tests; .ci/run allows exactly this module to skip in its vLLM 0.33 run.
if not hasattr(__import__("vllm.v1.core.kv_cache_planning", fromlist=["x"]), "get_kv_cache_config_builder"):
    pytest.skip("vLLM 0.34's KV-cache planning API is needed", allow_module_level=True)

import safetensors  # noqa: E402
from vllm_harness import kvformat_tier, make_keys  # noqa: E402
from vllm_models import FAMILIES, ModelDeployment, plan_model  # noqa: E402

from kvformat.errors import SchemaError  # noqa: E402

_ = MLAAttentionSpec


def kvf(root, **kw):
    return kvformat_tier(str(root), read_threads=2, write_threads=2, **kw)


def files(root):
    return sorted(p for p in glob.glob(os.path.join(str(root), "**", "*.kvf"), recursive=True) if "/.quarantine/" not in p)


def safetensors_layers(path):
    import torch

    with safetensors.safe_open(path, "pt") as f:
        return {k: f.get_tensor(k).contiguous().view(torch.uint8).numpy().tobytes() for k in f.keys()}


def store_and_check_files(dep, root, keys, seeds, group=0):
    dep.store(dict(zip(keys, seeds)))
    got = {}
    for p in files(root):
        got[os.path.basename(p)[:-4]] = safetensors_layers(p)
    from vllm.v1.kv_offload.base import get_offload_block_hash

    for k, s in zip(keys, seeds):
        layers = got[get_offload_block_hash(k).hex()]
        assert layers == dep.expected(s, group), "a file's per-layer tensors are not what vLLM's worker placed"
    return got


@pytest.mark.parametrize("family", ["deepseek-v3.2-fp8", "deepseek-v3.2-bf16", "glm-5-fp8", "dsa-shared-indexer",
                                    "deepseek-v3.2-mtp", "deepseek-v3-fp8"])
@pytest.mark.parametrize("row", ["replicated", "per_worker", "block_outer", "canonical"])
def test_safetensors_layers_are_what_vllm_placed(tmp_path, family, row):
    keys = make_keys(2, f"{family}-{row}")
    bpc = 2 if row == "block_outer" else 1
    with ModelDeployment(family, [kvf(tmp_path)], tp=4, row=row, bpc=bpc, n_layers=3) as dep:
        store_and_check_files(dep, tmp_path, keys, ["a", "b"])
        layout = dep.tier().layout
        roles = {l.role for l in layout.layers}
        assert "opaque" not in roles
        if "dsa" in family or "v3.2" in family or "glm" in family:
            assert roles == {"mla", "dsa_indexer"}
        dep.evict_primary()
        got = dep.load(keys)
        assert got == {keys[0]: dep.expected("a"), keys[1]: dep.expected("b")}


def test_v32_written_at_tp8_loads_byte_identical_at_tp1_and_tp4(tmp_path):
    keys = make_keys(3, "v32-cross")
    seeds = ["x", "y", "z"]
    with ModelDeployment("deepseek-v3.2-fp8", [kvf(tmp_path)], tp=8, row="per_worker", n_layers=3) as w:
        store_and_check_files(w, tmp_path, keys, seeds)
        ns = w.tier().namespace
        assert w.tier().counters()["files_written"] == 3
    for tp, row in ((1, "replicated"), (4, "replicated"), (4, "block_outer")):
        with ModelDeployment("deepseek-v3.2-fp8", [kvf(tmp_path)], tp=tp, row=row, n_layers=3) as r:
            assert r.tier().namespace == ns, (tp, row)
            assert r.load(keys) == {k: r.expected(s) for k, s in zip(keys, seeds)}, (tp, row)


def test_block_outer_and_layer_outer_share_files_canonical_differs(tmp_path):
    nss = {}
    for row in ("replicated", "block_outer", "per_worker", "canonical"):
        with ModelDeployment("deepseek-v3.2-fp8", [kvf(tmp_path)], tp=2, row=row, bpc=2, n_layers=2) as d:
            nss[row] = d.tier().namespace
    # One canonical payload whatever the row order; vLLM's canonical byte format is its own family.
    assert nss["replicated"] == nss["block_outer"] == nss["per_worker"] != nss["canonical"]


def test_canonical_per_worker_rows_fill_the_shared_canonical_area(tmp_path):
    # vLLM 0.34's canonical layout gives every worker the same canonical area at the row start
    # (shared_offload_region.create_next_canonical_view): one copy serves every worker.
    keys = make_keys(2, "canon")
    with ModelDeployment("deepseek-v3-bf16", [kvf(tmp_path)], tp=4, row="canonical", n_layers=3) as w:
        store_and_check_files(w, tmp_path, keys, ["p", "q"])
    with ModelDeployment("deepseek-v3-bf16", [kvf(tmp_path)], tp=2, row="canonical", n_layers=3) as r:
        assert r.load(keys) == {keys[0]: r.expected("p"), keys[1]: r.expected("q")}


def test_sliding_window_mla_groups_get_one_namespace_each(tmp_path):
    k0 = make_keys(2, "swa-full", group=0)
    k1 = make_keys(2, "swa-win", group=1)
    with ModelDeployment("sliding-window-mla", [kvf(tmp_path)], tp=2, row="replicated", n_layers=4) as dep:
        t = dep.tier()
        assert sorted(t.plans) == [0, 1]
        ns0, ns1 = t.plans[0].layout.namespace(), t.plans[1].layout.namespace()
        assert ns0 != ns1
        dep.store(dict(zip(k0, ["f0", "f1"])))
        dep.store(dict(zip(k1, ["w0", "w1"])))
        by_ns = {os.path.relpath(p, tmp_path).split("/")[0] for p in files(tmp_path)}
        assert by_ns == {ns0, ns1}
        dep.evict_primary()
        assert dep.load(k0) == {k0[0]: dep.expected("f0", 0), k0[1]: dep.expected("f1", 0)}
        assert dep.load(k1) == {k1[0]: dep.expected("w0", 1), k1[1]: dep.expected("w1", 1)}


def test_hybrid_mla_and_head_sharded_attention_is_never_stored_as_replicated(tmp_path):
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvformat.vllm import derive_plans

    fam = FAMILIES["hybrid-mla-gqa"]
    _, kc, skc, ocfg, _ = plan_model(fam, tp=2, row="per_worker", n_layers=4, tiers=[kvf(tmp_path)])
    assert not TieringOffloadingSpec(ocfg).replicated_layout  # vLLM: not every layer is replicated
    # With the per-layer specs (the worker's form of the config) the group is refused by its spec, even at
    # TP=1 where every rank trivially holds the same KV.
    _, kc1, _, ocfg1, _ = plan_model(fam, tp=1, n_layers=4, tiers=[kvf(tmp_path)])
    with pytest.raises(SchemaError, match="FullAttentionSpec .not MLA."):
        derive_plans(TieringOffloadingSpec(ocfg1), kv_cache_config=kc1)
    with pytest.raises(SchemaError, match="kv_tp_replicas"):
        derive_plans(TieringOffloadingSpec(ocfg), kv_cache_config=kc)
    # The scheduler's flattened config cannot tell a head-sharded layer from an MLA one of the same page
    # size, but vLLM counts the TP ranks holding identical KV for every layer (kv_tp_replicas): the tier
    # started by vLLM's own connector refuses the deployment with that reason.
    with pytest.raises(SchemaError, match="kv_tp_replicas"):
        derive_plans(TieringOffloadingSpec(ocfg), kv_cache_config=skc)
    with pytest.raises(SchemaError, match="head-sharded"):
        ModelDeployment(fam, [kvf(tmp_path)], tp=2, row="per_worker", n_layers=4)


def test_trust_rank0_needs_proof_of_replicated_kv(tmp_path):
    # With vLLM's per-layer MLA specs in scope, trust_rank0 starts; the hand-built config tests
    # (no specs, no model config) show the refusal.
    with ModelDeployment("deepseek-v3-bf16", [kvf(tmp_path, replica_policy="trust_rank0")], tp=2,
                         row="per_worker", n_layers=2) as dep:
        assert dep.tier().facts.replicated_kv_known


def test_without_vllms_kv_config_dsa_falls_back_to_formulas_or_opaque(tmp_path):
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvformat.vllm import derive_plans

    for family in ("deepseek-v3.2-fp8", "deepseek-v3.2-bf16"):
        _, _, _, ocfg, _ = plan_model(FAMILIES[family], tp=2, n_layers=3, tiers=[kvf(tmp_path)])
        spec = TieringOffloadingSpec(ocfg)
        with_truth, _ = derive_plans(spec, kv_cache_config=plan_model(FAMILIES[family], tp=2, n_layers=3)[2])
        plans, facts = derive_plans(spec)  # not constructed by vLLM's connector: no config in scope
        assert facts.source == "offloading-config"
        assert plans[0].layout == with_truth[0].layout, family  # the formulas give vLLM's own table
    # A page no formula explains: stored opaque, identity pinned, never a made-up table.
    import dataclasses

    odd = dataclasses.replace(ocfg, worker_kv_bytes_per_block=ocfg.worker_kv_bytes_per_block + 64 * 3)
    plans, _ = derive_plans(TieringOffloadingSpec(odd))
    assert [l.role for l in plans[0].layout.layers] == ["opaque"] and plans[0].layout.pins["opaque"] == "v1"


@pytest.mark.parametrize("row", ["per_worker", "replicated"])
def test_legacy_dsa_tree_from_vllms_fs_tier_compacts_to_the_tiers_files(tmp_path, row):
    from vllm_harness import fs_tier

    from kvformat.cli import main

    legacy, out = tmp_path / "legacy", tmp_path / "kvf"
    keys = make_keys(2, f"legacy-dsa-{row}")
    with ModelDeployment("deepseek-v3.2-fp8", [fs_tier(str(legacy))], tp=2, row=row, n_layers=3) as w:
        w.store(dict(zip(keys, ["l0", "l1"])))
        expected = {k: w.expected(s) for k, s in zip(keys, ["l0", "l1"])}
    assert main(["compact", str(legacy), str(out), "--platform", "cuda"]) == 0
    with ModelDeployment("deepseek-v3.2-fp8", [kvf(out)], tp=1, n_layers=3) as r:
        ns = r.tier().namespace
        assert {os.path.relpath(p, out).split("/")[0] for p in files(out)} == {ns}
        for p in files(out):
            layers = safetensors_layers(p)
            assert layers in expected.values()
        assert r.load(keys) == expected
