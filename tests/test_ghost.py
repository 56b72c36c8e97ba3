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
    _store(idx, tmp_path, "a")  # the reserve takes e (first ghost: 30 bytes); 10 + 10 x max(1, 30/10) = 40,
    assert idx.share() == 0.8 and idx.ghost_bytes() == (30, 0)  # over most x 40 = 32: probation keeps a fifth
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


def test_another_engines_store_is_not_a_load(tmp_path: Path) -> None:
    idx = GhostSegmentedIndex(40, protected=0.5)
    idx.begin_scan()
    assert idx.scan_add([("x", 10, 1.0), ("y", 10, 2.0)]) == 2  # a listing found them, before any journal did
    idx.end_scan()
    _store(idx, tmp_path, "a")
    assert idx.note_store("x")  # the journal names x's store: the listing saw this store, so x is stored once
    assert idx.lru_order() == ["y", "a", "x"] and idx.protected_bytes() == 0
    assert idx.note_store("a")  # a stored here and then by another engine: its second sight, as a re-store
    assert idx.lru_order() == ["y", "x", "a"] and idx.protected_bytes() == 10
    assert not idx.note_store("z")  # not indexed: the journal merge indexes it (add_found)
    lru = LRUIndex(40)
    lru.add("b", 10)
    lru.add("c", 10)
    assert lru.note_store("b") and lru.lru_order() == ["c", "b"]  # plain LRU: a store is a use


def test_the_evictor_keeps_its_own_new_files_while_another_engine_stores(tmp_path: Path) -> None:
    # The fleet runs at cbd31a1 and dd09d22: a prompt the evictor had just stored was gone within 4 s, while files
    # from minutes before stayed. Two causes, each enough: (1) the evictor's listing found B's new files cold, B's
    # journal then named them and each was protected as if loaded; (2) on a shared root the evictor lifts its
    # index's max_bytes while it evicts by passes, and the protected share was a share of max_bytes, so nothing
    # was ever demoted: every file once loaded stayed protected, and probation held only the newest stores.
    from test_shared_control import FILE, MAX, Engine, pump
    root = str(tmp_path)
    a = Engine(root, index=GhostSegmentedIndex(MAX))
    a.sb.tick()
    b = Engine(root, index=GhostSegmentedIndex(MAX))
    pump([a, b], 3, store=False)
    assert a.sb.is_evictor and not b.sb.is_evictor
    for _ in range(40):  # B stores; the evictor lists the root before it merges B's journal now and then
        b.sb.tick()
        b.store_one("b")
        if b.n % 5 == 0:
            a.list_cold()
        a.sb.tick()
    assert a.index.protected_bytes() == 0  # nothing was loaded
    for rel in list(a.index.lru_order()):
        a.index.touch(rel)  # the evictor's loads read every file once
    assert a.index.max_bytes is None and a.index.protected_bytes() <= 0.2 * MAX  # the share of the root's bound
    own = [a.store_one("a") for _ in range(4)]
    assert None not in own
    for _ in range(30):  # more of B's stores, listed as before: the evictor makes room with older files
        b.sb.tick()
        b.store_one("b")
        if b.n % 5 == 0:
            a.list_cold()
        a.sb.tick()
    on_root = [f for f in Path(root).rglob("*.kvf") if ".kvformat" not in f.parts]
    assert len(on_root) * FILE <= MAX < (b.n + len(own)) * FILE  # the bound held, so B's stores evicted
    assert all(Path(root, rel).exists() for rel in own)


def test_the_share_stops_at_most_so_a_new_prompt_keeps_its_first_chunk(tmp_path: Path) -> None:
    # At a share of 1 probation is one file wide: each store evicts the one before it, so a two-chunk prompt keeps
    # only its second chunk, which a prefix lookup never reaches. With most=0.5 half the bound stays probation.
    for most, kept in ((1.0, ["p1"]), (0.5, ["p0", "p1"])):
        root = tmp_path / str(most)
        root.mkdir()
        idx = GhostSegmentedIndex(40, protected=most, most=most)
        for rel in "abcd":
            _store(idx, root, rel)
            idx.touch(rel)  # every file loaded: the protected segment takes what its share allows
        for rel in ("p0", "p1"):
            _store(idx, root, rel)
        assert [f for f in _files(root) if f.startswith("p")] == kept
    with pytest.raises(ValueError, match="most"):
        GhostSegmentedIndex(40, protected=0.9, most=0.8)
