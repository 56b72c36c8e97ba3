"""The follower's side of a shared root: what an engine does while another holds the lease. It journals what it
writes and reads, applies the evictor's published state (its grant, the files doomed), refuses reads it may not
make, and watches the evictor so as to take the lease over when it stops (the protocol: :mod:`kvformat.cache.shared`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ...errors import ControlRecordError
from .._log import CacheLog
from .._lru import LRUIndex
from ._control import Control
from ._journal import Records
from ._lease import Leases, dead_here
from ._state import STATE_FILE, Key, parse_state

__all__ = ["Follower", "Ledger"]

_STUCK = "control:read"  # log-once reason of a control read that stalled
_OVERDUE = "shared:read_overdue"  # log-once reason of reads past read_deadline_s


@dataclass
class Ledger:
    """What both roles of one engine count, under one lock (``room`` is notified when a state or a pass may have
    made room for a store)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    room: threading.Condition = field(init=False)
    reserved: int = 0  # bytes admitted by may_write whose store has not finished
    closed: bool = False
    root: dict[str, Any] = field(default_factory=dict)  # the root as last published (or, the evictor's, counted)

    def __post_init__(self) -> None:
        self.room = threading.Condition(self.lock)


class Follower:
    """Engine ``engine_id``'s follower state; methods that end in ``_locked`` and :meth:`admit`, :meth:`record`
    are called with ``ledger.lock`` held."""

    def __init__(self, ledger: Ledger, control: Control, leases: Leases, index: LRUIndex, *, engine_id: str,
                 journal_rel: str, max_bytes: int, ttl_s: float, read_deadline_s: float, log: CacheLog) -> None:
        self.ledger = ledger
        self.control = control
        self.leases = leases
        self.index = index
        self.id = engine_id
        self.journal_rel = journal_rel
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        # A read older than this stops holding back the root's deletions (0: never): one read that never
        # returns (a hung mount) must not stop every deletion on the root, and with them every store.
        self.read_deadline_s = read_deadline_s
        self.log = log
        self.records = Records()
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

    def fresh(self) -> bool:
        return time.monotonic() - self._fresh_at <= self.ttl_s / 2

    def current(self) -> bool:
        return self._admitted and self.fresh()

    def admit(self, nbytes: int) -> str | None:
        if not self.fresh() or not self._admitted:
            return "coordination"  # no current state from the evictor: nothing may be added blindly
        if self.records.unmerged + self.ledger.reserved + nbytes > self._grant:
            return "bound"
        self.ledger.reserved += nbytes
        return None

    def record(self, relpath: str, op: str, nbytes: int, pred: str | None = None) -> None:
        if op == "r" and relpath in self.records.pending:
            return  # already journaled: recency comes with it
        self.records.add(relpath, op, nbytes, pred)

    def refused(self, relpath: str) -> bool:
        return relpath in self._refused

    def may_read(self, relpath: str) -> bool:
        return self._admitted and self.fresh() and relpath not in self._refused

    def read_begin_locked(self, relpath: str) -> int | None:
        if not self.fresh() or not self._admitted or relpath in self._refused:
            return None
        self._read_serial += 1
        self._reads[self._read_serial] = (self._applied, time.monotonic())
        return self._read_serial

    def read_end_locked(self, token: int) -> None:
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

    def journal(self, gone: bool = False) -> bytes:
        """This engine's next journal (``gone``: its last, on leaving the root)."""
        with self.ledger.lock:
            doc = self.records.doc(self.id, os.getpid(), self._ack_locked(), gone, self.ledger.reserved)
        return json.dumps(doc, separators=(",", ":")).encode()

    # -- what the evictor side changes ---------------------------------------------------------------
    def took_lease_locked(self) -> None:
        """This engine took the lease: its records and the doomed files it knew stop mattering."""
        self.records.clear()  # the evictor indexes its own files directly
        self._refused = {}

    def stepped_down_locked(self) -> None:
        """This engine stopped being the evictor: nothing is read or written until a new state is applied."""
        self._watch = (None, time.monotonic())
        self._fresh_at = -1e18
        self._admitted = False

    def rewatch(self) -> None:
        """Another engine won the lease this one tried to take: watch that one instead."""
        self._watch = (None, time.monotonic())

    # -- the follower's tick -------------------------------------------------------------------------
    def tick(self) -> tuple[int, dict[str, Any] | None] | None:
        """Journal, read and apply the state; the lease generation to take over (and the state it follows),
        or None."""
        self.control.put(self.journal_rel, self.journal(), overwrite=True)
        state = self._read_state()
        gens = self.leases.gens()
        if state is not None and (not gens or state["gen"] != max(gens)):
            # Only the holder of the newest lease publishes: a state of any other generation is stale (a lease
            # just taken, or orphaned by a crash: then the lease is watched and taken over after ttl_s) or forged,
            # and applying a forged one would pin this engine to a generation nobody serves.
            if not gens or state["gen"] > max(gens):
                self.control.reject(ControlRecordError("gen", f"state of generation {state['gen']} without its lease",
                                                       path=STATE_FILE))
            state = None
        now = time.monotonic()
        if state is not None:  # backed by the newest lease (above), even if older than one applied before: that
            self._apply(state, now)  # one's lease is gone (a forged or dead generation must not pin this engine)
        return self._take_over_gen(state, gens, now)

    def _read_state(self) -> dict[str, Any] | None:
        try:
            state, bad = parse_state(self.control.read(STATE_FILE))
        except FileNotFoundError:
            return None
        except ControlRecordError as e:  # torn, foreign or planted: as if there were none (the evictor rewrites it)
            self.control.reject(e.with_path(STATE_FILE))
            return None
        except TimeoutError as e:  # a stuck mount: this tick sees no state (stale soon: misses, never a hang)
            self.log.warn(_STUCK, "reading the shared root's state: %s", e)
            return None
        for b in bad:
            self.control.reject(b.with_path(STATE_FILE))
        return state

    def _apply(self, state: dict[str, Any], now: float) -> None:
        key: Key = (state["gen"], state["seq"])
        doomed: dict[str, int] = state["doomed"]
        new = [rel for rel in doomed if rel not in self._refused]
        with self.ledger.room:
            self._applied = key
            self._fresh_at = now
            self._refused = doomed
            merged = state["engines"].get(self.id)
            self._admitted = merged is not None
            if merged is not None:
                self._merged = merged
                self.records.merged(self._merged)
            self._grant = min(state["allowance"], self.max_bytes)  # a forged grant never exceeds the bound
            self.ledger.room.notify_all()
            root = {k: state.get(k) for k in ("gen", "used", "files", "target", "max_bytes")}
            root["engines"] = len(state["engines"]) + 1
            self.ledger.root = root
        for rel in new:  # doomed: no lookup may find it here any more
            self.index.remove(rel)

    def _take_over_gen(self, state: dict[str, Any] | None, gens: list[int],
                       now: float) -> tuple[int, dict[str, Any] | None] | None:
        if state is None:
            if not gens:
                return 1, None
            top = max(gens)
            seen: Any = ("lease", top)
            owner = self.leases.owner(top)
        else:
            top = state["gen"]
            seen = (top, state["seq"])
            owner = state
            if state.get("released"):
                return top + 1, state
        if owner is not None and dead_here(owner):
            return top + 1, state
        if seen != self._watch[0]:
            self._watch = (seen, now)
        elif now - self._watch[1] > self.ttl_s:
            return top + 1, state
        return None
