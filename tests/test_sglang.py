"""kvformat's SGLang HiCache backend through SGLang 0.5.23's real classes (tests/sglang_harness.py): its dynamic
backend loader, storage config, MLA host pool in all three host layouts and its page key function.

Expected bytes come from SGLang: pages as its ``get_data_page`` returns them, and the bytes its own built-in
file backend (``HiCacheFile``) writes for a page.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

sglang_harness = pytest.importorskip("sglang_harness", reason="SGLang is installed by tools/setup.sh")

from sglang.srt.mem_cache.device_pool_info import MLABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import storage_namespace_seed  # noqa: E402
from sglang_harness import LAYOUTS, MODEL, PAGE, attach, fill, host_pool, page_keys, pages  # noqa: E402
from s3_server import s3_bucket, s3_env, s3_server  # noqa: E402,F401
from tmpfs_mount import tmpfs  # noqa: E402

import kvformat as K  # noqa: E402
from kvformat.cache._keyscheme import page_chain  # noqa: E402
from kvformat.errors import SchemaError  # noqa: E402
from kvformat.sglang import KVFormatHiCache  # noqa: E402


def _files(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                  if f.endswith(".kvf") and ".quarantine" not in d)


def test_page_chain_is_sglangs_key_function() -> None:
    """The token-chain key vLLM's tier computes equals SGLang's own page keys (its JIT-built C++ hash): plain,
    seeded by a cache salt / LoRA extra key, and with a token id above u32 (SGLang's wide form)."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 150_000, (5 * PAGE + 17,), generator=g).tolist()
    assert page_chain(tokens, PAGE) == page_keys(tokens)[:5]  # SGLang also hashes the partial tail page
    seed = storage_namespace_seed("lora-7", "salt")
    assert seed is not None
    assert page_chain(tokens, PAGE, prior=seed) == page_keys(tokens, prior=seed)[:5]
    assert page_chain(tokens, PAGE, prior=seed) != page_chain(tokens, PAGE)
    wide = tokens[:2 * PAGE]
    wide[PAGE + 3] = (1 << 32) + 5
    assert page_chain(wide, PAGE) == page_keys(wide)
    # Extending a chain computed earlier gives the same keys as computing it whole.
    head = page_chain(tokens[:2 * PAGE], PAGE)
    assert page_chain(tokens, PAGE, start_page=2, out=head) == page_keys(tokens)[:5]


@pytest.mark.parametrize("writer", LAYOUTS)
def test_every_host_layout_reads_every_other(writer: str, tmp_path) -> None:
    """A page stored from one host layout loads into each of the three, per layer and token the same latents;
    the file's tensors are the page's [layer][token][latent], exactly the bytes SGLang's own file backend writes
    for a ``layer_first`` / ``page_first_direct`` page."""
    root = str(tmp_path / "kv")
    wpool = host_pool(writer)
    idx = fill(wpool, 3, seed=1)
    keys = page_keys(list(range(100, 100 + 3 * PAGE)))
    w = attach(wpool, root)
    try:
        assert w.batch_set_v1(keys, idx) == [True, True, True]
        assert len(_files(root)) == 3
        assert w.batch_set_v1(keys, idx) == [True, True, True]  # already stored: nothing rewritten
        assert w.counters()["files_written"] == 3
    finally:
        w.close()
    want = pages(wpool, idx)
    # SGLang's built-in file backend, on a layout whose page is already layer-major, writes the payload bytes.
    ref_pool = host_pool("page_first_direct")
    ridx = fill(ref_pool, 3, seed=1)
    ref = HiCacheFile(sglang_harness.storage_config(ref_pool, {"file_storage_path": str(tmp_path / "hf")}))
    for k, s in zip(keys, ridx[::PAGE].tolist()):
        assert ref.set(k, ref_pool.get_data_page(s))
    for k, p in zip(keys, want):
        f = next(f for f in _files(root) if os.path.basename(f) == f"{k}.kvf")
        raw = open(os.path.join(tmp_path / "hf", f"{k}_{MODEL.replace('/', '-')}.bin"), "rb").read()
        hdr = K.read_header(f)
        assert hdr.provenance.writer.endswith(f"(sglang {writer})")
        payload = bytearray(hdr.raw_bytes)
        K.read_into(f, payload)
        assert payload == raw
        tensors = K.load_file(f)
        assert torch.equal(torch.stack([t[0] for t in tensors.values()]), p)
    for reader in LAYOUTS:
        rpool = host_pool(reader)
        rpool.alloc(2 * PAGE)  # other pages first: the reader's host indices differ from the writer's
        ridx = rpool.alloc(3 * PAGE)
        r = attach(rpool, root, tp=8, rank=5)
        try:
            assert r.batch_exists(keys) == 3
            assert r.batch_get_v1(keys, ridx) == [True, True, True]
            for a, b in zip(pages(rpool, ridx), want):
                assert torch.equal(a, b), (writer, reader)
        finally:
            r.close()


def test_tp8_group_writes_each_page_once_tp1_reads(tmp_path) -> None:
    """Eight TP ranks over one root: only SGLang's storage writer (rank 0) writes, so each page is one file
    (SGLang's file backend keys MLA pages per model only, but each rank of another backend might write its
    own); the other ranks report the page stored; a TP=1 deployment reads every page."""
    root = str(tmp_path)
    keys = page_keys(list(range(7, 7 + 4 * PAGE)))
    ranks = []
    try:
        for rank in range(8):
            pool = host_pool("page_first")
            idx = fill(pool, 4, seed=3)
            ranks.append((attach(pool, root, tp=8, rank=rank), idx))
        readers_first = [b.batch_set_v1(keys, i) for b, i in ranks[1:]]
        assert readers_first == [[False] * 4] * 7  # nothing stored yet, and a non-writer writes nothing
        assert _files(root) == []
        assert ranks[0][0].batch_set_v1(keys, ranks[0][1]) == [True] * 4
        assert [b.batch_set_v1(keys, i) for b, i in ranks[1:]] == [[True] * 4] * 7
        assert len(_files(root)) == 4
        assert sum(b.counters()["files_written"] for b, _ in ranks) == 4
        want = pages(ranks[0][0].mem_pool_host, ranks[0][1])
    finally:
        for b, _ in ranks:
            b.close()
    pool = host_pool("layer_first")
    idx = pool.alloc(4 * PAGE)
    r = attach(pool, root, tp=1)
    try:
        assert r.batch_get_v1(keys, idx) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(pages(pool, idx), want))
    finally:
        r.close()


def test_corrupt_file_is_a_miss_quarantined_and_never_reaches_the_pool(tmp_path, caplog) -> None:
    root = str(tmp_path)
    wpool = host_pool("page_first")
    idx = fill(wpool, 3, seed=4)
    keys = page_keys(list(range(3 * PAGE)))
    w = attach(wpool, root)
    assert w.batch_set_v1(keys, idx) == [True] * 3
    w.close()
    bad = next(f for f in _files(root) if os.path.basename(f) == f"{keys[1]}.kvf")
    with open(bad, "r+b") as f:
        f.seek(os.path.getsize(bad) - 1000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    for layout in ("page_first", "page_first_direct"):  # a strided copy and a read straight into the pool
        rpool = host_pool(layout)
        ridx = rpool.alloc(3 * PAGE)
        r = attach(rpool, root, tp=2, rank=1)
        try:
            got = r.batch_get_v1(keys, ridx)
            c = r.counters()
        finally:
            r.close()
        if layout == "page_first":
            assert got == [True, False, True]
            assert c["checksum_failures"] == 1 and c["quarantined:ChecksumError"] == 1
            assert not os.path.exists(bad)
        else:
            assert got == [True, False, True]  # quarantined by the first reader: gone, a plain miss
            assert c["missing_files"] == 1
        miss = pages(rpool, ridx)[1]
        assert not miss.any(), "a page whose file failed must not hold its bytes"
    assert "ChecksumError" in caplog.text
    moved = [f for d, _, fs in os.walk(tmp_path / ".quarantine") for f in fs]
    assert moved and moved[0].startswith(f"{keys[1]}.kvf")


def test_dtype_and_revision_are_identity_33268(tmp_path) -> None:
    """SGLang's keys omit the KV dtype (sglang #33268): its file backend serves a bf16 page to an fp8 reader.
    kvformat's namespace holds the dtype and the revision, so either change is a miss."""
    root = str(tmp_path / "kv")
    wpool = host_pool("page_first_direct")
    idx = fill(wpool, 2, seed=5)
    keys = page_keys(list(range(50, 50 + 2 * PAGE)))
    w = attach(wpool, root, model_revision="rev-a")
    assert w.batch_set_v1(keys, idx) == [True, True]
    w.close()
    fp8 = host_pool("page_first_direct", dtype=torch.uint8)
    # SGLang's own file backend: the fp8 deployment finds the bf16 deployment's pages under the same keys.
    hf_dir = str(tmp_path / "hf")
    hf = HiCacheFile(sglang_harness.storage_config(wpool, {"file_storage_path": hf_dir}))
    for k, s in zip(keys, idx[::PAGE].tolist()):
        hf.set(k, wpool.get_data_page(s))
    hf8 = HiCacheFile(sglang_harness.storage_config(fp8, {"file_storage_path": hf_dir}))
    assert hf8.batch_exists(keys) == 2
    with pytest.raises(SchemaError, match="fp8"):  # an fp8 pool without its dtype is refused, not guessed
        attach(fp8, root)
    for kw in ({"kv_cache_dtype": "fp8_e4m3", "model_revision": "rev-a"}, {"model_revision": "rev-b"}, {}):
        pool = fp8 if "kv_cache_dtype" in kw else host_pool("page_first_direct")
        r = attach(pool, root, **kw)
        try:
            assert r.batch_exists(keys) == 0, kw
            assert r.batch_get_v1(keys, pool.alloc(2 * PAGE)) == [False, False]
        finally:
            r.close()
    r = attach(host_pool("layer_first"), root, model_revision="rev-a")
    try:
        assert r.batch_exists(keys) == 2
    finally:
        r.close()


@pytest.mark.parametrize("fp8", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_round_trip_across_layouts(tmp_path, fp8: str) -> None:
    """An fp8 cache (SGLang's host pool holds it as uint8): stored from ``page_first`` with its configured fp8
    dtype, recorded as that dtype in the file, read back into a ``layer_first`` pool byte for byte; the other
    fp8 dtype is another namespace (a miss)."""
    root = str(tmp_path)
    wpool = host_pool("page_first", dtype=torch.uint8)
    idx = fill(wpool, 2, seed=14)
    keys = page_keys(list(range(900, 900 + 2 * PAGE)))
    w = attach(wpool, root, kv_cache_dtype=fp8)
    try:
        assert w.batch_set_v1(keys, idx) == [True, True]
    finally:
        w.close()
    tensors = K.load_file(_files(root)[0])
    assert {str(t.dtype) for t in tensors.values()} == {"torch.float8_e4m3fn" if fp8 == "fp8_e4m3"
                                                         else "torch.float8_e5m2"}
    rpool = host_pool("layer_first", dtype=torch.uint8)
    ridx = rpool.alloc(2 * PAGE)
    r = attach(rpool, root, tp=4, rank=3, kv_cache_dtype=fp8)
    o = attach(host_pool("layer_first", dtype=torch.uint8), root,
               kv_cache_dtype="fp8_e5m2" if fp8 == "fp8_e4m3" else "fp8_e4m3")
    try:
        assert r.batch_get_v1(keys, ridx) == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(pages(rpool, ridx), pages(wpool, idx)))
        assert o.batch_exists(keys) == 0
    finally:
        r.close()
        o.close()


def test_max_bytes_evicts_least_recent_within_the_bound(tmp_path) -> None:
    root = str(tmp_path)
    pool = host_pool("page_first", pages=8)
    idx = fill(pool, 6, seed=6)
    keys = page_keys(list(range(9, 9 + 6 * PAGE)))
    one = None
    w = attach(pool, root, max_bytes=0)
    try:
        assert w.batch_set_v1(keys[:1], idx[:PAGE]) == [True]
        one = os.path.getsize(_files(root)[0])
    finally:
        w.close()
    for f in _files(root):
        os.unlink(f)
    w = attach(pool, root, max_bytes=3 * one)
    try:
        w.wait_scanned(30)
        for i in range(6):
            assert w.batch_set_v1(keys[i:i + 1], idx[i * PAGE:(i + 1) * PAGE]) == [True]
            assert sum(os.path.getsize(f) for f in _files(root)) <= 3 * one
        c = w.counters()
        assert c["evictions"] == 3 and c["used_bytes"] == 3 * one and c["files"] == 3
        assert w.batch_exists(keys) == 0 and w.batch_exists(keys[3:]) == 3
    finally:
        w.close()


def test_refusals_by_name(tmp_path) -> None:
    root = str(tmp_path)
    pool = host_pool("page_first")
    with pytest.raises(SchemaError, match="pipeline"):
        attach(pool, root, pp=2)
    with pytest.raises(SchemaError, match="unknown parameter"):
        attach(pool, root, replica_policy="verify")
    with pytest.raises(SchemaError, match="rope"):
        attach(pool, root, key_scheme="token-chain")
    with pytest.raises(SchemaError, match="model"):
        attach(pool, root, model=None)
    with pytest.raises(SchemaError, match="interface_v1"):
        KVFormatHiCache(sglang_harness.storage_config(pool, {"root": root}))
    unified = host_pool("page_unified")
    with pytest.raises(SchemaError, match="page_unified"):
        attach(unified, root)
    # SGLang's storage config says the model is not MLA.
    with pytest.raises(SchemaError, match="MLA KV only.*is_mla_model=False"):
        sc = sglang_harness.storage_config(pool, {**sglang_harness.BACKEND, "root": root})
        sc.is_mla_model = False
        b = StorageBackendFactory.create_backend("dynamic", sc, pool)
        b.register_mem_pool_host(pool)
        b.on_host_pools_registered()
    # A sidecar host pool (DSA indexer, MTP, Mamba) registered through SGLang's v2 call.
    b = StorageBackendFactory.create_backend(
        "dynamic", sglang_harness.storage_config(pool, {**sglang_harness.BACKEND, "root": root}), pool)
    b.register_mem_pool_host(pool)
    b.register_mem_host_pool_v2(host_pool("page_first", layers=1), "indexer")
    with pytest.raises(SchemaError, match="sidecar"):
        b.on_host_pools_registered()
    # An MTP draft layer packed into the MLA host pool by SGLang's own constructor (draft_buffer_infos).
    with pytest.raises(SchemaError, match="MTP draft"):
        attach(_mla_pool(draft=True), root)
    # DSA's packed fp8 latent (656 bytes a token: fp8 latent, its scales, bf16 rope), as SGLang builds its pool.
    with pytest.raises(SchemaError, match="DSA"):
        attach(_mla_pool(dsa=True), root, kv_cache_dtype="fp8_e4m3")
    assert not _files(root)


def _mla_pool(*, draft: bool = False, dsa: bool = False) -> object:
    """SGLang's MLA host pool with an MTP draft layer packed in, or DSA's packed fp8 rows."""
    width, dtype = (656, torch.uint8) if dsa else (576, torch.bfloat16)

    def info(layers: int) -> MLABufferInfo:
        bufs = tuple(torch.zeros(8 * PAGE, 1, width, dtype=dtype) for _ in range(layers))
        return MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs]),
                             layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=PAGE,
                             kv_lora_rank=512, qk_rope_head_dim=64, kv_cache_dim=width, dtype=dtype,
                             device=torch.device("cpu"), packed_fp8=dsa)
    return MLATokenToKVPoolHost(info(4), 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
                                override_kv_cache_dim=width if dsa else None,
                                draft_buffer_infos=(info(1),) if draft else (), device_capacity_tokens=8 * PAGE,
                                start_layer=0, end_layer=4, target_layer_num=4)


