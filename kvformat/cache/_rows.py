"""Primary row <-> kvformat file, one chunk at a time. No vLLM import: the tier feeds it row offsets.

A primary row holds ``copies`` slots of ``slot`` bytes each (one per worker, or a single
replicated/canonical slot) followed by padding; a slot is exactly the canonical payload. Stores
write slot 0 (after checking the other slots are the same bytes); loads read into slot 0 and copy
it into the other slots.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Any, Callable

import numpy as np

from ..format._block import encode_block
from ..format._header import check_layout
from ..format._paths import hash_relpath
from ..format._spec import BlockKey, CanonicalLayout, Provenance
from ..layout._rules import RowPlan
from ..errors import ChecksumError, KVFormatError, LayoutMismatchError, ReplicaMismatchError
from ..format._fused import read_into_fused, write_block_fused
from ..format._native import xxh3_64
from ..storage import Store
from ..storage._local import LocalStore
from ._config import TierConfig
from ._lru import LRUIndex
from ._counters import COUNTERS as COUNTERS, Counters
from ._pool import BatchWorker
from ._scan import scan_root

logger = logging.getLogger("kvformat.vllm")

WRITTEN, EXISTS, REPLICA_MISMATCH, FAILED = "written", "exists", "replica_mismatch", "failed"
CANCELLED = "cancelled"  # a store that never ran: the tier shut down first
# A load refreshes the file's mtime (the LRU order a restart rebuilds) at most this often: a utime per
# load cost ~10% of a tmpfs load, and a restart's LRU order only needs to be right to within minutes.
TOUCH_INTERVAL_S = 300.0
# A store that finds its file being evicted (or replaced) by another thread retries; only a cache churning
# the same file faster than this gives up (reported FAILED: nothing was stored).
STORE_ATTEMPTS = 4

class RowEngine:
    """Moves chunks between the primary rows and a Store, keeping the LRU index and counters."""

    def __init__(self, store: Store, plan: RowPlan | CanonicalLayout, flat: memoryview, stride: int, copies: int,
                 cfg: TierConfig, provenance: Provenance, index: LRUIndex,
                 on_removed: Callable[[list[str]], None], share: "RowEngine | None" = None,
                 interleaved: bool = False) -> None:
        if isinstance(plan, CanonicalLayout):  # a payload that is the whole slot, as stored
            n = plan.payload_bytes
            plan = RowPlan(plan, n, ((0, 0, n, 1, n, n),), "layer_outer", "payload")
        self.store = store
        self.plan = plan
        self.layout = layout = plan.layout
        self.ns = layout.namespace()
        self.flat = flat
        self.stride = stride
        self.copies = copies
        self.slot = plan.slot_bytes  # one worker's slot in the row
        self.payload_bytes = layout.payload_bytes
        self.cfg = cfg
        self.provenance = provenance
        self.index = index
        self.on_removed = on_removed
        # Engines of one tier (one per KV-cache group) share counters and log-once state.
        self.counters: Counters = share.counters if share is not None else Counters()
        self._warned: set[str] = share._warned if share is not None else set()
        self._warn_lock: threading.Lock = share._warn_lock if share is not None else threading.Lock()
        self._scratch = threading.local()
        if plan.shards and sorted(w for sh in plan.shards for w in sh.slots) != list(range(copies)):
            # Every worker slot belongs to exactly one shard, else a stage or DCP rank would be missing.
            raise ValueError(f"the plan's shards do not cover the row's {copies} worker slots exactly once")
        # A row's slots fit its stride; an interleaved buffer (a layer-first host pool: chunk i's page of each
        # layer lies a whole layer apart, chunk i+1's right after it) has windows that overlap the next chunk's,
        # each chunk's runs touching only its own pages.
        if copies * self.slot > stride and not (interleaved and copies == 1):
            raise ValueError(f"{copies} slots of {self.slot} bytes do not fit a primary row of {stride} bytes")
        # The row bytes one chunk occupies (what a store that finds the file already there saves).
        self.chunk_row_bytes = self.payload_bytes if interleaved else copies * self.slot
        # The fan-out copies with ctypes.memmove: it releases the GIL (fan-outs of several loads run on
        # several cores) and is the fastest copy measured here (plain memcpy; numpy's copy was slower).
        self._arr: np.ndarray | None = np.frombuffer(flat, dtype=np.uint8) if copies > 1 and len(flat) else None
        self._addr = int(self._arr.ctypes.data) if self._arr is not None else 0
        self._mtimes: dict[str, float] = {}  # relpath -> last known file mtime (written, scanned, touched)
        # Local buffered stores take the fused paths (one read / one write per chunk, payload hashed in the
        # same pass: kvformat._native); O_DIRECT reads and remote stores keep the Store calls.
        # Exactly a LocalStore: a subclass may override put/read_into, and the fused path would bypass it.
        self._fuse_allowed = os.environ.get("KVFORMAT_NO_FUSED") != "1"
        self._o_direct = getattr(store, "o_direct", "off") != "off"
        # File mtime is the LRU clock a restart rebuilds from; loads hand their touches to this thread.
        self.toucher = BatchWorker(self._touch_batch, name="kvformat_tier_touch")

    def _touch_batch(self, rels: list[str]) -> None:
        for rel in rels:
            # Pinned while touched: a remote touch may rewrite the file, and an eviction racing it would
            # leave a file on storage that the index no longer counts.
            self.index.pin(rel)
            try:
                if rel in self.index:
                    self.store.touch(rel)
            except OSError as e:
                self.warn_once(f"touch:{type(e).__name__}", "kvformat tier: touching %s failed: %s", rel, e)
            finally:
                self._unpin(rel)

    def close(self) -> None:
        """Drop every view of the primary buffer (vLLM unmaps it after the tier shuts down)."""
        self.toucher.close(0)
        self._arr = None
        self.flat = memoryview(b"")

    # -- helpers -----------------------------------------------------------------------------------
    def relpath(self, h: str) -> str:
        return hash_relpath(self.ns, h)

    def warn_once(self, reason: str, msg: str, *args: Any) -> None:
        with self._warn_lock:
            if reason in self._warned:
                return
            self._warned.add(reason)
        logger.warning(msg + " (logged once per reason; see the tier's counters)", *args)

    def _unpin(self, rel: str) -> None:
        if self.index.unpin(rel):  # the bound skipped this file while pinned: evict now, not at some later write
            self.delete_victims(self.index.victims())

    def delete_victims(self, victims: list[tuple[str, int]]) -> None:
        if not victims:
            return
        gone = []
        try:
            for rel, size in victims:
                self._mtimes.pop(rel, None)
                try:
                    self.store.delete(rel)
                except OSError as e:  # still counted as evicted: it is out of the index either way
                    self.warn_once("evict_error", "kvformat tier: could not delete %s: %s", rel, e)
                gone.append(rel)
                self.counters.add(evictions=1, evicted_bytes=size)
        finally:
            # Every victim stops being doomed, deleted or not: a store waiting to rewrite it proceeds.
            self.index.forget(rel for rel, _ in victims)
        self.on_removed(gone)

    def quarantine(self, rel: str, err: KVFormatError) -> None:
        reason = err.reason
        self.index.remove(rel)
        self._mtimes.pop(rel, None)
        try:
            moved = self.store.quarantine(rel, reason)
        except OSError as e:
            moved = None
            self.warn_once("quarantine_error", "kvformat tier: could not quarantine %s: %s", rel, e)
        self.counters.add(corrupt_files=1, checksum_failures=int(isinstance(err, ChecksumError)),
                          layout_mismatches=int(isinstance(err, LayoutMismatchError)))
        self.counters.add_quarantine(reason)
        self.warn_once(reason, "kvformat tier: %s; served as a miss, file moved to %s", err, moved)
        self.on_removed([rel])

    # -- store ---------------------------------------------------------------------------------
    def store_chunk(self, h: str, chunk_id: int) -> tuple[str, int]:
        """Write chunk ``chunk_id``'s canonical payload as block ``h``. Returns (outcome, bytes written)."""
        rel = self.relpath(h)
        if self.index.touch(rel):
            self.counters.add(dedup_saved_bytes=self.chunk_row_bytes)
            return EXISTS, 0
        base = chunk_id * self.stride
        digests: list[int] | None = None
        if self.plan.shards:
            sharded = self._gather_shards(h, base)
            if sharded is None:
                return REPLICA_MISMATCH, 0
            payload = sharded
        else:
            payload = self._payload_of(base)
        if self.copies > 1 and self.cfg.replica_policy == "verify" and not self.plan.shards:
            digests = [xxh3_64(payload if r == 0 else self._payload_of(base + r * self.slot, 1))  # native: no GIL
                       for r in range(self.copies)]
            if self._replicas_differ(h, digests, "the worker slots"):
                return REPLICA_MISMATCH, 0
        key = BlockKey(h, self.layout.group)
        prov = Provenance(**{**self.provenance.to_dict(), "created": int(time.time())})
        fuse = self._fused and digests is None and self.cfg.compression == "none"
        # The replicas not written (a sharded row holds the payload once across its shards).
        saved = (max(0, self.copies * self.slot - self.payload_bytes) if self.plan.shards
                 else (self.copies - 1) * self.slot)
        hdr, data, _ = encode_block(payload, self.layout, key, provenance=prov, codec=self.cfg.compression,
                                    level=self.cfg.compression_level,
                                    payload_xxh3=digests[0] if digests else (0 if fuse else None))
        size = len(hdr) + len(data)
        for attempt in range(STORE_ATTEMPTS):
            if attempt and self.index.touch(rel):  # the store we waited for (wait_gone) indexed the file
                self.counters.add(dedup_saved_bytes=self.chunk_row_bytes)
                return EXISTS, 0
            # Reserved for rel: until add/release no other thread indexes the file this put publishes, so
            # no eviction can delete it before our add (which would then index a ghost).
            victims = self.index.reserve(size, rel)
            try:
                self.delete_victims(victims)
                wrote = (self._put_fused(rel, hdr, data) if fuse
                         else self.store.put(rel, [hdr, data], overwrite=False, fsync=self.cfg.fsync))
            except BaseException:
                self.index.release(size, rel)
                raise
            if wrote:
                self._mtimes[rel] = time.time()
                self.delete_victims(self.index.add(rel, size, reserved=size))
                self.counters.add(bytes_written=size, files_written=1, dedup_saved_bytes=saved)
                return WRITTEN, size
            self.index.release(size, rel)
            # Another writer (instance, TP size) was first, or the file is a victim being deleted. The
            # pin, taken before the header read, makes add_found refuse a file evicted meanwhile.
            since = self.index.pin(rel)
            try:
                existing = self._check_existing(rel, key)
                if existing is not None and self.index.add_found(rel, existing, since):
                    self.counters.add(dedup_saved_bytes=self.chunk_row_bytes)
                    return EXISTS, 0
            finally:
                self._unpin(rel)
            self.index.wait_gone(rel)  # an eviction or another store of this file is finishing
        return FAILED, 0

    def _gather_shards(self, h: str, base: int) -> memoryview | None:
        """The payload assembled from every shard of a pipeline/DCP row (each pipeline stage's layers, each
        DCP rank's tokens), after checking each shard's TP replicas hold the same bytes; None if not."""
        out = self._buffer(0)
        for shard in self.plan.shards:
            first = base + shard.slots[0] * self.slot
            if len(shard.slots) > 1 and self.cfg.replica_policy == "verify":
                digests = [xxh3_64(self.flat[base + w * self.slot:base + w * self.slot + shard.used])
                           for w in shard.slots]
                if self._replicas_differ(h, digests, f"workers {list(shard.slots)} of one pipeline stage / DCP rank"):
                    return None
            self.plan.gather_shard(shard, self.flat[first:first + self.slot], out)
        return out

    def _replicas_differ(self, h: str, digests: list[int], what: str) -> bool:
        """Count and log (once) a chunk whose replicas' digests differ; True if they do."""
        if len(set(digests)) == 1:
            return False
        err = ReplicaMismatchError([f"{d:016x}" for d in digests])
        self.counters.add(replica_mismatches=1)
        self.warn_once("ReplicaMismatchError", "kvformat tier: chunk %s not stored: %s differ: %s. The model's KV "
                       "is not replicated across workers; kvformat stores only replicated (MLA) KV", h, what, err)
        return True

    def _buffer(self, i: int) -> memoryview:
        bufs = getattr(self._scratch, "bufs", None)
        if bufs is None:
            bufs = self._scratch.bufs = [memoryview(bytearray(self.payload_bytes)) for _ in range(2)]
        buf: memoryview = bufs[i]
        return buf

    def _payload_of(self, slot_base: int, scratch: int = 0) -> memoryview:
        """The canonical payload of the slot at ``slot_base``: a view of the row when the plan keeps it
        contiguous, else gathered into a per-thread scratch buffer (block-outer or multi-group rows)."""
        if self.plan.contiguous:
            return self.flat[slot_base:slot_base + self.payload_bytes]
        out = self._buffer(scratch)
        self.plan.gather(self.flat[slot_base:slot_base + self.slot], out)
        return out

    def _check_existing(self, rel: str, key: BlockKey) -> int | None:
        """Size of a valid existing file; None after quarantining an invalid one (or if it vanished)."""
        try:
            hdr: Any = self.store.read_header(rel, verify=True)
        except (FileNotFoundError, KVFormatError) as e:
            hdr = e
        return self._accept_header(rel, key, hdr)

    def _accept_header(self, rel: str, key: BlockKey, hdr: Any) -> int | None:
        """Size of the file whose header (or read error) is ``hdr`` if it is valid for ``key``; else None,
        quarantining a file that is there but wrong. Other OS errors propagate (the caller decides)."""
        if isinstance(hdr, FileNotFoundError):
            return None
        if isinstance(hdr, BaseException) and not isinstance(hdr, KVFormatError):
            raise hdr
        try:
            if isinstance(hdr, KVFormatError):
                raise hdr
            if hdr.key != key:
                raise LayoutMismatchError("key", key.to_str(), hdr.key.to_str())
            check_layout(hdr.layout, self.layout)
        except KVFormatError as e:
            self.quarantine(rel, e.with_path(rel))
            return None
        return int(hdr.file_bytes)

    # -- fused local I/O (kvformat._native) --------------------------------------------------------
    @property
    def _fused(self) -> bool:
        # Checked per call: the store may be swapped (tests) and a subclass's put/read_into must not be bypassed.
        return self._fuse_allowed and type(self.store) is LocalStore

    def _put_fused(self, rel: str, hdr: bytes, data: Any) -> bool:
        """store.put of header + payload in one pass; ``hdr`` carries a zero kvf.dxxh3 that the write patches."""
        wrote, _ = write_block_fused(self.store._abs(rel), hdr, data, fsync=self.cfg.fsync,  # type: ignore[attr-defined]
                                     overwrite=False, o_direct=self._o_direct)
        return wrote

    def _read_into(self, rel: str, dst: memoryview, key: BlockKey) -> Any:
        if self._fused:  # one read of header + payload; dst is ours, zeroed on any failure
            return read_into_fused(self.store._abs(rel), dst, expect=self.layout, key=key,  # type: ignore[attr-defined]
                                   verify=self.cfg.verify, o_direct=self._o_direct)
        return self.store.read_into(rel, dst, expect=self.layout, key=key, verify=self.cfg.verify)

    # -- load ----------------------------------------------------------------------------------
    def load_chunk(self, h: str, chunk_id: int) -> int | None:
        """Read block ``h`` into chunk ``chunk_id`` (fanned out to every slot). Bytes read, or None (a miss)."""
        rel = self.relpath(h)
        base = chunk_id * self.stride
        since = self.index.pin(rel)
        try:
            dst = self.flat[base:base + self.payload_bytes] if self.plan.contiguous else self._buffer(0)
            try:
                hdr = self._read_into(rel, dst, BlockKey(h, self.layout.group))
            except FileNotFoundError:
                self.index.remove(rel, since)  # kept if a store indexed a file published after this read
                self.counters.add(missing_files=1)
                self.on_removed([rel])
                return None
            except KVFormatError as e:
                self.quarantine(rel, e)
                return None
            except OSError as e:
                self.index.remove(rel, since)
                self.counters.add(io_errors=1)
                self.warn_once(f"OSError{e.errno}", "kvformat tier: reading %s failed: %s; served as a miss", rel, e)
                return None
            if self.plan.shards:
                for shard in self.plan.shards:
                    # Scatter (strided, per token run) into one slot of the shard, then copy its used bytes
                    # whole into the replicas (a GIL-free memmove: the fan-out of a per-worker row).
                    first = base + shard.slots[0] * self.slot
                    self.plan.scatter_shard(shard, dst, self.flat[first:first + self.slot])
                    for w in shard.slots[1:]:
                        ctypes.memmove(self._addr + base + w * self.slot, self._addr + first, shard.used)
            elif not self.plan.contiguous:
                for r in range(self.copies):
                    self.plan.scatter(dst, self.flat[base + r * self.slot:base + (r + 1) * self.slot])
            elif self._arr is not None:
                src = self._addr + base
                for r in range(1, self.copies):
                    ctypes.memmove(src + r * self.slot, src, self.payload_bytes)
            if not self.index.touch(rel) and self.index.add_found(rel, hdr.file_bytes, since):
                self.delete_victims(self.index.victims())
            now = time.time()
            if now - self._mtimes.get(rel, 0.0) > TOUCH_INTERVAL_S:
                self._mtimes[rel] = now
                self.toucher.submit(rel)  # off the load's path: a touch is a server-side copy on S3
            self.counters.add(bytes_read=hdr.file_bytes, files_read=1)
            return int(hdr.file_bytes)
        finally:
            self._unpin(rel)

    # -- lookup of a file the index does not know (written by another instance) ------------------
    def probe_many(self, hs: list[str]) -> list[bool]:
        """:meth:`probe` for many blocks with one batched header read (one round trip on remote roots).

        A block whose header cannot be read now (storage unreachable) is reported absent: a miss, never a
        false hit.
        """
        rels = [self.relpath(h) for h in hs]
        todo = [i for i, r in enumerate(rels) if r not in self.index]
        if todo:
            pinned = [rels[i] for i in todo]
            # before the reads: an eviction meanwhile makes add_found refuse the file
            since = [self.index.pin(rel) for rel in pinned]
            try:
                got: list[Any] = self.store.read_headers_many(pinned, verify=True)
                for i, hdr, t in zip(todo, got, since):
                    try:
                        size = self._accept_header(rels[i], BlockKey(hs[i], self.layout.group), hdr)
                    except OSError as e:
                        self.warn_once(f"probe:{type(e).__name__}", "kvformat tier: lookup failed: %s", e)
                        size = None
                    if size is not None:
                        self.index.add_found(rels[i], size, t)
            finally:
                for rel in pinned:
                    self.index.unpin(rel)
            self.delete_victims(self.index.victims())
        return [r in self.index for r in rels]

    # -- start-up ----------------------------------------------------------------------------------

    def scan(self, stop: threading.Event) -> None:
        """Rebuild usage and LRU order from the files under the root (a background thread): see _tier._scan."""
        scan_root(self, stop)
