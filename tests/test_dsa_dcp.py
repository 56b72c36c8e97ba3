"""The DSA + DCP matrix against vLLM's own writers (issue 20, items 1-3).

DeepSeek-V3.2 and GLM-5 pages (the MLA latent, bf16 or ``fp8_ds_mla``, and the DSA indexer's FP8 keys and
scales) are written by vLLM 0.34's own code under Triton's interpreter (tests/vllm_writers.py): its
slot-mapping kernel decides which tokens a DCP rank holds and where, its fused cache writer decides every
byte. A DCP writer's file must be byte for byte what a TP=1 deployment's writer produces for the logical
block, and every reader worker must hold exactly what vLLM's writer put in its own pages. Before kvformat
placed tokens through sub-layouts it moved the indexer's pages as 132-byte token rows: these tests fail there.

The matrix runs on ROCm's platform (shuffled indexer tiles: the order furthest from token rows, and block
sizes of 16 tokens keep the interpreter's work small); one DCP case runs on CUDA's split order (its indexer
takes 64-token kernel blocks only, so a DCP2 logical block is 128 tokens).
"""

from __future__ import annotations

import glob
import os

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")
if not hasattr(__import__("vllm.v1.core.kv_cache_planning", fromlist=["x"]), "get_kv_cache_config_builder"):
    pytest.skip("vLLM 0.34's KV-cache planning API is needed", allow_module_level=True)
if not os.path.exists(os.path.join(os.path.dirname(__import__("vllm").__file__), "models/deepseek_v32/common")):
    pytest.skip("vLLM 0.34's DeepSeek-V3.2 cache writers are needed", allow_module_level=True)
pytest.importorskip("triton")

import torch  # noqa: E402
from vllm.v1.kv_offload.base import get_offload_block_hash  # noqa: E402

import kvformat as K  # noqa: E402
from vllm_harness import kvformat_tier, make_keys  # noqa: E402
from vllm_parallel import ParallelDeployment  # noqa: E402

LOGICAL = 64
LAYOUTS = {"DCP2xTP2": (2, 1, 2), "DCP4xTP4": (4, 1, 4), "PP2xDCP2xTP2": (2, 2, 2), "TP1": (1, 1, 1)}


def deploy(root, family, layout, interleave, logical=LOGICAL, n_layers=2):
    tp, pp, dcp = LAYOUTS[layout]
    return ParallelDeployment(family, [kvformat_tier(root)], tp=tp, pp=pp, dcp=dcp, block_size=logical // dcp,
                              bpc=1, n_layers=n_layers, interleave=interleave, num_chunks=4, oracle=True)


def file_layers(root):
    (f,) = glob.glob(os.path.join(root, "**", "*.kvf"), recursive=True)
    return f, {n: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n, t in K.load_file(f).items()}


SLOW = os.environ.get("KVFORMAT_SLOW") == "1"
# (family, interleave): the whole matrix with KVFORMAT_SLOW=1 (about 10 CPU-minutes of interpreted writers,
# cached on disk afterwards); by default one fp8_ds_mla and one bf16 cell, each interleave once.
CELLS = [(f, i) for f in ("deepseek-v3.2-fp8", "deepseek-v3.2-bf16", "glm-5-fp8") for i in (1, 8)] if SLOW else \
    [("deepseek-v3.2-fp8", 8), ("deepseek-v3.2-bf16", 1)]


@pytest.fixture(scope="module", autouse=True)
def _writers_once():
    """Every page the cells below need, from one run of vLLM's writers (one interpreter start, not one per
    deployment); the deployments then find them in the oracle's cache."""
    from vllm_parallel import oracle_jobs
    from vllm_writers import write_pages

    jobs = []
    for family, inter in CELLS:
        cache = "auto" if "bf16" in family else "fp8"
        for d in (1, 2, 4):
            jobs += oracle_jobs(cache, "rocm", LOGICAL, d, inter, 1, [_seed(family, inter)], [0, 1])
    jobs += oracle_jobs("fp8", "cuda", 128, 2, 1, 1, ["cuda"], [0])
    jobs += oracle_jobs("fp8", "cuda", 128, 1, 1, 1, ["cuda"], [0])
    for platform in ("rocm", "cuda"):
        jobs += oracle_jobs("fp8", platform, LOGICAL, 1, 1, 1, ["rocm-cuda"], [0])
    write_pages(jobs)


