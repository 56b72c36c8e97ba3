"""A new evictor of a shared root must not index files that are gone because an old journal names them.

A journal stays on the root after its writer stopped journaling: the writer died, or it became the evictor (an
evictor writes none). A later evictor merges it as news; each write it names that an earlier evictor deleted would
be an entry for a file that is not there, a hit that finds no file when loaded (``missing_files`` on CI in
tests/test_shared_root.py, 2026-12-06: the second take-over merged the journal the first evictor had written as a
follower). Same harness as tests/test_shared_control.py: SharedBound engines on a real root, ticks pumped by hand.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from kvformat.cache.shared._journal import parse_journal
from kvformat.errors import ControlRecordError
from test_shared_control import FILE, MAX, Engine, _kvf_bytes, _payload, _start, pump


def _ghosts(e: Engine, root: str) -> list[str]:
    """Files ``e`` has indexed that are not on the root."""
    return [rel for rel in e.index.lru_order() if not Path(root, rel).exists()]


def test_the_journal_of_a_follower_that_became_the_evictor_is_not_merged_again(tmp_path: Path) -> None:
    root = str(tmp_path)
    a, b = _start(root)
    wrote = [b.store_one("b") for _ in range(3)]
    assert all(wrote)
    b.sb.tick()  # its journal names the three writes
    a.sb.tick()
    a.sb.close()  # released: b takes over at its next tick
    b.sb.tick()
    assert b.sb.is_evictor
    assert not Path(root, b.sb.journal_rel).exists()  # the follower's journal went with the role
    b.sb.evict(b.index.victims(limit=0))  # alone on the root: deleted at once
    assert not any(Path(root, rel).exists() for rel in wrote)
    c = Engine(root)
    c.sb.tick()
    b.sb.close()
    c.sb.tick()
    assert c.sb.is_evictor
    assert _ghosts(c, root) == [] and not any(rel in c.index for rel in wrote)


def test_a_dead_followers_journal_does_not_bring_back_files_deleted_since(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="test_shared_control")
    root = str(tmp_path)
    a, b = _start(root)
    wrote = [b.store_one("b") for _ in range(3)]
    kept = b.store_one("b")
    assert all(wrote) and kept
    b.sb.tick()  # b's last journal: it dies here (no more ticks)
    a.sb.tick()
    assert all(rel in a.index for rel in wrote)
    time.sleep(1.1 * a.sb.ttl_s)  # b stops counting as live; its journal is removed only after 3 ttl_s
    a.sb.tick()
    assert a.sb.holding is not None and not a.sb.holding.alone  # b's late writes may still land: not alone
    assert f"engine {b.sb.id} has not rewritten its journal" in caplog.text  # said once, when it went silent
    for rel in wrote:  # evicted while b is silent: deleted at the next pass, without waiting for b
        a.index.remove(rel)
        a.sb.evict([(rel, FILE)])
    a.sb.tick()
    a.sb.tick()
    assert not any(Path(root, rel).exists() for rel in wrote)
    c = Engine(root)
    c.sb.tick()
    a.sb.close()
    assert Path(root, b.sb.journal_rel).exists()  # the premise: c finds the dead engine's journal
    c.sb.tick()
    assert c.sb.is_evictor
    assert _ghosts(c, root) == [] and kept in c.index


def test_a_take_over_listing_longer_than_ttl_keeps_the_lease(tmp_path: Path) -> None:
    """The new evictor lists the root before its first pass. A listing longer than ``ttl_s`` (a big tree, a slow
    FUSE mount: the fleet run of issue 43 took 22 s through one) held up its first state, so the followers took the
    lease over again, and again: two engines evicting in turn, the bound exceeded by a few chunks. Now the listing
    runs beside the passes, which publish states granting nothing until it is done."""
    root = str(tmp_path)
    a, b = _start(root)
    c = Engine(root)
    for _ in range(3):
        for e in (a, b, c):
            e.sb.tick()
    slow = _slow_rescan(b)
    took_over: list[bool] = []
    done = threading.Event()

    def follower() -> None:  # c ticks on its own, as every engine's housekeeping thread does
        while not done.is_set():
            c.sb.tick()
            took_over.append(c.sb.is_evictor)
            time.sleep(c.sb.interval_s)

    ft = threading.Thread(target=follower, daemon=True)
    a.sb.close()  # released: the next follower tick takes over
    bt = threading.Thread(target=b.sb.tick, daemon=True)  # b takes over; before, this tick lasted the listing
    bt.start()
    assert wait_for(lambda: b.sb.is_evictor, 10)
    ft.start()
    bt.join()
    t_end = time.monotonic() + 1.5 * b.sb.ttl_s
    while time.monotonic() < t_end:  # longer than ttl_s: c must keep seeing fresh states
        b.sb.tick()
        time.sleep(b.sb.interval_s)
    assert not any(took_over), "the follower took over during the new evictor's listing"
    assert b.sb.holding is not None and b.sb.holding.grants[b.sb.holding.seq] == 0  # nothing granted yet
    slow.set()
    assert wait_scanned(b)
    b.sb.tick()
    b.sb.tick()
    done.set()
    ft.join()
    assert b.sb.is_evictor and not c.sb.is_evictor
    assert b.sb.holding.grants[b.sb.holding.seq] > 0  # the listing is in: writes are granted again


def _slow_rescan(e: Engine) -> threading.Event:
    """Makes ``e``'s take-over listing wait (up to 3 ttl_s) until the returned event is set."""
    slow = threading.Event()
    plain = e._rescan

    def slow_rescan() -> None:
        slow.wait(3 * e.sb.ttl_s)
        plain()

    e.sb.evictor._rescan = slow_rescan
    return slow


