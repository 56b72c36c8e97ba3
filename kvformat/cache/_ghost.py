"""Segmented LRU whose protected share is set by ARC's ghost rule: :class:`GhostSegmentedIndex`.

:class:`SegmentedLRUIndex` protects loaded files from the stream of files only stored, with a fixed share of the
bound. No fixed share is right everywhere (docs/benchmarks/capacity.md): on the Mooncake conversation trace a
share of 0.2 gains 4.8 % over LRU at 0.5 TB and loses 0.4 % at 2 TB, on the synthetic trace the best share at
0.5 TB is near 0.9. ARC (Megiddo & Modha, FAST'03) answers the same question with two ghost lists, the names of
files evicted lately: a file stored again while its name is in the ghost of files never protected says the
probation segment was too small, one whose name is in the ghost of files that were protected says the protected
segment was. This index moves its share by ARC's step on each such store (in bytes: the file's size times
max(1, other ghost / this ghost)) and keeps :class:`SegmentedLRUIndex`'s demotion, so a file pushed out of the
protected segment goes back to probation as its newest file rather than out of the cache (ARC evicts it): a
share that falls frees protected files gradually instead of dropping them. A file stored again from either
ghost has been seen twice, so it enters the protected segment (ARC's T2), as a re-store of an indexed file does.

The share stops at ``most`` (0.8), where ARC's may reach the whole cache: with every byte protected, probation is
one file wide and each store evicts the file stored just before it, so a prompt stored then keeps only its last
chunk, which no prefix lookup reaches. A fifth of the bound stays for new prompts to be read once (on the
synthetic Mooncake trace the cap also gains 0.7 % at 0.5 TB: docs/benchmarks/capacity.md).

Each ghost holds at most ``max_bytes`` of names (no data); a file leaves its ghost when stored again or when the
ghost is over that size, oldest name first. Cost: O(1) amortized per store, touch and eviction; memory, besides
the index, at most two bounds' worth of names.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from ._slru import SegmentedLRUIndex

__all__ = ["GhostSegmentedIndex"]


class _Ghost:
    """Names of evicted files with their sizes, oldest first, bounded in bytes."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.names: OrderedDict[str, int] = OrderedDict()
        self.bytes = 0

    def put(self, rel: str, size: int) -> None:
        self.bytes -= self.names.pop(rel, 0)
        self.names[rel] = size
        self.bytes += size
        while self.bytes > self.cap and self.names:
            _, n = self.names.popitem(last=False)
            self.bytes -= n

    def take(self, rel: str) -> bool:
        size = self.names.pop(rel, None)
        if size is None:
            return False
        self.bytes -= size
        return True


