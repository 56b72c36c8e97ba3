"""Small shared pieces of the CLI: sizes, times, aligned tables, a progress reporter."""

from __future__ import annotations

import re
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any, Sequence, TextIO

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20,
          "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40}
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")


class UsageError(Exception):
    """A bad command line value (exit code 2)."""


def parse_size(text: str) -> int:
    """'500', '10G', '1.5GiB', '64MiB' -> bytes (decimal K/M/G/T, binary Ki/Mi/Gi/Ti)."""
    m = _SIZE_RE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise UsageError(f"expected a size such as 500G, 64MiB or 1000000, got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def human(n: float) -> str:
    """Bytes in binary units, 3 significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def iso(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = ()) -> str:
    """An aligned text table; columns in ``right`` are right-aligned (numbers)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for j, r in enumerate(cells):
        parts = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)]
        out.append("  ".join(parts).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


class Progress:
    """A progress bar on a terminal (redrawn at most 10x/s), plain lines every ``every_s`` otherwise."""

    def __init__(self, total: int, total_bytes: int, *, label: str, stream: TextIO | None = None,
                 every_s: float = 5.0, enabled: bool = True) -> None:
        self.total, self.total_bytes, self.label = total, total_bytes, label
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s
        self.enabled = enabled
        self.done = 0
        self.done_bytes = 0
        self.t0 = time.monotonic()
        self._last = self.t0
        self._lock = threading.Lock()

    def update(self, n_bytes: int) -> None:
        with self._lock:
            self.done += 1
            self.done_bytes += n_bytes
            now = time.monotonic()
            if not self.enabled:
                return
            if self.tty and (now - self._last >= 0.1 or self.done == self.total):
                self._last = now
                self._draw(now)
            elif not self.tty and (now - self._last >= self.every_s and self.done < self.total):
                self._last = now
                self.stream.write(f"{self.label}: {self.done}/{self.total} files, {human(self.done_bytes)}"
                                  f" ({self._rate(now)})\n")
                self.stream.flush()

    def note(self, line: str) -> None:
        """A line that must not be mangled by the bar (failures)."""
        with self._lock:
            if self.tty and self.enabled:
                self.stream.write("\r\x1b[K")
            self.stream.write(line + "\n")
            if self.tty and self.enabled:
                self._draw(time.monotonic())
            self.stream.flush()

    def _rate(self, now: float) -> str:
        dt = max(now - self.t0, 1e-9)
        return f"{human(self.done_bytes / dt)}/s"

    def _draw(self, now: float) -> None:
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * 30)
        self.stream.write(f"\r{self.label} [{bar:<30}] {self.done}/{self.total} {human(self.done_bytes)} "
                          f"{self._rate(now)}\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.enabled and self.total:
            self.stream.write("\n")
            self.stream.flush()
