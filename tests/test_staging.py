"""kvformat.staging with real processes, a real /dev/shm row and real files (CPU).

Groups of ranks are real processes (multiprocessing forkserver, torch preloaded so a rank starts in
milliseconds); each rank holds its own copy of the same paged KV, as TP ranks of an MLA model do.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import kvformat as K
from kvformat.errors import ChecksumError, KVFormatError, LayoutMismatchError
from kvformat.staging import (
    DONE, FAILED, SharedRow, Stager, StagingConflictError, StagingError, StagingTimeoutError, row_path,
)
from kvformat.storage import open_store
from kvformat.testing.ranks import rank_context, run_ranks
from staging_helpers import RacingStager

ROOT = Path(__file__).resolve().parents[1]
N_LAYERS, TPB, WIDTH, BPC = 4, 8, 32, 4  # page = 8 * 32 * 2 = 512 bytes per layer per block
NUM_BLOCKS, CHUNKS = 40, 6
GROUP_TIMEOUT_S = 90.0


def _layout() -> K.CanonicalLayout:
    return K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                                     [f"model.layers.{i}.self_attn.attn" for i in range(N_LAYERS)], TPB, WIDTH,
                                     blocks_per_chunk=BPC)


def _kv(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, TPB, WIDTH, generator=g).to(torch.bfloat16) for _ in range(N_LAYERS)]


def _ids(seed: int) -> list[list[int]]:
    """Block ids per chunk: a permutation, so the payload never depends on where blocks sit in the KV."""
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    return [perm[c * BPC:(c + 1) * BPC] for c in range(CHUNKS)]


def _key(c: int) -> K.BlockKey:
    return K.BlockKey(f"{c + 1:02x}" * 16)


def _name() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# -- process harness: kvformat.testing.ranks (the one shared by tests, benches and the GPU check) -----
def _ctx() -> Any:
    return rank_context()


def _run_group(fn: Callable[..., Any], tp: int, *args: Any,
               on_start: Callable[[list[Any]], None] | None = None) -> dict[int, Any]:
    # A killed rank (on_start) reports nothing.
    return run_ranks(fn, tp, *args, on_start=on_start, expected=tp if on_start is None else tp - 1,
                     timeout_s=GROUP_TIMEOUT_S)


def _out_worker(rank: int, tp: int, name: str, root: str, rotate: bool, int8_views: bool) -> dict[str, Any]:
    L = _layout()
    kv = _kv()
    if int8_views:  # vLLM's shape: (num_blocks, page_bytes) int8 views of the same memory
        kv = [t.view(NUM_BLOCKS, -1).view(torch.int8) for t in kv]
    row = SharedRow.open(name, rank=rank, world_size=tp, num_chunks=CHUNKS, slot_bytes=L.payload_bytes, timeout_s=30)
    gone_after_open = not os.path.exists(row_path(name))
    st = Stager(row, kv, L, rotate=rotate, timeout_s=30)
    ids = _ids(7)
    copied = [st.stage_out(ids[c], c) for c in range(CHUNKS)]
    # Every rank returns from stage_out only once the chunk is published: it can read it now.
    slots_ok = all(_bytes_of(row.slot(c)) == _expected_payload(ids[c]) for c in range(CHUNKS))
    saved = [st.save(c, _key(c), open_store(root)) for c in range(CHUNKS)]
    stats = {"copied": copied, "saved": [s[0] if s else None for s in saved], **st.stats.to_dict()}
    del st
    row.close()
    return {"stats": stats, "gone_after_open": gone_after_open, "slots_ok": slots_ok}


def _expected_payload(block_ids: list[int]) -> bytes:
    kv = _kv()
    return b"".join(_bytes_of(t[block_ids]) for t in kv)


def _in_worker(rank: int, tp: int, name: str, root: str) -> dict[str, Any]:
    L = _layout()
    kv = [torch.zeros(NUM_BLOCKS, TPB, WIDTH, dtype=torch.bfloat16) for _ in range(N_LAYERS)]
    row = SharedRow.open(name, rank=rank, world_size=tp, num_chunks=CHUNKS, slot_bytes=L.payload_bytes, timeout_s=30)
    st = Stager(row, kv, L, timeout_s=30)
    src, dst = _ids(7), _ids(11)
    store = open_store(root)
    for c in range(CHUNKS):
        st.load(c, _key(c), store)
        st.stage_in(c, dst[c])
    orig = _kv()
    equal = all(torch.equal(kv[i][dst[c]].view(torch.int16), orig[i][src[c]].view(torch.int16))
                for c in range(CHUNKS) for i in range(N_LAYERS))
    used = {b for c in range(CHUNKS) for b in dst[c]}
    rest_zero = all(not kv[i][b].view(torch.int16).any() for i in range(N_LAYERS) for b in range(NUM_BLOCKS)
                    if b not in used)
    s = st.stats.to_dict()
    del st
    row.close()
    return {"equal": equal, "rest_zero": rest_zero, "stats": s}


class _StallingStager(Stager):
    """Stops for good after copying layer 0 of chunk 1, so the test can SIGKILL it mid-copy."""

    stalled: Any = None

    def _copy_out_layer(self, i: int, idx: torch.Tensor, dst: torch.Tensor, n: int) -> None:
        super()._copy_out_layer(i, idx, dst, n)
        if self.stalled is not None and i == 0 and self.epoch(1) == 1 and dst.data_ptr() == self._layer_view(
                self.row.slot(1), 0).data_ptr():
            self.stalled.set()
            time.sleep(120)


def _kill_worker(rank: int, tp: int, name: str, stalled: Any, killed: Any) -> dict[str, Any]:
    L = _layout()
    kv = _kv()
    row = SharedRow.open(name, rank=rank, world_size=tp, num_chunks=CHUNKS, slot_bytes=L.payload_bytes, timeout_s=30)
    ids = _ids(7)
    if rank == 0:
        st = _StallingStager(row, kv, L, timeout_s=30)
        st.stalled = stalled
        st.stage_out(ids[0], 0)
        st.stage_out(ids[1], 1)  # never returns: killed inside
        raise AssertionError("the writer was not killed")
    st = Stager(row, kv, L, timeout_s=1.5)
    st.stage_out(ids[0], 0)
    assert killed.wait(60)
    out: dict[str, Any] = {"gone": not os.path.exists(row_path(name))}
    try:
        st.stage_out(ids[1], 1)
        out["stage_out"] = "returned"
    except StagingTimeoutError as e:
        out["stage_out"] = (str(e), e.chunk, e.writer, e.state)
    # A sentinel in the destination blocks: a failed stage_in must leave it there.
    dst = [NUM_BLOCKS - 1 - j for j in range(BPC)]
    for t in kv:
        t[dst] = 5.0
    sentinel = [_bytes_of(t[dst]) for t in kv]
    try:
        st.stage_in(1, dst)
        out["stage_in_busy"] = "returned"
    except StagingTimeoutError as e:
        out["stage_in_busy"] = (str(e), e.chunk, e.writer, e.state)
    out["kv_untouched"] = [_bytes_of(t[dst]) for t in kv] == sentinel
    st.stage_in(0, dst)  # a published chunk still reads fine
    out["chunk0_ok"] = b"".join(_bytes_of(t[dst]) for t in kv) == _expected_payload(ids[0])
    del st
    row.close()
    return out


def _shm_entries(name: str) -> list[str]:
    return [e for e in os.listdir("/dev/shm") if name in e]


# -- tests with real processes ------------------------------------------------------------------------
def test_stage_out_tp2_tp4_to_file_then_stage_in_fresh_tp2(tmp_path: Path) -> None:
    L = _layout()
    roots = {2: str(tmp_path / "tp2"), 4: str(tmp_path / "tp4")}
    names = {}
    for tp in (2, 4):
        names[tp] = _name()
        res = _run_group(_out_worker, tp, tp, names[tp], roots[tp], False, tp == 4)
        # Exactly one rank (rank 0) copied each chunk; the others only observed completion.
        assert [res[r]["stats"]["copied"] for r in range(tp)] == [[True] * CHUNKS] + [[False] * CHUNKS] * (tp - 1)
        assert all(res[r]["gone_after_open"] and res[r]["slots_ok"] for r in range(tp))
        assert [res[r]["stats"]["saved"] for r in range(1, tp)] == [[None] * CHUNKS] * (tp - 1)
        # Counted by the stagers: the group copied each chunk's bytes once, all of it on rank 0.
        assert [res[r]["stats"]["bytes_out"] for r in range(tp)] == [CHUNKS * L.payload_bytes] + [0] * (tp - 1)
        assert [res[r]["stats"]["chunks_written"] for r in range(tp)] == [CHUNKS] + [0] * (tp - 1)
        assert all(res[r]["stats"]["chunks_observed"] == CHUNKS for r in range(1, tp))
        assert not _shm_entries(names[tp])
    ids = _ids(7)
    orig = _kv()
    for c in range(CHUNKS):
        rel = K.block_relpath(L, _key(c))
        payloads = []
        for tp in (2, 4):
            hdr = K.read_header(os.path.join(roots[tp], rel))
            assert hdr.provenance.tp == tp and hdr.provenance.row == "canonical"
            buf = bytearray(L.payload_bytes)
            K.read_into(os.path.join(roots[tp], rel), buf, expect=L, key=_key(c))
            payloads.append(bytes(buf))
        assert payloads[0] == payloads[1] == _expected_payload(ids[c])  # TP-independent file payload
        tensors = K.load_file(os.path.join(roots[2], rel))
        for i, l in enumerate(L.layers):
            assert torch.equal(tensors[l.name].view(torch.int16), orig[i][ids[c]].view(torch.int16))
    name = _name()
    res = _run_group(_in_worker, 2, 2, name, roots[4])
    for r in range(2):
        assert res[r]["equal"] and res[r]["rest_zero"]
        assert res[r]["stats"]["bytes_in"] == CHUNKS * L.payload_bytes  # every rank copies every chunk in
    assert res[0]["stats"]["bytes_from_file"] == CHUNKS * L.payload_bytes and res[1]["stats"]["bytes_from_file"] == 0
    assert not _shm_entries(name)


def test_writer_rotation_covers_all_ranks(tmp_path: Path) -> None:
    tp = 4
    res = _run_group(_out_worker, tp, tp, _name(), str(tmp_path), True, False)
    copied = [res[r]["stats"]["copied"] for r in range(tp)]
    page_total = _layout().payload_bytes // BPC
    for r in range(tp):  # bytes counted by each rank's stager match the chunks it was elected for
        assert res[r]["stats"]["bytes_out"] == sum(copied[r]) * BPC * page_total
    for c in range(CHUNKS):
        assert [copied[r][c] for r in range(tp)].count(True) == 1 and copied[c % tp][c]
    assert all(any(copied[r]) for r in range(tp))
    saved = {c: [res[r]["stats"]["saved"][c] for r in range(tp)] for c in range(CHUNKS)}
    assert all(sum(s is not None for s in saved[c]) == 1 for c in range(CHUNKS))  # each file written once
    ids = _ids(7)
    buf = bytearray(_layout().payload_bytes)
    for c in range(CHUNKS):
        K.read_into(tmp_path / K.block_relpath(_layout(), _key(c)), buf)
        assert bytes(buf) == _expected_payload(ids[c])


def test_writer_killed_mid_copy_readers_time_out_and_nothing_leaks() -> None:
    ctx = _ctx()
    stalled, killed = ctx.Event(), ctx.Event()
    name = _name()

    def kill_writer(procs: list[Any]) -> None:
        assert stalled.wait(60), "the writer never reached the middle of its copy"
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)
        assert procs[0].exitcode == -signal.SIGKILL
        killed.set()

    res = _run_group(_kill_worker, 3, 3, name, stalled, killed, on_start=kill_writer)
    for r in (1, 2):
        out = res[r]
        assert out["gone"]
        msg, chunk, writer, state = out["stage_out"]
        assert (chunk, writer, state) == (1, 0, "BUSY")
        assert "chunk 1" in msg and "writer rank 0" in msg and "died" in msg
        msg, chunk, writer, state = out["stage_in_busy"]
        assert (chunk, writer, state) == (1, 0, "BUSY")
        assert out["kv_untouched"] and out["chunk0_ok"]
    assert not _shm_entries(name)


# -- in-process tests (threads stand in for ranks where a group must open together) -----------------
def _open_threads(name: str, world: int, slot_bytes: int, num_chunks: int = 2,
                  timeout_s: float = 10.0) -> list[SharedRow]:
    rows: list[Any] = [None] * world

    def go(r: int) -> None:
        try:
            # pin="off": threads share one process, which can register a range with CUDA only once.
            rows[r] = SharedRow.open(name, rank=r, world_size=world, num_chunks=num_chunks, slot_bytes=slot_bytes,
                                     timeout_s=timeout_s, pin="off")
        except BaseException as e:
            rows[r] = e

    ts = [threading.Thread(target=go, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return rows


def _bg(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``fn`` in a thread (another rank); the box receives its result or exception."""
    box: list[Any] = [None]

    def go() -> None:
        try:
            box[0] = fn()
        except BaseException as e:
            box[0] = e

    t = threading.Thread(target=go)
    t.start()
    return t, box


