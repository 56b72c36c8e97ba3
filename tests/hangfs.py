"""A pass-through FUSE filesystem whose reads of chosen files never return until released: the hung read of a
stopped NFS server or MooseFS chunkserver, made on one host without either (issue 43).

``python hangfs.py SOURCE MOUNTPOINT CONTROL [DELAY_S]``: mounts SOURCE at MOUNTPOINT (foreground; unmount with
``umount -l``). CONTROL is a file of basenames or shell patterns (``*.speed``), one a line: a read() of a file
with a matching name blocks (polling CONTROL) until the line is gone from it. Only payload-sized reads block
(> 16 KiB): a header probe of the same file still answers, as on a mount whose metadata server lives but whose
chunkserver stopped. A line that starts with ``!`` (``!state.json``) blocks every read of its files, small
ones too (a control file on a stuck chunk). DELAY_S (default 0): every payload-sized read request waits that
long first, a slow root (a distant NFS server, a throttled bucket) rather than a hung one. The mount uses
direct_io, so the kernel passes each read through with its own size (no read-ahead merging them, no page cache
serving a re-read).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import sys
import time
from typing import Any

from fuse import FUSE, FuseOSError, Operations  # fusepy (libfuse2)

PAYLOAD_READ = 16 << 10


class HangFS(Operations):  # type: ignore[misc]
    def __init__(self, source: str, control: str, delay_s: float = 0.0) -> None:
        self.source = os.path.realpath(source)
        self.control = control
        self.delay_s = delay_s
        self._seen: tuple[int, int, int] | None = None
        self._cached: set[str] = set()

    def _p(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip("/"))

    def _names(self) -> set[str]:
        # Re-read only when CONTROL changed: every read of the mount asks, small ones included.
        try:
            st = os.stat(self.control)
            seen = (st.st_mtime_ns, st.st_size, st.st_ino)
            if seen != self._seen:
                with open(self.control) as f:
                    self._cached = {line.strip() for line in f if line.strip()}
                self._seen = seen
        except OSError:
            return set()
        return self._cached

    def _hung(self, path: str, size: int) -> bool:
        names = self._names()
        if not names:
            return False
        name = os.path.basename(path)
        return any(fnmatch.fnmatchcase(name, n[1:]) if n.startswith("!")
                   else size > PAYLOAD_READ and fnmatch.fnmatchcase(name, n) for n in names)

    # -- metadata ---------------------------------------------------------------------------------------
    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        try:
            st = os.lstat(self._p(path))
        except OSError as e:
            raise FuseOSError(e.errno) from None
        return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime",
                                            "st_mtime", "st_ctime", "st_ino")}

    def readdir(self, path: str, fh: Any) -> list[str]:
        return [".", "..", *os.listdir(self._p(path))]

    def statfs(self, path: str) -> dict[str, Any]:
        sv = os.statvfs(self._p(path))
        return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                            "f_files", "f_flag", "f_frsize", "f_namemax")}

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except OSError as e:
            raise FuseOSError(e.errno or errno.EIO) from None

    def mkdir(self, path: str, mode: int) -> None:
        self._call(os.mkdir, self._p(path), mode)

    def rmdir(self, path: str) -> None:
        self._call(os.rmdir, self._p(path))

    def unlink(self, path: str) -> None:
        self._call(os.unlink, self._p(path))

    def rename(self, old: str, new: str) -> None:
        self._call(os.rename, self._p(old), self._p(new))

    def link(self, target: str, source: str) -> None:
        self._call(os.link, self._p(source), self._p(target))

    def chmod(self, path: str, mode: int) -> None:
        self._call(os.chmod, self._p(path), mode)

    def utimens(self, path: str, times: Any = None) -> None:
        self._call(os.utime, self._p(path), times)

    def truncate(self, path: str, length: int, fh: Any = None) -> None:
        self._call(os.truncate, self._p(path), length)

    # -- data -------------------------------------------------------------------------------------------
    def open(self, path: str, flags: int) -> int:
        return int(self._call(os.open, self._p(path), flags & ~os.O_CREAT))

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return int(self._call(os.open, self._p(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode))

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        if size > PAYLOAD_READ and self.delay_s:
            time.sleep(self.delay_s)
        while self._hung(path, size):
            time.sleep(0.05)
        return bytes(self._call(os.pread, fh, size, offset))

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        return int(self._call(os.pwrite, fh, data, offset))

    def flush(self, path: str, fh: int) -> None:
        pass

    def fsync(self, path: str, datasync: int, fh: int) -> None:
        self._call(os.fsync, fh)

    def release(self, path: str, fh: int) -> None:
        self._call(os.close, fh)


if __name__ == "__main__":
    src, mnt, ctl = sys.argv[1:4]
    delay = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    FUSE(HangFS(src, ctl, delay), mnt, foreground=True, nothreads=False, direct_io=True, default_permissions=True)
