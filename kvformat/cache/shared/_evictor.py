"""The evictor's side of a shared root: what the engine holding the lease does. It takes the lease, merges the
followers' journals, dooms and deletes, and publishes ``state.json`` (the protocol: :mod:`kvformat.cache.shared`)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from typing import Any, Callable

from ...format import host_tag
from .._log import CacheLog
from .._lru import LRUIndex
from ._control import Control
from ._follower import Follower, Ledger
from ._journal import MAX_PENDING, JournalMerge
from ._lease import Leases
from ._state import STATE_FILE, Holding, View, grant, shared_target

__all__ = ["Evictor"]

_SILENT = "shared:silent"  # the log-once reason of a follower that stopped journaling


class Evictor:
    """The evictor role of one engine: :attr:`holding` is what it keeps while it holds the lease (None while it
    is a follower). ``delete(victims)`` removes files for good; ``rescan()`` rebuilds the index from a listing
    of the root; ``scanned()`` says whether the start-up scan has finished."""

    def __init__(self, ledger: Ledger, control: Control, leases: Leases, follower: Follower, index: LRUIndex, *,
                 max_bytes: int, allowance: int, ttl_s: float, log: CacheLog,
                 delete: Callable[[list[tuple[str, int]]], None], rescan: Callable[[], None],
                 scanned: Callable[[], bool]) -> None:
        self.ledger = ledger
        self.control = control
        self.leases = leases
        self.follower = follower
        self.index = index
        self.max_bytes = max_bytes
        self.allowance = allowance
        self.ttl_s = ttl_s
        self.log = log
        self._delete = delete
        self._rescan = rescan
        self._scanned = scanned
        self.journals = JournalMerge(control, index, follower.id, ttl_s)
        self.holding: Holding | None = None
        self.since_pass = 0  # bytes admitted since its last pass began
        self._own_grant = 0  # what its last pass granted itself
        # Its own writes since the pass before its last (monotonic time, path, bytes, predecessor): journaled if it
        # loses the lease, since a successor's listing may have missed them (_step_down).
        self._recent: deque[tuple[float, str, int, str | None]] = deque(maxlen=MAX_PENDING)

    def wrote_locked(self, relpath: str, nbytes: int, pred: str | None) -> None:
        """A store of this engine published ``relpath`` while it held the lease (``ledger.lock`` held)."""
        self._recent.append((time.monotonic(), relpath, nbytes, pred))

    def admit(self, h: Holding, nbytes: int) -> str | None:
        """Admit a store of this engine while it holds ``h`` (``ledger.lock`` held)."""
        if h.alone:
            self.ledger.reserved += nbytes
            return None  # the index evicts before the write and deletes at once: exact, as unshared
        if self.since_pass + nbytes > self._own_grant:
            return "bound"
        self.since_pass += nbytes
        self.ledger.reserved += nbytes
        return None

    def evict(self, victims: list[tuple[str, int]]) -> None:
        """Victims the index handed out: deleted at once when no other engine could be reading them, else
        doomed (published, deleted once every follower has let go)."""
        if not victims:
            return
        with self.ledger.lock:
            h = self.holding
            if h is not None and not h.alone:
                for rel, size in victims:
                    if rel not in h.doomed:
                        h.doomed[rel] = (h.seq + 1, size)  # first published by the next state
                    else:  # handed out again after a re-index: forget the extra doom at once
                        self.index.forget([rel])
                return
        self._delete(victims)

    def take_over(self, gen: int, state: dict[str, Any] | None) -> None:
        """Take lease generation ``gen`` (after ``state``, the last one applied, if any) and run a first pass."""
        gen, lost = self.leases.claim(gen)
        if lost:
            self.follower.rewatch()
        if not gen:
            return
        was = state.get("owner") if state is not None else None
        self.log.info("this engine is now the evictor of the shared root (lease generation %d%s)", gen,
                      f", after {was}" if was else "")
        try:  # the journal this engine wrote as a follower: a later evictor must not merge its old records
            self.control.store.delete(self.follower.journal_rel)
        except OSError:
            pass
        rescan = self._scanned()  # the start-up scan still running will list everything; else list again
        with self.ledger.lock:
            # Not alone until its first pass has looked: followers of the last evictor may be reading.
            self.holding = h = Holding(gen=gen, alone=False)
            self.follower.took_lease_locked()
            self.since_pass = self.ledger.reserved
            self._own_grant = 0  # a grant of an earlier generation: nothing is granted before this one's first pass
            if was and was != self.follower.id and state is not None and not state.get("released"):
                # The former evictor may be alive (a slow pass lost it the lease) and still be writing under its
                # own last grant; as the evictor it wrote no journal. Counted as a follower that acknowledged
                # nothing (one allowance exposed, deletions waiting on it) until it journals as a follower, or
                # for ttl_s if it never does (dead). Without this the new evictor found no live follower, took
                # itself to be alone and filled the root to max_bytes under the old evictor's last writes.
                h.views[str(was)] = View(seen_at=time.monotonic())
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
        self.leases.drop_older(gen)  # the older generations are history now
        self.tick()

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
        with self.ledger.lock:
            self.holding = None
            self.follower.stepped_down_locked()
            self._own_grant = 0
            # A successor takes the lease ttl_s after this engine's last state and then lists the root: writes that
            # landed since the pass before may be missing from its listing, and as the evictor this engine
            # journaled none. Journaled now as a follower's, they are counted (a file already indexed is only
            # touched). Its stores admitted and still in flight go into its journal's "reserved" (Follower.journal).
            # Without either, a starved TP=1 server that lost the lease in the fleet run at da6c35a left writes
            # nobody counted: the root went 21 files over max_bytes for 26 s.
            for _, rel, size, pred in self._recent:
                self.follower.record(rel, "w", size, pred)
            self._recent.clear()
        self.index.max_bytes = None
        self.index.forget(list(h.doomed))  # not deleted: the new evictor's scan finds them on storage

    def tick(self) -> None:
        """One pass: merge the journals, delete what every follower let go of, doom, grant, publish."""
        h = self.holding
        assert h is not None
        gens = self.leases.gens()
        if not gens or max(gens) != h.gen:  # a newer generation was taken, or this one's lease was removed
            self._step_down(f"lease generation {max(gens, default=0)} is the newest, not {h.gen}")
            return
        now = time.monotonic()
        for rel, raw in zip(*self.journals.read_all()):
            self.journals.merge(h, rel, raw, now)
        live = self._live(h, now)
        # Delete what every live follower has let go of (this listing was made after each doom was published) and
        # no load of this engine holds: one that passed read_begin just before the doom pins the file after it.
        ready = [(rel, size) for rel, (d, size) in h.doomed.items()
                 if all(v.ack is not None and v.ack[0] == h.gen and v.ack[1] >= d for v in live.values())
                 and not self.index.pinned(rel)]
        if ready:
            with self.ledger.lock:
                for rel, _ in ready:
                    del h.doomed[rel]
            self._delete(ready)
        # A follower silent for ttl_s no longer holds deletions back, but its writes admitted before it went silent
        # may still land (a stalled mount): it keeps its exposure, and this engine is not alone, until it is gone
        # (its journal says so, or 3 ttl_s of silence). fleet7: the evictor, alone a second after its follower on
        # FUSE went silent, filled the root to max_bytes and the follower's late writes went 8 chunks over.
        exposed = {i: v for i, v in h.views.items() if not v.gone}  # live or silent: writes may still land
        with self.ledger.lock:
            h.alone = not exposed and h.scanned  # alone means exact: only with the whole root indexed
            target = shared_target(self.max_bytes, len(exposed) + 1, self.allowance)
        # Alone: the store path evicts before each write and deletes at once. Shared: only passes pick victims, by
        # the indexed bytes alone (doomed files free nothing until deleted: counting them would doom again and again).
        self.index.max_bytes = self.max_bytes if h.alone else None
        self.evict(self.index.victims(limit=target))
        state = self._next_state(h, live, exposed, target)
        self.control.put(STATE_FILE, json.dumps(state, separators=(",", ":")).encode(), overwrite=True)
        with self.ledger.lock:  # the pass before this one's state was published: a successor's listing has those
            while self._recent and self._recent[0][0] < h.last_ok:
                self._recent.popleft()
        h.last_ok = now

    def _live(self, h: Holding, now: float) -> dict[str, View]:
        """The followers live now (a journal rewritten within ``ttl_s``); a change either way is logged."""
        live = {i: v for i, v in h.views.items() if not v.gone and now - v.seen_at <= self.ttl_s}
        for i in [i for i, v in h.views.items() if v.gone]:
            del h.views[i]
        for i in [i for i, v in h.views.items() if v.beat < 0 and i not in live]:
            del h.views[i]  # the former evictor never journaled within ttl_s: dead, not waited for any more
            self.log.info("the former evictor %s wrote no journal within %.1f s: deletions no longer wait for it",
                          i, self.ttl_s)
        for i, v in h.views.items():
            lost = i not in live
            if lost != v.lost:
                v.lost = lost
                if lost:  # its loads are no longer waited for: a miss or a load that finds its file gone
                    self.log.warn(_SILENT, "engine %s has not rewritten its journal for %.1f s: deletions no "
                                  "longer wait for its reads (a stalled or dead engine)", i, now - v.seen_at)
                else:
                    self.log.info("engine %s rewrites its journal again: deletions wait for its reads", i)
        return live

    def _next_state(self, h: Holding, live: dict[str, View], exposed: dict[str, View], target: int) -> dict[str, Any]:
        """The next state (taking ``ledger.lock``): the count, the grant, the doomed files."""
        scanned = h.scanned and self._scanned()
        with self.ledger.room:
            h.seq += 1
            held = sum(s for _, s in h.doomed.values())
            # Admitted stores are in reserved until they call wrote(), in the index's reserved until add(): the
            # sum counts a store in flight twice for a moment, never not at all.
            counted = self.index.used + self.index.reserved + self.ledger.reserved + held
            exposure = [self._exposure(h, v) for v in exposed.values()]
            g = grant(self.max_bytes, counted, exposure, self.allowance) if scanned and not h.alone else 0
            h.grants[h.seq] = g
            oldest = min((v.ack[1] for v in live.values() if v.ack is not None and v.ack[0] == h.gen), default=h.seq)
            for seq in [q for q in h.grants if q < oldest]:
                del h.grants[seq]
            # What this engine has admitted and not yet written stays charged against its grant: a successor allows
            # for one grant per former evictor, so writes slow to finish must not pile up one grant per pass.
            self._own_grant = g
            self.since_pass = self.ledger.reserved
            self.ledger.room.notify_all()
            state = {"gen": h.gen, "seq": h.seq, "owner": self.follower.id, "host": host_tag(), "pid": os.getpid(),
                     "max_bytes": self.max_bytes, "target": target, "allowance": g, "used": counted,
                     "files": len(self.index), "engines": {i: v.merged for i, v in h.views.items()},
                     "released": self.ledger.closed, "doomed": [[rel, d] for rel, (d, _) in h.doomed.items()]}
            root = {k: state[k] for k in ("gen", "used", "files", "target", "max_bytes")}
            root["engines"] = len(live) + 1
            self.ledger.root = root
        return state

    def _exposure(self, h: Holding, v: View) -> int:
        """The largest grant follower ``v`` may still be writing under: any published since the state it last
        acknowledged (its acknowledgement may be older than what it applied: conservative), or the allowance
        for one that acknowledged none of this evictor's states; and at least what its journal says it admitted
        and has not written (a former evictor's stores admitted under its own grant), up to the allowance (the
        most any engine is granted: a journal claiming more holds back no more than one that acknowledges
        nothing)."""
        if v.ack is None or v.ack[0] != h.gen:
            return self.allowance
        granted = max((g for seq, g in h.grants.items() if seq >= v.ack[1]), default=self.allowance)
        return max(granted, min(v.reserved, self.allowance))
