"""Engine journals, ``engines/<engine id>.json``: what a follower writes each tick (a heartbeat, its
acknowledgement, the bytes it admitted and has not written yet, and the records the evictor has not merged yet:
files it wrote, read, found gone), how a journal is parsed and checked, and how the evictor merges the journals
into its index (the protocol: :mod:`kvformat.cache.shared`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from ...errors import ControlRecordError
from ...format import CONTROL_DIR
from ...format import host_tag
from .._lru import LRUIndex
from ._checks import (ENGINE_ID, MAX_CONTROL_BYTES, MAX_FILE_BYTES, MAX_GEN, check_int, check_relpath, check_size,
                      load_doc)
from ._control import Control
from ._state import Holding, Key, View

__all__ = ["ENGINES_DIR", "MAX_PENDING", "Journal", "JournalMerge", "Records", "parse_journal"]

ENGINES_DIR = f"{CONTROL_DIR}/engines"
MAX_PENDING = 200_000  # journal records kept for the evictor; past this, read records (recency) are dropped
_READ = "control:read"  # the log-once reason of a control read that failed or stalled


@dataclass(frozen=True)
class Journal:
    """One follower's journal, checked. ``records``: (seq, op, relpath, size, pred) past ``merged``, in order (``pred``:
    the chunk before ``relpath`` in the prompt that stored it, from an optional fifth field ``{"pred": path}``, or
    None); ``bad``: the records skipped; ``reserved``: the bytes its stores admitted and not yet written (0 when
    absent: a journal of an older version)."""

    id: str
    beat: int
    ack: tuple[int, int] | None
    gone: bool
    records: list[tuple[int, str, str, int, str | None]]
    bad: list[ControlRecordError]
    reserved: int = 0


def parse_journal(raw: bytes, merged: int) -> Journal:
    """A journal's records not merged yet (seq > ``merged``). Unknown fields, in the document, in a record's fifth
    field (an object) or after it, are ignored (optional fields of later versions). A ``pred`` in the fifth field
    is checked as the path is: a bad one makes the record bad."""
    doc = load_doc(raw)
    ident = doc.get("id")
    if not isinstance(ident, str) or not ENGINE_ID.fullmatch(ident):
        raise ControlRecordError("id", "engine id not of the expected shape")
    beat = check_int(doc.get("beat"), 0, 2**62, "beat")
    reserved = check_int(doc.get("reserved", 0), 0, MAX_FILE_BYTES, "reserved")
    ack_raw = doc.get("ack")
    ack = None
    if ack_raw:
        if not isinstance(ack_raw, list) or len(ack_raw) != 2:
            raise ControlRecordError("ack", "not a [generation, state] pair")
        ack = (check_int(ack_raw[0], 0, MAX_GEN, "ack"), check_int(ack_raw[1], 0, 2**62, "ack"))
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
            seq = check_int(r[0], 0, 2**62, "seq")
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
    return Journal(ident, beat, ack, doc.get("gone") is True, out, bad, reserved)


class Records:
    """A follower's records the evictor has not merged yet, in record-number order; the caller holds the lock
    that guards them."""

    def __init__(self) -> None:
        self.beat = 0
        self.seq = 0
        # relpath -> [record number, op, size, predecessor or None]; insertion = seq order
        self.pending: dict[str, list[Any]] = {}
        self.unmerged = 0  # bytes of the "w" records in pending

    def add(self, relpath: str, op: str, nbytes: int, pred: str | None = None) -> None:
        """Record ``op`` ("w" wrote, "r" read, "x" gone) on ``relpath``: the newest record of a file replaces
        the one before (a read after a write stays the write)."""
        self.seq += 1
        old = self.pending.pop(relpath, None)
        if old is not None and old[1] == "w":
            self.unmerged -= old[2]
            if op == "r":
                op, nbytes, pred = "w", old[2], old[3]  # a read after a write: still the write (recency too)
        if op == "w":
            self.unmerged += nbytes
        self.pending[relpath] = [self.seq, op, nbytes, pred]
        if len(self.pending) > MAX_PENDING:
            for rel in [r for r, v in self.pending.items() if v[1] == "r"][:len(self.pending) - MAX_PENDING]:
                del self.pending[rel]

    def merged(self, upto: int) -> None:
        """The evictor has merged the records up to number ``upto``: they are dropped."""
        for rel in [r for r, v in self.pending.items() if v[0] <= upto]:
            del self.pending[rel]
        self.unmerged = sum(v[2] for v in self.pending.values() if v[1] == "w")

    def clear(self) -> None:
        """This engine took the lease: the evictor indexes its own files directly."""
        self.pending.clear()
        self.unmerged = 0

    def doc(self, engine_id: str, pid: int, ack: Key, gone: bool, reserved: int = 0) -> dict[str, Any]:
        """The next journal (a new heartbeat) of engine ``engine_id`` (``reserved``: its bytes admitted and not
        yet written)."""
        self.beat += 1
        return {"id": engine_id, "host": host_tag(), "pid": pid, "beat": self.beat, "ack": list(ack),
                "gone": gone, "reserved": reserved,
                "records": [[v[0], v[1], rel, v[2]] + ([{"pred": v[3]}] if v[3] else [])
                            for rel, v in self.pending.items()]}


class JournalMerge:
    """The evictor's side of the journals: each read bounded, merged into ``index``, a gone engine's removed."""

    def __init__(self, control: Control, index: LRUIndex, own_id: str, ttl_s: float) -> None:
        self.control = control
        self.store = control.store
        self.index = index
        self.id = own_id
        self.ttl_s = ttl_s

    def read_all(self) -> tuple[list[str], list[bytes]]:
        """The followers' journals, each read bounded (size, file type, time): one that is bad or stuck is
        skipped this pass, the others are read."""
        rels = [e.relpath for e in self.store.list_dir(ENGINES_DIR) if e.relpath.endswith(".json")]
        out: tuple[list[str], list[bytes]] = ([], [])
        many = getattr(self.store, "read_many_bytes", None)
        if many is not None and not self.store.is_local:  # remote: its own timeouts, in parallel
            try:
                got = self.control.bounded(ENGINES_DIR, lambda: many(rels))
            except (OSError, TimeoutError) as e:
                self.control.log.warn(_READ, "reading the followers' journals failed: %s", e)
                return out
            for rel, r in zip(rels, got):
                try:
                    if isinstance(r, (bytes, bytearray)) and len(r) <= MAX_CONTROL_BYTES:
                        out[1].append(self.control.open(rel, bytes(r)))
                        out[0].append(rel)
                    elif isinstance(r, (bytes, bytearray)):
                        raise ControlRecordError("oversized", f"{len(r)} bytes", path=rel)
                except ControlRecordError as e:
                    self.control.reject(e.with_path(rel))
            return out
        for rel in rels:
            try:
                raw = self.control.read(rel)
            except ControlRecordError as e:
                self.control.reject(e.with_path(rel))
                continue
            except (OSError, TimeoutError) as e:
                self.control.log.warn(_READ, "a follower's journal could not be read: %s: %s", rel, e)
                continue
            out[0].append(rel)
            out[1].append(raw)
        return out

    def merge(self, h: Holding, rel: str, raw: bytes, now: float) -> None:
        """Merge one follower's journal: its records past the last merged, each checked, a bad one skipped."""
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        last = h.journals.get(rel)
        if last is not None and last[0] == digest:  # unchanged since the last pass: nothing new, nothing re-counted
            v = h.views.get(last[1])
            if v is not None and not v.gone and now - v.seen_at > 3 * self.ttl_s:
                self._gone(h, rel, v)
            return
        try:
            j = parse_journal(raw, 0)
        except ControlRecordError as e:
            h.journals[rel] = (digest, "")
            self.control.reject(e.with_path(rel))
            return
        h.journals[rel] = (digest, j.id)
        for bad in j.bad:
            self.control.reject(bad.with_path(rel))
        if j.id == self.id:
            return
        first = j.id not in h.views or h.views[j.id].beat < 0  # never merged (a former evictor's placeholder)
        v = h.views.setdefault(j.id, View(seen_at=now))
        if j.beat != v.beat:
            v.beat, v.seen_at = j.beat, now
        v.ack = j.ack
        v.reserved = j.reserved
        absent = self._absent(h, j.records) if first else set()
        link = getattr(self.index, "link", None)  # a prefix-aware index (cache/_prefix.py) learns chains
        for seq, op, relpath, size, pred in j.records:
            if seq <= v.merged:
                continue
            v.merged = seq
            if op == "w" or op == "r":
                if relpath in h.doomed:
                    continue
                if pred is not None and op == "w" and link is not None:
                    link(relpath, pred)
                # A write is a store, not a load: a segmented index must not protect it (fleet at cbd31a1:
                # the evictor protected every file another engine wrote, and its own new files went first).
                known = self.index.note_store(relpath) if op == "w" else self.index.touch(relpath)
                if not known and op == "w" and relpath not in absent:
                    self.index.add_found(relpath, size)
            elif op == "x":
                self.index.remove(relpath)
        if j.gone or now - v.seen_at > 3 * self.ttl_s:
            self._gone(h, rel, v)

    def _absent(self, h: Holding, records: list[tuple[int, str, str, int, str | None]]) -> set[str]:
        """Of the files a journal's writes name, those not on storage: asked only when this evictor merges the
        journal for the first time. Such a journal may be old (an engine that died, or that became the evictor and
        wrote no journal since), and its writes may name files a former evictor deleted long ago; indexed, each
        would be a hit that finds no file (and bytes counted that are not there). Writes merged after the first
        time are newer than this evictor's own listing of the root. A check that fails or stalls counts them all
        (the bound errs on the safe side)."""
        rels = [rel for _, op, rel, _, _ in records if op == "w" and rel not in self.index and rel not in h.doomed]
        if not rels:
            return set()
        try:
            found = self.control.bounded(ENGINES_DIR + ":exists", lambda: self.store.exists_many(rels))
        except (OSError, TimeoutError) as e:
            self.control.log.warn(_READ, "checking the files a journal names failed: %s", e)
            return set()
        return {rel for rel, ok in zip(rels, found) if not ok}

    def _gone(self, h: Holding, rel: str, v: View) -> None:
        v.gone = True
        h.journals.pop(rel, None)
        try:
            self.store.delete(rel)
        except OSError:
            pass
