""":class:`SharedBound`, what every engine on a bounded root runs (the protocol: :mod:`kvformat.cache.shared`):
the row engine's questions answered by the role the engine has now, a :class:`Follower` or, while it holds the
lease, its :class:`Evictor`; both count under one :class:`Ledger`."""

from __future__ import annotations

import os
import secrets
import time
from typing import Any, Callable

from ...format import format_size
from ...format import host_tag
from ...storage import Store
from .._counters import Counters
from .._log import CacheLog
from .._lru import LRUIndex
from ._control import Control
from ._evictor import Evictor
from ._follower import Follower, Ledger
from ._journal import ENGINES_DIR
from ._lease import Leases
from ._mac import ControlMac
from ._state import Holding

__all__ = ["SharedBound"]


_LATE, _SLOW = "shared:late_round", "shared:slow_round"  # log reasons (rate-limited each)


class SharedBound:
    """This engine's part in bounding a shared root (see :mod:`kvformat.cache.shared`). Thread-safe; :meth:`tick`
    runs on one housekeeping thread, every ``interval_s``.

    ``delete(victims)`` removes files for good (the row engine's deletion: storage, counters, events);
    ``rescan()`` rebuilds the index from a listing of the root (the start-up scan), ``scanned()`` says whether the
    start-up scan has finished.
    """

    def __init__(self, store: Store, index: LRUIndex, *, max_bytes: int, allowance: int, log: CacheLog,
                 counters: Counters, delete: Callable[[list[tuple[str, int]]], None], rescan: Callable[[], None],
                 scanned: Callable[[], bool], interval_s: float = 1.0, ttl_s: float | None = None,
                 mac: ControlMac | None = None, read_deadline_s: float = 0.0) -> None:
        self.store = store
        self.index = index
        self.max_bytes = max_bytes
        self.allowance = allowance
        self.log = log
        self.counters = counters
        self.interval_s = interval_s
        self.ttl_s = ttl_s if ttl_s is not None else max(10 * interval_s, 2.0)
        self._last_round = time.monotonic()  # the previous tick began (a late one is logged: tick())
        self.id = f"{host_tag()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.journal_rel = f"{ENGINES_DIR}/{self.id}.json"  # written as a follower, deleted on taking the lease
        self.wait_s = 3 * interval_s
        self.ledger = Ledger()
        self.control = Control(store, log, self.ttl_s, mac)
        leases = Leases(self.control, self.id)
        self.follower = Follower(self.ledger, self.control, leases, index, engine_id=self.id,
                                 journal_rel=self.journal_rel, max_bytes=max_bytes, ttl_s=self.ttl_s,
                                 read_deadline_s=read_deadline_s, log=log)
        self.evictor = Evictor(self.ledger, self.control, leases, self.follower, index, max_bytes=max_bytes,
                               allowance=allowance, ttl_s=self.ttl_s, log=log, delete=delete, rescan=rescan,
                               scanned=scanned)
        index.max_bytes = None  # a follower never evicts: only the evictor does, for the whole root

    # -- what the row engine asks --------------------------------------------------------------------
    @property
    def holding(self) -> Holding | None:
        """What this engine keeps as the root's evictor; None while it is a follower."""
        return self.evictor.holding

    @property
    def is_evictor(self) -> bool:
        return self.evictor.holding is not None

    def may_write(self, nbytes: int) -> str | None:
        """Reserve ``nbytes`` for a store about to write: None when it may, else the reason it may not. A store
        past its grant waits up to ``wait_s`` (three ticks) for the evictor's next state before failing: stores
        are off the request path, and the next grant is usually one tick away."""
        deadline = time.monotonic() + self.wait_s
        room = self.ledger.room
        with room:
            while True:
                why = self._admit(nbytes)
                left = deadline - time.monotonic()
                if why is None or left <= 0 or why == "shutdown":
                    return why
                room.wait(left)

    def _admit(self, nbytes: int) -> str | None:
        if self.ledger.closed:
            return "shutdown"  # the last journal is written: a write now would never be counted
        h = self.evictor.holding
        if h is not None:
            return self.evictor.admit(h, nbytes)
        return self.follower.admit(nbytes)

    def unreserve(self, nbytes: int) -> None:
        """The store reserved with :meth:`may_write` wrote nothing."""
        with self.ledger.lock:
            self.ledger.reserved = max(0, self.ledger.reserved - nbytes)
            if self.evictor.holding is not None:
                self.evictor.since_pass = max(0, self.evictor.since_pass - nbytes)

    def wrote(self, relpath: str, nbytes: int, pred: str | None = None) -> None:
        """The store reserved with :meth:`may_write` published ``relpath`` (``nbytes``). ``pred``: the file of the
        chunk before it in the prompt, if known: a prefix-aware evictor index (cache/_prefix.py) learns it, here
        or through this follower's journal, and drops chunks whose predecessor is gone first."""
        link = getattr(self.index, "link", None)
        if pred is not None and link is not None:
            link(relpath, pred)  # this engine's index too: it has them if it takes the lease over
        with self.ledger.lock:
            self.ledger.reserved = max(0, self.ledger.reserved - nbytes)
            if self.evictor.holding is None:
                self.follower.record(relpath, "w", nbytes, pred)
            else:
                self.evictor.wrote_locked(relpath, nbytes, pred)

    def used(self, relpath: str) -> None:
        """A load or store found ``relpath``: recency for the evictor's LRU order."""
        with self.ledger.lock:
            if self.evictor.holding is None:
                self.follower.record(relpath, "r", 0)

    def removed(self, relpath: str) -> None:
        """``relpath`` is gone (found missing, quarantined)."""
        with self.ledger.lock:
            if self.evictor.holding is None:
                self.follower.record(relpath, "x", 0)

    def evict(self, victims: list[tuple[str, int]]) -> None:
        """Victims the index handed out: deleted at once when no other engine could be reading them, else
        doomed (published, deleted once every follower has let go)."""
        self.evictor.evict(victims)

    def refused(self, relpath: str) -> bool:
        """Whether ``relpath`` must not be read or indexed now (doomed by the evictor)."""
        h = self.evictor.holding
        if h is not None:
            return relpath in h.doomed
        return self.follower.refused(relpath)

    def may_read(self, relpath: str) -> bool:
        """Whether a read of ``relpath`` would be allowed now (lock-free, for lookups)."""
        h = self.evictor.holding
        if h is not None:
            return relpath not in h.doomed
        return self.follower.may_read(relpath)

    def view_current(self) -> bool:
        """Whether this engine may read at all now: the evictor, or a follower admitted by a state applied within
        ttl_s/2 (False: every lookup and load is a miss until its coordination round catches up)."""
        if self.evictor.holding is not None:
            return True
        return self.follower.current()

    def read_begin(self, relpath: str) -> int | None:
        """Call before reading ``relpath``; None means do not (a miss). Pass the token to :meth:`read_end`."""
        with self.ledger.lock:
            h = self.evictor.holding
            if h is not None:
                return None if relpath in h.doomed else -1
            return self.follower.read_begin_locked(relpath)

    def read_end(self, token: int | None) -> None:
        if token is None or token < 0:
            return
        with self.ledger.lock:
            self.follower.read_end_locked(token)

    def root_view(self) -> dict[str, Any]:
        """What this engine knows of the root: role, engines, usage as the evictor published it (metrics)."""
        with self.ledger.lock:
            s = dict(self.ledger.root)
            h = self.evictor.holding
            s["evictor"] = h is not None
            s["control_rejected"] = self.control.rejected()
            if h is not None:  # the evictor's own count is current, not as of its last pass
                s["used"] = (self.index.used + self.index.reserved + self.ledger.reserved
                             + sum(size for _, size in h.doomed.values()))
            return s

    def describe(self) -> str:
        """This engine's part, for the start-up and summary log lines."""
        role = "evictor" if self.is_evictor else "follower"
        return f", shared root: {role} (allowance {format_size(self.allowance)} per engine)"

    def gauges(self) -> dict[str, int]:
        """The shared root's values for metrics: role, engines, the root's usage, control records skipped."""
        view = self.root_view()
        return {"evictor": int(bool(view.get("evictor"))), "root_engines": int(view.get("engines") or 1),
                "root_used_bytes": int(view.get("used") or (self.index.used if view.get("evictor") else 0)),
                "control_rejected": sum(view.get("control_rejected", {}).values())}  # issue 31: bad control records

    # -- the housekeeping tick -----------------------------------------------------------------------
    def tick(self) -> None:
        """One round: journal + state (follower), or merge + evict + publish (evictor). Storage errors are
        logged (rate-limited) and retried at the next tick."""
        if self.ledger.closed:
            return
        t0 = time.monotonic()
        gap, self._last_round = t0 - self._last_round, t0
        if gap > self.ttl_s / 2:  # the housekeeping thread was not run (a starved process, a stuck health check)
            self.log.warn(_LATE, "this engine's coordination rounds of the shared root were %.1f s "
                          "apart, over ttl_s/2=%.1f s (interval %.1f s): a starved process or a slow root",
                          gap, self.ttl_s / 2, self.interval_s)
        try:
            if self.evictor.holding is not None:
                self.evictor.tick()
                self._warn_slow(t0, "followers take the lease over from an evictor silent for ttl_s")
            else:
                take = self.follower.tick()
                if take is not None:
                    self.evictor.take_over(*take)
                self._warn_slow(t0, "meanwhile this engine answered misses and refused stores (stale_view_misses)")
        except Exception as e:  # storage errors, or a foreign/garbled control file: the next tick tries again
            self.log.warn("shared:" + type(e).__name__, "coordinating the shared root failed: %s: %s (retried every "
                          "%.1f s; a follower serves misses and stores nothing while it cannot see the evictor's "
                          "state)", type(e).__name__, e, self.interval_s)

    def _warn_slow(self, t0: float, what: str) -> None:
        took = time.monotonic() - t0
        if took > self.ttl_s / 2:
            self.log.warn(_SLOW, "a coordination round of the shared root took %.1f s, over ttl_s/2="
                          "%.1f s (a slow mount or a starved process): %s", took, self.ttl_s / 2, what)

    def close(self) -> None:
        """Leave the root: a follower's last journal says it is gone; the evictor publishes a released state
        so that another engine takes over at once. Errors are logged, never raised."""
        if self.ledger.closed:
            return
        with self.ledger.room:
            self.ledger.closed = True
            self.ledger.room.notify_all()  # stores waiting for room fail now

        def leave() -> None:
            if self.evictor.holding is not None:
                self.evictor.tick()  # publishes released=True: another engine takes over at once
            else:
                self.control.put(self.journal_rel, self.follower.journal(gone=True), overwrite=True)

        try:  # bounded: a stuck mount delays shutdown by ttl_s at most (the lease then times out instead)
            self.control.stuck.call("close", leave, self.ttl_s)
        except (OSError, ValueError, TimeoutError) as e:
            self.log.warning("leaving the shared root: %s", e)
