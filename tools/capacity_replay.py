"""The block-level replay of tools/bench_capacity.py: one disk policy (an anchor from tools/capacity_policies.py or
a shipped ``cache/`` index), an optional admission setting, an optional vLLM CPU tier in front."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import capacity_policies as cp

BLOCK_TOKENS = 512


class Tally(Protocol):
    hit: int
    total: int
    written: int
    read: int
    evictions: int
    cpu_hit: int


def make_index(policy: str, budget: int) -> Any:
    """The index class a ``kvformat*`` policy names; ``kvformat-slru:0.3`` sets the protected share."""
    from kvformat.cache._arc import ArcLruIndex
    from kvformat.cache._ghost import GhostSegmentedIndex
    from kvformat.cache._lru import LRUIndex
    from kvformat.cache._prefix import PrefixIndex
    from kvformat.cache._slru import AdaptiveSegmentedIndex, SegmentedLRUIndex

    class SegmentedPrefixIndex(PrefixIndex, SegmentedLRUIndex):
        """Dead chunks first, then probation, then protected (the MRO chains the two subclasses)."""

    name, _, arg = policy.partition(":")
    if name == "kvformat":  # what the tier ships: eviction="ghost-slru"
        return GhostSegmentedIndex(budget)
    if name == "kvformat-lru":  # eviction="lru" (the tier's default before issue 45)
        return LRUIndex(budget)
    if name == "kvformat-prefix":
        return PrefixIndex(budget)
    if name in ("kvformat-slru", "kvformat-slru-prefix"):
        cls = SegmentedLRUIndex if name == "kvformat-slru" else SegmentedPrefixIndex
        return cls(budget, float(arg)) if arg else cls(budget)  # type: ignore[call-arg]
    if name == "kvformat-arc-lru":  # kvformat-arc-lru:arc / :lru follow one expert throughout (check rows)
        return ArcLruIndex(budget, expert=arg or None)
    if name == "kvformat-ghost":  # kvformat-ghost:0.3 starts the protected share at 0.3, :0.2:1 lets it reach 1
        start, _, most = arg.partition(":")
        return GhostSegmentedIndex(budget, float(start or 0.2), float(most or 0.8))
    if name == "kvformat-adaptive":
        return AdaptiveSegmentedIndex(budget, float(arg)) if arg else AdaptiveSegmentedIndex(budget)
    raise SystemExit(f"unknown kvformat policy {policy!r}")


ANCHORS = {"s3fifo": cp.S3FIFO, "w-tinylfu": cp.WTinyLFU, "arc": cp.ARC, "sieve": cp.Sieve, "lru": cp.LRU}


def make_block_policy(name: str, budget: int, size: int) -> cp.BlockPolicy:
    """A block-level policy for :func:`replay_blocks`: an anchor in blocks of ``size``, or a ``kvformat*`` index
    in bytes driven through the tier's calls."""
    base, _, arg = name.partition(":")
    if base == "s3fifo" and arg:  # s3fifo:T moves a block to the main queue after T hits in the small one
        return cp.S3FIFO(budget // size, threshold=int(arg))
    if base == "arc" and arg:  # arc:S starts ARC's target p at S x the capacity (the paper: 0)
        return cp.ARC(budget // size, start=float(arg))
    if base == "w-tinylfu" and arg:  # w-tinylfu:W sets the window's share of the capacity
        return cp.WTinyLFU(budget // size, window=float(arg))
    if name in ANCHORS:
        return ANCHORS[name](budget // size)  # type: ignore[no-any-return]
    if name.startswith("kvformat") and "prefix" not in name:
        return cp.IndexPolicy(make_index(name, budget), size)
    raise SystemExit(f"{name!r} cannot run with an admission setting or a CPU tier; expected one of "
                     f"{sorted(ANCHORS)} or a kvformat index without prefix links")


def make_admission(spec: str, budget: int, size: int) -> cp.SecondSight | cp.TargetRate:
    """``second-sight`` (remembers as many offered ids as the budget holds blocks) or ``dwpd:N`` (a target of N
    drive-writes per day of the budget)."""
    name, _, arg = spec.partition(":")
    if name == "second-sight":
        return cp.SecondSight(int(arg) if arg else budget // size)
    if name == "dwpd" and arg:
        return cp.TargetRate(float(arg) * budget / 86400)
    raise SystemExit(f"unknown admission {spec!r}; expected second-sight[:N] or dwpd:N")


def replay_blocks(trace: list[tuple[list[int], int]], times: list[float], budget: int, size: int, res: Tally,
                  tick: Callable[[], None], policy: str, cpu_cap: int = 0, cpu_touches_disk: bool = False) -> None:
    """One disk policy (``name[+admission]``), optionally behind vLLM's CPU tier: an LRU of ``cpu_cap`` blocks
    with the write-through cascade (every block stored goes to the CPU tier and to disk; a lookup asks the CPU
    tier first, then disk; a disk hit is promoted into the CPU tier; the disk tier does not see a CPU hit unless
    ``cpu_touches_disk``: a tier that refreshes recency when the request finishes, as vLLM's kvcr tier does)."""
    name, _, adm = policy.partition("+")
    disk = make_block_policy(name, budget, size)
    admission = make_admission(adm, budget, size) if adm else None
    cpu = cp.LRU(cpu_cap) if cpu_cap > 0 else None
    can_store = budget // size > 0
    for r, (blocks, n) in enumerate(trace):
        tick()
        res.total += n
        # Every key is looked up before any is loaded (vLLM's scheduler), so a promotion cannot evict a later hit.
        k = 0
        from_cpu: list[int] = []
        from_disk: list[int] = []
        while k < len(blocks):
            b = blocks[k]
            if cpu is not None and b in cpu:
                from_cpu.append(b)
            elif b in disk:
                from_disk.append(b)
            else:
                break
            k += 1
        # CPU hits are pinned while they load (vLLM's ref_cnt), so touch them before promotions make room.
        for b in from_cpu:
            cpu.hit(b)  # type: ignore[union-attr]
            if cpu_touches_disk and b in disk:
                disk.hit(b)
        for b in from_disk:
            disk.hit(b)
            if cpu is not None:
                cpu.insert(b)
        res.hit += k * BLOCK_TOKENS
        res.cpu_hit += len(from_cpu) * BLOCK_TOKENS
        res.read += len(from_disk) * size
        if admission is not None:
            admission.begin(times[r], res.written)
        storing = can_store
        for b in blocks[k:]:
            if cpu is not None:
                if b in cpu:
                    cpu.rewrite(b)  # vLLM's prepare_store skips a block the CPU tier holds: no cascade
                    continue
                cpu.insert(b)
            # A block offered after a rejected one is still offered (second-sight counts it), never written: with
            # its predecessor missing it could not be found.
            ok = admission.admit(b) if admission is not None else True
            storing = storing and ok
            if not storing:
                continue
            if b in disk:
                disk.rewrite(b)
            else:
                res.evictions += disk.insert(b)
            res.written += size
