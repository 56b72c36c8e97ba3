"""KVFormatTier against vLLM 0.33's real TieringOffloadingManager (store -> cascade -> evict -> promote)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is installed by .ci/run")

from vllm_harness import (  # noqa: E402  (after the importorskip on purpose)
    PAD_BYTE, Deployment, fs_tier, kvf, kvf_files, kvformat_tier, make_keys, make_payload, payloads,
)

import kvformat as K  # noqa: E402
from kvformat.cache._config import TierConfig, parse_size  # noqa: E402
from kvformat.cache._lru import LRUIndex  # noqa: E402
from kvformat.errors import SchemaError  # noqa: E402
from kvformat.vllm import METRIC_PREFIX, KVFormatTier  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402

N_LAYERS = 3  # 3 x 18,432-byte pages = 55,296-byte slot: not a multiple of 4096, so every row is padded


def roundtrip(dep: Deployment, items: dict) -> dict:
    dep.store(items)
    dep.evict_primary()
    return dep.load(list(items))


# -- every row layout, TP size and chunk size --------------------------------------------------------
@pytest.mark.parametrize("bpc", [1, 4])
@pytest.mark.parametrize("replicated", [True, False], ids=["replicated", "per_worker"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_roundtrip_one_canonical_file_per_chunk(tmp_path, tp, replicated, bpc):
    with Deployment([kvf(tmp_path)], tp=tp, replicated=replicated, blocks_per_chunk=bpc, n_layers=N_LAYERS,
                    num_chunks=8) as dep:
        assert dep.row_bytes == -(-dep.copies * dep.slot_bytes // 4096) * 4096
        keys = make_keys(6, f"rt{tp}{replicated}{bpc}")
        items = payloads(dep, keys)
        got = roundtrip(dep, items)
        assert got == items  # every worker slot was filled too (the harness checks the fan-out)
        raw = dep.load(keys[:1], raw=True)[keys[0]]
        assert raw[dep.copies * dep.slot_bytes:] == bytes(dep.row_bytes - dep.copies * dep.slot_bytes)
        tier = dep.tier()
        files = kvf_files(tmp_path)
        assert len(files) == len(keys)
        for p in files:
            hdr = K.read_header(p)
            assert hdr.raw_bytes == hdr.data_bytes == dep.slot_bytes  # one copy, no padding
            assert p.stat().st_size <= dep.slot_bytes + 8192
            assert hdr.layout == tier.layout and hdr.provenance.tp == tp
            assert hdr.provenance.row == ("replicated" if dep.replicated else "per_worker")
            with open(p, "rb") as f:
                f.seek(hdr.data_offset)
                assert f.read() == items[next(k for k in keys if k[:-4].hex() == hdr.key.hash)]
        c = tier.counters()
        assert c["files_written"] == len(keys) and c["files_read"] >= len(keys)
        assert c["dedup_saved_bytes"] == len(keys) * (dep.copies - 1) * dep.slot_bytes


@pytest.mark.parametrize("tp,replicated,n_layers,dtype,pad", [
    (2, True, 27, "bfloat16", 2048),  # slot 497,664 bytes (121.5 pages), row 499,712
    (1, False, 27, "bfloat16", 2048),
    (2, False, 3, "fp8", 2048),  # two 27,648-byte worker slots (13.5 pages)
    (8, True, 3, "bfloat16", 2048),
])
def test_padding_is_not_stored(tmp_path, tp, replicated, n_layers, dtype, pad):
    # the harness fills row padding with PAD_BYTE: none of it may reach a file
    with Deployment([kvf(tmp_path)], tp=tp, replicated=replicated, n_layers=n_layers, dtype=dtype,
                    num_chunks=4) as dep:
        assert dep.row_bytes - dep.copies * dep.slot_bytes == pad
        items = payloads(dep, make_keys(2, "pad"))
        assert roundtrip(dep, items) == items
        for p in kvf_files(tmp_path):
            data = p.read_bytes()
            hdr = K.read_header(p)
            assert len(data) == hdr.data_offset + dep.slot_bytes
            assert bytes([PAD_BYTE]) * 64 not in data[hdr.data_offset:]


# -- cross-TP ------------------------------------------------------------------------------------------
def test_cross_tp_tp8_writes_tp4_tp2_tp1_read_both_layouts(tmp_path):
    keys = make_keys(5, "xtp")
    with Deployment([kvf(tmp_path)], tp=8, replicated=False, blocks_per_chunk=4, n_layers=N_LAYERS,
                    num_chunks=8) as w8:
        items = payloads(w8, keys)
        w8.store(items)
        ns = w8.tier().namespace
    written = {p: p.stat().st_mtime_ns for p in kvf_files(tmp_path)}
    assert len(written) == len(keys)
    for tp in (4, 2, 1):
        for replicated in (True, False):
            with Deployment([kvf(tmp_path)], tp=tp, replicated=replicated, blocks_per_chunk=4, n_layers=N_LAYERS,
                            num_chunks=8) as r:
                assert r.tier().namespace == ns
                assert r.load(keys) == items, (tp, replicated)
                # and a reader's own store of the same chunks writes nothing new
                r.evict_primary()
                r.store({k: items[k] for k in keys[:2]})
                assert r.tier().counters()["files_written"] == 0
    assert set(kvf_files(tmp_path)) == set(written)


def test_running_instances_share_blocks(tmp_path):
    # B starts first (its scan sees nothing); A writes later; B finds A's files through its async lookup
    with Deployment([kvf(tmp_path)], tp=4, replicated=True, n_layers=N_LAYERS) as b:
        assert b.tier().wait_scanned(10)
        keys = make_keys(3, "share")
        with Deployment([kvf(tmp_path)], tp=8, replicated=False, n_layers=N_LAYERS) as a:
            items = payloads(a, keys)
            a.store(items)
        assert b.load(keys) == items


# -- corruption and mismatches ----------------------------------------------------------------------
def _file_of(root: Path, key) -> Path:
    return next(p for p in kvf_files(root) if p.stem == key[:-4].hex())


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_file_misses_others_load_no_livelock(tmp_path, damage):
    with Deployment([kvf(tmp_path)], tp=2, replicated=False, n_layers=N_LAYERS, num_chunks=8) as dep:
        keys = make_keys(4, f"bad{damage}")
        items = payloads(dep, keys)
        dep.store(items)
        bad = _file_of(tmp_path, keys[1])
        raw = bytearray(bad.read_bytes())
        if damage == "flip":
            raw[-100] ^= 0x01
        else:
            del raw[-4096:]
        bad.write_bytes(bytes(raw))
        dep.evict_primary()
        got = dep.load(keys, timeout=20)  # a livelock would raise TimeoutError
        assert got[keys[1]] is None
        assert all(got[k] == items[k] for k in keys if k != keys[1])
        assert not bad.exists()
        reason = "ChecksumError" if damage == "flip" else "TruncatedError"
        q = list((tmp_path / ".quarantine").rglob(f"*.kvf.{reason}"))
        assert len(q) == 1 and q[0].read_bytes() == bytes(raw)
        c = dep.tier().counters()
        assert c["corrupt_files"] == 1 and c[f"quarantined:{reason}"] == 1
        assert c["checksum_failures"] == (1 if damage == "flip" else 0)
        # the failed key keeps missing (no HIT -> failed promotion loop) ...
        dep.evict_primary()
        assert dep.load([keys[1]], timeout=10) == {keys[1]: None}
        # ... until it is recomputed and stored again
        dep.store({keys[1]: items[keys[1]]})
        dep.evict_primary()
        assert dep.load([keys[1]]) == {keys[1]: items[keys[1]]}


def test_transient_failure_then_restore_of_existing_file_hits_again(tmp_path):
    """A load that failed for a passing reason must not keep the key a MISS once it is stored again,
    even when that store finds the (valid) file already there."""
    with Deployment([kvf(tmp_path)], n_layers=N_LAYERS, num_chunks=8) as dep:
        keys = make_keys(2, "transient")
        items = payloads(dep, keys)
        dep.store(items)
        f = _file_of(tmp_path, keys[0])
        aside = tmp_path / "aside.kvf"
        f.rename(aside)  # the storage is briefly unreachable for this file
        dep.evict_primary()
        got = dep.load(keys, timeout=20)
        assert got[keys[0]] is None and got[keys[1]] == items[keys[1]]
        aside.rename(f)  # it is back, unchanged
        dep.store({keys[0]: items[keys[0]]})  # finds the file present: EXISTS, nothing rewritten
        dep.evict_primary()
        assert dep.load([keys[0]], timeout=20) == {keys[0]: items[keys[0]]}


def test_corrupt_file_is_a_miss_across_restart(tmp_path):
    with Deployment([kvf(tmp_path)], n_layers=N_LAYERS) as dep:
        keys = make_keys(3, "bad-restart")
        items = payloads(dep, keys)
        dep.store(items)
    bad = _file_of(tmp_path, keys[0])
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    bad.write_bytes(bytes(raw))
    with Deployment([kvf(tmp_path)], n_layers=N_LAYERS) as dep:
        dep.tier().wait_scanned(10)
        got = dep.load(keys, timeout=20)
        assert got[keys[0]] is None and got[keys[1]] == items[keys[1]] and got[keys[2]] == items[keys[2]]


@pytest.mark.parametrize("change", [{"model": "deepseek-ai/DeepSeek-V3"}, {"dtype": "float16"},
                                    {"tokens_per_block": 32}, {"n_layers": N_LAYERS + 1},
                                    {"blocks_per_chunk": 2}], ids=lambda c: next(iter(c)))
def test_other_model_dtype_or_block_size_misses(tmp_path, change):
    keys = make_keys(3, "other")
    with Deployment([kvf(tmp_path)], n_layers=N_LAYERS) as w:
        w.store(payloads(w, keys))
        ns = w.tier().namespace
    kw = {"n_layers": N_LAYERS, **change}
    with Deployment([kvf(tmp_path)], **kw) as r:
        assert r.tier().namespace != ns
        assert r.load(keys, timeout=20) == {k: None for k in keys}
        assert r.tier().counters()["files_read"] == 0


def test_planted_file_with_another_layout_is_quarantined(tmp_path):
    # A file of another layout copied to this namespace's path (a digest collision, a bad copy):
    # fail closed on the header, never load it.
    keys = make_keys(2, "plant")
    with Deployment([kvf(tmp_path / "other")], n_layers=N_LAYERS, tokens_per_block=32, width=288) as o:
        o.store(payloads(o, keys))
    with Deployment([kvf(tmp_path / "mine")], n_layers=N_LAYERS) as dep:
        assert dep.slot_bytes == o.slot_bytes  # same size: only the header tells them apart
        items = payloads(dep, keys[1:])
        dep.store(items)
        src = _file_of(tmp_path / "other", keys[0])
        dst = tmp_path / "mine" / dep.tier().engine.relpath(keys[0][:-4].hex())
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())
        dep.evict_primary()
        got = dep.load(keys, timeout=20)
        assert got == {keys[0]: None, keys[1]: items[keys[1]]}
        c = dep.tier().counters()
        assert c["layout_mismatches"] == 1 and c["quarantined:LayoutMismatchError"] == 1
        assert not dst.exists()


# -- replica policy --------------------------------------------------------------------------------
def test_per_worker_slots_that_differ_are_not_stored(tmp_path):
    with Deployment([kvf(tmp_path)], tp=4, replicated=False, n_layers=N_LAYERS) as dep:
        keys = make_keys(2, "replica")
        good = make_payload("good", dep.slot_bytes)
        slots = [make_payload(f"w{r}", dep.slot_bytes) for r in range(4)]
        dep.store({keys[0]: good, keys[1]: slots})
        assert [p.stem for p in kvf_files(tmp_path)] == [keys[0][:-4].hex()]
        c = dep.tier().counters()
        assert c["replica_mismatches"] == 1 and c["files_written"] == 1
        dep.evict_primary()
        assert dep.load(keys, timeout=20) == {keys[0]: good, keys[1]: None}


def test_one_byte_off_in_the_last_worker_slot_is_not_stored(tmp_path, caplog):
    """The slots are compared inside the fused write: a difference in the last byte of the last slot stops the
    store, leaves no temp file, counts a mismatch and logs the slots' digests."""
    with Deployment([kvf(tmp_path)], tp=8, replicated=False, n_layers=N_LAYERS) as dep:
        keys = make_keys(1, "last-byte")
        good = make_payload("same", dep.slot_bytes)
        off = bytearray(good)
        off[-1] ^= 0x80
        with caplog.at_level(logging.WARNING):
            dep.store({keys[0]: [good] * 7 + [bytes(off)]})
        assert kvf_files(tmp_path) == [] and not [p for p in tmp_path.rglob(".kvf-tmp-*")]
        c = dep.tier().counters()
        assert c["replica_mismatches"] == 1 and c["files_written"] == 0
        assert "the worker slots differ" in caplog.text and "xxh3 per slot" in caplog.text


