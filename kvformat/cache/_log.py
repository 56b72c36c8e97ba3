"""The cache's log: one logger the adapter hands in (so the engine's handlers, format and levels apply), and
warnings that repeat at a bounded rate instead of once per process lifetime."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

__all__ = ["DEFAULT_LOGGER", "REPEAT_INTERVAL_S", "CacheLog"]

#: Used when no adapter hands a logger in (tools, tests): a library logger, configured by the application.
DEFAULT_LOGGER = "kvformat.cache"
#: A warning of one reason is logged at once, then at most once per this many seconds, with the count of the
#: occurrences it stood for: a disk that fills again a day later is reported again, a failing store is not
#: logged a thousand times a second.
REPEAT_INTERVAL_S = 60.0


class CacheLog:
    """A logger plus per-reason rate limiting (thread-safe). ``prefix`` starts every message (the tier's name)."""

    def __init__(self, logger: logging.Logger | None = None, prefix: str = "kvformat",
                 interval_s: float = REPEAT_INTERVAL_S) -> None:
        self.logger = logger if logger is not None else logging.getLogger(DEFAULT_LOGGER)
        self.prefix = prefix
        self.interval_s = interval_s
        self._lock = threading.Lock()
        # reason -> [monotonic time of the last line logged, occurrences suppressed since]
        self._last: dict[str, list[float]] = {}

    # stacklevel: the file and line a handler shows (vLLM's "[file:line]") are the caller's, not this module's.
    def info(self, msg: str, *args: Any) -> None:
        self.logger.info(f"{self.prefix}: {msg}", *args, stacklevel=2)

    def warning(self, msg: str, *args: Any) -> None:
        self.logger.warning(f"{self.prefix}: {msg}", *args, stacklevel=2)

    def error(self, msg: str, *args: Any) -> None:
        self.logger.error(f"{self.prefix}: {msg}", *args, stacklevel=2)

    def warn(self, reason: str, msg: str, *args: Any, level: int = logging.WARNING, stacklevel: int = 2) -> bool:
        """Log ``msg`` for ``reason`` now unless one was logged less than ``interval_s`` ago (then count it).
        A line logged after suppressed ones says how many it stands for. True when it was logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(reason)
            if last is not None and now - last[0] < self.interval_s:
                last[1] += 1
                return False
            suppressed = int(last[1]) if last is not None else 0
            self._last[reason] = [now, 0]
        tail = (f" ({suppressed} more like this in the last {self.interval_s:g} s; repeats are logged at most "
                f"once per {self.interval_s:g} s, see the tier's metrics)" if suppressed else "")
        self.logger.log(level, f"{self.prefix}: {msg}{tail}", *args, stacklevel=stacklevel)
        return True

    def flush(self) -> None:
        """Report the occurrences held back whose interval has passed (called periodically), so the last burst
        of a problem that then stopped is counted in the log too."""
        now = time.monotonic()
        out = []
        with self._lock:
            for reason, last in self._last.items():
                if last[1] and now - last[0] >= self.interval_s:
                    out.append((reason, int(last[1])))
                    last[0], last[1] = now, 0
        for reason, n in out:
            self.logger.warning(f"{self.prefix}: {n} more '{reason}' warning(s) in the last {self.interval_s:g} s "
                                "(see the tier's metrics)")

    def suppressed(self, reason: str) -> int:
        """Occurrences of ``reason`` not logged since its last line (tests, tools)."""
        with self._lock:
            last = self._last.get(reason)
            return int(last[1]) if last is not None else 0
