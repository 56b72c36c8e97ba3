"""The side paths of spec/GUARANTEES.md (issue 20, item 5): what the quarantine, the fused read, a bad
destination and a failed eviction leave behind. One test (or group) per defect, each forcing its race or
fault with real parts: real files and processes, gates at the point where the race happens (as in
tests/test_index.py), a real filesystem that fails reads part-way (tests/faulty_fs.py), a real immutable
file, a real S3 API server.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import struct
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, Iterable

import pytest

import kvformat as K
from kvformat.admin import scan_root
from kvformat.cache._config import TierConfig
from kvformat.cache._lru import LRUIndex
from kvformat.cache._rows import WRITTEN, RowEngine
from kvformat.cli._verify import verify_path
from kvformat.errors import ChecksumError, DestinationError, KVFormatError, LayoutMismatchError
from kvformat.format._block import encode_block
from kvformat.format._fused import read_into_fused
from kvformat.format._spec import Provenance
from kvformat.storage import open_store
from kvformat.storage._local import LocalStore
from faulty_fs import FaultyFS
from s3_server import S3Server, s3_bucket, s3_env, s3_server  # noqa: F401
from test_index import assert_exact  # the index checks the side paths share with the index tests

TESTS = os.path.dirname(os.path.abspath(__file__))
LAYOUT = K.CanonicalLayout.uniform("test/side", "bfloat16", ["l0", "l1"], 16, 64)  # 4,096-byte payloads
STRIDE = 8192
CHUNKS = 4
WAIT = 60.0


def must(ev: threading.Event) -> None:
    assert ev.wait(WAIT), "the other thread never reached its gate"


def h(i: int) -> str:
    return f"{i:064x}"


def payload(seed: int) -> bytes:
    return random.Random(seed).randbytes(LAYOUT.payload_bytes)


def file_bytes() -> int:
    hdr, data, _ = encode_block(bytes(LAYOUT.payload_bytes), LAYOUT, K.BlockKey(h(0)))
    return len(hdr) + len(data)


class GatedStore(LocalStore):
    """A LocalStore whose failed payload read, or header read, of one path stops at a gate before the
    caller sees the result: the window in which another writer replaces the file."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.hold_read: str | None = None
        self.hold_headers: str | None = None
        self.read_failed = threading.Event()
        self.headers_read = threading.Event()
        self.go = threading.Event()

    def read_into(self, relpath: str, out: Any, **kw: Any) -> Any:
        try:
            return super().read_into(relpath, out, **kw)
        except KVFormatError:
            if relpath == self.hold_read:
                self.hold_read = None
                self.read_failed.set()
                must(self.go)
            raise

    def read_headers_many(self, relpaths: Iterable[str], **kw: Any) -> Any:
        rels = list(relpaths)
        res = super().read_headers_many(rels, **kw)
        if self.hold_headers in rels:
            self.hold_headers = None
            self.headers_read.set()
            must(self.go)
        return res


def engine(root: Path | str, store: LocalStore | None = None, max_files: int | None = None,
           removed: list[str] | None = None) -> RowEngine:
    flat = memoryview(bytearray(STRIDE * CHUNKS))
    index = LRUIndex(max_files * file_bytes() if max_files else None)
    return RowEngine(store or LocalStore(str(root)), LAYOUT, flat, STRIDE, 1, TierConfig.parse(str(root)),
                     Provenance(), index, (removed if removed is not None else []).extend)


def fill(eng: RowEngine, chunk: int, data: bytes) -> None:
    eng.flat[chunk * STRIDE:chunk * STRIDE + len(data)] = data


def row(eng: RowEngine, chunk: int) -> bytes:
    return bytes(eng.flat[chunk * STRIDE:chunk * STRIDE + LAYOUT.payload_bytes])


