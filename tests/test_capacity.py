"""Prefix-aware eviction (cache/_prefix.py) on real files, and tools/bench_capacity.py against an LRU written here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

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
                          "--policies", "lru,kvformat-lru", "--json", "--no-progress", *extra],
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
        assert [r["policy"] for r in rows] == ["lru", "kvformat-lru"]
        for r in rows:
            assert r["token_hit_ratio"] == ratio, (extra, r)
            assert r["evictions"] == evictions, (extra, r)
        sizes = {int(r["bytes_written"]) // writes for r in rows}  # type: ignore[call-overload]
        assert len(sizes) == 1 and 70_272 * 512 < sizes.pop() < 70_272 * 512 + (1 << 20)
    for sub in ("kvformat-lru-0.000126",):  # the LRU index's root holds exactly the 3 files it kept
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


# -- the field's policies (tools/capacity_policies.py), each against a sequence worked out by hand from its paper --

sys.path.insert(0, str(REPO / "tools"))
import capacity_policies as cp  # noqa: E402

ROW = 70_272 * 512  # DeepSeek-V3 bf16 payload of one 512-token block (the trace README's arithmetic)


def _play(policy: "cp.BlockPolicy", seq: str) -> str:
    """One single-block request per letter: H if the policy holds it (a hit), else M and the policy stores it."""
    out = []
    for ch in seq:
        b = ord(ch)
        if b in policy:
            policy.hit(b)
            out.append("H")
        else:
            policy.insert(b)
            out.append("M")
    return "".join(out)


def _ids(s: str) -> list[int]:
    return [ord(c) for c in s]


def test_sieve_hand_worked() -> None:
    # cap 3. 5 D: the hand starts at the tail A (visited: cleared), evicts B, stops at C. 6 B: evicts C. 8 E: D
    # visited (cleared), evicts B, the hand falls off the head. 10 F: from the tail, A cleared, D evicted. 12 G: E
    # cleared, F evicted. LRU would have evicted A at 8 E instead of B.
    s = cp.Sieve(3)
    assert _play(s, "ABCADBDEAFEG") == "MMMHMMHMHMHM"
    assert s.order() == _ids("AEG")
    # cap 2, both visited: the hand clears A and B, wraps past the head to the tail and evicts A.
    s = cp.Sieve(2)
    assert _play(s, "ABABCA") == "MMHHMM"
    assert s.order() == _ids("CA")


def test_s3fifo_hand_worked() -> None:
    """cap 4, small queue 1, main 3, ghost 3, move to main when hit more than once in the small queue."""
    s = cp.S3FIFO(4, small=0.25)
    assert (s.s_cap, s.m_cap) == (1, 3)
    # 1-4 fill S (the cache is not full before). 8 E: A (hit twice) moves to M, B (once) goes to the ghost.
    # 9 B: C to the ghost first, then B is found there and goes to M. 13 C: F's ghost entry pushes C out of the
    # 3-entry ghost before C is looked for, so C enters S. 17 I: C (hit twice) to M, H to the ghost. 20 J: I moves
    # to M, M overflows: A (freq 1) is reinserted with 0, B (0) is evicted. 21 B: B is not in the ghost (an
    # eviction from M leaves none), J goes to the ghost.
    assert _play(s, "ABCDAABEBFAGCHCCIIIJB") == "MMMMHHHMMMHMMMHHMHHMM"
    assert list(s.main) == _ids("CIA") and list(s.small) == _ids("B") and list(s.ghost) == _ids("GHJ")


def test_arc_hand_worked() -> None:
    """c = 2, the paper's cases: 4 C evicts B to B1; 5 B (in B1) raises p to 1, A goes to B2; 6 A (in B2) lowers p
    to 0, C to B1; 7 D moves B to B2; 8 B (in B2): D to B1; 9 E: B1 is full with T1, C leaves it, A to B2;
    10 A (B2): E to B1; 11 E (B1): p = 1, B to B2. LRU would hit E at 11."""
    a = cp.ARC(2)
    assert _play(a, "ABACBADBEAE") == "MMHMMMMMMMM"
    assert (list(a.t1), list(a.t2), list(a.b1), list(a.b2), a.p) == ([], _ids("AE"), _ids("D"), _ids("B"), 1.0)


def test_arc_start_moves_only_the_initial_target() -> None:
    """c = 2, A B A C: A is in T2 and B in T1 when C comes. The paper's start (p = 0) evicts B from T1 (T1 is over
    its target), so A hits next; started at p = c (``start=1``), T1 is under target and A leaves T2 instead."""
    a, b = cp.ARC(2), cp.ARC(2, start=1.0)
    assert (_play(a, "ABAC"), _play(b, "ABAC")) == ("MMHM", "MMHM")
    assert (list(a.b1), list(a.b2), list(b.b1), list(b.b2)) == (_ids("B"), [], [], _ids("A"))
    assert (_play(a, "A"), _play(b, "A"), cp.ARC(4, start=0.5).p) == ("H", "M", 2.0)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="share of the capacity"):
            cp.ARC(2, start=bad)


def test_frequency_sketch_doorkeeper_and_aging() -> None:
    f = cp.FrequencySketch(64, sample=8)
    for b, n in ((1, 5), (2, 2)):
        for _ in range(n):
            f.increment(b)
    # the first sighting only sets the doorkeeper bit; the next ones count in the sketch
    assert (f.estimate(1), f.estimate(2), f.estimate(3)) == (5, 2, 0)
    f.increment(3)  # the 8th addition: counters halve (4 -> 2, 1 -> 0), the doorkeeper is cleared
    assert (f.estimate(1), f.estimate(2), f.estimate(3), f.additions) == (2, 0, 0, 4)
    g = cp.FrequencySketch(64, sample=1000)
    for _ in range(20):
        g.increment(7)
    assert g.estimate(7) == 16  # 4-bit counters saturate at 15, plus the doorkeeper bit


def test_w_tinylfu_hand_worked() -> None:
    """cap 5: window 1, main 4 (protected 2). Estimates are access counts (no aging this short). 6-8 hits in
    probation promote A, B, C (A is demoted back when C overflows the protected segment). 9 F: window victim E
    (1) does not beat the probation victim D (1): E is dropped. 10 E (now 2) vs... F (1) loses to D. 11 G: E (2)
    beats D (1): D goes. 12 D: G (1) loses to A (2). 13 A promoted again, B demoted. 14 H: D (2) ties E (2): a tie
    keeps the victim."""
    w = cp.WTinyLFU(5, window=0.2, protected=0.5, sketch=cp.FrequencySketch(1024, sample=10_000))
    assert (w.w_cap, w.main_cap, w.prot_cap) == (1, 4, 2)
    assert _play(w, "ABCDEABCFEGDAH") == "MMMMMHHHMMMMHM"
    assert (list(w.window), list(w.probation), list(w.protected)) == (_ids("H"), _ids("EB"), _ids("CA"))


def test_target_rate_admission_scales_by_the_damped_error() -> None:
    t = cp.TargetRate(bytes_per_s=100, period=60)
    t.begin(0, 0)
    t.begin(60, 24_000)  # 400 B/s against 100: p x sqrt(1/4)
    assert t.p == 0.5
    t.begin(90, 25_000)  # within the period: unchanged
    assert t.p == 0.5
    t.begin(120, 27_000)  # 50 B/s over the last period: p x sqrt(2)
    assert abs(t.p - 0.5 * 2 ** 0.5) < 1e-12
    s = cp.SecondSight(2)
    assert [s.admit(b) for b in (1, 2, 1, 3, 4, 2)] == [False, False, True, False, False, False]


def _write_trace(path: Path, reqs: list[list[int]], span_ms: int = 3_600_000) -> None:
    last = max(1, len(reqs) - 1)
    path.write_text("".join(json.dumps({"timestamp": i * span_ms // last, "input_length": 512 * len(ids),
                                        "output_length": 1, "hash_ids": ids}) + "\n" for i, ids in enumerate(reqs)))


def _rows(trace: Path, *args: str) -> dict[tuple[str, float], dict[str, object]]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, str(TOOL), "--trace", str(trace), "--json", "--no-progress", *args],
                         capture_output=True, text=True, check=True, env=env, cwd=REPO)
    return {(r["policy"], r["codec_ratio"]): r for r in json.loads(out.stdout)}


def test_cpu_tier_write_through_hand_worked(tmp_path: Path) -> None:
    """Disk LRU of 3 blocks (110 MB) behind a CPU LRU of 2 (0.08 GB). [1], [2]: to both tiers. [1]: a CPU hit, which
    the disk tier never sees. [3]: to both (the CPU tier drops 2). [1]: a CPU hit. [4]: to both; the disk tier
    evicts 1, its least recent (its own last touch of 1 was the store). [2]: a disk hit, promoted. [1]: a miss in
    both. Without the CPU tier the disk LRU evicts 2 at [4], misses [2] and hits the last [1]."""
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, [[1], [2], [1], [3], [1], [4], [2], [1]])
    cpu = _rows(trace, "--budget-tb", "0.00011", "--policies", "lru", "--cpu-tier-gb", "0.08")[("lru", 1.0)]
    plain = _rows(trace, "--budget-tb", "0.00011", "--policies", "lru")[("lru", 1.0)]
    size = int(plain["bytes_written"]) // 5  # type: ignore[call-overload]
    assert (cpu["token_hit_ratio"], cpu["cpu_hit_ratio"], cpu["evictions"]) == (3 / 8, 2 / 8, 2)
    assert (cpu["bytes_read"], cpu["bytes_written"], cpu["cpu_tier_gb"]) == (size, 5 * size, 0.08)
    assert (plain["token_hit_ratio"], plain["cpu_hit_ratio"], plain["evictions"]) == (3 / 8, 0.0, 2)
    assert (plain["bytes_read"], plain["cpu_tier_gb"]) == (3 * size, 0.0)
    # drive-writes per day: 5 blocks over 110 MB in the trace's hour, times 24
    assert abs(float(cpu["drive_writes_per_day"]) - 5 * size / 110e6 * 24) < 1e-9  # type: ignore[arg-type]


def test_codec_ratio_makes_room_for_more_blocks(tmp_path: Path) -> None:
    """80 MB holds 2 uncompressed chunk files and 3 at ratio 1.5: [1,2,3] twice misses at 2 blocks (1 was
    evicted by 3), hits all three at 3."""
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, [[1, 2, 3], [1, 2, 3]])
    rows = _rows(trace, "--budget-tb", "0.00008", "--policies", "lru,kvformat,s3fifo", "--codec-ratio", "1,1.5")
    size1 = int(rows[("lru", 1.0)]["bytes_written"]) // 6  # type: ignore[call-overload]
    hdr = size1 - ROW
    assert 0 < hdr < 1 << 20
    for p in ("lru", "kvformat", "s3fifo"):  # S3-FIFO at 2 blocks: each store pushes the oldest through S to G
        assert rows[(p, 1.0)]["token_hit_ratio"] == 0.0
        assert rows[(p, 1.5)]["token_hit_ratio"] == 0.5
        assert rows[(p, 1.5)]["bytes_written"] == 3 * (hdr + 23_986_176)  # ceil(ROW / 1.5), header not compressed


def test_second_sight_admission_hand_worked(tmp_path: Path) -> None:
    """[1] is refused at first sight, stored at the second, hit at the third; [5,6] likewise (both blocks offered,
    both refused, then both stored): 3 of 9 blocks hit against plain LRU's 6, for the same 3 blocks written."""
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, [[1], [1], [1], [5, 6], [5, 6], [5, 6]])
    rows = _rows(trace, "--budget-tb", "0.00008", "--policies", "lru,lru+second-sight")
    size = int(rows[("lru", 1.0)]["bytes_written"]) // 3  # type: ignore[call-overload]
    assert rows[("lru", 1.0)]["token_hit_ratio"] == 6 / 9
    adm = rows[("lru+second-sight", 1.0)]
    assert (adm["token_hit_ratio"], adm["bytes_written"], adm["evictions"]) == (3 / 9, 3 * size, 1)
