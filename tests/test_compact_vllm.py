"""Legacy trees written by vLLM 0.33's REAL built-in fs tier, compacted, then loaded by KVFormatTier.

vLLM's ``FileSystemTierManager`` is driven through the real ``TieringOffloadingManager`` (see
tests/vllm_harness.py): it names the files, writes config.json and the raw rows. ``kvformat compact``
converts them; a TP=2 and a TP=1 deployment with ``KVFormatTier`` then load every block through the
same manager, and the bytes must equal what the writer stored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is installed by .ci/run")

from vllm_harness import Deployment, fs_tier, kvformat_tier, make_keys, make_payload  # noqa: E402

from kvformat.cli import main  # noqa: E402
from kvformat.legacy import find_namespaces, infer_row, legacy_fields, legacy_paths  # noqa: E402
from vllm.v1.kv_offload.base import get_offload_block_hash  # noqa: E402
from vllm.v1.kv_offload.file_mapper import FileMapper  # noqa: E402

ROW = 4096
_ITEM = {"bfloat16": 2, "fp8": 1}
# (dtype, tokens_per_block, layers), tried in order for the first shape whose row is (not) padded:
# with a 576-wide latent, rows of 2-byte pages at TP=8 x 4 blocks are always 4096-aligned, so the
# padded shapes need fewer tokens per block, odd layer counts, or a 1-byte dtype.
_SHAPES = [("bfloat16", 16, 4), ("bfloat16", 16, 3), ("bfloat16", 16, 27), ("bfloat16", 8, 3), ("bfloat16", 4, 3),
           ("bfloat16", 2, 3), ("fp8", 16, 3), ("fp8", 3, 3)]


def _shape(tp: int, bpf: int, replicated: bool, padded: bool) -> tuple[str, int, int]:
    copies = 1 if replicated else tp
    for dtype, tpb, n in _SHAPES:
        slot = n * tpb * 576 * _ITEM[dtype] * bpf
        if ((-slot * copies) % ROW != 0) == padded:
            return dtype, tpb, n
    raise AssertionError("no shape")


def _kvf(root: Path) -> dict:
    return kvformat_tier(str(root), read_threads=2, write_threads=2)


def _write_legacy(root: Path, *, tp: int, bpf: int, replicated: bool, dtype: str, tpb: int, n_layers: int,
                  n: int = 3, salt: str = "") -> tuple[list, dict, Deployment]:
    dep = Deployment([fs_tier(str(root))], tp=tp, replicated=replicated, blocks_per_chunk=bpf, n_layers=n_layers,
                     tokens_per_block=tpb, dtype=dtype, num_chunks=8)
    keys = make_keys(n, f"{salt}{tp}{bpf}{replicated}{dtype}{tpb}{n_layers}")
    items = {k: make_payload(k.hex(), dep.slot_bytes) for k in keys}
    assert dep.store(items) == keys
    dep.close()
    return keys, items, dep


def _load(dst: Path, keys, *, tp: int, replicated: bool, bpf: int, dtype: str, tpb: int, n_layers: int) -> dict:
    with Deployment([_kvf(dst)], tp=tp, replicated=replicated, blocks_per_chunk=bpf, n_layers=n_layers,
                    tokens_per_block=tpb, dtype=dtype, num_chunks=8) as dep:
        return dep.load(keys)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("replicated", [False, True], ids=["per_worker", "replicated"])
@pytest.mark.parametrize("bpf", [1, 4])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_real_fs_tier_tree_compacts_and_loads_at_tp2_and_tp1(tmp_path, capsys, tp, bpf, replicated, padded):
    dtype, tpb, n_layers = _shape(tp, bpf, replicated, padded)
    src, dst = tmp_path / "vllm-fs", tmp_path / "kvf"
    keys, items, w = _write_legacy(src, tp=tp, bpf=bpf, replicated=replicated, dtype=dtype, tpb=tpb,
                                   n_layers=n_layers)
    bins = sorted(src.rglob("*.bin"))
    assert len(bins) == len(keys) and all(p.stat().st_size == w.row_bytes for p in bins)
    assert (w.row_bytes > w.copies * w.slot_bytes) == padded
    cfg = json.loads(next(src.glob("*/config.json")).read_text())
    assert cfg.get("replicated_layout", False) == replicated

    rc = main(["compact", str(src), str(dst), "--platform", "cuda", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["converted"] == len(keys) and rep["failed"] == 0 and rep["ignored"] == 0
    (ns,) = rep["namespaces"]
    assert ns["row"] == ("replicated" if replicated else "per_worker") and ns["slots"] == w.copies
    assert ns["padding"] == w.row_bytes - w.copies * w.slot_bytes
    assert rep["bytes_after"] == len(keys) * (ROW + w.slot_bytes)

    for rtp, rrep in ((2, False), (1, True)):
        got = _load(dst, keys, tp=rtp, replicated=rrep, bpf=bpf, dtype=dtype, tpb=tpb, n_layers=n_layers)
        assert got == items, f"TP={rtp} load differs"


def test_real_fs_tier_tampered_replica_refused_rest_converted(tmp_path, capsys):
    src, dst = tmp_path / "vllm-fs", tmp_path / "kvf"
    dep = Deployment([fs_tier(str(src))], tp=4, replicated=False, n_layers=4, num_chunks=8)
    keys = make_keys(5, "tamper")
    items = {k: make_payload(k.hex(), dep.slot_bytes) for k in keys}
    bad = keys[2]
    slots = [items[bad]] * 4
    slots[3] = bytes(b ^ 0xFF if i == 7 else b for i, b in enumerate(items[bad]))
    assert dep.store({**items, bad: slots}) == keys  # worker 3 wrote a different latent
    dep.close()
    bad_path = next(p for p in src.rglob("*.bin") if p.stem == get_offload_block_hash(bad).hex())
    rc = main(["compact", str(src), str(dst), "--platform", "cuda", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 1 and rep["converted"] == 4 and rep["failed"] == 1
    assert rep["failures"][0]["path"] == str(bad_path) and rep["failures"][0]["reason"] == "ReplicaMismatchError"
    assert bad_path.exists()
    got = _load(dst, keys, tp=2, replicated=False, bpf=1, dtype="bfloat16", tpb=16, n_layers=4)
    assert got[bad] is None and all(got[k] == items[k] for k in keys if k != bad)


def test_tp8_and_tp2_trees_merge_into_one_namespace_read_at_tp1(tmp_path, capsys):
    src, dst = tmp_path / "vllm-fs", tmp_path / "kvf"
    k8, i8, _ = _write_legacy(src, tp=8, bpf=1, replicated=False, dtype="bfloat16", tpb=16, n_layers=4, salt="a")
    k2, i2, _ = _write_legacy(src, tp=2, bpf=1, replicated=True, dtype="bfloat16", tpb=16, n_layers=4, salt="b")
    assert len(find_namespaces(str(src))) == 2
    assert main(["compact", "-q", str(src), str(dst), "--platform", "cuda"]) == 0
    assert len([d for d in dst.iterdir() if d.is_dir()]) == 1
    got = _load(dst, k8 + k2, tp=1, replicated=True, bpf=1, dtype="bfloat16", tpb=16, n_layers=4)
    assert got == {**i8, **i2}
    capsys.readouterr()


@pytest.mark.parametrize("replicated", [False, True])
def test_naming_matches_vllm_file_mapper(tmp_path, replicated):
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    groups = [{"tokens_per_block": 16, "layer_names": names}]
    fm = FileMapper(root_dir=str(tmp_path), model_name="deepseek-ai/DeepSeek-V2-Lite", tokens_per_hash=16,
                    blocks_per_file=4, tp_size=8, pp_size=1, pcp_size=1, dcp_size=1, rank=0, dtype="bfloat16",
                    kv_cache_groups=groups, parallel_agnostic=replicated, replicated_layout=replicated)
    ours = legacy_fields("deepseek-ai/DeepSeek-V2-Lite", tokens_per_hash=16, blocks_per_file=4, dtype="bfloat16",
                         kv_cache_groups=groups, tp=8, replicated=replicated)
    assert ours == fm.get_run_config()
    key = make_keys(1, "naming")[0]
    h = get_offload_block_hash(key).hex()
    cfg, path = legacy_paths(str(tmp_path), ours, h)
    assert cfg == fm.get_config_file_path() and path == fm.get_file_name(key)


def test_inferred_layout_matches_the_tiers_namespace(tmp_path):
    src = tmp_path / "vllm-fs"
    _keys, _items, w = _write_legacy(src, tp=4, bpf=4, replicated=False, dtype="bfloat16", tpb=16, n_layers=27)
    ns = find_namespaces(str(src))[0]
    row = infer_row(ns, 0, w.row_bytes)
    with Deployment([_kvf(tmp_path / "kvf")], tp=2, replicated=True, blocks_per_chunk=4, n_layers=27,
                    num_chunks=4) as reader:
        assert reader.tier().namespace == row.layout.namespace()
    assert os.path.isdir(tmp_path / "kvf")
