"""One ``max_bytes`` for a root that several engines share, on any storage (no engine import, no locks).

Every engine on a bounded root runs a :class:`SharedBound`. The root's coordination lives under
``<root>/.kvformat/`` in small objects that need only what every backend has: an atomic whole-object write
(rename; a PUT), an exclusive create (``link``; a conditional PUT ``If-None-Match: *``), reads, deletes and a
listing of one directory. No POSIX lock is used (they do not work over many NFS setups, nor on object stores).

* **One evictor per root.** ``lease/<generation>`` objects are created exclusively: whoever creates generation
  ``g + 1`` is the evictor from then on, and the holder of ``g`` steps down when it sees ``g + 1``. A candidate
  takes over when the evictor's ``state.json`` has not changed for ``ttl_s`` of the candidate's own clock (no
  clock is compared across hosts), at once when the evictor released the root on shutdown, or when its holder is
  provably dead (a process of this kernel boot and PID namespace that no longer runs).
* **Journals.** Every other engine (a *follower*) rewrites ``engines/<engine id>.json`` each tick: a heartbeat,
  its acknowledgement (below) and the records it has not seen merged yet (files it wrote, read, found gone).
* **The evictor** merges the journals into its own LRU index (the root-wide usage view, refreshed incrementally;
  rebuilt by a scan when it takes over), keeps it under ``max_bytes`` and publishes ``state.json``: the usage,
  each engine's merged record number, each follower's write allowance and the files it *doomed* (chose to evict).
* **Writers respect it.** Each state grants every engine a number of bytes it may write (or have in flight) beyond
  what the evictor has counted: a follower, beyond what was merged from its journal; the evictor, since its pass.
  Past its grant a store fails (reason ``bound``) until the evictor catches up. The evictor picks the grant ``g``
  so that ``counted + followers' exposure + N * g <= max_bytes``, where ``counted`` is the indexed bytes, the writes
  in flight and the doomed files not yet deleted, and a follower's exposure is the largest grant it may still be
  using (any grant published since the last state it acknowledged; ``allowance``, the largest grant there is, for
  one that acknowledged no state of this evictor). Dooming moves bytes from indexed to doomed, so it never makes
  room by itself: deletions do, and grants shrink while they are pending. Each pass dooms files until the indexed
  bytes fit ``target = max(max_bytes - N * allowance, max_bytes // 2)``, which leaves the full allowance once
  deletions are through. So the bytes of ``.kvf`` files under the root never exceed ``max_bytes``, whatever the
  number of engines (exceptions: docs/vllm.md, spec/GUARANTEES.md G-8). An engine alone on its root (no live
  follower) evicts before each write and deletes at once, as an unshared tier does.
* **No deletion under a reader.** A doomed file is deleted only after every live follower has acknowledged a state
  that dooms it *and* finished every read it started before: a follower's acknowledgement is the oldest state
  under which one of its reads is still running. Followers refuse to read doomed files, and read nothing while
  their view of the state is older than ``ttl_s / 2`` (a partitioned engine serves misses, it does not race the
  evictor). An engine stalled longer than ``ttl_s`` (SIGSTOP, a hung mount) loses that protection: its read then
  fails as a miss or completes from the open file, never returns wrong bytes (checksums).
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from ..format._paths import CONTROL_DIR
from ..format._write import host_tag
from ..storage import Store
from ._counters import Counters
from ._log import CacheLog
from ._lru import LRUIndex

__all__ = ["ENGINES_DIR", "LEASE_DIR", "STATE_FILE", "SharedBound", "default_allowance", "shared_target"]

ENGINES_DIR = f"{CONTROL_DIR}/engines"
LEASE_DIR = f"{CONTROL_DIR}/lease"
STATE_FILE = f"{CONTROL_DIR}/state.json"
MAX_PENDING = 200_000  # journal records kept for the evictor; past this, read records (recency) are dropped

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
class _View:
    """The evictor's view of one follower."""

    beat: int = -1
    seen_at: float = 0.0  # evictor's monotonic clock when the beat last changed
    merged: int = 0  # last record number merged
    ack: Key | None = None
    gone: bool = False


