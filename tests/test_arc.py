"""ArcLruIndex (cache/_arc.py): each expert followed alone on sequences worked out by hand, against the replay's
ARC and LRU (tools/capacity_policies.py), and the choice of the leader."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from kvformat.cache._arc import ArcLruIndex
from test_capacity import store_file as _store

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import capacity_policies as cp  # noqa: E402


def _files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_following_arc_evicts_the_once_stored_file_and_adapts_on_a_ghost_hit(tmp_path: Path) -> None:
    idx = ArcLruIndex(30, expert="arc")  # three 10-byte files
    _store(idx, tmp_path, "a")
    assert idx.touch("a")  # a: T2; LRU order is now a (oldest access), then b, c
    _store(idx, tmp_path, "b")
    _store(idx, tmp_path, "c")
    _store(idx, tmp_path, "d")  # T1 (b, c) is over the target p = 0: its oldest, b, goes to B1; LRU would drop a
    assert _files(tmp_path) == ["a", "c", "d"]
    _store(idx, tmp_path, "b")  # B1 hit: p = 0 + max(|B2| / |B1|, 1) x 10 = 10; T1 (c, d) = 20 > 10 drops c
    assert _files(tmp_path) == ["a", "b", "d"] and idx.arc_target() == 10
    assert idx.lru_order() == ["a", "d", "b"]  # no eviction of ARC pending: LRU among the three (a touched first)


def test_following_lru_is_plain_lru(tmp_path: Path) -> None:
    idx = ArcLruIndex(30, expert="lru")
    _store(idx, tmp_path, "a")
    assert idx.touch("a")
    for rel in "bcd":
        _store(idx, tmp_path, rel)
    assert _files(tmp_path) == ["b", "c", "d"]  # a's one touch was the oldest access
    assert idx.touch("b")
    _store(idx, tmp_path, "e")
    assert _files(tmp_path) == ["b", "d", "e"]


@pytest.mark.parametrize("expert", ["arc", "lru"])
def test_one_expert_alone_holds_what_the_replays_policy_holds(expert: str) -> None:
    # Unit-sized files, so that ARC's target moves by the same floats as in the block-level ARC.
    for seed in range(5):
        rng = random.Random(seed)
        ref: cp.ARC | cp.LRU = cp.ARC(20) if expert == "arc" else cp.LRU(20)
        idx = ArcLruIndex(20, expert=expert)
        for _ in range(3000):
            b = int(rng.paretovariate(1.0) * 3) % 60 if rng.random() < 0.7 else rng.randrange(60)
            rel = str(b)
            assert (b in ref) == (rel in idx)
            if b in ref:
                ref.hit(b)
                assert idx.touch(rel)
            else:
                ref.insert(b)
                idx.forget(r for r, _ in idx.reserve(1, rel))
                idx.forget(r for r, _ in idx.add(rel, 1, reserved=1))
        held = list(ref.t1) + list(ref.t2) if isinstance(ref, cp.ARC) else list(ref._d)
        assert sorted(map(str, held)) == sorted(idx.lru_order())


def test_the_leader_is_arc_until_lru_leads_by_a_significant_margin(tmp_path: Path) -> None:
    idx = ArcLruIndex(30)
    assert idx.following == "arc" and idx.scores() == (0.0, 0.0)
    # a file touched once early and never again: ARC keeps it in T2 while a cycle of three new files runs
    _store(idx, tmp_path, "s")
    idx.touch("s")
    for i in range(40):
        for rel in (f"x{i % 2}", f"y{i % 2}", "z"):
            if rel in idx:
                idx.touch(rel)
            else:
                _store(idx, tmp_path, rel)
    lru, arc = idx.scores()
    assert idx.following == ("lru" if lru - arc > 2 * (lru + arc) ** 0.5 else "arc")
    assert len(_files(tmp_path)) == 3 and idx.used == 30


def test_an_unbounded_index_has_no_experts_and_orders_as_lru(tmp_path: Path) -> None:
    idx = ArcLruIndex(None)
    for rel in "abc":
        _store(idx, tmp_path, rel)
    idx.touch("a")
    assert idx.lru_order() == ["b", "c", "a"] and idx.victims(limit=10) == [("b", 10), ("c", 10)]
    with pytest.raises(ValueError):
        ArcLruIndex(10, expert="lfu")
