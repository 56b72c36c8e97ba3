"""Test-only broken tiers, to show the e2e run fails when the tier is wrong (issue 36, "must show"). Never
imported by kvformat; run_e2e.py points the tiering config at ``MutantKVFormatTier`` in this module when
KVFORMAT_E2E_MUTANT is set, and the engines find it on their PYTHONPATH.

* ``store_nothing``: every store job reports success and writes nothing (a tier that silently drops data);
* ``load_zeros``: every load job runs, then the rows it filled in vLLM's CPU tier are zeroed before vLLM sees the
  job finished (a tier that reports hits but hands the engine wrong KV).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from kvformat.vllm import KVFormatTier

MUTANTS = ("store_nothing", "load_zeros")


class MutantKVFormatTier(KVFormatTier):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mutant = os.environ.get("KVFORMAT_E2E_MUTANT", "")
        if self._mutant not in MUTANTS:
            raise ValueError(f"KVFORMAT_E2E_MUTANT must be one of {MUTANTS}, not {self._mutant!r}")
        self._faked: list[JobResult] = []
        self._load_rows: dict[Any, np.ndarray] = {}

    def submit_store(self, job_metadata: TransferJob) -> None:
        if self._mutant == "store_nothing":
            self._faked.append(JobResult(job_id=job_metadata.job_id, success=True, transfer_time=0.0,
                                         transfer_bytes=0))
            return
        super().submit_store(job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        if self._mutant == "load_zeros":
            self._load_rows[job_metadata.job_id] = np.asarray(job_metadata.chunk_ids).copy()
        super().submit_load(job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done = list(super().get_finished_jobs()) + self._faked
        self._faked = []
        for r in done:
            rows = self._load_rows.pop(r.job_id, None)
            if rows is not None:
                np.asarray(self._primary_kv_view)[rows] = 0
        return done

    def has_pending_work(self) -> bool:
        return bool(self._faked) or bool(super().has_pending_work())

