"""One conformance suite for the Store interface, run against every backend.

``StoreTests`` holds the tests; each backend subclass only says how to open a fresh, empty store
(local directory, ``memory://`` with single-PUT writes, ``memory://`` with temp+move writes, and
``s3://`` on a real moto S3 server on 127.0.0.1).
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid

import numpy as np
import pytest

import kvformat as K
from kvformat._io import TMP_PREFIX
from kvformat._spec import block_relpath
from kvformat.errors import ChecksumError, KVFormatError, LayoutMismatchError, TruncatedError
from kvformat.storage import LocalStore, Store, open_store
from kvformat.storage._fsspec import FsspecStore
from s3_server import s3_bucket, s3_env, s3_server  # noqa: F401  (fixtures)

MODEL = "deepseek-ai/DeepSeek-V2-Lite"


def layout(n_layers: int = 3, name_len: int = 0) -> K.CanonicalLayout:
    pad = "x" * name_len
    return K.CanonicalLayout.uniform(MODEL, "bfloat16", [f"model.layers.{i}.self_attn.attn{pad}" for i in range(n_layers)],
                                     16, 576)


def payload(L: K.CanonicalLayout, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, L.payload_bytes, dtype=np.uint8)


def key(i: int) -> K.BlockKey:
    return K.BlockKey(hashlib.sha256(str(i).encode()).hexdigest())


class StoreTests:
    """The contract every backend keeps. Subclasses provide the ``store`` fixture."""

    mtime_step = 0.02  # sleep between writes so mtimes differ (S3's LastModified has 1 s resolution)
    exclusive_create = True  # concurrent ``put(overwrite=False)`` of one path: exactly one writer wins

    @pytest.fixture
    def store(self) -> Store:
        raise NotImplementedError

    def test_put_block_roundtrip(self, store: Store) -> None:
        L, pay = layout(), payload(layout(), 1)
        rel, n, wrote = store.put_block(pay, L, key(1))
        assert wrote and rel == block_relpath(L, key(1)) and store.exists(rel)
        out = bytearray(L.payload_bytes)
        hdr = store.read_into(rel, out, expect=L, key=key(1))
        assert bytes(out) == pay.tobytes() and hdr.file_bytes == n and hdr.key == key(1)
        assert store.read_header(rel) == hdr
        assert len(store.read_bytes(rel)) == n

    def test_no_overwrite_keeps_first(self, store: Store) -> None:
        L = layout()
        rel, _, first = store.put_block(payload(L, 1), L, key(2))
        _, _, second = store.put_block(payload(L, 2), L, key(2))
        assert first and not second
        out = bytearray(L.payload_bytes)
        store.read_into(rel, out)
        assert bytes(out) == payload(L, 1).tobytes()
        assert store.put(rel, [b"replaced"], overwrite=True)
        assert store.read_bytes(rel) == b"replaced"

    def test_concurrent_create(self, store: Store) -> None:
        L = layout()
        rel = block_relpath(L, key(3))
        hdrs = [K.encode(payload(L, s), L, key(3)) for s in range(6)]
        won: list[bool] = []
        go = threading.Barrier(len(hdrs))

        def writer(parts: tuple) -> None:
            go.wait()
            won.append(store.put(rel, list(parts)))

        ts = [threading.Thread(target=writer, args=(h,)) for h in hdrs]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert sum(won) == 1 if self.exclusive_create else sum(won) >= 1
        hdr = store.read_into(rel, bytearray(L.payload_bytes), key=key(3))  # one whole file, never a mix
        assert hdr.key == key(3)

    def test_expect_and_key_checked_before_out(self, store: Store) -> None:
        L = layout()
        rel, _, _ = store.put_block(payload(L, 4), L, key(4))
        out = bytearray(b"\x07" * L.payload_bytes)
        with pytest.raises(LayoutMismatchError) as e:
            store.read_into(rel, out, key=key(5))
        assert e.value.field == "key" and e.value.path and rel in e.value.path
        with pytest.raises(LayoutMismatchError):
            store.read_into(rel, out, expect=layout(n_layers=4))
        assert out == bytearray(b"\x07" * L.payload_bytes)  # untouched

    def test_checksum_failure_zeroes_out(self, store: Store) -> None:
        L = layout()
        rel, _, _ = store.put_block(payload(L, 6), L, key(6))
        raw = bytearray(store.read_bytes(rel))
        raw[-100] ^= 0x01
        store.put(rel, [raw], overwrite=True)
        out = bytearray(b"\x07" * L.payload_bytes)
        with pytest.raises(ChecksumError) as e:
            store.read_into(rel, out, expect=L, key=key(6))
        assert e.value.region == "data" and not any(out)
        store.read_into(rel, out, verify=False)  # verify=False reads the bytes as they are
        assert out[-100 + len(out)] == payload(L, 6)[-100] ^ 0x01

    def test_truncated_and_garbage(self, store: Store) -> None:
        L = layout()
        rel, _, _ = store.put_block(payload(L, 7), L, key(7))
        raw = store.read_bytes(rel)
        store.put(rel, [raw[:-10]], overwrite=True)
        with pytest.raises(TruncatedError):
            store.read_into(rel, bytearray(L.payload_bytes))
        with pytest.raises(TruncatedError):
            store.read_header(rel)
        store.put(rel, [b"not a kvformat file at all, just bytes"], overwrite=True)
        with pytest.raises(KVFormatError):
            store.read_into(rel, bytearray(L.payload_bytes))
        with pytest.raises(KVFormatError):
            store.read_header(rel)

    def test_long_header(self, store: Store) -> None:
        L = layout(n_layers=60, name_len=120)  # header region > 8 KiB: a second (ranged) read
        rel, n, _ = store.put_block(payload(L, 8), L, key(8))
        hdr = store.read_header(rel)
        assert hdr.data_offset > 8192 and hdr.file_bytes == n and len(hdr.layout.layers) == 60
        out = bytearray(L.payload_bytes)
        store.read_into(rel, out, expect=L)
        assert bytes(out) == payload(L, 8).tobytes()

    def test_missing(self, store: Store) -> None:
        rel = block_relpath(layout(), key(9))
        assert not store.exists(rel) and not store.delete(rel)
        for call in (lambda: store.read_into(rel, bytearray(10)), lambda: store.read_header(rel),
                     lambda: store.read_bytes(rel)):
            with pytest.raises(FileNotFoundError):
                call()
        assert store.quarantine(rel, "ChecksumError") is None
        store.touch(rel)  # no error, and nothing created
        assert not store.exists(rel)

    def test_path_outside_root_refused(self, store: Store) -> None:
        with pytest.raises(ValueError):
            store.put("../escape.kvf", [b"x"])

    def test_list_delete_exists_many(self, store: Store) -> None:
        L = layout()
        rels = [store.put_block(payload(L, i), L, key(100 + i))[0] for i in range(5)]
        store.put(f"{L.namespace()}/aa/bb/{TMP_PREFIX}123-abc", [b"temp"])
        store.put(f"{L.namespace()}/notes.txt", [b"not a block"])
        entries = {e.relpath: e for e in store.list()}
        assert set(entries) == set(rels)
        assert all(e.size == store.read_header(e.relpath).file_bytes and e.mtime > 0 for e in entries.values())
        assert {e.relpath for e in store.list(rels[0].rsplit("/", 1)[0])} == {rels[0]}
        assert store.delete(rels[0]) and not store.delete(rels[0])
        missing = block_relpath(L, key(999))
        assert store.exists_many(rels + [missing]) == [False, True, True, True, True, False]
        assert {e.relpath for e in store.list()} == set(rels[1:])

    def test_touch_moves_to_newest(self, store: Store) -> None:
        L = layout()
        a = store.put_block(payload(L, 1), L, key(11))[0]
        time.sleep(self.mtime_step)
        b = store.put_block(payload(L, 2), L, key(12))[0]
        time.sleep(self.mtime_step)
        m = {e.relpath: e.mtime for e in store.list()}
        assert m[a] < m[b]
        store.touch(a)
        m = {e.relpath: e.mtime for e in store.list()}
        assert m[a] > m[b]
        out = bytearray(L.payload_bytes)
        store.read_into(a, out, key=key(11))  # touching keeps the bytes
        assert bytes(out) == payload(L, 1).tobytes()

    def test_quarantine(self, store: Store) -> None:
        L = layout()
        rel = store.put_block(payload(L, 13), L, key(13))[0]
        moved = store.quarantine(rel, "ChecksumError")
        assert moved == f".quarantine/{rel}.ChecksumError"
        assert not store.exists(rel) and store.exists(moved)
        assert rel not in {e.relpath for e in store.list()} and not list(store.list())
        assert store.read_header(moved).key == key(13)  # kept for inspection, intact

    def test_namespaces_and_cleanup_temp(self, store: Store) -> None:
        L = layout()
        assert store.namespaces() == []
        ns = store.ensure_namespace(L)
        assert ns == L.namespace() and store.namespaces() == [ns]
        assert b'"identity"' in store.read_bytes(f"{ns}/namespace.json")
        tmp = f"{ns}/ab/cd/{TMP_PREFIX}999-dead"
        store.put(tmp, [b"left by a crashed writer"])
        assert store.cleanup_temp(older_than_s=3600) == 0 and store.exists(tmp)
        assert store.cleanup_temp(older_than_s=0) == 1 and not store.exists(tmp)


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path) -> Store:
        s = open_store(str(tmp_path / "root"))
        assert isinstance(s, LocalStore)
        return s


class TestMemoryStore(StoreTests):

    @pytest.fixture
    def store(self) -> Store:
        s = open_store(f"memory://kvf-{uuid.uuid4().hex[:12]}/root")
        assert isinstance(s, FsspecStore) and s.atomic_put
        return s


class TestMemoryTempMoveStore(StoreTests):
    """memory:// forced through temp object + move, the path SFTP/HDFS-like filesystems take."""

    exclusive_create = False  # check, then move: of racing writers, the last one's whole file stays

    @pytest.fixture
    def store(self) -> Store:
        s = open_store(f"memory://kvf-{uuid.uuid4().hex[:12]}/root", atomic_put=False)
        assert isinstance(s, FsspecStore) and not s.atomic_put
        return s


class TestS3Store(StoreTests):
    mtime_step = 1.1

    @pytest.fixture
    def store(self, s3_bucket: str) -> Store:
        s = open_store(f"s3://{s3_bucket}/cache/root", timeout_s=20)
        assert isinstance(s, FsspecStore) and s.atomic_put and s._conditional_put
        return s
