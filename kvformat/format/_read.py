"""The one read pipeline: header then payload through one source (an open file or fetched bytes), the
destination zeroed on any failure. Every reader shares it: ``kvformat.read_into`` and every ``Store``."""

from __future__ import annotations

import errno
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ._block import as_bytes_view, check_expected, decompress_into, invalidate, unseal_into, verify_data
from ._header import decode_header, header_length
from ._consts import ALIGNMENT
from ._files import read_exact as _read_exact
from ._seal import Keyring, key_for
from ._spec import BlockHeader, BlockKey, CanonicalLayout
from ..errors import DestinationError, KVFormatError, LayoutMismatchError, NotKVFormatError, TruncatedError

FIRST_READ = 2 * ALIGNMENT  # a 61-layer header fits here, so most files need one header read
_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class FileId:
    """Which file a read went through: what a quarantine checks before it moves anything (G-5.5).

    A local file is its device and inode, plus size and mtime (ns), all from ``fstat`` of the descriptor
    read: an inode number is reused once a file is deleted, and the new file differs in mtime. A remote
    object is the ETag its GET answered with (S3), else its size and the xxh3 of the ``span`` bytes read
    from offset 0 (its content: a replacement that differs from the bad bytes cannot match them).
    """

    size: int
    dev: int = -1
    ino: int = -1
    mtime_ns: int = -1
    etag: str | None = None
    span: int = 0
    digest: int | None = None

    @classmethod
    def of_stat(cls, st: os.stat_result) -> "FileId":
        """The identity of a local file from its ``stat``."""
        return cls(size=st.st_size, dev=st.st_dev, ino=st.st_ino, mtime_ns=st.st_mtime_ns)

    @property
    def local(self) -> bool:
        """Whether this names a local file (device and inode)."""
        return self.ino >= 0

    def same_file(self, st: os.stat_result) -> bool:
        """Whether ``st`` (an ``lstat`` of the path now) is the very file that was read."""
        return (self.local and st.st_ino == self.ino and st.st_dev == self.dev and st.st_size == self.size
                and st.st_mtime_ns == self.mtime_ns)


def _tag(exc: BaseException | None, ident: Any) -> None:
    # A kvformat error raised while a file is open names the file it came from (see FileId).
    if isinstance(exc, KVFormatError) and exc.file_id is None:
        exc.file_id = ident() if callable(ident) else ident


class FileSource:
    """One open, validated regular file that a whole read goes through.

    Header and payload are read through this one descriptor, never by reopening the name: a file
    renamed over the path, or a FIFO planted there, after validation cannot supply part of a read.
    ``o_direct`` reads the page-aligned part of a payload with O_DIRECT set on this same descriptor
    (``fcntl(F_SETFL)``), falling back to buffered reads where the filesystem refuses it.
    ``direct_bytes`` counts the bytes actually read with O_DIRECT.
    """

    def __init__(self, path: str, *, o_direct: bool = False) -> None:
        self.path = path
        self.fd = _open_regular(path)
        try:
            self.ident = FileId.of_stat(os.fstat(self.fd))
        except BaseException:
            os.close(self.fd)
            raise
        self.size = self.ident.size
        self.o_direct = o_direct and bool(_O_DIRECT)
        self.direct_bytes = 0
        self.header_region = b""  # set by read_header_from

    def pread(self, offset: int, n: int) -> bytearray:
        """Up to ``n`` bytes at ``offset`` (fewer only at the end of the file)."""
        buf = bytearray(max(0, n))
        got = _read_exact(self.fd, memoryview(buf), offset)
        del buf[got:]
        return buf

    def readinto(self, offset: int, dst: memoryview) -> int:
        """Fill ``dst`` from ``offset``; returns the bytes read (short only at the end of the file)."""
        if not self.o_direct:
            return _read_exact(self.fd, dst, offset)
        import ctypes
        import fcntl

        aligned = len(dst) - len(dst) % ALIGNMENT
        addr = ctypes.addressof(ctypes.c_char.from_buffer(dst)) if aligned else 0
        if not aligned or addr % ALIGNMENT or offset % ALIGNMENT:  # O_DIRECT needs aligned memory and offsets
            return _read_exact(self.fd, dst, offset)
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | _O_DIRECT)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # filesystems without O_DIRECT: buffered
                return _read_exact(self.fd, dst, offset)
            raise
        got = -1
        try:
            got = _read_exact(self.fd, dst[:aligned], offset)
            self.direct_bytes += got
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: accepted at fcntl time, refused at read time (some FUSE)
                raise
        finally:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags)  # the unaligned tail is read buffered
        if got < 0:
            got = _read_exact(self.fd, dst[:aligned], offset)
        if got == aligned and aligned < len(dst):
            got += _read_exact(self.fd, dst[aligned:], offset + aligned)
        return got

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def identity(self) -> FileId:
        """The file this source reads (fstat at open)."""
        return self.ident

    def __enter__(self) -> "FileSource":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        _tag(exc, self.ident)
        self.close()


