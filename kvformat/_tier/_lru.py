"""The tier's view of what is stored: an LRU of files with sizes, a pin set, and capacity accounting.

Thread-safe (one lock). Sizes are file bytes (header + data), the unit ``max_bytes`` bounds.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Iterable


class LRUIndex:
    """Files this tier knows, least recently used first.

    ``reserve`` accounts for a file about to be written, so the bound holds while writes are in
    flight; ``victims`` picks what to delete to make room, skipping pinned files (a load is
    reading them). Files found by the start-up scan are merged in as older than anything the tier
    touched since it started.
    """

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._reserved = 0
        self._pins: Counter[str] = Counter()
        self._removed_during_scan: set[str] | None = None

    # -- queries ---------------------------------------------------------------------------------
    def __contains__(self, relpath: str) -> bool:
        return relpath in self._entries  # a dict read is atomic under the GIL

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used(self) -> int:
        """Bytes of the indexed files (not counting reservations)."""
        return self._used

    def size_of(self, relpath: str) -> int | None:
        return self._entries.get(relpath)

    # -- updates ---------------------------------------------------------------------------------
    def add(self, relpath: str, size: int, *, reserved: int = 0) -> None:
        """Record a file as most recently used (releasing ``reserved`` bytes taken for it)."""
        with self._lock:
            self._reserved -= reserved
            old = self._entries.pop(relpath, None)
            if old is not None:
                self._used -= old
            self._entries[relpath] = size
            self._used += size

    def touch(self, relpath: str) -> bool:
        with self._lock:
            if relpath in self._entries:
                self._entries.move_to_end(relpath)
                return True
            return False

    def remove(self, relpath: str) -> int | None:
        with self._lock:
            size = self._entries.pop(relpath, None)
            if size is not None:
                self._used -= size
            if self._removed_during_scan is not None:
                self._removed_during_scan.add(relpath)
            return size

    def pin(self, relpath: str) -> None:
        with self._lock:
            self._pins[relpath] += 1

    def unpin(self, relpath: str) -> None:
        with self._lock:
            self._pins[relpath] -= 1
            if self._pins[relpath] <= 0:
                del self._pins[relpath]

    def reserve(self, nbytes: int) -> list[tuple[str, int]]:
        """Account ``nbytes`` for a write about to start; returns the files to delete to make room.

        The victims are already out of the index (so no new lookup returns them); the caller
        deletes them. Pinned files are never chosen; if only pinned files are left the bound is
        exceeded until those loads finish (the next write evicts them).
        """
        with self._lock:
            self._reserved += nbytes
            return self._victims_locked()

    def release(self, nbytes: int) -> None:
        """Give back a reservation whose write did not happen."""
        with self._lock:
            self._reserved -= nbytes

    def victims(self) -> list[tuple[str, int]]:
        """Files to delete so that usage fits ``max_bytes`` (removed from the index)."""
        with self._lock:
            return self._victims_locked()

    def _victims_locked(self) -> list[tuple[str, int]]:
        if self.max_bytes is None:
            return []
        out = []
        excess = self._used + self._reserved - self.max_bytes
        if excess <= 0:
            return out
        for rel in list(self._entries):
            if excess <= 0:
                break
            if self._pins.get(rel):
                continue
            size = self._entries.pop(rel)
            self._used -= size
            excess -= size
            out.append((rel, size))
        return out

    # -- the start-up scan -------------------------------------------------------------------------
    def begin_scan(self) -> None:
        with self._lock:
            self._removed_during_scan = set()

    def merge_scan(self, found: Iterable[tuple[str, int, float]]) -> int:
        """Merge the files found by a scan (relpath, size, mtime) as older than every known entry.

        Files removed while the scan ran are not resurrected. Returns how many were added.
        """
        ordered = sorted(found, key=lambda e: e[2])
        with self._lock:
            gone = self._removed_during_scan or set()
            self._removed_during_scan = None
            merged: OrderedDict[str, int] = OrderedDict()
            used = 0
            for rel, size, _ in ordered:
                if rel in gone or rel in self._entries or rel in merged:
                    continue
                merged[rel] = size
                used += size
            added = len(merged)
            merged.update(self._entries)
            self._entries = merged
            self._used += used
            return added