def test_slots_that_keep_differing_do_not_evict_the_cache(tmp_path):
    """A model whose KV is not replicated fails every per-worker store. The in-write comparison comes after the
    eviction that makes room, so slots that differ from their first bytes on are caught before it: a full cache
    loses nothing to the failed stores (it lost a file per failed store when they were caught in the write)."""
    size = None
    with Deployment([kvf(tmp_path / "probe")], tp=4, replicated=False, n_layers=N_LAYERS) as dep:
        dep.store({make_keys(1, "probe")[0]: make_payload("p", dep.slot_bytes)})
        size = kvf_files(tmp_path / "probe")[0].stat().st_size
    with Deployment([kvf(tmp_path / "root", max_bytes=3 * size)], tp=4, replicated=False, n_layers=N_LAYERS) as dep:
        kept = make_keys(3, "kept")
        dep.store({k: make_payload(f"k{i}", dep.slot_bytes) for i, k in enumerate(kept)})
        assert len(kvf_files(tmp_path / "root")) == 3
        bad = make_keys(6, "not-replicated")
        dep.store({k: [make_payload(f"w{r}{i}", dep.slot_bytes) for r in range(4)] for i, k in enumerate(bad)})
        c = dep.tier().counters()
        assert c["replica_mismatches"] == 6 and c["files_written"] == 3, c
        assert len(kvf_files(tmp_path / "root")) == 3


