"""The /dev/shm side of a shared row: names, creation and joining, stale rows, fences and backoff.

No torch here; :mod:`kvformat.staging._row` builds the row on these.
"""

from __future__ import annotations

import os
import threading
import time

from ..errors import StagingError, StagingTimeoutError

SHM_DIR = "/dev/shm"
ROW_PREFIX = "kvformat_row_"
_MAGIC = int.from_bytes(b"KVFROW01", "little")
_MAX_WORLD = 1024
_HDR_WORDS = 16  # magic, num_chunks, slot_bytes, slot_stride, world_size, creator pid, control bytes, start time
_MAPPED_OFF = 256  # one byte per rank: "I have mapped the row"
_CHUNK_REC = 64  # bytes of control per chunk: one cache line, so writers of different chunks never share one
_CHUNK_BASE = _MAPPED_OFF + _MAX_WORLD  # 1280: first chunk record
_REASON_BYTES = 32  # FAILED records keep the writer's error class name here

EMPTY, BUSY, DONE, FAILED = 0, 1, 2, 3
_STATE_NAMES = ("EMPTY", "BUSY", "DONE", "FAILED")
_MIN_SLEEP_S = 50e-6
_MAX_SLEEP_S = 5e-3


def row_path(name: str) -> str:
    """The /dev/shm path of the row called ``name`` (present only while ranks are joining)."""
    if not name or "/" in name or "\x00" in name or len(name) > 200:
        raise StagingError(f"row name: expected 1..200 characters without '/', got {name[:80]!r}")
    return os.path.join(SHM_DIR, ROW_PREFIX + name)


_FENCE_LOCK = threading.Lock()


def fence() -> None:
    # A release followed by an acquire on the same lock orders every earlier memory access before every
    # later one (needed on weakly ordered CPUs: the slot bytes must be visible before the DONE word).
    with _FENCE_LOCK:
        pass
    with _FENCE_LOCK:
        pass


class Backoff:
    """Sleeps 50 µs, doubling to 5 ms: waiters cost no CPU, and a fast writer is seen within ~5 ms."""

    def __init__(self, timeout_s: float) -> None:
        self.start = time.monotonic()
        self.deadline = self.start + timeout_s
        self.sleep_s = _MIN_SLEEP_S

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def waited(self) -> float:
        return time.monotonic() - self.start

    def pause(self) -> None:
        time.sleep(min(self.sleep_s, max(0.0, self.deadline - time.monotonic())))
        self.sleep_s = min(self.sleep_s * 2, _MAX_SLEEP_S)


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); 0 if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def creator_alive(pid: int, start: int) -> bool:
    """False only when the creating process surely is gone (its pid is free, or now another process's).

    Ranks of one group share a pid namespace, as the processes of one engine on one node do.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = start_time(pid)
    return not (start and now and now != start)


def open_existing(path: str, backoff: Backoff) -> int:
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            # The creator failed (and unlinked) between our O_EXCL and this open: the group cannot form.
            if backoff.expired():
                raise
            backoff.pause()
            try:  # become the creator ourselves if the name is free again
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue


def wait_for_size(fd: int, path: str, total: int, backoff: Backoff) -> None:
    while True:
        st = os.fstat(fd)
        if st.st_size == total:
            return
        if st.st_size not in (0, total):
            raise StagingError(f"{path}: expected a row of {total} bytes, found {st.st_size} "
                               f"(another group uses this name, or the ranks disagree on the layout)")
        if st.st_nlink == 0:
            raise StagingError(f"{path}: the creating rank failed before sizing the row")
        if backoff.expired():
            raise StagingTimeoutError(f"{path}: the creating rank did not size the row in time",
                                      waited_s=backoff.waited())
        backoff.pause()


def unlink_if_same(path: str, fd: int | None) -> None:
    """Unlink ``path`` only if it is still the file behind ``fd`` (never a newer group's row)."""
    try:
        if fd is not None:
            a, b = os.stat(path), os.fstat(fd)
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                return
        os.unlink(path)
    except FileNotFoundError:
        pass