def test_token_chain_namespace_differs_and_pins_rope(tmp_path) -> None:
    pool = host_pool("page_first_direct")
    a = attach(pool, str(tmp_path))
    b = attach(pool, str(tmp_path), key_scheme="token-chain", rope="interleaved")
    c = attach(pool, str(tmp_path), key_scheme="token-chain", rope="neox")
    try:
        spaces = {x.layout.namespace() for x in (a, b, c)}
        assert len(spaces) == 3
        assert b.layout.pins["rope"] == "interleaved" and "key_scheme" in b.layout.pins
    finally:
        for x in (a, b, c):
            x.close()


def test_stats_clear_and_legacy_calls(tmp_path) -> None:
    """SGLang's metrics and operations: ``get_stats`` returns SGLang's own ``StorageMetrics`` (pages per batch,
    drained by each call), ``clear`` (``/clear_hicache_storage_backend``) deletes the writer's namespace and
    nothing else, a non-writer rank's ``clear`` deletes nothing, and the legacy per-page calls are refused."""
    from sglang.srt.observability.metrics_collector import StorageMetrics

    root = str(tmp_path)
    pool = host_pool("page_first")
    idx = fill(pool, 3, seed=13)
    keys = page_keys(list(range(700, 700 + 3 * PAGE)))
    other = attach(pool, root, model_revision="other")
    w = attach(pool, root)
    rpool = host_pool("layer_first")
    r = attach(rpool, root, tp=2, rank=1)
    try:
        assert other.batch_set_v1(keys[:1], idx[:PAGE]) == [True]
        assert w.batch_set_v1(keys, idx) == [True] * 3
        stats = w.get_stats()
        assert isinstance(stats, StorageMetrics)
        assert stats.backup_pgs == [3] and len(stats.backup_bandwidth) == 1 and stats.prefetch_pgs == []
        assert w.get_stats().backup_pgs == []  # drained
        assert r.batch_get_v1(keys[:2], rpool.alloc(2 * PAGE)) == [True, True]
        assert r.get_stats().prefetch_pgs == [2]
        assert len(_files(root)) == 4
        r.clear()  # a reader rank: nothing deleted
        assert len(_files(root)) == 4
        w.clear()
        assert w.batch_exists(keys) == 0
        # Another rank learns of the deletion at its next read of the page: a miss (the host page is not
        # filled), after which it no longer reports the page stored.
        before = pages(rpool, ridx := rpool.alloc(2 * PAGE))
        assert r.batch_get_v1(keys[:2], ridx) == [False, False]
        assert all(torch.equal(a, b) for a, b in zip(pages(rpool, ridx), before))
        assert r.batch_exists(keys) == 0 and r.counters()["missing_files"] == 2
        assert len(_files(root)) == 1 and other.batch_exists(keys[:1]) == 1  # another namespace: kept
        with pytest.raises(SchemaError, match="interface_v1"):
            w.get(keys[0])
        with pytest.raises(SchemaError, match="interface_v1"):
            w.batch_set(keys, [pool.get_data_page(0)])
    finally:
        for x in (other, w, r):
            x.close()


