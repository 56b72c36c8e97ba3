"""One legacy row file -> one kvformat file: the per-file work of :func:`kvformat.compact.compact`.

A source that is wholly in the page cache is mapped (its replicas compared where they lie); any other
is read into a per-thread buffer. The output goes through ``Store.put_block`` (temp file + rename).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any

from ..format import Keyring, __version__, read_exact
from ..errors import KVFormatError, ReplicaMismatchError
from ._rows import LegacyFile, RowLayout, extract_payload, key_for, provenance_for
from ..storage import MOVED as UNLINKED, Store, open_in, unlink_in

WRITER = f"kvformat-compact {__version__}"  # fixed: outputs must not depend on when/where they were made
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@dataclass
class FileResult:
    """The outcome of one source file."""

    status: str  # converted | skipped | failed | would_write
    src: str
    rel: str = ""
    before: int = 0
    after: int = 0
    error: str = ""
    reason: str = ""
    deleted: bool = False


@dataclass(frozen=True)
class Task:
    file: LegacyFile
    row: RowLayout
    rel: str
    after: int


@dataclass
class Converter:
    """Converts one legacy row file per :meth:`run` (thread-safe: buffers are per thread)."""

    store: Store
    codec: str
    level: int
    delete_source: bool
    fsync: bool
    mode: int | None = None
    keys: Keyring | None = None  # sealed outputs (spec §12): the first key seals, every key opens
    src_root: str | None = None  # sources are opened and deleted from a descriptor of it, never through a symlink

    def __post_init__(self) -> None:
        self._tls = threading.local()
        self._local_root = self.store.root if self.store.is_local else None

    def _buf(self, n: int) -> memoryview:
        b = getattr(self._tls, "buf", None)
        if b is None or len(b) < n:
            b = self._tls.buf = bytearray(n)
        return memoryview(b)[:n]

    def _out_buf(self, n: int) -> memoryview:
        b = getattr(self._tls, "out", None)
        if b is None or len(b) < n:
            b = self._tls.out = bytearray(n)
        return memoryview(b)[:n]

    def _valid_output(self, t: Task, full: bool) -> bool:
        try:
            if full:
                hdr = self.store.read_into(t.rel, self._out_buf(t.row.layout.payload_bytes), expect=t.row.layout,
                                           key=key_for(t.file), verify=True, keys=self.keys)
            else:
                hdr = self.store.read_header(t.rel, verify=True)
        except FileNotFoundError:
            return False
        except KVFormatError:
            return False
        return hdr.layout == t.row.layout and hdr.key == key_for(t.file)

    def run(self, t: Task) -> FileResult:
        f, row = t.file, t.row
        res = FileResult("converted", f.path, t.rel, f.size, t.after)
        try:
            existing = self.store.exists(t.rel)
            # The payload too, not only the header: a re-run promises to repair a corrupt output, and
            # reading 1/TP of the source's bytes back is cheap next to converting them again.
            if existing and self._valid_output(t, full=True):
                res.status = "skipped"
                res.after = self._size(t)
                self._carry_mtime(f.path, t.rel)  # a run killed between rename and utime left "now"
                self._maybe_delete(res)
                return res
            fd = self._open_source(f.path)
            mm = None
            try:
                st = os.fstat(fd)
                if st.st_size != row.row_bytes:
                    return FileResult("failed", f.path, t.rel, f.size, error=f"size changed to {st.st_size} bytes "
                                      f"while compacting (row is {row.row_bytes})", reason="SizeChanged")
                mm = _map_if_cached(fd, row.row_bytes)
                if mm is None:
                    buf = self._buf(row.row_bytes)
                    got = read_exact(fd, buf, 0)
                    if got != row.row_bytes:
                        return FileResult("failed", f.path, t.rel, f.size, error=f"short read: {got} of "
                                          f"{row.row_bytes} bytes", reason="SizeChanged")
                else:
                    buf = memoryview(mm)
            finally:
                os.close(fd)
            try:
                payload = extract_payload(row, buf, path=f.path)
                prov = provenance_for(row, int(st.st_mtime), WRITER)
                rel, n, _ = self.store.put_block(payload, row.layout, key_for(f), provenance=prov, codec=self.codec,
                                                 level=self.level, fsync=self.fsync, overwrite=existing,
                                                 keys=self.keys)
            finally:
                if mm is not None:
                    payload = buf = None  # type: ignore[assignment]  # views must go before the map closes
                    try:
                        mm.close()
                    except BufferError:  # an error's traceback still holds a view: the map closes when it goes
                        pass
            res.after = n
            self._carry_mtime(f.path, rel, st)
            if self.delete_source:
                if not self._valid_output(t, full=True):
                    return FileResult("failed", f.path, t.rel, f.size, error="output did not verify after writing; "
                                      "source kept", reason="VerifyFailed")
                self._maybe_delete(res, (st.st_dev, st.st_ino))  # only the file converted, not one swapped in
            return res
        except ReplicaMismatchError as e:
            return FileResult("failed", f.path, t.rel, f.size, error=e.message, reason=e.reason)
        except KVFormatError as e:
            return FileResult("failed", f.path, t.rel, f.size, error=e.message, reason=e.reason)
        except FileNotFoundError:
            return FileResult("failed", f.path, t.rel, f.size, error="source vanished", reason="FileNotFoundError")
        except OSError as e:  # one unreadable source (EACCES, EIO) fails alone; the others are converted
            name = errno.errorcode.get(e.errno or 0, type(e).__name__)
            return FileResult("failed", f.path, t.rel, f.size, error=f"{name}: {e.strerror or e}", reason=name)

    def _carry_mtime(self, src: str, rel: str, st: os.stat_result | None = None) -> None:
        """Give the output its source's mtime: the LRU clock (the block was last used when vLLM wrote it).

        With ``--mode``, also its exact mode (the umask set for the run already kept it no wider)."""
        if self._local_root is None:
            return
        out = os.path.join(self._local_root, rel)
        if self.mode is not None and stat.S_IMODE(os.stat(out).st_mode) != self.mode:
            os.chmod(out, self.mode)
        st = st or os.stat(src)
        if os.stat(out).st_mtime_ns != st.st_mtime_ns:
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))

    def _size(self, t: Task) -> int:
        try:
            return self.store.read_header(t.rel, verify=False).file_bytes
        except (KVFormatError, FileNotFoundError):
            return t.after

    def _open_source(self, path: str) -> int:
        if self.src_root is None:
            return os.open(path, os.O_RDONLY | _O_CLOEXEC)
        return open_in(self.src_root, os.path.relpath(path, self.src_root).replace(os.sep, "/"))

    def _maybe_delete(self, res: FileResult, expect: tuple[int, int] | None = None) -> None:
        if not self.delete_source:
            return
        if self.src_root is None:
            try:
                os.unlink(res.src)
                res.deleted = True
            except FileNotFoundError:
                pass
            return
        rel = os.path.relpath(res.src, self.src_root).replace(os.sep, "/")
        res.deleted = unlink_in(self.src_root, rel, expect) == UNLINKED


_PAGE = mmap.PAGESIZE
_RESIDENT = bytes(i for i in range(256) if i & 1)
_mincore: Any
try:
    _mincore = ctypes.CDLL(None, use_errno=True).mincore
    _mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    _mincore.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
    _mincore = None


def _map_if_cached(fd: int, n: int) -> mmap.mmap | None:
    """A map of the file when every page is already in the page cache, else None.

    Reading a cached source through a map skips copying every worker slot into a buffer (the
    replicas are compared where they lie), which roughly halves compaction's CPU. Only cached
    files are mapped: touching a mapped page that needs disk I/O turns an I/O error into SIGBUS,
    whereas the buffered read of an uncached file reports it as an OSError for that file.
    The map is private copy-on-write (nothing writes to it) so ctypes can take its address.
    """
    if _mincore is None:
        return None
    mm = mmap.mmap(fd, n, access=mmap.ACCESS_COPY)
    try:
        c = ctypes.c_char.from_buffer(mm)
        addr = ctypes.addressof(c)
        del c
        vec = (ctypes.c_ubyte * (-(-n // _PAGE)))()
        # bit 0 of each byte: page resident (the other bits are reserved): keep only absent pages
        if _mincore(addr, n, vec) == 0 and not bytes(vec).translate(None, _RESIDENT):
            return mm
    except BaseException:
        mm.close()
        raise
    mm.close()
    return None
