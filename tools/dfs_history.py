"""Check a shared-root history (tools/dfs_run.py's JSONL) as an independent oracle: no kvformat import, only the
records and the digests each writer took of the engine row it stored.

    python tools/dfs_history.py HISTORY.jsonl [--fs NAME] [--clients N] [--takeover-limit-s S]

Rules (each violation counted):
* wrong_bytes: a hit whose digest is not that of a store of the same key invoked before the load ended
  (completed or in flight: writers record the invocation first).
* lost_durable: a final store reported durable, by an engine neither killed nor on a torn mount, that no later
  final load (by such an engine, the writer included) finds. The final keys are the newest files of the run, one
  per engine, far under the bound, so an LRU bound never evicts them.
* bound: the largest sampled .kvf bytes over the bound may exceed it by at most one chunk per writer.
* lease takeover: after each fault, a live engine holds the lease and publishes a new state within the limit
  (kill: a holder other than the killed one; others: any state change after the fault ended); each fault's time
  is listed in ``takeover_each_s`` (None: never seen).
* wedged: an engine not killed that did not finish (the run's end record) or never wrote its final records.
Prints one JSON line; exits 1 when the history is not OK.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def check(records: list[dict[str, Any]], *, fs: str = "moosefs", clients: int = 0,
          takeover_limit_s: float = 30.0) -> dict[str, Any]:
    cfg = next(r for r in records if r.get("op") == "config")
    end = next((r for r in records if r.get("op") == "end"), {"wedged": [], "killed": []})
    faults = [r for r in records if r.get("op") == "fault"]
    samples = sorted((r for r in records if r.get("op") == "sample"), key=lambda r: r["t"])
    stores = [r for r in records if r.get("op") == "store"]
    # An invoked store counts for the bytes a hit may return even when it never completed (killed in flight).
    begun = stores + [r for r in records if r.get("op") == "store_begin"]
    loads = [r for r in records if r.get("op") == "load"]
    killed = set(end.get("killed", [])) | {f["target"] for f in faults if f["kind"] == "kill" and f.get("target")}
    torn = {f["target"]: f["start"] for f in faults if f["kind"] == "umount" and f.get("target")}

    by_key: dict[str, list[dict[str, Any]]] = {}
    for s in begun:
        by_key.setdefault(s["key"], []).append(s)
    wrong = 0
    for ld in loads:
        if ld["result"] != "hit":
            continue
        if not any(s["digest"] == ld["digest"] and s["start"] <= ld["end"] for s in by_key.get(ld["key"], [])):
            wrong += 1

    def trusted(engine: str) -> bool:
        return engine not in killed and engine not in torn

    # A cache may miss (a follower with a stale view of the state serves misses by design), so a durable final store
    # is lost only when no trusted engine (the writer included) loads it afterwards; every single miss of one is
    # counted apart (final_misses) as the cost of the filesystem's and the lease's delays.
    lost = final_misses = 0
    for s in stores:
        if not s.get("final") or s["result"] != "durable" or not trusted(s["engine"]):
            continue
        after = [ld for ld in loads if ld.get("final") and ld["key"] == s["key"] and ld["start"] > s["end"]
                 and trusted(ld["engine"])]
        final_misses += sum(ld["result"] != "hit" for ld in after)
        if after and not any(ld["result"] == "hit" for ld in after):
            lost += 1

    bound, chunk = cfg["bound"], cfg["chunk"]
    peak = max((r["usage"] for r in samples), default=0)
    over = max(0, peak - bound)
    writers = len(cfg["engines"])

    takeover = 0.0
    each: list[list[Any]] = []  # [kind, seconds or None] per fault: which fault a violation came from
    for f in faults:
        before = [r for r in samples if r["t"] <= f["start"]]
        st0 = before[-1]["state"] if before else None
        t_from = f["start"] if f["kind"] == "kill" else f["end"]
        got = None
        for r in samples:
            if r["t"] < f["end"] or r["state"] is None or r["state"] == st0:
                continue
            if f["kind"] == "kill" and r["lease_pid"] == f.get("target_pid"):
                continue
            got = r["t"] - t_from
            break
        takeover = max(takeover, got if got is not None else float("inf"))
        each.append([f["kind"], round(got, 2) if got is not None else None])

    final_done = {r["engine"] for r in records if r.get("op") == "stored_final"}
    wedged = set(end.get("wedged", [])) | {e for e in cfg["engines"] if e not in killed and e not in final_done}
    ok = (wrong == 0 and lost == 0 and over <= writers * chunk and takeover <= takeover_limit_s and not wedged
          and bool(samples) and any(ld["result"] == "hit" for ld in loads))
    return {"fs": fs, "clients": clients or len(cfg.get("mounts", [])), "rounds": cfg["rounds"],
            "faults": len(faults), "wrong_bytes": wrong, "lost_durable": lost, "bound_max_over_bytes": over,
            "bound_bytes": bound, "lease_takeover_max_s": round(takeover, 2) if takeover != float("inf") else None,
            "wedged": len(wedged), "history_ok": ok, "final_misses": final_misses, "takeover_each_s": each}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("history")
    ap.add_argument("--fs", default="moosefs")
    ap.add_argument("--clients", type=int, default=0)
    ap.add_argument("--takeover-limit-s", type=float, default=30.0)
    a = ap.parse_args(argv)
    with open(a.history) as f:
        records = [json.loads(ln) for ln in f if ln.strip()]
    out = check(records, fs=a.fs, clients=a.clients, takeover_limit_s=a.takeover_limit_s)
    print(json.dumps(out))
    return 0 if out["history_ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
