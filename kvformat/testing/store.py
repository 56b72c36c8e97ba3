"""The Store conformance suite: one contract, every backend (zarr's ``testing/store.py`` pattern).

A backend's test module subclasses :class:`StoreTests` and provides the ``store`` fixture. The suite
corrupts and inspects stored files through ``raw_read``/``raw_write``/``raw_exists``, which bypass the
store, so a store that reads back what it wrote wrongly cannot hide it behind its own write path.
They reach local roots through :meth:`Store.local_path` and fsspec-backed ones through
:meth:`Store.fsspec_location`; a third-party backend with neither overrides the three methods of the same
names on its subclass.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .. import format as _format
from ..format import TMP_PREFIX, BlockKey, CanonicalLayout, block_relpath, encode_header, xxh3_hex
from ..errors import (
    ChecksumError, CodecError, KVFormatError, LayoutMismatchError, TagMismatchError, TruncatedError, UnknownKeyError,
)
from ..storage import Store

MODEL = "deepseek-ai/DeepSeek-V2-Lite"
SENTINEL = 0x07


def layout(n_layers: int = 3, name_len: int = 0) -> CanonicalLayout:
    """A small MLA layout (16-token blocks, 576-wide bf16 latents); long names give a long header."""
    pad = "x" * name_len
    names = [f"model.layers.{i}.self_attn.attn{pad}" for i in range(n_layers)]
    return CanonicalLayout.uniform(MODEL, "bfloat16", names,
                                   16, 576)


def payload(L: CanonicalLayout, seed: int) -> np.ndarray:
    """A deterministic random payload for ``L``."""
    return np.random.default_rng(seed).integers(0, 256, L.payload_bytes, dtype=np.uint8)


def key(i: int) -> BlockKey:
    """A deterministic block key."""
    return BlockKey(hashlib.sha256(str(i).encode()).hexdigest())


def _fsspec_path(store: Store, relpath: str) -> tuple[Any, str]:
    where = store.fsspec_location(relpath)
    if where is None:
        raise TypeError(f"no raw access to {type(store).__name__}: override raw_read/raw_write/raw_exists")
    return where


def raw_read(store: Store, relpath: str) -> bytes:
    """The stored bytes of ``relpath``, read past the store (its caches and read path)."""
    if store.is_local:
        return (Path(store.root) / relpath).read_bytes()
    fs, p = _fsspec_path(store, relpath)
    return bytes(fs.cat_file(p))


def raw_write(store: Store, relpath: str, data: bytes) -> None:
    """Replace the stored bytes of ``relpath`` past the store (and drop its cached answers)."""
    if store.is_local:
        f = Path(store.root) / relpath
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
        return
    fs, p = _fsspec_path(store, relpath)
    fs.pipe_file(p, data)
    store.forget()


def raw_exists(store: Store, relpath: str) -> bool:
    """Whether ``relpath`` is stored, asked past the store."""
    if store.is_local:
        return (Path(store.root) / relpath).is_file()
    fs, p = _fsspec_path(store, relpath)
    try:
        fs.invalidate_cache()
    except Exception:  # some filesystems keep no listings cache
        pass
    return bool(fs.exists(p))


class StoreTests:
    """The contract every backend keeps. Subclasses provide the ``store`` fixture."""

    mtime_step = 0.02  # sleep between writes so mtimes differ (S3's LastModified has 1 s resolution)
    exclusive_create = True  # concurrent ``put(overwrite=False)`` of one path: exactly one writer wins

    @pytest.fixture
    def store(self) -> Store:
        raise NotImplementedError("a StoreTests subclass provides the store fixture")

    # bypass helpers: a third-party backend overrides these three
    def raw_read(self, store: Store, relpath: str) -> bytes:
        return raw_read(store, relpath)

    def raw_write(self, store: Store, relpath: str, data: bytes) -> None:
        raw_write(store, relpath, data)

    def raw_exists(self, store: Store, relpath: str) -> bool:
        return raw_exists(store, relpath)

    def test_put_block_roundtrip(self, store: Store) -> None:
        L, pay = layout(), payload(layout(), 1)
        rel, n, wrote = store.put_block(pay, L, key(1))
        assert wrote and rel == block_relpath(L, key(1)) and store.exists(rel)
        assert self.raw_read(store, rel)[store.read_header(rel).data_offset:] == pay.tobytes()  # as stored
        out = bytearray(L.payload_bytes)
        hdr = store.read_into(rel, out, expect=L, key=key(1))
        assert bytes(out) == pay.tobytes() and hdr.file_bytes == n and hdr.key == key(1)
        assert store.read_header(rel) == hdr
        assert store.read_bytes(rel) == self.raw_read(store, rel) and len(store.read_bytes(rel)) == n

    def test_no_overwrite_keeps_first(self, store: Store) -> None:
        L = layout()
        rel, _, first = store.put_block(payload(L, 1), L, key(2))
        _, _, second = store.put_block(payload(L, 2), L, key(2))
        assert first and not second
        out = bytearray(L.payload_bytes)
        store.read_into(rel, out)
        assert bytes(out) == payload(L, 1).tobytes()
        assert store.put(rel, [b"replaced"], overwrite=True)
        assert self.raw_read(store, rel) == b"replaced"

    def test_concurrent_create(self, store: Store) -> None:
        L = layout()
        rel = block_relpath(L, key(3))
        hdrs = [_format.encode(payload(L, s), L, key(3)) for s in range(6)]
        won: list[bool] = []
        go = threading.Barrier(len(hdrs))

        def writer(parts: tuple[Any, ...]) -> None:
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
        out = bytearray([SENTINEL]) * L.payload_bytes
        with pytest.raises(LayoutMismatchError) as e:
            store.read_into(rel, out, key=key(5))
        assert e.value.field == "key" and e.value.path and rel in e.value.path
        with pytest.raises(LayoutMismatchError):
            store.read_into(rel, out, expect=layout(n_layers=4))
        with pytest.raises(LayoutMismatchError) as e:
            store.read_into(rel, bytearray(L.payload_bytes - 1))  # too small: refused, nothing written
        assert e.value.field == "payload_bytes"
        assert out == bytearray([SENTINEL]) * L.payload_bytes  # untouched

    @pytest.mark.parametrize("codec", ["none", "zstd"])
    @pytest.mark.parametrize("verify", [True, False])
    def test_zero_on_failure(self, store: Store, codec: str, verify: bool) -> None:
        """F-5.5 on this backend: a failure after the header checks zeroes exactly out[:payload_bytes]."""
        L = layout()
        rel, _, _ = store.put_block(payload(L, 6), L, key(6), codec=codec)
        good = self.raw_read(store, rel)
        hdr = store.read_header(rel)
        raw = bytearray(good)
        raw[-100] ^= 0x01  # in the data section
        self.raw_write(store, rel, bytes(raw))
        out = bytearray([SENTINEL]) * (L.payload_bytes + 512)
        if verify:
            with pytest.raises(ChecksumError) as e:
                store.read_into(rel, out, expect=L, key=key(6), verify=verify)
            assert e.value.region == "data"
            assert out == bytes(L.payload_bytes) + bytes([SENTINEL]) * 512
        elif codec == "none":  # verify off reads the bytes as they are
            store.read_into(rel, out, verify=False)
            assert out[L.payload_bytes - 100] == payload(L, 6)[-100] ^ 0x01
        # A zstd frame cut short (checksums recomputed, so only the decoder can notice): partly decoded
        # bytes must not stay behind, with verify on or off.
        if codec == "zstd":
            frame = good[hdr.data_offset:]
            cut = frame[:len(frame) // 2]
            header = encode_header(L, key(6), hdr.provenance, codec="zstd", data_bytes=len(cut),
                                           data_xxh3=xxh3_hex(cut), raw_xxh3=hdr.raw_xxh3, level=hdr.level)
            self.raw_write(store, rel, header + cut)
            out = bytearray([SENTINEL]) * (L.payload_bytes + 512)
            with pytest.raises(CodecError):
                store.read_into(rel, out, expect=L, key=key(6), verify=verify)
            assert out == bytes(L.payload_bytes) + bytes([SENTINEL]) * 512

    @pytest.mark.parametrize("level", ["authenticate", "encrypt"])
    def test_sealed(self, store: Store, level: str) -> None:
        """Spec §12 on this backend: a sealed block round-trips with its key; without it nothing is delivered;
        bytes altered with the checksums recomputed (what anyone can do) fail the tag and are zeroed."""
        from ..format import Keyring

        keys = Keyring.of([hashlib.sha256(b"store-tests seal key").digest()])
        L = layout().with_seal(level)
        pay = payload(L, 8)
        rel, _, wrote = store.put_block(pay, L, key(8), keys=keys)
        assert wrote and rel == block_relpath(L, key(8))
        stored = self.raw_read(store, rel)
        hdr = store.read_header(rel)  # no key needed for the header
        assert hdr.seal is not None and hdr.seal.key_id == keys.write_key.key_id
        assert (stored[hdr.data_offset:] == pay.tobytes()) == (level == "authenticate")
        out = bytearray(L.payload_bytes)
        assert store.read_into(rel, out, expect=L, key=key(8), keys=keys) == hdr and bytes(out) == pay.tobytes()
        out = bytearray([SENTINEL]) * L.payload_bytes
        with pytest.raises(UnknownKeyError):
            store.read_into(rel, out, expect=L, key=key(8))
        assert out == bytearray([SENTINEL]) * L.payload_bytes  # F-12.5: untouched
        raw = bytearray(stored)
        raw[-100] ^= 0x01
        d = raw.index(b'"kvf.dxxh3":"') + 13
        raw[d:d + 16] = xxh3_hex(bytes(raw[hdr.data_offset:])).encode()
        h = raw.index(b'"kvf.hxxh3":"') + 13
        raw[h:h + 16] = b"0" * 16
        raw[h:h + 16] = xxh3_hex(bytes(raw[:hdr.data_offset])).encode()
        self.raw_write(store, rel, bytes(raw))
        with pytest.raises(TagMismatchError):
            store.read_into(rel, out, expect=L, key=key(8), keys=keys, verify=False)
        assert out == bytes(L.payload_bytes)  # F-12.6 with F-5.5: zeroed

    def test_truncated_and_garbage(self, store: Store) -> None:
        L = layout()
        rel, _, _ = store.put_block(payload(L, 7), L, key(7))
        raw = self.raw_read(store, rel)
        self.raw_write(store, rel, raw[:-10])
        out = bytearray([SENTINEL]) * L.payload_bytes
        with pytest.raises(TruncatedError):
            store.read_into(rel, out)
        assert out == bytearray([SENTINEL]) * L.payload_bytes  # the file length is checked before reading
        with pytest.raises(TruncatedError):
            store.read_header(rel)
        self.raw_write(store, rel, b"not a kvformat file at all, just bytes")
        with pytest.raises(KVFormatError):
            store.read_into(rel, bytearray(L.payload_bytes))
        with pytest.raises(KVFormatError):
            store.read_header(rel)
        assert store.read_headers_many([rel]) and isinstance(store.read_headers_many([rel])[0], KVFormatError)

    def test_long_header(self, store: Store) -> None:
        L = layout(n_layers=60, name_len=120)  # header region > 8 KiB: a second (ranged) read
        rel, n, _ = store.put_block(payload(L, 8), L, key(8))
        hdr = store.read_header(rel)
        assert hdr.data_offset > 8192 and hdr.file_bytes == n and len(hdr.layout.layers) == 60
        out = bytearray(L.payload_bytes)
        store.read_into(rel, out, expect=L)
        assert bytes(out) == payload(L, 8).tobytes()

    def test_read_many_into(self, store: Store) -> None:
        L = layout()
        rels = [store.put_block(payload(L, 20 + i), L, key(20 + i))[0] for i in range(3)]
        raw = bytearray(self.raw_read(store, rels[1]))
        raw[-1] ^= 0xFF
        self.raw_write(store, rels[1], bytes(raw))
        missing = block_relpath(L, key(29))
        outs = [bytearray([SENTINEL]) * L.payload_bytes for _ in range(4)]
        res = store.read_many_into([(r, o, key(20 + i)) for i, (r, o) in enumerate(zip(rels + [missing], outs))],
                                   expect=L)
        assert [type(r).__name__ for r in res] == ["BlockHeader", "ChecksumError", "BlockHeader", "FileNotFoundError"]
        assert bytes(outs[0]) == payload(L, 20).tobytes() and bytes(outs[2]) == payload(L, 22).tobytes()
        assert not any(outs[1]) and outs[3] == bytearray([SENTINEL]) * L.payload_bytes

    def test_missing(self, store: Store) -> None:
        rel = block_relpath(layout(), key(9))
        assert not store.exists(rel) and not store.delete(rel)
        for call in (lambda: store.read_into(rel, bytearray(10)), lambda: store.read_header(rel),
                     lambda: store.read_bytes(rel)):
            with pytest.raises(FileNotFoundError):
                call()
        assert store.quarantine(rel, "ChecksumError") is None
        store.touch(rel)  # no error, and nothing created
        assert not store.exists(rel) and not self.raw_exists(store, rel)

    def test_path_outside_root_refused(self, store: Store) -> None:
        for bad in ("../escape.kvf", "/abs.kvf", "a/../../b.kvf", ""):
            with pytest.raises(ValueError):
                store.put(bad, [b"x"])
            with pytest.raises(ValueError):
                store.read_header(bad)

    def test_list_delete_exists_many(self, store: Store) -> None:
        L = layout()
        rels = [store.put_block(payload(L, i), L, key(100 + i))[0] for i in range(5)]
        store.put(f"{L.namespace()}/aa/bb/{TMP_PREFIX}123-abc", [b"temp"])
        store.put(f"{L.namespace()}/notes.txt", [b"not a block"])
        entries = {e.relpath: e for e in store.list()}
        assert set(entries) == set(rels)
        assert all(e.size == len(self.raw_read(store, e.relpath)) and e.mtime > 0 for e in entries.values())
        assert {e.relpath for e in store.list(rels[0].rsplit("/", 1)[0])} == {rels[0]}
        assert store.delete(rels[0]) and not store.delete(rels[0]) and not self.raw_exists(store, rels[0])
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
        before = self.raw_read(store, rel)
        moved = store.quarantine(rel, "ChecksumError")
        assert moved == f".quarantine/{rel}.ChecksumError"
        assert not self.raw_exists(store, rel) and self.raw_read(store, moved) == before  # moved, intact
        assert not store.exists(rel) and store.exists(moved)
        assert rel not in {e.relpath for e in store.list()} and not list(store.list())
        assert store.read_header(moved).key == key(13)  # kept for inspection

    def test_quarantine_moves_only_the_file_read(self, store: Store) -> None:
        """G-5.5: a read's error names the file read; its quarantine leaves a file written there since."""
        L = layout()
        rel = store.put_block(payload(L, 14), L, key(14))[0]
        good = self.raw_read(store, rel)
        bad = bytearray(good)
        bad[-1] ^= 1
        self.raw_write(store, rel, bytes(bad))
        with pytest.raises(ChecksumError) as ei:
            store.read_into(rel, bytearray(L.payload_bytes), expect=L)
        assert ei.value.file_id is not None
        time.sleep(self.mtime_step)
        self.raw_write(store, rel, good)  # written afresh since the read (another writer)
        moved = f".quarantine/{rel}.ChecksumError"
        q = store.quarantine_read(rel, ei.value)
        assert (q.outcome, q.relpath) == ("replaced", None)
        assert self.raw_read(store, rel) == good and not self.raw_exists(store, moved)
        self.raw_write(store, rel, bytes(bad))
        with pytest.raises(ChecksumError) as ei:
            store.read_into(rel, bytearray(L.payload_bytes), expect=L)
        q = store.quarantine_read(rel, ei.value)
        assert (q.outcome, q.relpath) == ("moved", moved)
        assert not self.raw_exists(store, rel) and self.raw_read(store, moved) == bytes(bad)
        assert store.quarantine_read(rel, ei.value).outcome == "gone"

    def test_namespaces_and_cleanup_temp(self, store: Store) -> None:
        L = layout()
        assert store.namespaces() == []
        ns = store.ensure_namespace(L)
        assert ns == L.namespace() and store.namespaces() == [ns]
        assert b'"identity"' in self.raw_read(store, f"{ns}/namespace.json")
        tmp = f"{ns}/ab/cd/{TMP_PREFIX}999-dead"
        self.raw_write(store, tmp, b"left by a crashed writer")
        assert store.cleanup_temp(older_than_s=3600) == 0 and self.raw_exists(store, tmp)
        assert store.cleanup_temp(older_than_s=0) == 1 and not self.raw_exists(store, tmp)

    def test_list_dir_and_probe(self, store: Store) -> None:
        # The small control directories of a shared root (cache/shared/) and the start-up probe of a tier.
        from ..storage import probe_store

        assert store.list_dir(".kvformat/engines") == []
        store.put(".kvformat/engines/a.json", [b"{}"], overwrite=True)
        store.put(".kvformat/engines/a.json", [b'{"beat": 2}'], overwrite=True)  # rewritten whole
        assert store.put(".kvformat/engines/b.json", [b"{}"], overwrite=False)
        assert not store.put(".kvformat/engines/b.json", [b"{}"], overwrite=False)  # exclusive create
        self.raw_write(store, f".kvformat/engines/{TMP_PREFIX}1-x", b"a writer's temp")
        got = sorted(store.list_dir(".kvformat/engines"), key=lambda e: e.relpath)
        assert [(e.relpath, e.size) for e in got] == [(".kvformat/engines/a.json", 11), (".kvformat/engines/b.json", 2)]
        assert store.read_bytes(".kvformat/engines/a.json") == b'{"beat": 2}'
        assert probe_store(store) is None and store.list_dir(".kvformat/probe") == []

    def test_close(self, store: Store) -> None:
        L = layout()
        rel = store.put_block(payload(L, 14), L, key(14))[0]
        with store:
            assert store.read_header(rel).key == key(14)
        assert store.closed
        store.close()  # idempotent
        with pytest.raises(ValueError, match="closed"):
            store.read_header(rel)
        with pytest.raises(ValueError, match="closed"):
            store.put_block(payload(L, 15), L, key(15))


__all__ = ["StoreTests", "raw_read", "raw_write", "raw_exists", "layout", "payload", "key"]
