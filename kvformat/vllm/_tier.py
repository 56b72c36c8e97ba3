"""kvformat as a vLLM (0.33, 0.34) secondary offloading tier: :class:`KVFormatTier`.

Enable it in the tiering config of vLLM's ``OffloadingConnector`` (docs/vllm.md has every parameter)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 68719476736,
        "secondary_tiers": [{"type": "KVFormatTier", "module_path": "kvformat.vllm",
                             "root": "/mnt/kvcache", "max_bytes": "500GiB"}]}}'

What it does, per chunk of the primary (CPU) tier:

* store: exactly ONE canonical copy (the single replicated slot, or slot 0 of a per-worker row after
  checking every worker slot holds the same bytes), at ``<root>/<namespace>/<h[:2]>/<h[2:4]>/<hash>.kvf``.
  The namespace is a digest of TP-invariant identity only, so deployments of any TP size and either
  row layout share files; pipeline/context-parallel rows are assembled from their stages' and DCP ranks'
  slots into the same payload (docs/layout.md). Existing files are skipped; writes are atomic.
* load: header and layout checked (fail closed), checksums verified, payload placed into the slot
  (and copied into every worker slot of a per-worker row). A bad file is a miss, is moved to
  ``<root>/.quarantine/``, counted, and logged once per reason.
* capacity: ``max_bytes`` bounds the files under ``root`` (LRU, rebuilt from file mtimes at start-up
  in a background thread); files being loaded are never evicted; evictions are KV events.

vLLM is imported only by this module (and, inside functions, by kvformat._vllm_facts: the fact extraction).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
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
    TIER_LABEL, JobResult, RequestOffloadingContext, ScheduleEndContext, SecondaryTierManager, TransferJob,
)

from .._version import __version__
from ..format._paths import block_path_parts
from ..format._spec import Provenance
from ..layout._types import RowPlan
from ._facts import deployment_facts, derive_layout, derive_plans, token_chain_layout
from ._tokens import TokenNames
from ..cache._config import TierConfig
from ..cache._health import unusable_root
from ..cache._log import CacheLog
from ..cache._lru import LRUIndex
from ..cache._ops import RootOps
from ..cache._pool import DualPool
from ..cache._jobs import CounterReport, Job, JobBook, shutdown_bounded
from ..cache._rows import RowEngine
from ..cache._sealing import sealed_plans
from ..errors import SchemaError
from ..storage import Store, open_store

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

# A child of vLLM's "vllm" logger: the handlers, format and level vLLM configures (VLLM_LOGGING_LEVEL,
# VLLM_LOGGING_CONFIG_PATH, --logging-config) apply to kvformat's lines as to vLLM's own.
logger = logging.getLogger("vllm.kvformat")

METRIC_PREFIX = "vllm:kv_offload_kvformat_"
REASON_LABEL = "reason"
# Which entry of the spec's secondary_tiers each tier object is (its label), claimed in construction order.
_CLAIMED: "weakref.WeakKeyDictionary[Any, set[int]]" = weakref.WeakKeyDictionary()
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
    "seal_failures": "Sealed files whose checksums held but whose authentication tag did not (written without "
                     "the key, or altered): quarantined, served as misses.",
    "unknown_key_files": "Sealed files under a key this tier does not hold (another deployment's, or a key not "
                         "configured): served as misses, left in place.",
    "store_failures": "Chunks not stored, all reasons (store_failures_by_reason has each reason).",
    "lookup_hits": "Lookups this tier answered with a hit.",
    "lookup_misses": "Lookups this tier answered with a miss.",
}
_REASON_DOCS = {
    "store_failures_by_reason": "Chunks not stored, by reason: an errno name (ENOSPC, EROFS, EACCES, ENOENT), "
                                "TimeoutError/ConnectionError (remote roots), bound (the shared root's allowance "
                                "is used up), coordination (no current state from the root's evictor), evicting, "
                                "root_lost, root_degraded, replica_mismatch, contended, shutdown.",
    "quarantined": "Files moved to <root>/.quarantine, by reason (the error class).",
}
_GAUGE_DOCS = {
    "used_bytes": "Bytes of kvformat files under the root, as this tier accounts them.",
    "files": "kvformat files under the root, as this tier accounts them.",
    "root_healthy": "1 while the root is usable and is the root it was at start-up; 0: stores and loads stopped.",
    "root_used_bytes": "Bytes of kvformat files under a shared root, as its evictor last published (bounded "
                       "roots only).",
    "root_engines": "Engines sharing this root, as its evictor last published (bounded roots only).",
    "evictor": "1 when this tier is its shared root's evictor (bounded roots only).",
    "scan_files": "Files the start-up scan of the root has listed so far.",
    "scan_done": "1 once the start-up scan of the root has finished.",
}


# vLLM 0.34 added ``req_context`` to OffloadingEvent (0.33's tracker takes request data from the scheduler
# instead); fields are probed, not versions compared.
_EVENT_TAKES_REQ_CONTEXT = "req_context" in getattr(OffloadingEvent, "__dataclass_fields__", {})


class _Lookups(AsyncLookupManager):
    """Existence checks of blocks the index does not know (written by another instance), off-thread."""

    def __init__(self, tier: "KVFormatTier", tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._probe_many(keys, req_context)


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
    seal: ``"off"`` (default), ``"authenticate"`` (every file carries an AES-GCM tag under the deployment
        key: a file written without the key is never loaded) or ``"encrypt"`` (the payload is encrypted
        too). spec/FORMAT.md §12, docs/sealed.md.
    seal_key: the key new files are sealed under: a key file path or ``env:NAME`` (never the key itself).
    seal_read_keys: more key sources accepted for reading only (key rotation).
    key_scheme: ``"engine"`` (default: vLLM's block hashes) or ``"token-chain"``: chunks of plain-token
        requests are named by SGLang's page chain over their token ids, in a namespace SGLang's backend with
        the same scheme shares (docs/sglang.md); other requests keep vLLM's keys.
    rope: ``"interleaved"`` or ``"neox"``, the model's RoPE convention, for token-chain when vLLM's config does
        not establish it (it does for DeepSeek-family models, whose MLA vLLM always runs interleaved).

    Raises
    ------
    SchemaError (a ValueError) for a bad parameter or a deployment this tier cannot store (KV that is
    not MLA, PCP together with DCP, a placement it cannot prove: docs/layout.md); TypeError for an
    unknown parameter.
    """

    medium: ClassVar[Medium] = Medium.STORAGE
    #: Bound on :meth:`shutdown` (seconds): a remote root must not hold a vLLM shutdown for minutes.
    shutdown_timeout_s: float = 10.0

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        # Every series carries vLLM's own tier label ("2:KVFormatTier"), so two kvformat tiers in one engine (a
        # local disk and an S3 bucket) are two series, joinable with vllm:kv_offload_tiering_*{tier=...}.
        tier = (TIER_LABEL,)
        out: dict[str, OffloadingMetricMetadata] = {
            METRIC_PREFIX + k: OffloadingCounterMetadata(documentation=d, labelnames=tier)
            for k, d in _COUNTER_DOCS.items()}
        out.update({METRIC_PREFIX + k: OffloadingCounterMetadata(documentation=d, labelnames=(TIER_LABEL, REASON_LABEL))
                    for k, d in _REASON_DOCS.items()})
        out.update({METRIC_PREFIX + k: OffloadingGaugeMetadata(documentation=d, labelnames=tier)
                    for k, d in _GAUGE_DOCS.items()})
        return out

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview, tier_type: str, root: str,
                 read_threads: int = 8, write_threads: int = 8, compression: str = "none",
                 compression_level: int = 3, verify: bool = True, max_bytes: int | str | None = None,
                 o_direct: str = "off", fsync: bool = False, replica_policy: str = "verify",
                 model_revision: str | None = None, storage_options: dict[str, Any] | None = None,
                 enable_kv_events: bool = False, locality: str | None = None, start_degraded: bool = False,
                 shared_allowance: int | str | None = None, shared_interval_s: float = 1.0, seal: str = "off",
                 seal_key: str | None = None, seal_read_keys: list[str] | None = None, key_scheme: str = "engine",
                 rope: str | None = None, backpressure_detector: "BackpressureDetector | None" = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = TierConfig.parse(root, read_threads=read_threads, write_threads=write_threads,
                                       compression=compression, compression_level=compression_level, verify=verify,
                                       max_bytes=max_bytes, o_direct=o_direct, fsync=fsync,
                                       replica_policy=replica_policy, model_revision=model_revision,
                                       storage_options=storage_options, enable_kv_events=enable_kv_events,
                                       locality=locality, start_degraded=start_degraded,
                                       shared_allowance=shared_allowance, shared_interval_s=shared_interval_s,
                                       seal=seal, seal_key=seal_key, seal_read_keys=seal_read_keys,
                                       key_scheme=key_scheme)
        self.tier_label = _tier_label(offloading_spec, tier_type, root)
        self.log = CacheLog(logger, prefix=f"kvformat tier {self.tier_label}")
        self.locality = Locality(locality) if locality is not None else None
        self.plans, self.facts = derive_plans(offloading_spec, model_revision)
        self.plans = sealed_plans(self.plans, self.config)  # the namespace says how files are sealed
        self.copies, self.row_kind = self.facts.copies, self.facts.row
        if self.config.replica_policy == "trust_rank0" and self.copies > 1 and not self.facts.replicated_kv_known:
            raise SchemaError("replica_policy", "trust_rank0 stores worker 0's slot unchecked, but nothing vLLM "
                              "passed proves this model's KV is replicated on every worker (MLA); use \"verify\"")
        first = offloading_spec.config.groups[0].group_id
        self.layout = self.plans[first].layout  # the first group's (most deployments have one group)
        self.namespace = self.layout.namespace()
        self._ns_group = {p.layout.namespace(): g for g, p in self.plans.items()}
        self.store = self._open_store(root)
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
        pf = self.facts.parallel
        prov = Provenance(tp=max(1, par.tp_size), pp=max(1, par.pp_size), dcp=max(1, par.dcp_size),
                          pcp=max(1, par.pcp_size),
                          row=self.row_kind, writer=f"kvformat {__version__} (vllm tier)",
                          pp_layers=pf.stage_layers if pf is not None and pf.pp > 1 else (),
                          cp_interleave=pf.interleave if pf is not None and pf.dcp > 1 else 1)
        self._flat = primary_kv_view.cast("B")
        self.index = LRUIndex(self.config.max_bytes)
        self.engines: dict[int, RowEngine] = {}
        for g, plan in self.plans.items():
            shared = self.engines[first] if self.engines else None
            self.engines[g] = RowEngine(self.store, plan, self._flat, self.block_size_bytes, self.copies,
                                        self.config, prov, self.index, self._on_removed, share=shared)
        self.engine = self.engines[first]
        # The token-chain scheme: plain-token chunks of the (one, pure MLA) group go to a second engine over the
        # same rows, named by SGLang's page chain in a namespace SGLang's backend computes too.
        self._names: TokenNames | None = None
        if self.config.key_scheme == "token-chain":
            chain = token_chain_layout(offloading_spec, self.plans, self.facts, rope)
            plan = self.plans[first]
            self.chain_engine = RowEngine(self.store, RowPlan(chain, plan.slot_bytes, plan.runs, plan.order,
                                                              plan.source, plan.shards),
                                          self._flat, self.block_size_bytes, self.copies, self.config, prov, self.index,
                                          self._on_removed, share=self.engine)
            self._ns_group[chain.namespace()] = first
            self._names = TokenNames(first, chain.tokens_per_block, self.engine.warn)
        self.engine.log = self.log
        namespaces = ", ".join(f"group {g} -> {p.layout.namespace()} ({p.describe()})" for g, p in self.plans.items())
        if self._names is not None:
            namespaces += f", token-chain -> {self.chain_engine.layout.namespace()}"
        self.ops = RootOps(self.store, self.config, self.index, self._all_engines(), self.log,
                           describe=f"{self.row_kind} rows ({self.copies} slot(s)), {namespaces}")
        try:
            self.ops.start()  # raises (naming the parameter) rather than start a tier that can never store
        except BaseException:
            for eng in self._all_engines():
                eng.close()  # no view of vLLM's primary buffer may outlive a tier that failed to start
            try:
                self._flat.release()
            except BufferError:  # still exported somewhere: left to the garbage collector
                pass
            raise
        self._stop = self.ops.stop
        self._pool = DualPool(self.config.read_threads, self.config.write_threads)
        self._lookups = _Lookups(self, tier_type)
        self._jobs = JobBook(self._pool, self._target, self.engine.warn, JobResult,
                             self._on_stored if self.events is not None else None, self._lookups.mark_miss)
        self._report = CounterReport(self.engine.counters, self.index)

    def _open_store(self, root: str) -> Store:
        local = "://" not in root or root.startswith("file://")
        try:
            if local:  # storage_options are for URL roots only
                if self.config.storage_options:
                    logger.warning("kvformat tier %s: storage_options are ignored for the local root %s",
                                   self.tier_label, root)
                return open_store(root, o_direct=self.config.o_direct)
            return open_store(root, **self.config.storage_options)
        except OSError as e:
            raise unusable_root(root, not local, "open", e) from e

    # -- helpers ---------------------------------------------------------------------------------
    def _target(self, key: OffloadKey, req_context: ReqContext | None = None) -> tuple[RowEngine | None, str | None]:
        """The engine of the key's KV-cache group and the file's hash (None, None for a group not stored): vLLM's
        block hash, or under the token-chain scheme the chunk's page-chain key when its request allows one."""
        if self._names is not None:
            named = self._names.resolve(key, req_context)
            if named is not None:
                return self.chain_engine, named
        eng = self.engines.get(get_offload_group_idx(key))
        if eng is None:
            return None, None
        return eng, str(get_offload_block_hash(key).hex())

    def _probe_many(self, keys: list[OffloadKey], req_context: ReqContext | None = None) -> list[bool]:
        out = [False] * len(keys)
        if self._stop.is_set():  # shutting down: no more storage round trips
            return out
        by_engine: dict[int, list[tuple[int, str]]] = {}
        for i, k in enumerate(keys):
            eng, h = self._target(k, req_context)
            if eng is not None and h is not None:
                by_engine.setdefault(id(eng), []).append((i, h))
        for eng in self._all_engines():
            todo = by_engine.get(id(eng))
            if todo:
                for (i, _), ok in zip(todo, eng.probe_many([h for _, h in todo])):
                    out[i] = ok
        return out

    def _all_engines(self) -> list[RowEngine]:
        return [*self.engines.values(), *([self.chain_engine] if self._names is not None else [])]

    def _on_removed(self, relpaths: list[str]) -> None:
        if self.events is None:
            return
        keys = []
        for rel in relpaths:
            parts = block_path_parts(rel, strict=False)
            group = self._ns_group.get(parts[0]) if parts is not None else None
            if parts is not None and self._names is not None and parts[0] == self.chain_engine.ns:
                vkey = self._names.vllm_key(parts[1])  # a page-chain file: announce the vLLM key it served
                if vkey is not None:
                    keys.append(vkey)
                continue
            if parts is not None and group is not None:
                try:
                    keys.append(make_offload_key(bytes.fromhex(parts[1]), group))
                except ValueError:  # an odd number of hex digits: no vLLM key
                    continue
        if keys:
            with self._events_lock:
                self.events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=True,
                                                   locality=self.locality, **self._event_owner))

    def _on_stored(self, job: Job, stored: list[OffloadKey]) -> None:
        extra = dict(self._event_owner)
        if _EVENT_TAKES_REQ_CONTEXT:
            extra["req_context"] = job.req_context  # lets vLLM's tracker describe the chunk
        with self._events_lock:
            if self.events is not None:
                self.events.append(OffloadingEvent(keys=stored, medium=self.medium, removed=False,
                                                   locality=self.locality, **extra))

    # -- SecondaryTierManager ----------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        eng, h = self._target(key, req_context)
        counters = self.engine.counters
        if eng is None or h is None or key in self._jobs.failed:
            counters.add(lookup_misses=1)
            return LookupResult.MISS
        rel = eng.relpath(h)
        if rel in self.index and eng.can_read(rel):
            counters.add(lookup_hits=1)
            return LookupResult.HIT
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        hit = found and rel in self.index and eng.can_read(rel)
        counters.add(**{"lookup_hits" if hit else "lookup_misses": 1})
        return LookupResult.HIT if hit else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=True)

    def _submit(self, job_metadata: TransferJob, *, load: bool) -> None:
        keys = list(job_metadata.keys)
        ctx = getattr(job_metadata, "req_context", None)
        targets = [self._target(k, ctx) for k in keys] if self._names is not None else None
        self._jobs.submit(job_metadata.job_id, keys, job_metadata.chunk_ids, load=load, req_context=ctx,
                          targets=targets)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return self._jobs.take_finished()

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

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if self._names is not None:
            self._names.on_new_request(req_context)  # the token ids, while vLLM still holds the request
        return RequestOffloadingContext()

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
            computed, in_flight, prompt, total = (int(c) for c in counts if c is not None)
            done = min(max(0, computed - in_flight), max(prompt, total - 1))
        # Deepest chunk first, so a request's shortest prefix ends up most recent: a longer prefix is
        # useless without the chunks before it, so those are the last to go.
        for key, pos in sorted(positions.items(), key=lambda kv: -kv[1]):
            if done is not None and pos > done:
                continue
            eng, h = self._target(key, req_context)
            if eng is not None and h is not None:
                self.index.touch(eng.relpath(h))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        label = (self.tier_label,)
        for k, d in self._report.deltas().items():
            stats.increase_counter(METRIC_PREFIX + k, d, label)
        quarantined, failed = self._report.reason_deltas()
        for reason, d in quarantined.items():
            stats.increase_counter(METRIC_PREFIX + "quarantined", d, (self.tier_label, reason))
        for reason, d in failed.items():
            stats.increase_counter(METRIC_PREFIX + "store_failures_by_reason", d, (self.tier_label, reason))
        for k, v in self.ops.gauges().items():
            stats.set_gauge(METRIC_PREFIX + k, v, label)
        return stats

    def counters(self) -> dict[str, int]:
        """Cumulative counters since start (plus ``quarantined:<reason>`` and ``store_failures:<reason>`` counts
        and the gauges: ``used_bytes``, ``files``, ``root_healthy`` …)."""
        out = self._report.totals()
        out.update(self.ops.gauges())
        return out

    def wait_scanned(self, timeout: float | None = None) -> bool:
        """Block until the start-up scan of the root has finished (tests, tools)."""
        self.ops.scan.join(timeout)
        return not self.ops.scan.is_alive() and self.ops.progress.done

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Block until the tier serves as it will from now on (root usable, scan done, on a shared root admitted
        by its evictor); False if that did not happen within ``timeout`` seconds (tests, tools)."""
        deadline = time.monotonic() + timeout
        while not self.ops.ready():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def shutdown(self) -> None:
        """Stop within ``shutdown_timeout_s``: queued jobs fail (each reported once), running ones finish.

        The start-up scan and the async lookups stop at their next step; a remote call already in
        flight is not waited for past the deadline (its threads are daemons). Jobs submitted after
        shutdown fail at once. The primary buffer is released only when no tier thread can touch it any
        more; otherwise it is left to the garbage collector (a warning says so), never unmapped under a
        running copy.
        """
        if not shutdown_bounded(self.shutdown_timeout_s, self._stop, self._all_engines(), self._pool, self.ops.scan,
                                self._lookups.shutdown, self._flat):
            self.log.warning("shutdown gave up after %.0f s waiting for storage I/O at %s; the primary buffer is "
                             "left to the garbage collector", self.shutdown_timeout_s, self.store.root)
        # After the stores finished: the last journal (or the released lease) then counts every file written.
        self.ops.close(min(5.0, self.shutdown_timeout_s / 2))


def _tier_label(spec: Any, tier_type: str, root: str) -> str:
    """vLLM's label of this tier (``"<index + 1>:<type>"``, as TieringMetricsTracker.tier_label spells it): the
    first entry of the spec's ``secondary_tiers`` with this type and root not claimed by an earlier tier object
    (vLLM builds the tiers in list order). ``tier_type`` alone when the spec has no such list."""
    configs = getattr(spec, "secondary_tier_configs", None)
    if not isinstance(configs, list):
        return tier_type
    claimed = _CLAIMED.setdefault(spec, set())
    for i, c in enumerate(configs):
        if isinstance(c, dict) and c.get("type") == tier_type and str(c.get("root")) == root and i not in claimed:
            claimed.add(i)
            return f"{i + 1}:{tier_type}"
    return tier_type


__all__ = ["KVFormatTier", "deployment_facts", "derive_plans", "derive_layout", "METRIC_PREFIX"]