class BytesSource:
    """A file, or its first bytes, held in memory (what a remote store fetched).

    ``size`` is the object's full size when ``buf`` holds only a prefix of it (a ranged header read);
    ``etag`` the ETag the server answered the GET with, when it gives one.
    """

    def __init__(self, buf: Any, size: int | None = None, *, etag: str | None = None) -> None:
        self._mv = as_bytes_view(buf)
        self.size = len(self._mv) if size is None else int(size)
        self.etag = etag
        self.path = ""
        self.header_region = b""  # set by read_header_from

    def identity(self) -> FileId:
        """The object read: its ETag, else its size and the xxh3 of the held bytes (computed on demand: only a
        failed read needs it)."""
        if self.etag:
            return FileId(size=self.size, etag=self.etag)
        from ._native import xxh3_64

        return FileId(size=self.size, span=len(self._mv), digest=xxh3_64(self._mv))

    def pread(self, offset: int, n: int) -> memoryview:
        """Up to ``n`` held bytes at ``offset`` (no copy)."""
        return self._mv[offset:offset + max(0, n)]

    def readinto(self, offset: int, dst: memoryview) -> int:
        """Copy held bytes from ``offset`` into ``dst``; returns how many."""
        src = self._mv[offset:offset + len(dst)]
        dst[:len(src)] = src
        return len(src)

    def close(self) -> None:
        """Drop the reference to the held bytes."""
        self._mv = memoryview(b"")

    def __enter__(self) -> "BytesSource":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        _tag(exc, self.identity)
        self.close()


Source = FileSource | BytesSource


def read_header_from(src: Source, verify: bool = True) -> BlockHeader:
    """Read and check the header region of ``src`` (spec §11 steps 1-3, F-3.3). The one header reader.

    ``src.header_region`` keeps the bytes the header was parsed from: a sealed file's tag is checked over
    exactly these (a second read could meet other bytes, written in place meanwhile, than the ones parsed).
    """
    size = src.size
    first = bytes(src.pread(0, min(FIRST_READ, size)))
    end = header_length(first)
    if end > len(first):
        if end > size:
            raise TruncatedError("header", end, size)  # F-3.3
        first += bytes(src.pread(len(first), end - len(first)))
    src.header_region = first[:end]
    return decode_header(first, file_bytes=size, verify=verify)


