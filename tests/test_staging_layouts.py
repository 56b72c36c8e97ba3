"""The staging path with a DSA layout from the layout model: mixed per-layer pages and dtypes, real /dev/shm row."""

from __future__ import annotations

import uuid

import pytest
import torch

import kvformat as K
from kvformat.layout import DeploymentFacts, GroupFacts, plan_groups
from kvformat.staging import SharedRow, Stager
from kvformat.storage import open_store

TPB, NUM_BLOCKS = 64, 6


def _dsa_plan(n: int, bpc: int):
    names = tuple(x for i in range(n) for x in (f"model.layers.{i}.self_attn.attn",
                                               f"model.layers.{i}.self_attn.indexer.k_cache"))
    facts = DeploymentFacts(model="deepseek-ai/DeepSeek-V3.2", kv_dtype="bfloat16", tokens_per_hash=TPB,
                            blocks_per_chunk=bpc, worker_bytes_per_block=n * (TPB * 1152 + TPB * 132),
                            groups=(GroupFacts(0, TPB, names),))
    return plan_groups(facts)[0]


def _kv(layout: K.CanonicalLayout, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for l in layout.layers:
        raw = torch.randint(0, 256, (NUM_BLOCKS, l.page_bytes), dtype=torch.uint8, generator=g)
        dt = torch.bfloat16 if l.dtype == "BF16" else torch.uint8
        out.append(raw.view(dt).view(NUM_BLOCKS, *l.shape))
    return out


@pytest.mark.parametrize("bpc", [1, 2])
def test_dsa_layout_stages_out_to_a_file_and_back_into_other_kv(tmp_path, bpc):
    plan = _dsa_plan(3, bpc)
    L = plan.layout
    assert {l.role for l in L.layers} == {"mla", "dsa_indexer"}
    assert {l.dtype for l in L.layers} == {"BF16", "U8"}
    store = open_store(str(tmp_path))
    key = K.BlockKey("ab" * 16)
    name = f"t{uuid.uuid4().hex[:10]}"
    src, dst = _kv(L, 1), _kv(L, 2)
    blocks = list(range(1, 1 + bpc))
    with SharedRow.open(name + "w", rank=0, world_size=1, num_chunks=2, slot_bytes=L.payload_bytes,
                        pin="off") as row:
        w = Stager(row, src, L, timeout_s=10)
        assert w.stage_out(blocks, 0)
        w.save(0, key, store)
    with safe_layers(tmp_path) as got:
        for l, t in zip(L.layers, src):
            assert got[l.name] == t[blocks[0]:blocks[-1] + 1].contiguous().view(torch.uint8).numpy().tobytes()
    with SharedRow.open(name + "r", rank=0, world_size=1, num_chunks=2, slot_bytes=L.payload_bytes,
                        pin="off") as row:
        r = Stager(row, dst, L, timeout_s=10)
        assert r.load(1, key, store)
        r.stage_in(1, [4, 5][:bpc])
    for l, a, b in zip(L.layers, src, dst):
        assert torch.equal(a[blocks[0]:blocks[-1] + 1].view(torch.uint8), b[4:4 + bpc].view(torch.uint8)), l.name


class safe_layers:
    def __init__(self, root) -> None:
        import glob

        (self.path,) = glob.glob(f"{root}/**/*.kvf", recursive=True)

    def __enter__(self) -> dict[str, bytes]:
        import safetensors

        with safetensors.safe_open(self.path, "pt") as f:
            return {k: f.get_tensor(k).contiguous().view(torch.uint8).numpy().tobytes() for k in f.keys()}

    def __exit__(self, *exc) -> None:
        return None
