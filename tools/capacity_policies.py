"""The field's online eviction policies, admission filters and vLLM's CPU tier, for tools/bench_capacity.py.

Every policy works on equal-sized blocks (ids of the trace's 512-token prefix blocks) and a capacity in blocks, and
answers four calls the replay makes: ``b in p`` (a lookup, no side effect), ``hit(b)`` (a lookup found it and the
request loads it), ``insert(b)`` (store a block that is not cached; returns how many blocks it evicted) and
``rewrite(b)`` (the request stores a block that is still cached behind a missing one: what the tier does then).
Written from the papers' definitions:

* ``SIEVE`` (Zhang et al., NSDI'24): one FIFO, a visited bit, a hand that walks from the tail toward the head,
  clearing bits, and evicts the first unvisited block; new blocks go to the head.
* ``S3FIFO`` (Yang et al., SOSP'23, Algorithm 1): small FIFO (10 %), main FIFO, ghost FIFO of as many ids as the
  main queue holds, a frequency capped at 3 (two bits); a block leaves the small queue for the main one if it
  was hit more than once there (``freq > 1``), else for the ghost; the main queue reinserts a block with a
  non-zero frequency, one less.
* ``ARC`` (Megiddo & Modha, FAST'03, Fig. 4): T1/T2 with ghosts B1/B2 and the adaptive target ``p``; the paper
  starts ``p`` at 0, ``start`` (a share of the capacity) starts it elsewhere, to measure how much ARC's result owes
  to that one arbitrary choice.
* ``WTinyLFU`` (Einziger, Friedman & Manes, ToS 2017; Caffeine's layout): a 1 % window LRU in front of a
  segmented LRU (probation, protected 80 %); a window victim enters the main cache only if its estimated
  frequency beats the probation victim's. Frequencies: a count-min sketch of 4-bit counters, four rows
  (Caffeine's ``FrequencySketch`` shape), halved every 10 x capacity additions (Caffeine's aging), behind the
  TinyLFU paper's doorkeeper (first sightings only set a doorkeeper bit, cleared at each halving).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Protocol


class BlockPolicy(Protocol):
    def __contains__(self, b: int) -> bool: ...
    def __len__(self) -> int: ...
    def hit(self, b: int) -> None: ...
    def insert(self, b: int) -> int: ...
    def rewrite(self, b: int) -> None: ...


class LRU:
    """Plain LRU of ``cap`` blocks (vLLM's CPU tier, and ``lru`` under a CPU tier); a re-stored block is touched."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._d: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, b: int) -> bool:
        return b in self._d

    def __len__(self) -> int:
        return len(self._d)

    def hit(self, b: int) -> None:
        self._d.move_to_end(b)

    def insert(self, b: int) -> int:
        self._d[b] = None
        if len(self._d) > self.cap:
            self._d.popitem(last=False)
            return 1
        return 0

    def rewrite(self, b: int) -> None:
        self._d.move_to_end(b)


class Sieve:
    """SIEVE: FIFO order by insertion, visited bits, a hand that survives between evictions."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._visited: dict[int, bool] = {}
        self._newer: dict[int, int | None] = {}  # toward the head (the newest)
        self._older: dict[int, int | None] = {}
        self._head: int | None = None
        self._tail: int | None = None
        self._hand: int | None = None  # None: start at the tail

    def __contains__(self, b: int) -> bool:
        return b in self._visited

    def __len__(self) -> int:
        return len(self._visited)

    def order(self) -> list[int]:
        """Oldest first (tests)."""
        out, p = [], self._tail
        while p is not None:
            out.append(p)
            p = self._newer[p]
        return out

    def hit(self, b: int) -> None:
        self._visited[b] = True

    def rewrite(self, b: int) -> None:
        self._visited[b] = True

    def insert(self, b: int) -> int:
        ev = 0
        if len(self._visited) >= self.cap:
            self._evict()
            ev = 1
        self._visited[b] = False
        self._older[b], self._newer[b] = self._head, None
        if self._head is not None:
            self._newer[self._head] = b
        self._head = b
        if self._tail is None:
            self._tail = b
        return ev

    def _evict(self) -> None:
        p = self._hand if self._hand is not None else self._tail
        assert p is not None
        while self._visited[p]:
            self._visited[p] = False
            nxt = self._newer[p]
            p = nxt if nxt is not None else self._tail  # past the head the hand wraps to the tail
            assert p is not None
        self._hand = self._newer[p]
        older, newer = self._older.pop(p), self._newer.pop(p)
        del self._visited[p]
        if older is not None:
            self._newer[older] = newer
        else:
            self._tail = newer
        if newer is not None:
            self._older[newer] = older
        else:
            self._head = older


class S3FIFO:
    """S3-FIFO as in the paper's Algorithm 1 (insert into S unless the ghost holds the id)."""

    def __init__(self, cap: int, small: float = 0.1, threshold: int = 2) -> None:
        self.cap = cap
        self.s_cap = max(1, int(cap * small))
        self.m_cap = cap - self.s_cap
        self.threshold = threshold  # the paper's "t.freq > 1"
        self.small: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.main: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self._freq: dict[int, int] = {}

    def __contains__(self, b: int) -> bool:
        return b in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def hit(self, b: int) -> None:
        self._freq[b] = min(self._freq[b] + 1, 3)

    def rewrite(self, b: int) -> None:
        self.hit(b)

    def insert(self, b: int) -> int:
        ev = 0
        while len(self.small) + len(self.main) >= self.cap:
            ev += self._evict_s() if len(self.small) >= self.s_cap or not self.main else self._evict_m()
        if b in self.ghost:
            del self.ghost[b]
            self.main[b] = None
        else:
            self.small[b] = None
        self._freq[b] = 0
        return ev

    def _evict_s(self) -> int:
        ev = 0
        while self.small:
            t, _ = self.small.popitem(last=False)
            if self._freq[t] >= self.threshold:
                self.main[t] = None
                self._freq[t] = 0  # the access bits are cleared on the move
                if len(self.main) > self.m_cap:
                    ev += self._evict_m()
            else:
                del self._freq[t]
                self.ghost[t] = None
                if len(self.ghost) > self.m_cap:
                    self.ghost.popitem(last=False)
                return ev + 1
        return ev

    def _evict_m(self) -> int:
        while self.main:
            t, _ = self.main.popitem(last=False)
            if self._freq[t] > 0:
                self._freq[t] -= 1
                self.main[t] = None
            else:
                del self._freq[t]
                return 1
        return 0


class ARC:
    """Adaptive Replacement Cache, the paper's ARC(c) with the request split into hit and miss calls."""

    def __init__(self, cap: int, start: float = 0.0) -> None:
        if not 0.0 <= start <= 1.0:
            raise ValueError(f"start is a share of the capacity in [0, 1], not {start!r}")
        self.cap = cap
        self.p = start * cap  # T1's target; the paper's ARC starts it at 0
        self.t1: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, b: int) -> bool:
        return b in self.t1 or b in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def hit(self, b: int) -> None:  # case I
        if b in self.t1:
            del self.t1[b]
            self.t2[b] = None
        else:
            self.t2.move_to_end(b)

    def rewrite(self, b: int) -> None:
        self.hit(b)

    def _replace(self, in_b2: bool) -> int:
        if len(self.t1) + len(self.t2) < self.cap:
            return 0  # not full yet (only before the first eviction)
        if self.t1 and ((in_b2 and len(self.t1) == self.p) or len(self.t1) > self.p):
            v, _ = self.t1.popitem(last=False)
            self.b1[v] = None
        else:
            v, _ = self.t2.popitem(last=False)
            self.b2[v] = None
        return 1

    def insert(self, b: int) -> int:
        c = self.cap
        if b in self.b1:  # case II
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            ev = self._replace(False)
            del self.b1[b]
            self.t2[b] = None
            return ev
        if b in self.b2:  # case III
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            ev = self._replace(True)
            del self.b2[b]
            self.t2[b] = None
            return ev
        ev = 0  # case IV
        if len(self.t1) + len(self.b1) == c:
            if len(self.t1) < c:
                self.b1.popitem(last=False)
                ev = self._replace(False)
            else:
                self.t1.popitem(last=False)
                ev = 1
        elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= c:
            if len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) == 2 * c:
                self.b2.popitem(last=False)
            ev = self._replace(False)
        self.t1[b] = None
        return ev


