"""A local-filesystem store (plain paths, NFS, Lustre): O_DIRECT-capable, zero-copy reads."""

from __future__ import annotations

import builtins  # annotations inside Store name builtins.list: Store.list shadows it there
import errno
import os
import secrets
import stat
import threading
import time
from typing import Any, Iterator, Sequence

from ..format import (
    FILE_SUFFIX, NAMESPACE_FILE, O_DIRECT as _O_DIRECT, QUARANTINE_DIR, TMP_PREFIX, BlockHeader, BlockKey,
    CanonicalLayout, FileId, FileSource, HeaderTemplates, Keyring, iter_files, read_into_fused, temp_writer_gone,
    write_atomic, write_block_fused,
)
from ._safepath import GONE as GONE_OUT, MOVED as MOVED_OUT, link_in, rename_in, unlink_in
from ..errors import KVFormatError, PathEscapeError
from ._base import GONE, MOVED, REPLACED, Store, StoreEntry


# Filesystems whose reads wait on another machine or a user-space daemon: a stopped server or chunkserver
# blocks a read for as long as it stays stopped. Local block filesystems and tmpfs are not listed.
_NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs", "9p",
                         "afs", "beegfs", "ocfs2", "gfs2", "virtiofs", "orangefs", "pvfs2"})


def _hangs(fs_type: str) -> bool:
    return fs_type in _NETWORK_FS or fs_type.startswith("fuse")  # fuse, fuseblk, fuse.mfs, fuse.sshfs ...


