"""kvformat as a vLLM (0.33+) secondary offloading tier: :class:`KVFormatTier`.

Enable it in the tiering config of vLLM's ``OffloadingConnector`` (docs/vllm.md has every parameter)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 68719476736,
        "secondary_tiers": [{"type": "KVFormatTier", "module_path": "kvformat.vllm",
                             "root": "/mnt/kvcache", "max_bytes": "500GiB"}]}}'

What it does, per chunk of the primary (CPU) tier:

* store: exactly ONE canonical copy (the single replicated slot, or slot 0 of a per-worker row after
  checking every worker slot holds the same bytes), at ``<root>/<namespace>/<h[:2]>/<h[2:4]>/<hash>.kvf``.
  The namespace is a digest of TP-invariant identity only, so deployments of any TP size and either
  row layout share files. Existing files are skipped; writes are atomic (temp file + rename).
* load: header and layout checked (fail closed), checksums verified, payload placed into the slot
  (and copied into every worker slot of a per-worker row). A bad file is a miss, is moved to
  ``<root>/.quarantine/``, counted, and logged once per reason.
* capacity: ``max_bytes`` bounds the files under ``root`` (LRU, rebuilt from file mtimes at start-up
  in a background thread); files being loaded are never evicted; evictions are KV events.

vLLM is imported only by this module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

# Probe first, so a missing vLLM (or one missing an import-time dependency of its own) says how to fix it.
try:
    import vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics  # noqa: F401
    import vllm.v1.kv_offload.tiering.async_lookup  # noqa: F401
except ImportError as _e:
    raise ImportError(f'kvformat.vllm needs vLLM 0.33 or 0.34 with tiered KV offloading: pip install "kvformat[vllm]" '
                      f'(import failed: {_e})', name=_e.name) from _e

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality, LookupResult, Medium, OffloadingCounterMetadata, OffloadingEvent, OffloadingGaugeMetadata,
    OffloadingMetricMetadata, OffloadKey, ReqContext, get_offload_block_hash, get_offload_group_idx, make_offload_key,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import (
    JobId, JobResult, RequestOffloadingContext, ScheduleEndContext, SecondaryTierManager, TransferJob,
)

from . import __version__
from ._spec import DTYPE_SIZES, FILE_SUFFIX, CanonicalLayout, LayerSpec, Provenance, st_dtype_for
from ._tier._config import TierConfig
from ._tier._lru import LRUIndex
from ._tier._pool import DualPool
from ._tier._rows import COUNTERS, EXISTS, WRITTEN, RowEngine
from .errors import SchemaError
from .storage import open_store

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger("kvformat.vllm")

METRIC_PREFIX = "vllm:kv_offload_kvformat_"
_COUNTER_DOCS = {
    "bytes_written": "Bytes of kvformat files written (header + data, one canonical copy per chunk).",
    "files_written": "kvformat files written.",
    "bytes_read": "Bytes of kvformat files read into the primary tier.",
    "files_read": "kvformat files loaded into the primary tier.",
    "checksum_failures": "Files whose header or data checksum did not match (served as misses).",
    "corrupt_files": "Corrupt, truncated or mismatched files quarantined (served as misses).",
    "layout_mismatches": "Files whose layout or key did not match this deployment (quarantined).",
    "replica_mismatches": "Chunks not stored because the per-worker slots of the row differed.",
    "evictions": "Files deleted to keep the root under max_bytes.",
    "evicted_bytes": "Bytes of files deleted to keep the root under max_bytes.",
    "dedup_saved_bytes": "Row bytes not written because they duplicate stored bytes (worker replicas, "
                         "chunks already on storage).",
    "missing_files": "Files gone at load time (deleted by another instance or by hand).",
    "io_errors": "Loads that failed with an OS error (served as misses).",
}
_GAUGE_DOCS = {
    "used_bytes": "Bytes of kvformat files under the root, as this tier accounts them.",
    "files": "kvformat files under the root, as this tier accounts them.",
}


def derive_layout(spec: "OffloadingSpec", revision: str | None = None) -> tuple[CanonicalLayout, int, str]:
    """The TP-invariant canonical layout of ``spec``'s chunks, the slots per primary row, the row kind.

    Raises SchemaError for deployments whose primary row is not one replicated pure-MLA payload per
    worker (several KV-cache groups, pipeline or context parallelism, non-uniform layers).
    """
    cfg = spec.config
    if len(cfg.groups) != 1:
        raise SchemaError("groups", f"KVFormatTier needs one KV-cache group (pure MLA), got {len(cfg.groups)}")
    par = cfg.parallel
    if par.pp_size != 1 or par.pcp_size != 1 or par.dcp_size != 1:
        raise SchemaError("parallel", "KVFormatTier supports tensor parallelism only (pp, pcp and dcp must be 1), "
                          f"got pp={par.pp_size} pcp={par.pcp_size} dcp={par.dcp_size}")
    g = cfg.groups[0]
    n = len(g.layer_names)
    if n == 0 or cfg.worker_kv_bytes_per_block % n:
        raise SchemaError("worker_kv_bytes_per_block", f"expected a multiple of the {n} layers (uniform MLA "
                          f"pages), got {cfg.worker_kv_bytes_per_block}")
    page = cfg.worker_kv_bytes_per_block // n
    tpb = g.tokens_per_block
    st = st_dtype_for(cfg.model.dtype)
    item = DTYPE_SIZES[st]
    if page % (tpb * item):
        st, item = "U8", 1
        if page % tpb:
            raise SchemaError("page_bytes", f"a {page}-byte page does not split into {tpb} tokens")
    layers = tuple(LayerSpec(name, st, (tpb, page // (tpb * item))) for name in g.layer_names)
    family = "mla"
    if cfg.canonical_layout:
        # vLLM's canonical byte format is its own family: never shares a namespace with direct rows.
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id

        family = f"mla+{canonical_format_id(cfg.kv_cache_layout)}"
    layout = CanonicalLayout(model=cfg.model.name, kv_dtype=cfg.model.dtype, tokens_per_block=tpb,
                             blocks_per_chunk=spec.blocks_per_chunk, tokens_per_hash=cfg.cache.tokens_per_hash,
                             layers=layers, family=family, revision=revision, group=g.group_id)
    if cfg.canonical_layout:
        return layout, 1, "canonical"
    if getattr(spec, "replicated_layout", False):
        return layout, 1, "replicated"
    return layout, max(1, par.world_size), "per_worker"


# vLLM 0.34 added ``req_context`` to OffloadingEvent (0.33's tracker takes request data from the scheduler
# instead); fields are probed, not versions compared.
_EVENT_TAKES_REQ_CONTEXT = "req_context" in getattr(OffloadingEvent, "__dataclass_fields__", {})


class _Job:
    __slots__ = ("job_id", "keys", "is_load", "remaining", "results", "nbytes", "t0", "lock", "req_context")

    def __init__(self, job_id: JobId, keys: list[OffloadKey], is_load: bool,
                 req_context: ReqContext | None = None) -> None:
        self.job_id = job_id
        self.req_context = req_context
        self.keys = keys
        self.is_load = is_load
        self.remaining = len(keys)
        self.results: list[Any] = [None] * len(keys)
        self.nbytes = 0
        self.t0 = time.monotonic()
        self.lock = threading.Lock()


class _Lookups(AsyncLookupManager):
    """Existence checks of blocks the index does not know (written by another instance), off-thread."""

    def __init__(self, tier: "KVFormatTier", tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._probe_many(keys)


class KVFormatTier(SecondaryTierManager):
    """vLLM secondary tier storing each MLA KV chunk once, as a checksummed, TP-independent kvformat file.

    Parameters (the tier dict; see docs/vllm.md)
    ----------
    root: directory (or, with a remote-storage backend installed, URL) holding the namespaces.
    read_threads, write_threads: I/O threads preferring loads / stores (default 8 / 8).
    compression: ``"none"`` (default) or ``"zstd"``; compression_level: zstd level (default 3).
    verify: verify checksums on every load (default true).
    max_bytes: bound on the files under ``root`` (int or "500GiB"); default unbounded.
    o_direct: ``"off"`` (default: buffered I/O), ``"auto"``/``"on"`` (O_DIRECT payload reads where the
        filesystem allows them).
    fsync: fsync each file and its directory before it counts as stored (default false).
    replica_policy: ``"verify"`` (default: per-worker slots must hash equal, else the chunk is not
        stored) or ``"trust_rank0"`` (store worker 0's slot unchecked).
    model_revision: optional model revision, part of the namespace identity.
    storage_options: dict passed to the storage backend (remote roots).
    enable_kv_events: emit stored/removed KV events (when vLLM's KV events are on); default false.
    locality: ``"LOCAL"`` or ``"REMOTE"`` (passed by vLLM's factory; reported on events).

    Raises
    ------
    SchemaError (a ValueError) for a bad parameter or a deployment this tier cannot store (not pure
    MLA with tensor parallelism only); TypeError for an unknown parameter.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        out: dict[str, OffloadingMetricMetadata] = {
            METRIC_PREFIX + k: OffloadingCounterMetadata(documentation=d) for k, d in _COUNTER_DOCS.items()}
        out.update({METRIC_PREFIX + k: OffloadingGaugeMetadata(documentation=d) for k, d in _GAUGE_DOCS.items()})
        return out

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview, tier_type: str, root: str,
                 read_threads: int = 8, write_threads: int = 8, compression: str = "none",
                 compression_level: int = 3, verify: bool = True, max_bytes: int | str | None = None,
                 o_direct: str = "off", fsync: bool = False, replica_policy: str = "verify",
                 model_revision: str | None = None, storage_options: dict[str, Any] | None = None,
                 enable_kv_events: bool = False, locality: str | None = None,
                 backpressure_detector: "BackpressureDetector | None" = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = TierConfig.parse(root, read_threads=read_threads, write_threads=write_threads,
                                       compression=compression, compression_level=compression_level, verify=verify,
                                       max_bytes=max_bytes, o_direct=o_direct, fsync=fsync,
                                       replica_policy=replica_policy, model_revision=model_revision,
                                       storage_options=storage_options, enable_kv_events=enable_kv_events,
                                       locality=locality)
        self.locality = Locality(locality) if locality is not None else None
        self.layout, self.copies, self.row_kind = derive_layout(offloading_spec, model_revision)
        self.namespace = self.layout.namespace()
        if "://" not in root or root.startswith("file://"):
            self.store = open_store(root, o_direct=o_direct)  # storage_options are for URL roots only
        else:
            self.store = open_store(root, **self.config.storage_options)
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                logger.warning("enable_kv_events is set on tier '%s' but KV cache events are disabled globally; "
                               "the tier will not emit events.", tier_type)
        self._events_lock = threading.Lock()
        # This tier evicts and announces it, so vLLM's event tracker must count it as a holder of each
        # chunk it stored (a residency of its own, keyed by medium + ownership): the tracker then keeps the
        # chunk's block hashes after the CPU tier drops it and expands this tier's removals to them.
        self._event_owner: dict[str, Any] = {"ownership": tier_type, "removal_expected": True}
        par = offloading_spec.config.parallel
        prov = Provenance(tp=max(1, par.tp_size), pp=1, dcp=1, pcp=1, row=self.row_kind,
                          writer=f"kvformat {__version__} (vllm tier)")
        self._flat = primary_kv_view.cast("B")
        self.index = LRUIndex(self.config.max_bytes)
        self.engine = RowEngine(self.store, self.layout, self._flat, self.block_size_bytes, self.copies,
                                self.config, prov, self.index, self._on_removed)
        self._jobs_finished: list[JobResult] = []
        self._store_outcomes: list[list[tuple[OffloadKey, Any]]] = []
        self._finished_lock = threading.Lock()
        self._load_keys: dict[JobId, list[OffloadKey]] = {}
        self._failed: set[OffloadKey] = set()
        self._reported: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._pool = DualPool(self.config.read_threads, self.config.write_threads)
        self._lookups = _Lookups(self, tier_type)
        self._stop = threading.Event()
        self._scan = threading.Thread(target=self.engine.scan, args=(self._stop,), name="kvformat_tier_scan",
                                      daemon=True)
        self._scan.start()
        logger.info("KVFormatTier at %s: namespace %s, %s rows (%d slot(s) of %d bytes), max_bytes=%s",
                    root, self.namespace, self.row_kind, self.copies, self.layout.payload_bytes,
                    self.config.max_bytes)

    # -- helpers ---------------------------------------------------------------------------------
    def _hash(self, key: OffloadKey) -> str | None:
        if get_offload_group_idx(key) != self.layout.group:
            return None
        return get_offload_block_hash(key).hex()

    def _probe_many(self, keys: list[OffloadKey]) -> list[bool]:
        hs = [self._hash(k) for k in keys]
        valid = [h for h in hs if h is not None]
        found = iter(self.engine.probe_many(valid)) if valid else iter(())
        return [h is not None and next(found) for h in hs]

    def _on_removed(self, relpaths: list[str]) -> None:
        if self.events is None:
            return
        keys = []
        prefix = self.namespace + "/"
        for rel in relpaths:
            if rel.startswith(prefix) and rel.endswith(FILE_SUFFIX):
                h = rel.rsplit("/", 1)[1][:-len(FILE_SUFFIX)]
                try:
                    keys.append(make_offload_key(bytes.fromhex(h), self.layout.group))
                except ValueError:
                    continue
        if keys:
            with self._events_lock:
                self.events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=True,
                                                   locality=self.locality, **self._event_owner))

    def _finish(self, job: _Job, i: int, result: Any, nbytes: int) -> None:
        with job.lock:
            job.results[i] = result
            job.nbytes += nbytes
            job.remaining -= 1
            if job.remaining:
                return
        if job.is_load:
            ok = [k for k, r in zip(job.keys, job.results) if r is not None]
            success = len(ok) == len(job.keys)
            res = JobResult(job.job_id, success, successful_keys=None if success else tuple(ok),
                            transfer_time=time.monotonic() - job.t0, transfer_bytes=job.nbytes)
        else:
            success = all(r != "error" for r in job.results)
            res = JobResult(job.job_id, success, transfer_time=time.monotonic() - job.t0,
                            transfer_bytes=job.nbytes)
            if self.events is not None:
                stored = [k for k, r in zip(job.keys, job.results) if r in (WRITTEN, EXISTS)]
                if stored:
                    extra = dict(self._event_owner)
                    if _EVENT_TAKES_REQ_CONTEXT:
                        extra["req_context"] = job.req_context  # lets vLLM's tracker describe the chunk
                    with self._events_lock:
                        self.events.append(OffloadingEvent(keys=stored, medium=self.medium, removed=False,
                                                           locality=self.locality, **extra))
        with self._finished_lock:
            self._jobs_finished.append(res)
            if not job.is_load:
                self._store_outcomes.append(list(zip(job.keys, job.results)))

    def _store_task(self, job: _Job, i: int, h: str | None, cid: int) -> Any:
        def run() -> None:
            outcome, n = "skipped", 0
            try:
                if h is not None:
                    outcome, n = self.engine.store_chunk(h, cid)
            except Exception as e:  # OSError (ENOSPC …) or a bug: this chunk is not stored, the job fails
                outcome = "error"
                self.engine.warn_once(f"store:{type(e).__name__}", "kvformat tier: storing a chunk failed: %s", e)
            self._finish(job, i, outcome, n)
        return run

    def _load_task(self, job: _Job, i: int, h: str | None, cid: int) -> Any:
        def run() -> None:
            got = None
            try:
                if h is not None:
                    got = self.engine.load_chunk(h, cid)
            except Exception as e:
                self.engine.warn_once(f"load:{type(e).__name__}", "kvformat tier: loading a chunk failed: %s", e)
            self._finish(job, i, got, got or 0)
        return run

    # -- SecondaryTierManager ----------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        h = self._hash(key)
        if h is None or key in self._failed:
            return LookupResult.MISS
        rel = self.engine.relpath(h)
        if rel in self.index:
            return LookupResult.HIT
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found and rel in self.index else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=True)

    def _submit(self, job_metadata: TransferJob, *, load: bool) -> None:
        keys = list(job_metadata.keys)
        job = _Job(job_metadata.job_id, keys, is_load=load, req_context=getattr(job_metadata, "req_context", None))
        if load:
            self._load_keys[job.job_id] = keys
        if not keys:
            self._finish_empty(job)
            return
        task = self._load_task if load else self._store_task
        self._pool.submit([task(job, i, self._hash(k), int(c)) for i, (k, c) in
                           enumerate(zip(keys, job_metadata.chunk_ids))], load=load)

    def _finish_empty(self, job: _Job) -> None:
        with self._finished_lock:
            self._jobs_finished.append(JobResult(job.job_id, True, transfer_time=0.0, transfer_bytes=0))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._finished_lock:
            done, self._jobs_finished = self._jobs_finished, []
            outcomes, self._store_outcomes = self._store_outcomes, []
        for results in outcomes:
            for k, r in results:
                # EXISTS counts too: after a transient failure (storage briefly unreachable) the re-store
                # finds the file still there, and the key must become loadable again.
                if r in (WRITTEN, EXISTS):
                    self._failed.discard(k)
        for res in done:
            keys = self._load_keys.pop(res.job_id, None)
            if keys is not None and not res.success:
                ok = set(res.successful_keys or ())
                failed = [k for k in keys if k not in ok]
                if len(self._failed) > 1_000_000:
                    self._failed.clear()
                self._failed.update(failed)
                self._lookups.mark_miss(failed)
        return done

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return ()
        with self._events_lock:
            out, self.events = self.events, []
        return out

    def drain_jobs(self) -> None:
        self._pool.wait_idle()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._refresh_recency(req_context)
        self._lookups.cleanup(req_context.req_id)

    def _refresh_recency(self, req_context: ReqContext) -> None:
        """Count the chunks a finished request used as recently used, CPU-tier hits included.

        vLLM never asks a secondary tier about a CPU-tier hit (and ``touch`` was never called, then
        removed in 0.34), so the request's end is the one hook that sees every chunk it used: the scheduler
        records each offload key's end-token position in the request context (0.33 and 0.34). Keys past
        the tokens actually processed are skipped, as vLLM's kvcr tier does.
        """
        positions = getattr(req_context, "_offload_key_positions", None)
        if not positions:
            return
        done = None
        counts = [getattr(req_context, a, None) for a in
                  ("num_computed_tokens", "num_in_flight_tokens", "num_prompt_tokens", "num_tokens")]
        if None not in counts:
            computed, in_flight, prompt, total = counts
            done = min(max(0, computed - in_flight), max(prompt, total - 1))
        # Deepest chunk first, so a request's shortest prefix ends up most recent: a longer prefix is
        # useless without the chunks before it, so those are the last to go.
        for key, pos in sorted(positions.items(), key=lambda kv: -kv[1]):
            if done is not None and pos > done:
                continue
            h = self._hash(key)
            if h is not None:
                self.index.touch(self.engine.relpath(h))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def get_stats(self) -> OffloadingConnectorStats | None:
        values, _ = self.engine.counters.snapshot()
        stats = OffloadingConnectorStats()
        for k, v in values.items():
            d = v - self._reported.get(k, 0)
            if d:
                stats.increase_counter(METRIC_PREFIX + k, d)
        self._reported = values
        stats.set_gauge(METRIC_PREFIX + "used_bytes", self.index.used)
        stats.set_gauge(METRIC_PREFIX + "files", len(self.index))
        return stats

    def counters(self) -> dict[str, int]:
        """Cumulative counters since start (plus ``quarantined:<reason>`` counts, ``used_bytes``, ``files``)."""
        values, quarantined = self.engine.counters.snapshot()
        values.update({f"quarantined:{r}": n for r, n in quarantined.items()})
        values["used_bytes"] = self.index.used
        values["files"] = len(self.index)
        return values

    def wait_scanned(self, timeout: float | None = None) -> bool:
        """Block until the start-up scan of the root has finished (tests, tools)."""
        self._scan.join(timeout)
        return not self._scan.is_alive()

    def shutdown(self) -> None:
        self._stop.set()
        self._scan.join()
        self._pool.shutdown()
        self._lookups.shutdown()
        self.engine.close()
        self._flat.release()

__all__ = ["KVFormatTier", "derive_layout", "METRIC_PREFIX"]