def test_trust_rank0_without_proof_of_replicated_kv_is_refused(tmp_path):
    # A hand-built OffloadingConfig (no vLLM KV-cache config in scope, per-worker rows): nothing proves the
    # KV is replicated, so skipping the replica check is refused at start-up (tests/test_layout_models.py
    # has the accepted case, with vLLM's per-layer MLA specs).
    with pytest.raises(SchemaError, match="trust_rank0"):
        Deployment([kvf(tmp_path, replica_policy="trust_rank0")], tp=2, replicated=False, n_layers=N_LAYERS)


# -- capacity ------------------------------------------------------------------------------------------
def test_max_bytes_evicts_least_recently_used_and_reports_events(tmp_path):
    probe = K.CanonicalLayout.uniform("m", "bfloat16", ["a", "b", "c"], 16, 576)
    file_bytes = 4096 * 2 + probe.payload_bytes  # header region is at most 2 pages for 3 layers
    keys = make_keys(5, "lru")
    with Deployment([kvf(tmp_path, max_bytes=3 * file_bytes + 100, enable_kv_events=True)], n_layers=N_LAYERS,
                    enable_kv_events=True, num_chunks=8) as dep:
        tier = dep.tier()
        assert tier.wait_scanned(10)
        items = payloads(dep, keys)
        size = None
        for k in keys[:3]:
            dep.store({k: items[k]})
            size = size or sum(p.stat().st_size for p in kvf_files(tmp_path))
        assert size <= file_bytes and len(kvf_files(tmp_path)) == 3
        dep.evict_primary()
        assert dep.load([keys[0]]) == {keys[0]: items[keys[0]]}  # keys[0] is now the most recently used
        dep.events()
        dep.store({keys[3]: items[keys[3]]})  # evicts keys[1], the least recently used
        dep.store({keys[4]: items[keys[4]]})  # evicts keys[2]
        on_disk = {p.stem for p in kvf_files(tmp_path)}
        assert on_disk == {k[:-4].hex() for k in (keys[0], keys[3], keys[4])}
        assert sum(p.stat().st_size for p in kvf_files(tmp_path)) <= tier.config.max_bytes
        removed = [k for e in dep.events() if e.removed for k in e.keys]
        assert removed == [keys[1], keys[2]]
        c = tier.counters()
        assert c["evictions"] == 2 and c["used_bytes"] <= tier.config.max_bytes
        dep.evict_primary()
        got = dep.load(keys, timeout=20)
        assert [got[k] is not None for k in keys] == [True, False, False, True, True]


