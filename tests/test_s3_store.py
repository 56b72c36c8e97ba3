"""S3 specifics of FsspecStore against a real S3 API server (moto, 127.0.0.1): configuration from the
environment, credentials never shown, deadlines on a hung or dead server and recovery, batched I/O,
existence caching. The Store contract itself is tested in test_storage_conformance.py.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any, Callable

import numpy as np
import pytest

import kvformat as K
from kvformat import block_relpath
from kvformat.errors import ChecksumError
from kvformat.storage import open_store
from kvformat.storage._fsspec import FsspecStore
from s3_server import ACCESS_KEY, SECRET_KEY, S3Server, s3_bucket, s3_env, s3_server  # noqa: F401

L = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                              [f"model.layers.{i}.self_attn.attn" for i in range(4)], 16, 576)


def key(i: int) -> K.BlockKey:
    return K.BlockKey(hashlib.sha256(f"s3/{i}".encode()).hexdigest())


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, L.payload_bytes, dtype=np.uint8).tobytes()


def finishes(fn: Callable[[], Any], within: float) -> Any:
    """Run ``fn`` in a thread; fail if it is still running after ``within`` s (a hang), else return/raise its outcome.

    A liveness check (the call must come back at all), not a speed target: ``within`` is several times the
    store's own deadline.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (handed back to the test)
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(within)
    assert not t.is_alive(), "the call hung past its deadline"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_configuration_from_environment(s3_bucket: str) -> None:
    st = open_store(f"s3://{s3_bucket}/env")  # endpoint and credentials only in AWS_* variables
    rel, _, wrote = st.put_block(payload(1), L, key(1))
    out = bytearray(L.payload_bytes)
    assert wrote and st.read_into(rel, out, expect=L, key=key(1)).key == key(1) and bytes(out) == payload(1)


def test_configuration_from_options(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k, raising=False)
    if s3_server.proc is None:
        s3_server.start()
    bucket = s3_server.make_bucket()
    st = open_store(f"s3://{bucket}/opts", **s3_server.storage_options())
    assert st.put_block(payload(2), L, key(2))[2]
    assert st.exists(block_relpath(L, key(2)))


def test_missing_backend_names_the_package() -> None:
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="gcsfs"):
            open_store("gs://bucket/prefix")
    else:  # the backend is installed here: nothing to report
        assert open_store("gs://bucket/prefix", token="anon") is not None


def test_credentials_never_shown(s3_env: S3Server, caplog: pytest.LogCaptureFixture) -> None:
    bucket = s3_env.make_bucket()
    caplog.set_level(logging.DEBUG)  # every logger, botocore and s3fs included
    good = open_store(f"s3://{bucket}/c", **s3_env.storage_options(), timeout_s=3)
    assert SECRET_KEY not in repr(good) and ACCESS_KEY not in str(good)
    good.put_block(payload(3), L, key(3))
    errors: list[BaseException] = []
    bad = open_store(f"s3://{bucket}/c", endpoint_url=s3_env.endpoint, key=ACCESS_KEY, secret=SECRET_KEY + "x",
                     timeout_s=10, max_retries=0)
    for call in (lambda: bad.read_bytes(block_relpath(L, key(3))), lambda: bad.put_block(payload(4), L, key(4))):
        try:
            call()
        except OSError as e:
            errors.append(e)
    userinfo = open_store("memory://someuser:hunter2secret@kvfbucket/p")
    assert "hunter2secret" not in repr(userinfo) and "***@" in repr(userinfo)
    with pytest.raises(FileNotFoundError) as nf:
        userinfo.read_bytes("ns/aa/bb/x.kvf")
    assert "hunter2secret" not in str(nf.value) and "hunter2secret" not in repr(nf.value)
    s3_env.pause()  # and the errors of a hung server
    try:
        with pytest.raises(TimeoutError) as to:
            finishes(lambda: good.read_bytes(block_relpath(L, key(3)) + ".nope"), 30)
        errors.append(to.value)
    finally:
        s3_env.resume()
    assert errors and all(isinstance(e, OSError) for e in errors)
    texts = [str(e) for e in errors] + [repr(e) for e in errors] + [r.getMessage() for r in caplog.records]
    assert not [t for t in texts if SECRET_KEY in t]
    # memory:// has no notion of userinfo (it stays in fsspec's own debug lines); ours never show it
    assert not [t for t in texts[:2 * len(errors)] if "hunter2secret" in t]
    assert not [r for r in caplog.records if r.name.startswith("kvformat") and ACCESS_KEY in r.getMessage()]


def test_hung_server_calls_end_by_deadline_then_recover(s3_env: S3Server) -> None:
    bucket = s3_env.make_bucket()
    st = open_store(f"s3://{bucket}/hang", timeout_s=3, max_retries=1)
    rel = st.put_block(payload(5), L, key(5))[0]
    assert st.exists(rel)
    st.forget()
    s3_env.pause()
    try:
        with pytest.raises(TimeoutError):
            finishes(lambda: st.put_block(payload(6), L, key(6)), 20)
        out = bytearray(b"\x01" * L.payload_bytes)
        with pytest.raises(TimeoutError):
            finishes(lambda: st.read_into(rel, out, expect=L), 20)
        assert out == bytearray(b"\x01" * L.payload_bytes)  # nothing half-read lands in out
        with pytest.raises(TimeoutError):
            finishes(lambda: st.read_header(rel), 20)
        assert finishes(lambda: st.exists_many([rel, block_relpath(L, key(6))]), 20) == [False, False]
        many = finishes(lambda: st.read_many_into([(rel, bytearray(L.payload_bytes), key(5))] * 5, timeout_s=2), 20)
        assert len(many) == 5 and all(isinstance(r, TimeoutError) for r in many)
    finally:
        s3_env.resume()
    st.forget()
    out = bytearray(L.payload_bytes)
    assert finishes(lambda: st.read_into(rel, out, expect=L, key=key(5)), 20).key == key(5)
    assert bytes(out) == payload(5)
    assert finishes(lambda: st.put_block(payload(6), L, key(6)), 20)[2]  # the timed-out PUT never landed
    assert st.stats["timeouts"] > 0


