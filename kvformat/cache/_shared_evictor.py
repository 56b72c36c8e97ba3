"""The evictor's side of :class:`kvformat.cache._shared.SharedBound`: taking the lease, merging the followers'
journals, dooming and deleting, publishing ``state.json`` (the protocol is in :mod:`kvformat.cache._shared`)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from typing import Any, Callable

from ..format import host_tag
from ..storage import LocalStore, Store
from ._log import CacheLog
from ._lru import LRUIndex
from ..errors import ControlRecordError, KVFormatError
from ._shared_check import (MAX_CONTROL_BYTES, MAX_GEN, MAX_LEASE_BYTES, Stuck, parse_journal, parse_lease,
                            read_control)
from ._shared_mac import ControlMac
from ._shared_grants import ENGINES_DIR, LEASE_DIR, STATE_FILE, Holding, View, grant, shared_target

__all__ = ["EvictorRole"]

_READ = "control:read"  # the log-once reason of a control read that failed or stalled
_SILENT = "shared:silent"  # the log-once reason of a follower that stopped journaling


class EvictorRole:
    """Mixin: the methods an engine runs while it holds (or takes) the root's lease. The state it shares with the
    follower side is set up by ``SharedBound.__init__``."""

    store: Store
    index: LRUIndex
    max_bytes: int
    allowance: int
    ttl_s: float
    log: CacheLog
    id: str
    journal_rel: str
    holding: Holding | None
    _lock: threading.Lock
    _room: threading.Condition
    _delete: Callable[[list[tuple[str, int]]], None]
    _rescan: Callable[[], None]
    _scanned: Callable[[], bool]
    _closed: bool
    _pending: dict[str, list[Any]]
    _unmerged: int
    _reserved: int
    _since_pass: int
    _own_grant: int
    _refused: dict[str, int]
    _watch: tuple[Any, float]
    _fresh_at: float
    _admitted: bool
    _root_state: dict[str, Any]
    _stuck: Stuck
    mac: ControlMac | None
    _leases_seen: dict[str, tuple[int, float, bool]]

    def reject(self, e: KVFormatError) -> None:  # SharedBound's
        raise NotImplementedError

    def evict(self, victims: list[tuple[str, int]]) -> None:
        """Victims the index handed out: deleted at once when no other engine could be reading them, else
        doomed (published, deleted once every follower has let go)."""
        if not victims:
            return
        with self._lock:
            h = self.holding
            if h is not None and not h.alone:
                for rel, size in victims:
                    if rel not in h.doomed:
                        h.doomed[rel] = (h.seq + 1, size)  # first published by the next state
                    else:  # handed out again after a re-index: forget the extra doom at once
                        self.index.forget([rel])
                return
        self._delete(victims)

    def put_control(self, rel: str, body: bytes, *, overwrite: bool) -> bool:
        """Write a control record (with its MAC on a sealed root)."""
        return self.store.put(rel, [self.mac.seal(rel, body) if self.mac is not None else body], overwrite=overwrite)

    def open_control(self, rel: str, raw: bytes) -> bytes:
        """A control record's body; on a sealed root ControlRecordError unless its MAC verifies."""
        return self.mac.open(rel, raw) if self.mac is not None else raw

    def _lease_gens(self) -> list[int]:
        entries = [(e, e.relpath.rsplit("/", 1)[-1]) for e in self.store.list_dir(LEASE_DIR)]
        entries = [(e, n) for e, n in entries if len(n) == 12 and n.isdigit()]
        if self.mac is None:
            return [int(n) for _, n in entries]
        # Sealed: a lease counts only if its MAC verifies, else a keyless co-tenant could take the newest
        # generation by creating a name (the evictor would step down, followers wait on nobody). Each file is
        # read once per (size, mtime).
        seen, gens = self._leases_seen, []
        for e, n in entries:
            was = seen.get(n)
            if was is None or was[:2] != (e.size, e.mtime):
                ok = self._lease_body(int(n)) is not None
                seen[n] = was = (e.size, e.mtime, ok)
            if was[2]:
                gens.append(int(n))
        listed = {n for _, n in entries}
        for gone in [n for n in seen if n not in listed]:
            del seen[gone]
        return gens

    def _lease_body(self, gen: int) -> bytes | None:
        rel = f"{LEASE_DIR}/{gen:012d}"
        try:
            raw = self._stuck.call(rel, lambda: read_control(self.store, rel, MAX_LEASE_BYTES), self.ttl_s / 2)
            return self.open_control(rel, raw)
        except ControlRecordError as e:
            self.reject(e.with_path(rel))
            return None
        except (OSError, TimeoutError):
            return None

    def _lease_owner(self, gen: int) -> dict[str, Any] | None:
        body = self._lease_body(gen)
        if body is None:
            return None
        try:
            return parse_lease(body)
        except ControlRecordError as e:
            self.reject(e.with_path(f"{LEASE_DIR}/{gen:012d}"))
            return None

    def _take_over(self, gen: int, state: dict[str, Any] | None) -> None:
        if gen > MAX_GEN:
            # Only a planted lease holds the last generation (10**12 take-overs never happen). Taking over from it
            # would need a generation past the last: remove it and go on from the newest other one, so that a
            # co-tenant cannot end eviction on the root for good.
            self.reject(ControlRecordError("gen", f"a lease at the last generation {MAX_GEN} (removed)",
                                           path=LEASE_DIR))
            try:
                self.store.delete(f"{LEASE_DIR}/{MAX_GEN:012d}")
            except OSError:
                return
            gen = max((g for g in self._lease_gens() if g < MAX_GEN), default=0) + 1
        body = json.dumps({"owner": self.id, "host": host_tag(), "pid": os.getpid()}).encode()
        rel = f"{LEASE_DIR}/{gen:012d}"
        if not self.put_control(rel, body, overwrite=False):
            if self.mac is None or self._lease_body(gen) is not None:
                self._watch = (None, time.monotonic())  # another engine won this generation: watch it instead
                return
            # Sealed, and the name is held by a record without a valid MAC (planted): not a lease. Remove it and
            # take the generation, else a planted name would block every take-over for good.
            try:
                self.store.delete(rel)
            except OSError:
                pass
            if not self.put_control(rel, body, overwrite=False):
                self._watch = (None, time.monotonic())
                return
        was = state.get("owner") if state is not None else None
        self.log.info("this engine is now the evictor of the shared root (lease generation %d%s)", gen,
                      f", after {was}" if was else "")
        try:  # the journal this engine wrote as a follower: a later evictor must not merge its old records
            self.store.delete(self.journal_rel)
        except OSError:
            pass
        rescan = self._scanned()  # the start-up scan still running will list everything; else list again
        with self._lock:
            # Not alone until its first pass has looked: followers of the last evictor may be reading.
            self.holding = h = Holding(gen=gen, alone=False)
            self._pending.clear()  # the evictor indexes its own files directly
            self._unmerged = 0
            self._since_pass = self._reserved
            self._refused = {}
        if rescan:
            # Listed on a thread of its own: a listing longer than ttl_s (a big tree, a slow FUSE or network mount)
            # would hold up the first state, and the followers would take the lease over again. Until it is done,
            # passes publish states that grant nothing and count this engine as not alone.
            # A listing done within ttl_s / 2 is waited for (the first pass then sees the whole root).
            scan = threading.Thread(target=self._takeover_scan, args=(h,), name="kvformat_takeover_scan", daemon=True)
            scan.start()
            scan.join(self.ttl_s / 2)
        else:
            h.scanned = True
        for g in self._lease_gens():  # the older generations are history now
            if g < gen:
                try:
                    self.store.delete(f"{LEASE_DIR}/{g:012d}")
                except OSError:
                    pass
        self._evictor_pass()

    def _takeover_scan(self, h: Holding) -> None:
        try:
            self._rescan()
        except Exception as e:  # the periodic listing recounts the root later; grants must not stay at 0 for good
            self.log.warn("shared:" + type(e).__name__, "listing the shared root after taking it over failed: %s",
                          e)
        h.scanned = True

    def _step_down(self, why: str) -> None:
        h = self.holding
        if h is None:
            return
        self.log.warning("this engine stopped being the evictor of the shared root: %s", why)
        with self._lock:
            self.holding = None
            self._watch = (None, time.monotonic())
            self._fresh_at = -1e18
            self._admitted = False
        self.index.max_bytes = None
        self.index.forget(list(h.doomed))  # not deleted: the new evictor's scan finds them on storage

    def _evictor_pass(self) -> None:
        h = self.holding
        assert h is not None
        gens = self._lease_gens()
        if not gens or max(gens) != h.gen:  # a newer generation was taken, or this one's lease was removed
            self._step_down(f"lease generation {max(gens, default=0)} is the newest, not {h.gen}")
            return
        now = time.monotonic()
        for rel, raw in zip(*self._read_journals()):
            self._merge(h, rel, raw, now)
        live = {i: v for i, v in h.views.items() if not v.gone and now - v.seen_at <= self.ttl_s}
        for i in [i for i, v in h.views.items() if v.gone]:
            del h.views[i]
        for i, v in h.views.items():
            lost = i not in live
            if lost != v.lost:
                v.lost = lost
                if lost:  # its loads are no longer waited for: a miss or a load that finds its file gone
                    self.log.warn(_SILENT, "engine %s has not rewritten its journal for %.1f s: deletions no "
                                  "longer wait for its reads (a stalled or dead engine)", i, now - v.seen_at)
                else:
                    self.log.info("engine %s rewrites its journal again: deletions wait for its reads", i)
        # Delete what every live follower has let go of (this listing was made after each doom was published) and
        # no load of this engine holds: one that passed read_begin just before the doom pins the file after it.
        ready = [(rel, size) for rel, (d, size) in h.doomed.items()
                 if all(v.ack is not None and v.ack[0] == h.gen and v.ack[1] >= d for v in live.values())
                 and not self.index.pinned(rel)]
        if ready:
            with self._lock:
                for rel, _ in ready:
                    del h.doomed[rel]
            self._delete(ready)
        with self._lock:
            h.alone = not live and h.scanned  # alone means exact: only with the whole root indexed
            target = shared_target(self.max_bytes, len(live) + 1, self.allowance)
        # Alone: the store path evicts before each write and deletes at once. Shared: only passes pick victims, by
        # the indexed bytes alone (doomed files free nothing until deleted: counting them would doom again and again).
        self.index.max_bytes = self.max_bytes if h.alone else None
        self.evict(self.index.victims(limit=target))
        scanned = h.scanned and self._scanned()
        with self._lock:
            h.seq += 1
            held = sum(s for _, s in h.doomed.values())
            # Admitted stores are in _reserved until they call wrote(), in the index's reserved until add(): the
            # sum counts a store in flight twice for a moment, never not at all.
            counted = self.index.used + self.index.reserved + self._reserved + held
            exposure = [self._exposure(h, v) for v in live.values()]
            g = grant(self.max_bytes, counted, exposure, self.allowance) if scanned and not h.alone else 0
            h.grants[h.seq] = g
            oldest = min((v.ack[1] for v in live.values() if v.ack is not None and v.ack[0] == h.gen), default=h.seq)
            for seq in [q for q in h.grants if q < oldest]:
                del h.grants[seq]
            # The evictor's own writes since this pass: what is in flight now is in the index's reserved already.
            self._own_grant = g
            self._since_pass = 0
            self._room.notify_all()
            state = {"gen": h.gen, "seq": h.seq, "owner": self.id, "host": host_tag(), "pid": os.getpid(),
                     "max_bytes": self.max_bytes, "target": target, "allowance": g, "used": counted,
                     "files": len(self.index), "engines": {i: v.merged for i, v in h.views.items()},
                     "released": self._closed, "doomed": [[rel, d] for rel, (d, _) in h.doomed.items()]}
            self._root_state = {k: state[k] for k in ("gen", "used", "files", "target", "max_bytes")}
            self._root_state["engines"] = len(live) + 1
        self.put_control(STATE_FILE, json.dumps(state, separators=(",", ":")).encode(), overwrite=True)
        h.last_ok = now

    def _exposure(self, h: Holding, v: View) -> int:
        """The largest grant follower ``v`` may still be writing under: any published since the state it last
        acknowledged (its acknowledgement may be older than what it applied: conservative), or the allowance
        for one that acknowledged none of this evictor's states."""
        if v.ack is None or v.ack[0] != h.gen:
            return self.allowance
        return max((g for seq, g in h.grants.items() if seq >= v.ack[1]), default=self.allowance)

    def _read_journals(self) -> tuple[list[str], list[bytes]]:
        """The followers' journals, each read bounded (size, file type, time): one that is bad or stuck is
        skipped this pass, the others are read."""
        rels = [e.relpath for e in self.store.list_dir(ENGINES_DIR) if e.relpath.endswith(".json")]
        out: tuple[list[str], list[bytes]] = ([], [])
        many = getattr(self.store, "read_many_bytes", None)
        if many is not None and not isinstance(self.store, LocalStore):  # remote: its own timeouts, in parallel
            try:
                got = self._stuck.call(ENGINES_DIR, lambda: many(rels), self.ttl_s / 2)
            except (OSError, TimeoutError) as e:
                self.log.warn(_READ, "reading the followers' journals failed: %s", e)
                return out
            for rel, r in zip(rels, got):
                try:
                    if isinstance(r, (bytes, bytearray)) and len(r) <= MAX_CONTROL_BYTES:
                        out[1].append(self.open_control(rel, bytes(r)))
                        out[0].append(rel)
                    elif isinstance(r, (bytes, bytearray)):
                        raise ControlRecordError("oversized", f"{len(r)} bytes", path=rel)
                except ControlRecordError as e:
                    self.reject(e.with_path(rel))
            return out
        for rel in rels:
            try:
                raw = self._stuck.call(rel, lambda rel=rel: read_control(self.store, rel), self.ttl_s / 2)  # type: ignore[misc]
                raw = self.open_control(rel, raw)
            except ControlRecordError as e:
                self.reject(e.with_path(rel))
                continue
            except (OSError, TimeoutError) as e:
                self.log.warn(_READ, "a follower's journal could not be read: %s: %s", rel, e)
                continue
            out[0].append(rel)
            out[1].append(raw)
        return out

    def _merge(self, h: Holding, rel: str, raw: bytes, now: float) -> None:
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
            self.reject(e.with_path(rel))
            return
        h.journals[rel] = (digest, j.id)
        for bad in j.bad:
            self.reject(bad.with_path(rel))
        if j.id == self.id:
            return
        first = j.id not in h.views
        v = h.views.setdefault(j.id, View(seen_at=now))
        if j.beat != v.beat:
            v.beat, v.seen_at = j.beat, now
        v.ack = j.ack
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
                if not self.index.touch(relpath) and op == "w" and relpath not in absent:
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
            found = self._stuck.call(ENGINES_DIR + ":exists", lambda: self.store.exists_many(rels), self.ttl_s / 2)
        except (OSError, TimeoutError) as e:
            self.log.warn(_READ, "checking the files a journal names failed: %s", e)
            return set()
        return {rel for rel, ok in zip(rels, found) if not ok}

    def _gone(self, h: Holding, rel: str, v: View) -> None:
        v.gone = True
        h.journals.pop(rel, None)
        try:
            self.store.delete(rel)
        except OSError:
            pass
