"""kvformat.staging composes with pipeline (PP) and decode-context (DCP) parallelism (issue 15, item 5).

Real processes (kvformat.testing.ranks), a real /dev/shm row, real files. Every rank holds only its part
of the model's KV: its pipeline stage's layers, and of each block its DCP rank's tokens, placed as vLLM
places them (RankPlacement; vLLM's own token mapping is checked against it in tests/test_parallel.py).
A PP x DCP x TP group writes the same canonical files as a TP-only group, and any group reads them back.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import kvformat as K
from kvformat.staging import RankPlacement, SharedRow, Stager, StagingTimeoutError
from kvformat.storage import open_store
from kvformat.testing.ranks import run_ranks

N_LAYERS, TOKENS, WIDTH, BPC, CHUNKS, NUM_BLOCKS = 4, 8, 16, 2, 3, 12
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(N_LAYERS)]


def _layout() -> K.CanonicalLayout:
    return K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16", NAMES, TOKENS, WIDTH,
                                     blocks_per_chunk=BPC)


def _placement(tp: int, pp: int, dcp: int, interleave: int, pcp: int = 1) -> RankPlacement:
    per = N_LAYERS // pp
    stages = tuple(tuple(NAMES[s * per:(s + 1) * per]) for s in range(pp)) if pp > 1 else ()
    return RankPlacement(tp=tp, pp=pp, dcp=dcp, interleave=interleave, stages=stages, pcp=pcp)


def _truth(layer: int, block: int) -> torch.Tensor:
    """The model's KV of one layer and logical block: TOKENS x WIDTH bf16 (as raw bytes)."""
    g = torch.Generator().manual_seed(1000 * layer + block)
    return torch.randint(0, 256, (TOKENS, WIDTH * 2), dtype=torch.uint8, generator=g)


def _payload(blocks: list[int]) -> bytes:
    return b"".join(_truth(i, b).numpy().tobytes() for i in range(N_LAYERS) for b in blocks)


