"""Existence answers a remote store remembers for a while (a scheduler asks the same keys every step)."""

from __future__ import annotations

import threading
import time
from typing import Iterable


class ExistsCache:
    """``relpath -> (exists, when)``; a positive answer is trusted ``present_s``, a negative one
    ``missing_s`` (short: another host may write the key). Thread-safe."""

    def __init__(self, present_s: float, missing_s: float) -> None:
        self.present_s = present_s
        self.missing_s = missing_s
        self._known: dict[str, tuple[bool, float]] = {}
        self.after_fork()

    def after_fork(self) -> None:
        """Fresh lock and no lookups in flight (the parent's lock may have been held at fork time)."""
        self._lock = threading.Lock()
        self._pending: set[str] = set()

    def note(self, relpath: str, present: bool) -> None:
        """Remember an answer just learned."""
        with self._lock:
            self._known[relpath] = (present, time.monotonic())

    def get(self, relpath: str) -> bool | None:
        """The remembered answer, or None if unknown or expired."""
        with self._lock:
            v = self._known.get(relpath)
        if v is None:
            return None
        present, at = v
        return present if time.monotonic() - at < (self.present_s if present else self.missing_s) else None

    def forget(self, relpaths: Iterable[str] | None = None) -> None:
        """Drop remembered answers (all of them by default)."""
        with self._lock:
            if relpaths is None:
                self._known.clear()
            else:
                for r in relpaths:
                    self._known.pop(r, None)

    def claim(self, relpaths: Iterable[str]) -> list[str]:
        """Of ``relpaths``, those with no lookup in flight, now marked as in flight."""
        with self._lock:
            ask = [r for r in relpaths if r not in self._pending]
            self._pending.update(ask)
        return ask

    def release(self, relpath: str) -> None:
        """The lookup of ``relpath`` is over."""
        with self._lock:
            self._pending.discard(relpath)


__all__ = ["ExistsCache"]
