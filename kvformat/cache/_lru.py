"""The tier's view of what is stored: an LRU of files with sizes, a pin set, and capacity accounting.

Thread-safe (one lock). Sizes are file bytes (header + data), the unit ``max_bytes`` bounds.

Cost: every operation is O(1) except ``reserve``/``victims`` and an ``add`` over the bound
(O(victims + pinned files skipped) and O(log n) per file found by the start-up scan) and
``lru_order`` (O(n log n), for tests and tools).
The index never copies its keys on a store: at a million files the old copy-everything ``reserve``
held the lock for ~260 ms per store, and every load waited behind it.

Exactness under races (each one has a test in tests/test_index.py):

* A victim handed out by ``reserve``/``victims`` is *doomed* until the caller reports it deleted
  (``forget``). A file found on storage (a load, a probe, a store that found the file there) is
  indexed with ``add_found`` under a pin taken *before* the read; it is refused when the file was
  doomed or removed since the pin, so a load racing an eviction never re-adds a file that is
  about to disappear (a ghost entry). ``pin`` returns a token (an event number) that dates the
  read, so a change recorded before one reader's pin never counts against a later reader.
* A file a store has just published is indexed by that store (``add``) and by nobody else: from
  ``reserve(…, relpath)`` to ``add``/``release`` the file is *being written*, and ``add_found``
  and the scan leave it alone. Otherwise another thread could index the new file, an eviction
  could delete it, and the store's ``add`` would then index a file that is gone (a ghost).
* A read that found no file removes the entry only if no store indexed a new file since the
  read's pin (``remove(…, since=token)``): the read may predate that file, and dropping its entry
  would leave a file on storage that the index does not count.
* Evictions and removals made while the start-up scan runs are remembered until the scan ends, so
  a listing made before the deletion does not bring the file back.
* The scan feeds files in batches (``scan_add``) and the caller evicts after each batch, so the
  bound holds over every file the tier knows from the first store on. The exact slack: files the
  scan has not listed yet are unknown, so storage may hold ``max_bytes`` plus the bytes of the
  files still to be listed (zero once the scan ends), plus pinned files the bound could not evict
  (see ``reserve``), plus files of concurrent writes that found nothing indexed to evict when they
  reserved, plus victims handed out and not yet deleted. The slack ends with its cause: ``add`` and
  the last ``unpin`` of a file report an index over the bound, and the caller evicts then.
* A victim whose delete failed (EPERM, EACCES, a timeout) is still on storage: ``keep`` counts it
  again and marks it *stuck*. The bound then evicts other files first and hands a stuck file out
  again only when nothing else can make room, so the index never says less than storage holds; if
  only stuck and pinned files are left, storage exceeds the bound by exactly the stuck files.
"""

from __future__ import annotations

import heapq
import threading
from collections import Counter, OrderedDict
from typing import Iterable, Iterator

from ._coldscan import ColdScan


