"""Every byte a shared root's coordination reads under ``.kvformat/`` is checked here before use (issue 31).

Anyone who can write the root can write these files (a co-tenant, a buggy or crashed peer), so nothing in them is
trusted: a control file is opened without following a symlink and without blocking (a FIFO is refused, never
waited on), read to at most a stated size, and each record is checked for shape (a relative path inside the root,
a size in ``[0, MAX_FILE_BYTES]``, a sequence number that only grows). A bad record raises
:class:`~kvformat.errors.ControlRecordError` here; the callers skip it, count it and log it once, and go on with
the other records: one bad record never stops the root.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from ..errors import ControlRecordError
from ..format import CONTROL_DIR
from ..storage import LocalStore, Store

__all__ = ["MAX_CONTROL_BYTES", "MAX_FILE_BYTES", "MAX_GEN", "MAX_LEASE_BYTES", "Journal", "Stuck", "check_relpath",
           "check_size", "parse_journal", "parse_lease", "parse_state", "read_control"]

MAX_CONTROL_BYTES = 64 << 20  # a journal of MAX_PENDING records is ~20 MiB; a bigger control file is a bad file
MAX_LEASE_BYTES = 4096
MAX_FILE_BYTES = 1 << 40  # no single cache file is larger: a record claiming more is a bad record
MAX_GEN = 10**12 - 1  # lease names are 12 digits
MAX_PATH = 1024
_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
T = TypeVar("T")


def read_control(store: Store, relpath: str, limit: int = MAX_CONTROL_BYTES) -> bytes:
    """``relpath``'s bytes, at most ``limit`` of them. On a local root the file is opened with ``O_NOFOLLOW`` and
    ``O_NONBLOCK`` and must be a regular file: a planted symlink or FIFO is a bad file, never followed or waited
    on. FileNotFoundError passes through (no file is not a bad file)."""
    if not isinstance(store, LocalStore):
        data = store.read_bytes(relpath)
        if len(data) > limit:
            raise ControlRecordError("oversized", f"{len(data)} bytes, at most {limit}", path=relpath)
        return data
    check_relpath(relpath, control=True)
    try:
        fd = os.open(os.path.join(store.root, relpath),
                     os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise ControlRecordError("not-regular", "a symlink, FIFO or directory", path=relpath) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ControlRecordError("not-regular", "not a regular file", path=relpath)
        if st.st_size > limit:
            raise ControlRecordError("oversized", f"{st.st_size} bytes, at most {limit}", path=relpath)
        parts: list[bytes] = []
        got = 0
        while got <= limit:
            b = os.read(fd, min(1 << 20, limit + 1 - got))
            if not b:
                break
            parts.append(b)
            got += len(b)
        if got > limit:  # grew while read
            raise ControlRecordError("oversized", f"more than {limit} bytes", path=relpath)
        return b"".join(parts)
    finally:
        os.close(fd)


class Stuck:
    """Runs reads that may stall (a hung NFS/FUSE server) on a worker thread and gives up on one after
    ``timeout_s``: the caller goes on, the worker is abandoned. While an abandoned read of a name is still stuck,
    that name is not read again, so stuck threads stay at most one per name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stuck: set[str] = set()

    def call(self, name: str, fn: Callable[[], T], timeout_s: float) -> T:
        with self._lock:
            if name in self.stuck:
                raise TimeoutError(f"{name}: an earlier read is still stuck")
        box: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed to the caller
                box.append((False, e))
            finally:
                done.set()
                with self._lock:
                    self.stuck.discard(name)

        threading.Thread(target=run, name="kvformat-control-read", daemon=True).start()
        if not done.wait(timeout_s):
            with self._lock:
                if not done.is_set():
                    self.stuck.add(name)
            if not done.is_set():
                raise TimeoutError(f"{name}: read did not finish in {timeout_s:.1f} s (abandoned)")
        ok, val = box[0]
        if not ok:
            raise val
        return val  # type: ignore[no-any-return]


def check_relpath(rel: Any, *, control: bool = False) -> str:
    """``rel`` if it is a plain relative path inside the root (no ``..``, ``.``, empty component, absolute path,
    backslash or NUL), and outside ``.kvformat/`` unless ``control``."""
    if not isinstance(rel, str) or not rel or len(rel) > MAX_PATH:
        raise ControlRecordError("path", "not a non-empty string of at most %d characters" % MAX_PATH)
    if rel.startswith("/") or "\0" in rel or "\\" in rel or any(p in ("", ".", "..") for p in rel.split("/")):
        raise ControlRecordError("path", f"{rel[:80]!r} is not a plain relative path")
    if not control and (rel == CONTROL_DIR or rel.startswith(CONTROL_DIR + "/")):
        raise ControlRecordError("path", f"{rel[:80]!r} names the control directory")
    return rel


