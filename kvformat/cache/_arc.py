"""ARC or LRU, whichever has been hitting more: an :class:`LRUIndex` that evicts what the leading expert evicted.

Neither order wins everywhere on the Mooncake traces (docs/benchmarks/capacity.md). ARC (Megiddo & Modha, FAST'03)
keeps files hit at least once (its T2) ahead of files only stored (T1) and adapts the split from ghost hits: at small
budgets that is worth up to 3.4 % over LRU. Where the budget already holds most of the reuse window, T2's files go
stale faster than ARC's target moves and LRU leads by up to 4.3 %. So this index runs both as metadata-only shadow
caches at the same bound over the same accesses (names and sizes, never bytes), and evicts, of its files, first
those the leading expert has evicted (oldest eviction first), then any other least recently used first (only
needed while it holds files the leader never held: a start, pins, a shared root). While one expert leads
throughout, the index holds exactly what that expert holds: driven by ARC alone it is the paper's ARC(c) file for
file, by LRU alone plain LRU (tests/test_arc.py).

The leader is ARC unless LRU is ahead on the accesses where exactly one of the two hits by more than ``_Z``
standard deviations of a fair coin (McNemar's sign test), each access weighted ``exp(-bytes accessed since /
max_bytes)``: about the last cache-full of accesses, the span over which two orders at one bound can differ at all
(LeCaR's discount, 0.005 ** (1 / N) a request at N entries, is the same scale). ARC is the default because a
switch is not free (the index must drop the other expert's files and miss to get the leader's back), and judging
starts one cache-full of accesses after the first eviction (ARC's target starts at 0 and has nothing to adapt from
before). Measured (capacity.md, 2026-12-07): this meets issue 45's rule on the conversation trace but not on the
synthetic one, where LRU leads ARC for stretches after which ARC's protected files pay, so it is offered, not
wired.

Costs: per access O(1) amortized in each shadow; memory, besides the index, one name per file of the LRU shadow
(at most ``max_bytes`` of them) and of the ARC shadow (resident and ghosts, at most 2 x ``max_bytes``), and per
expert the indexed files it no longer holds (at most the index's files). The shadows keep the bound given at
construction: a shared root's roles set ``max_bytes`` to None and back (cache/shared/), and the experts judge the
root's bound, not the role's. Built unbounded (a reader rank) the index has no shadows and evicts as LRU.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Iterator

from ._lru import LRUIndex

__all__ = ["ArcLruIndex"]

# LRU is followed only while its lead over ARC on the accesses where exactly one of them hits is this many standard
# deviations of a fair coin (McNemar's sign test, one-sided ~98 %): a switch churns up to a cache-full of files.
_Z = 2.0


class _Sized(OrderedDict[str, int]):
    """Names -> sizes, keeping the sum of the sizes: ARC compares T1's bytes with its target at every eviction."""

    nbytes = 0

    def __setitem__(self, key: str, value: int) -> None:
        self.nbytes += value - super().get(key, 0)
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.nbytes -= self[key]
        super().__delitem__(key)

    def pop(self, key: str, *default: Any) -> Any:
        if key in self:
            value = super().pop(key)
            self.nbytes -= value
            return value
        return super().pop(key, *default)

    def popitem(self, last: bool = True) -> tuple[str, int]:
        key, value = super().popitem(last)
        self.nbytes -= value
        return key, value


