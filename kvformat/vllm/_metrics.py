"""The tier's Prometheus series (their definitions, vLLM's tier label, the stats handed to vLLM each step).

Every series carries vLLM's own tier label ("2:KVFormatTier"), so two kvformat tiers in one engine (a local disk
and an S3 bucket) are two series, joinable with vllm:kv_offload_tiering_*{tier=...}.
"""

from __future__ import annotations

import weakref
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingMetricMetadata

from ..cache import CounterReport, RootOps
from ._compat import TIER_LABEL

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
    "load_deadline_misses": "Loads reported a miss because they were not done read_deadline_s after they were asked "
                            "for (a hung mount or a stalled server).",
    "late_reads_dropped": "Reads given up on at read_deadline_s that returned later: their bytes were dropped, "
                          "never written into KV memory.",
    "stale_view_misses": "Lookups and loads answered a miss because this engine's view of the shared root was not "
                         "current (its coordination round had not finished within ttl_s/2: a slow mount or a "
                         "starved process).",
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
    "control_rejected": "Control records (journal, lease, state) of a shared root skipped as malformed, out of "
                        "bounds or unreadable, as this engine counted them (bounded roots only; docs/operations.md).",
    "evictor": "1 when this tier is its shared root's evictor (bounded roots only).",
    "scan_files": "Files the start-up scan of the root has listed so far.",
    "scan_done": "1 once the start-up scan of the root has finished.",
    "protected_share": "eviction=\"ghost-slru\": the share of max_bytes this engine's evictor now keeps for files "
                       "loaded since stored (starts at 0.2, moved by ARC's ghost rule; on a shared root the "
                       "evictor's is the one in effect).",
    "root_read_gbps": "compression=\"auto\": the root's read speed measured at start-up through its store (GB/s of "
                      "one chunk-sized file, past the page cache on a local path).",
    "codec_decode_gbps": "compression=\"auto\": the planes codec's verified decode speed on one core, measured at "
                         "start-up on a synthetic chunk of this deployment's layout (GB/s of payload).",
}
# The codec stores write with: 1 on the series whose labels name it and how it was set ("fixed" or "auto").
_INFO_DOC = ("The codec this tier writes files with (label codec: none, zstd, planes) and how it was chosen (label "
             "mode: fixed by the compression setting, or auto: measured at start-up); the value is always 1.")
CODEC_LABELS = ("codec", "mode")


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every series the tier reports (``KVFormatTier.build_metric_definitions``)."""
    tier = (TIER_LABEL,)
    out: dict[str, OffloadingMetricMetadata] = {
        METRIC_PREFIX + k: OffloadingCounterMetadata(documentation=d, labelnames=tier)
        for k, d in _COUNTER_DOCS.items()}
    out.update({METRIC_PREFIX + k: OffloadingCounterMetadata(documentation=d, labelnames=(TIER_LABEL, REASON_LABEL))
                for k, d in _REASON_DOCS.items()})
    out.update({METRIC_PREFIX + k: OffloadingGaugeMetadata(documentation=d, labelnames=tier)
                for k, d in _GAUGE_DOCS.items()})
    out[METRIC_PREFIX + "compression_info"] = OffloadingGaugeMetadata(documentation=_INFO_DOC,
                                                                      labelnames=(TIER_LABEL, *CODEC_LABELS))
    return out


def connector_stats(report: CounterReport, ops: RootOps, tier_label: str) -> OffloadingConnectorStats:
    """The counters' increments since the last call and the gauges now (``KVFormatTier.get_stats``)."""
    stats = OffloadingConnectorStats()
    label = (tier_label,)
    for k, d in report.deltas().items():
        stats.increase_counter(METRIC_PREFIX + k, d, label)
    quarantined, failed = report.reason_deltas()
    for reason, d in quarantined.items():
        stats.increase_counter(METRIC_PREFIX + "quarantined", d, (tier_label, reason))
    for reason, d in failed.items():
        stats.increase_counter(METRIC_PREFIX + "store_failures_by_reason", d, (tier_label, reason))
    for k, v in ops.gauges().items():
        stats.set_gauge(METRIC_PREFIX + k, v, label)
    c = ops.compression
    stats.set_gauge(METRIC_PREFIX + "compression_info", 1, (tier_label, c.codec, c.mode))
    for k, g in c.gauges().items():
        stats.set_gauge(METRIC_PREFIX + k, g, label)
    return stats


def tier_label(spec: Any, tier_type: str, root: str) -> str:
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