class LRUIndex(ColdScan):
    """Files this tier knows, least recently used first.

    ``reserve`` accounts for a file about to be written, so the bound holds while writes are in
    flight; ``victims`` picks what to delete to make room, skipping pinned files (a load is
    reading them). Files found by the start-up scan are *cold*: ordered by file mtime and older
    than anything the tier touched since it started (they are evicted first); touching a cold
    file makes it the most recently used.
    """

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._gone = threading.Condition(self._lock)  # notified when doomed files are forgotten
        self._hot: OrderedDict[str, int] = OrderedDict()  # touched since start, LRU first
        self._cold: dict[str, tuple[int, float]] = {}  # found by the scan, not touched: (size, mtime)
        self._heap: list[tuple[float, str]] = []  # (mtime, relpath) of cold files; stale rows skipped
        self._used = 0
        self._reserved = 0
        # relpath -> [pin count, event of its last removal/eviction, event of its last write indexed]; the
        # events are numbered by _events, so each pinner compares them with its own token (see pin).
        self._pins: dict[str, list[int]] = {}
        self._events = 0
        self._doomed: Counter[str] = Counter()  # handed out as victims, not yet deleted
        self._writing: Counter[str] = Counter()  # stores between reserve(…, relpath) and add/release
        self._stuck: set[str] = set()  # indexed files whose eviction failed: victims only as a last resort
        self._removed_during_scan: set[str] | None = None
        # Bytes of files out of the index but still on storage: doomed by a shared root's evictor until every
        # engine has let go of them (cache/shared/). They count against the bound until deleted.
        self.held = 0

    # -- queries ---------------------------------------------------------------------------------
    def __contains__(self, relpath: str) -> bool:
        # Lock-free (dict reads are atomic under the GIL). Cold first: a touch inserts into _hot
        # before deleting from _cold, so this order never misses a file moving between the two.
        return relpath in self._cold or relpath in self._hot

    def __len__(self) -> int:
        return len(self._cold) + len(self._hot)

    @property
    def used(self) -> int:
        """Bytes of the indexed files (not counting reservations)."""
        return self._used

    @property
    def reserved(self) -> int:
        """Bytes reserved for writes in flight."""
        return self._reserved

    def size_of(self, relpath: str) -> int | None:
        """The indexed size of ``relpath`` (None if unknown)."""
        cold = self._cold.get(relpath)
        if cold is not None:
            return cold[0]
        return self._hot.get(relpath)

    def lru_order(self) -> list[str]:
        """Every indexed file, the next victim first (O(n log n): tests and tools only)."""
        with self._lock:
            cold = sorted(self._cold, key=lambda r: (self._cold[r][1], r))
            return cold + list(self._hot)

    # -- updates ---------------------------------------------------------------------------------
    def add(self, relpath: str, size: int, *, reserved: int = 0) -> list[tuple[str, int]]:
        """Record a file this tier just wrote as most recently used; returns files to delete, as :meth:`reserve`.

        ``reserved``: the bytes ``reserve(reserved, relpath)`` set aside for this write; they are released
        and the write of ``relpath`` ends (others may index the file from now on). Victims are handed out
        when the bound is exceeded now: concurrent writes may each have reserved room that no indexed file
        could give back then (their files were not indexed yet), and without this the excess would stay
        until some later write. The new file itself is kept.
        """
        with self._lock:
            self._reserved -= reserved
            self._drop_locked(relpath)
            self._hot[relpath] = size
            self._used += size
            pin = self._pins.get(relpath)
            if pin is not None:
                pin[2] = self._event_locked()
            if reserved:
                self._end_write_locked(relpath)
            return self._victims_locked(keep=relpath)

    def add_found(self, relpath: str, size: int, since: int = 0) -> bool:
        """Index a file found on storage (read by a load or probe under a pin taken before the read).

        ``since``: the token :meth:`pin` returned to the caller (0: any change while the pin is held).
        Returns False, indexing nothing, when the file was evicted or removed since the caller pinned
        it (or is being evicted now): it is gone or about to be, and indexing it would leave a ghost
        entry. Also False while a store is writing the file: that store indexes it, and only it knows
        when its file is there to stay. A file already indexed is touched.
        """
        with self._lock:
            if self._touch_locked(relpath):
                return True
            if self._doomed.get(relpath) or self._writing.get(relpath):
                return False
            pin = self._pins.get(relpath)
            if pin is not None and pin[1] > since:
                return False
            self._hot[relpath] = size
            self._used += size
            return True

    def note_store(self, relpath: str) -> bool:
        """Another engine stored ``relpath`` (its journal says); False if not indexed. A store, not a load: a cold
        file is one a listing saw before the journal did, so it becomes the newest stored file, as :meth:`add`
        would make it; any other was stored before, and :meth:`_restored_locked` says what a second store does."""
        with self._lock:
            cold = self._cold.get(relpath)
            if cold is None:
                return self._restored_locked(relpath)
            self._hot[relpath] = cold[0]  # insert before deleting (see __contains__); its heap row goes stale
            del self._cold[relpath]
            return True

    def _restored_locked(self, relpath: str) -> bool:
        return self._touch_locked(relpath)  # LRU: another engine's second store is a use

    def touch(self, relpath: str) -> bool:
        """Make ``relpath`` the most recently used; False if it is not indexed."""
        with self._lock:
            return self._touch_locked(relpath)

    def _touch_locked(self, relpath: str) -> bool:
        """The one touch of every policy: the file moves to the end of :meth:`_touched_locked`'s segment."""
        top = self._touched_locked()
        if relpath in top:
            top.move_to_end(relpath)
            return True
        size = self._hot.get(relpath) if top is not self._hot else None
        if size is None:
            cold = self._cold.get(relpath)
            if cold is None:
                return False
            size = cold[0]
        top[relpath] = size  # insert before deleting: see __contains__
        if top is not self._hot:
            self._hot.pop(relpath, None)
        self._cold.pop(relpath, None)  # a cold file's heap row goes stale and is skipped
        self._promoted_locked(size)
        return True

    def _touched_locked(self) -> OrderedDict[str, int]:
        return self._hot  # the segment a touched file moves to (SegmentedLRUIndex: its protected one)

    def _promoted_locked(self, size: int) -> None:
        """A file of ``size`` bytes moved into :meth:`_touched_locked`'s segment from another one."""

    def _drop_locked(self, relpath: str) -> int | None:
        self._stuck.discard(relpath)
        size = self._hot.pop(relpath, None)
        if size is None:
            cold = self._cold.pop(relpath, None)
            size = cold[0] if cold is not None else None
        if size is not None:
            self._used -= size
        return size

    def _event_locked(self) -> int:
        self._events += 1
        return self._events

    def _mark_gone_locked(self, relpath: str) -> None:
        pin = self._pins.get(relpath)
        if pin is not None:
            pin[1] = self._event_locked()
        if self._removed_during_scan is not None:
            self._removed_during_scan.add(relpath)

    def _end_write_locked(self, relpath: str) -> None:
        n = self._writing.get(relpath, 0)
        if n:
            if n == 1:
                del self._writing[relpath]
            else:
                self._writing[relpath] = n - 1
            self._gone.notify_all()

    def remove(self, relpath: str, since: int | None = None) -> int | None:
        """Forget a file that is gone (missing, quarantined, unreadable); returns its indexed size.

        ``since``: the :meth:`pin` token of the read that found the file missing. Nothing is removed when a
        store indexed a new file since then: the read may have looked before that file was published.
        """
        with self._lock:
            if since is not None:
                pin = self._pins.get(relpath)
                if pin is not None and pin[2] > since:
                    return None
            size = self._drop_locked(relpath)
            self._mark_gone_locked(relpath)
            return size

    def pin(self, relpath: str) -> int:
        """Protect ``relpath`` from eviction while a load reads it (pins nest).

        Returns a token dating the pin, for :meth:`add_found` and :meth:`remove`: only changes made after
        it count against what this caller's read found.
        """
        with self._lock:
            pin = self._pins.get(relpath)
            if pin is None:
                self._pins[relpath] = [1, 0, 0]
            else:
                pin[0] += 1
            # A victim doomed before this pin: add_found refuses it while doomed, then forget's event (after
            # this token) records that the file this read may have seen was deleted.
            return self._events

    def pinned(self, relpath: str) -> bool:
        """Whether a load holds ``relpath`` now (see :meth:`pin`)."""
        with self._lock:
            return relpath in self._pins

    def unpin(self, relpath: str) -> bool:
        """Release one :meth:`pin`. True when that was the file's last pin and the index is over the bound:
        the bound may have skipped the file while pinned, and the caller should evict (:meth:`victims`)."""
        with self._lock:
            pin = self._pins.get(relpath)
            if pin is None:
                return False
            pin[0] -= 1
            if pin[0] > 0:
                return False
            del self._pins[relpath]
            return self.max_bytes is not None and self._used + self._reserved + self.held > self.max_bytes

    def reserve(self, nbytes: int, relpath: str | None = None) -> list[tuple[str, int]]:
        """Account ``nbytes`` for a write (of ``relpath``) about to start; returns the files to delete to make room.

        The victims are already out of the index (so no new lookup returns them) and doomed until the
        caller deletes them and calls :meth:`forget`. Pinned files are never chosen; if only pinned
        files are left the bound is exceeded until those loads finish (the last unpin reports it).
        With ``relpath``, that file is being written until :meth:`add` or :meth:`release` (see the module).
        """
        with self._lock:
            self._reserved += nbytes
            if relpath is not None:
                self._writing[relpath] += 1
            return self._victims_locked()

    def release(self, nbytes: int, relpath: str | None = None) -> None:
        """Give back a reservation whose write did not happen (ending the write of ``relpath``)."""
        with self._lock:
            self._reserved -= nbytes
            if relpath is not None:
                self._end_write_locked(relpath)

    def victims(self, limit: int | None = None) -> list[tuple[str, int]]:
        """Files to delete so that usage fits ``max_bytes`` (or ``limit``; removed from the index, doomed)."""
        with self._lock:
            return self._victims_locked(limit=limit)

    def forget(self, relpaths: Iterable[str]) -> None:
        """The caller deleted these victims (or found them gone): they are no longer doomed."""
        with self._lock:
            for rel in relpaths:
                self._undoom_locked(rel)
                # A reader pinned while the victim was doomed may have read the file now deleted; and a scan
                # that listed it before the delete must not bring it back (the shared evictor keeps victims
                # doomed for ticks, so one chosen before a periodic listing began is often deleted during it).
                self._mark_gone_locked(rel)
            self._gone.notify_all()

    def keep(self, victims: Iterable[tuple[str, int]]) -> None:
        """These victims could not be deleted: they are still on storage, so they are counted again (least
        recently used first) and marked stuck (see the module). No longer doomed either way."""
        with self._lock:
            for rel, size in victims:
                self._undoom_locked(rel)
                if rel in self or self._doomed.get(rel):
                    continue  # indexed again meanwhile (a store rewrote it), or another eviction of it is pending
                self._hot[rel] = size
                self._hot.move_to_end(rel, last=False)
                self._used += size
                self._stuck.add(rel)
            self._gone.notify_all()

    def stuck(self) -> int:
        """How many indexed files could not be evicted (their delete failed)."""
        return len(self._stuck)

    def _undoom_locked(self, rel: str) -> None:
        n = self._doomed.get(rel, 0)
        if n <= 1:
            self._doomed.pop(rel, None)
        else:
            self._doomed[rel] = n - 1

    def wait_gone(self, relpath: str) -> None:
        """Block until no eviction and no other store's write of ``relpath`` is in progress (a store then
        writes it afresh, or finds it indexed)."""
        with self._lock:
            while self._doomed.get(relpath) or self._writing.get(relpath):
                self._gone.wait()

    def doomed(self) -> int:
        """How many victims were handed out and not yet forgotten (tests)."""
        with self._lock:
            return sum(self._doomed.values())

    def _order_locked(self) -> Iterator[tuple[str, int]]:
        """The touched files, next victim first (a subclass with segments chains them)."""
        return iter(self._hot.items())

    def _unlist_locked(self, rel: str, size: int) -> None:
        """Take a victim picked from :meth:`_order_locked` out of the index."""
        del self._hot[rel]
        self._used -= size

    def _first_victims_locked(self) -> Iterable[str]:
        return ()  # files evicted before any other (PrefixIndex: dead chunks); a copy, as the loop drops them

    def _evicted_locked(self, victims: list[tuple[str, int]]) -> None:
        """The victims one call of :meth:`_victims_locked` took out of the index (already doomed)."""

    def _take_locked(self, rels: Iterable[str], excess: int, keep: str | None, out: list[tuple[str, int]],
                     *, stuck: bool = False) -> int:
        """Drop ``rels`` into ``out`` until ``excess`` bytes are freed (skipping pinned files, ``keep`` and unless
        ``stuck`` stuck ones); returns the excess left."""
        for rel in rels:
            if excess <= 0:
                break
            if rel in self._pins or rel == keep or (not stuck and rel in self._stuck):
                continue
            if (size := self._drop_locked(rel)) is not None:
                out.append((rel, size))
                excess -= size
        return excess

    def _victims_locked(self, keep: str | None = None, limit: int | None = None) -> list[tuple[str, int]]:
        """The one victim loop of every policy: first, cold, ordered (:meth:`_order_locked`), then stuck files."""
        bound = self.max_bytes if limit is None else limit
        if bound is None:
            return []
        excess = self._used + self._reserved + self.held - bound
        if excess <= 0:
            return []
        out: list[tuple[str, int]] = []
        excess = self._take_locked(self._first_victims_locked(), excess, keep, out)
        skipped: list[tuple[float, str]] = []
        while excess > 0 and self._heap:  # cold files first, oldest mtime first
            mtime, rel = heapq.heappop(self._heap)
            cold = self._cold.get(rel)
            if cold is None or cold[1] != mtime:
                continue  # touched or removed since the scan: a stale row
            if rel in self._pins or rel in self._stuck:
                skipped.append((mtime, rel))
                continue
            del self._cold[rel]
            self._used -= cold[0]
            excess -= cold[0]
            out.append((rel, cold[0]))
        for row in skipped:
            heapq.heappush(self._heap, row)
        if not self._cold:
            self._heap.clear()  # only stale rows are left
        if excess > 0:
            picked = []
            for rel, size in self._order_locked():  # iterate, never copy: O(victims + pinned skipped)
                if excess <= 0:
                    break
                if rel in self._pins or rel == keep or rel in self._stuck:
                    continue
                picked.append((rel, size))
                excess -= size
            for rel, size in picked:
                self._unlist_locked(rel, size)
            out += picked
        if excess > 0 and self._stuck:  # nothing else makes room: try the files whose delete failed again
            self._take_locked(sorted(self._stuck), excess, keep, out, stuck=True)
        for rel, _ in out:
            self._doomed[rel] += 1
            self._mark_gone_locked(rel)
        self._evicted_locked(out)
        return out
