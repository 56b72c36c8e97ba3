"""The secondary-tier contract vLLM 0.34 added, through vLLM's real manager and its real KV event tracker.

* stored events carry the request context (0.34), ``ownership`` and ``removal_expected``, so vLLM's
  ``OffloadingEventsTracker`` records kvformat as a holder of each chunk: after the CPU tier drops a chunk
  the tracker keeps its block hashes, and kvformat's eviction is announced with every block hash of the
  chunk (not a placeholder made of the offload key);
* a CPU-tier hit (which never reaches a secondary tier's ``lookup``) refreshes kvformat's LRU order when
  the request finishes;
* kvformat's own stores are answered from its index, so ``AsyncLookupManager.mark_present`` would save no
  lookup (docs/vllm.md says why it is not called); this test pins that down.

Every test runs on 0.33 too: where 0.33 differs (its tracker takes request data from the scheduler's
``record_store`` instead of the event's ``req_context``), the test feeds it the way 0.33's scheduler does.
"""

from __future__ import annotations

import hashlib
import os
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by tools/setup.sh")

import vllm  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (  # noqa: E402
    OffloadingEventGroupSpec, OffloadingEventsTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import GroupOffloadConfig  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult, Medium, OffloadingEvent, OffloadingKVEventsConfig, ReqContext, get_offload_block_hash,
    make_offload_key,
)
from vllm_harness import _STEP, Deployment, kvformat_tier, make_keys, make_payload  # noqa: E402

HAS_REQ_CONTEXT = "req_context" in OffloadingEvent.__dataclass_fields__
TPB, BPC, N_LAYERS = 16, 2, 2


def _event_hashes(hashes: list[bytes]) -> list:
    """Block hashes as KV events carry them (vLLM may turn them into ints)."""
    return [maybe_convert_block_hash(h) for h in hashes]


def _files(root) -> set[str]:
    return {f[:-4] for _, _, fs in os.walk(root) for f in fs if f.endswith(".kvf")}


class _Request(SimpleNamespace):
    """The fields of ``vllm.v1.request.Request`` the event tracker reads (a real Request needs a model)."""


def _request(n_chunks: int, salt: str) -> _Request:
    hashes = [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(n_chunks * BPC)]
    return _Request(request_id=salt, block_hashes=hashes, all_token_ids=list(range(n_chunks * BPC * TPB)),
                    lora_request=None, resumable=False, kv_transfer_params=None)


def _group_config() -> GroupOffloadConfig:
    # A full-attention group (sliding_window None): the tracker describes its chunks.
    return GroupOffloadConfig(group_idx=0, tokens_per_block=TPB, tokens_per_chunk=TPB * BPC, hashes_per_chunk=BPC,
                              kv_event_group_spec=OffloadingEventGroupSpec(None, None),
                              sliding_window_size_in_chunks=None, kv_cache_spec=None, manager_cls=None)


def test_events_make_vllms_tracker_count_kvformat_as_a_holder(tmp_path):
    n = 2  # our chunks; the CPU tier holds 2n, kvformat 2n files
    file_bytes_probe = tmp_path / "probe"
    with Deployment([kvformat_tier(file_bytes_probe)], n_layers=N_LAYERS, blocks_per_chunk=BPC) as dep:
        dep.store({k: make_payload(i, dep.slot_bytes) for i, k in enumerate(make_keys(1, "probe"))})
        file_bytes = next(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(file_bytes_probe)
                          for f in fs if f.endswith(".kvf"))
    root = tmp_path / "kvf"
    tier = kvformat_tier(root, enable_kv_events=True, max_bytes=2 * n * file_bytes)
    gc = _group_config()
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(enable_kv_cache_events=True,
                                                               self_describing_kv_events=True))
    req = _request(n, "evt")
    keys = [make_offload_key(req.block_hashes[(c + 1) * BPC - 1], 0) for c in range(n)]  # a chunk's last hash
    ctx = ReqContext(req_id="evt")
    for c, k in enumerate(keys):
        ctx.set_offload_key_position(k, (c + 1) * TPB * BPC)  # as the scheduler records them
    if hasattr(tracker, "on_new_request"):  # 0.34: the tracker reads the request from the event's req_context
        tracker.on_new_request(ctx, req, (gc,))
    else:  # 0.33: the scheduler snapshots each chunk it stores
        for c, k in enumerate(keys):
            tracker.record_store(req, gc, c, k)

    with Deployment([tier], n_layers=N_LAYERS, blocks_per_chunk=BPC, enable_kv_events=True, num_chunks=2 * n) as dep:
        dep.store({k: make_payload(i, dep.slot_bytes) for i, k in enumerate(keys)}, req_context=ctx)
        raw = dep.events()
        ours = [e for e in raw if e.medium is Medium.STORAGE]
        assert ours and all(e.ownership == "KVFormatTier" and e.removal_expected and not e.removed for e in ours)
        assert sorted(k for e in ours for k in e.keys) == sorted(keys)
        if HAS_REQ_CONTEXT:
            assert all(e.req_context is ctx for e in ours)
        out = list(tracker.take_events(raw))
        stored = [e for e in out if isinstance(e, BlockStored) and e.medium == "STORAGE"]
        assert len(stored) == n
        for c, e in enumerate(sorted(stored, key=lambda e: e.token_ids[0])):
            # Self-describing: the chunk's own block hashes and tokens, not a placeholder (token_ids=[]).
            assert e.ownership == "KVFormatTier" and e.block_size == TPB
            assert e.token_ids == list(range(c * BPC * TPB, (c + 1) * BPC * TPB))
            assert e.block_hashes == _event_hashes(req.block_hashes[c * BPC:(c + 1) * BPC])

        # 2n fresh chunks push ours out of both tiers: the CPU tier's LRU drops them first (its events come
        # first in the manager's batch), then kvformat evicts them. The tracker must have kept the payload
        # for kvformat's residency, so kvformat's removals name every block hash of each chunk; had it
        # counted the CPU tier only, they would be placeholders made of the offload key alone.
        dep.store({k: make_payload(100 + i, dep.slot_bytes) for i, k in enumerate(make_keys(2 * n, "push"))})
        raw = dep.events()
        cpu_gone = {k for e in raw if e.removed and e.medium is Medium.CPU for k in e.keys}
        assert cpu_gone == set(keys), "the CPU tier did not drop our chunks: the scenario did not happen"
        out = list(tracker.take_events(raw))
        removed = [e for e in out if isinstance(e, BlockRemoved) and e.medium == "STORAGE"]
        assert removed and all(e.ownership == "KVFormatTier" for e in removed)
        gone = [h for e in removed for h in e.block_hashes]
        # Every block hash of each evicted chunk, the first (non-key) hashes included.
        assert sorted(gone) == sorted(_event_hashes(req.block_hashes)), vllm.__version__
        assert not _files(root) & {k.hex() for k in req.block_hashes}


