"""The tier's cumulative counters (the metrics vLLM scrapes), with per-reason counts of quarantined files and of
failed stores."""

from __future__ import annotations

import errno
import threading

__all__ = ["COUNTERS", "Counters", "failure_reason"]

COUNTERS = ("bytes_written", "files_written", "bytes_read", "files_read", "checksum_failures", "corrupt_files",
            "layout_mismatches", "replica_mismatches", "evictions", "evicted_bytes", "dedup_saved_bytes",
            "missing_files", "io_errors", "seal_failures", "unknown_key_files", "store_failures", "lookup_hits",
            "lookup_misses", "load_deadline_misses", "late_reads_dropped", "stale_view_misses")


def failure_reason(e: BaseException) -> str:
    """A short stable tag for a failed store: the errno's name for OS errors (``ENOSPC``, ``EROFS``, ``EACCES``),
    else the exception's class name (``TimeoutError``, ``ConnectionError``, a bug's type)."""
    if isinstance(e, OSError) and e.errno is not None and e.errno in errno.errorcode:
        return errno.errorcode[e.errno]
    return type(e).__name__


class Counters:
    """Cumulative counters (thread-safe), plus per-reason counts of quarantined files and failed stores."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.quarantined: dict[str, int] = {}
        self.store_failed: dict[str, int] = {}

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.values[k] += v

    def add_quarantine(self, reason: str) -> None:
        with self._lock:
            self.quarantined[reason] = self.quarantined.get(reason, 0) + 1

    def add_store_failure(self, reason: str, n: int = 1) -> None:
        """Count ``n`` chunks not stored, by ``reason`` (also in the ``store_failures`` total)."""
        with self._lock:
            self.store_failed[reason] = self.store_failed.get(reason, 0) + n
            self.values["store_failures"] += n

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.values), dict(self.quarantined)

    def by_reason(self) -> tuple[dict[str, int], dict[str, int]]:
        """(quarantined files by reason, failed stores by reason), cumulative."""
        with self._lock:
            return dict(self.quarantined), dict(self.store_failed)
