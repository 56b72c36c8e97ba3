"""The start-up scan's half of :class:`~kvformat.cache._lru.LRUIndex`: files found on storage enter it *cold*.

A mixin only so that _lru.py stays one screenful of the index's own rules; it shares LRUIndex's lock and state.
"""

from __future__ import annotations

import heapq
import threading
from collections import Counter
from typing import Iterable


class ColdScan:
    """Batches of listed files indexed as cold (ordered by mtime, evicted first), removals remembered meanwhile."""

    _lock: threading.Lock
    _removed_during_scan: set[str] | None
    _cold: dict[str, tuple[int, float]]
    _heap: list[tuple[float, str]]
    _used: int
    _doomed: Counter[str]
    _writing: Counter[str]

    def __contains__(self, relpath: str) -> bool:
        raise NotImplementedError  # LRUIndex's (and its subclasses': every segment)

    def begin_scan(self) -> None:
        """Start remembering removals, so that a scan's stale listing cannot bring files back."""
        with self._lock:
            self._removed_during_scan = set()

    def scan_add(self, found: Iterable[tuple[str, int, float]]) -> int:
        """Index a batch of files found by the scan (relpath, size, mtime) as cold. Returns how many.

        Skips files already indexed, being evicted or written, or removed or evicted since :meth:`begin_scan`.
        The caller evicts (``victims``) after each batch, so the bound holds while the scan runs.
        """
        added = 0
        with self._lock:
            gone = self._removed_during_scan or ()
            for rel, size, mtime in found:
                if (rel in gone or rel in self or self._doomed.get(rel)
                        or self._writing.get(rel)):
                    continue
                self._cold[rel] = (size, mtime)
                heapq.heappush(self._heap, (mtime, rel))
                self._used += size
                added += 1
        return added

    def end_scan(self) -> None:
        """The scan is over: stop remembering removals."""
        with self._lock:
            self._removed_during_scan = None

    def merge_scan(self, found: Iterable[tuple[str, int, float]]) -> int:
        """:meth:`scan_add` of everything found, then :meth:`end_scan`. Returns how many were added."""
        added = self.scan_add(found)
        self.end_scan()
        return added
