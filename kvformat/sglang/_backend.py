"""kvformat as an SGLang (0.5.23) HiCache storage backend: :class:`KVFormatHiCache`.

Enable it with SGLang's dynamic backend loader (docs/sglang.md has every parameter)::

    --page-size 64 --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvformat", "module_path": "kvformat.sglang",
        "class_name": "KVFormatHiCache", "interface_v1": 1, "root": "/mnt/kvcache", "max_bytes": "500GiB"}'

Each page is one kvformat file holding the canonical payload (per layer, the page's latents), whatever the
host layout and TP size: SGLang's storage writer (one rank per TP group) stores it, every rank reads it
straight into its host pool (zero-copy for ``page_first_direct``, a strided copy for the other two), header
identity checked and checksums verified on every read; a bad file is a miss, quarantined and logged once.
``max_bytes`` bounds the files (LRU, rebuilt from file mtimes at start-up by the writer rank). All of it is
:mod:`kvformat.cache`'s engine-neutral chunk engine; this module only translates SGLang's calls.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

# Probe first, so a missing SGLang (or one missing an import-time dependency) says how to fix it.
try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
except ImportError as _e:
    raise ImportError(f'kvformat.sglang needs SGLang 0.5.23 with HiCache storage: pip install "kvformat[sglang]" '
                      f'(import failed: {_e})', name=_e.name) from _e

import torch

from ..format import Provenance, __version__
from ..cache import EXISTS, WRITTEN, CacheLog, RootOps, RowEngine, TierConfig, open_cache, shutdown_bounded
from ..errors import SchemaError
from ..storage import open_store, split_root
from ._facts import PageFacts, page_facts, page_plan

__all__ = ["KVFormatHiCache"]

logger = logging.getLogger("kvformat.sglang")

# Keys of the extra config SGLang itself reads (the dynamic loader's, the controller's); ignored here.
_SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "file_storage_path", "tp_lcm_size")
# kvformat's cache parameters, shared with the vLLM tier (kvformat.cache._config).
_CACHE_KEYS = ("root", "read_threads", "write_threads", "compression", "compression_level", "verify", "max_bytes",
               "o_direct", "fsync", "model_revision", "storage_options", "key_scheme", "start_degraded",
               "shared_allowance", "shared_interval_s", "seal", "seal_key", "seal_read_keys", "read_deadline_s",
               "eviction")
# Facts SGLang does not pass to a storage backend (kvformat.sglang._facts).
_FACT_KEYS = ("model", "kv_cache_dtype", "rope", "quantization")
_KEY_RE = re.compile(r"[0-9a-f]{2,128}")


class KVFormatHiCache(HiCacheStorage):
    """SGLang HiCache storage backend storing each MLA page once, as a checksummed, TP-independent kvformat file.

    Parameters (SGLang's ``--hicache-storage-backend-extra-config``; see docs/sglang.md)
    ----------
    root: directory (or fsspec URL) holding the namespaces (required).
    interface_v1: must be 1 (SGLang then calls the zero-copy batch_get_v1 / batch_set_v1).
    read_threads, write_threads, compression, compression_level, verify, max_bytes, o_direct, fsync,
    storage_options, start_degraded, shared_allowance, shared_interval_s, seal, seal_key, seal_read_keys: as for
    the vLLM tier (docs/vllm.md, docs/sealed.md). The storage writer rank runs the root-level side the vLLM
    tier runs (kvformat.cache's RootOps: start-up probe, the shared root's bound, health watch, scan).
    key_scheme: ``"engine"`` (default: SGLang's own namespace) or ``"token-chain"`` (files vLLM's tier with the
        same scheme reads and writes; needs ``rope``).
    model: model id for the identity (default: SGLang's served model name).
    model_revision: model revision (default: SGLang's ``--revision`` when the server args are set).
    kv_cache_dtype: ``"fp8_e4m3"`` / ``"fp8_e5m2"`` for an fp8 cache (SGLang's host pool holds uint8).
    rope: ``"interleaved"`` or ``"neox"``: the model's RoPE convention (token-chain only).
    quantization: the weights' quantization as vLLM names it (token-chain: vLLM pins its own; default: SGLang's
        ``--quantization`` when the server args are set).

    Raises
    ------
    SchemaError (a ValueError) for a bad or unknown parameter, or a deployment it cannot store (named: not
    MLA, DSA, MTP draft layers, PP/CP/DCP, an unknown host layout, an fp8 cache of unknown dtype), when SGLang
    constructs it or registers its host pool.
    """

    #: Bound on :meth:`close` (seconds).
    shutdown_timeout_s: float = 10.0

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - set(_SGLANG_KEYS + _CACHE_KEYS + _FACT_KEYS))
        if unknown:
            raise SchemaError("extra_config", f"unknown parameter(s) {', '.join(unknown)} (docs/sglang.md lists them)")
        if not extra.get("interface_v1"):
            raise SchemaError("interface_v1", "kvformat implements SGLang's zero-copy v1 storage interface: set "
                              "\"interface_v1\": 1 in the extra config")
        self.config = TierConfig.parse(extra.get("root"), **{k: extra[k] for k in _CACHE_KEYS if k in extra and
                                                            k != "root"})
        self.storage_config = storage_config
        self._extra = extra
        root = self.config.root
        if not split_root(root)[0]:
            self.store = open_store(root, o_direct=self.config.o_direct)
        else:
            self.store = open_store(root, **self.config.storage_options)
        self.facts: PageFacts | None = None
        self.engine: RowEngine | None = None
        self.ops: RootOps | None = None  # the storage writer rank's root-level side (_attach)
        self._attach_lock = threading.Lock()
        self._stop = threading.Event()
        self._stats_lock = threading.Lock()
        self._stats: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                               "backup_bandwidth": []}

    # -- attaching to the host pool ---------------------------------------------------------------
    def on_host_pools_registered(self) -> None:
        """SGLang registered its host pool(s): derive the identity and start the cache (raising refuses it)."""
        self._attach()

    def _attach(self) -> RowEngine:
        with self._attach_lock:
            if self.engine is not None:
                return self.engine
            others = sorted(str(n) for n in getattr(self, "registered_pools", {}) if str(n) != "kv")
            if others:
                raise SchemaError("pools", f"sidecar host pools {others} (DSA indexer, MTP draft, Mamba …) are not "
                                  "supported yet: their pages would be missing from the cache")
            pool = getattr(self, "mem_pool_host", None)
            if pool is None:
                raise SchemaError("pools", "SGLang registered no host KV pool with the backend")
            facts = page_facts(self.storage_config, pool, self._extra, self.config.key_scheme)
            layout = facts.layout()
            if self.config.seal != "off":  # the namespace says how files are sealed (as sealed_plans does)
                layout = layout.with_seal(self.config.seal)
            plan, stride, interleaved = page_plan(facts, layout)
            flat = _host_bytes(pool)
            _check_placement(pool, facts, stride, flat)
            # One writer per TP group (SGLang's is_storage_writer) bounds and scans the root (the same root-level
            # side as the vLLM tier: probe, raising naming the parameter, the shared root's bound with every other
            # engine on it, health watch, scan, summary line); the other ranks only read, and never evict what the
            # writer accounts for.
            prov = Provenance(tp=max(1, facts.tp_size), row="replicated",
                              writer=f"kvformat {__version__} (sglang {facts.host_layout})")
            self.cache = open_cache(self.config, self.store, {0: plan}, flat, stride=stride, copies=1,
                                    provenance=prov, on_removed=_no_events, interleaved=interleaved,
                                    root_log=CacheLog(logger, prefix=f"kvformat hicache {facts.host_layout}")
                                    if facts.writer else None, pool_name="kvformat_hicache",
                                    describe=f"SGLang {facts.host_layout} pages of {facts.page_tokens} tokens, "
                                             f"namespace {layout.namespace()} ({self.config.key_scheme} keys)")
            eng, self.index, self.ops = self.cache.engine, self.cache.index, self.cache.ops
            self._flat, self._io, self._report = flat, self.cache.pool, self.cache.report
            if self.ops is not None:
                self._stop = self.ops.stop
            else:
                self._scan = threading.Thread(target=_nothing, args=(self._stop,), name="kvformat_hicache_scan",
                                              daemon=True)
                self._scan.start()
            self.facts, self.layout, self.engine = facts, layout, eng
            logger.info("KVFormatHiCache at %s: namespace %s (%s keys), %s host pages of %d tokens, %s rank, "
                        "max_bytes=%s; facts from %s", root_repr(self.store), layout.namespace(),
                        self.config.key_scheme, facts.host_layout, facts.page_tokens,
                        "writer" if facts.writer else "reader", self.config.max_bytes, dict(facts.sources))
            return eng

    # -- the v1 interface -------------------------------------------------------------------------
    def _pages(self, keys: list[str], host_indices: Any) -> list[int] | None:
        eng = self._attach()
        assert self.facts is not None
        n = self.facts.page_tokens
        idx = host_indices.tolist() if hasattr(host_indices, "tolist") else list(host_indices)
        if len(idx) != len(keys) * n:
            eng.warn_once("sglang:indices", "kvformat backend: %d host indices for %d pages of %d tokens; refused",
                          len(idx), len(keys), n)
            return None
        starts = idx[::n]
        if any(s % n for s in starts):
            eng.warn_once("sglang:unaligned", "kvformat backend: a page starts at host index %s, not on a page "
                          "boundary; refused", next(s for s in starts if s % n))
            return None
        return [s // n for s in starts]

    def _key_ok(self, eng: RowEngine, key: str) -> bool:
        if isinstance(key, str) and _KEY_RE.fullmatch(key):
            return True
        eng.warn_once("sglang:key", "kvformat backend: page key %r is not a hex hash; served as a miss", key)
        return False

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store each page (the storage writer only: other ranks report whether the page is stored)."""
        eng = self._attach()
        assert self.facts is not None
        if not self.facts.writer:
            return self._exists_each(eng, keys)
        pages = self._pages(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        t0 = time.perf_counter()
        fns = [_store(eng, k, p) if self._key_ok(eng, k) else _false for k, p in zip(keys, pages)]
        out = [r in (WRITTEN, EXISTS) for r in self._io.map(fns, load=False)]
        self._note("backup", sum(out), time.perf_counter() - t0)
        return out

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read each page into the host pool; False (a miss) for a page absent, corrupt or of another identity."""
        eng = self._attach()
        pages = self._pages(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        t0 = time.perf_counter()
        fns = [_load(eng, k, p) if self._key_ok(eng, k) else _none for k, p in zip(keys, pages)]
        out = [r is not None for r in self._io.map(fns, load=True)]
        self._note("prefetch", sum(out), time.perf_counter() - t0)
        return out

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, are stored (a header that cannot be read counts as absent)."""
        hits = self._exists_each(self._attach(), keys)
        return hits.index(False) if False in hits else len(hits)

    def _exists_each(self, eng: RowEngine, keys: list[str]) -> list[bool]:
        if self._stop.is_set():
            return [False] * len(keys)
        ok = [self._key_ok(eng, k) for k in keys]
        found = iter(eng.probe_many([k for k, good in zip(keys, ok) if good]))
        return [next(found) if good else False for good in ok]

    def _note(self, what: str, pages: int, seconds: float) -> None:
        if not pages or self.facts is None:
            return
        gb = pages * self.facts.page_bytes * self.facts.n_layers / 1e9
        with self._stats_lock:
            self._stats[f"{what}_pgs"].append(pages)
            self._stats[f"{what}_bandwidth"].append(gb / max(seconds, 1e-9))

    # -- the legacy per-page interface: SGLang does not call it with interface_v1 ----------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        raise SchemaError("interface_v1", "KVFormatHiCache serves SGLang's zero-copy v1 interface only "
                          "(batch_get_v1 / batch_set_v1), which SGLang uses when interface_v1 is 1")

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None] | int:
        self.get(keys[0] if keys else "")
        return 0

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        self.get(key)
        return False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        self.get(keys[0] if keys else "")
        return False

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- operations -------------------------------------------------------------------------------
    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s per prefetch/backup batch) since the previous call."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._stats_lock:
            for k, v in self._stats.items():
                getattr(m, k).extend(v)
                v.clear()
        return m

    def counters(self) -> dict[str, float]:
        """kvformat's cumulative counters (as the vLLM tier's: files and bytes read/written, quarantined files
        by reason, evictions, ``used_bytes``, ``files``, and with ``eviction="ghost-slru"`` ``protected_share``)."""
        self._attach()
        return self._report.totals()

    def wait_scanned(self, timeout: float | None = None) -> bool:
        """Block until the writer's start-up scan of the root has finished (tests, tools)."""
        self._attach()
        scan = self._scan_thread()
        scan.join(timeout)
        return not scan.is_alive()

    def clear(self) -> None:
        """Delete this deployment's files (its namespace) from the root: the storage writer only."""
        eng = self._attach()
        assert self.facts is not None
        if not self.facts.writer:
            return
        gone = [e for e in self.store.list(self.layout.namespace())]
        eng.delete_victims([(e.relpath, e.size) for e in gone])
        for e in gone:
            self.index.remove(e.relpath)
        logger.info("KVFormatHiCache: cleared %d files of namespace %s", len(gone), self.layout.namespace())

    def _scan_thread(self) -> threading.Thread:
        """The writer's start-up scan (RootOps starts it again after a degraded start), or a reader's no-op."""
        return self.ops.scan if self.ops is not None else self._scan

    def close(self) -> None:
        """Stop within ``shutdown_timeout_s``: queued reads and writes fail, running ones finish."""
        if self.engine is None:
            self.store.close()
            return
        if not shutdown_bounded(self.shutdown_timeout_s, self._stop, [self.engine], self._io, self._scan_thread(),
                                _nothing, self._flat):
            logger.warning("KVFormatHiCache: close gave up after %.0f s waiting for storage I/O at %s",
                           self.shutdown_timeout_s, root_repr(self.store))
        if self.ops is not None:  # after the stores: the last journal (or the released lease) counts them all
            self.ops.close(min(5.0, self.shutdown_timeout_s / 2))


def _host_bytes(pool: Any) -> memoryview:
    """The host pool's KV buffer as writable bytes (a view: the pool keeps the tensor alive)."""
    buf = pool.kv_buffer
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
        raise SchemaError("host_layout", "SGLang's host KV buffer is not one contiguous CPU tensor")
    return memoryview(buf.view(torch.uint8).reshape(-1).numpy()).cast("B")


def _check_placement(pool: Any, facts: PageFacts, stride: int, flat: memoryview) -> None:
    """Refuse unless SGLang's own page addressing (``get_page_buffer_meta``) puts the first and last pages where
    :func:`~kvformat.sglang.page_plan` does: a host layout that changed under us must not be read as another."""
    n = facts.page_tokens
    base = pool.kv_buffer.data_ptr()
    layer = facts.host_tokens * facts.page_bytes // n
    for page in sorted({0, facts.host_tokens // n - 1}):
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page * n, (page + 1) * n))
        if facts.host_layout == "layer_first":
            want = [(page * stride + l * layer, facts.page_bytes) for l in range(facts.n_layers)]
        else:
            want = [(page * stride, facts.page_bytes * facts.n_layers)]
        got = [(p - base, s) for p, s in zip(ptrs, sizes)]
        if got != want or want[-1][0] + want[-1][1] > len(flat):
            raise SchemaError("host_layout", f"SGLang places page {page} of its {facts.host_layout} pool at "
                              f"{got[:2]}…, not where kvformat expects {want[:2]}…; refused")


def root_repr(store: Any) -> str:
    return str(getattr(store, "root", store))


def _store(eng: RowEngine, key: str, page: int) -> Any:
    def run() -> str:
        try:
            return eng.store_chunk(key, page)[0]
        except Exception as e:  # OSError (ENOSPC …) or a bug: this page is not stored
            eng.warn_once(f"store:{type(e).__name__}", "kvformat backend: storing a page failed: %s", e)
            return "error"
    return run


def _load(eng: RowEngine, key: str, page: int) -> Any:
    def run() -> int | None:
        try:
            return eng.load_chunk(key, page)
        except Exception as e:
            eng.warn_once(f"load:{type(e).__name__}", "kvformat backend: loading a page failed: %s", e)
            return None
    return run


def _false() -> str:
    return "invalid"


def _none() -> None:
    return None


def _nothing(*_: Any) -> None:
    return None


def _no_events(_: list[str]) -> None:
    """SGLang has no storage events: removals need no announcement."""
