"""The bounded reads and field checks that every byte a shared root's coordination reads under ``.kvformat/``
goes through before use (issue 31); each record's parser (``_journal``, ``_state``, ``_lease``) is built on them.

Anyone who can write the root can write these files (a co-tenant, a buggy or crashed peer), so nothing in them is
trusted: a control file is opened without following a symlink and without blocking (a FIFO is refused, never
waited on), read to at most a stated size, and each record is checked for shape (a relative path inside the root,
a size in ``[0, MAX_FILE_BYTES]``, a sequence number that only grows). A bad record raises
:class:`~kvformat.errors.ControlRecordError`; the callers skip it, count it and log it once, and go on with
the other records: one bad record never stops the root.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import threading
from typing import Any, Callable, TypeVar

from ...errors import ControlRecordError
from ...format import CONTROL_DIR
from ...storage import Store

__all__ = ["ENGINE_ID", "MAX_CONTROL_BYTES", "MAX_FILE_BYTES", "MAX_GEN", "MAX_LEASE_BYTES", "Stuck", "check_int",
           "check_relpath", "check_size", "load_doc", "read_control"]

MAX_CONTROL_BYTES = 64 << 20  # a journal of MAX_PENDING records is ~20 MiB; a bigger control file is a bad file
MAX_LEASE_BYTES = 4096
MAX_FILE_BYTES = 1 << 40  # no single cache file is larger: a record claiming more is a bad record
MAX_GEN = 10**12 - 1  # lease names are 12 digits
MAX_PATH = 1024
ENGINE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
T = TypeVar("T")


def read_control(store: Store, relpath: str, limit: int = MAX_CONTROL_BYTES) -> bytes:
    """``relpath``'s bytes, at most ``limit`` of them. On a local root the file is opened with ``O_NOFOLLOW`` and
    ``O_NONBLOCK`` and must be a regular file: a planted symlink or FIFO is a bad file, never followed or waited
    on. FileNotFoundError passes through (no file is not a bad file)."""
    if not store.is_local:
        data = store.read_bytes(relpath)
        if len(data) > limit:
            raise ControlRecordError("oversized", f"{len(data)} bytes, at most {limit}", path=relpath)
        return data
    check_relpath(relpath, control=True)
    try:
        fd = os.open(os.path.join(store.root, relpath),
                     os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise ControlRecordError("not-regular", "a symlink, FIFO or directory", path=relpath) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ControlRecordError("not-regular", "not a regular file", path=relpath)
        if st.st_size > limit:
            raise ControlRecordError("oversized", f"{st.st_size} bytes, at most {limit}", path=relpath)
        parts: list[bytes] = []
        got = 0
        while got <= limit:
            b = os.read(fd, min(1 << 20, limit + 1 - got))
            if not b:
                break
            parts.append(b)
            got += len(b)
        if got > limit:  # grew while read
            raise ControlRecordError("oversized", f"more than {limit} bytes", path=relpath)
        return b"".join(parts)
    finally:
        os.close(fd)


class Stuck:
    """Runs reads that may stall (a hung NFS/FUSE server) on a worker thread and gives up on one after
    ``timeout_s``: the caller goes on, the worker is abandoned. While an abandoned read of a name is still stuck,
    that name is not read again, so stuck threads stay at most one per name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stuck: set[str] = set()

    def call(self, name: str, fn: Callable[[], T], timeout_s: float) -> T:
        with self._lock:
            if name in self.stuck:
                raise TimeoutError(f"{name}: an earlier read is still stuck")
        box: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed to the caller
                box.append((False, e))
            finally:
                done.set()
                with self._lock:
                    self.stuck.discard(name)

        threading.Thread(target=run, name="kvformat-control-read", daemon=True).start()
        if not done.wait(timeout_s):
            with self._lock:
                if not done.is_set():
                    self.stuck.add(name)
            if not done.is_set():
                raise TimeoutError(f"{name}: read did not finish in {timeout_s:.1f} s (abandoned)")
        ok, val = box[0]
        if not ok:
            raise val
        return val  # type: ignore[no-any-return]


def check_relpath(rel: Any, *, control: bool = False) -> str:
    """``rel`` if it is a plain relative path inside the root (no ``..``, ``.``, empty component, absolute path,
    backslash or NUL), and outside ``.kvformat/`` unless ``control``."""
    if not isinstance(rel, str) or not rel or len(rel) > MAX_PATH:
        raise ControlRecordError("path", "not a non-empty string of at most %d characters" % MAX_PATH)
    if rel.startswith("/") or "\0" in rel or "\\" in rel or any(p in ("", ".", "..") for p in rel.split("/")):
        raise ControlRecordError("path", f"{rel[:80]!r} is not a plain relative path")
    if not control and (rel == CONTROL_DIR or rel.startswith(CONTROL_DIR + "/")):
        raise ControlRecordError("path", f"{rel[:80]!r} names the control directory")
    return rel


def check_size(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_FILE_BYTES:
        raise ControlRecordError("size", f"{str(n)[:40]} is not in [0, {MAX_FILE_BYTES}]")
    return n


def check_int(v: Any, lo: int, hi: int, what: str) -> int:
    """``v`` if it is an int (not a bool) in ``[lo, hi]``, else ControlRecordError ``what``."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ControlRecordError(what, f"{str(v)[:40]} is not in [{lo}, {hi}]")
    return v


def load_doc(raw: bytes) -> dict[str, Any]:
    """A control record's JSON object; ControlRecordError ``json`` if it is none."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise ControlRecordError("json", "not JSON") from None
    if not isinstance(doc, dict):
        raise ControlRecordError("json", "not a JSON object")
    return doc
