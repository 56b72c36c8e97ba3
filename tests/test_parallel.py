"""Pipeline (PP) and decode-context (DCP) parallel deployments share one canonical file per chunk (issue 15).

Everything goes through vLLM 0.34's real planning of every worker's KV-cache config, its real scheduler-side
connector and ``TieringOffloadingManager`` (tests/vllm_parallel.py); what each worker must hold (its stage's
layers, its DCP rank's tokens) comes from vLLM's own partition and token mapping, not from kvformat.
``tools/parallel_matrix.py`` runs the full writer x reader matrix.
"""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")
if not hasattr(__import__("vllm.v1.core.kv_cache_planning", fromlist=["x"]), "get_kv_cache_config_builder"):
    pytest.skip("vLLM 0.34's KV-cache planning API is needed", allow_module_level=True)

import torch  # noqa: E402
from vllm.v1.kv_offload.base import get_offload_block_hash  # noqa: E402

import kvformat as K  # noqa: E402
from kvformat.errors import SchemaError  # noqa: E402
from vllm_harness import kvformat_tier, make_keys  # noqa: E402
from vllm_parallel import ParallelDeployment  # noqa: E402

LOGICAL = 64  # tokens per hashed block: a DCP=d layout runs GPU blocks of LOGICAL / d tokens


def deploy(root, family, tp, pp=1, dcp=1, **kw):
    return ParallelDeployment(family, [kvformat_tier(root)], tp=tp, pp=pp, dcp=dcp, block_size=LOGICAL // dcp,
                              **{"n_layers": 7, "bpc": 2, **kw})


def files(root):
    return sorted(glob.glob(os.path.join(root, "**", "*.kvf"), recursive=True))


@pytest.mark.parametrize("family,writer,reader,interleave", [
    ("deepseek-v3-bf16", (8, 1, 1), (4, 2, 1), 1),       # TP8 -> PP2xTP4
    ("deepseek-v3-bf16", (2, 4, 1), (8, 1, 2), 1),       # PP4xTP2 -> DCP2xTP8
    ("kimi-k2-bf16", (4, 2, 2), (1, 1, 1), 4),           # PP2xDCP2xTP4 (interleave 4) -> TP1
    ("glm-5-fp8", (4, 2, 1), (2, 4, 1), 1),              # PP2xTP4 (DSA: whole pages) -> PP4xTP2
], ids=["TP8-to-PP2xTP4", "PP4xTP2-to-DCP2xTP8", "PP2xDCP2xTP4-to-TP1", "PP2xTP4-dsa-to-PP4xTP2"])
def test_pp_and_dcp_layouts_share_files(tmp_path, family, writer, reader, interleave):
    """Latent pages are token rows on every platform: random bytes stand for them. DSA with DCP moves the
    indexer's tokens, so its pages come from vLLM's own writers: tests/test_dsa_dcp.py."""
    root = str(tmp_path)
    keys = make_keys(3, "share")
    seeds = {k: i for i, k in enumerate(keys)}
    with deploy(root, family, *writer, interleave=interleave) as w:
        assert w.store(seeds) == keys
        layout = w.tier().layout
        want = {k: w.expected(s) for k, s in seeds.items()}
    # One canonical file per chunk: the payload once, plus the header; every layer in model order, tokens in order.
    fs = files(root)
    assert len(fs) == len(keys)
    for f in fs:
        hdr = K.read_header(f)
        assert os.path.getsize(f) == hdr.data_offset + layout.payload_bytes
        k = next(k for k in keys if get_offload_block_hash(k).hex() == hdr.key.hash)
        got = {n: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n, t in K.load_file(f).items()}
        assert got == want[k]
    with deploy(root, family, *reader, interleave=interleave) as r:
        assert r.tier().namespace == layout.namespace()
        # Every reader worker holds exactly its stage's layers and its DCP rank's tokens.
        assert r.load_checked(seeds) == dict.fromkeys(keys, True)