class GhostSegmentedIndex(SegmentedLRUIndex):
    """:class:`SegmentedLRUIndex` whose protected share starts at ``protected`` and follows ARC's ghost hits."""

    def __init__(self, max_bytes: int | None, protected: float = 0.2, most: float = 0.8) -> None:
        if not 0.0 <= protected <= most <= 1.0:
            raise ValueError(f"need 0 <= protected <= most <= 1, not {protected!r}, {most!r}")
        self._target = 0.0  # protected bytes aimed at: what ``protected`` reads and writes
        self.most = most
        super().__init__(max_bytes, protected)
        self._demoted: set[str] = set()  # in probation, pushed out of the protected segment
        self._was_protected: dict[str, bool] = {}  # dropped just now: the ghost each victim goes to
        cap = max_bytes or 0
        self._ghost_new = _Ghost(cap)  # evicted, never protected (ARC's B1)
        self._ghost_prot = _Ghost(cap)  # evicted from protection or after it (ARC's B2)

    # The share moves in bytes (ARC's step is a file's size): it is kept as bytes, so no rounding through the
    # share accumulates over a trace's millions of steps.
    @property
    def protected(self) -> float:
        return self._target / self.capacity if self.capacity else self._start

    @protected.setter
    def protected(self, share: float) -> None:
        self._start = share
        self._target = share * self.capacity if self.capacity is not None else 0.0

    def share(self) -> float:
        """The protected segment's target as a share of the bound (the tier's ``protected_share`` gauge)."""
        with self._lock:
            return self.protected

    def ghost_bytes(self) -> tuple[int, int]:
        """Bytes named by the two ghosts (never protected, protected)."""
        with self._lock:
            return self._ghost_new.bytes, self._ghost_prot.bytes

    # -- the adaptation: a store of a ghost's name -------------------------------------------------------
    def add(self, relpath: str, size: int, *, reserved: int = 0) -> list[tuple[str, int]]:
        with self._lock:
            seen = relpath in self or self._ghost_seen_locked(relpath, size)
        victims = super().add(relpath, size, reserved=reserved)
        if seen:
            with self._lock:
                self._promote_locked(relpath)
        return victims

    def add_found(self, relpath: str, size: int, since: int = 0) -> bool:
        # On a shared root the evictor learns the other engines' stores this way (their journals): a store of a
        # name it evicted is the same evidence as its own.
        with self._lock:
            fresh = relpath not in self
        if not super().add_found(relpath, size, since):
            return False
        if fresh:
            with self._lock:
                if relpath in self._hot and self._ghost_seen_locked(relpath, size):
                    self._promote_locked(relpath)
        return True

    def _restored_locked(self, relpath: str) -> bool:
        # A second store of a file in probation is its second sight, as in add(); one the listing found was not
        # stored twice (LRUIndex.note_store moves it to probation unasked).
        if not super()._restored_locked(relpath):
            return False
        self._promote_locked(relpath)
        return True

    def keep(self, victims: Iterable[tuple[str, int]]) -> None:
        victims = list(victims)
        with self._lock:  # a victim whose delete failed is still stored: not evicted, so in no ghost
            for rel, _ in victims:
                self._ghost_new.take(rel) or self._ghost_prot.take(rel)
        super().keep(victims)

    def _ghost_seen_locked(self, rel: str, size: int) -> bool:
        if self.capacity is None:
            return False
        new, prot = self._ghost_new, self._ghost_prot
        # The ratio is taken with the file still in its ghost (ARC's delta), so it is never over an empty one.
        if rel in new.names:
            self._target = max(0.0, self._target - size * max(1.0, prot.bytes / max(new.bytes, 1)))
            new.take(rel)
        elif rel in prot.names:
            step = size * max(1.0, new.bytes / max(prot.bytes, 1))
            self._target = min(self.most * self.capacity, self._target + step)
            prot.take(rel)
        else:
            return False
        return True

    def _promote_locked(self, rel: str) -> None:
        size = self._hot.get(rel)
        if size is None or rel in self._prot:
            return  # already protected, or evicted meanwhile
        self._prot[rel] = size  # insert before deleting: see SegmentedLRUIndex.__contains__
        del self._hot[rel]
        self._demoted.discard(rel)
        self._promoted_locked(size)

    # -- keeping the ghosts --------------------------------------------------------------------------
    def _touch_locked(self, relpath: str) -> bool:
        self._demoted.discard(relpath)
        return super()._touch_locked(relpath)

    def _cap_locked(self) -> float:
        return self._target

    def _demoted_locked(self, rel: str) -> None:
        self._demoted.add(rel)

    def _leaving_locked(self, rel: str) -> None:
        # Which ghost ``rel`` goes to if this drop is an eviction (_evicted_locked decides).
        self._was_protected[rel] = rel in self._prot or rel in self._demoted
        self._demoted.discard(rel)

    def _drop_locked(self, relpath: str) -> int | None:
        self._leaving_locked(relpath)
        return super()._drop_locked(relpath)

    def _unlist_locked(self, rel: str, size: int) -> None:
        self._leaving_locked(rel)
        super()._unlist_locked(rel, size)

    def _evicted_locked(self, victims: list[tuple[str, int]]) -> None:
        for rel, size in victims:
            ghost = self._ghost_prot if self._was_protected.get(rel) else self._ghost_new
            ghost.put(rel, size)
        self._was_protected.clear()  # drops outside an eviction (a re-store, a removal) leave no ghost
        super()._evicted_locked(victims)

    def remove(self, relpath: str, since: int | None = None) -> int | None:
        size = super().remove(relpath, since)
        with self._lock:
            self._was_protected.pop(relpath, None)
        return size
