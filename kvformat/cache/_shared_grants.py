"""The shared root's numbers and records: where its control objects live, the grant arithmetic, and what the
evictor keeps of each follower (see :mod:`kvformat.cache._shared` for the protocol)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..format import CONTROL_DIR, host_tag

__all__ = ["ENGINES_DIR", "LEASE_DIR", "MAX_PENDING", "STATE_FILE", "Holding", "Key", "View", "dead_here",
           "default_allowance", "grant", "shared_target"]

ENGINES_DIR = f"{CONTROL_DIR}/engines"
LEASE_DIR = f"{CONTROL_DIR}/lease"
STATE_FILE = f"{CONTROL_DIR}/state.json"
MAX_PENDING = 200_000  # journal records kept for the evictor; past this, read records (recency) are dropped

Key = tuple[int, int]  # (lease generation, state number): a point in the evictor's published history


def default_allowance(max_bytes: int, file_bytes: int) -> int:
    """A follower's write allowance when none is configured: 1/16 of the bound, at most 4 GiB, at least two
    files (a writer must be able to write)."""
    return max(2 * file_bytes, min(max_bytes // 16, 4 << 30))


def shared_target(max_bytes: int, engines: int, allowance: int) -> int:
    """What the evictor keeps the indexed bytes under, with ``engines`` engines on the root (itself included): room
    for each to be granted its full ``allowance`` once pending deletions are through."""
    if engines <= 1:
        return max_bytes
    return max(max_bytes - engines * allowance, max_bytes // 2)


def grant(max_bytes: int, counted: int, exposure: list[int], allowance: int) -> int:
    """The bytes each of ``len(exposure) + 1`` engines may write beyond ``counted`` (the evictor's count) when each
    follower may still be using a grant up to its ``exposure``: the largest ``g <= allowance`` with
    ``counted + sum(max(e, g) for e in exposure) + g <= max_bytes`` (0 if none)."""
    lo, hi = 0, allowance
    while lo < hi:  # the total is monotone in g: bisect on whole bytes
        mid = (lo + hi + 1) // 2
        if counted + sum(max(e, mid) for e in exposure) + mid <= max_bytes:
            lo = mid
        else:
            hi = mid - 1
    if counted + sum(exposure) + lo > max_bytes:
        return 0
    return lo


@dataclass
class View:
    """The evictor's view of one follower."""

    beat: int = -1
    seen_at: float = 0.0  # evictor's monotonic clock when the beat last changed
    merged: int = 0  # last record number merged
    ack: Key | None = None
    gone: bool = False
    lost: bool = False  # not live at the last pass (its journal unchanged for ttl_s): logged when it changes


@dataclass
class Holding:
    """What the evictor keeps while it holds lease generation ``gen``."""

    gen: int
    seq: int = 0
    views: dict[str, View] = field(default_factory=dict)
    doomed: dict[str, tuple[int, int]] = field(default_factory=dict)  # relpath -> (state number dooming it, size)
    journals: dict[str, tuple[bytes, str]] = field(default_factory=dict)  # relpath -> (digest, engine id) last read
    grants: dict[int, int] = field(default_factory=dict)  # state number -> the grant it published
    alone: bool = True  # no live follower: victims go at once, as on an unshared root
    scanned: bool = False
    last_ok: float = 0.0


def dead_here(owner: dict[str, Any]) -> bool:
    """Whether the engine that wrote ``owner`` ({"host", "pid"}) is a process of this kernel boot and PID
    namespace that no longer runs (then its lease is not waited out)."""
    if owner.get("host") != host_tag():
        return False
    try:
        pid = int(owner.get("pid", 0))
    except (TypeError, ValueError):
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