def test_provenance_records_the_writers_partition_and_interleave(tmp_path):
    with deploy(str(tmp_path), "deepseek-v3-bf16", 4, pp=2, dcp=2, interleave=8, n_layers=5) as d:
        d.store({make_keys(1, "prov")[0]: 1})
    (f,) = files(str(tmp_path))
    prov = K.read_header(f).provenance
    # vLLM's own partition of 5 layers over 2 stages (get_pp_indices): the remainder goes to the first stage.
    assert (prov.tp, prov.pp, prov.dcp, prov.pcp, prov.row) == (4, 2, 2, 1, "per_worker")
    assert (prov.pp_layers, prov.cp_interleave) == ((3, 2), 8)


def test_explicit_pp_partition_from_vllms_environment(tmp_path):
    """VLLM_PP_LAYER_PARTITION is vLLM's explicit partition: the tier follows it, never its own split."""
    root = str(tmp_path)
    keys = make_keys(2, "part")
    seeds = {k: i for i, k in enumerate(keys)}
    with deploy(root, "deepseek-v3-bf16", 2, pp=2, n_layers=7, partition="5,2") as d:
        assert d.ranges == [(0, 5), (5, 7)]
        d.store(seeds)
    assert K.read_header(files(root)[0]).provenance.pp_layers == (5, 2)
    with deploy(root, "deepseek-v3-bf16", 1, n_layers=7) as r:
        assert r.load_checked(seeds) == dict.fromkeys(keys, True)


def test_a_stage_larger_than_vllms_slot_is_refused(tmp_path):
    """vLLM sizes every worker's slot from stage 0; a later stage with more layers cannot fit its row."""
    with pytest.raises(SchemaError, match=r"pipeline stage 1 holds .* more than vLLM's per-worker slot"):
        deploy(str(tmp_path), "deepseek-v3-bf16", 2, pp=2, n_layers=7, partition="3,4")


def test_replicas_of_one_stage_that_differ_are_not_stored(tmp_path):
    root = str(tmp_path)
    key = make_keys(1, "mismatch")[0]
    with deploy(root, "deepseek-v3-bf16", 2, pp=2) as d:
        def seed(w, name, block):  # worker 3 (stage 1, TP rank 1) holds other bytes than its replica, worker 2
            base = d.local(7, name, block, w)
            return bytes(b ^ 1 for b in base) if w == 3 else base

        d.store({key: seed})
        c = d.tier().counters()
    assert c["replica_mismatches"] == 1 and c["files_written"] == 0
    assert files(root) == []


def test_a_stage_missing_from_the_row_is_refused(tmp_path):
    """A row whose worker slots do not cover every stage (world_size < tp x pp) is never assembled."""
    from kvformat.vllm import derive_plans

    with deploy(str(tmp_path), "deepseek-v3-bf16", 2, pp=2) as d:
        cfg = d.cfg
        bad = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, world_size=2))
        spec = type("S", (), {"config": bad, "blocks_per_chunk": 2, "replicated_layout": False})()
        with pytest.raises(SchemaError, match=r"world_size 2 is not tp x pp x pcp = 4"):
            derive_plans(spec, vllm_config=d.vllm_config, kv_cache_config=d.scheduler_kv_cache_config)


def test_dsa_dcp_over_pages_cudas_indexer_cannot_take_is_refused_by_name(tmp_path):
    """vLLM's CUDA indexer takes 64-token kernel blocks only: a 32-token DCP page of it has no described order,
    so its tokens are not moved (tests/test_dsa_dcp.py runs the 64-token pages against vLLM's writers)."""
    with pytest.raises(SchemaError, match=r"indexer\.k_cache: where a token's bytes sit in a dsa_indexer "
                                          r"dsa_indexer_fp8 page on platform cuda is not described .* refused"):
        deploy(str(tmp_path), "glm-5-fp8", 4, dcp=2)


@pytest.mark.parametrize("writer,reader", [((2, 1, 1, 2), (4, 1, 1, 1)), ((4, 1, 1, 1), (2, 2, 1, 2)),
                                           ((2, 1, 2, 2), (1, 1, 1, 1)), ((4, 1, 1, 1), (4, 1, 2, 2))],
                         ids=["PCP2xTP2-to-TP4", "TP4-to-PP2xPCP2xTP2", "PCP2xDCP2xTP2-to-TP1",
                              "TP4-to-PCP2xDCP2xTP4"])
