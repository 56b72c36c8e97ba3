"""The evictor's published state (``state.json``: parsed and checked here), the grant arithmetic behind it, and what
the evictor keeps while it holds the lease (:class:`Holding`, a :class:`View` of each follower); the protocol is in
:mod:`kvformat.cache.shared`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import ControlRecordError
from ...format import CONTROL_DIR
from ._checks import ENGINE_ID, MAX_FILE_BYTES, MAX_GEN, check_int, check_relpath, load_doc

__all__ = ["STATE_FILE", "Holding", "Key", "View", "default_allowance", "grant", "parse_state", "shared_target"]

STATE_FILE = f"{CONTROL_DIR}/state.json"

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
    reserved: int = 0  # its bytes admitted and not yet written, as its last journal said
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


def parse_state(raw: bytes) -> tuple[dict[str, Any], list[ControlRecordError]]:
    """``state.json`` checked: the fields a follower uses, of the right types and ranges; bad doomed entries and
    engine entries are dropped (and returned)."""
    doc = load_doc(raw)
    bad: list[ControlRecordError] = []
    s: dict[str, Any] = {"gen": check_int(doc.get("gen"), 1, MAX_GEN, "gen"),
                         "seq": check_int(doc.get("seq"), 0, 2**62, "seq"),
                         "allowance": check_int(doc.get("allowance", 0), 0, MAX_FILE_BYTES, "allowance"),
                         "released": doc.get("released") is True}
    for k in ("owner", "host"):
        s[k] = doc[k] if isinstance(doc.get(k), str) and len(doc[k]) <= 256 else None
    s["pid"] = doc["pid"] if isinstance(doc.get("pid"), int) and not isinstance(doc["pid"], bool) else 0
    for k in ("used", "files", "target", "max_bytes"):
        v = doc.get(k)
        s[k] = v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 2**62 else None
    doomed: dict[str, int] = {}
    for d in doc.get("doomed", []) if isinstance(doc.get("doomed"), list) else []:
        try:
            if not isinstance(d, list) or len(d) < 2:
                raise ControlRecordError("doomed", "not a [path, state] pair")
            doomed[check_relpath(d[0])] = check_int(d[1], 0, 2**62, "doomed")
        except ControlRecordError as e:
            bad.append(e)
    s["doomed"] = doomed
    engines: dict[str, int] = {}
    raw_eng = doc.get("engines")
    for k, v in (raw_eng.items() if isinstance(raw_eng, dict) else ()):
        if isinstance(k, str) and ENGINE_ID.fullmatch(k) and isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            engines[k] = v
        else:
            bad.append(ControlRecordError("engines", "an engine entry not of the expected shape"))
    s["engines"] = engines
    return s, bad
