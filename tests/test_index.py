"""The tier's LRU index stays exact under every race it meets: real threads, real files, events (no sleeps).

Each test is named after one race of issue 11. The store used here is a real LocalStore with gates
(threading.Events) at the point where the race happens, so each interleaving is forced, not hoped for.
"""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

import kvformat as K
from kvformat.format._block import encode_block
from kvformat.cache import _scan
from kvformat.cache._config import TierConfig
from kvformat.cache._lru import LRUIndex
from kvformat.cache._rows import EXISTS, FAILED, WRITTEN, RowEngine
from kvformat.format._spec import Provenance
from kvformat.storage._base import StoreEntry
from kvformat.storage._local import LocalStore

LAYOUT = K.CanonicalLayout.uniform("test/index", "bfloat16", ["l0"], 16, 64)  # 2,048-byte payloads
STRIDE = 4096
CHUNKS = 8
WAIT = 30.0  # an Event that is never set fails the test instead of hanging it


def must(ev: threading.Event) -> None:
    assert ev.wait(WAIT), "the other thread never reached its gate"


class GatedStore(LocalStore):
    """A LocalStore that can stop a delete, a listing, a put or a missed read at a gate until the test opens it."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.hold_delete: str | None = None  # relpath whose delete waits for open_delete
        self.deleting = threading.Event()
        self.open_delete = threading.Event()
        self.list_gate_after: int | None = None  # list() waits for open_list after this many entries
        self.listed = threading.Event()
        self.open_list = threading.Event()
        self.list_before: threading.Event | None = None  # list() waits for this before listing anything
        self.put_refused = threading.Event()  # set when a put finds its file already there
        self.hold_put: str | None = None  # relpath whose put, once published, waits for open_put
        self.published = threading.Event()
        self.open_put = threading.Event()
        self.hold_read: str | None = None  # relpath whose read waits for open_read before it starts
        self.reading = threading.Event()
        self.open_read = threading.Event()
        self.hold_miss: str | None = None  # relpath whose read, once it found no file, waits for open_miss
        self.missed = threading.Event()
        self.open_miss = threading.Event()

    def delete(self, relpath: str) -> bool:
        if relpath == self.hold_delete:
            self.deleting.set()
            must(self.open_delete)
        return super().delete(relpath)

    def put(self, relpath: str, parts: list[Any], *, overwrite: bool = False, fsync: bool = False) -> bool:
        wrote = super().put(relpath, parts, overwrite=overwrite, fsync=fsync)
        if not wrote:
            self.put_refused.set()
        elif relpath == self.hold_put:
            self.published.set()
            must(self.open_put)
        return wrote

    def read_into(self, relpath: str, out: Any, **kw: Any) -> Any:
        if relpath == self.hold_read:
            self.reading.set()
            must(self.open_read)
        try:
            return super().read_into(relpath, out, **kw)
        except FileNotFoundError:
            if relpath == self.hold_miss:
                self.missed.set()
                must(self.open_miss)
            raise

    def list(self, prefix: str = "") -> Iterator[StoreEntry]:
        if self.list_before is not None:
            must(self.list_before)
        for n, e in enumerate(super().list(prefix)):
            if n == self.list_gate_after:
                self.listed.set()
                must(self.open_list)
            yield e
        if self.list_gate_after is not None and not self.listed.is_set():
            self.listed.set()  # fewer entries than the gate: stop at the end of the listing
            must(self.open_list)


def file_bytes() -> int:
    hdr, data, _ = encode_block(bytes(LAYOUT.payload_bytes), LAYOUT, K.BlockKey("ab" * 32))
    return len(hdr) + len(data)


def engine(root: Path, max_files: int | None, store: LocalStore | None = None,
           removed: list[str] | None = None) -> RowEngine:
    flat = memoryview(bytearray(STRIDE * CHUNKS))
    cfg = TierConfig.parse(str(root))
    index = LRUIndex(max_files * file_bytes() if max_files else None)
    return RowEngine(store or LocalStore(str(root)), LAYOUT, flat, STRIDE, 1, cfg, Provenance(), index,
                     (removed if removed is not None else []).extend)


def h(i: int) -> str:
    return f"{i:064x}"


def fill(eng: RowEngine, chunk: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(LAYOUT.payload_bytes)
    eng.flat[chunk * STRIDE:chunk * STRIDE + len(data)] = data
    return data


def on_disk(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*.kvf") if ".quarantine" not in p.parts}


def assert_exact(eng: RowEngine, root: Path) -> None:
    """The index holds exactly the files under the root, with their sizes, and nothing is doomed."""
    files = on_disk(root)
    assert sorted(eng.index.lru_order()) == sorted(files)
    assert {r: eng.index.size_of(r) for r in files} == files
    assert eng.index.used == sum(files.values())
    assert eng.index.doomed() == 0 and eng.index.reserved == 0


def run_thread(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


# -- a load racing a store's eviction --------------------------------------------------------------
def test_race_load_does_not_readd_file_a_store_is_evicting(tmp_path):
    store = GatedStore(str(tmp_path))
    eng = engine(tmp_path, 1, store)
    fill(eng, 0, 1)
    assert eng.store_chunk(h(1), 0)[0] == WRITTEN
    victim = eng.relpath(h(1))
    store.hold_delete = victim
    fill(eng, 1, 2)
    t, out = run_thread(eng.store_chunk, h(2), 1)  # evicts h(1); its delete waits at the gate
    must(store.deleting)
    eng.flat[2 * STRIDE:3 * STRIDE] = bytes(STRIDE)
    got = eng.load_chunk(h(1), 2)  # the file is still there: the load reads it (valid bytes) …
    assert got is not None
    assert victim not in eng.index  # … but must not index a file that is being deleted
    store.open_delete.set()
    t.join(WAIT)
    assert out == [(WRITTEN, file_bytes())]
    assert not (tmp_path / victim).exists()
    assert_exact(eng, tmp_path)


def test_race_probe_does_not_readd_file_a_store_is_evicting(tmp_path):
    store = GatedStore(str(tmp_path))
    eng = engine(tmp_path, 1, store)
    fill(eng, 0, 1)
    eng.store_chunk(h(1), 0)
    victim = eng.relpath(h(1))
    store.hold_delete = victim
    fill(eng, 1, 2)
    t, _ = run_thread(eng.store_chunk, h(2), 1)
    must(store.deleting)
    assert eng.probe_many([h(1)]) == [False]  # the header is still readable; the file is going
    store.open_delete.set()
    t.join(WAIT)
    assert_exact(eng, tmp_path)


def test_race_store_of_a_file_being_evicted_rewrites_it(tmp_path):
    # store A evicts X (delete held); store B of X finds X still there: it must not index the dying file
    # as EXISTS (a ghost once A deletes it) but wait for the delete and write X afresh
    store = GatedStore(str(tmp_path))
    eng = engine(tmp_path, 1, store)
    fill(eng, 0, 1)
    eng.store_chunk(h(1), 0)
    x = eng.relpath(h(1))
    store.hold_delete = x
    fill(eng, 1, 2)
    a, out_a = run_thread(eng.store_chunk, h(2), 1)
    must(store.deleting)
    store.hold_delete = None
    b, out_b = run_thread(eng.store_chunk, h(1), 0)
    must(store.put_refused)  # B found X on disk (A has not deleted it yet)
    store.open_delete.set()
    a.join(WAIT)
    b.join(WAIT)
    # B wrote X afresh (never EXISTS for the dying file). Which of X and h(2) survives the 1-file bound depends
    # on whose add comes last (an add evicts past the bound); either way the index is exactly the disk.
    assert out_a[0][0] == WRITTEN and out_b[0][0] == WRITTEN
    assert (tmp_path / x).exists() == (x in eng.index)
    assert_exact(eng, tmp_path)  # one file, the bound holds


# -- a store's file between its publication and the store's own add --------------------------------
def test_race_load_of_a_just_published_file_does_not_index_it_for_an_eviction(tmp_path):
    # store A publishes X and is preempted before indexing it; a load reads X. Had the load indexed X, a
    # store of Y could evict (delete) X before A's add, which would then index a file that is gone (the
    # CI failure: the index held a file an eviction had deleted). X is A's to index.
    store = GatedStore(str(tmp_path))
    eng = engine(tmp_path, 2, store)
    fill(eng, 0, 1)
    assert eng.store_chunk(h(1), 0)[0] == WRITTEN
    x = eng.relpath(h(3))
    store.hold_put = x
    fill(eng, 1, 3)
    a, out_a = run_thread(eng.store_chunk, h(3), 1)
    must(store.published)  # X is on disk, A has not indexed it
    store.hold_put = None
    eng.flat[2 * STRIDE:3 * STRIDE] = bytes(STRIDE)
    assert eng.load_chunk(h(3), 2) is not None  # a hit: the bytes are there
    assert x not in eng.index
    fill(eng, 3, 4)
    assert eng.store_chunk(h(4), 3)[0] == WRITTEN  # evicts h(1), never X
    assert (tmp_path / x).exists()
    store.open_put.set()
    a.join(WAIT)
    assert out_a == [(WRITTEN, file_bytes())]
    assert set(on_disk(tmp_path)) == {x, eng.relpath(h(4))}
    assert_exact(eng, tmp_path)


def test_race_scan_does_not_index_a_file_its_store_has_not_indexed_yet(tmp_path):
    # the scan lists X while X's store is between publishing and indexing it: indexed by the scan (cold,
    # the first victim), X would be evicted by the scan's own bound check and then indexed by its store
    store = GatedStore(str(tmp_path))
    eng = engine(tmp_path, 1, store)
    x = eng.relpath(h(1))
    store.hold_put = x
    fill(eng, 0, 1)
    a, out_a = run_thread(eng.store_chunk, h(1), 0)
    must(store.published)
    store.list_gate_after = 10**9  # stop at the end of the listing, before the scan indexes its batch
    stop = threading.Event()
    scan = threading.Thread(target=eng.scan, args=(stop,), daemon=True)
    scan.start()
    must(store.listed)  # the scan has listed X
    store.open_list.set()
    scan.join(WAIT)
    assert x not in eng.index and (tmp_path / x).exists()
    store.open_put.set()
    a.join(WAIT)
    assert out_a == [(WRITTEN, file_bytes())]
    assert_exact(eng, tmp_path)


def test_race_load_miss_does_not_unindex_a_file_stored_after_its_read(tmp_path):
    # a load finds no X; before it forgets X, a store writes and indexes X: the load's stale miss must not
    # drop the new file's entry (a file on disk the index does not count: the other half of the CI failure)
    store = GatedStore(str(tmp_path))
    eng = engine(tmp_path, 2, store)
    x = eng.relpath(h(4))
    store.hold_miss = x
    t, out = run_thread(eng.load_chunk, h(4), 0)
    must(store.missed)
    fill(eng, 1, 4)
    assert eng.store_chunk(h(4), 1)[0] == WRITTEN
    store.open_miss.set()
    t.join(WAIT)
    assert out == [None]
    assert x in eng.index
    assert_exact(eng, tmp_path)


# -- the bound once the writes and loads that held it off are over -----------------------------------
def test_race_concurrent_stores_leave_the_index_within_its_bound(tmp_path):
    # a 1-file tier, two stores at once: neither finds an indexed file to evict when it reserves (the
    # other's file is not indexed yet), so the second one to be indexed must evict the first
    store = GatedStore(str(tmp_path))
    eng = engine(tmp_path, 1, store)
    x = eng.relpath(h(1))
    store.hold_put = x
    fill(eng, 0, 1)
    a, out_a = run_thread(eng.store_chunk, h(1), 0)
    must(store.published)
    fill(eng, 1, 2)
    assert eng.store_chunk(h(2), 1)[0] == WRITTEN  # reserved room no indexed file could give back
    store.open_put.set()
    a.join(WAIT)
    assert out_a == [(WRITTEN, file_bytes())]
    assert set(on_disk(tmp_path)) == {x}  # h(2) was indexed first: the least recently used
    assert_exact(eng, tmp_path)
    assert eng.index.used <= file_bytes()


def test_race_load_pin_defers_an_eviction_to_its_unpin(tmp_path):
    # a store finds the only victim pinned by a load: the bound is exceeded while the load reads, and
    # the load's unpin evicts (no later write is needed to restore it)
    store = GatedStore(str(tmp_path))
    eng = engine(tmp_path, 1, store)
    fill(eng, 0, 1)
    assert eng.store_chunk(h(1), 0)[0] == WRITTEN
    x = eng.relpath(h(1))
    store.hold_read = x
    t, out = run_thread(eng.load_chunk, h(1), 2)
    must(store.reading)  # pinned
    fill(eng, 1, 2)
    assert eng.store_chunk(h(2), 1)[0] == WRITTEN
    assert len(on_disk(tmp_path)) == 2  # the documented slack: a pinned file the bound could not evict
    store.open_read.set()
    t.join(WAIT)
    assert out == [file_bytes()]
    assert set(on_disk(tmp_path)) == {x}  # the load made h(1) the most recently used: h(2) goes
    assert_exact(eng, tmp_path)
    assert eng.index.used <= file_bytes()


def test_a_pin_is_not_refused_for_a_removal_made_before_it():
    idx = LRUIndex(max_bytes=None)
    idx.add("x", 10)
    old = idx.pin("x")
    idx.remove("x")
    new = idx.pin("x")  # the first pin is still held: the removal must count for it only
    assert not idx.add_found("x", 10, old)
    assert idx.add_found("x", 10, new) and idx.used == 10
    idx.unpin("x")
    idx.unpin("x")


# -- evictions during the start-up scan ---------------------------------------------------------------
def test_race_eviction_during_scan_is_not_resurrected(tmp_path):
    # the scan lists X (written by a store meanwhile); a store then evicts X; the scan's batch must not
    # bring X back when it is indexed
    store = GatedStore(str(tmp_path))
    removed: list[str] = []
    eng = engine(tmp_path, 1, store, removed)
    store.list_before = threading.Event()
    store.list_gate_after = 10**9  # stop at the end of the listing, before the scan indexes its batch
    stop = threading.Event()
    scan = threading.Thread(target=eng.scan, args=(stop,), daemon=True)
    scan.start()
    fill(eng, 0, 1)
    assert eng.store_chunk(h(1), 0)[0] == WRITTEN
    x = eng.relpath(h(1))
    store.list_before.set()
    must(store.listed)  # the scan has listed X (in its unindexed batch)
    fill(eng, 1, 2)
    assert eng.store_chunk(h(2), 1)[0] == WRITTEN  # evicts X
    assert removed == [x] and not (tmp_path / x).exists()
    store.open_list.set()
    scan.join(WAIT)
    assert x not in eng.index
    assert_exact(eng, tmp_path)


def test_race_bound_holds_while_the_scan_runs(tmp_path, monkeypatch):
    # six old files, max_bytes = three: stores during the scan must evict what the scan has indexed
    monkeypatch.setattr(_scan, "SCAN_BATCH", 2)
    seed = engine(tmp_path, None)
    for i in range(6):
        fill(seed, 0, 100 + i)
        seed.store_chunk(h(100 + i), 0)
    for i, rel in enumerate(sorted(on_disk(tmp_path))):
        os.utime(tmp_path / rel, (1_000_000 + i, 1_000_000 + i))
    store = GatedStore(str(tmp_path))
    store.list_gate_after = 4  # two batches indexed, two files not yet listed
    eng = engine(tmp_path, 3, store)
    stop = threading.Event()
    scan = threading.Thread(target=eng.scan, args=(stop,), daemon=True)
    scan.start()
    must(store.listed)
    one = file_bytes()
    # the exact slack while the scan runs: the files it has not indexed yet (here 2)
    assert eng.index.used <= 3 * one and len(on_disk(tmp_path)) == 3 + 2
    for i in range(3):
        fill(eng, 1, 200 + i)
        assert eng.store_chunk(h(200 + i), 1)[0] == WRITTEN
        files = on_disk(tmp_path)
        assert eng.index.used <= 3 * one
        assert sum(files.values()) <= 3 * one + 2 * one
    store.open_list.set()
    scan.join(WAIT)
    assert sum(on_disk(tmp_path).values()) <= 3 * one  # the scan's last batch evicted the rest
    assert {eng.relpath(h(200 + i)) for i in range(3)} == set(on_disk(tmp_path))  # new files outlive old
    assert_exact(eng, tmp_path)


def test_scan_merges_old_files_oldest_first_and_a_touch_makes_them_recent():
    idx = LRUIndex(max_bytes=400)
    idx.begin_scan()
    assert idx.scan_add([("c", 100, 3.0), ("a", 100, 1.0), ("b", 100, 2.0)]) == 3
    idx.add("new", 100)
    assert idx.lru_order() == ["a", "b", "c", "new"]
    assert idx.touch("a") and idx.lru_order() == ["b", "c", "new", "a"]
    assert idx.reserve(100) == [("b", 100)]  # cold files go first, oldest mtime first
    idx.forget(["b"])
    idx.end_scan()
    assert idx.used == 300 and idx.reserved == 100


def test_a_victim_deleted_during_a_scan_is_not_brought_back_by_its_listing():
    """The shared evictor dooms a victim and deletes it ticks later; a periodic listing that began in between saw
    the file. Before, forget() did not count as a removal for the scan and the listing indexed a file no longer on
    storage: a ghost that the evictor's own lookups then hit (a load found its file gone)."""
    idx = LRUIndex(max_bytes=200)
    idx.add("a", 100)
    idx.add("b", 100)
    assert idx.victims(limit=100) == [("a", 100)]  # doomed before the scan begins
    idx.begin_scan()
    listed = [("a", 100, 1.0), ("b", 100, 2.0)]  # the listing still sees "a"
    idx.forget(["a"])  # deleted while the scan runs
    assert idx.scan_add(listed) == 0
    idx.end_scan()
    assert "a" not in idx and idx.used == 100


