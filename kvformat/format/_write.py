"""Atomic publication of a file (spec §10): a temp file in the destination directory, then rename or
link. Shared by every local writer (:func:`write_atomic`, the fused tier write, the legacy writer)."""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
import socket
from typing import Any

TMP_PREFIX = ".kvf-tmp-"  # temp files: never matched by readers, removed by gc/start-up (spec §10)


def write_atomic(path: str, parts: list[Any], *, fsync: bool = False, overwrite: bool = True) -> bool:
    """Write ``parts`` to ``path`` through a temp file and a rename; no partial file is ever visible.

    Returns False (and writes nothing) when ``overwrite`` is False and ``path`` exists.
    """
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, temp_name())
    with TempFile(tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)) as t:
        views = [memoryview(p).cast("B") if not isinstance(p, (bytes, bytearray)) else p for p in parts]
        total = sum(len(v) for v in views)
        done = 0
        while done < total:  # writev may write less than asked (signals, huge files)
            n = os.writev(t.fd, views)
            done += n
            if done < total:
                views = advance_views(views, n)
        if fsync:
            os.fsync(t.fd)
    return publish(tmp, path, d, overwrite=overwrite, fsync=fsync)


def publish(tmp: str, path: str, d: str, *, overwrite: bool, fsync: bool) -> bool:
    """Make the complete temp file ``tmp`` visible as ``path`` (spec §10); False if ``path`` existed and not
    ``overwrite``. The temp name is gone afterwards either way; with ``fsync`` the directory entry is durable."""
    try:
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if path exists: first writer wins, nothing is replaced
            except FileExistsError:
                return False
            finally:
                _unlink_quiet(tmp)
        if fsync:
            dfd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    return True


def _read_small(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(256).strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    """The identity of this process's PID namespace ("" where /proc does not say)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _host_tag() -> str:
    # Boot id (a fresh UUID per kernel boot: no two hosts or boots share one; the hostname is shared by clones
    # and by containers with host networking) plus the PID namespace: a pid only means something to readers in
    # the same namespace of the same running kernel. Without /proc the hostname is all there is.
    boot = _read_small("/proc/sys/kernel/random/boot_id") or _read_small("/etc/machine-id") or socket.gethostname()
    return hashlib.sha1(f"{boot}/{_pid_namespace()}".encode()).hexdigest()[:12]


_HOST_TAG = _host_tag()
_TAG_PID = os.getpid()


def host_tag() -> str:
    """This process's writer identity: boot id + PID namespace, hashed (re-derived after a fork into a new
    PID namespace, e.g. ``unshare --pid --fork``)."""
    global _HOST_TAG, _TAG_PID
    if os.getpid() != _TAG_PID:
        _HOST_TAG, _TAG_PID = _host_tag(), os.getpid()
    return _HOST_TAG


_SALT = [0, ""]  # [pid, random hex] of the process that drew it: a forked child draws its own
_COUNT = itertools.count()


def temp_name() -> str:
    """``.kvf-tmp-<pid>-<unique>-<host tag>``: unique across hosts, boots and PID namespaces (the tag is the
    boot id and PID namespace, hashed), and enough to tell later whether its writer is gone.

    ``<unique>`` is a random salt drawn once per process and a counter: a ``getrandom`` call per file was a
    system call (and a GIL hand-off) on every store. The files are created with O_EXCL, so even a salt
    shared with a dead writer of the same pid could only fail a store, never clobber a file."""
    pid = os.getpid()
    if _SALT[0] != pid:
        _SALT[:] = [pid, secrets.token_hex(4)]
    return f"{TMP_PREFIX}{pid}-{_SALT[1]}{next(_COUNT):x}-{host_tag()}"


def temp_writer_gone(name: str) -> bool:
    """Whether the process that wrote temp file ``name`` certainly no longer runs.

    Decidable only for a writer of this kernel boot *and* this PID namespace (the host tag matches): a pid
    seen from another namespace or host says nothing here (it may be a live writer's), so such files, and
    untagged names of older versions, are left to the age rule.
    """
    parts = name[len(TMP_PREFIX):].split("-")
    if len(parts) != 3 or not parts[0].isdigit() or parts[2] != host_tag():
        return False
    try:
        os.kill(int(parts[0]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # runs, as another user
        return False
    return False


class TempFile:
    """A new temp file's descriptor (``fd``, replaceable while writing): closed when the block ends, and
    the file unlinked when the block raised, so a failed write never leaves a temp file behind."""

    def __init__(self, tmp: str, fd: int) -> None:
        self.tmp = tmp
        self.fd = fd

    def __enter__(self) -> "TempFile":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: Any) -> None:
        os.close(self.fd)
        if exc_type is not None:
            _unlink_quiet(self.tmp)


def advance_views(views: list[Any], n: int) -> list[Any]:
    """``views`` without their first ``n`` bytes (after a short writev/preadv)."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(memoryview(v)[n:])
        n = 0
    return out


def _unlink_quiet(p: str) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass
