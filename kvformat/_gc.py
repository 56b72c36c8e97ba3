"""Offline LRU eviction for ``kvformat gc``: keep a root under a byte budget, oldest mtime first.

Works on the :class:`~kvformat.storage.Store` interface only (``list``/``delete``/``cleanup_temp``), so it
runs on any backend. Safe while a tier serves from the same root: a file is removed with one
``unlink`` (local) or one object delete; a reader that already opened it keeps reading the same
inode to the end, and a reader that opens it afterwards gets ``FileNotFoundError``, which a tier
reports as a miss. Files are replaced only by rename, never rewritten in place, so no reader ever
sees a half-deleted or half-written file. A block read between the listing and its deletion may
still be evicted (its mtime was older when listed): the cost is one recompute, never wrong bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .storage import Store, StoreEntry

__all__ = ["GcReport", "plan_gc", "run_gc"]

TEMP_GRACE_S = 3600.0  # temp files younger than this may belong to a live writer


@dataclass
class GcReport:
    """What ``gc`` found and did; ``to_dict`` is its ``--json`` output."""

    root: str
    max_bytes: int
    dry_run: bool
    files_before: int = 0
    bytes_before: int = 0
    victims: list[StoreEntry] = field(default_factory=list)
    deleted: int = 0
    freed_bytes: int = 0
    temp_removed: int = 0

    @property
    def bytes_after(self) -> int:
        return self.bytes_before - sum(v.size for v in self.victims)

    def to_dict(self) -> dict[str, Any]:
        return {"command": "gc", "root": self.root, "max_bytes": self.max_bytes, "dry_run": self.dry_run,
                "files_before": self.files_before, "bytes_before": self.bytes_before,
                "evict_files": len(self.victims), "evict_bytes": sum(v.size for v in self.victims),
                "bytes_after": self.bytes_after, "deleted": self.deleted, "freed_bytes": self.freed_bytes,
                "temp_removed": self.temp_removed,
                "evicted": [{"path": v.relpath, "bytes": v.size, "mtime": v.mtime} for v in self.victims]}


def plan_gc(store: Store, max_bytes: int) -> GcReport:
    """Which files to evict (least recently used first, ties by path) to get under ``max_bytes``."""
    entries = list(store.list())
    rep = GcReport(store.root, max_bytes, True, len(entries), sum(e.size for e in entries))
    excess = rep.bytes_before - max_bytes
    if excess <= 0:
        return rep
    for e in sorted(entries, key=lambda e: (e.mtime, e.relpath)):
        if excess <= 0:
            break
        rep.victims.append(e)
        excess -= e.size
    return rep


def run_gc(store: Store, max_bytes: int, *, dry_run: bool = False) -> GcReport:
    """Evict LRU files until the root holds at most ``max_bytes``; also drop stale temp files."""
    rep = plan_gc(store, max_bytes)
    rep.dry_run = dry_run
    if dry_run:
        return rep
    rep.temp_removed = store.cleanup_temp(older_than_s=TEMP_GRACE_S)
    for v in rep.victims:
        if store.delete(v.relpath):
            rep.deleted += 1
            rep.freed_bytes += v.size
    return rep
