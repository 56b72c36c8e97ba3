"""The tier's start-up scan: usage and LRU order rebuilt from the files under the root (no engine import)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

from ..format import CanonicalLayout
from ..storage import Store
from ._log import CacheLog
from ._lru import LRUIndex

__all__ = ["SCAN_BATCH", "TEMP_MAX_AGE_S", "ScanProgress", "scan_root"]

TEMP_MAX_AGE_S = 3600.0  # a temp file this old belongs to a crashed writer, not a slow live one
SCAN_BATCH = 1024  # files indexed per batch by the start-up scan (evicting after each batch)


@dataclass
class ScanProgress:
    """How far the scan of the root got (read by metrics and the start-up summary while it runs)."""

    files: int = 0  # files listed so far
    bytes: int = 0
    indexed: int = 0  # of them, files newly indexed
    done: bool = False
    seconds: float = 0.0
    error: str = ""
    temps_removed: int = 0


class _Scanned(Protocol):
    """What the scan needs of the row engine (``_rows.RowEngine``), which calls it."""

    store: Store
    layout: CanonicalLayout
    index: LRUIndex
    log: CacheLog
    _mtimes: dict[str, float]

    def delete_victims(self, victims: list[tuple[str, int]]) -> None: ...


def scan_root(self: _Scanned, stop: threading.Event, progress: ScanProgress | None = None) -> ScanProgress:
    """Rebuild usage and LRU order from the files under the root (runs in a background thread).

    Files are indexed in batches of SCAN_BATCH and evicted after each batch, so ``max_bytes`` holds
    over what is known while the scan runs (not only once it ends).
    """
    p = progress if progress is not None else ScanProgress()
    p.done, p.error, t0 = False, "", time.monotonic()
    self.index.begin_scan()
    batch: list[tuple[str, int, float]] = []

    def flush() -> None:
        p.indexed += self.index.scan_add(batch)
        batch.clear()
        if not stop.is_set():  # after shutdown nothing is deleted any more
            self.delete_victims(self.index.victims())

    try:
        self.store.ensure_namespace(self.layout)
        p.temps_removed = self.store.cleanup_temp(older_than_s=TEMP_MAX_AGE_S, dead_writers=True)
        for e in self.store.list():
            if stop.is_set():
                break
            batch.append((e.relpath, e.size, e.mtime))
            p.files += 1
            p.bytes += e.size
            self._mtimes.setdefault(e.relpath, e.mtime)
            if len(batch) >= SCAN_BATCH:
                flush()
    except OSError as e:
        p.error = f"{type(e).__name__}: {e}"
        self.log.error("listing the root %s failed after %d files: %s. The bound counts only the files found so "
                       "far (more may be on storage until a later scan), and lookups of other files still read "
                       "storage", self.store.root, p.files, p.error)
    finally:
        flush()
        self.index.end_scan()
        p.seconds = time.monotonic() - t0
        p.done = True
    return p
