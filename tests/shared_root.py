"""Helpers of tests/test_shared_root.py (local root) and tests/test_shared_root_s3.py: engine processes
(tests/shared_root_child.py) on one bounded root, a usage sampler, and the checks every run makes.

The engines store and load overlapping keys on one bounded root while the test samples the bytes on storage. The
bytes never exceed max_bytes (cache/shared/, spec/GUARANTEES.md G-8), every load is the right bytes or a miss, and
no load finds its file deleted under it (``missing_files`` and ``io_errors`` stay 0 on every engine although the
evictor deletes files the others have indexed and read).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
CHILD = os.path.join(TESTS, "shared_root_child.py")
FILE = 4 * 16 * 576 * 2 + 4096  # one chunk file: 4 layers x 16 tokens x 576 bf16 + the 4 KiB header region
MAX = 20 * FILE
ALLOWANCE = 3 * FILE
INTERVAL = 0.2


def start(root: str, go: str, n: int, rounds: int, tier: dict) -> list[subprocess.Popen]:
    procs = []
    for i in range(n):
        cfg = {"root": root, "go": go, "seed": i, "rounds": rounds, "keys": 60, "pause": INTERVAL,
               "tier": {"max_bytes": MAX, "shared_allowance": ALLOWANCE, "shared_interval_s": INTERVAL, **tier}}
        procs.append(subprocess.Popen([sys.executable, CHILD, ROOT, TESTS, json.dumps(cfg)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        line = p.stdout.readline() if p.stdout else ""
        assert line.startswith("{"), (line, p.stderr.read()[-3000:] if p.stderr else "")
        assert json.loads(line)["ready"], line
    return procs


def finish(procs: list[subprocess.Popen], skip: set[int] = frozenset()) -> list[dict]:
    out = []
    for i, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=300)
        if i in skip:
            continue
        assert p.returncode == 0, stderr[-4000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
        out[-1]["log"] = [line for line in stderr.splitlines() if "KVFormatTier" in line][-30:]
    return out


class Sampler:
    """Samples a usage function every few ms in a thread; ``peak`` is the largest value seen."""

    def __init__(self, usage, period: float) -> None:
        self.usage, self.period = usage, period
        self.peak = self.samples = 0
        self.peak_after_kill = 0
        self.killed = False
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            u = self.usage()
            self.samples += 1
            if self.killed:
                self.peak_after_kill = max(self.peak_after_kill, u)
            else:
                self.peak = max(self.peak, u)
            time.sleep(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def check(results: list[dict]) -> dict:
    total = {"hits": sum(r["hits"] for r in results), "misses": sum(r["misses"] for r in results),
             "wrong": sum(r["wrong"] for r in results)}
    for k in ("evictions", "missing_files", "io_errors", "corrupt_files", "files_written", "store_failures"):
        total[k] = sum(r["counters"][k] for r in results)
    reasons: dict[str, int] = {}
    for r in results:
        for k, v in r["counters"].items():
            if k.startswith("store_failures:"):
                reasons[k.split(":", 1)[1]] = reasons.get(k.split(":", 1)[1], 0) + v
    total["store_failures_by_reason"] = reasons
    assert total["wrong"] == 0 and total["corrupt_files"] == 0
    # The evictor deleted files the other engines had indexed and loaded, yet no load ever found its file gone.
    assert total["missing_files"] == 0 and total["io_errors"] == 0, (total, [r["log"] for r in results])
    assert total["evictions"] > 0 and total["hits"] > 0 and total["misses"] > 0, total
    return total


