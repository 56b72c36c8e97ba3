"""The row engine's common part: its construction, the per-thread buffers, and what takes a file out of the
cache (eviction's deletes, the quarantine of a file a read found bad, the header checks that find one).

A primary row holds ``copies`` slots of ``slot`` bytes each (one per worker, or a single
replicated/canonical slot) followed by padding; a slot is exactly the canonical payload. The store path
(``_row_store``) and the load path (``_row_load``) build on this; ``_rows.RowEngine`` joins them.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any, Callable

import numpy as np

from ..errors import (
    ChecksumError, DestinationError, KVFormatError, LayoutMismatchError, TagMismatchError, UnknownKeyError,
)
from ..format import (
    BlockHeader, BlockKey, CanonicalLayout, HeaderEncoder, HeaderTemplates, Keyring, Provenance, check_layout,
    encode_block, hash_relpath, key_for,
)
from ..layout import RowPlan
from ..storage import REPLACED, Quarantined, Store
from ._config import TierConfig
from ._counters import Counters
from ._health import RootHealth
from ._log import CacheLog
from ._lru import LRUIndex
from ._pool import BatchWorker
from ._sealing import sealed_plans, tier_keyring
from .shared import Bound, NoBound

WRITTEN, EXISTS, REPLICA_MISMATCH, FAILED = "written", "exists", "replica_mismatch", "failed"
REFUSED = "refused"  # not attempted: the root is unusable, or the shared bound has no room (counted by reason)
CANCELLED = "cancelled"  # a store that never ran: the tier shut down first
# A load refreshes the file's mtime (the LRU order a restart rebuilds) at most this often: a utime per
# load cost ~10% of a tmpfs load, and a restart's LRU order only needs to be right to within minutes.
TOUCH_INTERVAL_S = 300.0
# A store that finds its file being evicted (or replaced) by another thread retries; only a cache churning
# the same file faster than this gives up (reported FAILED: nothing was stored).
STORE_ATTEMPTS = 4

class RowCore:
    """Moves chunks between the primary rows and a Store, keeping the LRU index and counters (shared state)."""

    def __init__(self, store: Store, plan: RowPlan | CanonicalLayout, flat: memoryview, stride: int, copies: int,
                 cfg: TierConfig, provenance: Provenance, index: LRUIndex,
                 on_removed: Callable[[list[str]], None], share: "RowCore | None" = None,
                 interleaved: bool = False) -> None:
        if isinstance(plan, CanonicalLayout):  # a payload that is the whole slot, as stored
            n = plan.payload_bytes
            plan = RowPlan(plan, n, ((0, 0, n, 1, n, n),), "layer_outer", "payload")
        plan = sealed_plans({0: plan}, cfg)[0]  # spec §12: the seal level is part of the namespace
        # Sealed tiers seal new files under the first key and open files of every key they hold.
        self.keys: Keyring | None = share.keys if share is not None else tier_keyring(cfg)
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
        # Engines of one tier (one per KV-cache group) share counters, the log and the root's health and bound.
        self.counters: Counters = share.counters if share is not None else Counters()
        self.log: CacheLog = share.log if share is not None else CacheLog()
        self.health: RootHealth | None = share.health if share is not None else None
        self.shared: Bound = share.shared if share is not None else NoBound(self.delete_now)
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
        # same pass: kvformat.format._native); O_DIRECT reads and remote stores keep the Store calls.
        self._fuse_allowed = os.environ.get("KVFORMAT_NO_FUSED") != "1"
        self._o_direct = getattr(store, "o_direct", "off") != "off"
        # Loads that may be given up on at read_deadline_s read into this thread's private buffer and copy into
        # the row only if still wanted: a read that returns after its job reported a miss must not write into
        # a chunk vLLM has handed to another request. Only where a read can hang (Store.reads_may_hang): on
        # local disks the direct read into the row stays, and a load there is given up on only before it starts.
        self.isolated_reads = cfg.read_deadline_s > 0 and bool(getattr(store, "reads_may_hang", True))
        # The fused paths' per-chunk header work without JSON: loads compare against headers already checked,
        # stores patch the key into the last header made (format/_template.py, spec §11.1).
        # Sealed headers differ per file (nonce, tag): nothing to compare against, every load parses its own.
        self.templates = HeaderTemplates(self.layout) if self.layout.seal is None else None
        self._encoder = HeaderEncoder(self.layout, provenance)
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
                self.warn(f"touch:{type(e).__name__}", "touching %s failed: %s", rel, e)
            finally:
                self._unpin(rel)

    def close(self) -> None:
        """Drop every view of the primary buffer (vLLM unmaps it after the tier shuts down)."""
        self.toucher.close(0)
        self._arr = None
        self.flat = memoryview(b"")

    # -- helpers -----------------------------------------------------------------------------------
    def file_bytes(self) -> int:
        """Bytes of one uncompressed chunk file of this engine's layout (header region + payload)."""
        hdr, _, _ = encode_block(memoryview(bytearray(self.payload_bytes)), self.layout,
                                 BlockKey("0" * 64, self.layout.group), provenance=self.provenance, payload_xxh3=0,
                                 keys=self.keys)  # a sealed header is longer (nonce, key id, tag)
        return len(hdr) + self.payload_bytes

    def relpath(self, h: str) -> str:
        return hash_relpath(self.ns, h)

    def warn(self, reason: str, msg: str, *args: Any) -> None:
        """Log a warning for ``reason`` now, then at most once a minute with a count (:class:`CacheLog`)."""
        self.log.warn(reason, msg, *args, stacklevel=3)

    warn_once = warn  # the name callers used when each reason was logged once per process

    def _usable(self) -> bool:
        return self.health is None or self.health.usable

    def can_read(self, rel: str) -> bool:
        """Whether a lookup may answer a hit for ``rel`` now: the root is usable and, on a shared root, the file
        is not doomed and this engine's view of the evictor is current."""
        return self._usable() and self.shared.may_read(rel)

    def note_stale_view(self, what: str) -> None:
        """Count (and log, rate-limited) a lookup or load answered a miss only because this engine's view of the
        shared root is not current: without it such a miss looks like an empty cache."""
        if self.shared.view_current():
            return
        self.counters.add(stale_view_misses=1)
        self.warn("stale_view", "a %s was answered a miss: this engine's view of the shared root is not current "
                  "(its coordination round has not finished within ttl_s/2: a slow mount or a starved process; "
                  "counted in stale_view_misses)", what)

    def store_failed(self, reason: str) -> None:
        """Count a chunk not stored; an OS error also has the root examined at once (a mount that went away)."""
        self.counters.add_store_failure(reason)
        if self.health is not None and reason not in ("bound", "coordination", "evicting", "replica_mismatch"):
            self.health.wake.set()

    def _unpin(self, rel: str) -> None:
        if self.index.unpin(rel):  # the bound skipped this file while pinned: evict now, not at some later write
            self.delete_victims(self.index.victims())

    def delete_victims(self, victims: list[tuple[str, int]]) -> None:
        """Evict ``victims``: at once, or through the shared root's evictor (doomed until no engine reads them)."""
        self.shared.evict(victims)

    def delete_now(self, victims: list[tuple[str, int]]) -> None:
        """Delete evicted files for good (counters, events)."""
        if not victims:
            return
        gone: list[str] = []
        try:
            for rel, size in victims:
                try:
                    self.store.delete(rel)
                except OSError as e:
                    # Still on storage: counted again (LRUIndex.keep), so the index never says less than the
                    # disk holds; other files are evicted first and this one is retried when nothing else fits.
                    self.warn("evict_error", "could not delete %s: %s; it stays counted and is retried when "
                              "nothing else can be evicted", rel, e)
                    continue
                self._mtimes.pop(rel, None)
                gone.append(rel)
                self.counters.add(evictions=1, evicted_bytes=size)
        finally:
            # Every victim stops being doomed, deleted or not: a store waiting to rewrite it proceeds.
            done = set(gone)
            self.index.forget(gone)
            self.index.keep([(rel, size) for rel, size in victims if rel not in done])
        self.on_removed(gone)

    def quarantine(self, rel: str, err: KVFormatError, since: int | None = None) -> None:
        """A read of ``rel`` found the file bad (``err``): move that very file aside, then forget it.

        Only the file that was read moves (``err.file_id``; :meth:`Store.quarantine_read`): a store of the
        same block may have replaced it since (quarantining it itself, then publishing a fresh file), and
        that file stays, indexed. ``since``: the reader's pin token; an entry a store indexed after it is
        kept (:meth:`LRUIndex.remove`).
        """
        if isinstance(err, UnknownKeyError):
            # Sealed under a key this tier does not hold: another trust domain's file, or a key left out of
            # the config. A miss, counted, but not moved: a misconfigured deployment must not empty a cache.
            self.index.remove(rel, since)
            self._mtimes.pop(rel, None)
            self.counters.add(unknown_key_files=1)
            self.warn(err.reason, "%s; served as a miss, file left in place", err)
            return
        reason = err.reason
        self._mtimes.pop(rel, None)
        try:
            q = self.store.quarantine_read(rel, err)
        except OSError as e:
            q = Quarantined("failed")
            self.warn("quarantine_error", "could not quarantine %s: %s", rel, e)
        self.counters.add(corrupt_files=1, checksum_failures=int(isinstance(err, ChecksumError)),
                          layout_mismatches=int(isinstance(err, LayoutMismatchError)),
                          seal_failures=int(isinstance(err, TagMismatchError)))
        self.counters.add_quarantine(reason)
        if q.outcome == REPLACED:  # the name holds a newer file than the one read: its entry, if any, is its own
            self.warn(reason, "%s; served as a miss, left in place: a newer file has taken its name", err)
            return
        self.index.remove(rel, since)
        self.shared.removed(rel)
        self.warn(reason, "%s; served as a miss, file moved to %s", err, q.relpath)
        self.on_removed([rel])

    def _chunk_base(self, chunk_id: int) -> int:
        """Where chunk ``chunk_id``'s row starts in the primary buffer; DestinationError when it is not there
        (the caller's mistake: no file is read, written or condemned for it)."""
        base = chunk_id * self.stride
        if chunk_id < 0 or base + self.copies * self.slot > len(self.flat):
            raise DestinationError(f"chunk {chunk_id} is outside the primary buffer ({len(self.flat)} bytes, "
                                   f"rows of {self.stride} bytes)")
        return base


    def _buffer(self, i: int) -> memoryview:
        bufs = getattr(self._scratch, "bufs", None)
        if bufs is None:
            bufs = self._scratch.bufs = []
        while len(bufs) <= i:  # 0, 1: gathers; 2: an encrypted store's ciphertext (made on first use)
            # The ciphertext buffer is page-aligned (an anonymous map) so o_direct stores can write it O_DIRECT.
            bufs.append(memoryview(mmap.mmap(-1, self.payload_bytes)) if len(bufs) == 2
                        else memoryview(bytearray(self.payload_bytes)))
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


    def _header_check(self, key: BlockKey) -> Callable[[str, BlockHeader], None]:
        """The key and layout check (F-9.1, F-9.2) a load makes, run on a header while its file is open, so
        a mismatch names the file read (its quarantine moves exactly that file)."""
        layout, keys = self.layout, self.keys

        def check(_rel: str, hdr: BlockHeader) -> None:
            if hdr.key != key:
                raise LayoutMismatchError("key", key.to_str(), hdr.key.to_str())
            check_layout(hdr.layout, layout)
            if hdr.seal is not None:
                key_for(hdr, keys)  # F-12.5: a file no held key opens is no hit
        return check

    def _accept_header(self, rel: str, hdr: Any, since: int) -> int | None:
        """Size of the file whose checked header (or read error) is ``hdr``; else None, quarantining the file
        read when it is there but wrong. Other OS errors propagate (the caller decides)."""
        if isinstance(hdr, FileNotFoundError):
            return None
        if isinstance(hdr, KVFormatError):
            self.quarantine(rel, hdr.with_path(rel), since)
            return None
        if isinstance(hdr, BaseException):
            raise hdr
        return int(hdr.file_bytes)

    # -- fused local I/O (kvformat.format._native) -----------------------------------------------
    @property
    def _fused(self) -> bool:
        # Checked per call: the store may be swapped (tests) and a subclass's put/read_into must not be bypassed.
        return self._fuse_allowed and self.store.fused_io