def mount_fs_type(path: str) -> str | None:
    """The filesystem type of the mount holding ``path`` (from /proc/self/mountinfo), None if unknown."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best, fs_type = -1, None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right:
            continue
        mnt = fields[4].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > best:
            best, fs_type = len(mnt), right.split()[0]
    return fs_type


class LocalStore(Store):
    """Files under a local directory. ``o_direct``: "auto" (try it, fall back), "on" or "off".

    ``stats["o_direct_bytes"]`` counts payload bytes actually read with O_DIRECT.
    """

    supports_o_direct = bool(_O_DIRECT)
    is_local = True

    def __init__(self, root: str, *, o_direct: str = "off") -> None:
        if o_direct not in ("auto", "on", "off"):
            raise ValueError(f"o_direct: expected auto, on or off, got {o_direct!r}")
        self.root = os.path.abspath(root)
        self.o_direct = o_direct
        self.stats = {"o_direct_bytes": 0}
        self._stats_lock = threading.Lock()  # reader threads add to stats concurrently
        os.makedirs(self.root, exist_ok=True)
        self.fs_type = mount_fs_type(self.root)
        self.reads_may_hang = self.fs_type is None or _hangs(self.fs_type)

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    def _abs(self, relpath: str) -> str:
        p = os.path.normpath(os.path.join(self.root, relpath))
        if p != self.root and not p.startswith(self.root + os.sep):
            raise ValueError(f"path {relpath!r} leaves the store root")
        return p

    def _where(self, relpath: str) -> str:
        return self._abs(relpath)

    def local_path(self, relpath: str) -> str:
        return self._abs(relpath)

    @property
    def fused_io(self) -> bool:
        # Exactly a LocalStore: a subclass may override put/read_into, and the fused paths would bypass it.
        return type(self) is LocalStore

    def read_into_fused(self, relpath: str, out: Any, *, expect: CanonicalLayout, key: BlockKey | None = None,
                        verify: bool = True, o_direct: bool = False, keys: Keyring | None = None,
                        templates: HeaderTemplates | None = None) -> BlockHeader:
        return read_into_fused(self._abs(relpath), out, expect=expect, key=key, verify=verify, o_direct=o_direct,
                               keys=keys, templates=templates)

    def put_fused(self, relpath: str, header: bytes, payload: Any, *, fsync: bool = False, o_direct: bool = False,
                  keep_parents: int | None = None, others: tuple[Any, int, int] | None = None) -> bool:
        keep = keep_parents
        wrote, _ = write_block_fused(self._abs(relpath), header, payload, fsync=fsync, overwrite=False,
                                     o_direct=o_direct, others=others,
                                     make_parent=None if keep is None else lambda: self.make_parent(relpath, keep))
        return wrote

    # -- primitives -------------------------------------------------------------------------------
    def _open_many(self, relpaths: Sequence[str], *, head_only: bool,
                   timeout_s: float | None) -> Iterator[tuple[int, Any]]:
        # Opened one at a time, as the caller consumes them: one descriptor open at once.
        direct = self.o_direct != "off" and not head_only
        for i, rel in enumerate(relpaths):
            try:
                src = _CountingSource(self._abs(rel), self, o_direct=direct)
            except (OSError, KVFormatError) as e:
                yield i, e
                continue
            yield i, src

    def _put_many(self, items: Sequence[tuple[str, list[Any]]], *, overwrite: bool, fsync: bool,
                  timeout_s: float | None) -> builtins.list[bool | BaseException]:
        out: builtins.list[bool | BaseException] = []
        for rel, parts in items:
            try:
                out.append(write_atomic(self._abs(rel), parts, fsync=fsync, overwrite=overwrite))
            except OSError as e:
                out.append(e)
        return out

    def _delete_many(self, relpaths: Sequence[str], timeout_s: float | None) -> builtins.list[bool | BaseException]:
        out: builtins.list[bool | BaseException] = []
        for rel in relpaths:
            try:  # from a descriptor of the root: a journal naming a path through a symlink deletes nothing outside
                out.append(unlink_in(self.root, rel) == MOVED_OUT)
            except OSError as e:
                out.append(e)
        return out

    def _move(self, src: str, dst: str, file_id: FileId | None = None) -> str:
        d = self._abs(dst)
        s = self._abs(src)
        _refuse_symlinks(self.root, os.path.dirname(d))
        os.makedirs(os.path.dirname(d), exist_ok=True)
        if file_id is None:
            return GONE if rename_in(self.root, src, dst) == GONE else MOVED
        return self._move_if_same(s, d, file_id)

    def _move_if_same(self, src: str, dst: str, file_id: FileId) -> str:
        """Move ``src`` to ``dst`` only if it is the file ``file_id`` names (MOVED, GONE or REPLACED).

        No syscall renames "this inode only", so the file is first renamed to a private name beside ``dst``
        (atomic: whoever publishes at ``src`` meanwhile keeps the name to itself), then checked there. A
        file that is not the one read (published between the check before and the rename) goes back under
        its name with link(2), which never replaces a newer file; only in that race does the name lack a
        valid file, for an instant: a reader then gets a miss, never wrong bytes (G-5.3).
        """
        try:
            at = os.lstat(src)
            if stat.S_ISLNK(at.st_mode):  # a symlink at a block path (the operator's): the file read is its target
                if not file_id.same_file(os.stat(src)):
                    return REPLACED
                file_id = FileId.of_stat(at)  # and the link is what moves: checked again once aside
            elif not file_id.same_file(at):  # the common case of a replaced file: nothing is touched
                return REPLACED
        except FileNotFoundError:
            return GONE
        aside = f"{dst}.{os.getpid()}-{secrets.token_hex(6)}"  # inside .quarantine: never listed, never a temp file
        try:
            self._rename_aside(src, aside)
        except FileNotFoundError:
            return GONE
        if file_id.same_file(os.lstat(aside)):
            rename_in(self.root, self._rel(aside), self._rel(dst))
            return MOVED
        try:
            link_in(self.root, self._rel(aside), self._rel(src))
        except FileExistsError:  # a newer file took the name: the one taken aside is redundant
            pass
        unlink_in(self.root, self._rel(aside))
        return REPLACED

    def _rel(self, path: str) -> str:
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def _rename_aside(self, src: str, aside: str) -> None:
        # One method, so that a test can publish a file in the window between the check and the rename.
        # From a descriptor of the root: a directory on src's path that is a symlink stops it (PathEscapeError).
        if rename_in(self.root, self._rel(src), self._rel(aside)) == GONE_OUT:
            raise FileNotFoundError(errno.ENOENT, "gone since the check", src)

    def _exists_many(self, relpaths: Sequence[str], timeout_s: float | None) -> builtins.list[bool]:
        return [os.path.isfile(self._abs(r)) for r in relpaths]

    # -- other operations -------------------------------------------------------------------------
    def read_bytes(self, relpath: str) -> bytes:
        self._check(relpath)
        with open(self._abs(relpath), "rb") as f:
            return f.read()

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

    def list_dir(self, prefix: str) -> builtins.list[StoreEntry]:
        self._check(prefix)
        out = []
        try:
            with os.scandir(self._abs(prefix)) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(st.st_mode) and not e.name.startswith(TMP_PREFIX):
                        out.append(StoreEntry(f"{prefix}/{e.name}", st.st_size, st.st_mtime))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return out

    def root_identity(self) -> tuple[int, int]:
        st = os.stat(self.root)
        return st.st_dev, st.st_ino

    def make_parent(self, relpath: str, keep: int = 1) -> None:
        """Create the missing directories above ``relpath`` except its first ``keep`` levels, which must exist.

        A tier creates its hash directories this way, never the namespace directory: when the root's mount
        is gone the path leads to the mount point's own (empty) directory, and the write fails with
        ``FileNotFoundError`` instead of re-creating the tree on the disk underneath."""
        parts = relpath.split("/")[:-1]
        base = os.path.join(self.root, *parts[:keep])
        if not os.path.isdir(base):
            raise FileNotFoundError(errno.ENOENT, "the directory the store writes under is gone", base)
        for part in parts[keep:]:
            base = os.path.join(base, part)
            try:
                os.mkdir(base)
            except FileExistsError:
                pass

    def cleanup_temp(self, older_than_s: float = 0.0, *, dead_writers: bool = False) -> int:
        """Remove temp files older than ``older_than_s``; with ``dead_writers`` also, at any age, those
        whose writer (a process of this host) is gone. A live writer's temp file is never touched."""
        n, now = 0, time.time()
        for dirpath, _dirnames, filenames in os.walk(self.root):
            for name in filenames:
                if name.startswith(TMP_PREFIX):
                    p = os.path.join(dirpath, name)
                    try:
                        st = os.lstat(p)
                        if (now - st.st_mtime >= older_than_s or (dead_writers and temp_writer_gone(name))):
                            # from the root's descriptor, that inode only: a directory swapped for a symlink
                            # since the walk deletes nothing outside (PathEscapeError: skipped)
                            n += unlink_in(self.root, self._rel(p), (st.st_dev, st.st_ino)) == MOVED_OUT
                    except FileNotFoundError:
                        pass
                    except PathEscapeError:
                        pass
        return n

    def _namespace_dirs(self) -> builtins.list[str]:
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


class _CountingSource(FileSource):
    """A FileSource that adds its O_DIRECT bytes to the store's stats when closed."""

    def __init__(self, path: str, store: LocalStore, *, o_direct: bool) -> None:
        super().__init__(path, o_direct=o_direct)
        self._store = store

    def close(self) -> None:
        if self.fd >= 0 and self.direct_bytes:
            with self._store._stats_lock:
                self._store.stats["o_direct_bytes"] += self.direct_bytes
        super().close()