def test_add_found_refuses_a_file_removed_while_pinned():
    idx = LRUIndex(max_bytes=None)
    idx.add("x", 10)
    idx.pin("x")
    idx.remove("x")  # quarantined or missing while a probe read its header
    assert not idx.add_found("x", 10) and "x" not in idx
    idx.unpin("x")
    idx.pin("x")  # a fresh pin after the removal: the file found now is a new one
    assert idx.add_found("x", 10) and idx.used == 10
    idx.unpin("x")


# -- the whole engine under concurrent stores and loads --------------------------------------------
@pytest.mark.parametrize("max_files", [2, 5])
def test_index_is_exact_after_concurrent_stores_loads_and_probes(tmp_path, max_files):
    eng = engine(tmp_path, max_files)
    stop = threading.Event()
    scan = threading.Thread(target=eng.scan, args=(stop,), daemon=True)
    scan.start()
    errors: list[BaseException] = []

    def worker(wid: int) -> None:
        rnd = random.Random(wid)
        try:
            for _ in range(60):
                i = rnd.randrange(8)
                chunk = wid  # one row per worker: rows are the caller's, never shared by two jobs
                op = rnd.random()
                if op < 0.5:
                    fill(eng, chunk, i)
                    # FAILED only if the file churned STORE_ATTEMPTS times under this store (2-file cache)
                    assert eng.store_chunk(h(i), chunk)[0] in (WRITTEN, EXISTS, FAILED)
                elif op < 0.9:
                    got = eng.load_chunk(h(i), chunk)
                    if got is not None:
                        want = random.Random(i).randbytes(LAYOUT.payload_bytes)
                        assert bytes(eng.flat[chunk * STRIDE:chunk * STRIDE + len(want)]) == want
                else:
                    eng.probe_many([h(i), h(rnd.randrange(8))])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    scan.join(WAIT)
    assert not errors, errors
    assert_exact(eng, tmp_path)
    assert eng.index.used <= max_files * file_bytes()