def plant_bad_header(root: Path | str, rel: str, seed: int = 99) -> None:
    """A file at ``rel`` whose header checksum fails (one byte of the JSON changed): bad for a load, a
    store's existence check and a probe alike."""
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    K.save_file(payload(seed), path, LAYOUT, K.BlockKey(os.path.basename(rel)[:-4]))
    raw = bytearray(open(path, "rb").read())
    i = raw.index(b"test/side")
    raw[i] = ord("T")
    open(path, "wb").write(bytes(raw))


def quarantined(root: Path) -> list[str]:
    q = root / ".quarantine"
    return sorted(str(p.relative_to(q)) for p in q.rglob("*") if p.is_file()) if q.exists() else []


def holds(path: Path | str, data: bytes) -> bool:
    out = bytearray(LAYOUT.payload_bytes)
    K.read_into(path, out, expect=LAYOUT)
    return bytes(out) == data


# -- defect 1: quarantine by name moved the fresh file a concurrent store had published -------------------
def test_load_quarantine_leaves_the_fresh_file_a_concurrent_store_published(tmp_path: Path) -> None:
    store = GatedStore(str(tmp_path))
    removed: list[str] = []
    eng = engine(tmp_path, store, removed=removed)
    rel = eng.relpath(h(1))
    plant_bad_header(tmp_path, rel)
    store.hold_read = rel
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(eng.load_chunk(h(1), 1)), daemon=True)
    t.start()
    must(store.read_failed)  # the load has read the bad file and not yet quarantined it
    fresh = payload(1)
    fill(eng, 0, fresh)
    assert eng.store_chunk(h(1), 0)[0] == WRITTEN  # quarantines the bad file itself, then publishes afresh
    ctime = os.stat(tmp_path / rel).st_ctime_ns
    store.go.set()
    t.join(WAIT)
    assert out == [None]  # the load's own read was bad: a miss
    assert holds(tmp_path / rel, fresh), "the fresh file was moved into .quarantine"
    assert os.stat(tmp_path / rel).st_ctime_ns == ctime  # left alone, not even renamed and put back
    assert quarantined(tmp_path) == [f"{rel}.ChecksumError"]  # the bad file, once
    assert removed == [rel]  # the store's quarantine; the load's found the name taken and reported nothing
    assert_exact(eng, tmp_path)
    assert eng.load_chunk(h(1), 2) == file_bytes() and row(eng, 2) == fresh


def test_probe_quarantine_leaves_a_file_replaced_after_its_header_read(tmp_path: Path) -> None:
    store = GatedStore(str(tmp_path))
    eng = engine(tmp_path, store)
    rel = eng.relpath(h(2))
    plant_bad_header(tmp_path, rel)
    store.hold_headers = rel
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(eng.probe_many([h(2)])), daemon=True)
    t.start()
    must(store.headers_read)
    fresh = payload(2)
    K.save_file(fresh, tmp_path / rel, LAYOUT, K.BlockKey(h(2)))  # another process publishes over it (rename)
    ctime = os.stat(tmp_path / rel).st_ctime_ns
    store.go.set()
    t.join(WAIT)
    assert out == [[False]]  # what the probe read was bad
    assert holds(tmp_path / rel, fresh) and os.stat(tmp_path / rel).st_ctime_ns == ctime
    assert quarantined(tmp_path) == []
    assert eng.probe_many([h(2)]) == [True]
    assert_exact(eng, tmp_path)


def test_fused_load_quarantines_by_the_inode_it_read(tmp_path: Path) -> None:
    eng = engine(tmp_path)  # a plain LocalStore: the fused one-read path
    assert eng._fused
    rel = eng.relpath(h(3))
    plant_bad_header(tmp_path, rel)
    assert eng.load_chunk(h(3), 0) is None
    assert quarantined(tmp_path) == [f"{rel}.ChecksumError"] and not (tmp_path / rel).exists()
    # The error names the inode read: once the name holds another file, that file is not moved.
    plant_bad_header(tmp_path, rel)
    with pytest.raises(ChecksumError) as ei:
        read_into_fused(tmp_path / rel, bytearray(LAYOUT.payload_bytes), expect=LAYOUT)
    st = os.stat(tmp_path / rel)
    assert (ei.value.file_id.dev, ei.value.file_id.ino) == (st.st_dev, st.st_ino)
    K.save_file(payload(3), tmp_path / rel, LAYOUT, K.BlockKey(h(3)))
    q = LocalStore(str(tmp_path)).quarantine_read(rel, ei.value)
    assert q.outcome == "replaced" and q.relpath is None and holds(tmp_path / rel, payload(3))


