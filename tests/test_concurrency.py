"""Concurrent deployments and gc (issue 7).

* Two processes storing the same keys into one root at the same moment: exactly one valid file per
  key, every store succeeds or skips (Store level, then two real vLLM deployments of different TP).
* gc running while readers load: each load returns the right bytes or a miss, never torn data
  (Store-level reader threads against a gc + re-writer process, then a vLLM deployment's tier loading
  while ``kvformat gc`` runs as a real process).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import uuid

import pytest

import kvformat as K
from kvformat.format._write import TMP_PREFIX, write_atomic
from kvformat import block_relpath
from kvformat.storage import LocalStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
SLOW = os.environ.get("KVFORMAT_SLOW") == "1"


def _layout() -> K.CanonicalLayout:
    return K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                                     [f"model.layers.{i}.self_attn.attn" for i in range(4)], 64, 576)


def _walk(root: str) -> tuple[list[str], list[str]]:
    finals, temps = [], []
    for d, _, names in os.walk(root):
        for n in names:
            if n.startswith(TMP_PREFIX):
                temps.append(os.path.join(d, n))
            elif n.endswith(".kvf"):
                finals.append(os.path.join(d, n))
    return finals, temps


STORE_CHILD = r"""
import json, os, random, sys, time
sys.path.insert(0, sys.argv[1])
import kvformat as K
from kvformat.storage import open_store
root, go, n, order, tp, codec = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
L = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16",
                              [f"model.layers.{i}.self_attn.attn" for i in range(4)], 64, 576)
st = open_store(root)
keys = list(range(n))
random.Random(order).shuffle(keys)
pays = {i: random.Random(i).randbytes(L.payload_bytes) for i in keys}
print("ready", flush=True)
while not os.path.exists(go):
    pass
written = errors = 0
for i in keys:
    try:
        st.ensure_namespace(L)
        _, _, w = st.put_block(pays[i], L, K.BlockKey(f"{i:064x}"), codec=codec, provenance=K.Provenance(tp=tp))
        written += w
    except Exception as e:
        errors += 1
        print("ERR", type(e).__name__, e, file=sys.stderr)
