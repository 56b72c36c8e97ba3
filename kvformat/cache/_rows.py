"""Primary row <-> kvformat file, one chunk at a time. No vLLM import: the tier feeds it row offsets.

:class:`RowEngine` joins the row engine's parts: ``_row_core`` (construction, buffers, eviction deletes and
quarantine), ``_row_store`` (the store path), ``_row_load`` (the load path and probes of unindexed files).
"""

from __future__ import annotations

import threading

from ._counters import COUNTERS as COUNTERS
from ._row_core import (
    CANCELLED as CANCELLED, EXISTS as EXISTS, FAILED as FAILED, REFUSED as REFUSED,
    REPLICA_MISMATCH as REPLICA_MISMATCH, STORE_ATTEMPTS as STORE_ATTEMPTS, TOUCH_INTERVAL_S as TOUCH_INTERVAL_S,
    WRITTEN as WRITTEN,
)
from ._row_load import RowLoad
from ._row_store import RowStore
from ._scan import ScanProgress, scan_root


class RowEngine(RowStore, RowLoad):
    """Moves chunks between the primary rows and a Store, keeping the LRU index and counters."""

    # -- start-up ----------------------------------------------------------------------------------

    def scan(self, stop: threading.Event, progress: ScanProgress | None = None) -> ScanProgress:
        """Rebuild usage and LRU order from the files under the root (a background thread): see ``_scan``."""
        return scan_root(self, stop, progress)
