"""The tier's start-up scan: usage and LRU order rebuilt from the files under the root (no vLLM import)."""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from ..format._spec import CanonicalLayout
from ..storage import Store
from ._lru import LRUIndex

__all__ = ["SCAN_BATCH", "TEMP_MAX_AGE_S", "scan_root"]

logger = logging.getLogger("kvformat.vllm")

TEMP_MAX_AGE_S = 3600.0  # a temp file this old belongs to a crashed writer, not a slow live one
SCAN_BATCH = 1024  # files indexed per batch by the start-up scan (evicting after each batch)


class _Scanned(Protocol):
    """What the scan needs of the row engine (``_rows.RowEngine``), which calls it."""

    store: Store
    layout: CanonicalLayout
    index: LRUIndex
    _mtimes: dict[str, float]

    def delete_victims(self, victims: list[tuple[str, int]]) -> None: ...


def scan_root(self: _Scanned, stop: threading.Event) -> None:
    """Rebuild usage and LRU order from the files under the root (runs in a background thread).

    Files are indexed in batches of SCAN_BATCH and evicted after each batch, so ``max_bytes`` holds
    over what is known while the scan runs (not only once it ends).
    """
    self.index.begin_scan()
    added = 0
    batch: list[tuple[str, int, float]] = []

    def flush() -> int:
        n = self.index.scan_add(batch)
        batch.clear()
        if not stop.is_set():  # after shutdown nothing is deleted any more
            self.delete_victims(self.index.victims())
        return n

    try:
        self.store.ensure_namespace(self.layout)
        self.store.cleanup_temp(older_than_s=TEMP_MAX_AGE_S, dead_writers=True)
        for e in self.store.list():
            if stop.is_set():
                break
            batch.append((e.relpath, e.size, e.mtime))
            self._mtimes.setdefault(e.relpath, e.mtime)
            if len(batch) >= SCAN_BATCH:
                added += flush()
    except OSError as e:
        logger.warning("kvformat tier: scanning %s failed: %s; capacity counts only what was found",
                       self.store.root, e)
    finally:
        added += flush()
        self.index.end_scan()
    logger.info("kvformat tier: found %d files (%d bytes) under %s", added, self.index.used, self.store.root)
