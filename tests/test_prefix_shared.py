"""Issue 33 item 2: a chunk's predecessor reaches the shared root's evictor through a follower's journal, so the
evictor drops a chain whose head was evicted before a loadable chain, across two engines on one root (SharedBound,
the class every engine on a bounded root runs, on a real root directory with real files; ticks pumped by hand)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kvformat.cache._counters import Counters
from kvformat.cache._log import CacheLog
from kvformat.cache._lru import LRUIndex
from kvformat.cache._prefix import PrefixIndex
from kvformat.cache.shared import ENGINES_DIR, SharedBound
from kvformat.cache.shared._journal import parse_journal
from kvformat.errors import ControlRecordError
from kvformat.storage import LocalStore

FILE = 4096
MAX = 10 * FILE  # two engines, allowance 2 files: each evictor pass dooms down to max(10 - 2 x 2, 5) = 6 files


class Engine:
    def __init__(self, root: str, index: LRUIndex) -> None:
        self.store = LocalStore(root)
        self.index = index
        self.sb = SharedBound(self.store, index, max_bytes=MAX, allowance=2 * FILE,
                              log=CacheLog(logging.getLogger("test_prefix_shared"), interval_s=0.0),
                              counters=Counters(), delete=self._delete, rescan=lambda: None, scanned=lambda: True,
                              interval_s=0.1, ttl_s=1.0)

    def _delete(self, victims: list[tuple[str, int]]) -> None:
        for rel, _ in victims:
            self.store.delete(rel)
        self.index.forget([rel for rel, _ in victims])

    def store_chunk(self, rel: str, pred: str | None) -> None:
        """As the tier's store path: admission, write, wrote (journal or local), then the index."""
        assert self.sb.may_write(FILE) is None
        self.store.put(rel, [b"k" * FILE], overwrite=True)
        self.sb.wrote(rel, FILE, pred=pred)
        self.sb.evict(self.index.add(rel, FILE))


def _settle(a: Engine, b: Engine) -> None:
    for _ in range(4):  # journal written, merged, state published, acknowledged, doomed files deleted
        b.sb.tick()
        a.sb.tick()


def _run(root: Path, prefix: bool, links: bool) -> list[str]:
    make = (lambda: PrefixIndex(None)) if prefix else (lambda: LRUIndex(None))
    a = Engine(str(root), make())
    a.sb.tick()
    assert a.sb.is_evictor
    b = Engine(str(root), make())
    _settle(a, b)
    assert not b.sb.is_evictor
    steps: list[tuple[Engine, str, str | None]] = [
        (b, "h/0.kvf", None),  # the oldest file: the head of b's chain, the first victim in any order
        (a, "l/0.kvf", None), (a, "l/1.kvf", "l/0.kvf"),  # a loadable chain, older than the rest of b's
        (b, "h/1.kvf", "h/0.kvf"), (b, "h/2.kvf", "h/1.kvf"),
        (a, "n/0.kvf", None), (a, "n/1.kvf", None),  # 7 files: h/0 goes
        (a, "n/2.kvf", None), (a, "n/3.kvf", None)]  # two more victims
    for eng, rel, pred in steps:
        eng.store_chunk(rel, pred if links else None)
        _settle(a, b)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.kvf"))


def test_the_follower_journal_carries_the_predecessor_and_a_dead_chain_goes_first(tmp_path: Path) -> None:
    kept = _run(tmp_path / "prefix", prefix=True, links=True)
    assert "h/0.kvf" not in kept  # the head was evicted (the oldest file)
    # its suffix, stored by the other engine, could never be loaded again: it went before the older chain l/
    assert kept == ["l/0.kvf", "l/1.kvf", "n/0.kvf", "n/1.kvf", "n/2.kvf", "n/3.kvf"]
    # without the links (or with plain LRU) the same stores evict by age: the loadable chain goes, the dead stays
    for name, prefix, links in (("nolinks", True, False), ("lru", False, True)):
        assert _run(tmp_path / name, prefix, links) == ["h/1.kvf", "h/2.kvf", "n/0.kvf", "n/1.kvf", "n/2.kvf",
                                                        "n/3.kvf"], name


def test_the_journal_record_has_the_pred_field_and_a_bad_pred_is_a_bad_record(tmp_path: Path) -> None:
    a = Engine(str(tmp_path), PrefixIndex(None))
    a.sb.tick()
    b = Engine(str(tmp_path), PrefixIndex(None))
    _settle(a, b)
    b.sb.may_write(FILE)
    b.sb.wrote("c/1.kvf", FILE, pred="c/0.kvf")
    b.sb.tick()
    raw = (tmp_path / ENGINES_DIR / f"{b.sb.id}.json").read_bytes()
    doc = json.loads(raw)
    assert [r[1:] for r in doc["records"]] == [["w", "c/1.kvf", FILE, {"pred": "c/0.kvf"}]]
    assert parse_journal(raw, 0).records[0][1:] == ("w", "c/1.kvf", FILE, "c/0.kvf")
    doc["records"] += [[100, "w", "c/2.kvf", FILE, {"pred": "../../etc/passwd"}],
                       [101, "w", "c/3.kvf", FILE, {"pred": ".kvformat/state.json"}],
                       [102, "w", "c/4.kvf", FILE, {"other": 1}, "later"], [103, "w", "c/5.kvf", FILE, "x"]]
    j = parse_journal(json.dumps(doc).encode(), 0)
    assert [(r[2], r[4]) for r in j.records] == [("c/1.kvf", "c/0.kvf"), ("c/4.kvf", None), ("c/5.kvf", None)]
    assert len(j.bad) == 2 and all(isinstance(e, ControlRecordError) and e.why == "path" for e in j.bad)
    assert b.index.is_dead("c/1.kvf") is False  # linked in the follower's own index too (not indexed there yet)
    b.index.add("c/1.kvf", FILE)
    assert b.index.is_dead("c/1.kvf")  # its predecessor was never stored
