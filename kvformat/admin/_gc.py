"""Offline LRU eviction for ``kvformat gc``: keep a root under a byte budget, oldest mtime first.

Works on the :class:`~kvformat.storage.Store` interface (``list``/``delete``/``cleanup_temp``), so it
runs on any backend. Safe while a tier serves from the same root: a file is removed with one
``unlink`` (local) or one object delete; a reader that already opened it keeps reading the same
inode to the end, and a reader that opens it afterwards gets ``FileNotFoundError``, which a tier
reports as a miss. Files are replaced only by rename, never rewritten in place, so no reader ever
sees a half-deleted or half-written file. A block read between the listing and its deletion may
still be evicted (its mtime was older when listed): the cost is one recompute, never wrong bytes.

Only block files (``<namespace>/<hh>/<hh>/<hash>.kvf``) inside a namespace directory of the root
are candidates: a directory that is not a kvformat root, or that holds several roots, is refused
(:func:`open_gc_root`), and other ``.kvf`` files are reported, never deleted. A limit of None (the
CLI's and the tier's ``0``) means no limit: nothing is evicted.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..format import BLOCK_PATH_HELP, NAMESPACE_FILE, QUARANTINE_DIR, block_path_parts, iter_files
from ..storage import Store, StoreEntry, open_store, split_root, unlink_in
from ..errors import PathEscapeError, UsageError
from ._scan import not_a_root

__all__ = ["GcReport", "open_gc_root", "plan_gc", "run_gc"]

TEMP_GRACE_S = 3600.0  # temp files younger than this may belong to a live writer


@dataclass
class GcReport:
    """What ``gc`` found and did (or, with ``dry_run``, would do); ``to_dict`` is its ``--json`` output."""

    root: str
    max_bytes: int | None
    dry_run: bool
    files_before: int = 0
    bytes_before: int = 0
    victims: list[StoreEntry] = field(default_factory=list)
    quarantine_victims: list[StoreEntry] = field(default_factory=list)
    deleted: int = 0
    freed_bytes: int = 0
    temp_removed: int = 0
    failed: list[dict[str, str]] = field(default_factory=list)
    ignored: list[dict[str, str]] = field(default_factory=list)

    @property
    def bytes_after(self) -> int:
        return self.bytes_before - sum(v.size for v in self.victims)

    @property
    def exit_code(self) -> int:
        return 2 if self.failed else 0

    def to_dict(self) -> dict[str, Any]:
        return {"command": "gc", "root": self.root, "max_bytes": self.max_bytes, "dry_run": self.dry_run,
                "files_before": self.files_before, "bytes_before": self.bytes_before,
                "evict_files": len(self.victims), "evict_bytes": sum(v.size for v in self.victims),
                "bytes_after": self.bytes_after, "deleted": self.deleted, "freed_bytes": self.freed_bytes,
                "temp_removed": self.temp_removed,
                "evicted": [{"path": v.relpath, "bytes": v.size, "mtime": v.mtime} for v in self.victims],
                "quarantine_purged": [{"path": v.relpath, "bytes": v.size, "mtime": v.mtime}
                                      for v in self.quarantine_victims],
                "failed": self.failed, "ignored": self.ignored, "exit_code": self.exit_code}


def open_gc_root(root: str) -> Store:
    """The store of a kvformat root for gc; UsageError for anything else.

    Refused: a missing path, a namespace directory (gc bounds a whole root), and a directory with no
    namespace directly under it (an empty tree, a legacy cache, or a parent of several roots, whose
    files gc must not treat as one LRU set).
    """
    scheme, path = split_root(root)
    if not scheme:
        if not os.path.isdir(path):
            raise UsageError(f"{root}: not a directory")
        if os.path.isfile(os.path.join(path, NAMESPACE_FILE)):
            raise UsageError(f"{root}: a namespace directory; give its root ({os.path.dirname(os.path.abspath(path))})")
    store = open_store(root)
    if not store.namespace_dirs():
        raise UsageError(not_a_root(root if scheme else path, "collect")
                         + "; gc deletes only block files inside a root's namespaces")
    return store


def plan_gc(store: Store, max_bytes: int | None, ignored: list[dict[str, str]] | None = None, *,
            namespaces_only: bool = False) -> GcReport:
    """Which block files to evict (least recently used first, ties by path) to get under ``max_bytes``.

    ``max_bytes`` None (or 0) is no limit: nothing is evicted. Only block paths are candidates (a
    nested root's files are one level deeper, so never); with ``namespaces_only`` (the CLI) only
    those whose directory holds a regular namespace.json, as the tier's roots all do.
    """
    nss = set(store.namespace_dirs()) if namespaces_only else None
    entries = []
    for e in store.list():
        parts = block_path_parts(e.relpath)
        if parts is not None and (nss is None or parts[0] in nss):
            entries.append(e)
        elif ignored is not None:
            why = (f"not a block path ({BLOCK_PATH_HELP})" if parts is None
                   else f"{parts[0]} has no namespace.json (not a kvformat namespace)")
            ignored.append({"path": e.relpath, "why": why + ": never deleted"})
    rep = GcReport(store.root, max_bytes or None, True, len(entries), sum(e.size for e in entries))
    if not max_bytes:
        return rep
    excess = rep.bytes_before - max_bytes
    for e in sorted(entries, key=lambda e: (e.mtime, e.relpath)):
        if excess <= 0:
            break
        rep.victims.append(e)
        excess -= e.size
    return rep


def _quarantined(store: Store, ids: dict[str, tuple[int, int]]) -> list[StoreEntry]:
    if not store.is_local:
        raise UsageError("--quarantine: purging .quarantine is supported on local roots only (the Store "
                         "interface lists no quarantined objects)")
    qdir = os.path.join(store.root, QUARANTINE_DIR)
    if os.path.islink(qdir) or not os.path.isdir(qdir):
        return []
    out = []
    for rel, e in iter_files(qdir, ""):
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        out.append(StoreEntry(f"{QUARANTINE_DIR}/{rel}", st.st_size, st.st_mtime))
        ids[out[-1].relpath] = (st.st_dev, st.st_ino)
    return sorted(out, key=lambda e: e.relpath)


def run_gc(store: Store, max_bytes: int | None, *, dry_run: bool = False, quarantine: bool = False,
           evict: bool = True, namespaces_only: bool = False, progress: Callable[[int], None] | None = None,
           on_plan: Callable[[int], None] | None = None) -> GcReport:
    """Evict LRU block files until the root holds at most ``max_bytes`` (None: no limit); drop stale temp
    files; with ``quarantine`` also delete everything under ``.quarantine``.

    ``dry_run`` plans exactly the same deletions and performs none. ``progress`` is called with each
    deleted file's size, ``on_plan`` once with the number of files to delete.
    """
    ignored: list[dict[str, str]] = []
    rep = plan_gc(store, max_bytes if evict else None, ignored, namespaces_only=namespaces_only)
    rep.ignored = ignored
    rep.dry_run = dry_run
    ids: dict[str, tuple[int, int]] = {}
    if quarantine:
        rep.quarantine_victims = _quarantined(store, ids)
    if on_plan is not None:
        on_plan(len(rep.victims) + len(rep.quarantine_victims))
    if dry_run:
        return rep
    rep.temp_removed = store.cleanup_temp(older_than_s=TEMP_GRACE_S)
    for v in rep.victims:
        try:
            if store.delete(v.relpath):
                rep.deleted += 1
                rep.freed_bytes += v.size
        except PathEscapeError as e:  # a directory swapped for a symlink since the listing: nothing removed
            rep.failed.append({"path": v.relpath, "error": f"{type(e).__name__}: {e}"})
        if progress is not None:
            progress(v.size)
    for v in rep.quarantine_victims:
        try:  # from a descriptor of the root, only the inode listed: a swapped-in symlink deletes nothing outside
            unlink_in(store.root, v.relpath, ids.get(v.relpath))
        except OSError as e:
            rep.failed.append({"path": v.relpath, "error": f"{type(e).__name__}: {e.strerror or e}"})
        if progress is not None:
            progress(v.size)
    if rep.quarantine_victims:
        _prune_dirs(os.path.join(store.root, QUARANTINE_DIR))
    return rep


def _prune_dirs(top: str) -> None:
    """Remove the now-empty directories under ``top`` (not ``top`` itself: a tier may be moving a file in)."""
    for dirpath, _dirs, _files in os.walk(top, topdown=False):
        if dirpath != top:
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
