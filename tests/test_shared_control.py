"""Issue 31 (control plane): a co-tenant, a buggy or a crashed peer writing the coordination files of a shared root
(``.kvformat/``: journals, state, leases) can cost cache entries, never wedge the root, hang an engine, delete
outside the root or lift the bound. Each test is the attack it prevents, on a real root directory with real files:
two engines (SharedBound, the class every engine on a bounded root runs) on one root, their ticks pumped by hand.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
import threading
from pathlib import Path

import pytest

from kvformat.cache._counters import Counters
from kvformat.cache._log import CacheLog
from kvformat.cache._lru import LRUIndex
from kvformat.cache.shared import ENGINES_DIR, LEASE_DIR, STATE_FILE, SharedBound
from kvformat.cache.shared._checks import MAX_CONTROL_BYTES, MAX_GEN, Stuck
from kvformat.cache.shared import ControlMac
from kvformat.storage import LocalStore
from treediff import changes, snapshot

FILE = 4096
MAX = 64 * FILE


class Engine:
    """One engine's shared-bound part on ``root``: deletes go to the store, the start-up scan lists it."""

    def __init__(self, root: str, ttl_s: float = 1.0, mac: ControlMac | None = None,
                 read_deadline_s: float = 0.0, index: LRUIndex | None = None) -> None:
        self.store = LocalStore(root)
        self.index = index if index is not None else LRUIndex(None)
        self.n = 0
        self.sb = SharedBound(self.store, self.index, max_bytes=MAX, allowance=8 * FILE,
                              log=CacheLog(logging.getLogger("test_shared_control"), interval_s=0.0),
                              counters=Counters(), delete=self._delete, rescan=self._rescan, scanned=lambda: True,
                              interval_s=ttl_s / 10, ttl_s=ttl_s, mac=mac, read_deadline_s=read_deadline_s)

    def _delete(self, victims: list[tuple[str, int]]) -> None:
        for rel, _ in victims:
            self.store.delete(rel)
        self.index.forget([rel for rel, _ in victims])

    def _rescan(self) -> None:
        for e in self.store.list():
            self.index.add_found(e.relpath, e.size)

    def list_cold(self) -> int:
        """The tier's listing of the root (cache/_scan.py): every file not indexed yet is indexed cold."""
        self.index.begin_scan()
        n = self.index.scan_add((e.relpath, e.size, e.mtime) for e in self.store.list() if e.relpath.endswith(".kvf"))
        self.index.end_scan()
        return n

    def store_one(self, tag: str) -> str | None:
        """Store one FILE-byte file as an engine does (admission, write, publish); its path, or None if refused."""
        if self.sb.may_write(FILE) is not None:
            return None
        self.n += 1
        rel = f"ns/{tag}/{self.n:06d}.kvf"
        self.store.put(rel, [_payload(rel)], overwrite=True)
        self.sb.wrote(rel, FILE)  # as the row engine does (cache/_row_store.py), in either role
        if self.sb.is_evictor:
            self.sb.evict(self.index.add(rel, FILE))
        return rel


def _payload(rel: str) -> bytes:
    return hashlib.sha256(rel.encode()).digest() * (FILE // 32)


def _kvf_bytes(root: str) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*.kvf") if ".kvformat" not in p.parts)


@pytest.fixture
def site(tmp_path: Path) -> tuple[str, Path]:
    """A root and, next to it, a sentinel tree that no attack may change (compared byte for byte)."""
    sentinel = tmp_path / "outside"
    (sentinel / "ns" / "x").mkdir(parents=True)
    for i in range(4):
        (sentinel / "ns" / "x" / f"{i:06d}.kvf").write_bytes(os.urandom(FILE))
    (sentinel / "keep.txt").write_bytes(b"not the cache's")
    root = tmp_path / "root"
    root.mkdir()
    return str(root), sentinel


def pump(engines: list[Engine], rounds: int, store: bool = True) -> list[str]:
    """Ticks every engine ``rounds`` times, each storing one file per round; returns what was stored."""
    stored = []
    for _ in range(rounds):
        for i, e in enumerate(engines):
            e.sb.tick()
            if store:
                rel = e.store_one(f"e{i}")
                if rel is not None:
                    stored.append(rel)
    return stored


def _start(root: str, ttl_s: float = 1.0) -> list[Engine]:
    a = Engine(root, ttl_s)
    a.sb.tick()
    assert a.sb.is_evictor
    b = Engine(root, ttl_s)
    pump([a, b], 3, store=False)
    assert not b.sb.is_evictor and b.sb.may_read("x")
    return [a, b]


def _plant(root: str, rel: str, doc: object) -> None:
    p = Path(root, rel)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.is_symlink() or (p.exists() and not p.is_file()):
        p.unlink()  # the co-tenant replaces what it planted; it never writes through its own symlink
    p.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())