def test_row_is_page_aligned_shared_and_unlinked_once_mapped() -> None:
    name = _name()
    rows = _open_threads(name, 2, 5000, num_chunks=3)
    try:
        assert all(isinstance(r, SharedRow) for r in rows)
        assert not os.path.exists(row_path(name))
        assert sum(r.creator for r in rows) == 1
        for c in range(3):
            assert rows[0].slot(c).data_ptr() % 4096 == 0 and rows[0].slot(c).numel() == 5000
        rows[0].slot(2).fill_(7)
        assert bytes(rows[1].slot(2)[:4].numpy()) == b"\x07" * 4  # the same memory in both mappings
        assert rows[0].state(1) == (0, 0)
    finally:
        for r in rows:
            r.close()


def test_join_timeout_and_shape_mismatch_leak_nothing() -> None:
    name = _name()
    with pytest.raises(StagingTimeoutError, match=r"ranks \[1\] did not map it"):
        SharedRow.open(name, rank=0, world_size=2, num_chunks=1, slot_bytes=100, timeout_s=0.3)
    assert not os.path.exists(row_path(name))
    rows: list[Any] = [None, None]

    def go(r: int, slot: int) -> None:
        try:
            rows[r] = SharedRow.open(name, rank=r, world_size=2, num_chunks=1, slot_bytes=slot, timeout_s=1.0)
        except BaseException as e:
            rows[r] = e

    a = threading.Thread(target=go, args=(0, 100))
    a.start()
    while not os.path.exists(row_path(name)):
        time.sleep(0.001)
    go(1, 9000)  # disagrees on the slot size: refused, the creator's file is not its to remove
    a.join()
    assert isinstance(rows[1], StagingError) and "expected a row of" in str(rows[1])
    assert isinstance(rows[0], StagingTimeoutError)
    assert not os.path.exists(row_path(name))
    for bad in ({"rank": 2, "world_size": 2}, {"rank": 0, "world_size": 0}):
        with pytest.raises(StagingError):
            SharedRow.open(_name(), num_chunks=1, slot_bytes=1, **bad)
    with pytest.raises(StagingError):
        row_path("a/b")