class RenameGate(LocalStore):
    """Publishes a fresh file at the name in the window between the quarantine's check and its rename."""

    fresh: bytes = b""

    def _rename_aside(self, src: str, aside: str) -> None:
        K.save_file(self.fresh, src, LAYOUT, K.BlockKey(os.path.basename(src)[:-4]))
        super()._rename_aside(src, aside)


def test_quarantine_puts_back_a_file_published_between_its_check_and_its_rename(tmp_path: Path) -> None:
    st = RenameGate(str(tmp_path))
    rel = K.block_relpath(LAYOUT, K.BlockKey(h(4)))
    plant_bad_header(tmp_path, rel)
    with pytest.raises(ChecksumError) as ei:
        st.read_into(rel, bytearray(LAYOUT.payload_bytes), expect=LAYOUT)
    st.fresh = payload(4)
    q = st.quarantine_read(rel, ei.value)
    assert q.outcome == "replaced" and holds(tmp_path / rel, payload(4))
    assert quarantined(tmp_path) == []  # nothing moved, and the file taken aside is not left behind


# -- defect 1 between processes: a load in one process, a store of the same block in another -------------
_CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
import test_races_and_faults as t
eng = t.engine({root!r}, t.StdinGate({root!r}) if {gate!r} else None)
if {gate!r}:
    eng.store.hold_read = eng.relpath(t.h({i}))
    print(json.dumps({{"loaded": eng.load_chunk(t.h({i}), 1)}}), flush=True)
else:
    t.fill(eng, 0, t.payload({i}))
    print(json.dumps({{"stored": eng.store_chunk(t.h({i}), 0)[0]}}), flush=True)
