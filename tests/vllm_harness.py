"""Drive vLLM's (0.33 or 0.34) REAL ``TieringOffloadingManager`` on a CPU-only machine (test helper).

A :class:`Deployment` is one scheduler-side vLLM offloading stack: a real ``OffloadingConfig``,
``TieringOffloadingSpec(cfg).get_manager()`` (which creates the real ``/dev/shm`` primary region and
the configured secondary tiers), and the manager's real store/cascade/evict/lookup/promote cycle.
The GPU worker cannot run here (it asserts CUDA tensors), so the harness plays the TP workers: it
writes each chunk's primary row exactly as ``CPUOffloadingWorker`` lays it out
(``vllm/v1/kv_offload/cpu/spec.py`` and ``shared_offload_region.py``)::

    replicated row:  |slot|pad|             (spec.replicated_layout: one copy for all workers)
    per-worker row:  |W0|W1|...|W(tp-1)|pad| (one slot per worker)
    slot = for each layer in group order: page_bytes * blocks_per_chunk bytes (block j at j*page)
    page_bytes = worker_kv_bytes_per_block / n_layers  (uniform pure MLA)
    row = round_up(slot * copies, 4096)

Payload convention: a chunk's *payload* is its canonical single-slot bytes (``slot_bytes`` long), i.e.
exactly what kvformat stores. ``store`` writes it into the single slot, or replicates it into every
worker slot; pass a list of ``tp`` byte strings instead to give each worker its own slot (replica
mismatch tests). The row padding is filled with ``PAD_BYTE`` so a tier that stores padding is visible.

API
---
``Deployment(tiers, *, n_layers=4, tp=1, blocks_per_chunk=1, replicated=True, tokens_per_block=16,
width=576, dtype="bfloat16", model=DEFAULT_MODEL, tokens_per_hash=None, num_chunks=16, group=0,
enable_kv_events=False, engine_id=None)``
    ``tiers`` is the ``secondary_tiers`` list (e.g. ``[fs_tier(root)]`` or ``[kvformat_tier(root)]``).
    Use as a context manager or call ``close()`` (shuts the manager down and frees /dev/shm).
``dep.store({key: payload}) -> list[key]``
    GPU->primary store of every key (batched to the primary's capacity), cascade to the secondary
    tiers, and ``flush()`` after each batch. Returns the keys the primary accepted for storing.
    ``req_context=ctx`` stores them all in that one request (e.g. carrying offload-key positions and
    KV-event state as the scheduler sets them).
``dep.flush(timeout=60)``: step the engine until no tier has pending work.
``dep.evict_primary()``: ``reset_cache()`` + ``on_reset_flushed()`` and zero the primary region, so
    the next ``load`` must come from a secondary tier.
``dep.load(keys, timeout=60, raw=False) -> {key: bytes | None}``
    Step ``lookup`` until every key is HIT or MISS (RETRY / HIT_PENDING step again; a key that never
    resolves raises ``TimeoutError``: a livelock), ``prepare_load`` the hits, read their rows,
    ``complete_load``. A hit maps to its canonical slot bytes (after checking every worker slot holds
    the same bytes: the fan-out); ``raw=True`` gives the whole row instead. A miss maps to ``None``.
``dep.lookup_once(key) -> LookupResult``: one lookup in its own request and step.
``dep.events() -> list[OffloadingEvent]``, ``dep.stats()`` (the manager's ``get_stats()``),
``dep.tier(i=0)`` (the i-th secondary tier object), ``dep.spec``, ``dep.mgr``, ``dep.view``.
Module helpers: ``make_config(tiers, layer_names=…, worker_kv_bytes_per_block=…, …)`` (the bare
``OffloadingConfig``, e.g. for ``TieringOffloadingSpec(cfg)`` without a manager), ``make_key(i, salt="")`` (an OffloadKey with a 32-byte block hash),
``make_keys(n, salt)``, ``make_payload(seed, nbytes)``, ``fs_tier(root, **kw)`` (vLLM's built-in "fs"
tier), ``kvformat_tier(root, **kw)``, ``page_bytes_for(tokens_per_block, width, dtype)``.

Several deployments may live in one process (each has its own ``engine_id``), e.g. a TP=8 writer and
TP=1 readers over the same root, or a restart (close one, open another over the same root).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from vllm.v1.kv_offload.base import (
    LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig, OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V2-Lite"
ROW_ALIGN = 4096
PAD_BYTE = 0xA5
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "fp8": 1, "fp8_e4m3": 1,
             "fp8_e5m2": 1, "fp8_ds_mla": 1}
_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def page_bytes_for(tokens_per_block: int, width: int, dtype: str) -> int:
    """Bytes of one MLA block of one layer: tokens x latent width x item size."""
    return tokens_per_block * width * _ITEMSIZE[dtype]


def make_key(i: int | str, salt: str = "", group: int = 0) -> OffloadKey:
    """A deterministic OffloadKey: 32-byte block hash of (salt, i) plus the group index."""
    return make_offload_key(hashlib.sha256(f"{salt}/{i}".encode()).digest(), group)


def make_keys(n: int, salt: str = "", group: int = 0) -> list[OffloadKey]:
    return [make_key(i, salt, group) for i in range(n)]


def make_payload(seed: int | str, nbytes: int) -> bytes:
    """Deterministic pseudo-random bytes (distinct per seed)."""
    s = int.from_bytes(hashlib.sha256(str(seed).encode()).digest()[:8], "little")
    return np.random.default_rng(s).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def fs_tier(root: str, **kw: Any) -> dict[str, Any]:
    """Tier config of vLLM's built-in filesystem tier (type "fs", FileSystemTierManager)."""
    return {"type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2, **kw}


def kvformat_tier(root: str, **kw: Any) -> dict[str, Any]:
    """Tier config of kvformat's tier (``kvformat.vllm.KVFormatTier``)."""
    return {"type": "KVFormatTier", "module_path": "kvformat.vllm", "root": str(root), **kw}


def make_config(tiers: Sequence[Mapping[str, Any]], *, layer_names: Sequence[str], tp: int = 1,
                blocks_per_chunk: int = 1, replicated: bool = True, tokens_per_block: int = 16,
                worker_kv_bytes_per_block: int, dtype: str = "bfloat16", model: str = DEFAULT_MODEL,
                tokens_per_hash: int | None = None, cpu_bytes: int = 64 << 20, group: int = 0,
                enable_kv_events: bool = False, engine_id: str | None = None, pp: int = 1, dcp: int = 1,
                extra_groups: Sequence[Sequence[str]] = ()) -> OffloadingConfig:
    """The OffloadingConfig vLLM's connector would build for this deployment (scheduler side, rank 0)."""
    groups = (OffloadingGroupConfig(tokens_per_block=tokens_per_block, layer_names=tuple(layer_names),
                                    group_id=group),)
    groups += tuple(OffloadingGroupConfig(tokens_per_block=tokens_per_block, layer_names=tuple(g),
                                          group_id=group + 1 + i) for i, g in enumerate(extra_groups))
    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=enable_kv_events,
        extra_config={"cpu_bytes_to_use": cpu_bytes, "secondary_tiers": [dict(t) for t in tiers]},
        engine_id=engine_id or f"kvft_{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(model, dtype, 4096),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_hash or tokens_per_block,
                                    blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=tp * pp, tp_size=tp, pp_size=pp, pcp_size=1, dcp_size=dcp, data_parallel_index=0,
            data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False),
        replicated_layout=replicated, canonical_layout=False, kv_cache_layout=None)