def test_s3_root_round_trip(s3_bucket: str) -> None:  # noqa: F811
    """An ``s3://`` root on a real S3 API server (moto on 127.0.0.1)."""
    url = f"s3://{s3_bucket}/kv"
    wpool = host_pool("page_first")
    idx = fill(wpool, 2, seed=8)
    keys = page_keys(list(range(300, 300 + 2 * PAGE)))
    w = attach(wpool, url, storage_options={"timeout_s": 5.0})
    try:
        assert w.batch_set_v1(keys, idx) == [True, True]
    finally:
        w.close()
    rpool = host_pool("layer_first")
    ridx = rpool.alloc(2 * PAGE)
    r = attach(rpool, url, tp=4, rank=2, storage_options={"timeout_s": 5.0})
    try:
        assert r.batch_exists(keys) == 2
        assert r.batch_get_v1(keys, ridx) == [True, True]
        assert all(torch.equal(x, y) for x, y in zip(pages(rpool, ridx), pages(wpool, idx)))
    finally:
        r.close()


def test_cli_inspect_verify_gc_on_an_sglang_root(tmp_path) -> None:
    root = str(tmp_path)
    pool = host_pool("page_first")
    idx = fill(pool, 2, seed=9)
    w = attach(pool, root)
    try:
        assert w.batch_set_v1(page_keys(list(range(2 * PAGE))), idx) == [True, True]
    finally:
        w.close()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvformat.cli", *args], capture_output=True, text=True,
                              timeout=120)

    out = cli("inspect", root, "--json")
    assert out.returncode == 0, out.stderr
    assert '"files": 2' in out.stdout.replace(" ", "").replace('"files":2', '"files": 2'), out.stdout
    assert cli("verify", root).returncode == 0
    out = cli("gc", root, "--max-bytes", "1")
    assert out.returncode == 0, out.stderr
    assert len(_files(root)) <= 1