def test_stager_rejects_bad_input_with_kvformat_errors() -> None:
    L = _layout()
    with SharedRow.open(_name(), rank=0, world_size=1, num_chunks=2, slot_bytes=L.payload_bytes) as row:
        with pytest.raises(LayoutMismatchError):
            Stager(row, [torch.zeros(4, TPB, WIDTH + 1, dtype=torch.bfloat16)] * N_LAYERS, L)
        with pytest.raises(LayoutMismatchError):
            Stager(row, _kv()[:2], L)
        with pytest.raises(StagingError, match="contiguous"):
            Stager(row, [torch.zeros(NUM_BLOCKS, WIDTH, TPB, dtype=torch.bfloat16).transpose(1, 2)] * N_LAYERS, L)
        st = Stager(row, _kv(), L)
        for call in (lambda: st.stage_out([0] * (BPC + 1), 0), lambda: st.stage_out([NUM_BLOCKS], 0),
                     lambda: st.stage_out([], 0), lambda: st.stage_out([0], 2), lambda: st.stage_in(0, [0])):
            with pytest.raises(KVFormatError):
                call()
        # A short chunk: the tail of the slot is zeroed, so the payload (and file) is still defined.
        row.slot(1).fill_(0xFF)
        st.stage_out([3], 1)
        page_total = sum(l.page_bytes for l in L.layers)
        assert st.stats.bytes_out == page_total
        for i, n in enumerate(L.chunk_bytes_per_layer):
            layer = row.slot(1)[L.layer_offsets[i]:L.layer_offsets[i] + n]
            assert not layer[L.layers[i].page_bytes:].any()
        del st, layer