"""


class StdinGate(LocalStore):
    """In a child process: a failed read of ``hold_read`` says so on stdout and waits for a line on stdin."""

    hold_read: str | None = None

    def read_into(self, relpath: str, out: Any, **kw: Any) -> Any:
        try:
            return super().read_into(relpath, out, **kw)
        except KVFormatError:
            if relpath == self.hold_read:
                print("read-failed", flush=True)
                sys.stdin.readline()
            raise


def test_quarantine_between_processes_moves_only_the_file_read(tmp_path: Path) -> None:
    rel = K.block_relpath(LAYOUT, K.BlockKey(h(5)))
    plant_bad_header(tmp_path, rel)
    env = dict(os.environ, PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    loader = subprocess.Popen([sys.executable, "-c", _CHILD.format(tests=TESTS, root=str(tmp_path), gate=True, i=5)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert loader.stdout is not None and loader.stdin is not None
        assert loader.stdout.readline().strip() == "read-failed"  # process A read the bad file
        storer = subprocess.run([sys.executable, "-c", _CHILD.format(tests=TESTS, root=str(tmp_path), gate=False,
                                                                     i=5)],
                                capture_output=True, text=True, env=env, timeout=WAIT)
        assert json.loads(storer.stdout.splitlines()[-1]) == {"stored": "written"}, storer.stderr  # process B
        loader.stdin.write("\n")
        loader.stdin.flush()
        assert json.loads(loader.stdout.readline()) == {"loaded": None}
        assert loader.wait(WAIT) == 0
    finally:
        loader.kill()
    assert holds(tmp_path / rel, payload(5)), "process A moved the file process B had just published"
    assert quarantined(tmp_path) == [f"{rel}.ChecksumError"]


# -- defect 1 in verify --quarantine: a file replaced between the check and the move ---------------------
class ReplaceOnLastUpdate:
    """A progress sink (verify's public hook) that, once every file is checked, has another writer replace
    one file with a fresh valid one: what a tier does after quarantining the bad file itself."""

    def __init__(self, replace: Any) -> None:
        self.replace = replace
        self.total = self.done = 0

    def add_total(self, files: int, nbytes: int) -> None:
        self.total += files

    def update(self, nbytes: int) -> None:
        self.done += 1
        if self.done == self.total:
            self.replace()


def _kv_root(root: Path, n: int) -> list[str]:
    st = LocalStore(str(root))
    st.ensure_namespace(LAYOUT)
    return [st.put_block(payload(10 + i), LAYOUT, K.BlockKey(h(10 + i)))[0] for i in range(n)]


def test_verify_quarantine_leaves_a_file_replaced_after_it_was_checked(tmp_path: Path) -> None:
    rels = _kv_root(tmp_path, 3)
    bad = tmp_path / rels[1]
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 1
    bad.write_bytes(bytes(raw))
    sink = ReplaceOnLastUpdate(lambda: K.save_file(payload(11), bad, LAYOUT, K.BlockKey(h(11))))
    rep = verify_path(str(tmp_path), quarantine=True, progress=sink)
    assert [b["reason"] for b in rep["bad"]] == ["ChecksumError"] and rep["exit_code"] == 1
    assert rep["quarantined"] == [] and quarantined(tmp_path) == []
    assert any("replaced since it was checked" in i["why"] for i in rep["ignored"])
    assert holds(bad, payload(11))
    # Unreplaced, the same bad file is moved.
    bad.write_bytes(bytes(raw))
    rep = verify_path(str(tmp_path), quarantine=True)
    assert rep["quarantined"] == [str(tmp_path / ".quarantine" / f"{rels[1]}.ChecksumError")]
    assert scan_root(str(tmp_path), verify=True).bad == []


def _remote_replace_case(url: str, corrupt: Any, replace: Any) -> None:
    st = open_store(url)
    st.ensure_namespace(LAYOUT)
    rels = [st.put_block(payload(20 + i), LAYOUT, K.BlockKey(h(20 + i)))[0] for i in range(3)]
    corrupt(st, rels[2])
    sink = ReplaceOnLastUpdate(lambda: replace(st, rels[2]))
    rep = verify_path(url, quarantine=True, progress=sink)
    assert [b["reason"] for b in rep["bad"]] == ["ChecksumError"]
    assert rep["quarantined"] == [], "the object published after the check was moved"
    assert any("replaced since it was checked" in i["why"] for i in rep["ignored"])
    out = bytearray(LAYOUT.payload_bytes)
    st.read_into(rels[2], out, expect=LAYOUT)
    assert bytes(out) == payload(22)
    corrupt(st, rels[2])  # unreplaced: moved
    rep = verify_path(url, quarantine=True)
    assert rep["quarantined"] == [f"{st.root}/.quarantine/{rels[2]}.ChecksumError"]
    assert not open_store(url).exists(rels[2])  # (st caches what it saw)


def _flip_last(st: Any, rel: str) -> None:
    raw = bytearray(st.read_bytes(rel))
    raw[-1] ^= 1
    st.put(rel, [bytes(raw)], overwrite=True)


def _republish(st: Any, rel: str) -> None:
    st.put_block(payload(22), LAYOUT, K.BlockKey(h(22)), overwrite=True)


def test_verify_on_s3_leaves_an_object_replaced_after_it_was_checked(s3_bucket: str) -> None:  # noqa: F811
    _remote_replace_case(f"s3://{s3_bucket}/cache", _flip_last, _republish)  # identity: the GET's ETag


def test_verify_on_a_remote_root_without_etags_leaves_a_replaced_object() -> None:
    _remote_replace_case(f"memory://kvf-{uuid.uuid4().hex[:12]}/cache", _flip_last, _republish)  # by content


# -- defect 2: an EIO part-way through the fused read left the file's bytes in the tier's row -------------
@pytest.fixture
def fuse_view(tmp_path: Path) -> Any:
    why = FaultyFS.mount_error()
    if why:
        pytest.skip(f"no FUSE view here: {why}")

    def view(eio_from: int) -> FaultyFS:
        return FaultyFS(str(tmp_path / "backing"), str(tmp_path / "mnt"), eio_from=eio_from)
    (tmp_path / "backing").mkdir()
    return view


def test_tier_load_that_fails_part_way_leaves_the_row_zeroed(tmp_path: Path, fuse_view: Any) -> None:
    big = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16",
                                    [f"model.layers.{i}.self_attn.attn" for i in range(61)], 64, 576)
    rel = K.block_relpath(big, K.BlockKey(h(6)))
    backing = tmp_path / "backing"
    os.makedirs(backing / os.path.dirname(rel))
    K.save_file(os.urandom(big.payload_bytes), backing / rel, big, K.BlockKey(h(6)))
    stride = big.payload_bytes
    with fuse_view(600_000) as mnt:  # EIO after ~590 KB of the payload has landed
        flat = memoryview(bytearray(b"\xa5" * stride * 2))
        eng = RowEngine(LocalStore(mnt), big, flat, stride, 1, TierConfig.parse(mnt), Provenance(), LRUIndex(None),
                        [].extend)
        assert eng._fused
        assert eng.load_chunk(h(6), 1) is None  # a miss
        assert eng.counters.values["io_errors"] == 1 and eng.counters.values["corrupt_files"] == 0
        assert not any(flat[stride:]), "unverified file bytes stayed in the primary row"
        assert all(b == 0xA5 for b in flat[:stride])  # other rows untouched
        eng.close()
    assert (backing / rel).exists()  # an I/O error is not a bad file: nothing quarantined


# -- defect 3: a destination error condemned the (good) source file ----------------------------------------
@pytest.mark.parametrize("chunk", [CHUNKS, CHUNKS + 7, -1])
def test_load_into_an_out_of_range_chunk_keeps_the_source_file(tmp_path: Path, chunk: int) -> None:
    eng = engine(tmp_path)
    data = payload(7)
    fill(eng, 0, data)
    assert eng.store_chunk(h(7), 0)[0] == WRITTEN
    rel = eng.relpath(h(7))
    before = bytes(eng.flat)
    with pytest.raises(DestinationError):
        eng.load_chunk(h(7), chunk)
    assert bytes(eng.flat) == before  # no row written (chunk -1 is not the last row)
    assert quarantined(tmp_path) == [] and holds(tmp_path / rel, data) and rel in eng.index
    assert eng.counters.values["corrupt_files"] == 0
    assert eng.load_chunk(h(7), 2) == file_bytes() and row(eng, 2) == data  # still there for every later load
    with pytest.raises(DestinationError):
        eng.store_chunk(h(8), chunk)  # nor is a store from outside the buffer written under a key
    assert eng.relpath(h(8)) not in eng.index and not (tmp_path / eng.relpath(h(8))).exists()
    assert_exact(eng, tmp_path)


@pytest.mark.parametrize("fused", [False, True])
def test_a_short_destination_is_the_callers_error_not_the_files(tmp_path: Path, fused: bool) -> None:
    st = LocalStore(str(tmp_path))
    rel = st.put_block(payload(9), LAYOUT, K.BlockKey(h(9)))[0]
    short = bytearray(LAYOUT.payload_bytes - 1)
    with pytest.raises(DestinationError) as ei:
        if fused:
            read_into_fused(tmp_path / rel, short, expect=LAYOUT)
        else:
            st.read_into(rel, short, expect=LAYOUT)
    assert not isinstance(ei.value, KVFormatError)  # no handler of bad files catches it
    assert not any(short)
    # Without an expected layout the file's declared size decides (G-1.2): a kvformat error, as before.
    with pytest.raises(LayoutMismatchError):
        st.read_into(rel, short)


# -- defect 4: an eviction whose delete failed forgot the file ---------------------------------------------
FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10


def _immutable(path: Path, on: bool) -> None:
    """chattr +i / -i: unlink then fails with EPERM, for root too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        flags = struct.unpack("l", fcntl.ioctl(fd, FS_IOC_GETFLAGS, struct.pack("l", 0)))[0]
        flags = flags | FS_IMMUTABLE_FL if on else flags & ~FS_IMMUTABLE_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("l", flags))
    finally:
        os.close(fd)