def test_pcp_ranks_are_replicas_and_share_files(tmp_path, writer, reader):
    """vLLM writes the KV gathered from every PCP rank into every PCP rank's cache, sharding tokens over DCP only
    (tests/test_pcp.py): a PCP rank's slot is one more replica of its stage's (and DCP rank's) part."""
    root = str(tmp_path)
    keys = make_keys(2, "pcp")
    seeds = {k: i for i, k in enumerate(keys)}
    tp, pp, dcp, pcp = writer
    with deploy(root, "deepseek-v3-bf16", tp, pp=pp, dcp=dcp, pcp=pcp) as w:
        w.store(seeds)
        c = w.tier().counters()
    assert c["files_written"] == len(keys) and c["replica_mismatches"] == 0
    assert {K.read_header(f).provenance.pcp for f in files(root)} == {pcp}
    tp, pp, dcp, pcp = reader
    with deploy(root, "deepseek-v3-bf16", tp, pp=pp, dcp=dcp, pcp=pcp) as r:
        assert r.load_checked(seeds) == dict.fromkeys(keys, True)


def test_pcp_ranks_that_differ_are_not_stored(tmp_path):
    key = make_keys(1, "pcp-differ")[0]
    with deploy(str(tmp_path), "deepseek-v3-bf16", 2, pcp=2) as d:
        def seed(w, name, block):  # worker 3 (PCP rank 1, TP rank 1) holds other bytes
            base = d.local(7, name, block, w)
            return bytes(b ^ 1 for b in base) if w == 3 else base

        d.store({key: seed})
        c = d.tier().counters()
    assert c["replica_mismatches"] == 1 and c["files_written"] == 0 and files(str(tmp_path)) == []


def test_pp_without_vllms_config_is_refused(tmp_path):
    """Without vLLM's config in reach (a bare spec), which layers a stage holds is unknown: refused, not guessed."""
    from vllm_harness import make_config
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    cfg = make_config([kvformat_tier(str(tmp_path))], layer_names=names, tp=2, pp=2, replicated=False,
                      worker_kv_bytes_per_block=4 * 16 * 576 * 2)
    with pytest.raises(SchemaError, match=r"the tier did not find; not stored"):
        TieringOffloadingSpec(cfg).get_manager()


# -- legacy trees written by vLLM's own fs tier at PP > 1 / DCP > 1 ----------------------------------------
def _legacy_tree(src, family, tp, pp=1, dcp=1, **kw):
    """vLLM's REAL built-in fs tier stores chunks of a PP/DCP deployment (whole rows, every worker's slot)."""
    from vllm_harness import fs_tier

    keys = make_keys(3, "legacy")
    seeds = {k: i for i, k in enumerate(keys)}
    with ParallelDeployment(family, [fs_tier(str(src))], tp=tp, pp=pp, dcp=dcp, block_size=LOGICAL // dcp,
                            **{"n_layers": 7, "bpc": 2, **kw}) as d:
        assert d.store(seeds) == keys
    assert len(list(src.rglob("*.bin"))) == len(keys)
    return seeds