def test_load_failure_is_published_and_slot_never_read(tmp_path: Path) -> None:
    L = _layout()
    store = open_store(str(tmp_path))
    rows = _open_threads(_name(), 2, L.payload_bytes)
    try:
        w, r = Stager(rows[0], _kv(), L, timeout_s=5), Stager(rows[1], _kv(2), L, timeout_s=5)
        t, box = _bg(lambda: r.load(0, _key(0), store))
        with pytest.raises(FileNotFoundError):  # OS errors pass through unchanged on the rank that hit them
            w.load(0, _key(0), store)
        t.join()
        assert isinstance(box[0], StagingError)
        assert "writer rank 0" in str(box[0]) and "FileNotFoundError" in str(box[0])
        assert rows[1].state(0) == (1, FAILED)
        with pytest.raises(StagingError, match="failed to publish"):
            r.stage_in(0, [0])
        # A corrupt file: the writer gets ChecksumError and the slot is zeroed, never left holding bad bytes.
        assert w.stage_out(_ids(7)[1], 1) and not r.stage_out(_ids(7)[1], 1)
        rel, _, _ = w.save(1, _key(1), store)
        raw = bytearray((tmp_path / rel).read_bytes())
        raw[-1] ^= 1
        (tmp_path / rel).write_bytes(raw)
        t, box = _bg(lambda: r.load(1, _key(1), store))
        with pytest.raises(ChecksumError):
            w.load(1, _key(1), store)
        t.join()
        assert isinstance(box[0], StagingError) and "ChecksumError" in str(box[0])
        assert rows[0].state(1) == (2, FAILED) and not rows[0].slot(1).any()
        del w, r
    finally:
        for row in rows:
            row.close()