def _serving(engines: list[Engine]) -> None:
    """No engine wedged: every follower reads and stores; the evictor publishes; loads give the right bytes."""
    stored = pump(engines, 5)
    assert any(e.sb.is_evictor for e in engines)
    for e in engines:
        if not e.sb.is_evictor:
            assert e.sb.may_read("ns/any.kvf"), "follower wedged: it reads nothing"
    assert stored, "no engine could store"
    for rel in stored:
        p = Path(engines[0].store.root, rel)
        if p.exists():
            assert p.read_bytes() == _payload(rel)


def test_journal_records_with_path_tricks_are_skipped_and_nothing_outside_changes(site: tuple[str, Path]) -> None:
    root, sentinel = site
    before = snapshot(sentinel)
    engines = _start(root)
    out = f"../{sentinel.name}/ns/x/000000.kvf"
    evil = [[1, "w", out, FILE], [2, "w", "/" + str(sentinel / "keep.txt"), FILE], [3, "w", "ns/../../x.kvf", FILE],
            [4, "w", "ns//y.kvf", FILE], [5, "w", "ns/a\u0000.kvf", FILE], [6, "x", ".kvformat/state.json", 0],
            [7, "w", "ns/ok/000001.kvf", FILE, {"pred": "ns/ok/000000.kvf"}]]  # an optional field: tolerated
    _plant(root, f"{ENGINES_DIR}/evil.json", {"id": "evil", "beat": 1, "ack": None, "records": evil})
    _plant(root, "ns/ok/000001.kvf", _payload("ns/ok/000001.kvf"))
    pump(engines, 60)  # far past the bound: the evictor evicts (what the bad records named too, had they counted)
    a = engines[0].sb
    assert a.root_view()["control_rejected"]["path"] == 6
    assert not changes(before, snapshot(sentinel)), changes(before, snapshot(sentinel))
    _serving(engines)
    assert _kvf_bytes(root) <= MAX


def test_the_evictor_does_not_delete_a_doomed_file_its_own_load_is_reading(site: tuple[str, Path]) -> None:
    """A load of the evictor passes read_begin, a pass dooms that file, then the load pins it and reads: the
    followers' acknowledgements do not cover the evictor's own loads, so before, the file went under the read
    (a load found its file gone under CPU load in tests/test_shared_root.py)."""
    root, _ = site
    a, b = _start(root)
    first = a.store_one("e0")
    assert first is not None
    token = a.sb.read_begin(first)
    assert token is not None
    for _ in range(200):  # both store until a pass dooms the evictor's oldest file
        pump([a, b], 1)
        assert a.sb.holding is not None
        if first in a.sb.holding.doomed:
            break
    else:
        raise AssertionError("no pass doomed the oldest file")
    assert Path(root, first).exists()
    a.index.pin(first)  # the read begins
    pump([a, b], 8)
    assert Path(root, first).read_bytes() == _payload(first)  # the followers let go long ago, the load has not
    a.index.unpin(first)
    a.sb.read_end(token)
    pump([a, b], 8)
    assert not Path(root, first).exists()  # deleted once the load ended: the bound is not lifted for good


@pytest.mark.parametrize("deadline_s", [0.0, 0.3])
def test_a_follower_read_that_never_ends_holds_deletions_only_until_its_deadline(site: tuple[str, Path],
                                                                                 deadline_s: float) -> None:
    """A follower's read that never returns (a hung mount) pinned its acknowledgement for good: no file doomed
    since was ever deleted, and once the bound filled every store was refused. With ``read_deadline_s`` the read
    stops holding deletions back once it is that old; with 0 (off) the old behaviour is kept, as the control."""
    root, _ = site
    a = Engine(root)
    a.sb.tick()
    b = Engine(root, read_deadline_s=deadline_s)
    pump([a, b], 3, store=False)
    stuck = b.sb.read_begin("ns/any.kvf")  # begun, never ended
    assert stuck is not None
    pump([a, b], 10)
    time.sleep(max(deadline_s, 0.05) + 0.05)
    stored = pump([a, b], 40)  # 80 files of which at most 64 fit: eviction must delete
    on_root = _kvf_bytes(root)
    assert on_root <= MAX
    gone = [r for r in stored if not Path(root, r).exists()]
    if deadline_s:
        assert len(stored) > MAX // FILE and len(gone) >= len(stored) - MAX // FILE
    else:  # the control: the stuck read still holds every deletion, so stores stop at the bound
        assert len(gone) == 0 and len(stored) <= MAX // FILE
    b.sb.read_end(stuck)


