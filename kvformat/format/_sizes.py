"""The one size syntax of kvformat: the CLI's size options and the tier's ``max_bytes`` share it.

Accepted: a non-negative integer (``1000000``), or a number with a unit, case-insensitive, spaces
allowed between them: ``K``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB``, ``P``/``PB`` are powers of
1000; ``Ki``/``KiB``, ``Mi``/``MiB``, ``Gi``/``GiB``, ``Ti``/``TiB``, ``Pi``/``PiB`` powers of 1024;
``B`` is bytes. A fraction (``1.5TiB``) is allowed and rounded down to a whole byte.

``0`` means **no limit** wherever a size is a bound (the tier's ``max_bytes``, ``kvformat gc
--max-bytes``), as ``rsync --max-size=0`` does: a zero that evicts everything is too easy to type
by accident and would contradict the tier. :func:`parse_limit` returns None for it.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

from ..errors import UsageError

__all__ = ["UNITS", "format_size", "parse_limit", "parse_size"]

UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    UNITS[_p] = UNITS[_p + "b"] = 1000 ** _i
    UNITS[_p + "i"] = UNITS[_p + "ib"] = 1024 ** _i

# Digits only (no exponent, no sign, no "inf"/"nan" that float() would take).
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*([A-Za-z]*)\s*")
_EXAMPLES = "such as 500GiB, 1.5TB, 800G or 1000000"


def parse_size(value: Any, name: str = "size") -> int:
    """Bytes from an int or a size string (see the module docstring). Raises UsageError naming ``name``."""
    if isinstance(value, bool):  # True is an int to Python, never a size to a user
        raise UsageError(f"{name}: expected a byte count {_EXAMPLES}, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise UsageError(f"{name}: expected a byte count {_EXAMPLES}, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in UNITS:
            raise UsageError(f"{name}: expected a byte count {_EXAMPLES}, got {value!r}")
        n = int(Fraction(m.group(1)) * UNITS[unit])  # Fraction: "1.1TB" exact, no float rounding
    else:
        raise UsageError(f"{name}: expected an int or a string {_EXAMPLES}, got {type(value).__name__}")
    if n < 0:
        raise UsageError(f"{name}: expected a non-negative size, got {value!r}")
    return n


def parse_limit(value: Any, name: str = "size") -> int | None:
    """A bound in bytes, or None for "no limit" (``None`` or any spelling of 0)."""
    if value is None:
        return None
    return parse_size(value, name) or None


def format_size(n: float) -> str:
    """Bytes in binary units with 3 significant digits (``1.00 MiB``, ``999 KiB``, ``12.3 GiB``), never
    an exponent: a value that rounds up to 1024 of a unit is shown in the next unit."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    if n < 1023.5:  # whole bytes; 1023.5 would round to "1024 B"
        return f"{sign}{n:.0f} B"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    for i, unit in enumerate(units):
        n /= 1024
        text = f"{n:.2f}" if n < 9.995 else f"{n:.1f}" if n < 99.95 else f"{n:.0f}"
        if float(text) < 1024 or i == len(units) - 1:
            return f"{sign}{text} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover
