"""The segmented LRU index (cache/_slru.py) on real files, and its replay row against an SLRU written here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from kvformat.cache._lru import LRUIndex
from kvformat.cache._slru import AdaptiveSegmentedIndex, SegmentedLRUIndex
from test_capacity import store_file as _store

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "bench_capacity.py"


def _files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_a_loaded_file_outlives_newer_files_that_were_only_stored(tmp_path: Path) -> None:
    idx = SegmentedLRUIndex(40, protected=0.5)
    for rel in "abcd":
        _store(idx, tmp_path, rel)
    assert idx.touch("a")  # loaded once: protected; plain LRU would still take it first
    _store(idx, tmp_path, "e")
    assert _files(tmp_path) == ["a", "c", "d", "e"] and "b" not in idx
    _store(idx, tmp_path, "f")
    assert _files(tmp_path) == ["a", "d", "e", "f"]
    assert idx.used == 40 and len(idx) == 4 and idx.protected_bytes() == 10


def test_the_protected_segment_is_bounded_and_its_overflow_ages_out_in_probation(tmp_path: Path) -> None:
    idx = SegmentedLRUIndex(40, protected=0.5)  # 20 protected bytes: two files
    for rel in "abcd":
        _store(idx, tmp_path, rel)
    for rel in "abc":
        idx.touch(rel)
    # a was pushed out of protected and is now probation's newest: d (stored, never loaded) goes first, then a
    assert idx.lru_order() == ["d", "a", "b", "c"] and idx.protected_bytes() == 20
    _store(idx, tmp_path, "e")
    assert _files(tmp_path) == ["a", "b", "c", "e"]
    _store(idx, tmp_path, "f")
    assert _files(tmp_path) == ["b", "c", "e", "f"]
    # with probation down to the write's own file, protected files go too (oldest first)
    idx2 = SegmentedLRUIndex(20, protected=1.0)
    for rel in "pq":
        _store(idx2, tmp_path, rel)
        idx2.touch(rel)
    _store(idx2, tmp_path, "r")
    assert "p" not in idx2 and "q" in idx2 and "r" in idx2 and not (tmp_path / "p").exists()


def test_pins_and_scanned_files_keep_lru_index_rules(tmp_path: Path) -> None:
    idx = SegmentedLRUIndex(30, protected=0.5)
    for rel in ("old", "older"):
        (tmp_path / rel).write_bytes(b"x" * 10)
    idx.begin_scan()
    idx.scan_add([("old", 10, 2.0), ("older", 10, 1.0)])
    idx.end_scan()
    assert idx.touch("old") and idx.protected_bytes() == 10  # a scanned file a load found: protected
    _store(idx, tmp_path, "n1")
    _store(idx, tmp_path, "n2")  # the cold file goes first, as in LRUIndex
    assert _files(tmp_path) == ["n1", "n2", "old"]
    idx.pin("n1")
    _store(idx, tmp_path, "n3")  # n1 is probation's oldest but pinned: n2 goes, never the protected file
    assert _files(tmp_path) == ["n1", "n3", "old"]
    assert not idx.unpin("n1")  # the bound held while it was pinned: nothing to evict now
    assert idx.size_of("old") == 10 and idx.size_of("n1") == 10 and idx.size_of("n2") is None
    with pytest.raises(ValueError):
        SegmentedLRUIndex(10, protected=1.5)


def _slru_by_hand(reqs: list[list[int]], cap: int, prot_cap: int) -> tuple[float, int]:
    prob: OrderedDict[int, None] = OrderedDict()
    prot: OrderedDict[int, None] = OrderedDict()
    hit = total = evictions = 0
    for ids in reqs:
        total += 512 * len(ids) + 100
        k = 0
        while k < len(ids) and (ids[k] in prob or ids[k] in prot):
            k += 1
        for b in ids[:k]:
            prob.pop(b, None)
            prot[b] = None
            prot.move_to_end(b)
            while len(prot) > prot_cap:
                prob[prot.popitem(last=False)[0]] = None
        hit += 512 * k
        for b in ids[k:]:
            # as the tier: room is reserved (a victim taken) before the write, while an old copy of b (stored
            # after the first gap of this request) still counts; the write then replaces it in probation
            if len(prob) + len(prot) + 1 > cap:
                (prob if prob else prot).popitem(last=False)
                evictions += 1
            prob.pop(b, None)
            prot.pop(b, None)
            prob[b] = None
    return hit / total, evictions


def test_replay_slru_row_equals_an_independent_slru(tmp_path: Path) -> None:
    reqs = [[0, 1, 2], [0, 1, 2, 3], [0, 4], [5, 6, 7], [0, 1, 8], [5, 6], [0, 4, 9], [0, 1, 2, 3, 10],
            [11, 12], [5, 6, 7, 13], [0, 1], [11, 12, 14], [0, 4], [5, 6, 7]]
    trace = tmp_path / "trace.jsonl"
    with trace.open("w") as f:
        for i, ids in enumerate(reqs):
            f.write(json.dumps({"timestamp": i, "input_length": 512 * len(ids) + 100, "output_length": 1,
                                "hash_ids": ids + [1000 + i]}) + "\n")
    # 126 MB holds 3 DeepSeek-V3 chunk files (36.0 MB of payload each plus a header far under 10 MB); half of
    # it, the protected share, holds one
    ratio, evictions = _slru_by_hand(reqs, 3, 1)
    lru_ratio = _slru_by_hand(reqs, 3, 0)[0]  # no protected segment: plain LRU
    assert ratio != lru_ratio  # the trace tells the two apart
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, str(TOOL), "--trace", str(trace), "--budget-tb", "0.000126",
                          "--policies", "kvformat-slru:0.5,lru", "--json", "--no-progress"],
                         capture_output=True, text=True, check=True, env=env, cwd=REPO)
    rows = json.loads(out.stdout)
    assert [(r["policy"], r["token_hit_ratio"], r["evictions"]) for r in rows] == [
        ("kvformat-slru:0.5", ratio, evictions), ("lru", lru_ratio, rows[1]["evictions"])]


def _round(idx: LRUIndex, root: Path, hot: str, fresh: list[str]) -> bool:
    """A load of ``hot`` (stored again when it was evicted, and loaded by the next request) then stores of files
    never used again."""
    hit = idx.touch(hot)
    if not hit:
        _store(idx, root, hot)
        assert idx.touch(hot)
    for rel in fresh:
        _store(idx, root, rel)
    return hit


def test_the_adaptive_index_protects_only_once_its_segmented_shadow_holds_more(tmp_path: Path) -> None:
    adaptive, lru = AdaptiveSegmentedIndex(40, protected=0.5, decay=1.0), LRUIndex(40)
    (tmp_path / "a").mkdir()
    (tmp_path / "l").mkdir()
    hits: dict[str, list[bool]] = {"a": [], "l": []}
    for r in range(6):
        fresh = [f"s{r}-{i}" for i in range(4)]  # four one-off files push a once-loaded file out of plain LRU
        hits["a"].append(_round(adaptive, tmp_path / "a", "hot", fresh))
        hits["l"].append(_round(lru, tmp_path / "l", "hot", fresh))
    assert hits["l"] == [False] * 6  # LRU: evicted before every reuse
    # round 0 stores it; in round 1 the real index (still plain LRU) has lost it while the segmented shadow holds
    # it, so protection is on from its store there, and it stays from then on
    assert hits["a"] == [False, False, True, True, True, True]
    assert adaptive.protected == 0.5 and "hot" in adaptive and (tmp_path / "a" / "hot").exists()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["hot", "s5-1", "s5-2", "s5-3"]


def test_the_adaptive_index_is_plain_lru_until_then(tmp_path: Path) -> None:
    adaptive, lru = AdaptiveSegmentedIndex(30, decay=1.0), LRUIndex(30)
    for i in range(8):
        for idx in (adaptive, lru):
            idx.reserve(10, f"f{i}")
            idx.forget(r for r, _ in idx.add(f"f{i}", 10, reserved=10))
            idx.touch(f"f{max(0, i - 1)}")
    assert adaptive.protected == 0.0 and adaptive.lru_order() == lru.lru_order()
    unbounded = AdaptiveSegmentedIndex(None)
    unbounded.add("x", 10)
    assert unbounded.touch("x") and unbounded.protected == 0.0 and unbounded.victims() == []
