"""A local-filesystem store (plain paths, NFS, Lustre): O_DIRECT-capable, zero-copy reads."""

from __future__ import annotations

import errno
import os
import stat
import time
from typing import Any, Iterator

from .._io import TMP_PREFIX, iter_files, temp_writer_gone, read_header, read_into, write_atomic
from .._spec import FILE_SUFFIX, NAMESPACE_FILE, QUARANTINE_DIR, BlockHeader, BlockKey, CanonicalLayout
from ._base import Store, StoreEntry


class LocalStore(Store):
    """Files under a local directory. ``o_direct``: "auto" (try it, fall back), "on" or "off"."""

    def __init__(self, root: str, *, o_direct: str = "off") -> None:
        if o_direct not in ("auto", "on", "off"):
            raise ValueError(f"o_direct: expected auto, on or off, got {o_direct!r}")
        self.root = os.path.abspath(root)
        self.o_direct = o_direct
        os.makedirs(self.root, exist_ok=True)

    def _abs(self, relpath: str) -> str:
        p = os.path.normpath(os.path.join(self.root, relpath))
        if p != self.root and not p.startswith(self.root + os.sep):
            raise ValueError(f"path {relpath!r} leaves the store root")
        return p

    def put(self, relpath: str, parts: list[Any], *, overwrite: bool = False, fsync: bool = False) -> bool:
        return write_atomic(self._abs(relpath), parts, fsync=fsync, overwrite=overwrite)

    def read_into(self, relpath: str, out: Any, *, expect: CanonicalLayout | None = None,
                  key: BlockKey | None = None, verify: bool = True) -> BlockHeader:
        return read_into(self._abs(relpath), out, expect=expect, key=key, verify=verify,
                         o_direct=self.o_direct != "off")

    def read_header(self, relpath: str, *, verify: bool = True) -> BlockHeader:
        return read_header(self._abs(relpath), verify=verify)

    def read_bytes(self, relpath: str) -> bytes:
        with open(self._abs(relpath), "rb") as f:
            return f.read()

    def exists(self, relpath: str) -> bool:
        return os.path.isfile(self._abs(relpath))

    def delete(self, relpath: str) -> bool:
        try:
            os.unlink(self._abs(relpath))
            return True
        except FileNotFoundError:
            return False

    def list(self, prefix: str = "") -> Iterator[StoreEntry]:
        if not prefix:
            return scan_entries(self.root)
        rel = os.path.relpath(self._abs(prefix), self.root).replace(os.sep, "/")
        if rel == QUARANTINE_DIR or rel.startswith(QUARANTINE_DIR + "/"):
            return iter(())
        return scan_entries(self._abs(prefix), rel + "/")

    def touch(self, relpath: str) -> None:
        try:
            os.utime(self._abs(relpath))
        except FileNotFoundError:
            pass

    def quarantine(self, relpath: str, reason: str) -> str | None:
        dst_rel = f"{QUARANTINE_DIR}/{relpath}.{reason}"
        dst = self._abs(dst_rel)
        _refuse_symlinks(self.root, os.path.dirname(dst))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            os.replace(self._abs(relpath), dst)
        except FileNotFoundError:
            return None
        return dst_rel

    def cleanup_temp(self, older_than_s: float = 0.0, *, dead_writers: bool = False) -> int:
        """Remove temp files older than ``older_than_s``; with ``dead_writers`` also, at any age, those
        whose writer (a process of this host) is gone. A live writer's temp file is never touched."""
        n, now = 0, time.time()
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in filenames:
                if name.startswith(TMP_PREFIX):
                    p = os.path.join(dirpath, name)
                    try:
                        if (now - os.lstat(p).st_mtime >= older_than_s
                                or (dead_writers and temp_writer_gone(name))):
                            os.unlink(p)
                            n += 1
                    except FileNotFoundError:
                        pass
        return n

    def _namespace_dirs(self) -> list[str]:
        try:
            return [d for d in os.listdir(self.root) if os.path.isfile(os.path.join(self.root, d, NAMESPACE_FILE))]
        except FileNotFoundError:
            return []


def _refuse_symlinks(root: str, path: str) -> None:
    """Raise ELOOP if a directory between ``root`` and ``path`` is a symlink.

    A planted ``.quarantine`` symlink must not move a bad file (or create directories) outside the root.
    """
    p = root
    for part in os.path.relpath(path, root).split(os.sep):
        p = os.path.join(p, part)
        try:
            if stat.S_ISLNK(os.lstat(p).st_mode):
                raise OSError(errno.ELOOP, "a symlink inside the store root would lead the move out of it", p)
        except FileNotFoundError:
            return


def scan_entries(root: str, rel_prefix: str = "") -> Iterator[StoreEntry]:
    """Every ``.kvf`` file under ``root`` as a StoreEntry (relpath = ``rel_prefix`` + path under root),
    quarantine and temp files excluded; never follows symlinks."""
    for rel, e in iter_files(root, FILE_SUFFIX, skip_top=() if rel_prefix else (QUARANTINE_DIR,)):
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:  # removed since the scan (gc, another tier)
            continue
        yield StoreEntry(rel_prefix + rel, st.st_size, st.st_mtime)