_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_M64 = (1 << 64) - 1
_HALF = bytes(i >> 1 for i in range(256))


class FrequencySketch:
    """Count-min sketch, four rows of 4-bit counters (saturating at 15), halved after ``sample`` additions;
    in front of it a doorkeeper: an id seen for the first time since the last halving only sets its bit."""

    def __init__(self, width: int, sample: int, doorkeeper: bool = True) -> None:
        self.bits = max(4, (width - 1).bit_length())  # a power of two, at least 16 counters a row
        self.rows = [bytearray(1 << self.bits) for _ in _SEEDS]
        self.sample = sample
        self.additions = 0
        self.doorkeeper: set[int] | None = set() if doorkeeper else None

    def _slots(self, b: int) -> list[int]:
        shift = 64 - self.bits
        return [(((b + 1) * s) & _M64) >> shift for s in _SEEDS]

    def increment(self, b: int) -> None:
        if self.doorkeeper is not None and b not in self.doorkeeper:
            self.doorkeeper.add(b)
        else:
            for row, i in zip(self.rows, self._slots(b)):
                if row[i] < 15:
                    row[i] += 1
        self.additions += 1
        if self.additions >= self.sample:
            self._age()

    def _age(self) -> None:
        for row in self.rows:
            row[:] = row.translate(_HALF)
        self.additions //= 2
        if self.doorkeeper is not None:
            self.doorkeeper.clear()

    def estimate(self, b: int) -> int:
        est = min(row[i] for row, i in zip(self.rows, self._slots(b)))
        return est + (1 if self.doorkeeper is not None and b in self.doorkeeper else 0)