@pytest.mark.parametrize("layout", LAYOUTS)
def test_compact_sglang_file_backend_pages(tmp_path, layout: str, capsys) -> None:
    """Pages SGLang's built-in file backend wrote (raw, in the writer's host layout) become kvformat files that
    kvformat's backend serves to a deployment of another layout; files that are not a whole MLA page of the given
    geometry are skipped by reason."""
    from kvformat.cli import main

    src, dst = str(tmp_path / "hicache"), str(tmp_path / "kv")
    pool = host_pool(layout)
    idx = fill(pool, 3, seed=12)
    keys = page_keys(list(range(500, 500 + 3 * PAGE)))
    hf = HiCacheFile(sglang_harness.storage_config(pool, {"file_storage_path": src}))
    for k, s in zip(keys, idx[::PAGE].tolist()):
        assert hf.set(k, pool.get_data_page(s))
    # A TP-sharded (non-MLA) writer's page and a truncated page: not converted.
    suffix = MODEL.replace("/", "-")
    with open(os.path.join(src, f"{'ab' * 32}_{suffix}_0_2.bin"), "wb") as f:
        f.write(b"\0" * 10)
    with open(os.path.join(src, f"{'cd' * 32}_{suffix}.bin"), "wb") as f:
        f.write(b"\0" * 10)
    argv = ["compact", src, dst, "--from", "sglang", "--model", MODEL, "--layers", "4", "--page-size", str(PAGE),
            "--host-layout", layout, "--json"]
    assert main(argv) == 1  # some files skipped
    rep = __import__("json").loads(capsys.readouterr().out)
    assert (rep["seen"], rep["written"], sum(rep["skipped"].values())) == (5, 3, 2)
    assert main(argv) == 1 and __import__("json").loads(capsys.readouterr().out)["existed"] == 3
    rpool = host_pool("page_first" if layout != "page_first" else "layer_first")
    ridx = rpool.alloc(3 * PAGE)
    r = attach(rpool, dst, tp=4, rank=1)
    try:
        assert r.layout.namespace() == rep["namespace"]
        assert r.batch_get_v1(keys, ridx) == [True] * 3
        assert all(torch.equal(a, b) for a, b in zip(pages(rpool, ridx), pages(pool, idx)))
    finally:
        r.close()


