"""The one assembly of the chunk cache (issue 44): :func:`open_cache` wires index -> row engines -> root ops ->
I/O pool over an opened store, so an adapter configures one :class:`Cache` instead of building its parts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, Mapping, Sequence, TypeVar

from ..format import CanonicalLayout, Provenance
from ..layout import RowPlan
from ..storage import Store
from ._autocodec import CompressionChoice
from ._config import TierConfig
from ._ghost import GhostSegmentedIndex
from ._jobs import CounterReport
from ._log import CacheLog
from ._lru import LRUIndex
from ._measure import auto_compression
from ._ops import RootOps
from ._pool import DualPool
from ._rows import RowEngine

K = TypeVar("K", bound=Hashable)


@dataclass
class Cache(Generic[K]):
    """What an adapter drives: one index, one row engine per plan (``engines``, then ``more`` over the same rows),
    the root-level side (``ops``: None for a reader that neither bounds nor scans the root), the I/O pool and
    the counters' report. The engines share counters, log, keyring and the root's health and bound. ``config``
    is the one the engines run with: ``compression="auto"`` replaced by the codec ``compression`` chose."""

    config: TierConfig
    store: Store
    index: LRUIndex
    engines: dict[K, RowEngine]
    ops: RootOps | None
    pool: DualPool
    report: CounterReport
    more: list[RowEngine] = field(default_factory=list)
    compression: CompressionChoice = CompressionChoice("none")

    @property
    def engine(self) -> RowEngine:
        """The first plan's engine (whose counters and log every engine shares)."""
        return next(iter(self.engines.values()))

    def all_engines(self) -> list[RowEngine]:
        return [*self.engines.values(), *self.more]


def open_cache(config: TierConfig, store: Store, plans: Mapping[K, RowPlan | CanonicalLayout], flat: memoryview, *,
               stride: int, copies: int, provenance: Provenance, on_removed: Callable[[list[str]], None],
               root_log: CacheLog | None, describe: str = "", engine_log: CacheLog | None = None,
               more: Sequence[RowPlan] = (), interleaved: bool = False,
               pool_name: str = "kvformat_tier") -> Cache[K]:
    """Assemble and start the cache of one engine over ``store`` (already open) and its rows ``flat``.

    ``plans``: one row plan per KV-cache group (the first one's engine is shared by the others); ``more``: further
    plans over the same rows (another naming of the same chunks). ``root_log``: the log of the root-level side
    (probe, shared bound, scan, health, summary line described by ``describe``), started here; None for a reader
    rank, whose index is unbounded. ``engine_log``: the first engine's log. If the start fails every engine is
    closed (no view of ``flat`` outlives it) and the error is raised. ``compression="auto"`` is decided here, before
    any engine exists, from the first plan's layout (:func:`_compression`).
    """
    choice = _compression(config, store, plans, root_log is not None)
    config = dataclasses.replace(config, compression=choice.codec)
    index = _index(config, root_log is not None)
    engines: dict[K, RowEngine] = {}
    first: RowEngine | None = None
    for k, plan in plans.items():
        engines[k] = RowEngine(store, plan, flat, stride, copies, config, provenance, index, on_removed, share=first,
                               interleaved=interleaved)
        first = first or engines[k]
    assert first is not None, "open_cache needs at least one plan"
    extra = [RowEngine(store, plan, flat, stride, copies, config, provenance, index, on_removed, share=first,
                       interleaved=interleaved) for plan in more]
    if engine_log is not None:
        first.log = engine_log
    ops = None
    if root_log is not None:
        ops = RootOps(store, config, index, [*engines.values(), *extra], root_log, describe=describe,
                      compression=choice)
        try:
            ops.start()  # raises (naming the parameter) rather than start a cache that can never store
        except BaseException:
            for eng in [*engines.values(), *extra]:
                eng.close()
            raise
    pool = DualPool(config.read_threads, config.write_threads, name=pool_name)
    return Cache(config, store, index, engines, ops, pool, CounterReport(first.counters, index), extra, choice)


def _index(config: TierConfig, writes: bool) -> LRUIndex:
    """The capacity index: unbounded on a reader rank (it never stores, so it never evicts), else the one
    ``eviction`` names."""
    bound = config.max_bytes if writes else None
    if config.eviction == "lru" or bound is None:
        return LRUIndex(bound)
    return GhostSegmentedIndex(bound)


def _compression(config: TierConfig, store: Store, plans: Mapping[K, RowPlan | CanonicalLayout],
                 writes: bool) -> CompressionChoice:
    """The codec this cache writes with: the operator's, or for ``"auto"`` the one measured on this root (a reader
    rank, which never stores, measures nothing). One decision per root: every plan's files get the same codec."""
    if config.compression != "auto":
        return CompressionChoice(config.compression)
    if not writes:
        return CompressionChoice("none", "auto", "auto: a reader rank stores nothing; nothing measured")
    plan = next(iter(plans.values()))
    layout = plan.layout if isinstance(plan, RowPlan) else plan
    return auto_compression(store, layout, config.compression_level)
