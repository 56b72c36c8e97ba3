"""KVFormatTier.shutdown is bounded and fails queued jobs (each reported exactly once), on real vLLM classes.

The tier's store is swapped for a real LocalStore whose put waits at a gate (a threading.Event), so
"storage is slow" is a forced state, not a sleep.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by .ci/run")

from vllm_harness import Deployment, kvformat_tier, make_keys  # noqa: E402

from kvformat.storage._local import LocalStore  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

WAIT = 60.0


class SlowStore(LocalStore):
    """Every put waits for ``open`` (storage that does not answer); counts the puts that started."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.open = threading.Event()
        self.started = threading.Semaphore(0)
        self.puts = 0
        self._lock = threading.Lock()

    def put(self, relpath: str, parts: list[Any], *, overwrite: bool = False, fsync: bool = False) -> bool:
        with self._lock:
            self.puts += 1
        self.started.release()
        assert self.open.wait(WAIT)
        return super().put(relpath, parts, overwrite=overwrite, fsync=fsync)


def job(job_id: int, keys: list, chunks: list[int], load: bool) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunks, dtype=np.int64), is_promotion=load,
                       req_context=ReqContext(req_id=f"r{job_id}"))


def slow_tier(dep: Deployment, timeout_s: float) -> tuple[Any, SlowStore]:
    tier = dep.tier()
    assert tier.wait_scanned(WAIT)
    slow = SlowStore(tier.store.root)
    tier.store = tier.engine.store = slow
    tier.shutdown_timeout_s = timeout_s
    return tier, slow


def results(tier: Any) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for r in tier.get_finished_jobs():
        assert r.job_id not in out, f"job {r.job_id} reported twice"
        out[r.job_id] = r
    return out


def test_shutdown_fails_queued_jobs_instead_of_draining_them_and_is_bounded(tmp_path):
    keys = make_keys(6, "shut")
    with Deployment([kvformat_tier(str(tmp_path), read_threads=1, write_threads=1)], n_layers=2,
                    num_chunks=8) as dep:
        tier, slow = slow_tier(dep, timeout_s=0.2)
        tier.submit_store(job(1, keys[:4], [0, 1, 2, 3], load=False))
        for _ in range(2):  # both threads are inside a put that storage does not answer
            assert slow.started.acquire(timeout=WAIT)
        tier.submit_load(job(2, keys[4:], [4, 5], load=True))
        stopper = threading.Thread(target=tier.shutdown, daemon=True)
        stopper.start()
        stopper.join(WAIT)
        assert not stopper.is_alive()  # returned while storage still hangs: bounded
        done = results(tier)
        assert set(done) == {2} and not done[2].success and not done[2].successful_keys  # the queued load
        slow.open.set()  # storage answers: the two running puts finish, the two queued ones never start
        for t in tier._pool._threads:
            t.join(WAIT)
        done = results(tier)
        assert set(done) == {1} and not done[1].success
        assert slow.puts == 2
        # a job submitted after shutdown fails at once, reported once
        tier.submit_store(job(3, keys[4:5], [6], load=False))
        tier.submit_load(job(4, keys[:1], [7], load=True))
        done = results(tier)
        assert set(done) == {3, 4} and not done[3].success and not done[4].success
        assert results(tier) == {}


def test_shutdown_waits_for_running_jobs_within_the_bound(tmp_path):
    keys = make_keys(3, "shut2")
    with Deployment([kvformat_tier(str(tmp_path), read_threads=1, write_threads=1)], n_layers=2,
                    num_chunks=4) as dep:
        tier, slow = slow_tier(dep, timeout_s=WAIT)
        tier.submit_store(job(1, keys[:1], [0], load=False))
        assert slow.started.acquire(timeout=WAIT)
        tier.submit_store(job(2, keys[1:3], [1, 2], load=False))  # the reader thread takes one, one may queue
        stopper = threading.Thread(target=tier.shutdown, daemon=True)
        stopper.start()
        slow.open.set()
        stopper.join(WAIT)
        assert not stopper.is_alive()
        done = results(tier)
        assert set(done) == {1, 2}
        assert done[1].success  # it was running: shutdown let it finish (never half a file)
        assert done[2].success == (slow.puts == 3)  # queued chunks failed, not drained
        assert len(list(tmp_path.rglob("*.kvf"))) == slow.puts
        assert tier.engine.flat.nbytes == 0  # every thread ended: the primary buffer was released