class WTinyLFU:
    """W-TinyLFU: window LRU, then TinyLFU admission into a segmented LRU main cache."""

    def __init__(self, cap: int, window: float = 0.01, protected: float = 0.8,
                 sketch: FrequencySketch | None = None) -> None:
        self.cap = cap
        self.w_cap = max(1, int(cap * window))
        self.main_cap = max(0, cap - self.w_cap)
        self.prot_cap = int(self.main_cap * protected)
        self.sketch = sketch if sketch is not None else FrequencySketch(cap, 10 * max(1, cap))
        self.window: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, b: int) -> bool:
        return b in self.window or b in self.probation or b in self.protected

    def __len__(self) -> int:
        return len(self.window) + len(self.probation) + len(self.protected)

    def hit(self, b: int) -> None:
        self.sketch.increment(b)
        if b in self.window:
            self.window.move_to_end(b)
        elif b in self.probation:
            del self.probation[b]
            self.protected[b] = None
            if len(self.protected) > self.prot_cap:
                v, _ = self.protected.popitem(last=False)
                self.probation[v] = None  # demoted to probation's most recent end
        else:
            self.protected.move_to_end(b)

    def rewrite(self, b: int) -> None:
        self.hit(b)

    def insert(self, b: int) -> int:
        self.sketch.increment(b)
        self.window[b] = None
        if len(self.window) <= self.w_cap:
            return 0
        cand, _ = self.window.popitem(last=False)
        if len(self.probation) + len(self.protected) < self.main_cap:
            self.probation[cand] = None
            return 0
        victims = self.probation if self.probation else self.protected
        if not victims:
            return 1  # no main cache at all (a capacity of one block): the candidate goes
        victim = next(iter(victims))
        if self.sketch.estimate(cand) > self.sketch.estimate(victim):
            del victims[victim]
            self.probation[cand] = None
        return 1


class IndexPolicy:
    """A shipped ``cache/`` index driven through the tier's calls (reserve, delete victims, add, forget)."""

    def __init__(self, index: object, size: int) -> None:
        self.idx = index
        self.size = size

    def __contains__(self, b: int) -> bool:
        return str(b) in self.idx  # type: ignore[operator]

    def __len__(self) -> int:
        return len(self.idx)  # type: ignore[arg-type]

    def hit(self, b: int) -> None:
        self.idx.touch(str(b))  # type: ignore[attr-defined]

    def _drop(self, victims: list[tuple[str, int]]) -> int:
        self.idx.forget(rel for rel, _ in victims)  # type: ignore[attr-defined]
        return len(victims)

    def insert(self, b: int) -> int:
        rel = str(b)
        n = self._drop(self.idx.reserve(self.size, rel))  # type: ignore[attr-defined]
        return n + self._drop(self.idx.add(rel, self.size, reserved=self.size))  # type: ignore[attr-defined]

    def rewrite(self, b: int) -> None:
        self.insert(b)  # the tier stores the file again: the index re-adds it as the most recent


class SecondSight:
    """CacheLib's reject-first admission: a block is written only when it was offered before, while the last
    ``window`` offered ids are remembered (a FIFO of ids, no data)."""

    def __init__(self, window: int) -> None:
        self.window = max(1, window)
        self.seen: OrderedDict[int, None] = OrderedDict()

    def begin(self, t: float, written: int) -> None:
        """Nothing: the decision is per block."""

    def admit(self, b: int) -> bool:
        if b in self.seen:
            del self.seen[b]
            return True
        self.seen[b] = None
        if len(self.seen) > self.window:
            self.seen.popitem(last=False)
        return False


class TargetRate:
    """Dynamic random admission to a target write rate (the idea of CacheLib's ``DynamicRandomAP``): each request's
    new blocks are written with probability ``p``; every ``period`` seconds of trace time ``p`` is scaled by the
    square root of target / observed bytes written in that period (damped, so one burst does not swing it), within
    [0.001, 1]. A coin per request, not per block: a request's new blocks are a chain, and a block written after
    a skipped one could never be found."""

    def __init__(self, bytes_per_s: float, period: float = 60.0, seed: int = 0) -> None:
        self.rate, self.period = bytes_per_s, period
        self.p = 1.0
        self._rng = random.Random(seed)
        self._start: float | None = None
        self._written0 = 0
        self._coin = True

    def begin(self, t: float, written: int) -> None:
        if self._start is None:
            self._start = t
        elif t - self._start >= self.period:
            seen = (written - self._written0) / (t - self._start)
            factor = (self.rate / seen) ** 0.5 if seen > 0 else 2.0
            self.p = min(1.0, max(0.001, self.p * factor))
            self._start, self._written0 = t, written
        self._coin = self._rng.random() < self.p

    def admit(self, b: int) -> bool:
        return self._coin
