"""Segmented LRU: an :class:`LRUIndex` that shields files loaded at least once from files only ever stored.

A prefix cache stores every new chunk of every prompt, and most of them are never looked up again (76 % of the
blocks of the Mooncake conversation trace, docs/benchmarks/capacity.md). Under plain LRU each such chunk pushes
out one that was; here a stored file enters a *probation* segment and moves to a *protected* segment when it is
touched (a load found it), and victims come from probation first. The protected segment holds at most
``protected`` × ``max_bytes``; a file pushed out of it goes back to probation as its most recently used file, so a
file that stops being loaded ages out as under LRU, only later.

Everything else (pins, dooms, writes in flight, stuck files, the scan's cold files, which are still evicted
first) is :class:`LRUIndex`'s: this class only changes which touched file is the next victim. A file found on
storage by a load (``add_found``) of a file that is not indexed enters probation, as a store does.

:class:`AdaptiveSegmentedIndex` keeps the protected segment only while it pays: it runs two metadata-only shadow
caches at the same bound over the same touches and stores (one plain LRU, one segmented) and protects nothing
(plain LRU) while the LRU shadow has held more of the recently touched or re-stored files.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain
from typing import Iterator

from ._lru import LRUIndex

__all__ = ["AdaptiveSegmentedIndex", "SegmentedLRUIndex"]


class SegmentedLRUIndex(LRUIndex):
    """:class:`LRUIndex` with a probation segment (stored, not loaded since) evicted before a protected one."""

    def __init__(self, max_bytes: int | None, protected: float = 0.2) -> None:
        if not 0.0 <= protected <= 1.0:
            raise ValueError(f"protected must be a share of max_bytes in [0, 1], not {protected!r}")
        super().__init__(max_bytes)
        # The bound the segments are shares of. Not max_bytes itself: a shared root's evictor sets that to None
        # while it picks victims by passes (shared/_evictor.py), and the protected segment must stay bounded then
        # (with no cap every file ever loaded was protected, and the evictor deleted its newest stores first).
        self.capacity = max_bytes
        self.protected = protected
        self._prot: OrderedDict[str, int] = OrderedDict()  # touched by a load since stored, LRU first
        self._prot_bytes = 0

    # -- queries: a file is in _cold, _hot (probation) or _prot ----------------------------------------------
    def __contains__(self, relpath: str) -> bool:
        # Lock-free, as LRUIndex's. A move inserts before it deletes; promotion goes _hot -> _prot and demotion
        # _prot -> _hot, so _hot is looked at on both sides of _prot: a file moving either way is seen once.
        return (relpath in self._cold or relpath in self._hot or relpath in self._prot
                or relpath in self._hot)

    def __len__(self) -> int:
        return super().__len__() + len(self._prot)

    def size_of(self, relpath: str) -> int | None:
        size = self._prot.get(relpath)
        return size if size is not None else super().size_of(relpath)

    def lru_order(self) -> list[str]:
        with self._lock:  # one snapshot: cold files (oldest mtime first), probation, then protected
            cold = sorted(self._cold, key=lambda r: (self._cold[r][1], r))
            return cold + list(self._hot) + list(self._prot)

    def protected_bytes(self) -> int:
        """Bytes in the protected segment (tests and tools)."""
        return self._prot_bytes

    # -- the segments ------------------------------------------------------------------------------------
    def _restored_locked(self, relpath: str) -> bool:
        # Another engine's store is no load: the file keeps its segment, as the newest of it.
        for seg in (self._hot, self._prot):
            if relpath in seg:
                seg.move_to_end(relpath)
                return True
        return False

    def _touched_locked(self) -> OrderedDict[str, int]:
        return self._prot

    def _promoted_locked(self, size: int) -> None:
        self._prot_bytes += size
        self._demote_locked()

    def _cap_locked(self) -> float:
        """Bytes the protected segment may hold (``capacity`` is set)."""
        return self.protected * self.capacity  # type: ignore[operator]

    def _demote_locked(self) -> None:
        if self.capacity is None:
            return
        cap = self._cap_locked()
        while self._prot_bytes > cap and self._prot:
            rel, size = next(iter(self._prot.items()))
            self._hot[rel] = size  # the newest in probation: it ages out from there
            del self._prot[rel]
            self._prot_bytes -= size
            self._demoted_locked(rel)

    def _demoted_locked(self, rel: str) -> None:
        """``rel`` was just pushed out of the protected segment into probation (a hook for subclasses)."""

    def _drop_locked(self, relpath: str) -> int | None:
        size = self._prot.pop(relpath, None)
        if size is None:
            return super()._drop_locked(relpath)
        self._stuck.discard(relpath)
        self._used -= size
        self._prot_bytes -= size
        return size

    def _order_locked(self) -> Iterator[tuple[str, int]]:
        return chain(self._hot.items(), self._prot.items())

    def _unlist_locked(self, rel: str, size: int) -> None:
        if self._hot.pop(rel, None) is None:
            del self._prot[rel]
            self._prot_bytes -= size
        self._used -= size


class _Shadow:
    """Which files a policy would hold at ``max_bytes`` (names and sizes only): LRU, or segmented with a share."""

    def __init__(self, max_bytes: int, protected: float) -> None:
        self.max_bytes, self.cap = max_bytes, protected * max_bytes
        self.prob: OrderedDict[str, int] = OrderedDict()
        self.prot: OrderedDict[str, int] = OrderedDict()
        self.used = self.prot_bytes = 0

    def event(self, rel: str, size: int) -> bool:
        """A touch or a store of ``rel``: True when this policy still held it (a hit in its world)."""
        if rel in self.prot:
            self.prot.move_to_end(rel)
            return True
        held = self.prob.pop(rel, None)
        if held is not None and self.cap > 0:
            self.prot[rel] = held
            self.prot_bytes += held
            while self.prot_bytes > self.cap and self.prot:
                old, n = self.prot.popitem(last=False)
                self.prob[old] = n
                self.prot_bytes -= n
            return True
        if held is not None:
            self.prob[rel] = held  # plain LRU: the newest
            return True
        self.prob[rel] = size  # a miss in its world: it stores the file, as the tier would
        self.used += size
        while self.used > self.max_bytes and (self.prob or self.prot):
            if self.prob:
                _, n = self.prob.popitem(last=False)
            else:
                _, n = self.prot.popitem(last=False)
                self.prot_bytes -= n
            self.used -= n
        return False


class AdaptiveSegmentedIndex(SegmentedLRUIndex):
    """:class:`SegmentedLRUIndex` whose protected share is ``protected`` while a segmented shadow cache beats an
    LRU one on recent events (touches and stores, each weighted ``decay`` ** age), and 0 (plain LRU) otherwise.

    Costs two more dict entries per file (the shadows hold names, not bytes) and O(1) per touch and store.
    """

    def __init__(self, max_bytes: int | None, protected: float = 0.2, decay: float = 0.99999) -> None:
        super().__init__(max_bytes, protected)
        self.share = protected
        self.decay = decay
        self._shadows = ([_Shadow(max_bytes, 0.0), _Shadow(max_bytes, protected)]
                         if max_bytes is not None else [])
        self._scores = [0.0, 0.0]
        self.protected = 0.0  # plain LRU until the segmented shadow shows it holds more

    def _observe_locked(self, rel: str, size: int) -> None:
        if not self._shadows:
            return
        for i, sh in enumerate(self._shadows):
            self._scores[i] = self._scores[i] * self.decay + sh.event(rel, size)
        want = self.share if self._scores[1] > self._scores[0] else 0.0
        if want != self.protected:
            self.protected = want
            self._demote_locked()

    def _touch_locked(self, relpath: str) -> bool:
        size = self.size_of(relpath)
        if size is not None:
            self._observe_locked(relpath, size)
        return super()._touch_locked(relpath)

    def add(self, relpath: str, size: int, *, reserved: int = 0) -> list[tuple[str, int]]:
        with self._lock:
            self._observe_locked(relpath, size)
        return super().add(relpath, size, reserved=reserved)