def test_failed_eviction_keeps_the_file_counted(tmp_path: Path) -> None:
    removed: list[str] = []
    eng = engine(tmp_path, max_files=2, removed=removed)
    for i in (1, 2):
        fill(eng, i, payload(30 + i))
        assert eng.store_chunk(h(30 + i), i)[0] == WRITTEN
    stuck = tmp_path / eng.relpath(h(31))  # the least recently used: the next victim
    try:
        _immutable(stuck, True)
    except OSError as e:
        pytest.skip(f"this filesystem has no immutable flag: {e}")
    try:
        with pytest.raises(PermissionError):
            os.unlink(stuck)  # the real refusal the eviction meets
        fill(eng, 3, payload(33))
        assert eng.store_chunk(h(33), 3)[0] == WRITTEN
        assert stuck.exists()
        assert_exact(eng, tmp_path)  # still counted: the index says what the disk holds …
        assert eng.index.used == 2 * file_bytes()  # … and the bound holds: another file was evicted instead
        assert eng.relpath(h(31)) not in removed and removed == [eng.relpath(h(32))]
        assert eng.load_chunk(h(31), 0) == file_bytes()  # and it is still served
    finally:
        _immutable(stuck, False)
    fill(eng, 2, payload(34))
    assert eng.store_chunk(h(34), 2)[0] == WRITTEN
    assert_exact(eng, tmp_path)


