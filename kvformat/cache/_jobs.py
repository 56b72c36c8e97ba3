"""The tier's store/load jobs: per-key results collected into one finished job, the keys that failed to
load, counter deltas, and the bounded shutdown. No vLLM import: the adapter passes in vLLM's job-result
type, its key -> (engine, block hash) mapping, and the hooks that feed vLLM's lookups and events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ._ghost import GhostSegmentedIndex
from ._lru import LRUIndex
from ._pool import DualPool, TaskPair
from ._counters import COUNTERS, Counters, failure_reason
from ._rows import CANCELLED, EXISTS, FAILED, REPLICA_MISMATCH, WRITTEN, RowEngine

Target = Callable[[Any], "tuple[RowEngine | None, str | None]"]


class Job:
    __slots__ = ("job_id", "keys", "is_load", "remaining", "results", "nbytes", "t0", "lock", "req_context")

    def __init__(self, job_id: Any, keys: list[Any], is_load: bool, req_context: Any = None) -> None:
        self.job_id = job_id
        self.req_context = req_context
        self.keys = keys
        self.is_load = is_load
        self.remaining = len(keys)
        self.results: list[Any] = [None] * len(keys)
        self.nbytes = 0
        self.t0 = time.monotonic()
        self.lock = threading.Lock()


@dataclass(eq=False)
class JobBook:
    """Runs jobs on the pool and queues their results (``make_result(job_id, success, successful_keys=…,
    transfer_time=…, transfer_bytes=…)``) for :meth:`take_finished`.

    ``on_stored(job, keys)`` (None: no events) sees the keys of a store job now on storage;
    ``mark_miss(keys)`` the keys a load failed on. A failed load is a miss for its own request only (vLLM's
    tiers override just that request's cached verdict): its keys stay in :attr:`failed` under the request's id
    until the request ends (:meth:`forget_request`) or they are stored again. A cause that concerns every
    request (a corrupt file) is the engine's to act on: it quarantines the file, a miss for all.
    Jobs without a request (vLLM 0.33's TransferJob has no req_context) file under ``None``: a miss for every
    request until the key is stored again, as before.
    """

    pool: DualPool
    target: Target
    warn: Callable[..., None]
    make_result: Callable[..., Any]
    on_stored: Callable[[Job, list[Any]], None] | None
    mark_miss: Callable[[list[Any]], None]
    # A load not done this long after it was submitted is reported a miss (0: never). ``stop`` ends the watch.
    deadline_s: float = 0.0
    stop: threading.Event | None = None
    spare_readers: int = 8
    _jobs_finished: list[Any] = field(default_factory=list, init=False)
    _store_outcomes: list[list[tuple[Any, Any]]] = field(default_factory=list, init=False)
    _finished_lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _load_keys: dict[Any, tuple[list[Any], Any]] = field(default_factory=dict, init=False)
    failed: dict[Any, set[Any]] = field(default_factory=dict, init=False)  # request id (or None) -> keys
    # load tasks under the deadline: serial -> (deadline, job, index, state cell, engine)
    _watched: dict[int, tuple[float, Job, int, list[str], Any]] = field(default_factory=dict, init=False)
    _watch_lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _watcher: threading.Thread | None = field(default=None, init=False)
    _serial: int = field(default=0, init=False)

    def submit(self, job_id: Any, keys: list[Any], chunk_ids: Iterable[Any], *, load: bool,
               req_context: Any = None, targets: list[tuple[RowEngine | None, str | None]] | None = None) -> None:
        """Queue one job; ``targets`` (one ``(engine, file hash)`` per key) replaces :attr:`target` for it,
        for adapters whose key -> file mapping depends on the request (the token-chain key scheme)."""
        job = Job(job_id, keys, is_load=load, req_context=req_context)
        if load:
            self._load_keys[job.job_id] = (keys, getattr(req_context, "req_id", None))
        if not keys:
            with self._finished_lock:
                self._jobs_finished.append(self.make_result(job.job_id, True, transfer_time=0.0, transfer_bytes=0))
            return
        task = self._load_task if load else self._store_task
        where = targets if targets is not None else [self.target(k) for k in keys]
        self.pool.submit([task(job, i, k, int(c), t) for i, (k, c, t) in enumerate(zip(keys, chunk_ids, where))],
                         load=load)

    def finish(self, job: Job, i: int, result: Any, nbytes: int) -> None:
        with job.lock:
            job.results[i] = result
            job.nbytes += nbytes
            job.remaining -= 1
            if job.remaining:
                return
        if job.is_load:
            ok = [k for k, r in zip(job.keys, job.results) if r is not None]
            success = len(ok) == len(job.keys)
            res = self.make_result(job.job_id, success, successful_keys=None if success else tuple(ok),
                                    transfer_time=time.monotonic() - job.t0, transfer_bytes=job.nbytes)
        else:
            # Success means every chunk is on storage now. FAILED, REPLICA_MISMATCH, an error, a cancelled
            # task or a key of another group stored nothing: vLLM then counts a failed store (its
            # back-pressure detector may pause stores to this tier), and the primary copy is released
            # exactly as after a success, so nothing else changes for the chunk.
            success = all(r in (WRITTEN, EXISTS) for r in job.results)
            res = self.make_result(job.job_id, success, transfer_time=time.monotonic() - job.t0,
                                    transfer_bytes=job.nbytes)
            if self.on_stored is not None:
                stored = [k for k, r in zip(job.keys, job.results) if r in (WRITTEN, EXISTS)]
                if stored:
                    self.on_stored(job, stored)
        with self._finished_lock:
            self._jobs_finished.append(res)
            if not job.is_load:
                self._store_outcomes.append(list(zip(job.keys, job.results)))

    def _store_task(self, job: Job, i: int, key: Any, cid: int,
                    target: tuple[RowEngine | None, str | None]) -> TaskPair:
        eng, h = target

        def run() -> None:
            outcome, n = "skipped", 0
            try:
                if eng is not None and h is not None:
                    outcome, n = eng.store_chunk(h, cid)
                    if outcome in (FAILED, REPLICA_MISMATCH):  # refusals (REFUSED) count themselves, by reason
                        eng.store_failed("contended" if outcome == FAILED else REPLICA_MISMATCH)
            except Exception as e:  # OSError (ENOSPC …) or a bug: this chunk is not stored, the job fails
                outcome = "error"
                reason = failure_reason(e)
                if eng is not None:
                    eng.store_failed(reason)
                self.warn(f"store:{reason}", "storing a chunk failed: %s (counted in store_failures{reason=\"%s\"})",
                          e, reason)
            self.finish(job, i, outcome, n)

        def fail() -> None:  # never ran (tier shut down): not stored
            if eng is not None:
                eng.store_failed("shutdown")
            self.finish(job, i, CANCELLED, 0)
        return run, fail

    def _load_task(self, job: Job, i: int, key: Any, cid: int,
                   target: tuple[RowEngine | None, str | None]) -> TaskPair:
        eng, h = target
        # queued -> running -> committed (writing the row: past the point of giving up) -> done; or abandoned
        state = ["queued"]
        serial = self._watch(job, i, state, eng) if self.deadline_s > 0 else None

        def claim() -> bool:
            with job.lock:
                if state[0] == "abandoned":
                    return False
                state[0] = "committed"
                return True

        def settle(got: int | None) -> None:
            with job.lock:
                if state[0] == "abandoned":  # the watch reported it a miss already
                    return
                state[0] = "done"
            if serial is not None:
                with self._watch_lock:
                    self._watched.pop(serial, None)
            self.finish(job, i, got, got or 0)

        def run() -> None:
            with job.lock:
                if state[0] == "abandoned":
                    return
                state[0] = "running"
            got = None
            try:
                if eng is not None and h is not None:
                    got = eng.load_chunk(h, cid, claim=claim if serial is not None else None)
            except Exception as e:
                self.warn(f"load:{type(e).__name__}", "loading a chunk failed: %s", e)
            settle(got)

        def fail() -> None:  # never ran (tier shut down): a miss
            settle(None)
        return run, fail

    # -- the load deadline -----------------------------------------------------------------------------
    def _watch(self, job: Job, i: int, state: list[str], eng: Any) -> int:
        with self._watch_lock:
            self._serial += 1
            self._watched[self._serial] = (job.t0 + self.deadline_s, job, i, state, eng)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch_loop, name="kvformat_load_deadline", daemon=True)
                self._watcher.start()
            return self._serial

    def _watch_loop(self) -> None:
        period = min(1.0, max(0.01, self.deadline_s / 4))
        stop = self.stop or threading.Event()  # no stop event: the watch lasts the process (a daemon thread)
        while not stop.wait(period):
            self.give_up_overdue()

    def give_up_overdue(self) -> int:
        """Report every load past its deadline a miss, if it can still be given up on: one not started, or one
        whose read goes to a private buffer (isolated reads). Returns how many were given up on."""
        now = time.monotonic()
        with self._watch_lock:
            due = [(s, e) for s, e in self._watched.items() if e[0] <= now]
        n = 0
        for serial, (_, job, i, state, eng) in due:
            isolated = bool(getattr(eng, "isolated_reads", False))
            with job.lock:
                give_up = state[0] == "queued" or (state[0] == "running" and isolated)
                if give_up:
                    was, state[0] = state[0], "abandoned"
            if not give_up:
                continue
            with self._watch_lock:
                self._watched.pop(serial, None)
            n += 1
            if eng is not None:
                eng.counters.add(load_deadline_misses=1)
            self.warn("load:deadline", "a load was not done %.1f s after it was asked for (%s; a hung mount or a "
                      "stalled server?): served as a miss (counted in load_deadline_misses)", self.deadline_s,
                      "its read still runs and its bytes will be dropped" if was == "running" else "not started")
            if was == "running":
                self.pool.add_reader(self.spare_readers)  # the stuck thread may never come back
            self.finish(job, i, None, 0)
        return n

    def take_finished(self) -> list[Any]:
        with self._finished_lock:
            done, self._jobs_finished = self._jobs_finished, []
            outcomes, self._store_outcomes = self._store_outcomes, []
        for results in outcomes:
            for k, r in results:
                # EXISTS counts too: after a transient failure (storage briefly unreachable) the re-store
                # finds the file still there, and the key must become loadable again.
                if r in (WRITTEN, EXISTS):
                    for keys_failed in self.failed.values():
                        keys_failed.discard(k)
        for res in done:
            entry = self._load_keys.pop(res.job_id, None)
            if entry is not None and not res.success:
                keys, req_id = entry
                ok = set(res.successful_keys or ())
                failed = [k for k in keys if k not in ok]
                if sum(len(v) for v in self.failed.values()) > 1_000_000:
                    self.failed.clear()
                self.failed.setdefault(req_id, set()).update(failed)
                self.mark_miss(failed)
        return done

    def failed_for(self, key: Any, req_id: Any) -> bool:
        """Whether a load of ``key`` failed for request ``req_id`` (or for a job of no known request)."""
        return key in self.failed.get(req_id, ()) or key in self.failed.get(None, ())

    def forget_request(self, req_id: Any) -> None:
        """The request ended: its failed loads no longer decide anything."""
        self.failed.pop(req_id, None)


class CounterReport:
    """The engines' counters as totals, or as the increases since the previous :meth:`deltas`."""

    def __init__(self, counters: Counters, index: LRUIndex) -> None:
        self._counters = counters
        self._index = index
        self._reported: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._reported_reasons: tuple[dict[str, int], dict[str, int]] = ({}, {})

    def deltas(self) -> dict[str, int]:
        values, _ = self._counters.snapshot()
        out = {k: v - self._reported.get(k, 0) for k, v in values.items()}
        self._reported = values
        return {k: d for k, d in out.items() if d}

    def reason_deltas(self) -> tuple[dict[str, int], dict[str, int]]:
        """Increases since the previous call: (quarantined files by reason, failed stores by reason)."""
        now = self._counters.by_reason()
        out = tuple({r: n - old.get(r, 0) for r, n in cur.items() if n - old.get(r, 0)}
                    for cur, old in zip(now, self._reported_reasons))
        self._reported_reasons = now
        return out[0], out[1]

    def totals(self) -> dict[str, float]:
        counts, quarantined = self._counters.snapshot()
        values: dict[str, float] = dict(counts)
        values.update({f"quarantined:{r}": n for r, n in quarantined.items()})
        values.update({f"store_failures:{r}": n for r, n in self._counters.by_reason()[1].items()})
        values["used_bytes"] = self._index.used
        values["files"] = len(self._index)
        if isinstance(self._index, GhostSegmentedIndex):
            values["protected_share"] = self._index.share()
        return values


def shutdown_bounded(timeout_s: float, stop: threading.Event, engines: Iterable[RowEngine], pool: DualPool,
                     scan: threading.Thread, stop_lookups: Callable[[], None], flat: memoryview) -> bool:
    """Stop the tier's threads within ``timeout_s``; release ``flat`` (and the engines' views of it) only
    when none of them can touch it any more. False when it gave up waiting (``flat`` is then left alone)."""
    deadline = time.monotonic() + timeout_s
    stop.set()

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    engines = list(engines)
    for eng in engines:  # pending mtime touches are dropped: they only refine a restart's order
        eng.toucher.close(0)
    idle = pool.shutdown(timeout=left())
    scan.join(left())
    lookups = threading.Thread(target=stop_lookups, name="kvformat_tier_lookups_stop", daemon=True)
    lookups.start()
    lookups.join(left())
    if not (idle and not scan.is_alive() and not lookups.is_alive()):
        return False
    for eng in engines:
        eng.close()
    flat.release()
    return True
