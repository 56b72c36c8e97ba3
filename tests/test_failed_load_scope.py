"""A failed load is a miss as wide as its cause (issue 32), through vLLM's real tiering manager and tier API.

vLLM's own tiers override only the failing request's cached verdict (``AsyncLookupManager.mark_miss``); a fresh
request probes again. So: a destination the caller got wrong (no file read) is a miss for that request only; a
corrupt file is quarantined, a miss for everyone; a read that fails once (EIO) is a miss for that request and a
hit for the next, the file being fine.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by tools/setup.sh")

from faulty_fs import FaultyFS  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm_harness import Deployment, kvformat_tier, make_keys, make_payload  # noqa: E402

N_LAYERS = 2


def _job(job_id: int, keys: list[Any], chunk_ids: list[int], ctx: ReqContext) -> TransferJob:
    # vLLM 0.33's TransferJob has no req_context: pass only the fields this vLLM has.
    have = {f.name for f in dataclasses.fields(TransferJob)}
    kw: dict[str, Any] = {"job_id": job_id, "keys": keys, "chunk_ids": np.array(chunk_ids, dtype=np.int64),
                          "is_promotion": True, "req_context": ctx}
    return TransferJob(**{k: v for k, v in kw.items() if k in have})


def _load_in(tier: Any, ctx: ReqContext, key: Any, chunk_id: int, job_id: int) -> Any:
    tier.submit_load(_job(job_id, [key], [chunk_id], ctx))
    tier.drain_jobs()
    (res,) = list(tier.get_finished_jobs())
    return res


def _stored(tmp_path: Path, dep: Deployment, tag: str) -> tuple[Any, bytes, Any]:
    key = make_keys(1, tag)[0]
    data = make_payload(tag, dep.slot_bytes)
    assert dep.store({key: data}) == [key]
    dep.evict_primary()  # later loads come from the tier
    return key, data, dep.tier()


def test_a_destination_failure_is_a_miss_for_that_request_only(tmp_path: Path) -> None:
    with Deployment([kvformat_tier(str(tmp_path))], n_layers=N_LAYERS) as dep:
        key, data, tier = _stored(tmp_path, dep, "dest")
        r1 = ReqContext(req_id="r1")
        tier.on_new_request(r1)
        assert tier.lookup(key, r1) is LookupResult.HIT
        res = _load_in(tier, r1, key, dep.num_chunks + 5, 900_001)  # a chunk outside the primary: no file read
        assert not res.success
        assert tier.lookup(key, r1) is LookupResult.MISS  # the failing request does not retry it
        r2 = ReqContext(req_id="r2")
        assert tier.lookup(key, r2) is LookupResult.HIT  # a fresh request is not poisoned by r1's failure
        tier.on_request_finished(r1)
        assert tier.counters()["corrupt_files"] == 0 and not (tmp_path / ".quarantine").exists()
        assert dep.load([key])[key] == data  # vLLM's manager promotes it, bytes intact


def test_a_corrupt_file_is_a_miss_for_every_request_and_quarantined(tmp_path: Path) -> None:
    with Deployment([kvformat_tier(str(tmp_path))], n_layers=N_LAYERS) as dep:
        key, _, tier = _stored(tmp_path, dep, "corrupt")
        (path,) = [p for p in tmp_path.rglob("*.kvf") if ".quarantine" not in p.parts]
        with open(path, "r+b") as f:  # one payload byte flipped: the checksum catches it
            f.seek(-1, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([b[0] ^ 0xFF]))
        assert dep.load([key])[key] is None  # request 1: a miss, never the bad bytes
        assert not path.exists() and any((tmp_path / ".quarantine").rglob("*"))
        assert tier.counters()["corrupt_files"] == 1
        assert dep.lookup_once(key) is not LookupResult.HIT  # request 2: a miss too
        assert dep.load([key])[key] is None


def test_a_read_that_fails_once_is_a_miss_for_that_request_then_a_hit(tmp_path: Path) -> None:
    why = FaultyFS.mount_error()
    if why:
        pytest.skip(f"no FUSE view here: {why}")
    root = tmp_path / "root"
    with Deployment([kvformat_tier(str(root))], n_layers=N_LAYERS) as dep:
        key, data, tier = _stored(tmp_path, dep, "eio")
        (path,) = list(root.rglob("*.kvf"))
        backing = tmp_path / "backing"
        shutil.copytree(path.parent, backing)
        r1 = ReqContext(req_id="r1")
        tier.on_new_request(r1)
        assert tier.lookup(key, r1) is LookupResult.HIT
        # The file's directory, seen through a view whose every read fails with EIO (a bad sector, a dropped
        # NFS server), for this one load; unmounted, the very same file reads fine again.
        with FaultyFS(str(backing), str(path.parent), eio_from=0):
            res = _load_in(tier, r1, key, 0, 900_002)
        assert not res.success and tier.counters()["io_errors"] == 1
        assert tier.lookup(key, r1) is LookupResult.MISS  # that request: a miss
        tier.on_request_finished(r1)
        assert path.exists() and tier.counters()["corrupt_files"] == 0  # an I/O error condemns no file
        assert dep.load([key])[key] == data  # the next request: a hit, the bytes intact