def check_size(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_FILE_BYTES:
        raise ControlRecordError("size", f"{str(n)[:40]} is not in [0, {MAX_FILE_BYTES}]")
    return n


def _int(v: Any, lo: int, hi: int, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ControlRecordError(what, f"{str(v)[:40]} is not in [{lo}, {hi}]")
    return v


def _load(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise ControlRecordError("json", "not JSON") from None
    if not isinstance(doc, dict):
        raise ControlRecordError("json", "not a JSON object")
    return doc


@dataclass(frozen=True)
class Journal:
    """One follower's journal, checked. ``records``: (seq, op, relpath, size, pred) past ``merged``, in order (``pred``:
    the chunk before ``relpath`` in the prompt that stored it, from an optional fifth field ``{"pred": path}``, or
    None); ``bad``: the records skipped."""

    id: str
    beat: int
    ack: tuple[int, int] | None
    gone: bool
    records: list[tuple[int, str, str, int, str | None]]
    bad: list[ControlRecordError]


def parse_journal(raw: bytes, merged: int) -> Journal:
    """A journal's records not merged yet (seq > ``merged``). Unknown fields, in the document, in a record's fifth
    field (an object) or after it, are ignored (optional fields of later versions). A ``pred`` in the fifth field
    is checked as the path is: a bad one makes the record bad."""
    doc = _load(raw)
    ident = doc.get("id")
    if not isinstance(ident, str) or not _ID.fullmatch(ident):
        raise ControlRecordError("id", "engine id not of the expected shape")
    beat = _int(doc.get("beat"), 0, 2**62, "beat")
    ack_raw = doc.get("ack")
    ack = None
    if ack_raw:
        if not isinstance(ack_raw, list) or len(ack_raw) != 2:
            raise ControlRecordError("ack", "not a [generation, state] pair")
        ack = (_int(ack_raw[0], 0, MAX_GEN, "ack"), _int(ack_raw[1], 0, 2**62, "ack"))
    recs = doc.get("records", [])
    if not isinstance(recs, list) or len(recs) > 2 * 200_000:
        raise ControlRecordError("records", "not a list of at most 400000 records")
    out: list[tuple[int, str, str, int, str | None]] = []
    bad: list[ControlRecordError] = []
    last = merged
    for r in recs:
        try:
            if not isinstance(r, list) or len(r) < 4:
                raise ControlRecordError("record", "not a [seq, op, path, size, ...] list")
            seq = _int(r[0], 0, 2**62, "seq")
            if seq <= merged:
                continue
            if seq <= last:
                raise ControlRecordError("seq", f"record {seq} after {last}: sequence numbers only grow")
            if r[1] not in ("w", "r", "x"):
                raise ControlRecordError("op", "op not one of w, r, x")
            extra = r[4] if len(r) > 4 and isinstance(r[4], dict) else {}
            pred = check_relpath(extra["pred"]) if extra.get("pred") is not None else None
            out.append((seq, r[1], check_relpath(r[2]), check_size(r[3]), pred))
            last = seq
        except ControlRecordError as e:
            bad.append(e)
    return Journal(ident, beat, ack, doc.get("gone") is True, out, bad)


def parse_state(raw: bytes) -> tuple[dict[str, Any], list[ControlRecordError]]:
    """``state.json`` checked: the fields a follower uses, of the right types and ranges; bad doomed entries and
    engine entries are dropped (and returned)."""
    doc = _load(raw)
    bad: list[ControlRecordError] = []
    s: dict[str, Any] = {"gen": _int(doc.get("gen"), 1, MAX_GEN, "gen"), "seq": _int(doc.get("seq"), 0, 2**62, "seq"),
                         "allowance": _int(doc.get("allowance", 0), 0, MAX_FILE_BYTES, "allowance"),
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
            doomed[check_relpath(d[0])] = _int(d[1], 0, 2**62, "doomed")
        except ControlRecordError as e:
            bad.append(e)
    s["doomed"] = doomed
    engines: dict[str, int] = {}
    raw_eng = doc.get("engines")
    for k, v in (raw_eng.items() if isinstance(raw_eng, dict) else ()):
        if isinstance(k, str) and _ID.fullmatch(k) and isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            engines[k] = v
        else:
            bad.append(ControlRecordError("engines", "an engine entry not of the expected shape"))
    s["engines"] = engines
    return s, bad


def parse_lease(raw: bytes) -> dict[str, Any]:
    doc = _load(raw)
    return {"owner": doc.get("owner") if isinstance(doc.get("owner"), str) else None,
            "host": doc.get("host") if isinstance(doc.get("host"), str) else None,
            "pid": doc.get("pid") if isinstance(doc.get("pid"), int) and not isinstance(doc.get("pid"), bool) else 0}
