"""What an operator lives with, for any engine's adapter (no engine import): the start-up checks (parameters
against the chunk size, the root probed), the root-wide bound of a shared root, the root's health while the
cache runs, the start-up scan, one summary line, and the values the adapter reports as metrics.

An adapter builds its row engines, then :class:`RootOps` with them and calls :meth:`RootOps.start` (which raises
:class:`~kvformat.errors.RootUnusableError` or :class:`~kvformat.errors.SchemaError` naming the parameter);
:meth:`RootOps.close` at shutdown. One housekeeping thread runs the shared bound's ticks and the health checks.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..format import format_size
from ..storage import Store, split_root
from ._autocodec import CompressionChoice
from ._config import TierConfig
from ._ghost import GhostSegmentedIndex
from ._health import RootHealth
from ._log import CacheLog
from ._lru import LRUIndex
from ._rows import RowEngine
from ._scan import ScanProgress
from .shared import Bound, ControlMac, SharedBound, default_allowance

__all__ = ["RootOps", "rescan_interval"]

_UNJOURNALED = "rescan:unjournaled"  # the log-once reason of files found by the periodic listing


def rescan_interval(shared_interval_s: float) -> float:
    """Seconds between the evictor's periodic listings of the whole root. Journals tell it what bounded engines
    of this root write; the listing finds what no journal names (a writer under a retired key id or another
    namespace, an unbounded or foreign writer, files copied in), which must count toward the one bound too.
    A listing costs one pass over the tree, so it runs far less often than the shared ticks."""
    return max(60.0 * shared_interval_s, 3.0)


class RootOps:
    """The root-level side of one cache (one adapter instance): see the module docstring."""

    def __init__(self, store: Store, cfg: TierConfig, index: LRUIndex, engines: list[RowEngine], log: CacheLog, *,
                 describe: str = "", compression: CompressionChoice | None = None) -> None:
        self.store = store
        self.cfg = cfg
        self.index = index
        self.engines = engines
        self.log = log
        self.describe = describe
        # The codec stores use and, for "auto", why (the start-up line and the metrics say both).
        self.compression = compression or CompressionChoice(cfg.compression)
        self.stop = threading.Event()
        self.progress = ScanProgress()
        self.health = RootHealth(store, cfg.root, log, start_degraded=cfg.start_degraded)
        self.shared: Bound = engines[0].shared  # unbounded: the engines' stand-in; start() may share a bound
        self.file_bytes = 0
        self.scan = threading.Thread(target=self._scan, name="kvformat_scan", daemon=True)
        self._keeper = threading.Thread(target=self._keep, name="kvformat_keeper", daemon=True)
        self._summary_logged = False
        self._rescanner: threading.Thread | None = None
        self._next_rescan = time.monotonic() + rescan_interval(cfg.shared_interval_s)
        self._scan_lock = threading.Lock()  # one listing at a time: each scan brackets the index's removals

    @property
    def counters(self) -> Any:
        return self.engines[0].counters

    def start(self) -> None:
        """Check the bound against the chunk size, prove the root usable, join the shared root, then start
        the scan and the housekeeping thread. Raises (SchemaError, RootUnusableError) instead of starting
        a cache that would never store anything."""
        self.file_bytes = max(e.file_bytes() for e in self.engines)
        small = self.cfg.check_bound(self.file_bytes)
        if small:
            self.log.warning("%s", small)
        for eng in self.engines:
            eng.log = self.log
            eng.health = self.health
        self.health.startup([e.layout for e in self.engines])
        if self.cfg.max_bytes is not None:
            main = self.engines[0]
            self.shared = SharedBound(
                self.store, self.index, max_bytes=self.cfg.max_bytes, log=self.log, counters=main.counters,
                allowance=self.cfg.shared_allowance or default_allowance(self.cfg.max_bytes, self.file_bytes),
                delete=main.delete_now, rescan=lambda: self._rescan(), scanned=lambda: self.progress.done,
                interval_s=self.cfg.shared_interval_s, read_deadline_s=self.cfg.read_deadline_s,
                # A sealed root's engines all hold the key: their control records are MAC'd under it (issue 31)
                mac=ControlMac.of(main.keys) if main.keys is not None else None)
            for eng in self.engines:
                eng.shared = self.shared
            if self.health.usable:
                self.shared.tick()  # a lone engine is its root's evictor before the first store arrives
        self.log.info("starting on %s (%s): %s; max_bytes=%s%s; %d read + %d write threads, verify=%s, "
                      "compression=%s, o_direct=%s, fsync=%s; root %s; scanning the root in the background",
                      self.store.root, self.backend, self.describe, self._bound(), self._shared_text(),
                      self.cfg.read_threads, self.cfg.write_threads, self.cfg.verify, self.compression.describe(),
                      self.cfg.o_direct, self.cfg.fsync, self.health.state)
        self.scan.start()
        self._keeper.start()

    @property
    def backend(self) -> str:
        return "local" if self.store.is_local else split_root(self.store.root)[0]

    def _bound(self) -> str:
        m = self.cfg.max_bytes
        return "unbounded" if m is None else f"{m} ({format_size(m)}), eviction={self.cfg.eviction}"

    def _shared_text(self) -> str:
        return self.shared.describe()

    def _scan(self) -> None:
        if not self.health.usable:  # a degraded root: scanned once it works (see _keep)
            return
        self.engines[0].scan(self.stop, self.progress)

    def _rescan(self) -> None:
        """The evictor's rescan on taking over (on the housekeeping thread, after the start-up scan ended)."""
        p = ScanProgress()
        with self._scan_lock:
            self.engines[0].scan(self.stop, p)
        self._next_rescan = time.monotonic() + rescan_interval(self.cfg.shared_interval_s)
        self.log.info("rescanned the shared root as its new evictor: %d files (%s) in %.1f s", p.files,
                      format_size(p.bytes), p.seconds)

    def _maybe_rescan(self, now: float) -> None:
        """The evictor lists the root every :func:`rescan_interval`, on a thread of its own (a big tree must not
        hold up the ticks followers wait on), and counts every file found that it did not know of."""
        sb = self.shared
        if (not sb.is_evictor or not self.progress.done or now < self._next_rescan
                or (self._rescanner is not None and self._rescanner.is_alive())):
            return
        self._next_rescan = now + rescan_interval(self.cfg.shared_interval_s)

        def run() -> None:
            p = ScanProgress()
            with self._scan_lock:
                self.engines[0].scan(self.stop, p)
            if p.indexed:
                self.log.warn(_UNJOURNALED, "the periodic listing of the root found %d file(s) no journal "
                              "named (written under another key id or namespace, by an unbounded writer, or "
                              "copied in): counted toward max_bytes now", p.indexed)

        self._rescanner = threading.Thread(target=run, name="kvformat_rescan", daemon=True)
        self._rescanner.start()

    def _keep(self) -> None:
        interval = self.cfg.shared_interval_s
        next_tick = 0.0
        while not self.stop.is_set():
            self.health.wake.wait(max(0.0, next_tick - time.monotonic()))
            if self.stop.is_set():
                return
            self.health.wake.clear()
            was = self.health.state
            try:
                usable = self.health.check()  # also at once after a failed store: a mount that went away
            except Exception as e:  # a bug must not end the thread that watches the root
                self.log.warn("health:" + type(e).__name__, "checking the root failed: %s: %s", type(e).__name__, e)
                usable = self.health.usable
            if usable and was != "ok" and not self.progress.done and not self.scan.is_alive():
                self.scan = threading.Thread(target=self._scan, name="kvformat_scan", daemon=True)
                self.scan.start()  # the root became usable after a degraded start: scan it now
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + interval
                if usable:
                    self.shared.tick()
                    self._maybe_rescan(now)
                self.log.flush()
                if self.progress.done and not self._summary_logged:
                    self._summary_logged = True
                    self.summary()
            else:
                self.stop.wait(0.05)  # woken by failing stores: examine the root at most 20 times a second

    def ready(self) -> bool:
        """Whether the cache serves as it will from now on: root usable, start-up scan done and, on a shared root,
        this engine is the evictor or admitted by it (until then a follower's stores fail and loads miss)."""
        if not (self.health.usable and self.progress.done):
            return False
        return self.shared.is_evictor or self.shared.may_read("")

    def summary(self) -> None:
        """The one start-up summary line (logged when the scan has finished)."""
        p = self.progress
        self.log.info("ready: root %s (%s), %s; max_bytes=%s%s; found %d files (%s) in %.1f s%s; used %s in "
                      "%d files; %d read + %d write threads, verify=%s, compression=%s; root %s",
                      self.store.root, self.backend, self.describe, self._bound(), self._shared_text(), p.files,
                      format_size(p.bytes), p.seconds, f" (listing failed: {p.error})" if p.error else "",
                      format_size(self.index.used), len(self.index), self.cfg.read_threads, self.cfg.write_threads,
                      self.cfg.verify, self.compression.codec + (" (auto)" if self.compression.mode == "auto" else ""),
                      self.health.state)

    def gauges(self) -> dict[str, float]:
        """Point-in-time values for metrics: usage as this engine accounts it, the root's health, the shared
        root's view, the scan's progress, and with ``eviction="ghost-slru"`` the protected share it evicts by."""
        out: dict[str, float] = {"used_bytes": self.index.used, "files": len(self.index),
                                 "root_healthy": int(self.health.usable), "scan_files": self.progress.files,
                                 "scan_done": int(self.progress.done)}
        out.update(self.shared.gauges())
        if isinstance(self.index, GhostSegmentedIndex):
            out["protected_share"] = self.index.share()
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the housekeeping thread; leave the shared root (a released lease, a last journal)."""
        self.stop.set()
        self.health.wake.set()
        if self._keeper.is_alive():
            self._keeper.join(timeout_s)
        if self.health.usable:
            self.shared.close()
