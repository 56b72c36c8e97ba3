"""Prove a root usable before a tier relies on it: the write path a store takes, done once with a small object."""

from __future__ import annotations

import errno
import os
import secrets
import time
from dataclasses import dataclass

from ..format import CONTROL_DIR, host_tag
from ._base import Store

__all__ = ["PROBE_DIR", "PROBE_TIMEOUT_S", "ReadSpeed", "measure_read", "probe_store"]

PROBE_DIR = f"{CONTROL_DIR}/probe"
PROBE_TIMEOUT_S = 30.0


def probe_store(store: Store, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[str, BaseException] | None:
    """Create, write, publish (rename or conditional PUT), read back and delete one probe object under
    ``.kvformat/probe/``, with the store's own credentials and paths.

    Returns None when every step worked, else ``(step, error)`` for the first one that did not: ``"write"``
    (create + write + publish: one call on every backend), ``"read back"``, ``"compare"`` (the bytes read
    differ: a ValueError), ``"delete"``. Storage errors are returned, never raised. Each remote step may take up
    to ``timeout_s`` (more patient than a store's per-call deadline: a slow start is not a broken root; a refused
    connection or a denied request still fails at once).
    """
    rel = f"{PROBE_DIR}/{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"
    body = f"kvformat probe {secrets.token_hex(16)}\n".encode()
    deadline = max(timeout_s, float(getattr(store, "timeout_s", 0.0)))
    try:
        r = store.put_many([(rel, [body])], overwrite=False, timeout_s=deadline)[0]
        if isinstance(r, BaseException):
            raise r
    except (OSError, ValueError) as e:
        return "write", e
    try:
        many = getattr(store, "read_many_bytes", None)
        got: object = many([rel], timeout_s=deadline)[0] if many is not None else store.read_bytes(rel)
        if isinstance(got, BaseException):
            raise got
    except (OSError, ValueError) as e:
        return "read back", e
    if got != body:
        return "compare", ValueError(f"read back {len(got) if isinstance(got, bytes) else '?'} bytes that differ "
                                     f"from the {len(body)} written")
    try:
        d = store.delete_many([rel], timeout_s=deadline)[0]
        if isinstance(d, BaseException):
            raise d
    except (OSError, ValueError) as e:
        return "delete", e
    return None


@dataclass(frozen=True)
class ReadSpeed:
    """What :func:`measure_read` saw: the fastest read's GB/s, how many reads of ``nbytes`` it timed, and whether
    each read came past the page cache (``cold``: a local root's file was dropped from it before each read)."""

    gbps: float
    reads: int
    nbytes: int
    cold: bool


def measure_read(store: Store, nbytes: int, *, budget_s: float = 0.2, max_reads: int = 5,
                 timeout_s: float = PROBE_TIMEOUT_S) -> ReadSpeed:
    """Time whole reads of one probe object of ``nbytes`` random bytes under ``.kvformat/probe/``, through the
    store's own read path, then delete it: at least one read, more until ``budget_s`` is spent or ``max_reads``.

    On a root with local paths (a disk, NFS, a FUSE mount) the file is written back and dropped from the page cache
    before each read (``posix_fadvise(DONTNEED)``), so the read comes from the device or the server, as a load of a
    file not used lately does: a re-read from memory would say every root is fast. Random bytes: a filesystem that
    compresses (ZFS, btrfs) must not read faster than it would the KV. Raises the store's OSError (or a
    ValueError when the bytes read differ); a hung mount blocks here, so the caller bounds the wall time.
    """
    rel = f"{PROBE_DIR}/{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}.speed"
    body = os.urandom(nbytes)
    deadline = max(timeout_s, float(getattr(store, "timeout_s", 0.0)))
    r = store.put_many([(rel, [body])], overwrite=False, timeout_s=deadline)[0]
    if isinstance(r, BaseException):
        raise r
    local = store.local_path(rel) if store.is_local else None
    cold = local is not None
    best, reads, spent = float("inf"), 0, 0.0
    try:
        while reads < max(1, max_reads) and (reads == 0 or spent < budget_s):
            if local is not None:
                cold = _drop_cached(local) and cold
            t0 = time.perf_counter()
            many = getattr(store, "read_many_bytes", None)
            got: object = many([rel], timeout_s=deadline)[0] if many is not None else store.read_bytes(rel)
            dt = time.perf_counter() - t0
            if isinstance(got, BaseException):
                raise got
            if got != body:
                raise ValueError(f"the read-speed probe read back {len(got) if isinstance(got, bytes) else '?'} "
                                 f"bytes that differ from the {nbytes} written")
            best, reads, spent = min(best, dt), reads + 1, spent + dt
    finally:
        store.delete_many([rel], timeout_s=deadline)
    return ReadSpeed(nbytes / max(best, 1e-9) / 1e9, reads, nbytes, cold)


def _drop_cached(path: str) -> bool:
    """Whether ``path``'s pages were dropped (False: a filesystem without fsync or fadvise; the read is warm)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # DONTNEED drops only clean pages, and the probe was just written
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EROFS):
            return False
        raise
    finally:
        os.close(fd)