def test_compact_sglang_deletes_only_the_inode_it_converted(tmp_path, monkeypatch) -> None:
    """Issue 31 item 3: ``--delete-source`` removes a page only if its name still holds the inode that was read
    and converted. A page swapped by someone else between the conversion and the delete (another file under the
    same name) is never deleted: it was never converted. A symlinked page is neither read nor deleted, and its
    target outside the tree is untouched."""
    from kvformat.sglang import _filetree

    src, dst = str(tmp_path / "hicache"), str(tmp_path / "kv")
    pool = host_pool("layer_first")
    idx = fill(pool, 3, seed=13)
    keys = page_keys(list(range(700, 700 + 3 * PAGE)))
    hf = HiCacheFile(sglang_harness.storage_config(pool, {"file_storage_path": src}))
    for k, s in zip(keys, idx[::PAGE].tolist()):
        assert hf.set(k, pool.get_data_page(s))
    names = sorted(n for n in os.listdir(src) if n.endswith(".bin"))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(open(os.path.join(src, names[0]), "rb").read())
    link = os.path.join(src, f"{'ef' * 32}_{MODEL.replace('/', '-')}.bin")
    os.symlink(outside, link)
    swapped = os.path.join(src, names[1])
    real_open = _filetree.open_store

    def open_store(root: str):  # the co-tenant swaps one page right after kvformat stored it
        store = real_open(root)
        put = store.put_block

        def put_block(payload, layout, key, **kw):
            out = put(payload, layout, key, **kw)
            if os.path.basename(swapped).startswith(key.hash):
                with open(swapped + ".tmp", "wb") as f:  # a new inode, as a writer that renames into place makes
                    f.write(b"someone else's page")
                os.replace(swapped + ".tmp", swapped)
            return out
        monkeypatch.setattr(store, "put_block", put_block)
        return store
    monkeypatch.setattr(_filetree, "open_store", open_store)
    rep = _filetree.compact_sglang(src, dst, model=MODEL, n_layers=4, page_tokens=PAGE, host_layout="layer_first",
                                   delete_source=True)
    assert (rep.seen, rep.written, rep.deleted) == (3, 3, 2)
    assert open(swapped, "rb").read() == b"someone else's page"  # kept
    assert os.path.islink(link) and outside.read_bytes() == open(link, "rb").read()  # untouched


