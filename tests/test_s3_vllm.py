"""KVFormatTier on an ``s3://`` root: vLLM 0.33's real TieringOffloadingManager over a real S3 API server
(moto on 127.0.0.1, or Ceph's RADOS gateway under tools/rgw_check.sh; credentials and endpoint from the environment
as s3fs reads them).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is installed by .ci/run")

from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload, wait_for  # noqa: E402

import kvformat as K  # noqa: E402
from kvformat.storage import open_store  # noqa: E402
from s3_server import S3Server, s3_bucket, s3_env, s3_server  # noqa: E402,F401

N_LAYERS = 3
TIMEOUT_S = 3.0  # the store's deadline per call: a hung server costs a job at most this (plus the queue)


def s3tier(url: str, **kw) -> dict:
    return kvformat_tier(url, read_threads=2, write_threads=2,
                         storage_options={"timeout_s": TIMEOUT_S, "max_retries": 1}, **kw)


def payloads(dep: Deployment, keys) -> dict:
    return {k: make_payload(k.hex(), dep.slot_bytes) for k in keys}


def test_tp4_writes_s3_tp2_reads_byte_identical(s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/kvcache/prod"
    keys = make_keys(6, "s3-xtp")
    with Deployment([s3tier(url)], tp=4, replicated=False, n_layers=N_LAYERS, num_chunks=8) as w:
        items = payloads(w, keys)
        w.store(items)
        c = w.tier().counters()
        assert c["files_written"] == len(keys) and c["io_errors"] == 0
        layout = w.tier().layout
    st = open_store(url)
    entries = list(st.list())
    assert len(entries) == len(keys)
    by_hash = {k[:-4].hex(): items[k] for k in keys}
    for e in entries:  # one canonical object per chunk, payload = the slot bytes, nothing else
        out = bytearray(layout.payload_bytes)
        hdr = st.read_into(e.relpath, out, expect=layout)
        assert bytes(out) == by_hash[hdr.key.hash] and e.size == hdr.file_bytes and hdr.provenance.tp == 4
    for replicated in (True, False):
        with Deployment([s3tier(url)], tp=2, replicated=replicated, n_layers=N_LAYERS, num_chunks=8) as r:
            assert r.load(keys) == items
            assert r.tier().counters()["files_read"] == len(keys)


def test_corrupted_object_is_a_miss(s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/kvcache"
    keys = make_keys(4, "s3-bad")
    with Deployment([s3tier(url)], tp=4, replicated=False, n_layers=N_LAYERS, num_chunks=8) as w:
        items = payloads(w, keys)
        w.store(items)
    st = open_store(url)
    bad = next(e.relpath for e in st.list() if e.relpath.endswith(keys[2][:-4].hex() + ".kvf"))
    raw = bytearray(st.read_bytes(bad))
    raw[-100] ^= 0x01
    st.put(bad, [raw], overwrite=True)
    with Deployment([s3tier(url)], tp=2, replicated=True, n_layers=N_LAYERS, num_chunks=8) as r:
        r.tier().wait_scanned(20)
        got = r.load(keys, timeout=30)  # a livelock would raise TimeoutError
        assert got[keys[2]] is None
        assert all(got[k] == items[k] for k in keys if k != keys[2])
        c = r.tier().counters()
        assert c["checksum_failures"] == 1 and c["quarantined:ChecksumError"] == 1
    st.forget()
    assert not st.exists(bad) and st.read_bytes(f".quarantine/{bad}.ChecksumError") == bytes(raw)


def test_server_lost_mid_run_jobs_fail_cleanly_primary_serves_tier_recovers(s3_env: S3Server) -> None:
    bucket = s3_env.make_bucket()
    url = f"s3://{bucket}/kvcache"
    ka, kb, kc, kd, ke = (make_keys(3, f"s3-down-{s}") for s in "abcde")
    with Deployment([s3tier(url)], tp=2, replicated=True, n_layers=N_LAYERS, num_chunks=8) as dep:
        tier = dep.tier()
        assert tier.wait_scanned(20)
        a = payloads(dep, ka)
        dep.store(a)
        assert tier.counters()["files_written"] == 3

        s3_env.pause()  # hung: connections accepted, nothing answered
        try:
            b = payloads(dep, kb)
            dep.store(b, timeout=60)  # the store jobs end (failed) by their deadline: flush() returns
            c = tier.counters()
            assert c["files_written"] == 3
            assert dep.load(kb, timeout=30) == b  # primary hits keep working
            dep.evict_primary()
            assert dep.load(ka, timeout=60) == {k: None for k in ka}  # tier loads fail cleanly: misses
            assert tier.counters()["io_errors"] == len(ka)
        finally:
            s3_env.resume()

        # back: the same tier instance stores and serves again
        dep.evict_primary()
        dep.store(b)
        cc = payloads(dep, kc)
        dep.store(cc)
        assert tier.counters()["files_written"] == 3 + len(kb) + len(kc)
        dep.evict_primary()
        assert dep.load(kb + kc) == {**b, **cc}

        # The namespace file, kept aside as an operator who recreates a bucket restores it: without it the root
        # is not the one the tier started on, and stores stop until it is back (docs/vllm-operations.md).
        st = open_store(url)
        ns_rel = next(iter(st.list())).relpath.split("/", 1)[0] + "/namespace.json"
        ns_blob = st.read_bytes(ns_rel)
        s3_env.stop()  # dead: connection refused, fails fast
        try:
            d = payloads(dep, kd)
            dep.store(d, timeout=60)
            assert tier.counters()["files_written"] == 3 + len(kb) + len(kc)
            assert dep.load(kd, timeout=30) == d  # primary
        finally:
            s3_env.start()  # moto keeps nothing: the bucket is recreated, as an operator would (RGW keeps it)
        s3_env.make_bucket(bucket)
        assert open_store(url).put(ns_rel, [ns_blob], overwrite=True)
        # a health check that ran before the put stopped stores: until the next
        assert wait_for(lambda: tier.counters()["root_healthy"] == 1, 30)
        e = payloads(dep, ke)

        # The endpoint is a new process: the client's first puts after it came back can still fail (the CI run at
        # 754930c under vLLM 0.33: all three of ke missed, no new warning inside the minute's rate limit). Stores
        # resuming is what must hold, so a store that failed is made again (keys in the primary are not re-stored).
        def served_again() -> bool:
            dep.evict_primary()
            dep.store(e)
            dep.evict_primary()
            return dep.load(ke) == e
        assert wait_for(served_again, 60), tier.counters()
        st = open_store(url)
        # (the namespace file is not a block: not listed) RGW keeps the objects stored before its restart, moto none
        kept = len(ka) + len(kb) + len(kc) if s3_env.keeps_objects else 0
        assert len(list(st.list())) == kept + len(ke)
        assert all(isinstance(st.read_header(x.relpath), K.BlockHeader) for x in st.list())
