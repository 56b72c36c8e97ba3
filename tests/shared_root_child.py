"""One vLLM engine process for tests/test_shared_root.py (run as a script, not collected).

argv: <repo root> <tests dir> <json config>. The config: ``root``, ``tier`` (extra tier parameters), ``seed``,
``rounds``, ``keys`` (size of the key space all engines share), ``go`` (a path: start when it exists).

Drives vLLM's real TieringOffloadingManager with a KVFormatTier: waits until the tier is ready (admitted by the
root's evictor), prints {"ready": ..., "pid": ...}, waits for ``go``, then each round stores 4 keys of the
shared key space, drops the CPU tier and loads 6 keys (stored by any engine), checking every hit byte for byte.
Prints one JSON line with the outcome and the tier's counters.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
import uuid

sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])

from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload  # noqa: E402

cfg = json.loads(sys.argv[3])
# The tier's log on stderr with this process's clock: the test shows it when a run fails (who held the lease when).
logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d ms %(message)s")
with Deployment([kvformat_tier(cfg["root"], read_threads=2, write_threads=2, **cfg["tier"])], n_layers=4,
                num_chunks=16, engine_id=f"kvft_sh_{uuid.uuid4().hex[:10]}") as dep:
    tier = dep.tier()
    ready = tier.wait_ready(180)
    print(json.dumps({"ready": ready, "pid": os.getpid(), "evictor": tier.ops.shared.is_evictor}), flush=True)
    while not os.path.exists(cfg["go"]):
        time.sleep(0.005)
    keys = make_keys(cfg["keys"], "shared-root")
    items = {k: make_payload(k.hex(), dep.slot_bytes) for k in keys}
    rng = random.Random(cfg["seed"])
    hits = misses = wrong = 0
    for _ in range(cfg["rounds"]):
        dep.store({k: items[k] for k in rng.sample(keys, 4)})
        dep.evict_primary()
        for k, v in dep.load(rng.sample(keys, 6)).items():
            if v is None:
                misses += 1
            elif v == items[k]:
                hits += 1
            else:
                wrong += 1
        time.sleep(cfg.get("pause", 0.0))  # pace the rounds to the evictor's passes (allowance per pass)
    time.sleep(3 * tier.config.shared_interval_s)  # the last journal merged, the last dooms deleted
    print(json.dumps({"hits": hits, "misses": misses, "wrong": wrong, "evictor": tier.ops.shared.is_evictor,
                      "counters": tier.counters()}), flush=True)
