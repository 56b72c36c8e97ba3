"""Torch-free helpers for untrusted trees: small metadata files read safely, regular-file checks, and
the walk of a root's block files. No format code here."""

from __future__ import annotations

import errno
import os
import stat
from typing import Iterator

from ._paths import FILE_SUFFIX
from ._write import TMP_PREFIX
from ..errors import UnsafeFileError


def read_exact(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``offset`` of ``fd``; the bytes read (fewer only at the end of the file)."""
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def read_row(path: str, buf: memoryview) -> int:
    """Fill ``buf`` from the start of the file at ``path`` (a legacy row); the bytes read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return read_exact(fd, buf, 0)
    finally:
        os.close(fd)


SMALL_FILE_LIMIT = 1 << 20


def read_small_file(path: str, *, limit: int = SMALL_FILE_LIMIT) -> bytes:
    """The bytes of a small metadata file (namespace.json, a legacy config.json) in an untrusted tree.

    Never follows a symlink in the last component, never opens anything but a regular file (a FIFO
    would block, a device node would stream forever) and reads at most ``limit`` bytes.

    Raises
    ------
    UnsafeFileError (an OSError) naming why the file was not read; other OSErrors pass through.
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFileError(errno.ELOOP, "a symlink (not followed)", path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(errno.EINVAL, "not a regular file", path)
    try:
        # The lstat above and this open race with a swap: O_NOFOLLOW/O_NONBLOCK and fstat close that gap.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFileError(errno.ELOOP, "a symlink (not followed)", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(errno.EINVAL, "not a regular file", path)
        if st.st_size > limit:
            raise UnsafeFileError(errno.EFBIG, f"over the {limit}-byte limit ({st.st_size} bytes)", path)
        chunks: list[bytes] = []
        n = 0
        while True:
            b = os.read(fd, limit + 1 - n)
            if not b:
                break
            chunks.append(b)
            n += len(b)
            if n > limit:  # grew since fstat
                raise UnsafeFileError(errno.EFBIG, f"over the {limit}-byte limit", path)
        return b"".join(chunks)
    finally:
        os.close(fd)


def is_regular_file(path: str) -> bool:
    """True for a regular file that is not a symlink (lstat; nothing is opened)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def iter_files(root: str, suffix: str = FILE_SUFFIX, *,
               skip_top: tuple[str, ...] = ()) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """``(relative path with '/', entry)`` of the regular files under ``root`` ending in ``suffix``.

    Never follows symlinks, skips temp files, and skips the top-level directories named in ``skip_top``.
    The relative path is built while walking (no per-file ``os.path.relpath``: scans of 10k-file trees).
    """
    stack = [("", root)]
    while stack:
        rel, d = stack.pop()
        try:
            it = os.scandir(d)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with it:
            for e in it:
                name = e.name
                if e.is_dir(follow_symlinks=False):
                    if not (not rel and name in skip_top):
                        stack.append((rel + name + "/", e.path))
                elif name.endswith(suffix) and not name.startswith(TMP_PREFIX) and e.is_file(follow_symlinks=False):
                    yield rel + name, e