def test_sealed_pages_round_trip_and_stay_apart_from_clear_ones(tmp_path) -> None:
    """The SGLang backend takes the tier's seal parameters: its files are sealed (spec §12) in a namespace of their
    own; a rank with the key loads SGLang's pages back exactly, a clear deployment never sees them."""
    root = str(tmp_path / "kv")
    keyfile = tmp_path / "seal.key"
    keyfile.write_text(os.urandom(32).hex())
    keyfile.chmod(0o600)
    wpool = host_pool("page_first_direct")
    idx = fill(wpool, 2, seed=11)
    keys = page_keys(list(range(500, 500 + 2 * PAGE)))
    w = attach(wpool, root, seal="encrypt", seal_key=str(keyfile))
    try:
        assert w.batch_set_v1(keys, idx) == [True, True]
    finally:
        w.close()
    files = _files(root)
    assert len(files) == 2 and all(K.read_header(f).seal is not None for f in files)
    want = pages(wpool, idx)
    for reader in LAYOUTS:
        rpool = host_pool(reader)
        ridx = rpool.alloc(2 * PAGE)
        r = attach(rpool, root, tp=2, rank=1, seal="encrypt", seal_key=str(keyfile))
        try:
            assert r.batch_get_v1(keys, ridx) == [True, True]
            for a, b in zip(pages(rpool, ridx), want):
                assert torch.equal(a, b), reader
        finally:
            r.close()
    clear = attach(host_pool("layer_first"), root)
    try:
        assert clear.batch_exists(keys) == 0
    finally:
        clear.close()


def test_writer_rank_refuses_a_read_only_root_naming_it(tmp_path) -> None:
    """The storage writer rank proves its root usable at start-up, as the vLLM tier does (the same RootOps): a
    read-only root fails SGLang's attach with an error naming ``root``, not a cache that never stores."""
    ro = tmp_path / "ro"
    if os.geteuid() == 0:
        mounted = tmpfs(ro, "ro,size=1m")
    else:
        ro.mkdir()
        ro.chmod(0o555)
        mounted = contextlib.nullcontext(str(ro))
    with mounted:
        with pytest.raises(K.errors.RootUnusableError) as e:
            attach(host_pool("layer_first"), str(ro))
        assert e.value.field == "root" and str(ro) in str(e.value)