def test_a_stuck_file_is_retried_only_when_nothing_else_can_be_evicted() -> None:
    idx = LRUIndex(2)
    for r in ("a", "b"):
        idx.add(r, 1)
    assert idx.reserve(1) == [("a", 1)]
    idx.keep([("a", 1)])  # its delete failed
    assert "a" in idx and idx.used == 2 and idx.stuck() == 1 and idx.doomed() == 0
    assert idx.add("c", 1, reserved=1) == [("b", 1)]  # another file goes first
    idx.forget(["b"])
    idx.pin("c")
    assert idx.reserve(1) == [("a", 1)]  # only the stuck one is left to make room: tried again
    assert idx.stuck() == 0 and "a" not in idx


# -- defect 6 is in tests/test_format.py (header parsing), defect 5 in tests/test_native.py --------------


def test_a_bad_file_reached_through_a_symlink_at_its_block_path_is_quarantined(tmp_path: Path) -> None:
    """The tier follows a symlink found at a block path (G-6): the file read is the link's target, and the
    link is what the quarantine moves (the target, outside the namespace, is not the tier's to move)."""
    eng = engine(tmp_path)
    rel = eng.relpath(h(40))
    plant_bad_header(tmp_path, "elsewhere/" + os.path.basename(rel))
    os.makedirs(os.path.dirname(tmp_path / rel))
    os.symlink(tmp_path / "elsewhere" / os.path.basename(rel), tmp_path / rel)
    assert eng.load_chunk(h(40), 0) is None
    assert quarantined(tmp_path) == [f"{rel}.ChecksumError"] and not os.path.lexists(tmp_path / rel)
    assert os.path.islink(tmp_path / ".quarantine" / f"{rel}.ChecksumError")
    assert (tmp_path / "elsewhere" / os.path.basename(rel)).exists()