def test_the_protected_share_is_a_gauge_and_a_ghost_hit_moves_it(tmp_path):
    probe = K.CanonicalLayout.uniform("m", "bfloat16", ["a", "b", "c"], 16, 576)
    file_bytes = 4096 * 2 + probe.payload_bytes
    bound = 3 * file_bytes + 100
    keys = make_keys(4, "ghost-gauge")
    tier = "('1:KVFormatTier',)"

    def share(dep: Deployment) -> float:
        return dep.stats().reduce()[f"{METRIC_PREFIX}protected_share:{tier}"]

    with Deployment([kvf(tmp_path, max_bytes=bound)], n_layers=N_LAYERS) as dep:
        assert dep.tier().wait_scanned(10)
        items = payloads(dep, keys)
        assert share(dep) == 0.2  # the default's start
        for k in keys:
            dep.store({k: items[k]})  # the fourth pushes out keys[0], never loaded: its name to the first ghost
        size = _file_of(tmp_path, keys[1]).stat().st_size
        dep.evict_primary()
        dep.store({keys[0]: items[keys[0]]})  # ARC's B1 hit: the target falls by size x max(1, 0/size), to 0
        assert max(0.0, 0.2 * bound - size) == 0.0 and share(dep) == 0.0
        assert dep.tier().counters()["protected_share"] == 0.0
    with Deployment([kvf(tmp_path / "lru", max_bytes=bound, eviction="lru")], n_layers=N_LAYERS) as dep:
        assert f"{METRIC_PREFIX}protected_share:{tier}" not in dep.stats().reduce()


