"""GPU-verified loads (issue 47): ``Stager.load(..., verify="device")`` with real files, a real /dev/shm row and
the device checksum run by Triton's interpreter on CPU KV (the same kernels a GPU compiles).

The oracle of "the bytes are right" is the source KV itself and python-xxhash; a corrupt file is made by
flipping one byte of its data region on disk.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import kvformat as K
from kvformat.errors import ChecksumError, KVFormatError
from kvformat.format._paths import block_relpath
from kvformat.staging import AsyncStager, SharedRow, Stager, StagingError, xxh3_64_gathered
from kvformat.storage import open_store

N_LAYERS, TPB, WIDTH, BPC, NUM_BLOCKS = 3, 8, 40, 4, 16  # page = 640 bytes: blocks straddle 1 KiB edges


def _layout() -> K.CanonicalLayout:
    return K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                                     [f"model.layers.{i}.self_attn.attn" for i in range(N_LAYERS)], TPB, WIDTH,
                                     blocks_per_chunk=BPC)


def _kv(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 128, (NUM_BLOCKS, TPB * WIDTH * 2), dtype=torch.int8, generator=g)
            .view(torch.bfloat16).view(NUM_BLOCKS, TPB, WIDTH) for _ in range(N_LAYERS)]


def _key(c: int) -> K.BlockKey:
    return K.BlockKey(f"{c + 7:02x}" * 16)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _save(root: Path, src_ids: list[int], chunk: int = 0, codec: str = "none") -> tuple[Any, str, bytes]:
    """Stage ``src_ids`` of a seeded KV out and save them as the file of ``_key(chunk)``; (store, relpath,
    the payload as the spec lays it out, built here from the KV)."""
    L = _layout()
    kv = _kv(1)
    store = open_store(str(root))
    row = SharedRow.open(f"gv-{uuid.uuid4().hex[:12]}", rank=0, world_size=1, num_chunks=1,
                         slot_bytes=L.payload_bytes, pin="off")
    try:
        st = Stager(row, kv, L)
        st.stage_out(src_ids, 0)
        st.save(0, _key(chunk), store, codec=codec)
    finally:
        row.close()
    payload = b"".join(b"".join(_bytes(x[b]) for b in src_ids) + bytes(TPB * WIDTH * 2 * (BPC - len(src_ids)))
                       for x in kv)
    return store, block_relpath(L, _key(chunk)), payload


def _flip(store: Any, rel: str, at: int) -> None:
    off = store.read_header(rel).data_offset
    p = os.path.join(store.root, rel)
    with open(p, "r+b") as f:
        f.seek(off + at)
        b = f.read(1)
        f.seek(off + at)
        f.write(bytes([b[0] ^ 0x01]))


def _fresh(tp: int = 1, rank: int = 0, name: str | None = None) -> tuple[SharedRow, Stager, list[torch.Tensor]]:
    L = _layout()
    kv = [torch.zeros(NUM_BLOCKS, TPB, WIDTH, dtype=torch.bfloat16) for _ in range(N_LAYERS)]
    row = SharedRow.open(name or f"gv-{uuid.uuid4().hex[:12]}", rank=rank, world_size=tp, num_chunks=1,
                         slot_bytes=L.payload_bytes, pin="off")
    return row, Stager(row, kv, L, timeout_s=30), kv


def test_device_verified_load_lands_every_byte_and_checks_the_data_on_the_device(tmp_path: Path) -> None:
    src = [9, 2, 14, 5]
    store, rel, payload = _save(tmp_path, src)
    assert store.read_header(rel).data_xxh3 == f"{xxhash.xxh3_64_intdigest(payload):016x}"
    row, st, kv = _fresh()
    try:
        assert st.load(0, _key(0), store, verify="device") is True
        assert st.stats.bytes_verified_device == len(payload)
        assert bytes(row.slot(0).numpy()) == payload
        dst = [3, 0, 11, 7]
        st.stage_in(0, dst)  # from the device copy the check left (the slot is not copied again)
        assert b"".join(b"".join(_bytes(x[b]) for b in dst) for x in kv) == b"".join(
            payload[i * BPC * 640:(i + 1) * BPC * 640] for i in range(N_LAYERS))
        # The gathered checksum of where the blocks landed, in file order, is the file's.
        assert st.checksum_blocks(dst) == xxhash.xxh3_64_intdigest(payload) == int(store.read_header(rel).data_xxh3, 16)
        assert xxh3_64_gathered(st._pages, dst, BPC) == xxhash.xxh3_64_intdigest(payload)
        kv[1][11, 3, 7] = -kv[1][11, 3, 7] if kv[1][11, 3, 7] != 0 else 1.0  # one value changed where it landed
        assert st.checksum_blocks(dst) != xxhash.xxh3_64_intdigest(payload)
    finally:
        row.close()


def test_a_short_chunk_verifies_on_the_device_too(tmp_path: Path) -> None:
    store, rel, payload = _save(tmp_path, [4, 6])  # zero past its 2 blocks, in the file and in the hash
    row, st, kv = _fresh()
    try:
        st.load(0, _key(0), store, verify="device")
        st.stage_in(0, [1, 12])
        assert st.checksum_blocks([1, 12]) == xxhash.xxh3_64_intdigest(payload)
    finally:
        row.close()


@pytest.mark.parametrize("where", [0, 640 * BPC + 1, 3 * 640 * BPC - 1])
def test_a_flipped_byte_fails_the_load_as_the_cpu_check_does_and_is_quarantined(tmp_path: Path, where: int) -> None:
    store, rel, payload = _save(tmp_path, [1, 2, 3, 4])
    _flip(store, rel, where)
    row, st, kv = _fresh()
    try:
        with pytest.raises(ChecksumError) as cpu:
            st.load(0, _key(0), store, verify=True)
        with pytest.raises(ChecksumError) as dev:
            st.load(0, _key(0), store, verify="device")
        e = dev.value
        # The same error as the CPU's: region, expected value, path; the actual value is the bytes' hash.
        assert (e.region, e.expected, e.path) == (cpu.value.region, cpu.value.expected, cpu.value.path)
        assert e.actual == cpu.value.actual == f"{_corrupt_hash(payload, where):016x}"
        assert st.stats.bytes_verified_device == 0
        assert not any(row.slot(0).numpy())  # zeroed, as after a CPU checksum failure (F-5.5)
        with pytest.raises(StagingError, match="failed to publish"):
            st.stage_in(0, [0, 1, 2, 3])  # the chunk is FAILED: never staged in, never counted as loaded
        assert st.stats.bytes_in == 0 and not any(x.view(torch.uint8).any() for x in kv)
        q = store.quarantine_read(rel, e)  # where callers quarantine today: the error names the very file read
        assert q.relpath is not None and not store.exists(rel)
    finally:
        row.close()


def _corrupt_hash(payload: bytes, where: int) -> int:
    b = bytearray(payload)
    b[where] ^= 0x01
    return xxhash.xxh3_64_intdigest(bytes(b))


def test_other_ranks_see_the_writers_device_check_fail_and_stage_nothing(tmp_path: Path) -> None:
    store, rel, _ = _save(tmp_path, [0, 5, 10, 15])
    _flip(store, rel, 77)
    name = f"gv-{uuid.uuid4().hex[:12]}"
    out: dict[int, Any] = {}

    def rank(r: int) -> None:
        row, st, kv = _fresh(2, r, name)
        try:
            try:
                st.load(0, _key(0), store, verify="device")
                out[r] = "loaded"
            except KVFormatError as e:
                out[r] = e
            try:
                st.stage_in(0, [2, 3, 4, 5])
                out[(r, "in")] = "staged"
            except StagingError as e:
                out[(r, "in")] = e
            out[(r, "kv")] = any(x.view(torch.uint8).any() for x in kv)
        finally:
            row.close()

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert isinstance(out[0], ChecksumError) and out[0].region == "data"
    assert isinstance(out[1], StagingError) and "writer rank 0" in str(out[1]) and "ChecksumError" in str(out[1])
    for r in range(2):
        assert isinstance(out[(r, "in")], StagingError) and out[(r, "kv")] is False


def test_async_device_verified_loads_publish_only_after_the_check(tmp_path: Path) -> None:
    store, rel, payload = _save(tmp_path, [8, 9, 10, 11], chunk=0)
    bad, bad_rel, _ = _save(tmp_path, [8, 9, 10, 11], chunk=1)
    _flip(bad, bad_rel, 1500)
    row, st, kv = _fresh()
    try:
        with AsyncStager(st) as a:
            assert a.load(0, _key(0), store, verify="device") is True
            a.stage_in(0, [0, 1, 2, 3])
            assert st.stats.bytes_verified_device == len(payload)
            with pytest.raises(ChecksumError):
                a.load(0, _key(1), store, verify="device")
            with pytest.raises(StagingError, match="ChecksumError"):
                a.stage_in(0, [4, 5, 6, 7])  # the failed epoch is never applied
        assert not any(x[4:8].view(torch.uint8).any() for x in kv)
        assert st.checksum_blocks([0, 1, 2, 3]) == xxhash.xxh3_64_intdigest(payload)
    finally:
        row.close()


def test_compressed_files_are_still_checked_on_the_cpu_in_device_mode(tmp_path: Path) -> None:
    store, rel, payload = _save(tmp_path, [1, 3, 5, 7], codec="zstd")
    row, st, kv = _fresh()
    try:
        st.load(0, _key(0), store, verify="device")
        assert bytes(row.slot(0).numpy()) == payload and st.stats.bytes_verified_device == 0
        _flip(store, rel, 20)
        with pytest.raises(KVFormatError):
            st.load(0, _key(0), store, verify="device")
    finally:
        row.close()


def test_an_unknown_verify_mode_is_refused_before_reading(tmp_path: Path) -> None:
    store, rel, _ = _save(tmp_path, [1])
    row, st, kv = _fresh()
    try:
        with pytest.raises(StagingError, match="verify"):
            st.load(0, _key(0), store, verify="gpu")
        assert st.epoch(0) == 0  # nothing was announced
    finally:
        row.close()


def test_checksum_blocks_refuses_bad_ids(tmp_path: Path) -> None:
    row, st, kv = _fresh()
    try:
        for ids in ([], [NUM_BLOCKS], list(range(BPC + 1))):
            with pytest.raises(StagingError, match="block_ids"):
                st.checksum_blocks(ids)
    finally:
        row.close()
