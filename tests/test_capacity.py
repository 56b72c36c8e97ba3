"""Prefix-aware eviction (cache/_prefix.py) on real files, and tools/bench_capacity.py against an LRU written here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

from kvformat.cache._lru import LRUIndex
from kvformat.cache._prefix import PrefixIndex

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "bench_capacity.py"


def store_file(idx: LRUIndex, root: Path, rel: str) -> None:
    """A 10-byte store as the tier makes it: reserve (deleting victims), write, index (deleting victims)."""
    for victim, _ in idx.reserve(10, rel):
        (root / victim).unlink()
        idx.forget([victim])
    (root / rel).write_bytes(b"x" * 10)
    for victim, _ in idx.add(rel, 10, reserved=10):
        (root / victim).unlink()
        idx.forget([victim])


def _store(idx: PrefixIndex, root: Path, rel: str, parent: str | None) -> None:
    idx.link(rel, parent)
    store_file(idx, root, rel)


def test_dead_suffix_is_evicted_before_a_loadable_chain(tmp_path: Path) -> None:
    idx = PrefixIndex(50)
    _store(idx, tmp_path, "b0", None)  # the oldest file: plain LRU would take it first
    _store(idx, tmp_path, "b1", "b0")
    _store(idx, tmp_path, "a0", None)
    _store(idx, tmp_path, "a1", "a0")
    _store(idx, tmp_path, "a2", "a1")
    # a0 goes (a corrupt file quarantined, or another engine's eviction): a1 and a2 can never be loaded again
    (tmp_path / "a0").unlink()
    idx.remove("a0")
    assert idx.is_dead("a1") and not idx.is_dead("a2")  # a2's parent a1 is still indexed
    _store(idx, tmp_path, "c0", None)
    _store(idx, tmp_path, "c1", "c0")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["a2", "b0", "b1", "c0", "c1"] or left == ["b0", "b1", "c0", "c1"], left
    assert "a1" not in idx and "b0" in idx and "b1" in idx
    # the next store takes a2 (dead once a1 went), still not the older loadable chain
    _store(idx, tmp_path, "d0", None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b0", "b1", "c0", "c1", "d0"]


def test_a_relinked_parent_revives_its_children(tmp_path: Path) -> None:
    idx = PrefixIndex(100)
    _store(idx, tmp_path, "p", None)
    _store(idx, tmp_path, "q", "p")
    idx.remove("p")
    assert idx.is_dead("q")
    _store(idx, tmp_path, "p", None)
    assert not idx.is_dead("q")


def _tiny_trace(path: Path) -> list[list[int]]:
    reqs = [[0, 1, 2], [0, 1, 2, 3], [0, 4], [5, 6, 7], [0, 1, 8], [5, 6], [0, 4, 9], [0, 1, 2, 3, 10],
            [11, 12], [5, 6, 7, 13], [0, 1], [11, 12, 14]]
    with path.open("w") as f:
        for i, ids in enumerate(reqs):
            f.write(json.dumps({"timestamp": i, "input_length": 512 * len(ids) + 100, "output_length": 1,
                                "hash_ids": ids + [1000 + i]}) + "\n")  # a trailing partial block, never stored
    return reqs


def _lru_by_hand(reqs: list[list[int]], cap: int) -> tuple[float, int, int]:
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = evictions = writes = 0
    for ids in reqs:
        total += 512 * len(ids) + 100
        k = 0
        while k < len(ids) and ids[k] in cache:
            k += 1
        for b in ids[:k]:
            cache.move_to_end(b)
        hit += 512 * k
        for b in ids[k:]:
            cache[b] = None
            writes += 1
            if len(cache) > cap:
                cache.popitem(last=False)
                evictions += 1
    return hit / total, evictions, writes


def _replay(trace: Path, *extra: str) -> list[dict[str, object]]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, str(TOOL), "--trace", str(trace), "--budget-tb", "0.000126",
                          "--policies", "lru,kvformat", "--json", "--no-progress", *extra],
                         capture_output=True, text=True, check=True, env=env, cwd=REPO)
    rows: list[dict[str, object]] = json.loads(out.stdout)
    return rows


def test_replay_lru_rows_equal_an_independent_lru(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    reqs = _tiny_trace(trace)
    # 126 MB holds 3 DeepSeek-V3 chunk files, not 4: 70,272 B x 512 tokens = 36.0 MB of payload each, plus a
    # header far under 10 MB
    ratio, evictions, writes = _lru_by_hand(reqs, 3)
    assert 0 < ratio < 1 and evictions > 0
    for extra in ((), ("--root", str(tmp_path / "root"), "--scale", "65536", "--keep-files")):
        rows = _replay(trace, *extra)
        assert [r["policy"] for r in rows] == ["lru", "kvformat"]
        for r in rows:
            assert r["token_hit_ratio"] == ratio, (extra, r)
            assert r["evictions"] == evictions, (extra, r)
        sizes = {int(r["bytes_written"]) // writes for r in rows}  # type: ignore[call-overload]
        assert len(sizes) == 1 and 70_272 * 512 < sizes.pop() < 70_272 * 512 + (1 << 20)
    for sub in ("kvformat-0.000126",):  # the shipped index's root holds exactly the 3 files it kept
        assert len(list((tmp_path / "root" / sub).rglob("*.kvf"))) == 3


def test_oracle_admission_stores_only_blocks_used_again(tmp_path: Path) -> None:
    """``lru-oracle-admission`` against rows worked out by hand: requests [1, 2, 3], [4, 5], [1, 2] in a budget of
    two DeepSeek-V3 chunk files (80 MB: 36.0 MB each plus the header)."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0, "input_length": 512 * len(ids), "output_length": 1,
                                         "hash_ids": ids}) + "\n" for ids in ([1, 2, 3], [4, 5], [1, 2])))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, str(TOOL), "--trace", str(trace), "--budget-tb", "0.00008", "--policies",
                          "lru,lru-oracle-admission,optimal", "--json", "--no-progress"],
                         capture_output=True, text=True, check=True, env=env, cwd=REPO)
    rows = {r["policy"]: r for r in json.loads(out.stdout)}
    size = rows["lru"]["bytes_written"] // 7
    # LRU stores all 7 blocks, evicting 5, and the third request finds block 1 gone: no hit.
    assert (rows["lru"]["token_hit_ratio"], rows["lru"]["evictions"]) == (0.0, 5)
    # The oracle stores 1 and 2 only (3, 4, 5 never come back), so the third request loads both.
    oracle = rows["lru-oracle-admission"]
    assert (oracle["token_hit_ratio"], oracle["evictions"], oracle["bytes_written"]) == (2 / 7, 0, 2 * size)
    assert oracle["token_hit_ratio"] == rows["optimal"]["token_hit_ratio"]


def test_a_pinned_dead_chunk_is_not_evicted(tmp_path: Path) -> None:
    idx = PrefixIndex(30)
    _store(idx, tmp_path, "h", None)
    _store(idx, tmp_path, "t", "h")
    _store(idx, tmp_path, "x", None)
    idx.remove("h")
    (tmp_path / "h").unlink()
    idx.pin("t")  # a load that began before the head went is still reading it
    _store(idx, tmp_path, "y", None)
    _store(idx, tmp_path, "z", None)
    assert (tmp_path / "t").exists() and "t" in idx and not (tmp_path / "x").exists()
    idx.unpin("t")
    _store(idx, tmp_path, "w", None)  # unpinned, the dead chunk goes before the older loadable y
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w", "y", "z"]
