"""This engine's reads and writes of its shared root's control records (journals, state, leases): MAC'd on a
sealed root, every read bounded in size (:func:`read_control`) and in time (:class:`Stuck`), every bad record
counted and logged, never raised past the caller."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable, TypeVar

from ...errors import KVFormatError
from ...storage import Store
from .._log import CacheLog
from ._checks import MAX_CONTROL_BYTES, Stuck, read_control
from ._mac import ControlMac

__all__ = ["Control"]

T = TypeVar("T")


class Control:
    """The control records of one root as one engine sees them. ``ttl_s / 2`` bounds each read in time: a stuck
    mount degrades the read that stalled, never the tick that made it."""

    def __init__(self, store: Store, log: CacheLog, ttl_s: float, mac: ControlMac | None) -> None:
        self.store = store
        self.log = log
        self.ttl_s = ttl_s
        self.mac = mac  # a sealed root: every control record written is MAC'd, every one read must verify
        self.stuck = Stuck()  # control reads given up on (a hung mount): each degrades only itself
        self._lock = threading.Lock()
        self._rejected: Counter[str] = Counter()  # control records skipped, by ControlRecordError.why

    def put(self, rel: str, body: bytes, *, overwrite: bool) -> bool:
        """Write a control record (with its MAC on a sealed root)."""
        return self.store.put(rel, [self.mac.seal(rel, body) if self.mac is not None else body], overwrite=overwrite)

    def open(self, rel: str, raw: bytes) -> bytes:
        """A control record's body; on a sealed root ControlRecordError unless its MAC verifies."""
        return self.mac.open(rel, raw) if self.mac is not None else raw

    def bounded(self, name: str, fn: Callable[[], T]) -> T:
        """``fn()``, given up on (TimeoutError) after ``ttl_s / 2``."""
        return self.stuck.call(name, fn, self.ttl_s / 2)

    def read(self, rel: str, limit: int = MAX_CONTROL_BYTES) -> bytes:
        """The body of the control record at ``rel``, read bounded in size and time, its MAC checked."""
        raw = self.bounded(rel, lambda: read_control(self.store, rel, limit))
        return self.open(rel, raw)

    def reject(self, e: KVFormatError) -> None:
        """Count and log (once per reason and interval) a control record skipped."""
        why = getattr(e, "why", type(e).__name__)
        with self._lock:
            self._rejected[why] += 1
        self.log.warn("control:" + why, "skipped a record of the shared root's coordination: %s (counted in "
                      "root_view()['control_rejected']; other records and engines go on)", e)

    def rejected(self) -> dict[str, int]:
        """Control records skipped so far, by reason."""
        with self._lock:
            return dict(self._rejected)