# -- touches are off the load's path ------------------------------------------------------------------
class SlowTouchStore(LocalStore):
    """A LocalStore whose touch waits for ``open`` (a remote copy_object that takes its time)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.open = threading.Event()
        self.touching = threading.Event()
        self.touched: list[str] = []

    def touch(self, relpath: str) -> None:
        self.touching.set()
        must(self.open)
        super().touch(relpath)
        self.touched.append(relpath)


def test_load_does_not_wait_for_the_mtime_touch(tmp_path):
    store = SlowTouchStore(str(tmp_path))
    eng = engine(tmp_path, None, store)
    want = fill(eng, 0, 7)
    eng.store_chunk(h(7), 0)
    rel = eng.relpath(h(7))
    os.utime(tmp_path / rel, (1_000_000, 1_000_000))
    eng._mtimes[rel] = 0.0  # last touched long ago: this load refreshes the mtime
    eng.flat[STRIDE:2 * STRIDE] = bytes(STRIDE)
    assert eng.load_chunk(h(7), 1) is not None  # returns while the touch waits at its gate
    assert bytes(eng.flat[STRIDE:STRIDE + len(want)]) == want
    must(store.touching)
    assert (tmp_path / rel).stat().st_mtime == 1_000_000
    store.open.set()
    eng.toucher.flush()
    assert store.touched == [rel] and (tmp_path / rel).stat().st_mtime > 1_000_000


def test_touches_are_batched_and_skip_evicted_files(tmp_path):
    store = SlowTouchStore(str(tmp_path))
    eng = engine(tmp_path, None, store)
    for i in range(3):
        fill(eng, 0, i)
        eng.store_chunk(h(i), 0)
    rels = [eng.relpath(h(i)) for i in range(3)]
    assert eng.toucher.submit(rels[0])
    must(store.touching)  # the worker is inside the first touch; the next ones wait as one batch
    for r in rels[1:] + rels[1:]:
        eng.toucher.submit(r)
    eng.index.remove(rels[2])  # gone before its touch runs: not touched
    store.open.set()
    eng.toucher.flush()
    assert store.touched == rels[:2]
