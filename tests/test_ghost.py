"""The tier's default index (cache/_ghost.py) on real files: sequences worked out by hand from ARC's rule (Megiddo &
Modha, FAST'03: a ghost hit in B1 lowers the frequency side's target by max(1, |B2|/|B1|), one in B2 raises it by
max(1, |B1|/|B2|), each ratio taken before the name leaves its ghost), in bytes, with SLRU's demotion."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvformat.cache import TierConfig
from kvformat.cache._ghost import GhostSegmentedIndex
from kvformat.cache._lru import LRUIndex
from kvformat.cache._open import _index
from kvformat.errors import SchemaError
from test_capacity import store_file as _store


def _files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_a_ghost_hit_of_a_file_never_loaded_shrinks_the_protected_share(tmp_path: Path) -> None:
    idx = GhostSegmentedIndex(40, protected=0.5)  # four 10-byte files, 20 protected bytes aimed at
    for rel in "abcde":
        _store(idx, tmp_path, rel)  # e pushes a (never loaded) out: its name goes to the first ghost
    assert _files(tmp_path) == ["b", "c", "d", "e"] and idx.ghost_bytes() == (10, 0)
    _store(idx, tmp_path, "a")  # the reserve takes b first; then a's name is found: 20 - 10 x max(1, 0/20)
    assert idx.share() == 0.25 and idx.ghost_bytes() == (10, 0)
    # seen twice, a comes back protected: the stored-only files go before it
    assert _files(tmp_path) == ["a", "c", "d", "e"] and idx.lru_order() == ["c", "d", "e", "a"]
    assert idx.protected_bytes() == 10


def test_a_ghost_hit_of_a_file_once_protected_grows_the_share_by_the_ghosts_ratio(tmp_path: Path) -> None:
    idx = GhostSegmentedIndex(40, protected=0.25)  # one protected file
    for rel in "abcd":
        _store(idx, tmp_path, rel)
    idx.touch("a")
    idx.touch("b")  # a is demoted: probation's newest, still remembered as once protected
    assert idx.lru_order() == ["c", "d", "a", "b"]
    for rel in "efg":
        _store(idx, tmp_path, rel)  # c, d go to the first ghost, the demoted a to the second
    assert _files(tmp_path) == ["b", "e", "f", "g"] and idx.ghost_bytes() == (20, 10)
    _store(idx, tmp_path, "a")  # the reserve takes e (first ghost: 30 bytes); 10 + 10 x max(1, 30/10) = 40
    assert idx.share() == 1.0 and idx.ghost_bytes() == (30, 0)
    assert _files(tmp_path) == ["a", "b", "f", "g"] and idx.lru_order() == ["f", "g", "b", "a"]
    assert idx.protected_bytes() == 20


def test_a_restore_promotes_a_removal_leaves_no_ghost_and_ghosts_are_bounded(tmp_path: Path) -> None:
    idx = GhostSegmentedIndex(30, protected=0.5)
    for rel in "ab":
        _store(idx, tmp_path, rel)
    _store(idx, tmp_path, "a")  # stored again while indexed: the second sight, as ARC counts it
    assert idx.lru_order() == ["b", "a"] and idx.protected_bytes() == 10
    (tmp_path / "b").unlink()
    assert idx.remove("b") == 10 and idx.ghost_bytes() == (0, 0)  # gone from storage, not evicted
    for rel in "cdefgh":
        _store(idx, tmp_path, rel)  # c, d, e, f evicted in turn; the first ghost keeps the newest 30 bytes
    assert _files(tmp_path) == ["a", "g", "h"] and idx.ghost_bytes() == (30, 0)
    _store(idx, tmp_path, "c")  # c's name was dropped with the ghost's oldest: no adaptation
    assert idx.share() == 0.5 and _files(tmp_path) == ["a", "c", "h"]


def test_pins_and_the_bound_hold_as_in_lru_index(tmp_path: Path) -> None:
    idx = GhostSegmentedIndex(30, protected=0.5)
    for rel in "abc":
        _store(idx, tmp_path, rel)
    idx.pin("a")
    _store(idx, tmp_path, "d")  # a is probation's oldest but pinned: b goes
    assert _files(tmp_path) == ["a", "c", "d"] and idx.used == 30
    assert not idx.unpin("a")
    assert GhostSegmentedIndex(None).reserve(10**12) == []  # unbounded: never evicts


def test_the_tier_builds_the_index_eviction_names() -> None:
    assert TierConfig.parse("/tmp/x").eviction == "ghost-slru"
    bounded = TierConfig.parse("/tmp/x", max_bytes="1GiB")
    assert type(_index(bounded, writes=True)) is GhostSegmentedIndex
    assert type(_index(TierConfig.parse("/tmp/x", max_bytes="1GiB", eviction="lru"), writes=True)) is LRUIndex
    reader = _index(bounded, writes=False)  # a reader rank never stores: unbounded, plain
    assert type(reader) is LRUIndex and reader.max_bytes is None
    with pytest.raises(SchemaError, match="eviction"):
        TierConfig.parse("/tmp/x", eviction="arc")


def test_another_engines_store_of_an_evicted_name_counts_and_a_kept_victim_leaves_its_ghost(tmp_path: Path) -> None:
    idx = GhostSegmentedIndex(30, protected=0.5)
    for rel in "abcd":
        _store(idx, tmp_path, rel)  # a is evicted into the first ghost
    (tmp_path / "a").write_bytes(b"x" * 10)  # another engine on the root stores a again: its journal says so
    for victim, _ in idx.reserve(10):
        (tmp_path / victim).unlink()  # b: the room the evictor makes for it
        idx.forget([victim])
    assert idx.add_found("a", 10)
    idx.release(10)
    assert idx.share() == pytest.approx(5 / 30) and idx.lru_order() == ["c", "d", "a"]  # 15 - 10 x max(1, 0/20)
    victims = idx.victims(limit=20)  # c cannot be deleted (EPERM): it stays counted, so it is no ghost
    assert victims == [("c", 10)] and idx.ghost_bytes() == (20, 0)
    idx.keep(victims)
    assert idx.ghost_bytes() == (10, 0) and idx.lru_order()[0] == "c"
