"""The asynchronous staging API (issue 37) over real processes sharing one real /dev/shm row.

Many chunks in flight, completion out of submission order, a writer killed mid-pipeline, a republished slot,
shutdown with work in flight. The oracle is the KV the ranks were built from (torch tensors), never kvformat.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

import kvformat as K
from kvformat.staging import AsyncStager, SharedRow, Stager, StagingConflictError, StagingError, StagingTimeoutError
from kvformat.storage import open_store
from kvformat.testing.ranks import run_ranks

N_LAYERS, TOKENS, WIDTH, BPC, CHUNKS, NUM_BLOCKS = 3, 8, 16, 4, 6, 32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(N_LAYERS)]


def _layout() -> K.CanonicalLayout:
    return K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16", NAMES, TOKENS, WIDTH,
                                     blocks_per_chunk=BPC)


def _kv(zero: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    kv = [torch.randint(0, 256, (NUM_BLOCKS, TOKENS, WIDTH * 2), dtype=torch.uint8, generator=g)
          for _ in range(N_LAYERS)]
    return [torch.zeros_like(t) for t in kv] if zero else kv


def _src(c: int) -> list[int]:
    """Scattered ids for even chunks, one contiguous run for odd ones (both paths of the pipeline)."""
    scattered = {0: [0, 5, 10, 15], 2: [3, 8, 13, 30], 4: [1, 6, 11, 28]}  # every chunk's ids distinct
    return scattered[c] if c in scattered else list(range(16 + 2 * (c - 1), 16 + 2 * (c - 1) + BPC))


def _dst(c: int) -> list[int]:
    return [NUM_BLOCKS - 1 - b for b in _src(c)]


def _open(rank: int, name: str, *, timeout_s: float = 30, rotate: bool = False) -> tuple[SharedRow, Stager]:
    layout = _layout()
    row = SharedRow.open(name, rank=rank, world_size=2, num_chunks=CHUNKS, slot_bytes=layout.payload_bytes,
                         timeout_s=30, pin="off")
    return row, Stager(row, _kv(), layout, rotate=rotate, timeout_s=timeout_s)


def _applied(st: Stager, c: int) -> bool:
    want = _kv()
    return all(torch.equal(st._pages[i][_dst(c)], want[i].view(NUM_BLOCKS, -1)[_src(c)]) for i in range(N_LAYERS))


def _untouched(st: Stager) -> bool:
    return all(not bool(p.any()) for p in st._pages)


def _out_of_order(rank: int, name: str, *, barrier: Any) -> dict[str, Any]:
    row, st = _open(rank, name, rotate=True)  # chunk c is written by rank c % 2
    barrier.wait()
    if rank == 0:
        time.sleep(1.0)  # rank 1's own chunks publish first; its jobs for rank 0's chunks wait
    a = AsyncStager(st)
    outs = [a.submit_stage_out(_src(c), c) for c in range(CHUNKS)]
    order = [r.chunk for r in a.wait() if r.ok]
    for p in st._pages:
        p.zero_()
    ins = [a.submit_stage_in(c, _dst(c)) for c in range(CHUNKS)]  # all in flight at once, two buffers
    res = a.wait(ins)
    out = {"order": order, "outs": len(outs), "ins_ok": all(r.ok for r in res) and len(res) == CHUNKS,
           "applied": all(_applied(st, c) for c in range(CHUNKS)), "written": st.stats.chunks_written}
    a.shutdown()
    del st
    row.close()
    return out


def test_many_chunks_in_flight_finish_out_of_submission_order() -> None:
    res = run_ranks(_out_of_order, 2, f"a-{uuid.uuid4().hex[:10]}", barrier=True)
    for r in (0, 1):
        assert sorted(res[r]["order"]) == list(range(CHUNKS)) and res[r]["ins_ok"] and res[r]["applied"]
        assert res[r]["written"] == CHUNKS // 2
    assert res[1]["order"][:CHUNKS // 2] == [1, 3, 5]  # its own chunks first, though submitted interleaved
    assert res[1]["order"] != sorted(res[1]["order"])


def _killed(rank: int, name: str, *, barrier: Any) -> dict[str, Any]:
    row, st = _open(rank, name, timeout_s=2.0)
    a = AsyncStager(st)
    barrier.wait()
    if rank == 0:
        a.submit_stage_out(_src(0), 0)
        a.wait()  # chunk 0 is published
        assert a._copier is not None
        a._copier.submit(threading.Event().wait)  # the copies queued next stay in flight until the kill
        for c in range(1, CHUNKS):
            a.submit_stage_out(_src(c), c)  # BUSY, copies in flight: then the writer dies
        os.kill(os.getpid(), signal.SIGKILL)
    for p in st._pages:
        p.zero_()
    outs = [a.submit_stage_out(_src(c), c) for c in range(CHUNKS)]
    ins = [a.submit_stage_in(c, _dst(c)) for c in range(CHUNKS)]
    done = {r.job_id: r for r in a.wait()}
    timeouts = [isinstance(done[j].error, StagingTimeoutError) and done[j].error.writer == 0
                and "writer rank 0" in str(done[j].error) for j in outs + ins]
    kv_clean = all(not bool(p[_dst(c)].any()) for p in st._pages for c in range(1, CHUNKS))
    out = {"chunk0": done[ins[0]].ok and _applied(st, 0), "timeouts": timeouts, "kv_clean": kv_clean}
    a.shutdown()
    del st
    row.close()
    return out


def test_writer_killed_mid_pipeline_readers_time_out_naming_it_and_no_kv_written() -> None:
    res = run_ranks(_killed, 2, f"k-{uuid.uuid4().hex[:10]}", barrier=True, expected=1)
    r = res[1]
    assert r["chunk0"]
    assert r["timeouts"] == [False] + [True] * (CHUNKS - 1) + [False] + [True] * (CHUNKS - 1)
    assert r["kv_clean"]


def _republished(rank: int, name: str, *, barrier: Any) -> dict[str, Any]:
    row, st = _open(rank, name)
    a = AsyncStager(st)
    assert a.stage_out(_src(0), 0) is (rank == 0)  # the synchronous wrapper: submit, then wait
    out: dict[str, Any] = {}
    if rank == 1:
        for p in st._pages:
            p.zero_()
        gate = threading.Event()
        assert a._copier is not None
        a._copier.submit(gate.wait)  # the copy engine is busy: the slot copy queued next is still in flight
        job = a.submit_stage_in(0, _dst(0))
        barrier.wait()
        barrier.wait()  # rank 0 republished chunk 0 meanwhile (it did not wait for this rank)
        gate.set()
        (r,) = a.wait([job])
        out = {"conflict": isinstance(r.error, StagingConflictError), "kv_untouched": _untouched(st)}
    else:
        barrier.wait()
        a.wait([a.submit_stage_out(_src(1), 0)])
        barrier.wait()
    a.shutdown()
    del st
    row.close()
    return out


def test_republished_slot_is_never_applied() -> None:
    res = run_ranks(_republished, 2, f"r-{uuid.uuid4().hex[:10]}", barrier=True)
    assert res[1] == {"conflict": True, "kv_untouched": True}


def _shutdown(rank: int, name: str, root: str) -> dict[str, Any]:
    row, st = _open(rank, name)
    a = AsyncStager(st)
    store = open_store(root)
    jobs = [a.submit_stage_out(_src(c), c) for c in range(CHUNKS)]
    jobs += [a.submit_save(c, _key(c), store) for c in range(CHUNKS)]
    reader = Stager(row, _kv(zero=True), _layout(), timeout_s=30)  # a second KV of this rank, zeroed
    reader._epochs[:] = st._epochs
    b = AsyncStager(reader)
    ins = [b.submit_stage_in(c, _dst(c)) for c in range(CHUNKS)]
    got = a.shutdown() + b.shutdown()  # nothing polled before: every job is in flight here
    ids = [r.job_id for r in got if r.kind != "stage_in"]
    try:
        a.submit_stage_out(_src(0), 0)
        late = "accepted"
    except StagingError:
        late = "refused"
    out = {"once": sorted(ids) == sorted(jobs) and len([r for r in got if r.kind == "stage_in"]) == len(ins),
           "ok": all(r.ok for r in got), "saved": sum(r.value is not None for r in got if r.kind == "save"),
           "applied": all(_applied(reader, c) for c in range(CHUNKS)), "bytes_in": reader.stats.bytes_in,
           "late": late}
    del st, reader
    row.close()
    return out


def _key(c: int) -> K.BlockKey:
    return K.BlockKey(f"{c + 3:02x}" * 16)


def test_shutdown_with_work_in_flight_loses_nothing_and_applies_nothing_twice(tmp_path: Path) -> None:
    res = run_ranks(_shutdown, 2, f"s-{uuid.uuid4().hex[:10]}", str(tmp_path))
    for r in (0, 1):
        assert res[r]["once"] and res[r]["ok"] and res[r]["applied"] and res[r]["late"] == "refused"
        assert res[r]["bytes_in"] == CHUNKS * BPC * N_LAYERS * TOKENS * WIDTH * 2  # each chunk applied once
    assert res[0]["saved"] == CHUNKS and res[1]["saved"] == 0
    layout, want = _layout(), _kv()
    for c in range(CHUNKS):  # the files hold the KV's bytes (the oracle: the tensors the ranks were built from)
        buf = bytearray(layout.payload_bytes)
        K.read_into(tmp_path / K.block_relpath(layout, _key(c)), buf, expect=layout, key=_key(c))
        assert bytes(buf) == b"".join(want[i][_src(c)].numpy().tobytes() for i in range(N_LAYERS))


def _failed_load(rank: int, name: str, root: str) -> dict[str, Any]:
    row, st = _open(rank, name, timeout_s=10)
    a = AsyncStager(st)
    (r,) = a.wait([a.submit_load(0, _key(0), open_store(root))])
    out = {"error": type(r.error).__name__, "msg": str(r.error)}
    a.shutdown()
    del st
    row.close()
    return out


def test_a_failed_load_fails_every_rank_naming_the_writer(tmp_path: Path) -> None:
    res = run_ranks(_failed_load, 2, f"f-{uuid.uuid4().hex[:10]}", str(tmp_path))
    assert res[0]["error"] == "FileNotFoundError"
    assert res[1]["error"] == "StagingError" and "writer rank 0" in res[1]["msg"]
