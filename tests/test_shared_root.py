"""One max_bytes for a root several engines share (issue 21 item 1): three engine processes on a local root (a
tmpfs mounted for the test, so statvfs gives every byte on it at once), the evictor killed with SIGKILL half-way.
The S3 run is tests/test_shared_root_s3.py; the helpers and what every run checks are in tests/shared_root.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from kvformat.cache.shared import STATE_FILE
from shared_root import FILE, MAX, Sampler, check, finish, start
from tmpfs_mount import tmpfs


@pytest.fixture
def tmpfs_root(tmp_path: Path):
    with tmpfs(tmp_path / "mnt", "size=64m,mode=0755", ": the exact usage sampling needs one") as root:
        yield root


def test_three_engines_one_bound_local_root_evictor_killed(tmpfs_root: str, tmp_path: Path) -> None:
    pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by tools/setup.sh")
    root, go = tmpfs_root, str(tmp_path / "go")

    def used() -> int:
        st = os.statvfs(root)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    procs = start(root, go, 3, 24, {})
    sampler = Sampler(used, 0.002)
    open(go, "w").close()
    time.sleep(3.0)
    state = json.loads(Path(root, STATE_FILE).read_text())
    victim = next(i for i, p in enumerate(procs) if p.pid == state["pid"])
    sampler.killed = True
    os.kill(procs[victim].pid, signal.SIGKILL)  # the evictor dies mid-run: its lease is taken over
    results = finish(procs, skip={victim})
    sampler.stop()
    after = json.loads(Path(root, STATE_FILE).read_text())
    total = check(results)
    overhead = 64 * 4096  # coordination files (lease, state, journals, namespace.json): whole tmpfs pages
    crashed = 2 * FILE  # the killed engine's temp files of writes in flight (2 write threads), until swept
    print(json.dumps({"max_bytes": MAX, "peak": sampler.peak, "peak_after_kill": sampler.peak_after_kill,
                      "samples": sampler.samples, "gen": [state["gen"], after["gen"]], **total}))
    assert after["gen"] > state["gen"] and after["pid"] != state["pid"]
    assert sampler.samples > 100
    assert sampler.peak <= MAX + overhead, (sampler.peak, MAX)
    assert sampler.peak_after_kill <= MAX + overhead + crashed, (sampler.peak_after_kill, MAX)