print(json.dumps({"written": written, "errors": errors}), flush=True)
"""


def _start(args: list[str]) -> subprocess.Popen:
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready", p.stderr.read() if p.stderr else ""
    return p


@pytest.mark.parametrize("order", ["same", "reversed", "shuffled"])
def test_two_processes_store_same_keys(tmp_path, order):
    """Two writers (TP 1 and TP 8 provenance, both codecs) race on 40 keys, 5 rounds: one valid file per key."""
    L = _layout()
    n = 40
    for rnd in range(5):
        root = str(tmp_path / f"r{rnd}")
        go = str(tmp_path / f"go{rnd}")
        orders = {"same": (1, 1), "reversed": (1, 2), "shuffled": (10 + rnd, 20 + rnd)}[order]
        procs = [_start([sys.executable, "-c", STORE_CHILD, ROOT, root, go, str(n), str(o), str(tp), codec])
                 for o, tp, codec in zip(orders, (1, 8), ("none", "zstd"))]
        open(go, "w").close()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-2000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        assert all(r["errors"] == 0 for r in results), results  # both succeed or skip
        assert sum(r["written"] for r in results) == n  # each key written exactly once
        finals, temps = _walk(root)
        assert temps == [] and len(finals) == n
        out = bytearray(L.payload_bytes)
        for i in range(n):
            key = K.BlockKey(f"{i:064x}")
            K.read_into(os.path.join(root, block_relpath(L, key)), out, expect=L, key=key)
            assert bytes(out) == random.Random(i).randbytes(L.payload_bytes)
        assert json.load(open(os.path.join(root, L.namespace(), "namespace.json")))["namespace"] == L.namespace()


GC_CHILD = r"""
import os, random, shutil, sys, time
sys.path.insert(0, sys.argv[1])
from kvformat.admin._gc import run_gc
from kvformat.format._write import write_atomic
from kvformat.storage import LocalStore
root, backup, stop, max_bytes = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
st = LocalStore(root)
rng = random.Random(5)
rels = [os.path.relpath(os.path.join(d, n), backup) for d, _, ns in os.walk(backup) for n in ns if n.endswith(".kvf")]
print("ready", flush=True)
rounds = 0
while not os.path.exists(stop):
    run_gc(st, max_bytes)                      # unlink least recently used files
    for rel in rng.sample(rels, len(rels) // 2):  # another writer puts some back (temp + rename, or overwrite)
        with open(os.path.join(backup, rel), "rb") as f:
            data = f.read()
        write_atomic(os.path.join(root, rel), [data], overwrite=rng.random() < 0.5)
    rounds += 1
print(rounds, flush=True)
"""


def test_gc_while_store_readers_load(tmp_path):
    """Reader threads load while a gc process deletes and a writer re-creates files: right bytes or a miss."""
    L = _layout()
    root, backup, stop = str(tmp_path / "root"), str(tmp_path / "backup"), str(tmp_path / "stop")
    n = 24
    bst = LocalStore(backup)
    pays = {i: random.Random(i).randbytes(L.payload_bytes) for i in range(n)}
    for i in range(n):
        bst.put_block(pays[i], L, K.BlockKey(f"{i:064x}"), codec="zstd" if i % 3 == 0 else "none")
    size = os.path.getsize(_walk(backup)[0][0])
    st = LocalStore(root)
    for i in range(n):
        st.put_block(pays[i], L, K.BlockKey(f"{i:064x}"), codec="zstd" if i % 3 == 0 else "none")
    gc = _start([sys.executable, "-c", GC_CHILD, ROOT, root, backup, stop, str(size * 4)])
    counts = {"hit": 0, "miss": 0}
    errors: list[str] = []
    lock = threading.Lock()
    deadline_loads = 1500 if not SLOW else 15000

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        out = bytearray(L.payload_bytes)
        for j in range(20 * deadline_loads):
            # At least deadline_loads/2 loads each, and on until both outcomes were seen (a loaded machine).
            if j >= deadline_loads // 2 and counts["hit"] and counts["miss"]:
                break
            i = rng.randrange(n)
            key = K.BlockKey(f"{i:064x}")
            try:
                st.read_into(block_relpath(L, key), out, expect=L, key=key)
            except FileNotFoundError:
                with lock:
                    counts["miss"] += 1
                continue
            except Exception as e:  # a torn or half-deleted file would land here
                errors.append(f"{type(e).__name__}: {e}")
                return
            if bytes(out) != pays[i]:
                errors.append(f"wrong bytes for key {i}")
                return
            with lock:
                counts["hit"] += 1

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    open(stop, "w").close()
    out, err = gc.communicate(timeout=60)
    assert gc.returncode == 0, err[-2000:]
    print(json.dumps({**counts, "gc_rounds": int(out.split()[-1])}))
    assert errors == []
    # Both outcomes happened: gc really raced the loads (else this test would prove nothing).
    assert counts["hit"] > 0 and counts["miss"] > 0 and int(out.split()[-1]) >= 1


# -- real vLLM deployments ------------------------------------------------------------------------------

TIER_CHILD = r"""
import json, os, sys, time, uuid
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload
root, go, tp, replicated, n = sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6] == "1", int(sys.argv[7])
with Deployment([kvformat_tier(root, read_threads=2, write_threads=4)], tp=tp, replicated=replicated, n_layers=3,
                num_chunks=16, engine_id=f"kvft_cc_{uuid.uuid4().hex[:10]}") as dep:
    tier = dep.tier()
    jobs = []
    orig = tier.get_finished_jobs
    def recording():  # observe the job results the manager receives
        r = list(orig())
        jobs.extend(r)
        return r
    tier.get_finished_jobs = recording
    keys = make_keys(n, "concurrent")
    items = {k: make_payload(k.hex(), dep.slot_bytes) for k in keys}
    if tp == 1:
        keys = keys[::-1]  # the two meet in the middle, so both write and both find the other's files
    tier.wait_scanned(30)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.0005)
    dep.store(items)
    dep.evict_primary()
    got = dep.load(keys)
    c = tier.counters()
    print(json.dumps({"jobs": len(jobs), "failed_jobs": sum(not j.success for j in jobs),
                      "written": c["files_written"], "corrupt": c["corrupt_files"],
                      "loaded_ok": sum(got[k] == items[k] for k in keys)}), flush=True)
