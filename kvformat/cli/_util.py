"""Small shared pieces of the CLI: argument types, sizes, names safe to print, tables, progress."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any, TextIO

from ..format import format_size, parse_limit, parse_size
from ..errors import UsageError
from ..storage import REPLACED, Quarantined

__all__ = [
    "note_quarantine",
    "MAX_JOBS",
    "Progress",
    "UsageError",
    "human",
    "int_arg",
    "iso",
    "jobs_arg",
    "mode_arg",
    "parse_limit",
    "parse_size",
    "shown",
    "size_arg",
    "table",
    "terminal_safe",
]

MAX_JOBS = 256  # the tier's read_threads/write_threads bound too


def human(n: float) -> str:
    """Bytes in binary units, 3 significant digits, never an exponent (``1.00 MiB``, not ``1e+03 KiB``)."""
    return format_size(n)


def shown(text: str) -> str:
    """A file name made safe for one line of text on any terminal encoding.

    Names are bytes on POSIX: Python decodes undecodable bytes as lone surrogates, which a UTF-8
    stdout cannot encode, and a newline or an escape sequence in a name would break or forge output
    lines. Undecodable bytes become ``\\xNN``, control characters and backslashes their escapes
    (as ``ls -b`` does), so every name prints on one line and can be told apart.
    """
    out = []
    for ch in text:
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:  # surrogateescape: the original byte
            out.append(f"\\x{o - 0xDC00:02x}")
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif not ch.isprintable() and ch != " ":  # C0, DEL, C1, bidi overrides, separators, unassigned
            out.append(_escape(o))
        else:
            out.append(ch)
    return "".join(out)


def _escape(o: int) -> str:
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def terminal_safe(text: str) -> str:
    """``text`` with every non-printable character but newlines escaped: the last line of defence of all human
    output (a header string or an error message may carry C0/C1 controls that a terminal would obey).
    Backslashes are kept, so text already passed through :func:`shown` is unchanged."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        o = ord(ch)
        if ch == "\n" or ch == " " or ch.isprintable():
            out.append(ch)
        elif 0xDC80 <= o <= 0xDCFF:
            out.append(f"\\x{o - 0xDC00:02x}")
        else:
            out.append(_escape(o))
    return "".join(out)


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


# -- argument types: one validation per kind of value, so every command says the same thing ----------
def int_arg(lo: int, hi: int | None = None, what: str = "an integer") -> Callable[[str], int]:
    """An argparse type: an integer in ``lo..hi`` (argparse turns the error into exit code 2)."""
    def parse(text: str) -> int:
        try:
            v = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            rng = f"{lo}..{hi}" if hi is not None else f"at least {lo}"
            raise argparse.ArgumentTypeError(f"expected {what} in {rng}, got {v}")
        return v
    parse.__name__ = what  # argparse names the type in some messages
    return parse


jobs_arg = int_arg(1, MAX_JOBS, "a thread count")


def layers_arg(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated layer counts, each at least 1 (a pipeline partition)."""
    count = int_arg(1, 1024, "a layer count")
    return tuple(count(x.strip()) for x in text.split(","))


def size_arg(text: str) -> int:
    """An argparse type: kvformat's one size syntax (kvformat.format._sizes)."""
    try:
        return parse_size(text, "size")
    except UsageError as e:
        raise argparse.ArgumentTypeError(e.message.removeprefix("size: ")) from None


def mode_arg(text: str) -> int:
    """An argparse type: an octal permission mode such as 0640 or 640 (no setuid/setgid/sticky bits)."""
    try:
        v = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an octal mode such as 0640, got {text!r}") from None
    if not 0 <= v <= 0o777:
        raise argparse.ArgumentTypeError(f"expected an octal mode in 000..777, got {text!r}")
    if not v & 0o600 == 0o600:
        raise argparse.ArgumentTypeError(f"mode {text}: the owner must keep read and write (u+rw)")
    return v


def progress_wanted(quiet: bool, json_out: bool, stream: TextIO | None = None) -> bool:
    """Progress is drawn only on a terminal: never in pipes, with --quiet, or with --json."""
    s = stream or sys.stderr
    return not quiet and not json_out and bool(getattr(s, "isatty", lambda: False)())


class Progress:
    """A progress bar on a terminal (stderr, redrawn at most 10x/s); nothing on a pipe or when disabled.

    ``note`` lines (failures) are always written, above the bar when there is one.
    """

    def __init__(self, total: int, total_bytes: int, *, label: str, stream: TextIO | None = None,
                 enabled: bool = True, unit: str = "files") -> None:
        self.total, self.total_bytes, self.label, self.unit = total, total_bytes, label, unit
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled and self.tty
        self.done = 0
        self.done_bytes = 0
        self.t0 = time.monotonic()
        self._last = 0.0
        self._drawn = False
        self._lock = threading.Lock()

    def update(self, n_bytes: int, n: int = 1) -> None:
        with self._lock:
            self.done += n
            self.done_bytes += n_bytes
            if not self.enabled:
                return
            now = time.monotonic()
            if now - self._last >= 0.1 or self.done >= self.total:
                self._last = now
                self._draw(now)

    def add_total(self, files: int, nbytes: int) -> None:
        """More work became known (a scan lists before it checks; a mixed root has two sides)."""
        with self._lock:
            self.total += files
            self.total_bytes += nbytes

    def note(self, line: str) -> None:
        """A line that must not be mangled by the bar (failures)."""
        with self._lock:
            if self._drawn:
                self.stream.write("\r\x1b[K")
            self.stream.write(shown(line) + "\n")  # library lines carry raw file names
            if self._drawn:
                self._draw(time.monotonic())
            self.stream.flush()

    def _draw(self, now: float) -> None:
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        bar = "#" * int(frac * 30)
        rate = human(self.done_bytes / max(now - self.t0, 1e-9))
        self.stream.write(f"\r{self.label} [{bar:<30}] {self.done}/{self.total} {self.unit} "
                          f"{human(self.done_bytes)} {rate}/s\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        with self._lock:
            if self._drawn:
                self.stream.write("\n")
                self.stream.flush()
                self._drawn = False


def umask() -> int:
    """The process umask (reading it means setting it: set it back at once)."""
    m = os.umask(0)
    os.umask(m)
    return m


def note_quarantine(rep: dict[str, Any], where: str, q: Quarantined, root: str, sep: str) -> None:
    """Record what a quarantine did in the verify report: moved (to ``root + sep + q.relpath``), or left alone
    because the file at that name is not the one found bad (replaced since the check: written afresh)."""
    if q.relpath is not None:
        rep["quarantined"].append(f"{root}{sep}{q.relpath}")
    elif q.outcome == REPLACED:
        rep["ignored"].append({"path": where, "why": "replaced since it was checked (a newer file holds its name): "
                               "not quarantined"})