def test_lru_index_never_evicts_pinned_files():
    idx = LRUIndex(max_bytes=300)
    for name in "abc":
        idx.add(name, 100)
    idx.pin("a")
    assert idx.reserve(100) == [("b", 100)]  # "a" is older but a load is reading it
    idx.add("d", 100, reserved=100)
    idx.unpin("a")
    assert idx.reserve(100) == [("a", 100)]
    idx.release(100)
    idx.begin_scan()
    idx.remove("c")
    assert idx.merge_scan([("old", 10, 1.0), ("c", 100, 2.0), ("d", 100, 3.0)]) == 1  # "c" was deleted meanwhile
    assert idx.lru_order() == ["old", "d"] and idx.used == 110


# -- restart ------------------------------------------------------------------------------------------
def test_restart_sees_and_serves_stored_blocks(tmp_path):
    keys = make_keys(6, "restart")
    with Deployment([kvf(tmp_path)], tp=4, replicated=True, blocks_per_chunk=4, n_layers=N_LAYERS) as dep:
        items = payloads(dep, keys)
        dep.store(items)
    total = sum(p.stat().st_size for p in kvf_files(tmp_path))
    with Deployment([kvf(tmp_path)], tp=4, replicated=False, blocks_per_chunk=4, n_layers=N_LAYERS) as dep:
        tier = dep.tier()
        assert tier.wait_scanned(10)
        c = tier.counters()
        assert c["files"] == len(keys) and c["used_bytes"] == total
        with dep.mgr.lock:  # the tier answers from its rebuilt index: HIT at once, no RETRY step
            assert all(tier.lookup(k, ReqContext(req_id="probe")) is LookupResult.HIT for k in keys)
        assert dep.load(keys) == items