def test_a_negative_size_does_not_disable_eviction(site: tuple[str, Path]) -> None:
    root, _ = site
    engines = _start(root)
    recs = [[1, "w", "ns/neg/0.kvf", -(1 << 50)], [2, "w", "ns/b/0.kvf", True], [3, "w", "ns/s/0.kvf", "12"]]
    _plant(root, f"{ENGINES_DIR}/evil.json", {"id": "evil", "beat": 1, "records": recs})
    pump(engines, 100)  # a negative size would leave the index "empty": no eviction, disk past the bound
    assert engines[0].sb.root_view()["control_rejected"]["size"] == 3
    assert _kvf_bytes(root) <= MAX


def test_a_huge_size_does_not_flush_the_cache(site: tuple[str, Path]) -> None:
    root, _ = site
    engines = _start(root)
    pump(engines, 20)
    kept = sorted(str(p) for p in Path(root).rglob("*.kvf"))
    _plant(root, f"{ENGINES_DIR}/evil.json", {"id": "evil", "beat": 1, "records": [[1, "w", "ns/h/0.kvf", 1 << 60]]})
    pump(engines, 10, store=False)
    assert sorted(str(p) for p in Path(root).rglob("*.kvf")) == kept, "a huge size flushed the cache"
    assert engines[0].sb.root_view()["control_rejected"]["size"] == 1


def test_fifo_and_symlink_planted_as_control_files_hang_nothing(site: tuple[str, Path]) -> None:
    root, sentinel = site
    engines = _start(root)
    os.mkfifo(Path(root, ENGINES_DIR, "fifo.json"))  # the evictor reads every journal
    (Path(root, ENGINES_DIR) / "link.json").symlink_to(sentinel / "keep.txt")
    done = threading.Event()

    def work() -> None:
        pump(engines, 5)
        Path(root, STATE_FILE).unlink()
        os.mkfifo(Path(root, STATE_FILE))  # every follower reads the state
        engines[1].sb.tick()  # the follower first: the evictor's next state replaces the FIFO
        (Path(root, LEASE_DIR) / "000000000099").symlink_to(sentinel / "keep.txt")
        pump(engines, 5)
        for e in engines:
            e.sb.close()
        done.set()

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(60)  # a hang detector, not a speed test: the work takes well under a second
    assert done.is_set(), "housekeeping or shutdown hung on a planted FIFO"
    rejected = {}
    for e in engines:
        for k, v in e.sb.root_view()["control_rejected"].items():
            rejected[k] = rejected.get(k, 0) + v
    assert rejected.get("not-regular", 0) >= 1
    assert (sentinel / "keep.txt").read_bytes() == b"not the cache's"


def test_oversized_control_file_is_a_bad_file_not_read_whole(site: tuple[str, Path]) -> None:
    root, _ = site
    engines = _start(root)
    big = Path(root, ENGINES_DIR, "big.json")
    with open(big, "wb") as f:
        f.truncate(4 * MAX_CONTROL_BYTES)  # sparse: costs no disk; reading it whole would take 256 MiB
    pump(engines, 2)
    assert engines[0].sb.root_view()["control_rejected"]["oversized"] >= 1
    _serving(engines)


def test_garbled_state_and_journal_are_skipped_and_the_root_recovers(site: tuple[str, Path]) -> None:
    root, _ = site
    engines = _start(root)
    _plant(root, f"{ENGINES_DIR}/evil.json", b"\xff\x00{not json")
    _plant(root, f"{ENGINES_DIR}/evil2.json", {"id": "../x", "beat": -1})
    _plant(root, f"{ENGINES_DIR}/evil3.json", {"id": "e3", "beat": 1, "records": [[3, "w", "ns/a.kvf", 1],
                                                                                 [2, "w", "ns/b.kvf", 1]]})
    _plant(root, STATE_FILE, {"gen": "1", "seq": [], "doomed": {"a": 1}})
    pump(engines, 5)
    rej = engines[0].sb.root_view()["control_rejected"]
    assert rej["json"] >= 1 and rej["id"] >= 1 and rej["seq"] >= 1
    _serving(engines)


