"""tools/dfs_history.py (the shared-root history oracle) on small synthetic histories: a clean one passes, and
each planted bug (wrong bytes, a lost durable store, the bound exceeded, no lease takeover, a wedged engine) fails.
"""

from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import dfs_history  # noqa: E402

CHUNK = 1000
BOUND = 10 * CHUNK


def clean() -> list[dict]:
    h: list[dict] = [{"op": "config", "bound": BOUND, "chunk": CHUNK, "engines": ["e0", "e1", "e2"],
                      "mounts": ["m0", "m1"], "rounds": 2, "start": 0.0}]
    h += [{"op": "sample", "t": t / 10, "usage": 5 * CHUNK, "lease_gen": 1 if t < 30 else 2,
           "lease_pid": 100 if t < 30 else 101, "state": f"s{t}"} for t in range(60)]
    h.append({"op": "fault", "kind": "kill", "target": "e0", "target_pid": 100, "start": 2.9, "end": 2.9})
    h += [{"op": "store", "engine": "e1", "key": "k1", "digest": "d1", "start": 1.0, "end": 1.1, "result": "durable"},
          {"op": "load", "engine": "e2", "key": "k1", "digest": "d1", "start": 1.05, "end": 1.2, "result": "hit"},
          {"op": "load", "engine": "e2", "key": "k9", "digest": None, "start": 1.3, "end": 1.4, "result": "miss"},
          {"op": "store", "engine": "e1", "key": "f1", "digest": "df", "start": 4.0, "end": 4.1, "result": "durable",
           "final": True},
          {"op": "load", "engine": "e2", "key": "f1", "digest": "df", "start": 5.0, "end": 5.1, "result": "hit",
           "final": True},
          {"op": "stored_final", "engine": "e1", "start": 4.2, "end": 4.2, "result": "ok"},
          {"op": "stored_final", "engine": "e2", "start": 4.2, "end": 4.2, "result": "ok"},
          {"op": "end", "start": 6.0, "wedged": [], "killed": ["e0"]}]
    return h


def test_clean_history_passes() -> None:
    out = dfs_history.check(clean())
    assert out["history_ok"], out
    assert out["wrong_bytes"] == 0 and out["lost_durable"] == 0 and out["wedged"] == 0
    assert out["lease_takeover_max_s"] is not None and out["lease_takeover_max_s"] <= 0.2


def test_wrong_bytes_fail() -> None:
    h = clean()
    next(r for r in h if r.get("op") == "load" and r["result"] == "hit")["digest"] = "d-other"
    out = dfs_history.check(h)
    assert out["wrong_bytes"] == 1 and not out["history_ok"]


def test_bytes_of_a_store_not_yet_started_fail() -> None:
    h = clean()
    next(r for r in h if r.get("op") == "store")["start"] = 1.3  # the hit ended before this store began
    out = dfs_history.check(h)
    assert out["wrong_bytes"] == 1 and not out["history_ok"]


def test_lost_durable_store_fails() -> None:
    h = clean()
    ld = next(r for r in h if r.get("op") == "load" and r.get("final"))
    extra = dict(ld, engine="e1", start=5.2, end=5.3)  # another engine finds it: one miss is no loss
    ld.update(result="miss", digest=None)
    out = dfs_history.check(h + [extra])
    assert out["history_ok"] and out["lost_durable"] == 0 and out["final_misses"] == 1, out
    out = dfs_history.check(h)
    assert out["lost_durable"] == 1 and not out["history_ok"]


def test_bytes_of_a_store_killed_in_flight_are_right() -> None:
    h = clean()
    h.append({"op": "store_begin", "engine": "e0", "key": "k9", "digest": "d9", "start": 1.25})
    h.append({"op": "load", "engine": "e2", "key": "k9", "digest": "d9", "start": 1.5, "end": 1.6, "result": "hit"})
    assert dfs_history.check(h)["history_ok"]


def test_bound_exceeded_by_more_than_a_chunk_per_writer_fails() -> None:
    h = clean()
    ok = copy.deepcopy(h)
    next(r for r in ok if r.get("op") == "sample")["usage"] = BOUND + 3 * CHUNK  # one chunk per writer: allowed
    assert dfs_history.check(ok)["history_ok"]
    next(r for r in h if r.get("op") == "sample")["usage"] = BOUND + 3 * CHUNK + 1
    out = dfs_history.check(h)
    assert out["bound_max_over_bytes"] == 3 * CHUNK + 1 and not out["history_ok"]


def test_no_takeover_after_kill_fails() -> None:
    h = clean()
    for r in h:
        if r.get("op") == "sample":
            r.update(lease_pid=100)  # the killed engine's lease is never taken over
    out = dfs_history.check(h)
    assert out["lease_takeover_max_s"] is None and not out["history_ok"]


def test_wedged_engine_fails() -> None:
    h = [r for r in clean() if not (r.get("op") == "stored_final" and r["engine"] == "e2")]
    out = dfs_history.check(h)
    assert out["wedged"] == 1 and not out["history_ok"]