def read_payload_from(src: Source, out: Any, *, expect: CanonicalLayout | None = None, key: BlockKey | None = None,
                      verify: bool = True, keys: Keyring | None = None, stored_only: bool = False,
                      data_check: Callable[[BlockHeader, memoryview], None] | None = None) -> BlockHeader:
    """The read pipeline every reader shares (``kvformat.read_into`` and every ``Store``).

    ``data_check(hdr, dst)`` (with ``verify``), for a plain, unsealed file: replaces the CPU's kvf.dxxh3 pass
    over the stored bytes now in ``dst`` (kvformat.staging hashes them on a GPU); it raises ChecksumError on a
    mismatch and runs while the file is open, so its error names the file read like any other.

    Header, schema, file length, ``expect`` and ``key`` (and, for a sealed file, that ``keys`` holds its
    key) are checked before ``out`` is touched; after that, ANY failure (short read, data checksum, zstd
    frame with or without ``verify``, decoded checksum, authentication tag, an OSError mid-read)
    zero-fills ``out[:payload_bytes]`` before raising (F-5.5, G-1.2).

    ``stored_only`` (keyless maintenance: verify, inspect): a sealed file is checked as far as no key
    allows, its stored bytes (the ciphertext of ``encrypt``) against kvf.dxxh3, and those land in ``out``.
    """
    dst = as_bytes_view(out, writable=True)
    hdr = read_header_from(src, verify)
    region = src.header_region
    check_expected(hdr, expect, key)
    sealed = hdr.seal is not None and not stored_only
    if sealed:
        key_for(hdr, keys)  # F-12.5: UnknownKeyError before the destination is touched
    if len(dst) < hdr.raw_bytes:
        if expect is not None:  # the file is what the caller expects: the caller's buffer is at fault, not the
            # file (never a kvformat error, so no handler of bad files condemns the file for it)
            raise DestinationError(f"the destination holds {len(dst)} bytes, the expected layout's payload is "
                                   f"{hdr.raw_bytes}")
        raise LayoutMismatchError("payload_bytes", len(dst), hdr.raw_bytes)  # the file decides: kvformat error
    dst = dst[:hdr.raw_bytes]
    try:
        if hdr.codec == "none":
            got = src.readinto(hdr.data_offset, dst)
            if got != hdr.data_bytes:
                raise TruncatedError("data", hdr.data_bytes, got)
            if verify and data_check is not None and not sealed:
                data_check(hdr, dst)  # F-5.2, by the caller (on a device)
            elif verify:
                verify_data(hdr, dst, None)  # F-5.2 (of the stored bytes: an accident shows here, not as a forgery)
            if sealed:
                unseal_into(hdr, region, dst, keys)  # F-12.6
        else:
            data = _read_stored(src, hdr)
            if verify:
                verify_data(hdr, data, dst)  # F-5.2, F-6.3, F-6.4, F-5.3
            else:
                if len(data) != hdr.data_bytes:
                    raise TruncatedError("data", hdr.data_bytes, len(data))
                decompress_into(hdr, data, dst)  # F-6.3, F-6.4; F-6.6, F-6.7
    except BaseException:
        invalidate(dst)  # F-5.5: never leave partly read or partly decoded bytes behind
        raise
    return hdr


_LOCAL = threading.local()


def _read_stored(src: Source, hdr: BlockHeader) -> Any:
    """The stored bytes of a compressed file. From a file they go into a buffer reused by this thread: a fresh
    one per read costs its zeroing and page faults (a fifth of a verified planes read of a 4.5 MB block here).
    Held: the largest compressed file this thread has read."""
    if not isinstance(src, FileSource):
        return src.pread(hdr.data_offset, hdr.data_bytes)  # held bytes: a view, no copy
    buf: bytearray | None = getattr(_LOCAL, "stored", None)
    if buf is None or len(buf) < hdr.data_bytes:
        buf = _LOCAL.stored = bytearray(hdr.data_bytes)
    view = memoryview(buf)[:hdr.data_bytes]
    return view[:src.readinto(hdr.data_offset, view)]


def payload_buffer(hdr: BlockHeader) -> bytearray:
    """A buffer for ``hdr``'s decoded payload, allocated only once the decompression cap holds (CodecError)."""
    if hdr.codec != "none":
        from . import _codec

        _codec.check_bounds(hdr.data_bytes, hdr.raw_bytes)
    return bytearray(hdr.raw_bytes)


def _open_regular(p: str) -> int:
    return _open_regular_stat(p)[0]


def _open_regular_stat(p: str) -> tuple[int, os.stat_result]:
    """:func:`_open_regular` and the file's fstat (the tier's read needs its size: one fstat, not two)."""
    # O_NONBLOCK: opening a FIFO planted under a block's name must not block a reader forever
    # (it is a no-op for regular files); anything but a regular file is not a kvformat file.
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):  # an OS error, as a plain read of a directory would give
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), p)
        err = NotKVFormatError("not a regular file", path=p)
        err.file_id = FileId.of_stat(st)
        raise err
    return fd, st
