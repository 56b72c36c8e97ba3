"""The tier's cumulative counters (the metrics vLLM scrapes) and per-reason quarantine counts."""

from __future__ import annotations

import threading

__all__ = ["COUNTERS", "Counters"]

COUNTERS = ("bytes_written", "files_written", "bytes_read", "files_read", "checksum_failures", "corrupt_files",
            "layout_mismatches", "replica_mismatches", "evictions", "evicted_bytes", "dedup_saved_bytes",
            "missing_files", "io_errors", "seal_failures", "unknown_key_files")


class Counters:
    """Cumulative counters (thread-safe), plus per-reason counts of quarantined files."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.quarantined: dict[str, int] = {}

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.values[k] += v

    def add_quarantine(self, reason: str) -> None:
        with self._lock:
            self.quarantined[reason] = self.quarantined.get(reason, 0) + 1

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.values), dict(self.quarantined)