class Deployment:
    """One vLLM scheduler-side offloading stack with real tiers; see the module docstring."""

    def __init__(self, tiers: Sequence[Mapping[str, Any]], *, n_layers: int = 4, tp: int = 1,
                 blocks_per_chunk: int = 1, replicated: bool = True, tokens_per_block: int = 16,
                 width: int = 576, dtype: str = "bfloat16", model: str = DEFAULT_MODEL,
                 tokens_per_hash: int | None = None, num_chunks: int = 16, group: int = 0,
                 enable_kv_events: bool = False, engine_id: str | None = None,
                 layer_names: Sequence[str] | None = None) -> None:
        self.tp = tp
        self.n_layers = n_layers
        self.blocks_per_chunk = blocks_per_chunk
        self.group = group
        self.layer_names = tuple(layer_names or (f"model.layers.{i}.self_attn.attn" for i in range(n_layers)))
        self.page_bytes = page_bytes_for(tokens_per_block, width, dtype)
        worker_kv_bytes_per_block = self.page_bytes * n_layers
        self.slot_bytes = worker_kv_bytes_per_block * blocks_per_chunk
        copies = 1 if replicated else tp
        row = -(-self.slot_bytes * copies // ROW_ALIGN) * ROW_ALIGN
        self.engine_id = engine_id or f"kvft_{uuid.uuid4().hex[:12]}"
        self.cfg = make_config(tiers, layer_names=self.layer_names, tp=tp, blocks_per_chunk=blocks_per_chunk,
                               replicated=replicated, tokens_per_block=tokens_per_block,
                               worker_kv_bytes_per_block=worker_kv_bytes_per_block, dtype=dtype, model=model,
                               tokens_per_hash=tokens_per_hash, cpu_bytes=row * num_chunks, group=group,
                               enable_kv_events=enable_kv_events, engine_id=self.engine_id)
        self.spec = TieringOffloadingSpec(self.cfg)
        self._attach(self.spec.get_manager())
        self.copies = 1 if self.replicated else tp
        assert self.row_bytes == row, (self.row_bytes, row)

    def _attach(self, mgr: Any) -> None:
        """Take the manager vLLM built (with its tiers) and map its primary region's rows."""
        self.mgr = mgr
        self.replicated = bool(self.spec.replicated_layout)
        self.row_bytes = self.spec.kv_bytes_per_chunk
        self.num_chunks = self.spec.num_chunks
        self.view: memoryview = mgr.primary_tier.get_kv_memoryview()
        self._rows: np.ndarray | None = np.asarray(self.view).view(np.uint8)  # (num_chunks, row_bytes)
        self._req = 0
        self._closed = False

    # -- plumbing ------------------------------------------------------------------------------
    def _ctx(self) -> ReqContext:
        self._req += 1
        return ReqContext(req_id=f"{self.engine_id}-r{self._req}")

    def _step(self) -> None:
        with self.mgr.lock:
            self.mgr.on_schedule_end(_STEP)

    def tier(self, i: int = 0) -> Any:
        """The i-th secondary tier object (e.g. a KVFormatTier)."""
        return self.mgr.secondary_tiers[i]

    def _write_row(self, chunk_id: int, payload: bytes | Sequence[bytes]) -> None:
        assert self._rows is not None
        row = self._rows[int(chunk_id)]
        if isinstance(payload, (bytes, bytearray, memoryview)):
            slots = [payload] * self.copies
        else:
            slots = list(payload)
            if len(slots) != self.copies:
                raise ValueError(f"expected {self.copies} worker slots, got {len(slots)}")
        for r, s in enumerate(slots):
            if len(s) != self.slot_bytes:
                raise ValueError(f"slot payload is {len(s)} bytes, expected {self.slot_bytes}")
            row[r * self.slot_bytes:(r + 1) * self.slot_bytes] = np.frombuffer(s, dtype=np.uint8)
        row[self.copies * self.slot_bytes:] = PAD_BYTE

    # -- the cycle -----------------------------------------------------------------------------
    def store(self, items: Mapping[OffloadKey, bytes | Sequence[bytes]], *, timeout: float = 60.0,
              req_context: ReqContext | None = None) -> list[OffloadKey]:
        """Store each payload GPU->primary, cascade to every secondary tier, wait for the tiers.

        ``req_context``: store everything in this one request (as the scheduler would, e.g. with the
        offload-key positions and event state it records); at most half the primary's chunks.
        """
        keys = list(items)
        stored: list[OffloadKey] = []
        batch = max(1, self.num_chunks // 2)
        if req_context is not None and len(keys) > batch:
            raise ValueError(f"one request stores at most {batch} chunks here, got {len(keys)}")
        for i in range(0, len(keys), batch):
            part = keys[i:i + batch]
            ctx = req_context or self._ctx()
            with self.mgr.lock:
                self.mgr.on_new_request(ctx)
                out = self.mgr.prepare_store(part, ctx)
                if out is None:
                    self.mgr.on_request_finished(ctx)
                    raise RuntimeError("the primary tier could not allocate chunks for the store")
                to_store = list(out.keys_to_store)
                for k, cid in zip(to_store, out.store_spec.chunk_ids):
                    self._write_row(int(cid), items[k])
                if to_store:  # keys already in the primary are not stored (nor cascaded) again
                    self.mgr.complete_store(to_store, ctx)
                self.mgr.on_request_finished(ctx)
                self.mgr.on_schedule_end(_STEP)
            stored += to_store
            self.flush(timeout=timeout)
        return stored

    def flush(self, timeout: float = 60.0) -> None:
        """Step until neither the manager nor any tier has pending work."""
        deadline = time.monotonic() + timeout
        while True:
            with self.mgr.lock:
                self.mgr.on_schedule_end(_STEP)
                if not self.mgr.has_pending_work():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("tiers still have pending work")
            time.sleep(0.002)

    def evict_primary(self) -> None:
        """Drop every chunk from the primary tier (as after a cache reset) and zero the region."""
        with self.mgr.lock:
            self.mgr.reset_cache()
            self.mgr.on_reset_flushed()
        assert self._rows is not None
        self._rows[:] = 0

    def lookup_once(self, key: OffloadKey) -> LookupResult:
        """One lookup in a fresh request, then one step."""
        ctx = self._ctx()
        with self.mgr.lock:
            self.mgr.on_new_request(ctx)
            r = self.mgr.lookup(key, ctx)
            self.mgr.on_request_finished(ctx)
            self.mgr.on_schedule_end(_STEP)
        return r

    def load(self, keys: Iterable[OffloadKey], *, timeout: float = 60.0, raw: bool = False,
             req_context: ReqContext | None = None) -> dict[OffloadKey, bytes | None]:
        """Look each key up until HIT or MISS, promote the hits, read their rows back (``req_context``: in that
        one request, as the scheduler would, e.g. with its offload-key positions)."""
        keys = list(dict.fromkeys(keys))
        out: dict[OffloadKey, bytes | None] = {}
        batch = max(1, self.num_chunks // 2)
        for i in range(0, len(keys), batch):
            part = keys[i:i + batch]
            # Subclasses override _load_batch(keys, timeout, raw): pass the context only when there is one.
            out.update(self._load_batch(part, timeout, raw) if req_context is None
                       else self._load_batch(part, timeout, raw, req_context))
        return out

    def _load_batch(self, keys: list[OffloadKey], timeout: float, raw: bool,
                    req_context: ReqContext | None = None) -> dict[OffloadKey, bytes | None]:
        ctx = req_context or self._ctx()
        verdict: dict[OffloadKey, bool] = {}
        deadline = time.monotonic() + timeout
        with self.mgr.lock:
            self.mgr.on_new_request(ctx)
        while True:
            with self.mgr.lock:
                for k in keys:
                    if k in verdict:
                        continue
                    r = self.mgr.lookup(k, ctx)
                    if r is LookupResult.HIT:
                        verdict[k] = True
                    elif r is LookupResult.MISS:
                        verdict[k] = False
                if len(verdict) == len(keys):
                    hits = [k for k in keys if verdict[k]]
                    res: dict[OffloadKey, bytes | None] = {k: None for k in keys}
                    if hits:
                        spec = self.mgr.prepare_load(hits, ctx)
                        for k, cid in zip(hits, spec.chunk_ids):
                            res[k] = self._read_row(int(cid), raw)
                        self.mgr.complete_load(hits, ctx)
                    self.mgr.on_request_finished(ctx)
                    self.mgr.on_schedule_end(_STEP)
                    return res
                self.mgr.on_schedule_end(_STEP)
            if time.monotonic() > deadline:
                pending = [k.hex()[:16] for k in keys if k not in verdict]
                with self.mgr.lock:
                    self.mgr.on_request_finished(ctx)
                raise TimeoutError(f"lookups never resolved (livelock?): {pending}")
            time.sleep(0.002)

    def _read_row(self, chunk_id: int, raw: bool) -> bytes:
        assert self._rows is not None
        row = self._rows[chunk_id]
        if raw:
            return row.tobytes()
        first = row[:self.slot_bytes].tobytes()
        for r in range(1, self.copies):
            other = row[r * self.slot_bytes:(r + 1) * self.slot_bytes].tobytes()
            if other != first:
                raise AssertionError(f"worker slot {r} of chunk {chunk_id} differs from slot 0 (fan-out broken)")
        return first

    # -- observation ---------------------------------------------------------------------------
    def events(self) -> list[Any]:
        with self.mgr.lock:
            return list(self.mgr.take_events())

    def stats(self) -> Any:
        with self.mgr.lock:
            return self.mgr.get_stats()

    def close(self) -> None:
        """Shut the manager (and its tiers) down and release the /dev/shm region."""
        if self._closed:
            return
        self._closed = True
        self._rows = None  # our export of the primary view must go before the manager releases it
        self.mgr.shutdown()

    def __enter__(self) -> "Deployment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def kvf(root: Any, **kw: Any) -> dict[str, Any]:
    """A kvformat tier config at ``root`` with 2 + 2 I/O threads (the tests' default)."""
    return kvformat_tier(str(root), read_threads=2, write_threads=2, **kw)


def kvf_files(root: Any) -> list[Any]:
    """The block files under a root, quarantined ones left out."""
    from pathlib import Path

    return sorted(p for p in Path(root).rglob("*.kvf") if ".quarantine" not in p.parts)


def payloads(dep: "Deployment", keys: Any) -> dict[Any, bytes]:
    """One seeded payload per key, of the deployment's slot size."""
    return {k: make_payload(k.hex(), dep.slot_bytes) for k in keys}


def wait_for(cond: Any, timeout: float = 20.0) -> bool:
    """Poll ``cond()`` until it is true or ``timeout`` seconds have passed; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())