def test_cpu_tier_hit_refreshes_kvformat_lru_order(tmp_path):
    keys = make_keys(4, "lru")
    probe = tmp_path / "probe"
    with Deployment([kvformat_tier(probe)], n_layers=N_LAYERS) as dep:
        dep.store({keys[0]: make_payload(0, dep.slot_bytes)})
        file_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(probe) for f in fs
                         if f.endswith(".kvf"))
    root = tmp_path / "kvf"
    with Deployment([kvformat_tier(root, max_bytes=3 * file_bytes)], n_layers=N_LAYERS, num_chunks=8) as dep:
        a, b, c, d = keys
        for i, k in enumerate((a, b, c)):  # one request each: kvformat's LRU order is a < b < c
            dep.store({k: make_payload(i, dep.slot_bytes)})
        tier = dep.tier()
        # A request hits `a` in the CPU tier: kvformat's lookup is never asked.
        ctx = ReqContext(req_id="hit-a")
        ctx.set_offload_key_position(a, 16)
        calls = []
        orig_lookup = tier.lookup
        tier.lookup = lambda k, c2: calls.append(k) or orig_lookup(k, c2)
        with dep.mgr.lock:
            dep.mgr.on_new_request(ctx)
            assert dep.mgr.lookup(a, ctx) is LookupResult.HIT
            dep.mgr.prepare_load([a], ctx)
            dep.mgr.complete_load([a], ctx)
            dep.mgr.on_request_finished(ctx)
            dep.mgr.on_schedule_end(_STEP)
        dep.flush()
        assert calls == [], "a CPU-tier hit reached the kvformat tier's lookup"
        dep.store({d: make_payload(3, dep.slot_bytes)})  # one eviction: the least recently used file goes
        present = _files(root)
        names = {k: get_offload_block_hash(k).hex() for k in keys}
        assert names[a] in present, "the CPU-tier hit did not count as a use: `a` was evicted"
        assert names[b] not in present and {names[c], names[d]} <= present, present


def test_own_store_is_answered_without_a_lookup(tmp_path):
    """Why mark_present is not called: the index answers every key this tier stored, before any probe."""
    with Deployment([kvformat_tier(tmp_path)], n_layers=N_LAYERS) as dep:
        tier = dep.tier()
        probes: list[list] = []
        orig = tier._lookups.batch_lookup
        tier._lookups.batch_lookup = lambda ks, ctx: probes.append(list(ks)) or orig(ks, ctx)
        (k,) = make_keys(1, "mp")
        ctx = ReqContext(req_id="mp-reader")
        with dep.mgr.lock:
            dep.mgr.on_new_request(ctx)
        deadline = 200
        while True:  # the reader's request asks before the chunk exists: a probe, then a cached miss
            with dep.mgr.lock:
                r = dep.mgr.lookup(k, ctx)
                dep.mgr.on_schedule_end(_STEP)
            if r is LookupResult.MISS:
                break
            deadline -= 1
            assert deadline, "the probe never resolved"
            time.sleep(0.01)
        assert len(probes) == 1
        dep.store({k: make_payload(1, dep.slot_bytes)})  # another request stores it
        with dep.mgr.lock:
            assert tier.lookup(k, ctx) is LookupResult.HIT  # same request, cached miss: still HIT
            dep.mgr.on_request_finished(ctx)
        assert len(probes) == 1, "a probe ran for a key the tier had just stored"