def test_legacy_pp_tree_compacts_and_loads_at_tp8(tmp_path, capsys):
    import json

    from kvformat.cli import main

    src, dst = tmp_path / "vllm-fs", tmp_path / "kvf"
    seeds = _legacy_tree(src, "glm-5-fp8", 4, pp=2)
    # config.json names stage 0's layers only: the partition must be given ...
    assert main(["compact", str(src), str(dst), "--platform", "cuda", "--json"]) == 2
    assert "--pp-layers" in capsys.readouterr().out
    # ... and so must the platform, which decides these fp8 / indexer bytes (config.json does not record it).
    assert main(["compact", str(src), str(dst), "--pp-layers", "4,3", "--json"]) == 2
    assert "--platform" in capsys.readouterr().out
    # ... and a partition the files contradict (stage 1 holds 3 layers, not 2) converts nothing.
    assert main(["compact", str(src), str(tmp_path / "bad"), "--pp-layers", "4,2", "--platform", "cuda",
                 "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["converted"] == 0 and {f["reason"] for f in rep["failures"]} == {"LegacyLayoutError"}
    assert main(["compact", str(src), str(dst), "--pp-layers", "4,3", "--platform", "cuda", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["converted"] == 3 and rep["failed"] == 0
    fs = files(str(dst))
    prov = K.read_header(fs[0]).provenance
    assert (prov.pp, prov.tp, prov.pp_layers) == (2, 4, (4, 3))
    with deploy(str(dst), "glm-5-fp8", 8) as r:
        assert r.tier().namespace in fs[0]
        assert r.load_checked(seeds) == dict.fromkeys(seeds, True)


def test_legacy_dcp_tree_compacts_and_loads_at_tp8(tmp_path, capsys):
    from kvformat.cli import main

    src, dst = tmp_path / "vllm-fs", tmp_path / "kvf"
    seeds = _legacy_tree(src, "deepseek-v3-bf16", 4, dcp=2, interleave=4)
    assert main(["compact", str(src), str(dst), "--cp-interleave", "4"]) == 0
    capsys.readouterr()
    with deploy(str(dst), "deepseek-v3-bf16", 8) as r:
        assert r.load_checked(seeds) == dict.fromkeys(seeds, True)
    # The interleave is not in config.json and the bytes cannot tell it: a wrong one yields other files, which the
    # TP=8 reader rejects byte for byte; that is why it is an explicit option with no default
    # (test_compact_of_a_dcp_tree_requires_the_interleave).
    dst2 = tmp_path / "kvf2"
    assert main(["compact", str(src), str(dst2), "--cp-interleave", "1"]) == 0
    capsys.readouterr()
    with deploy(str(dst2), "deepseek-v3-bf16", 8) as r:
        assert set(r.load_checked(seeds).values()) == {False}


def test_compact_of_a_dcp_tree_requires_the_interleave(tmp_path, capsys):
    """Issue 20: compact of a DCP tree without --cp-interleave assumed 1 and exited 0 (wrong bytes, valid
    checksums); it now names the flag, and refuses an interleave that does not split a DCP rank's block."""
    import json

    from kvformat.cli import main

    src = tmp_path / "vllm-fs"
    _legacy_tree(src, "deepseek-v3-bf16", 4, dcp=2, interleave=4)
    assert main(["compact", str(src), str(tmp_path / "a"), "--json"]) == 2
    rep = json.loads(capsys.readouterr().out)
    assert rep["converted"] == 0 and any("--cp-interleave" in e and "dcp_size=2" in e for e in rep["layout_errors"])
    assert glob.glob(str(tmp_path / "a" / "**" / "*.kvf"), recursive=True) == []
    # The data tells what it can: a DCP rank's 32-token block is not whole runs of 64 tokens.
    assert main(["compact", str(src), str(tmp_path / "b"), "--cp-interleave", "64", "--json"]) == 2
    assert "interleave runs of 64" in capsys.readouterr().out


def test_compact_pp_layers_must_add_up_to_the_writers_layers(tmp_path, capsys):
    """Issue 20: a partition claiming more layers than the writer had (4+4 for 7) filled the extra layer from the
    slot's zero tail; a layer the writer never wrote is now refused."""
    import json

    from kvformat.cli import main

    src = tmp_path / "vllm-fs"
    _legacy_tree(src, "deepseek-v3-bf16", 4, pp=2)  # vLLM's partition of 7 layers: 4, 3
    assert main(["compact", str(src), str(tmp_path / "bad"), "--pp-layers", "4,4", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["converted"] == 0 and {f["reason"] for f in rep["failures"]} == {"LegacyLayoutError"}
    assert all("does not add up to the writer's layers" in f["error"] for f in rep["failures"])
    assert glob.glob(str(tmp_path / "bad" / "**" / "*.kvf"), recursive=True) == []


def test_legacy_pcp_tree_compacts_and_loads_at_tp4(tmp_path, capsys):
    from kvformat.cli import main

    src, dst = tmp_path / "vllm-fs", tmp_path / "kvf"
    seeds = _legacy_tree(src, "deepseek-v3-bf16", 2, pcp=2)
    assert main(["compact", str(src), str(dst)]) == 0
    capsys.readouterr()
    assert K.read_header(files(str(dst))[0]).provenance.pcp == 2
    with deploy(str(dst), "deepseek-v3-bf16", 4) as r:
        assert r.load_checked(seeds) == dict.fromkeys(seeds, True)
