"""KV events of store jobs that fail, on KVFormatTier's own write path (vLLM's real manager, a real I/O error).

vLLM's fs-tier tests check the same contract by replacing the fs tier's write function, which KVFormatTier
never calls (docs/vllm.md, "vLLM's own fs-tier tests"); here the error is real: the chunk's shard directory
is taken by a regular file, so creating the file under it fails with ENOTDIR.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by .ci/run")

from vllm_harness import Deployment, kvf, make_keys, payloads  # noqa: E402

from vllm.v1.kv_offload.base import Medium  # noqa: E402


def _split_keys(n_ok: int, n_bad: int) -> tuple[list, list]:
    """Keys whose files fall in different top-level shard directories: the bad ones share one, no good one
    is in it."""
    keys = make_keys(64, "events")
    bad_dir = keys[0][:1].hex()
    bad = [k for k in keys if k[:1].hex() == bad_dir][:n_bad]
    ok = [k for k in keys if k[:1].hex() != bad_dir][:n_ok]
    assert len(bad) == n_bad and len(ok) == n_ok
    return ok, bad


def _block_shard_dir(dep: Deployment, key: bytes) -> None:
    tier = dep.tier()
    rel = tier.engine.relpath(key[:-4].hex())  # <namespace>/<h[:2]>/<h[2:4]>/<h>.kvf
    ns, top = rel.split("/")[:2]
    shard = os.path.join(tier.store.root, ns, top)
    with open(shard, "wb") as f:
        f.write(b"not a directory")


def _stored_events(dep: Deployment) -> list[list]:
    return [list(e.keys) for e in dep.events() if e.medium == Medium.STORAGE and not e.removed]


@contextmanager
def _one_chunk_blocked(tmp_path) -> Iterator[tuple[Deployment, bytes, bytes, dict]]:
    """A deployment with KV events on, a good and a bad key (its shard directory taken), and their payloads."""
    (good,), (bad,) = _split_keys(1, 1)
    with Deployment([kvf(tmp_path, enable_kv_events=True)], n_layers=3, enable_kv_events=True,
                    num_chunks=8) as dep:
        assert dep.tier().wait_ready(10)
        _block_shard_dir(dep, bad)
        yield dep, good, bad, payloads(dep, [bad, good])


def test_a_partly_failed_store_job_announces_exactly_its_stored_chunks(tmp_path):
    with _one_chunk_blocked(tmp_path) as (dep, good, bad, items):
        assert dep.store(items) == [bad, good]  # one request, one store job of both chunks
        assert _stored_events(dep) == [[good]]
        assert dep.tier().counters()["store_failures:ENOTDIR"] == 1
        dep.evict_primary()
        assert dep.load([good, bad]) == {good: items[good], bad: None}


def test_of_a_failed_and_a_successful_store_job_only_the_successful_one_is_announced(tmp_path):
    with _one_chunk_blocked(tmp_path) as (dep, good, bad, items):
        dep.store({bad: items[bad]})
        dep.store({good: items[good]})
        assert _stored_events(dep) == [[good]]