def test_dead_server_fails_fast_then_recovers(s3_env: S3Server) -> None:
    bucket = s3_env.make_bucket()
    st = open_store(f"s3://{bucket}/dead", timeout_s=5, max_retries=2)
    rel = st.put_block(payload(7), L, key(7))[0]
    s3_env.stop()
    try:
        with pytest.raises(ConnectionError):
            finishes(lambda: st.read_bytes(rel), 30)
        with pytest.raises(OSError):
            finishes(lambda: st.put_block(payload(8), L, key(8)), 30)
        assert st.stats["retries"] >= 2  # connection refused is transient: retried, within the deadline
    finally:
        s3_env.start()  # moto keeps objects in memory: the restarted server is empty
    s3_env.make_bucket(bucket)
    st.forget()
    assert finishes(lambda: st.put_block(payload(8), L, key(8)), 20)[2]  # same store object, new connections
    out = bytearray(L.payload_bytes)
    st.read_into(block_relpath(L, key(8)), out, key=key(8))
    assert bytes(out) == payload(8)


def test_batched_io_one_request_per_key(s3_bucket: str) -> None:
    st = open_store(f"s3://{s3_bucket}/batch", max_in_flight=4)
    assert isinstance(st, FsspecStore)
    items = []
    for i in range(24):
        hdr, data = K.encode(np.frombuffer(payload(i), dtype=np.uint8), L, key(i))
        items.append((block_relpath(L, key(i)), [hdr, data]))
    before = st.stats["requests"]
    assert st.put_many(items) == [True] * 24
    assert st.stats["requests"] - before == 24  # one conditional PUT each
    assert st.put_many(items[:3]) == [False] * 3
    raw = bytearray(st.read_bytes(items[5][0]))
    raw[-1] ^= 0xFF
    st.put(items[5][0], [raw], overwrite=True)
    missing = block_relpath(L, key(999))
    outs = [bytearray(b"\x02" * L.payload_bytes) for _ in range(25)]
    reqs = [(rel, o, key(i)) for i, ((rel, _), o) in enumerate(zip(items, outs))] + [(missing, outs[24], key(999))]
    before = st.stats["requests"]
    res = st.read_many_into(reqs, expect=L)
    assert st.stats["requests"] - before == 25  # one GET each: no HEAD before a read
    for i, r in enumerate(res[:24]):
        if i == 5:
            assert isinstance(r, ChecksumError) and not any(outs[5])
        else:
            assert isinstance(r, K.BlockHeader) and bytes(outs[i]) == payload(i)
    assert isinstance(res[24], FileNotFoundError)
    hs = st.read_headers_many([items[1][0], missing, items[2][0]])
    assert [type(h) for h in hs] == [K.BlockHeader, FileNotFoundError, K.BlockHeader] and hs[2].key == key(2)
    assert st.delete_many([items[0][0], missing]) == [True, False]


def test_header_read_is_ranged(s3_bucket: str) -> None:
    big = K.CanonicalLayout.uniform("m/big", "bfloat16", [f"l{i}" for i in range(27)], 16, 576, blocks_per_chunk=4)
    st = open_store(f"s3://{s3_bucket}/hdr")
    assert isinstance(st, FsspecStore)
    rel, n, _ = st.put_block(np.zeros(big.payload_bytes, dtype=np.uint8), big, key(1))
    calls: list[tuple[Any, ...]] = []
    real = st._fs._call_s3

    async def spy(method: str, *a: Any, **kw: Any) -> Any:  # records GETs, then calls the real s3fs method
        got = await real(method, *a, **kw)
        if method == "get_object":
            calls.append((kw.get("Range"), got["ContentLength"]))
        return got

    st._fs._call_s3 = spy
    hdr = st.read_header(rel)
    assert hdr.file_bytes == n > 1_900_000
    assert calls == [("bytes=0-8191", 8192)]  # the first 8 KiB only, not the 2 MB file (one GET, its ETag kept)


def test_existence_cache(s3_bucket: str) -> None:
    a = open_store(f"s3://{s3_bucket}/ex")
    b = open_store(f"s3://{s3_bucket}/ex", exists_cache_s=3600, missing_cache_s=3600)
    assert isinstance(b, FsspecStore)
    rel = a.put_block(payload(9), L, key(9))[0]
    other = block_relpath(L, key(10))
    assert b.exists_many([rel, other]) == [True, False]
    before = b.stats["requests"]
    assert b.exists_many([rel, other] * 10) == [True, False] * 10
    assert b.stats["requests"] == before  # answered from the cache: a scheduler step costs no request
    a.delete(rel)
    a.put_block(payload(10), L, key(10))
    assert b.exists(rel) and not b.exists(other)  # another host's changes: seen after forget() or the TTL
    b.forget([rel, other])
    assert not b.exists(rel) and b.exists(other)
    c = open_store(f"s3://{s3_bucket}/ex")
    assert isinstance(c, FsspecStore)
    assert c.exists_nowait([other, rel]) == [None, None]  # a background lookup is started
    deadline = time.monotonic() + 20
    while c.exists_nowait([other, rel]) != [True, False]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