def _local_kv(rank: int, pl: RankPlacement, zero: bool = False) -> tuple[list[int], list[torch.Tensor]]:
    """This rank's KV: its stage's layers, each block holding its DCP rank's tokens (vLLM's placement)."""
    layout = _layout()
    mine = pl.layer_indices(layout, rank)
    order = pl.token_order(TOKENS // pl.dcp, pl.part_of(rank))
    kv = []
    for i in mine:
        t = torch.zeros(NUM_BLOCKS, TOKENS // pl.dcp, WIDTH * 2, dtype=torch.uint8)
        if not zero:
            for b in range(NUM_BLOCKS):
                t[b] = _truth(i, b)[order]
        kv.append(t)
    return mine, kv


def _ids(c: int) -> list[int]:
    return [2 * c, 2 * c + 1]


def _key(c: int) -> K.BlockKey:
    return K.BlockKey(f"{c + 7:02x}" * 16)


def _writer_group(rank: int, shape: tuple[int, ...], name: str, root: str) -> dict[str, Any]:
    pl = _placement(*shape)
    layout = _layout()
    _, kv = _local_kv(rank, pl)
    row = SharedRow.open(name, rank=rank, world_size=pl.world, num_chunks=CHUNKS, slot_bytes=layout.payload_bytes,
                         parts=pl.parts, timeout_s=30, pin="off")
    st = Stager(row, kv, layout, placement=pl, timeout_s=30)
    copied = [st.stage_out(_ids(c), c) for c in range(CHUNKS)]
    slots_ok = all(row.slot(c).numpy().tobytes() == _payload(_ids(c)) for c in range(CHUNKS))
    saved = [st.save(c, _key(c), open_store(root)) for c in range(CHUNKS)]
    out = {"copied": copied, "slots_ok": slots_ok, "saved": [s is not None for s in saved],
           "bytes_out": st.stats.bytes_out}
    del st
    row.close()
    return out


def _reader_group(rank: int, shape: tuple[int, ...], name: str, root: str) -> bool:
    pl = _placement(*shape)
    layout = _layout()
    mine, kv = _local_kv(rank, pl, zero=True)
    _, want = _local_kv(rank, pl)
    row = SharedRow.open(name, rank=rank, world_size=pl.world, num_chunks=CHUNKS, slot_bytes=layout.payload_bytes,
                         parts=pl.parts, timeout_s=30, pin="off")
    st = Stager(row, kv, layout, placement=pl, timeout_s=30)
    dst = [[NUM_BLOCKS - 1 - b for b in _ids(c)] for c in range(CHUNKS)]  # other block ids on the way back
    for c in range(CHUNKS):
        st.load(c, _key(c), open_store(root))
        st.stage_in(c, dst[c])
    ok = all(torch.equal(kv[k][dst[c]], want[k][_ids(c)]) for k in range(len(mine)) for c in range(CHUNKS))
    del st
    row.close()
    return ok


SHAPES = {  # (tp, pp, dcp, interleave[, pcp])
    "PP2xTP2": (2, 2, 1, 1), "DCP2xTP2": (2, 1, 2, 2), "PP2xDCP2xTP2": (2, 2, 2, 1), "TP2": (2, 1, 1, 1),
    "TP1": (1, 1, 1, 1), "PCP2xTP1": (1, 1, 1, 1, 2),
}


@pytest.mark.parametrize("writer,reader", [("PP2xTP2", "DCP2xTP2"), ("DCP2xTP2", "TP1"),
                                           ("PP2xDCP2xTP2", "PP2xTP2"), ("TP2", "PP2xDCP2xTP2"),
                                           ("PCP2xTP1", "DCP2xTP2")])
def test_parallel_groups_write_canonical_files_any_group_reads(tmp_path: Path, writer: str, reader: str) -> None:
    shape = SHAPES[writer]
    pl = _placement(*shape)
    res = run_ranks(_writer_group, pl.world, shape, f"t-{uuid.uuid4().hex[:10]}", str(tmp_path))
    assert all(r["slots_ok"] for r in res.values())
    # One writer per part and chunk; one saver per chunk.
    for c in range(CHUNKS):
        assert sum(res[r]["copied"][c] for r in res) == pl.parts
        assert sum(res[r]["saved"][c] for r in res) == 1
    # A rank copies only its part: its stage's layers, its DCP rank's tokens.
    part_bytes = BPC * (N_LAYERS // pl.pp) * (TOKENS // pl.dcp) * WIDTH * 2
    assert max(r["bytes_out"] for r in res.values()) == CHUNKS * part_bytes
    layout = _layout()
    for c in range(CHUNKS):  # the canonical file, the same whatever the writer's layout
        path = tmp_path / K.block_relpath(layout, _key(c))
        buf = bytearray(layout.payload_bytes)
        hdr = K.read_into(path, buf, expect=layout, key=_key(c))
        assert bytes(buf) == _payload(_ids(c)) and os.path.getsize(path) == hdr.data_offset + layout.payload_bytes
        assert (hdr.provenance.tp, hdr.provenance.pp, hdr.provenance.dcp) == shape[:3]
        assert hdr.provenance.pcp == pl.pcp
    rshape = SHAPES[reader]
    rpl = _placement(*rshape)
    got = run_ranks(_reader_group, rpl.world, rshape, f"t-{uuid.uuid4().hex[:10]}", str(tmp_path))
    assert all(got.values())


def _missing_stage(rank: int, name: str, root: str) -> dict[str, Any]:
    """PP=2 x TP=1: the stage-1 rank joins the row but never stages the chunk out (it died or hung)."""
    pl = _placement(1, 2, 1, 1)
    layout = _layout()
    _, kv = _local_kv(rank, pl)
    row = SharedRow.open(name, rank=rank, world_size=2, num_chunks=CHUNKS, slot_bytes=layout.payload_bytes,
                         parts=pl.parts, timeout_s=30, pin="off")
    st = Stager(row, kv, layout, placement=pl, timeout_s=1.0)
    out: dict[str, Any] = {}
    if rank == 0:
        try:
            st.stage_out(_ids(0), 0)
        except StagingTimeoutError as e:
            out["stage_out"] = (str(e), e.chunk, e.writer)
        try:
            st.save(0, _key(0), open_store(root))
        except StagingTimeoutError as e:
            out["save"] = (str(e), e.chunk, e.writer)
    del st
    row.close()
    return out


def test_a_chunk_missing_a_stage_is_never_saved(tmp_path: Path) -> None:
    res = run_ranks(_missing_stage, 2, f"t-{uuid.uuid4().hex[:10]}", str(tmp_path))
    for what in ("stage_out", "save"):
        msg, chunk, writer = res[0][what]
        assert (chunk, writer) == (0, 1) and "pipeline stage 1" in msg
    assert not list(tmp_path.rglob("*.kvf"))


def test_placement_follows_vllms_rank_order() -> None:
    assert [RankPlacement(tp=2, pp=2, pcp=2, stages=(("a",), ("b",))).part_of(w) for w in range(8)] == [0] * 4 + [1] * 4
    pl = RankPlacement(tp=4, pp=2, dcp=2, interleave=1, stages=(("a",), ("b",)))
    # rank = stage * tp + tp rank; DCP rank = tp rank % dcp (consecutive TP ranks)
    assert [pl.part_of(w) for w in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert pl.replicas(1) == [1, 3] and pl.replicas(2) == [4, 6]
    assert pl.token_order(4, 1) == [1, 3, 5, 7]
    assert RankPlacement(tp=2, dcp=2, interleave=2).token_order(4, 0) == [0, 1, 4, 5]