def _seed(family, interleave):
    # V3.2 and GLM-5 fp8 hold the same cache format: the same token inputs give the same pages.
    return f"{'bf16' if 'bf16' in family else 'fp8'}/{interleave}"


@pytest.mark.platform("rocm")
@pytest.mark.parametrize("family,interleave", CELLS)
def test_dsa_dcp_matrix_against_vllms_writers(tmp_path, family, interleave):
    (key,) = make_keys(1, f"dsa-{family}-{interleave}")
    seeds = {key: _seed(family, interleave)}
    payloads = {}
    for writer in ("DCP2xTP2", "DCP4xTP4", "PP2xDCP2xTP2"):
        root = str(tmp_path / writer)
        with deploy(root, family, writer, interleave) as w:
            assert w.store(seeds) == [key]
            want = w.expected(seeds[key])
            ns = w.tier().namespace
        f, got = file_layers(root)
        assert K.read_header(f).key.hash == get_offload_block_hash(key).hex()
        # The file holds every layer exactly as vLLM's writer lays out the logical block at TP=1.
        assert list(got) == list(want)
        assert {n: got[n] == want[n] for n in want} == dict.fromkeys(want, True)
        payloads[writer] = (ns, open(f, "rb").read()[K.read_header(f).data_offset:])
    assert len(set(payloads.values())) == 1, "every DCP/PP writer stores one canonical payload in one namespace"
    root = str(tmp_path / "DCP2xTP2")
    for reader in LAYOUTS:
        with deploy(root, family, reader, interleave) as r:
            assert r.tier().namespace == payloads["DCP2xTP2"][0]
            # Every reader worker holds exactly the pages vLLM's writer produces for its own tokens.
            assert r.load_checked(seeds) == {key: True}, reader


@pytest.mark.platform("cuda")
def test_dsa_dcp2_on_cuda_against_vllms_writers(tmp_path):
    """CUDA's indexer order: 64-token kernel blocks of keys then scales (a 128-token DCP2 logical block)."""
    (key,) = make_keys(1, "dsa-cuda")
    seeds = {key: "cuda"}
    root = str(tmp_path)
    with deploy(root, "deepseek-v3.2-fp8", "DCP2xTP2", 1, logical=128, n_layers=1) as w:
        w.store(seeds)
        want = w.expected("cuda")
    _, got = file_layers(root)
    assert {n: got[n] == want[n] for n in want} == dict.fromkeys(want, True)
    with deploy(root, "deepseek-v3.2-fp8", "TP1", 1, logical=128, n_layers=1) as r:
        assert r.load_checked(seeds) == {key: True}


@pytest.mark.platform("rocm")
def test_rocm_and_cuda_deployments_share_one_canonical_payload(tmp_path, monkeypatch):
    """A ROCm deployment (shuffled indexer tiles, vLLM's writer) and a CUDA one (keys then scales) of the same
    model and encoding store byte-identical files in one namespace, and each serves the other exactly its pages."""
    import kvformat.vllm._facts as facts

    (key,) = make_keys(1, "rocm-cuda")
    seeds = {key: "rocm-cuda"}
    payload = {}
    for platform in ("rocm", "cuda"):
        monkeypatch.setattr(facts, "vllm_platform", lambda p=platform: p)
        root = str(tmp_path / platform)
        with deploy(root, "deepseek-v3.2-fp8", "TP1", 1, n_layers=1) as w:
            assert w.platform == platform
            w.store(seeds)
            ns = w.tier().namespace
        f, _ = file_layers(root)
        payload[platform] = (ns, open(f, "rb").read()[K.read_header(f).data_offset:])
    assert payload["rocm"] == payload["cuda"]
    for reader, writer in (("cuda", "rocm"), ("rocm", "cuda")):
        monkeypatch.setattr(facts, "vllm_platform", lambda p=reader: p)
        with deploy(str(tmp_path / writer), "deepseek-v3.2-fp8", "TP1", 1, n_layers=1) as r:
            assert r.load_checked(seeds) == {key: True}, (writer, reader)