def test_republished_slot_is_detected_and_never_reaches_the_kv() -> None:
    L = _layout()
    rows = _open_threads(_name(), 2, L.payload_bytes)
    try:
        kv_w, ids = _kv(), _ids(7)
        w = Stager(rows[0], kv_w, L, timeout_s=5)
        kv_r = [torch.zeros(NUM_BLOCKS, TPB, WIDTH, dtype=torch.bfloat16) for _ in range(N_LAYERS)]
        r = RacingStager(rows[1], kv_r, L, timeout_s=5)
        assert w.stage_out(ids[0], 0) and not r.stage_out(ids[0], 0)
        r.race = lambda: w.stage_out(ids[1], 0)  # the writer reuses chunk 0 while r is reading it
        with pytest.raises(StagingConflictError, match="KV was not modified"):
            r.stage_in(0, ids[0])
        assert not any(t.view(torch.int16).any() for t in kv_r)
        r.race = None
        with pytest.raises(StagingConflictError, match="expected epoch 1"):  # r never saw epoch 2 published
            r.stage_in(0, ids[0])
        # r catches up with the collective call it missed; epoch 2 is published, so it returns at once.
        assert not r.stage_out(ids[1], 0) and rows[1].state(0) == (2, DONE)
        r.stage_in(0, ids[1])
        assert all(torch.equal(a[ids[1]].view(torch.int16), b[ids[1]].view(torch.int16)) for a, b in zip(kv_r, kv_w))
        assert r.stats.bytes_in == BPC * sum(l.page_bytes for l in L.layers) and r.stats.bytes_out == 0
        del w, r
    finally:
        for row in rows:
            row.close()