def test_forged_state_of_a_far_generation_does_not_pin_followers(site: tuple[str, Path]) -> None:
    root, _ = site
    engines = _start(root)
    state = json.loads(Path(root, STATE_FILE).read_text())
    state.update(gen=10**11, seq=10**15, doomed=[])
    _plant(root, STATE_FILE, state)
    engines[1].sb.tick()  # the follower reads the forged state before the evictor rewrites it
    assert engines[1].sb.root_view()["control_rejected"]["gen"] == 1
    _serving(engines)
    state = json.loads(Path(root, STATE_FILE).read_text())
    state.update(allowance=1 << 62)  # a grant past any disk: the follower would write without bound
    _plant(root, STATE_FILE, state)
    engines[1].sb.tick()
    assert engines[1].sb.root_view()["control_rejected"]["allowance"] == 1
    _serving(engines)
    assert _kvf_bytes(root) <= MAX


def test_orphaned_lease_generation_is_taken_over_within_ttl(site: tuple[str, Path]) -> None:
    """A peer that took lease generation g+1 and crashed before publishing (or a co-tenant's planted lease):
    the root gets an evictor again within a few ttl_s, and the disk returns under the bound."""
    root, _ = site
    engines = _start(root, ttl_s=0.3)
    gen = json.loads(Path(root, STATE_FILE).read_text())["gen"]
    _plant(root, f"{LEASE_DIR}/{gen + 1:012d}", {"owner": "gone", "host": "elsewhere", "pid": 1})
    deadline = time.monotonic() + 20 * 0.3
    while time.monotonic() < deadline:
        pump(engines, 1)
        if json.loads(Path(root, STATE_FILE).read_text())["gen"] > gen + 1:
            break
        time.sleep(0.05)
    assert json.loads(Path(root, STATE_FILE).read_text())["gen"] == gen + 2
    assert sum(e.sb.is_evictor for e in engines) == 1
    pump(engines, 80)
    assert _kvf_bytes(root) <= MAX


def test_a_lease_at_the_last_generation_does_not_end_eviction(site: tuple[str, Path]) -> None:
    """A co-tenant creates lease generation 999999999999, the last one a name can hold: no engine could take a
    newer generation, so the root would have no evictor for good. The planted lease is removed when an engine
    takes over from it, within a few ttl_s, and the disk returns under the bound."""
    root, _ = site
    engines = _start(root, ttl_s=0.3)
    _plant(root, f"{LEASE_DIR}/{MAX_GEN:012d}", {"owner": "evil", "host": "elsewhere", "pid": 1})
    deadline = time.monotonic() + 40 * 0.3
    while time.monotonic() < deadline:
        pump(engines, 1)
        if not Path(root, LEASE_DIR, f"{MAX_GEN:012d}").exists() and any(e.sb.is_evictor for e in engines):
            break
        time.sleep(0.05)
    assert not Path(root, LEASE_DIR, f"{MAX_GEN:012d}").exists()
    assert sum(e.sb.is_evictor for e in engines) == 1
    assert engines[0].sb.root_view()["control_rejected"].get("gen", 0) + \
        engines[1].sb.root_view()["control_rejected"].get("gen", 0) >= 1
    pump(engines, 80)
    assert _kvf_bytes(root) <= MAX
    _serving(engines)


def test_a_stalled_read_is_abandoned_and_degrades_only_itself() -> None:
    """A read that never returns (here a real blocking read of a pipe nobody writes, as a hung NFS/FUSE read
    is) is given up on after its timeout; while it is stuck its name is not read again (one thread per stuck
    name, not one per tick), and other names are read meanwhile."""
    r, w = os.pipe()
    stuck = Stuck()
    with pytest.raises(TimeoutError):
        stuck.call("journal-a", lambda: os.read(r, 1), 0.2)
    with pytest.raises(TimeoutError, match="still stuck"):
        stuck.call("journal-a", lambda: b"", 5.0)
    assert stuck.call("journal-b", lambda: b"ok", 5.0) == b"ok"
    os.write(w, b"x")  # the server answers at last: the name is read again
    for _ in range(100):
        if not stuck.stuck:
            break
        threading.Event().wait(0.05)
    assert stuck.call("journal-a", lambda: b"back", 5.0) == b"back"
    os.close(r)
    os.close(w)


