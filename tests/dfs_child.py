"""One vLLM engine process of tools/dfs_run.py (run as a script, not collected): a real KVFormatTier on one client
mount of a shared root, recording every operation in a JSONL history for tools/dfs_history.py.

argv: <repo root> <tests dir> <json config>: ``root``, ``tier``, ``seed``, ``rounds``, ``keys``, ``go``,
``history`` (the JSONL path this engine appends to), ``engine`` (its name in the history).

Each store writes a payload unique to (key, engine, round), so a load's digest names the one store it came from.
Planted bugs for the checker's own test (never set outside it), ``KVF_DFS_PLANT``:
``nolease``: the shared bound's lease and grants are switched off in this process (a build without the lease check);
``noverify``: a hit records the bytes of a store of another key (a load that skipped verification and returned
stale bytes of another file).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
import uuid

sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])

from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload  # noqa: E402

PLANT = os.environ.get("KVF_DFS_PLANT", "")
if PLANT == "nolease":
    from kvformat.cache import shared as _shared

    _shared.SharedBound.tick = lambda self: None  # type: ignore[method-assign]
    _shared.SharedBound.may_write = lambda self, n: None  # type: ignore[method-assign]
    _shared.SharedBound.may_read = lambda self, rel: True  # type: ignore[method-assign]

cfg = json.loads(sys.argv[3])
hist = open(cfg["history"], "a", buffering=1)
name = cfg["engine"]


def rec(**kw: object) -> None:
    hist.write(json.dumps({"engine": name, "pid": os.getpid(), **kw}) + "\n")


with Deployment([kvformat_tier(cfg["root"], read_threads=2, write_threads=2, **cfg["tier"])], n_layers=4,
                num_chunks=16, engine_id=f"kvft_dfs_{uuid.uuid4().hex[:10]}") as dep:
    tier = dep.tier()
    ready = tier.wait_ready(180)
    print(json.dumps({"ready": ready, "pid": os.getpid()}), flush=True)
    while not os.path.exists(cfg["go"]):
        time.sleep(0.005)
    keys = make_keys(cfg["keys"], "dfs-root")
    rng = random.Random(cfg["seed"])
    last_other: str | None = None
    for rnd in range(cfg["rounds"]):
        for k in rng.sample(keys, 2):
            payload = make_payload(f"{k.hex()}/{name}/{rnd}", dep.slot_bytes)
            dig = hashlib.sha256(payload).hexdigest()
            before = tier.counters()["files_written"]
            t0 = time.time()
            # The invocation first: a store in flight when this process is killed may still publish its file.
            rec(op="store_begin", key=k.hex(), digest=dig, start=t0)
            try:
                dep.store({k: payload})
                res = "durable" if tier.counters()["files_written"] > before else "not_stored"
            except Exception as e:  # noqa: BLE001 - the history records every outcome, the checker judges it
                res = f"error:{type(e).__name__}"
            rec(op="store", key=k.hex(), digest=dig, start=t0, end=time.time(), result=res)
            last_other = dig
        dep.evict_primary()
        for k in rng.sample(keys, 3):
            t0 = time.time()
            try:
                v = dep.load([k]).get(k)
                if v is None:
                    res, dig = "miss", None
                else:
                    res, dig = "hit", hashlib.sha256(v).hexdigest()
                    if PLANT == "noverify" and last_other is not None and rnd % 3 == 0:
                        dig = last_other
            except Exception as e:  # noqa: BLE001
                res, dig = f"error:{type(e).__name__}", None
            rec(op="load", key=k.hex(), digest=dig, start=t0, end=time.time(), result=res)
        dep.evict_primary()
        time.sleep(cfg.get("pause", 0.0))
    # The durability probe: one final key per engine, the newest files on the root (so an LRU bound keeps them),
    # stored, then loaded back by every engine once all have stored: each durable one must hit.
    # All engines' rounds end before any final store (a barrier the runner opens), so the final files are the
    # newest on the root and nothing the others still do moves them to the LRU tail.
    rec(op="rounds_done", start=time.time(), end=time.time(), result="ok")
    while not os.path.exists(cfg["go"] + ".store"):
        time.sleep(0.01)
    finals = make_keys(len(cfg["engines"]), "dfs-final")
    fk = finals[cfg["engines"].index(name)]
    payload = make_payload(f"{fk.hex()}/{name}/final", dep.slot_bytes)
    before = tier.counters()["files_written"]
    t0 = time.time()
    rec(op="store_begin", key=fk.hex(), digest=hashlib.sha256(payload).hexdigest(), start=t0)
    try:
        dep.store({fk: payload})
        res = "durable" if tier.counters()["files_written"] > before else "not_stored"
    except Exception as e:  # noqa: BLE001
        res = f"error:{type(e).__name__}"
    rec(op="store", key=fk.hex(), digest=hashlib.sha256(payload).hexdigest(), start=t0, end=time.time(),
        result=res, final=True)
    rec(op="stored_final", start=time.time(), end=time.time(), result="ok")
    while not os.path.exists(cfg["go"] + ".final"):
        time.sleep(0.01)
    dep.evict_primary()  # the final loads read the root, not this engine's CPU tier
    for k in finals:
        t0 = time.time()
        try:
            v = dep.load([k]).get(k)
            res, dig = ("miss", None) if v is None else ("hit", hashlib.sha256(v).hexdigest())
        except Exception as e:  # noqa: BLE001
            res, dig = f"error:{type(e).__name__}", None
        rec(op="load", key=k.hex(), digest=dig, start=t0, end=time.time(), result=res, final=True)
    rec(op="done", start=time.time(), end=time.time(), result="ok", counters=tier.counters())
    print(json.dumps({"done": True, "counters": tier.counters()}), flush=True)