def wait_for(cond: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def wait_scanned(e: Engine, timeout: float = 10.0) -> bool:
    return wait_for(lambda: e.sb.holding is not None and e.sb.holding.scanned, timeout)


def test_an_engine_that_takes_the_lease_back_writes_nothing_until_its_first_pass(tmp_path: Path) -> None:
    """An engine that was the evictor once keeps the grant its last pass gave itself. Taking the lease again, it
    admitted its own stores against that old grant while its take-over listing ran (up to ttl_s / 2, before the
    first pass of the new generation counted the root): in the fleet run of issue 43 the TP=1 server, evictor at
    the start, took the lease back when the TP=2 server was killed and wrote 25 chunks during its 4.7 s listing
    through a FUSE mount, 20 chunks over max_bytes. A new generation grants nothing before its first pass."""
    root = str(tmp_path)
    a, b = _start(root)
    pump([a, b], 3)
    assert a.sb.evictor._own_grant > 0  # the premise: a granted itself room while b followed
    time.sleep(1.2 * a.sb.ttl_s)  # a is silent: b takes the lease over, then a sees it and steps down
    b.sb.tick()
    assert b.sb.is_evictor
    a.sb.tick()
    assert not a.sb.is_evictor
    for _ in range(3):
        b.sb.tick()
        a.sb.tick()
    slow = _slow_rescan(a)
    b.sb.close()  # released: a takes the lease back at its next tick and lists the root first
    at = threading.Thread(target=a.sb.tick, daemon=True)
    at.start()
    try:
        assert wait_for(lambda: a.sb.is_evictor, 10)
        written = [rel for rel in (a.store_one("a") for _ in range(4)) if rel is not None]
        assert written == [], "stores admitted by a new evictor before its first pass"
    finally:
        slow.set()
        at.join()
    assert wait_scanned(a)
    a.sb.tick()
    assert a.store_one("a") is not None  # alone and listed: stores go on


def test_the_evictors_writes_in_flight_stay_within_one_grant(tmp_path: Path) -> None:
    """A successor counts the old evictor, now a follower, as writing under one allowance at most. So the evictor's
    own admitted writes still in flight must stay within one grant across its passes: each pass used to start its
    count again at 0, and writes slow to finish (a FUSE mount) piled up one grant per pass, beyond what a new
    evictor allows for when the lease moves."""
    root = str(tmp_path)
    a, b = _start(root)
    pump([a, b], 2, store=False)
    grant = a.sb.evictor._own_grant
    assert grant >= 2 * FILE
    admitted = 0
    for _ in range(4):  # writes admitted and never finished, over four passes
        while a.sb._admit(FILE) is None:
            admitted += FILE
        a.sb.tick()
        b.sb.tick()
    assert admitted <= max(grant, a.sb.evictor._own_grant), (admitted, grant)


def test_a_new_evictor_counts_the_former_one_until_it_journals(tmp_path: Path) -> None:
    """The lease can move from an evictor that is alive but slow (its passes held up by a slow mount: the fleet run
    of issue 43, the TP=1 server on FUSE under load). The former evictor wrote no journal while it held the lease,
    so the new one found no live follower, took itself to be alone and filled the root to max_bytes exactly, while
    the former one still wrote under its last grant: 20 chunks over the bound. Now the former evictor counts as a
    follower that acknowledged nothing: the new evictor is not alone and leaves it one allowance."""
    root = str(tmp_path)
    a, b = _start(root)
    pump([a, b], 3)
    time.sleep(1.2 * a.sb.ttl_s)  # a's passes stall: b takes the lease while a still believes it holds it
    b.sb.tick()
    assert b.sb.is_evictor and a.sb.is_evictor
    h = b.sb.evictor.holding
    assert h is not None and not h.alone, "the new evictor took itself to be alone beside a live former evictor"
    assert a.sb.id in h.views
    a.sb.tick()  # a sees the newer lease, steps down and journals as a follower
    assert not a.sb.is_evictor
    for _ in range(3):
        a.sb.tick()
        b.sb.tick()
    assert a.sb.may_read("x") and not h.alone and h.views[a.sb.id].beat >= 0


def test_a_dead_former_evictor_is_waited_for_only_ttl_s(tmp_path: Path) -> None:
    root = str(tmp_path)
    a, b = _start(root)
    pump([a, b], 3)
    time.sleep(1.2 * a.sb.ttl_s)  # a is dead: it never ticks again
    b.sb.tick()
    h = b.sb.evictor.holding
    assert h is not None and a.sb.id in h.views and not h.alone
    time.sleep(1.2 * b.sb.ttl_s)
    b.sb.tick()
    assert a.sb.id not in h.views and h.alone  # no journal within ttl_s: dead, and b is alone on the root


def test_a_silent_followers_writes_stay_counted_until_it_is_gone(tmp_path: Path) -> None:
    """A follower silent for ttl_s (its mount stalled) may still finish writes admitted before: the evictor keeps
    its exposure and is not alone (exact, filling to max_bytes) until the follower is gone (3 ttl_s). fleet7:
    alone a second after the TP=1 server on FUSE went silent, the evictor filled the root and the follower's late
    writes went 8 chunks over max_bytes."""
    root = str(tmp_path)
    a, b = _start(root)
    pump([a, b], 3)
    time.sleep(1.2 * a.sb.ttl_s)  # b is silent
    a.sb.tick()
    h = a.sb.evictor.holding
    assert h is not None and not h.alone and b.sb.id in h.views
    assert h.grants[h.seq] <= MAX - a.index.used - a.sb.allowance  # b's allowance still held back
    time.sleep(3.0 * a.sb.ttl_s)  # over 3 ttl_s of silence in all: b is gone
    a.sb.tick()
    a.sb.tick()
    assert h.alone and b.sb.id not in h.views


def _fill(e: Engine, tag: str) -> list[str]:
    """Stores until ``e``'s grant is used up; what it stored."""
    out = []
    while (rel := e.store_one(tag)) is not None:
        out.append(rel)
    return out


def test_a_starved_evictors_writes_still_landing_after_it_stepped_down_are_counted(tmp_path: Path) -> None:
    """The lease moves from an evictor that is alive but starved (fleet run at da6c35a, 2 cores: the TP=1 server's
    round took 11.2 s, the restarted TP=2 server took the lease). Its stores admitted as the evictor go on landing:
    some before it notices the newer lease (indexed in its own index only, never journaled, and after the new
    evictor's listing), some after (it is a follower by then). The new evictor left it one allowance only until
    it acknowledged a state; after that its uncounted bytes were taken to be within the new grants: the root went
    21 files over max_bytes for 26 s. Here the former evictor journals its writes since its last pass and the
    bytes it admitted and has not written; the root's .kvf bytes never pass max_bytes."""
    root = str(tmp_path)
    a, b = _start(root)
    for e in (a, b):
        e.sb.wait_s = 0.0  # a refused store fails at once: the test fills each grant in a loop
    for _ in range(12):  # the root fills up and eviction runs
        for e, tag in ((a, "a"), (b, "b")):
            e.sb.tick()
            _fill(e, tag)
            assert _kvf_bytes(root) <= MAX
    pump([a, b], 4, store=False)  # deletions go through: a grants itself up to an allowance; b watches a's last state
    inflight = 0  # a's stores admitted as the evictor and not yet written
    while a.sb._admit(FILE) is None:
        inflight += 1
    assert inflight >= 2, "the premise: the evictor has room of its own to write under"
    time.sleep(1.2 * a.sb.ttl_s)  # a is starved: b takes the lease while a still believes it holds it
    b.sb.tick()
    assert b.sb.is_evictor and a.sb.is_evictor and wait_scanned(b)

    def land(n: int) -> None:
        for _ in range(n):
            a.n += 1
            rel = f"ns/a/late{a.n:06d}.kvf"
            a.store.put(rel, [_payload(rel)], overwrite=True)
            a.sb.wrote(rel, FILE)
            a.sb.evict(a.index.add(rel, FILE))

    early = inflight // 2
    land(early)  # land after b listed the root, while a is still the evictor
    a.sb.tick()  # a sees the newer lease and steps down
    assert not a.sb.is_evictor
    late = inflight - early
    h = b.sb.holding
    assert h is not None
    peak = 0
    for _ in range(24):
        b.sb.tick()
        _fill(b, "b")
        peak = max(peak, _kvf_bytes(root))
        a.sb.tick()
        v = h.views[a.sb.id]
        # The rest of a's stores land once b takes a to write under b's grants alone, and those allow less
        # than what is still in flight (the hole: b's grant and a's late writes together pass max_bytes).
        if late and v.ack is not None and v.ack[0] == h.gen and \
                max(g for seq, g in h.grants.items() if seq >= v.ack[1]) < late * FILE:
            land(late)
            late = 0
        _fill(a, "a")
        peak = max(peak, _kvf_bytes(root))
    assert late == 0, "the premise: b granted a less than a still had in flight"
    assert peak <= MAX, f"{(peak - MAX) // FILE} files over max_bytes after the lease moved"


def test_the_journal_says_what_is_in_flight_and_a_bad_or_huge_claim_holds_back_no_more_than_one_allowance(
        tmp_path: Path) -> None:
    root = str(tmp_path)
    a, b = _start(root)
    assert b.sb.may_write(FILE) is None and b.sb.may_write(FILE) is None  # two stores admitted, not written
    b.sb.tick()
    raw = Path(root, b.sb.journal_rel).read_bytes()
    assert json.loads(raw)["reserved"] == 2 * FILE and parse_journal(raw, 0).reserved == 2 * FILE
    doc = json.loads(raw)
    for bad in (-1, True, "4096", 1.5, (1 << 40) + 1):
        with pytest.raises(ControlRecordError) as e:
            parse_journal(json.dumps({**doc, "reserved": bad}).encode(), 0)
        assert e.value.why == "reserved"
    del doc["reserved"]
    assert parse_journal(json.dumps(doc).encode(), 0).reserved == 0  # an older version's journal
    a.sb.tick()
    h = a.sb.holding
    assert h is not None and h.views[b.sb.id].reserved == 2 * FILE
    h.views[b.sb.id].reserved = 1 << 40  # a peer claiming more than any grant
    assert a.sb.evictor._exposure(h, h.views[b.sb.id]) == a.sb.allowance