@dataclass
class _Holding:
    """What the evictor keeps while it holds lease generation ``gen``."""

    gen: int
    seq: int = 0
    views: dict[str, _View] = field(default_factory=dict)
    doomed: dict[str, tuple[int, int]] = field(default_factory=dict)  # relpath -> (state number dooming it, size)
    grants: dict[int, int] = field(default_factory=dict)  # state number -> the grant it published
    alone: bool = True  # no live follower: victims go at once, as on an unshared root
    scanned: bool = False
    last_ok: float = 0.0


class SharedBound:
    """This engine's part in bounding a shared root (see the module docstring). Thread-safe; :meth:`tick` runs on
    one housekeeping thread, every ``interval_s``.

    ``delete(victims)`` removes files for good (the row engine's deletion: storage, counters, events);
    ``rescan()`` rebuilds the index from a listing of the root (the start-up scan), ``scanned()`` says whether the
    start-up scan has finished.
    """

    def __init__(self, store: Store, index: LRUIndex, *, max_bytes: int, allowance: int, log: CacheLog,
                 counters: Counters, delete: Callable[[list[tuple[str, int]]], None], rescan: Callable[[], None],
                 scanned: Callable[[], bool], interval_s: float = 1.0, ttl_s: float | None = None) -> None:
        self.store = store
        self.index = index
        self.max_bytes = max_bytes
        self.allowance = allowance
        self.log = log
        self.counters = counters
        self._delete = delete
        self._rescan = rescan
        self._scanned = scanned
        self.interval_s = interval_s
        self.ttl_s = ttl_s if ttl_s is not None else max(10 * interval_s, 2.0)
        self.id = f"{host_tag()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when a state or a pass may have made room
        self.wait_s = 3 * interval_s
        # -- as a follower
        self._beat = 0
        self._seq = 0
        self._pending: dict[str, list[Any]] = {}  # relpath -> [record number, op, size]; insertion = seq order
        self._unmerged = 0  # bytes of the "w" records in _pending
        self._reserved = 0  # bytes admitted by may_write whose store has not finished
        self._since_pass = 0  # the evictor's: bytes admitted since its last pass began
        self._own_grant = 0  # the evictor's: what its last pass granted itself
        self._merged = 0
        self._admitted = False
        self._grant = 0
        self._applied: Key = (0, 0)
        self._fresh_at = -1e18  # monotonic time of the last full tick (journal written, state read)
        self._refused: dict[str, int] = {}  # doomed in the state applied: never read, never indexed
        self._reads: Counter[Key] = Counter()  # reads running, by the state applied when each began
        self._watch: tuple[Any, float] = (None, 0.0)  # (what the evictor last published, when that was seen)
        self._root_state: dict[str, Any] = {}
        # -- as the evictor
        self.holding: _Holding | None = None
        self._closed = False
        index.max_bytes = None  # a follower never evicts: only the evictor does, for the whole root

    # -- what the row engine asks --------------------------------------------------------------------
    @property
    def is_evictor(self) -> bool:
        return self.holding is not None

    def _fresh(self) -> bool:
        return time.monotonic() - self._fresh_at <= self.ttl_s / 2

    def may_write(self, nbytes: int) -> str | None:
        """Reserve ``nbytes`` for a store about to write: None when it may, else the reason it may not. A store
        past its grant waits up to ``wait_s`` (three ticks) for the evictor's next state before failing: stores
        are off the request path, and the next grant is usually one tick away."""
        deadline = time.monotonic() + self.wait_s
        with self._room:
            while True:
                why = self._admit(nbytes)
                left = deadline - time.monotonic()
                if why is None or left <= 0 or why == "shutdown":
                    return why
                self._room.wait(left)

    def _admit(self, nbytes: int) -> str | None:
        if self._closed:
            return "shutdown"  # the last journal is written: a write now would never be counted
        h = self.holding
        if h is not None:
            if h.alone:
                self._reserved += nbytes
                return None  # the index evicts before the write and deletes at once: exact, as unshared
            if self._since_pass + nbytes > self._own_grant:
                return "bound"
            self._since_pass += nbytes
            self._reserved += nbytes
            return None
        if not self._fresh() or not self._admitted:
            return "coordination"  # no current state from the evictor: nothing may be added blindly
        if self._unmerged + self._reserved + nbytes > self._grant:
            return "bound"
        self._reserved += nbytes
        return None

    def unreserve(self, nbytes: int) -> None:
        """The store reserved with :meth:`may_write` wrote nothing."""
        with self._lock:
            self._reserved = max(0, self._reserved - nbytes)
            if self.holding is not None:
                self._since_pass = max(0, self._since_pass - nbytes)

    def wrote(self, relpath: str, nbytes: int) -> None:
        """The store reserved with :meth:`may_write` published ``relpath`` (``nbytes``)."""
        with self._lock:
            self._reserved = max(0, self._reserved - nbytes)
            if self.holding is None:
                self._record(relpath, "w", nbytes)

    def used(self, relpath: str) -> None:
        """A load or store found ``relpath``: recency for the evictor's LRU order."""
        with self._lock:
            if self.holding is None and relpath not in self._pending:
                self._record(relpath, "r", 0)

    def removed(self, relpath: str) -> None:
        """``relpath`` is gone (found missing, quarantined)."""
        with self._lock:
            if self.holding is None:
                self._record(relpath, "x", 0)

    def _record(self, relpath: str, op: str, nbytes: int) -> None:
        self._seq += 1
        old = self._pending.pop(relpath, None)
        if old is not None and old[1] == "w":
            self._unmerged -= old[2]
            if op == "r":
                op, nbytes = "w", old[2]  # a read after a write: still the write (which is recency too)
        if op == "w":
            self._unmerged += nbytes
        self._pending[relpath] = [self._seq, op, nbytes]
        if len(self._pending) > MAX_PENDING:
            for rel in [r for r, v in self._pending.items() if v[1] == "r"][:len(self._pending) - MAX_PENDING]:
                del self._pending[rel]

    def refused(self, relpath: str) -> bool:
        """Whether ``relpath`` must not be read or indexed now (doomed by the evictor)."""
        h = self.holding
        if h is not None:
            return relpath in h.doomed
        return relpath in self._refused

    def may_read(self, relpath: str) -> bool:
        """Whether a read of ``relpath`` would be allowed now (lock-free, for lookups)."""
        if self.holding is not None:
            return relpath not in self.holding.doomed
        return self._admitted and self._fresh() and relpath not in self._refused

    def read_begin(self, relpath: str) -> Key | None:
        """Call before reading ``relpath``; None means do not (a miss). Pass the token to :meth:`read_end`."""
        with self._lock:
            if self.holding is not None:
                return None if relpath in self.holding.doomed else (-1, 0)
            if not self._fresh() or not self._admitted or relpath in self._refused:
                return None
            key = self._applied
            self._reads[key] += 1
            return key

    def read_end(self, token: Key | None) -> None:
        if token is None or token[0] < 0:
            return
        with self._lock:
            n = self._reads.get(token, 0)
            if n <= 1:
                self._reads.pop(token, None)
            else:
                self._reads[token] = n - 1

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

    def root_view(self) -> dict[str, Any]:
        """What this engine knows of the root: role, engines, usage as the evictor published it (metrics)."""
        with self._lock:
            s = dict(self._root_state)
            h = self.holding
            s["evictor"] = h is not None
            if h is not None:  # the evictor's own count is current, not as of its last pass
                s["used"] = (self.index.used + self.index.reserved + self._reserved
                             + sum(size for _, size in h.doomed.values()))
            return s

    # -- the housekeeping tick -----------------------------------------------------------------------
    def tick(self) -> None:
        """One round: journal + state (follower), or merge + evict + publish (evictor). Storage errors are
        logged (rate-limited) and retried at the next tick."""
        if self._closed:
            return
        try:
            if self.holding is not None:
                self._evictor_pass()
            else:
                self._follower_pass()
        except Exception as e:  # storage errors, or a foreign/garbled control file: the next tick tries again
            self.log.warn("shared:" + type(e).__name__, "coordinating the shared root failed: %s: %s (retried every "
                          "%.1f s; a follower serves misses and stores nothing while it cannot see the evictor's "
                          "state)", type(e).__name__, e, self.interval_s)

    def _journal(self, gone: bool = False) -> bytes:
        with self._lock:
            self._beat += 1
            ack = self._applied
            if self._reads:
                ack = min(ack, min(k for k, n in self._reads.items() if n))
            doc = {"id": self.id, "host": host_tag(), "pid": os.getpid(), "beat": self._beat, "ack": list(ack),
                   "gone": gone, "records": [[v[0], v[1], rel, v[2]] for rel, v in self._pending.items()]}
        return json.dumps(doc, separators=(",", ":")).encode()

    def _follower_pass(self) -> None:
        self.store.put(f"{ENGINES_DIR}/{self.id}.json", [self._journal()], overwrite=True)
        try:
            state = json.loads(self.store.read_bytes(STATE_FILE))
        except FileNotFoundError:
            state = None
        except ValueError:  # a torn or foreign state.json: as if there were none (the evictor rewrites it)
            state = None
        now = time.monotonic()
        if state is not None and int(state.get("gen", 0)) >= self._applied[0]:
            self._apply(state, now)
        self._maybe_take_over(state, now)

    def _apply(self, state: dict[str, Any], now: float) -> None:
        key: Key = (int(state["gen"]), int(state["seq"]))
        doomed = {str(rel): int(d) for rel, d in state.get("doomed", [])}
        new = [rel for rel in doomed if rel not in self._refused]
        with self._lock:
            self._applied = key
            self._fresh_at = now
            self._refused = doomed
            merged = state.get("engines", {}).get(self.id)
            self._admitted = merged is not None
            if merged is not None:
                self._merged = int(merged)
                for rel in [r for r, v in self._pending.items() if v[0] <= self._merged]:
                    del self._pending[rel]
                self._unmerged = sum(v[2] for v in self._pending.values() if v[1] == "w")
            self._grant = int(state.get("allowance", 0))
            self._room.notify_all()
            self._root_state = {k: state.get(k) for k in ("gen", "used", "files", "target", "max_bytes")}
            self._root_state["engines"] = len(state.get("engines", {})) + 1
        for rel in new:  # doomed: no lookup may find it here any more
            self.index.remove(rel)

    def _maybe_take_over(self, state: dict[str, Any] | None, now: float) -> None:
        if state is None:
            gens = self._lease_gens()
            if not gens:
                self._take_over(1, None)
                return
            top = max(gens)
            seen: Any = ("lease", top)
            owner = self._lease_owner(top)
        else:
            top = int(state["gen"])
            seen = (top, int(state["seq"]))
            owner = state
            if state.get("released"):
                self._take_over(top + 1, state)
                return
        if owner is not None and _dead_here(owner):
            self._take_over(top + 1, state)
            return
        if seen != self._watch[0]:
            self._watch = (seen, now)
        elif now - self._watch[1] > self.ttl_s:
            self._take_over(top + 1, state)

    def _lease_gens(self) -> list[int]:
        return [int(e.relpath.rsplit("/", 1)[-1]) for e in self.store.list_dir(LEASE_DIR)
                if e.relpath.rsplit("/", 1)[-1].isdigit()]

    def _lease_owner(self, gen: int) -> dict[str, Any] | None:
        try:
            doc: dict[str, Any] = json.loads(self.store.read_bytes(f"{LEASE_DIR}/{gen:012d}"))
            return doc
        except (OSError, ValueError):
            return None

    def _take_over(self, gen: int, state: dict[str, Any] | None) -> None:
        body = json.dumps({"owner": self.id, "host": host_tag(), "pid": os.getpid()}).encode()
        if not self.store.put(f"{LEASE_DIR}/{gen:012d}", [body], overwrite=False):
            self._watch = (None, time.monotonic())  # another engine won this generation: watch it instead
            return
        was = state.get("owner") if state is not None else None
        self.log.info("this engine is now the evictor of the shared root (lease generation %d%s)", gen,
                      f", after {was}" if was else "")
        rescan = self._scanned()  # the start-up scan still running will list everything; else list again
        with self._lock:
            # Not alone until its first pass has looked: followers of the last evictor may be reading.
            self.holding = h = _Holding(gen=gen, alone=False)
            self._pending.clear()  # the evictor indexes its own files directly
            self._unmerged = 0
            self._since_pass = self._reserved
            self._refused = {}
        if rescan:
            self._rescan()
        h.scanned = True
        for g in self._lease_gens():  # the older generations are history now
            if g < gen:
                try:
                    self.store.delete(f"{LEASE_DIR}/{g:012d}")
                except OSError:
                    pass
        self._evictor_pass()

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
        try:
            self.store.read_bytes(f"{LEASE_DIR}/{h.gen + 1:012d}")
            self._step_down(f"lease generation {h.gen + 1} was taken by another engine")
            return
        except FileNotFoundError:
            pass
        now = time.monotonic()
        entries = [e.relpath for e in self.store.list_dir(ENGINES_DIR) if e.relpath.endswith(".json")]
        docs = self._read_all(entries)
        for rel, doc in zip(entries, docs):
            if doc is None or doc.get("id") == self.id:
                continue
            v = h.views.setdefault(str(doc["id"]), _View(seen_at=now))
            if int(doc["beat"]) != v.beat:
                v.beat, v.seen_at = int(doc["beat"]), now
            ack = doc.get("ack")
            v.ack = (int(ack[0]), int(ack[1])) if ack else None
            for seq, op, relpath, size in doc.get("records", ()):
                if int(seq) <= v.merged:
                    continue
                v.merged = int(seq)
                if op == "w" or op == "r":
                    if relpath in h.doomed:
                        continue
                    if not self.index.touch(relpath) and op == "w":
                        self.index.add_found(relpath, int(size))
                elif op == "x":
                    self.index.remove(relpath)
            if doc.get("gone") or now - v.seen_at > 3 * self.ttl_s:
                v.gone = True
                try:
                    self.store.delete(rel)
                except OSError:
                    pass
        live = {i: v for i, v in h.views.items() if not v.gone and now - v.seen_at <= self.ttl_s}
        for i in [i for i, v in h.views.items() if v.gone]:
            del h.views[i]
        # Delete what every live follower has let go of (this listing was made after each doom was published).
        ready = [(rel, size) for rel, (d, size) in h.doomed.items()
                 if all(v.ack is not None and v.ack[0] == h.gen and v.ack[1] >= d for v in live.values())]
        if ready:
            with self._lock:
                for rel, _ in ready:
                    del h.doomed[rel]
            self._delete(ready)
        with self._lock:
            h.alone = not live
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
        self.store.put(STATE_FILE, [json.dumps(state, separators=(",", ":")).encode()], overwrite=True)
        h.last_ok = now

    def _exposure(self, h: _Holding, v: _View) -> int:
        """The largest grant follower ``v`` may still be writing under: any published since the state it last
        acknowledged (its acknowledgement may be older than what it applied: conservative), or the allowance
        for one that acknowledged none of this evictor's states."""
        if v.ack is None or v.ack[0] != h.gen:
            return self.allowance
        return max((g for seq, g in h.grants.items() if seq >= v.ack[1]), default=self.allowance)

    def _read_all(self, rels: list[str]) -> list[dict[str, Any] | None]:
        many = getattr(self.store, "read_many_bytes", None)
        raw: list[Any] = many(rels) if many is not None else []
        if many is None:
            for rel in rels:
                try:
                    raw.append(self.store.read_bytes(rel))
                except OSError as e:
                    raw.append(e)
        out: list[dict[str, Any] | None] = []
        for r in raw:
            try:
                doc = json.loads(r) if not isinstance(r, BaseException) else None
                out.append(doc if isinstance(doc, dict) and "id" in doc and "beat" in doc else None)
            except ValueError:
                out.append(None)
        return out

    def close(self) -> None:
        """Leave the root: a follower's last journal says it is gone; the evictor publishes a released state
        so that another engine takes over at once. Errors are logged, never raised."""
        if self._closed:
            return
        with self._room:
            self._closed = True
            self._room.notify_all()  # stores waiting for room fail now
        try:
            if self.holding is not None:
                self._evictor_pass()  # publishes released=True: another engine takes over at once
            else:
                self.store.put(f"{ENGINES_DIR}/{self.id}.json", [self._journal(gone=True)], overwrite=True)
        except (OSError, ValueError) as e:
            self.log.warning("leaving the shared root: %s", e)


def _dead_here(owner: dict[str, Any]) -> bool:
    """Whether the engine that wrote ``owner`` ({"host", "pid"}) is a process of this kernel boot and PID
    namespace that no longer runs (then its lease is not waited out)."""
    if owner.get("host") != host_tag():
        return False
    try:
        pid = int(owner.get("pid", 0))
    except (TypeError, ValueError):
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