def test_restart_with_smaller_max_bytes_evicts_oldest(tmp_path):
    keys = make_keys(4, "shrink")
    with Deployment([kvf(tmp_path)], n_layers=N_LAYERS) as dep:
        items = payloads(dep, keys)
        for i, k in enumerate(keys):
            dep.store({k: items[k]})
            os.utime(_file_of(tmp_path, k), (1_000_000 + i, 1_000_000 + i))  # distinct LRU clocks
    one = _file_of(tmp_path, keys[0]).stat().st_size
    with Deployment([kvf(tmp_path, max_bytes=2 * one)], n_layers=N_LAYERS) as dep:
        assert dep.tier().wait_scanned(10)
        assert {p.stem for p in kvf_files(tmp_path)} == {k[:-4].hex() for k in keys[2:]}
        assert dep.tier().counters()["evictions"] == 2


# -- the rest of the contract ---------------------------------------------------------------------------
def test_zstd_compression_roundtrip(tmp_path):
    with Deployment([kvf(tmp_path, compression="zstd", compression_level=1)], tp=2, replicated=False,
                    n_layers=N_LAYERS) as dep:
        keys = make_keys(2, "zstd")
        items = {k: bytes(dep.slot_bytes // 2) + make_payload(k.hex(), dep.slot_bytes - dep.slot_bytes // 2)
                 for k in keys}
        assert roundtrip(dep, items) == items
        for p in kvf_files(tmp_path):
            assert K.read_header(p).codec == "zstd" and p.stat().st_size < dep.slot_bytes


def test_existing_files_are_not_rewritten(tmp_path):
    keys = make_keys(3, "skip")
    with Deployment([kvf(tmp_path)], n_layers=N_LAYERS) as dep:
        items = payloads(dep, keys)
        dep.store(items)
    before = {p: p.stat().st_mtime_ns for p in kvf_files(tmp_path)}
    time.sleep(0.01)
    with Deployment([kvf(tmp_path)], tp=2, replicated=False, n_layers=N_LAYERS) as dep:
        dep.store(items)  # index not scanned yet or scanned: either way nothing is rewritten
        c = dep.tier().counters()
        assert c["files_written"] == 0 and c["dedup_saved_bytes"] == 3 * 2 * dep.slot_bytes
    assert {p: p.stat().st_mtime_ns for p in kvf_files(tmp_path)} == before
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".kvf-tmp-")]


def test_metrics_through_get_stats(tmp_path):
    with Deployment([kvf(tmp_path)], tp=2, replicated=False, n_layers=N_LAYERS) as dep:
        keys = make_keys(2, "metrics")
        roundtrip(dep, payloads(dep, keys))
        tier = "('1:KVFormatTier',)"  # every series carries vLLM's label of the tier (reduce() spells it so)
        reduced = {k.removesuffix(":" + tier): v for k, v in dep.stats().reduce().items() if k.endswith(tier)}
        assert reduced[METRIC_PREFIX + "files_written"] == 2
        assert reduced[METRIC_PREFIX + "bytes_read"] == reduced[METRIC_PREFIX + "bytes_written"] > 0
        assert reduced[METRIC_PREFIX + "dedup_saved_bytes"] == 2 * dep.slot_bytes
        assert reduced[METRIC_PREFIX + "used_bytes"] == reduced[METRIC_PREFIX + "bytes_written"]
        assert reduced[METRIC_PREFIX + "root_healthy"] == 1 and reduced[METRIC_PREFIX + "lookup_hits"] == 2
        again = dep.stats().reduce()  # counters are deltas since the last report
        assert METRIC_PREFIX + "files_written:" + tier not in again
    names = KVFormatTier.build_metric_definitions({})
    for m in ("bytes_written", "bytes_read", "checksum_failures", "replica_mismatches", "evictions",
              "dedup_saved_bytes"):
        assert METRIC_PREFIX + m in names


