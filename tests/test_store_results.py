"""A store job reports success only when every chunk is on storage (real vLLM manager, real files)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by .ci/run")

from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload  # noqa: E402

from kvformat.storage._local import LocalStore  # noqa: E402


def recording(tier: Any) -> list[Any]:
    """Record every JobResult the real get_finished_jobs hands to vLLM's manager."""
    seen: list[Any] = []
    real = tier.get_finished_jobs

    def get_finished_jobs() -> Any:
        out = list(real())
        seen.extend(out)
        return out

    tier.get_finished_jobs = get_finished_jobs
    return seen


def test_store_job_of_written_chunks_succeeds(tmp_path):
    with Deployment([kvformat_tier(str(tmp_path))], n_layers=2) as dep:
        seen = recording(dep.tier())
        keys = make_keys(2, "ok")
        dep.store({k: make_payload(k.hex(), dep.slot_bytes) for k in keys})
        dep.store({k: make_payload(k.hex(), dep.slot_bytes) for k in keys[:1]})  # EXISTS is stored too
        assert seen and all(r.success for r in seen)


def test_store_job_with_a_replica_mismatch_fails(tmp_path):
    with Deployment([kvformat_tier(str(tmp_path))], tp=2, replicated=False, n_layers=2) as dep:
        seen = recording(dep.tier())
        good, bad = make_keys(2, "mismatch")
        payload = make_payload("good", dep.slot_bytes)
        dep.store({good: payload, bad: [make_payload("w0", dep.slot_bytes), make_payload("w1", dep.slot_bytes)]})
        assert len(seen) == 1 and not seen[0].success  # one job, half of it not stored
        assert dep.tier().counters()["files_written"] == 1
        dep.evict_primary()  # the manager took the failure in its stride: the stored half loads
        assert dep.load([good, bad], timeout=20) == {good: payload, bad: None}


class RefusingStore(LocalStore):
    """Another writer always wins and its file never becomes readable: every attempt ends FAILED."""

    def put(self, relpath: str, parts: list[Any], *, overwrite: bool = False, fsync: bool = False) -> bool:
        return False


def test_store_job_whose_chunk_ended_failed_fails(tmp_path):
    with Deployment([kvformat_tier(str(tmp_path))], n_layers=2) as dep:
        tier = dep.tier()
        assert tier.wait_scanned(30)
        tier.store = tier.engine.store = RefusingStore(str(tmp_path))
        seen = recording(tier)
        key = make_keys(1, "failed")[0]
        dep.store({key: make_payload("x", dep.slot_bytes)})
        assert len(seen) == 1 and not seen[0].success
        assert tier.counters()["files_written"] == 0
