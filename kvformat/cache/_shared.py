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
  its acknowledgement (below) and the records it has not seen merged yet (files it wrote, read, found gone). An
  engine deletes its journal when it takes the lease; a journal merged for the first time may be old (a dead
  engine's), so the writes it names are indexed only if their files are still there.
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
from typing import Any, Callable

from ..errors import ControlRecordError, KVFormatError
from ..format import host_tag
from ..storage import Store
from ._counters import Counters
from ._log import CacheLog
from ._lru import LRUIndex
from ._shared_check import Stuck, parse_state, read_control
from ._shared_evictor import EvictorRole
from ._shared_mac import ControlMac
from ._shared_grants import (ENGINES_DIR, LEASE_DIR, MAX_PENDING, STATE_FILE, Holding, Key, dead_here,
                             default_allowance, grant, shared_target)

_STUCK = "control:read"  # log-once reason of a control read that stalled
_OVERDUE = "shared:read_overdue"  # log-once reason of reads past read_deadline_s

__all__ = ["ENGINES_DIR", "LEASE_DIR", "STATE_FILE", "SharedBound", "default_allowance", "grant", "shared_target"]


class SharedBound(EvictorRole):
    """This engine's part in bounding a shared root (see the module docstring). Thread-safe; :meth:`tick` runs on
    one housekeeping thread, every ``interval_s``.

    ``delete(victims)`` removes files for good (the row engine's deletion: storage, counters, events);
    ``rescan()`` rebuilds the index from a listing of the root (the start-up scan), ``scanned()`` says whether the
    start-up scan has finished.
    """

    def __init__(self, store: Store, index: LRUIndex, *, max_bytes: int, allowance: int, log: CacheLog,
                 counters: Counters, delete: Callable[[list[tuple[str, int]]], None], rescan: Callable[[], None],
                 scanned: Callable[[], bool], interval_s: float = 1.0, ttl_s: float | None = None,
                 mac: ControlMac | None = None, read_deadline_s: float = 0.0) -> None:
        self.store = store
        self.mac = mac  # a sealed root: every control record written is MAC'd, every one read must verify
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
        self.journal_rel = f"{ENGINES_DIR}/{self.id}.json"  # written as a follower, deleted on taking the lease
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when a state or a pass may have made room
        self.wait_s = 3 * interval_s
        # A read older than this stops holding back the root's deletions (0: never): one read that never
        # returns (a hung mount) must not stop every deletion on the root, and with them every store.
        self.read_deadline_s = read_deadline_s
        # -- as a follower
        self._beat = 0
        self._seq = 0
        # relpath -> [record number, op, size, predecessor or None]; insertion = seq order
        self._pending: dict[str, list[Any]] = {}
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
        # reads running: token -> (the state applied when it began, its monotonic start time)
        self._reads: dict[int, tuple[Key, float]] = {}
        self._read_serial = 0
        self._overdue: set[int] = set()  # reads past read_deadline_s already logged
        self._watch: tuple[Any, float] = (None, 0.0)  # (what the evictor last published, when that was seen)
        self._root_state: dict[str, Any] = {}
        # -- as the evictor
        self.holding: Holding | None = None
        self._closed = False
        self.rejected: Counter[str] = Counter()  # control records skipped, by ControlRecordError.why
        self._stuck = Stuck()  # control reads given up on (a hung mount): each degrades only itself
        self._leases_seen: dict[str, tuple[int, float, bool]] = {}  # sealed: lease name -> (size, mtime, MAC ok)
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

    def wrote(self, relpath: str, nbytes: int, pred: str | None = None) -> None:
        """The store reserved with :meth:`may_write` published ``relpath`` (``nbytes``). ``pred``: the file of the
        chunk before it in the prompt, if known: a prefix-aware evictor index (cache/_prefix.py) learns it, here
        or through this follower's journal, and drops chunks whose predecessor is gone first."""
        link = getattr(self.index, "link", None)
        if pred is not None and link is not None:
            link(relpath, pred)  # this engine's index too: it has them if it takes the lease over
        with self._lock:
            self._reserved = max(0, self._reserved - nbytes)
            if self.holding is None:
                self._record(relpath, "w", nbytes, pred)

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

    def _record(self, relpath: str, op: str, nbytes: int, pred: str | None = None) -> None:
        self._seq += 1
        old = self._pending.pop(relpath, None)
        if old is not None and old[1] == "w":
            self._unmerged -= old[2]
            if op == "r":
                op, nbytes, pred = "w", old[2], old[3]  # a read after a write: still the write (recency too)
        if op == "w":
            self._unmerged += nbytes
        self._pending[relpath] = [self._seq, op, nbytes, pred]
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

    def read_begin(self, relpath: str) -> int | None:
        """Call before reading ``relpath``; None means do not (a miss). Pass the token to :meth:`read_end`."""
        with self._lock:
            if self.holding is not None:
                return None if relpath in self.holding.doomed else -1
            if not self._fresh() or not self._admitted or relpath in self._refused:
                return None
            self._read_serial += 1
            self._reads[self._read_serial] = (self._applied, time.monotonic())
            return self._read_serial

    def read_end(self, token: int | None) -> None:
        if token is None or token < 0:
            return
        with self._lock:
            self._reads.pop(token, None)
            self._overdue.discard(token)

    def _ack_locked(self) -> Key:
        """The oldest state a read of this engine still runs under; reads past ``read_deadline_s`` excluded."""
        ack = self._applied
        now = time.monotonic()
        late = []
        for token, (key, t0) in self._reads.items():
            if self.read_deadline_s > 0 and now - t0 > self.read_deadline_s:
                if token not in self._overdue:
                    late.append(token)
                continue
            ack = min(ack, key)
        if late:
            self._overdue.update(late)
            self.log.warn(_OVERDUE, "%d read(s) of this engine have run longer than read_deadline_s="
                          "%gs (a hung mount?): they no longer hold back the root's deletions; such a read can only "
                          "end as a miss, never with wrong bytes", len(late), self.read_deadline_s)
        return ack

    def root_view(self) -> dict[str, Any]:
        """What this engine knows of the root: role, engines, usage as the evictor published it (metrics)."""
        with self._lock:
            s = dict(self._root_state)
            h = self.holding
            s["evictor"] = h is not None
            s["control_rejected"] = dict(self.rejected)
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
            ack = self._ack_locked()
            doc = {"id": self.id, "host": host_tag(), "pid": os.getpid(), "beat": self._beat, "ack": list(ack),
                   "gone": gone, "records": [[v[0], v[1], rel, v[2]] + ([{"pred": v[3]}] if v[3] else [])
                                             for rel, v in self._pending.items()]}
        return json.dumps(doc, separators=(",", ":")).encode()

    def _follower_pass(self) -> None:
        self.put_control(self.journal_rel, self._journal(), overwrite=True)
        state = self._read_state()
        gens = self._lease_gens()
        if state is not None and (not gens or state["gen"] != max(gens)):
            # Only the holder of the newest lease publishes: a state of any other generation is stale (a lease
            # just taken, or orphaned by a crash: then the lease is watched and taken over after ttl_s) or forged,
            # and applying a forged one would pin this engine to a generation nobody serves.
            if not gens or state["gen"] > max(gens):
                self.reject(ControlRecordError("gen", f"state of generation {state['gen']} without its lease",
                                               path=STATE_FILE))
            state = None
        now = time.monotonic()
        if state is not None:  # backed by the newest lease (above), even if older than one applied before: that
            self._apply(state, now)  # one's lease is gone (a forged or dead generation must not pin this engine)
        self._maybe_take_over(state, gens, now)

    def _read_state(self) -> dict[str, Any] | None:
        try:
            raw = self._stuck.call(STATE_FILE, lambda: read_control(self.store, STATE_FILE), self.ttl_s / 2)
            state, bad = parse_state(self.open_control(STATE_FILE, raw))
        except FileNotFoundError:
            return None
        except ControlRecordError as e:  # torn, foreign or planted: as if there were none (the evictor rewrites it)
            self.reject(e.with_path(STATE_FILE))
            return None
        except TimeoutError as e:  # a stuck mount: this tick sees no state (stale soon: misses, never a hang)
            self.log.warn(_STUCK, "reading the shared root's state: %s", e)
            return None
        for b in bad:
            self.reject(b.with_path(STATE_FILE))
        return state

    def reject(self, e: KVFormatError) -> None:
        """Count and log (once per reason and interval) a control record skipped."""
        why = getattr(e, "why", type(e).__name__)
        with self._lock:
            self.rejected[why] += 1
        self.log.warn("control:" + why, "skipped a record of the shared root's coordination: %s (counted in "
                      "root_view()['control_rejected']; other records and engines go on)", e)

    def _apply(self, state: dict[str, Any], now: float) -> None:
        key: Key = (state["gen"], state["seq"])
        doomed: dict[str, int] = state["doomed"]
        new = [rel for rel in doomed if rel not in self._refused]
        with self._lock:
            self._applied = key
            self._fresh_at = now
            self._refused = doomed
            merged = state["engines"].get(self.id)
            self._admitted = merged is not None
            if merged is not None:
                self._merged = merged
                for rel in [r for r, v in self._pending.items() if v[0] <= self._merged]:
                    del self._pending[rel]
                self._unmerged = sum(v[2] for v in self._pending.values() if v[1] == "w")
            self._grant = min(state["allowance"], self.max_bytes)  # a forged grant never exceeds the bound
            self._room.notify_all()
            self._root_state = {k: state.get(k) for k in ("gen", "used", "files", "target", "max_bytes")}
            self._root_state["engines"] = len(state["engines"]) + 1
        for rel in new:  # doomed: no lookup may find it here any more
            self.index.remove(rel)

    def _maybe_take_over(self, state: dict[str, Any] | None, gens: list[int], now: float) -> None:
        if state is None:
            if not gens:
                self._take_over(1, None)
                return
            top = max(gens)
            seen: Any = ("lease", top)
            owner = self._lease_owner(top)
        else:
            top = state["gen"]
            seen = (top, state["seq"])
            owner = state
            if state.get("released"):
                self._take_over(top + 1, state)
                return
        if owner is not None and dead_here(owner):
            self._take_over(top + 1, state)
            return
        if seen != self._watch[0]:
            self._watch = (seen, now)
        elif now - self._watch[1] > self.ttl_s:
            self._take_over(top + 1, state)

    def close(self) -> None:
        """Leave the root: a follower's last journal says it is gone; the evictor publishes a released state
        so that another engine takes over at once. Errors are logged, never raised."""
        if self._closed:
            return
        with self._room:
            self._closed = True
            self._room.notify_all()  # stores waiting for room fail now

        def leave() -> None:
            if self.holding is not None:
                self._evictor_pass()  # publishes released=True: another engine takes over at once
            else:
                self.put_control(self.journal_rel, self._journal(gone=True), overwrite=True)

        try:  # bounded: a stuck mount delays shutdown by ttl_s at most (the lease then times out instead)
            self._stuck.call("close", leave, self.ttl_s)
        except (OSError, ValueError, TimeoutError) as e:
            self.log.warning("leaving the shared root: %s", e)