"""


def test_two_vllm_deployments_store_same_keys(tmp_path):
    """TP=8 per-worker rows and TP=1 replicated rows, two processes, same 24 keys at once, one root."""
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is installed by .ci/run")
    root, go, n = str(tmp_path / "root"), str(tmp_path / "go"), 24
    procs = []
    for tp, rep in ((8, "0"), (1, "1")):
        procs.append(subprocess.Popen([sys.executable, "-c", TIER_CHILD, ROOT, TESTS, root, go, str(tp), rep, str(n)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:  # both have imported vLLM and built their deployment before either stores
        line = p.stdout.readline() if p.stdout else ""
        assert line.strip() == "ready", (line, p.stderr.read()[-3000:] if p.stderr else "")
    open(go, "w").close()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(json.dumps(results))
    assert all(r["failed_jobs"] == 0 and r["jobs"] > 0 for r in results), results  # succeed or skip
    assert sum(r["written"] for r in results) == n  # one file per key, whoever was first
    assert all(r["corrupt"] == 0 and r["loaded_ok"] == n for r in results), results
    finals, temps = _walk(root)
    assert len(finals) == n and temps == []
    for p in finals:
        K.read_into(p, bytearray(K.read_header(p).raw_bytes))


def test_kvformat_gc_process_while_tier_loads(tmp_path):
    """A vLLM deployment loads in a loop while ``kvformat gc`` (a real process) evicts and a writer
    re-creates files: every load is the right bytes or a miss; nothing is quarantined as corrupt."""
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is installed by .ci/run")
    from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload

    root, backup, stop = str(tmp_path / "root"), str(tmp_path / "backup"), str(tmp_path / "stop")
    with Deployment([kvformat_tier(root, read_threads=4, write_threads=2)], tp=2, replicated=False, n_layers=3,
                    num_chunks=16, engine_id=f"kvft_gc_{uuid.uuid4().hex[:10]}") as dep:
        keys = make_keys(12, "gcrace")
        items = {k: make_payload(k.hex(), dep.slot_bytes) for k in keys}
        dep.store(items)
        finals = _walk(root)[0]
        assert len(finals) == len(keys)
        for p in finals:  # the pristine copies the re-writer puts back
            dst = os.path.join(backup, os.path.relpath(p, root))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(p, "rb") as f:
                write_atomic(dst, [f.read()])
        size = os.path.getsize(finals[0])
        cli = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from kvformat.cli import main; "
               "sys.exit(main(sys.argv[2:]))", ROOT, "gc", root, "--max-bytes", str(size * 3)]
        restorer = threading.Event()
        gc_runs = {"n": 0, "rc": []}

        def churn() -> None:
            rng = random.Random(3)
            rels = [os.path.relpath(p, backup) for p in _walk(backup)[0]]
            while not restorer.is_set():
                r = subprocess.run(cli, capture_output=True, text=True, timeout=60)
                gc_runs["n"] += 1
                gc_runs["rc"].append(r.returncode)
                for rel in rng.sample(rels, len(rels) // 2):
                    with open(os.path.join(backup, rel), "rb") as f:
                        write_atomic(os.path.join(root, rel), [f.read()], overwrite=rng.random() < 0.5)

        t = threading.Thread(target=churn)
        t.start()
        hits = misses = 0
        try:
            for j in range(5000):
                # 200 rounds (2000 slow), and on until gc ran twice and both outcomes were seen.
                if j >= (200 if not SLOW else 2000) and gc_runs["n"] >= 2 and hits and misses:
                    break
                dep.evict_primary()
                got = dep.load(keys)
                for k in keys:
                    if got[k] is None:
                        misses += 1
                    else:
                        assert got[k] == items[k]  # never torn or foreign bytes
                        hits += 1
        finally:
            restorer.set()
            t.join()
        c = dep.tier().counters()
        print(json.dumps({"hits": hits, "misses": misses, "gc_runs": gc_runs["n"], **c}))
        assert set(gc_runs["rc"]) == {0} and gc_runs["n"] >= 2
        assert hits > 0 and misses > 0  # gc really raced the loads
        assert c["corrupt_files"] == 0 and c["checksum_failures"] == 0  # no load ever saw a torn file
        assert not os.path.exists(os.path.join(root, ".quarantine"))