def test_tier_parameters(tmp_path):
    assert parse_size("max_bytes", "500GiB") == 500 * 2**30
    assert parse_size("max_bytes", "1.5TB") == 1_500_000_000_000
    assert parse_size("max_bytes", 4096) == 4096 and parse_size("max_bytes", None) is None
    for bad in ("lots", "5 parsecs", -1, True, [1]):
        with pytest.raises(SchemaError, match="max_bytes"):
            parse_size("max_bytes", bad)
    cfg = TierConfig.parse(str(tmp_path))
    assert (cfg.read_threads, cfg.write_threads, cfg.compression, cfg.verify, cfg.max_bytes, cfg.o_direct,
            cfg.fsync, cfg.replica_policy) == (8, 8, "none", True, None, "off", False, "verify")
    for kw, field in [({"compression": "lz4"}, "compression"), ({"replica_policy": "vote"}, "replica_policy"),
                      ({"o_direct": "maybe"}, "o_direct"), ({"read_threads": 0}, "read_threads"),
                      ({"verify": "yes"}, "verify"), ({"storage_options": "x"}, "storage_options")]:
        with pytest.raises(SchemaError, match=field):
            TierConfig.parse(str(tmp_path), **kw)
    with pytest.raises(TypeError):
        Deployment([kvf(tmp_path, no_such_param=1)], n_layers=N_LAYERS)
    with Deployment([kvf(tmp_path, locality="LOCAL", fsync=True, o_direct="auto", max_bytes="1GiB")],
                    n_layers=N_LAYERS) as dep:
        assert dep.tier().config.max_bytes == 2**30 and dep.tier().locality.value == "LOCAL"
        items = payloads(dep, make_keys(1, "params"))
        assert roundtrip(dep, items) == items


def test_harness_drives_builtin_fs_tier(tmp_path):
    # the harness itself, on vLLM's own tier: other suites build legacy fs trees with it
    with Deployment([fs_tier(str(tmp_path))], tp=2, replicated=False, n_layers=N_LAYERS) as dep:
        items = payloads(dep, make_keys(3, "fs"))
        assert roundtrip(dep, items) == items
        files = list(tmp_path.rglob("*.bin"))
        assert len(files) == 3 and all(p.stat().st_size == dep.row_bytes for p in files)


@pytest.mark.parametrize("kw,field", [({"pp": 2}, "parallel"), ({"dcp": 2}, "parallel"),
                                      ({"extra_groups": [["model.layers.9.indexer"]]}, "groups")])
def test_deployments_the_tier_cannot_store_are_refused(tmp_path, kw, field):
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
    from vllm_harness import make_config

    from kvformat.vllm import derive_layout

    args = {"layer_names": [f"l{i}" for i in range(3)], "worker_kv_bytes_per_block": 3 * 18432, "tp": 2, **kw}
    spec = TieringOffloadingSpec(make_config([kvf(tmp_path)], **args))
    with pytest.raises(SchemaError, match=field):
        derive_layout(spec)
    ok = TieringOffloadingSpec(make_config([kvf(tmp_path)], layer_names=["a", "b"], worker_kv_bytes_per_block=2 * 18432,
                                           tp=2, replicated=False))
    layout, copies, kind = derive_layout(ok, "rev1")
    assert (copies, kind, layout.revision, layout.layers[0].shape, layout.layers[0].dtype) == (
        2, "per_worker", "rev1", (16, 576), "BF16")
    # Pages the rules cannot explain are stored opaque (never a made-up per-layer table), pinned to the row.
    odd = TieringOffloadingSpec(make_config([kvf(tmp_path)], layer_names=["a", "b", "c"], tp=2,
                                            worker_kv_bytes_per_block=3 * 18432 + 16))
    layout, _, _ = derive_layout(odd)
    assert [l.role for l in layout.layers] == ["opaque"]
    assert layout.pins["row.worker_bytes_per_block"] == str(3 * 18432 + 16)


def test_url_root_goes_through_the_store_interface(tmp_path):
    # fsspec's in-process memory filesystem: the tier never opens files itself, so a URL root just works
    pytest.importorskip("fsspec")
    import uuid

    root = f"memory://kvft-{uuid.uuid4().hex[:8]}/cache"
    keys = make_keys(3, "url")
    with Deployment([kvformat_tier(root, read_threads=2, write_threads=2, storage_options={})], tp=4,
                    replicated=False, n_layers=N_LAYERS) as w:
        items = payloads(w, keys)
        w.store(items)
        assert w.tier().counters()["files_written"] == 3
    with Deployment([kvformat_tier(root, read_threads=2, write_threads=2)], tp=2, replicated=True,
                    n_layers=N_LAYERS) as r:
        assert r.tier().wait_scanned(10) and r.tier().counters()["files"] == 3
        assert r.load(keys) == items