def _mutations(rng: "random.Random", root: str, sentinel: Path) -> None:
    """One round of a co-tenant's writes into ``.kvformat/``: random bytes, truncations, huge and negative numbers,
    path tricks, FIFOs and symlinks, in journals, the state and the leases."""
    ctl = Path(root, ".kvformat")
    files = [p for p in ctl.rglob("*") if p.is_file() and not p.is_symlink()]
    tricks = ["../outside/keep.txt", "/" + str(sentinel / "keep.txt"), "ns/../..", "", "ns//a.kvf", "a\u0000b",
              ".kvformat/state.json", "ns/x.kvf"]
    numbers = [-1, -(1 << 62), 1 << 62, 1 << 200, 0, 2**31, 1.5, "7", None, True]
    kind = rng.randrange(7)
    if kind == 0 and files:
        p = rng.choice(files)
        p.write_bytes(os.urandom(rng.randrange(1, 200)))
    elif kind == 1 and files:
        p = rng.choice(files)
        data = p.read_bytes()
        p.write_bytes(data[:rng.randrange(len(data) + 1)])
    elif kind == 2:
        recs = [[rng.choice(numbers + [1, 2, 3]), rng.choice(["w", "r", "x", "?"]), rng.choice(tricks),
                 rng.choice(numbers)] for _ in range(rng.randrange(1, 6))]
        _plant(root, f"{ENGINES_DIR}/f{rng.randrange(3)}.json",
               {"id": rng.choice(["f", "../x", "a" * 300]), "beat": rng.choice(numbers), "records": recs})
    elif kind == 3 and Path(root, STATE_FILE).is_file() and not Path(root, STATE_FILE).is_symlink():
        try:
            s = json.loads(Path(root, STATE_FILE).read_text())
        except ValueError:
            return
        s[rng.choice(["gen", "seq", "allowance", "used", "engines", "doomed"])] = rng.choice(
            numbers + [[[rng.choice(tricks), 1]], {"x": -1}])
        _plant(root, STATE_FILE, s)
    elif kind == 4:
        name = Path(root, ENGINES_DIR if rng.random() < 0.5 else LEASE_DIR, f"{rng.randrange(10**12):012d}")
        name.parent.mkdir(parents=True, exist_ok=True)
        if not name.exists():
            os.mkfifo(name)
    elif kind == 5:
        name = Path(root, LEASE_DIR, f"{rng.randrange(1, 40):012d}")
        name.parent.mkdir(parents=True, exist_ok=True)
        if not name.exists():
            name.write_bytes(rng.choice([b"{}", os.urandom(20), b'{"owner":"x","host":"h","pid":-5}']))
    elif files:
        p = rng.choice(files)
        p.unlink()
        p.symlink_to(sentinel / "keep.txt")


def test_fuzzed_control_files_under_two_engines(site: tuple[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """A fixed number of rounds of random co-tenant writes into the control files while two engines store and
    load: no unexpected exception in housekeeping, nothing outside the root changed, every load the right bytes;
    once the co-tenant stops, the root serves again and the disk is back under the bound."""

    root, sentinel = site
    before = snapshot(sentinel)
    engines = _start(root, ttl_s=0.3)
    rng = random.Random(31)
    caplog.set_level(logging.WARNING, logger="test_shared_control")
    wrong = 0
    for _ in range(400):
        _mutations(rng, root, sentinel)
        for rel in pump(engines, 1):
            p = Path(root, rel)
            if p.is_file() and p.read_bytes() != _payload(rel):
                wrong += 1
    crashes = [r.getMessage() for r in caplog.records if "coordinating the shared root failed" in r.getMessage()]
    assert not crashes, crashes[:3]
    assert wrong == 0
    assert not changes(before, snapshot(sentinel)), changes(before, snapshot(sentinel))
    for p in Path(root, ".kvformat").rglob("*"):  # the co-tenant stops: its planted files go
        if p.is_symlink() or (p.exists() and not p.is_file() and not p.is_dir()):
            p.unlink()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (
            sum(e.sb.is_evictor for e in engines) == 1 and all(e.sb.is_evictor or e.sb.may_read("x") for e in engines)):
        pump(engines, 1)
        time.sleep(0.05)
    _serving(engines)
    pump(engines, 80)
    assert _kvf_bytes(root) <= MAX
    assert not changes(before, snapshot(sentinel)), changes(before, snapshot(sentinel))