# -- tools/gpu_check.py: its device-independent logic runs here on the CPU ------------------------------
def _load_tool(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_gpu_check_logic_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool = _load_tool("gpu_check")
    rc = tool.main(["--device", "cpu", "--tp", "1", "--layers", "3", "--tokens", "16", "--latent", "64", "--blocks-per-chunk", "2",
                    "--chunks", "3", "--num-blocks", "12", "--root", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "bytes equal: yes" in out and "D2H" in out and "H2D" in out


def test_gpu_check_tp2_one_writer_every_rank_equal(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--device", "cpu", "--tp", "2",
                        "--layers", "2", "--tokens", "16", "--latent", "64", "--blocks-per-chunk", "2", "--chunks", "2",
                        "--num-blocks", "8", "--repeat", "1"], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    mib = 2 * 2 * 16 * 64 * 2 * 2 / 2**20  # chunks x layers x page bytes x blocks per chunk
    assert f"rank 0: copied out {mib:.1f} MiB/round, copied in {mib:.1f}" in p.stdout
    assert f"rank 1: copied out 0.0 MiB/round, copied in {mib:.1f}" in p.stdout
    assert p.stdout.count("bytes equal: yes") == 3


def test_gpu_check_without_gpu_says_not_run() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "not run: no GPU available"


def test_bench_staging_moves_one_tp_th_of_the_bytes() -> None:
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_staging.py"), "--tp", "2", "--layers", "2",
                        "--chunks", "2", "--blocks-per-chunk", "2", "--repeat", "1", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = {r["mode"]: r for r in json.loads(p.stdout.strip().splitlines()[-1])}
    base = rows["per_rank"]
    assert base["ranks_copying"] == 2 and rows["staged"]["ranks_copying"] == 1 and rows["rotate"]["ranks_copying"] == 2
    assert rows["staged"]["total_bytes"] * 2 == base["total_bytes"] == rows["rotate"]["total_bytes"] * 2
    assert rows["rotate"]["max_rank_bytes"] * 2 == base["max_rank_bytes"]


def _stale_creator(rank: int, name: str) -> None:
    SharedRow.open(name, rank=0, world_size=2, num_chunks=2, slot_bytes=4096, timeout_s=60)  # killed while waiting


def test_row_left_by_a_dead_group_is_replaced_not_trusted() -> None:
    from kvformat import staging

    name = _name()
    ctx = _ctx()
    p = ctx.Process(target=_stale_creator, args=(0, name), daemon=True)
    p.start()
    deadline = time.monotonic() + 60
    while True:  # wait until the creator has published its header, then kill it: the file stays behind
        try:
            if os.path.getsize(row_path(name)) and Path(row_path(name)).read_bytes()[:8] == b"KVFROW01":
                break
        except FileNotFoundError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    with open(row_path(name), "r+b") as f:  # a stale "chunk 0 is DONE at epoch 1" a new group must not see
        f.seek(staging._CHUNK_BASE)
        f.write((1 << 2 | DONE).to_bytes(8, "little"))
    rows = _open_threads(name, 2, 4096)
    try:
        assert all(isinstance(r, SharedRow) for r in rows), rows
        assert rows[0].state(0) == (0, 0) and rows[1].state(0) == (0, 0)
        assert not _shm_entries(name)
    finally:
        for r in rows:
            r.close()