class _LruShadow:
    """LRU over names and sizes at ``cap`` bytes."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.files = _Sized()  # least recently used first
        self.evicted: list[str] = []

    def __contains__(self, rel: str) -> bool:
        return rel in self.files

    def event(self, rel: str, size: int) -> bool:
        """A touch or a store of ``rel``: True when LRU held it; else LRU stores it."""
        files = self.files
        if rel in files:
            files.move_to_end(rel)
            return True
        files[rel] = size
        while files.nbytes > self.cap and len(files) > 1:
            self.evicted.append(files.popitem(last=False)[0])
        return False


class _ArcShadow:
    """ARC over names and sizes at ``cap`` bytes (the paper's Fig. 4 in bytes): T1/T2 resident, B1/B2 their ghosts,
    ``p`` the target of T1's bytes. With equal sizes it is ARC(c) step for step (tools/capacity_policies.py ARC)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.p = 0.0
        self.t1, self.t2, self.b1, self.b2 = _Sized(), _Sized(), _Sized(), _Sized()  # least recently used first
        self.evicted: list[str] = []  # what the last events evicted (the index drains it)

    def __contains__(self, rel: str) -> bool:
        return rel in self.t1 or rel in self.t2

    def event(self, rel: str, size: int) -> bool:
        """A touch or a store of ``rel``: True when ARC held it (a hit in its world); else ARC stores it."""
        if rel in self.t1:  # case I
            self.t2[rel] = self.t1.pop(rel)
            return True
        if rel in self.t2:
            self.t2.move_to_end(rel)
            return True
        in_b1, in_b2 = rel in self.b1, rel in self.b2
        if in_b1:  # case II: a file evicted from T1 came back, so T1 was too small
            self.p = min(float(self.cap), self.p + max(self.b2.nbytes / self.b1.nbytes, 1.0) * size)
            del self.b1[rel]
        elif in_b2:  # case III: one evicted from T2 came back
            self.p = max(0.0, self.p - max(self.b1.nbytes / self.b2.nbytes, 1.0) * size)
            del self.b2[rel]
        self._replace(size, in_b2)
        (self.t2 if in_b1 or in_b2 else self.t1)[rel] = size  # case IV (never seen, or forgotten): T1
        self._trim()
        return False

    def _replace(self, size: int, in_b2: bool) -> None:
        """Make room for ``size`` bytes: T1's oldest file while T1 is over ``p``, else T2's; each goes to its ghost."""
        t1, t2 = self.t1, self.t2
        while t1.nbytes + t2.nbytes + size > self.cap and (t1 or t2):
            if t1 and (not t2 or t1.nbytes > self.p or (in_b2 and t1.nbytes == self.p)):
                rel, n = t1.popitem(last=False)
                self.b1[rel] = n
            else:
                rel, n = t2.popitem(last=False)
                self.b2[rel] = n
            self.evicted.append(rel)

    def _trim(self) -> None:
        """The directory bounds: T1 + B1 <= cap, T1 + T2 + B1 + B2 <= 2 cap (ARC drops ghosts oldest first)."""
        while self.b1 and self.t1.nbytes + self.b1.nbytes > self.cap:
            self.b1.popitem(last=False)
        total = self.t1.nbytes + self.t2.nbytes + self.b1.nbytes + self.b2.nbytes
        while (self.b1 or self.b2) and total > 2 * self.cap:
            total -= (self.b2 if self.b2 else self.b1).popitem(last=False)[1]




class ArcLruIndex(LRUIndex):
    """:class:`LRUIndex` evicting what the leading one of two shadow caches (LRU, ARC) has evicted, the leader
    being the one with more hits over about the last cache-full of accesses (the module says how)."""

    def __init__(self, max_bytes: int | None, *, expert: str | None = None) -> None:
        if expert not in (None, "lru", "arc"):
            raise ValueError(f"expert must be None (the one ahead), 'lru' or 'arc', not {expert!r}")
        super().__init__(max_bytes)
        self.cap = max_bytes
        self.expert = expert  # one expert followed whatever the scores (tests and the replay's check rows)
        self._experts: tuple[_LruShadow | _ArcShadow, ...] | None = (
            (_LruShadow(max_bytes), _ArcShadow(max_bytes)) if max_bytes else None)
        # Per expert: indexed files it no longer holds, in the order it evicted them (the victims it would pick).
        self._left: tuple[OrderedDict[str, None], OrderedDict[str, None]] = (OrderedDict(), OrderedDict())
        self._scores = [0.0, 0.0]  # LRU's, ARC's
        self.following = expert or "arc"
        self._seen = 0
        self._full_since: int | None = None

    def scores(self) -> tuple[float, float]:
        """The LRU and ARC shadows' decayed hits (tests and tools)."""
        return self._scores[0], self._scores[1]

    def arc_target(self) -> float | None:
        """The ARC shadow's target for T1's bytes (``p``; tests and tools), None when unbounded."""
        return self._experts[1].p if self._experts is not None and isinstance(self._experts[1], _ArcShadow) else None

    def lru_order(self) -> list[str]:
        with self._lock:  # the exact victim order now: cold files, then the leader's evictions, then LRU
            cold = sorted(self._cold, key=lambda r: (self._cold[r][1], r))
            return cold + [rel for rel, _ in self._order_locked()]

    def _observe_locked(self, rel: str, size: int) -> None:
        """One access (a touch, or a store asking for room) seen by both experts."""
        if self._experts is None or self.cap is None:
            return
        decay = math.exp(-size / self.cap)
        hits = [False, False]
        for i, shadow in enumerate(self._experts):
            hits[i] = shadow.event(rel, size)
            if shadow.evicted and self._full_since is None:
                self._full_since = self._seen
            left = self._left[i]
            for v in shadow.evicted:
                if v in self._hot:
                    left[v] = None
            shadow.evicted.clear()
            left.pop(rel, None)  # every access leaves the file in both experts
        s = self._scores
        s[0] = s[0] * decay + (hits[0] and not hits[1])
        s[1] = s[1] * decay + (hits[1] and not hits[0])
        self._seen += size
        # Judged only from one cache-full of accesses after the first eviction: until then ARC's target has had
        # nothing to adapt from, and the two differ by its starting value only.
        judged = self._full_since is not None and self._seen - self._full_since >= self.cap
        lru, arc = s
        self.following = self.expert or ("lru" if judged and lru - arc > _Z * math.sqrt(lru + arc) else "arc")

    def reserve(self, nbytes: int, relpath: str | None = None) -> list[tuple[str, int]]:
        # The store's access is counted before its victims are chosen, so that the leader's victim for it is
        # known; add then knows it was counted from the write in flight (LRUIndex._writing).
        if relpath is not None:
            with self._lock:
                self._observe_locked(relpath, nbytes)
        return super().reserve(nbytes, relpath)

    def add(self, relpath: str, size: int, *, reserved: int = 0) -> list[tuple[str, int]]:
        with self._lock:
            if not self._writing.get(relpath):
                self._observe_locked(relpath, size)  # no reserve(..., relpath) counted this store
        return super().add(relpath, size, reserved=reserved)

    def add_found(self, relpath: str, size: int, since: int = 0) -> bool:
        fresh = relpath not in self  # an indexed file is touched, and the touch counts the access
        ok = super().add_found(relpath, size, since)
        if ok and fresh:
            with self._lock:
                self._observe_locked(relpath, size)
        return ok

    def _touch_locked(self, relpath: str) -> bool:
        size = self.size_of(relpath)
        if size is None:
            return False
        self._observe_locked(relpath, size)
        return super()._touch_locked(relpath)

    def _order_locked(self) -> Iterator[tuple[str, int]]:
        """The leader's evictions that are still indexed, oldest first, then every other file least recently used
        first (only needed while the index holds files the leader does not: a start, pins, a shared root)."""
        left = self._left[self.following == "arc"]
        hot = self._hot
        for rel in left:
            yield rel, hot[rel]
        for rel, size in hot.items():
            if rel not in left:
                yield rel, size

    def _drop_locked(self, relpath: str) -> int | None:
        for left in self._left:
            left.pop(relpath, None)
        return super()._drop_locked(relpath)

    def _unlist_locked(self, rel: str, size: int) -> None:
        for left in self._left:
            left.pop(rel, None)
        super()._unlist_locked(rel, size)
