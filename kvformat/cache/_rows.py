"""Primary row <-> kvformat file, one chunk at a time. No vLLM import: the tier feeds it row offsets.

A primary row holds ``copies`` slots of ``slot`` bytes each (one per worker, or a single
replicated/canonical slot) followed by padding; a slot is exactly the canonical payload. Stores
write slot 0 (after checking the other slots are the same bytes); loads read into slot 0 and copy
it into the other slots.
"""

from __future__ import annotations

import ctypes
import mmap
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
from ..errors import (
    ChecksumError, DestinationError, KVFormatError, LayoutMismatchError, ReplicaMismatchError, TagMismatchError,
    UnknownKeyError,
)
from ..format._fused import read_into_fused, write_block_fused
from ..format._template import HeaderEncoder, HeaderTemplates
from ..format._native import xxh3_64
from ..format._seal import Keyring, key_for
from ..format._spec import BlockHeader
from ..storage import Store
from ..storage._base import REPLACED, Quarantined
from ..storage._local import LocalStore
from ._config import TierConfig
from ._lru import LRUIndex
from ._counters import COUNTERS as COUNTERS, Counters
from ._health import RootHealth
from ._log import CacheLog
from ._pool import BatchWorker
from ._scan import ScanProgress, scan_root
from ._sealing import sealed_plans, tier_keyring
from ._shared import SharedBound

WRITTEN, EXISTS, REPLICA_MISMATCH, FAILED = "written", "exists", "replica_mismatch", "failed"
REFUSED = "refused"  # not attempted: the root is unusable, or the shared bound has no room (counted by reason)
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
        self.shared: SharedBound | None = share.shared if share is not None else None
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
        return self._usable() and (self.shared is None or self.shared.may_read(rel))

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
        if self.shared is not None:
            self.shared.evict(victims)
        else:
            self.delete_now(victims)

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
        if self.shared is not None:
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

    # -- store ---------------------------------------------------------------------------------
    def store_chunk(self, h: str, chunk_id: int) -> tuple[str, int]:
        """Write chunk ``chunk_id``'s canonical payload as block ``h``. Returns (outcome, bytes written)."""
        rel = self.relpath(h)
        base = self._chunk_base(chunk_id)
        if not self._usable():
            assert self.health is not None
            self.store_failed(f"root_{self.health.state}")
            return REFUSED, 0
        if self.shared is not None and self.shared.refused(rel):  # being evicted: written again once it is gone
            self.store_failed("evicting")
            return REFUSED, 0
        if self.index.touch(rel):
            self.counters.add(dedup_saved_bytes=self.chunk_row_bytes)
            return EXISTS, 0
        digests: list[int] | None = None
        if self.plan.shards:
            sharded = self._gather_shards(h, base)
            if sharded is None:
                return REPLICA_MISMATCH, 0
            payload = sharded
        else:
            payload = self._payload_of(base)
        others: tuple[memoryview, int, int] | None = None
        if self.copies > 1 and self.cfg.replica_policy == "verify" and not self.plan.shards:
            if (self._fused and self.plan.contiguous and self.cfg.compression == "none" and self.layout.seal is None
                    and self._slot_heads_match(base)):
                # Compared piece by piece with the payload inside the fused write, while each piece is in
                # cache: every slot read once from memory, one hash (not one per slot, then a re-read to write).
                # The write comes after the eviction that makes room for it, so slots that differ from their
                # first bytes on (a model whose KV is not replicated fails every store) are caught before it:
                # failing stores must not empty the cache one victim each.
                others = (self.flat[base + self.slot:base + self.copies * self.slot], self.copies - 1, self.slot)
            else:
                digests = [xxh3_64(payload if r == 0 else self._payload_of(base + r * self.slot, 1))  # no GIL
                           for r in range(self.copies)]
                if self._replicas_differ(h, digests, "the worker slots"):
                    return REPLICA_MISMATCH, 0
        key = BlockKey(h, self.layout.group)
        fuse = self._fused and digests is None and self.cfg.compression == "none"
        # The replicas not written (a sharded row holds the payload once across its shards).
        saved = (max(0, self.copies * self.slot - self.payload_bytes) if self.plan.shards
                 else (self.copies - 1) * self.slot)
        data: Any
        if fuse and self.layout.seal is None:  # kvf.dxxh3 zero, patched by the write that hashes the payload
            hdr, data = self._encoder.encode(key), payload
        else:
            prov = Provenance(**{**self.provenance.to_dict(), "created": int(time.time())})
            hdr, data, _ = encode_block(payload, self.layout, key, provenance=prov, codec=self.cfg.compression,
                                        level=self.cfg.compression_level,
                                        payload_xxh3=digests[0] if digests else (0 if fuse else None),
                                        keys=self.keys,
                                        out=self._buffer(2) if self.layout.seal == "encrypt" else None)
        size = len(hdr) + len(data)
        for attempt in range(STORE_ATTEMPTS):
            if attempt and self.index.touch(rel):  # the store we waited for (wait_gone) indexed the file
                self.counters.add(dedup_saved_bytes=self.chunk_row_bytes)
                return EXISTS, 0
            shared = self.shared
            if shared is not None:
                why = shared.may_write(size)  # room under the root-wide bound, reserved until wrote/unreserve
                if why is not None:
                    self.store_failed(why)
                    return REFUSED, 0
            # Reserved for rel: until add/release no other thread indexes the file this put publishes, so
            # no eviction can delete it before our add (which would then index a ghost).
            victims = self.index.reserve(size, rel)
            try:
                self.delete_victims(victims)
                if fuse:  # the parent is made only when the write finds it missing: no stat per store
                    wrote = self._put_fused(rel, hdr, data, others)
                else:
                    self._make_parent(rel)
                    wrote = self.store.put(rel, [hdr, data], overwrite=False, fsync=self.cfg.fsync)
            except ReplicaMismatchError:  # found by the fused write: nothing was published
                self.index.release(size, rel)
                if shared is not None:
                    shared.unreserve(size)
                # The digests for the log: the rare path pays for them.
                self._replicas_differ(h, [xxh3_64(self._payload_of(base + r * self.slot, 1))
                                          for r in range(self.copies)], "the worker slots", found=True)
                return REPLICA_MISMATCH, 0
            except BaseException:
                self.index.release(size, rel)
                if shared is not None:
                    shared.unreserve(size)
                raise
            if wrote:
                self._mtimes[rel] = time.time()
                if shared is not None:
                    shared.wrote(rel, size)
                self.delete_victims(self.index.add(rel, size, reserved=size))
                self.counters.add(bytes_written=size, files_written=1, dedup_saved_bytes=saved)
                return WRITTEN, size
            self.index.release(size, rel)
            if shared is not None:
                shared.unreserve(size)
            # Another writer (instance, TP size) was first, or the file is a victim being deleted. The
            # pin, taken before the header read, makes add_found refuse a file evicted meanwhile.
            # On a shared root the evictor may have doomed the file since the check at the top: indexing it
            # then would leave a ghost once it is deleted (a later load finds it missing). The read token
            # keeps the evictor from deleting it until the refused() check after add_found has run.
            token = shared.read_begin(rel) if shared is not None else None
            if shared is not None and token is None:
                self.store_failed("evicting" if shared.refused(rel) else "coordination")
                return REFUSED, 0
            since = self.index.pin(rel)
            try:
                existing = self._check_existing(rel, key, since)
                if existing is not None and self.index.add_found(rel, existing, since):
                    if shared is not None and shared.refused(rel):
                        self.index.remove(rel)
                        self.store_failed("evicting")
                        return REFUSED, 0
                    self.counters.add(dedup_saved_bytes=self.chunk_row_bytes)
                    if shared is not None:
                        shared.used(rel)
                    return EXISTS, 0
            finally:
                self._unpin(rel)
                if shared is not None:
                    shared.read_end(token)
            self.index.wait_gone(rel)  # an eviction or another store of this file is finishing
        return FAILED, 0

    def _make_parent(self, rel: str) -> None:
        # A local tier creates its hash directories itself, never the namespace directory (LocalStore.make_parent):
        # after its mount went away the store fails here instead of growing a tree on the disk underneath.
        # Only where the root's health is watched: there the namespace directory was made at start-up.
        if (self.health is not None and isinstance(self.store, LocalStore)
                and not os.path.isdir(os.path.dirname(self.store._abs(rel)))):
            self.store.make_parent(rel)

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

    def _slot_heads_match(self, base: int) -> bool:
        """Whether every worker slot of the row at ``base`` starts with the same 4 KiB (a cheap first look)."""
        n = min(4096, self.payload_bytes)
        head = bytes(self.flat[base:base + n])
        return all(bytes(self.flat[base + r * self.slot:base + r * self.slot + n]) == head  # bytes: memcmp
                   for r in range(1, self.copies))

    def _replicas_differ(self, h: str, digests: list[int], what: str, found: bool = False) -> bool:
        """Count and log (once) a chunk whose replicas' digests differ; True if they do. ``found``: a comparison
        already found them different (counted and logged even if the slots have changed since)."""
        if len(set(digests)) == 1 and not found:
            return False
        err = ReplicaMismatchError([f"{d:016x}" for d in digests])
        self.counters.add(replica_mismatches=1)
        self.warn("ReplicaMismatchError", "chunk %s not stored: %s differ: %s. The model's KV "
                       "is not replicated across workers; kvformat stores only replicated (MLA) KV", h, what, err)
        return True

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

    def _check_existing(self, rel: str, key: BlockKey, since: int) -> int | None:
        """Size of a valid existing file; None after quarantining an invalid one (or if it vanished)."""
        try:
            hdr: Any = self.store.read_header(rel, verify=True, check=self._header_check(key))
        except (FileNotFoundError, KVFormatError) as e:
            hdr = e
        return self._accept_header(rel, hdr, since)

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

    # -- fused local I/O (kvformat._native) --------------------------------------------------------
    @property
    def _fused(self) -> bool:
        # Checked per call: the store may be swapped (tests) and a subclass's put/read_into must not be bypassed.
        return self._fuse_allowed and type(self.store) is LocalStore

    def _put_fused(self, rel: str, hdr: bytes, data: Any, others: tuple[memoryview, int, int] | None = None) -> bool:
        """store.put of header + payload in one pass; ``hdr`` carries a zero kvf.dxxh3 that the write patches;
        ``others``: the other worker slots, compared with the payload in the same pass."""
        watched = self.health is not None and isinstance(self.store, LocalStore)
        wrote, _ = write_block_fused(self.store._abs(rel), hdr, data, fsync=self.cfg.fsync,  # type: ignore[attr-defined]
                                     overwrite=False, o_direct=self._o_direct,
                                     make_parent=(lambda: self.store.make_parent(rel)) if watched else None,  # type: ignore[attr-defined]
                                     others=others)
        return wrote

    def _read_into(self, rel: str, dst: memoryview, key: BlockKey) -> Any:
        if self._fused:  # one read of header + payload; dst is ours, zeroed on any failure
            return read_into_fused(self.store._abs(rel), dst, expect=self.layout, key=key,  # type: ignore[attr-defined]
                                   verify=self.cfg.verify, o_direct=self._o_direct, keys=self.keys,
                                   templates=self.templates)
        return self.store.read_into(rel, dst, expect=self.layout, key=key, verify=self.cfg.verify, keys=self.keys)

    # -- load ----------------------------------------------------------------------------------
    def load_chunk(self, h: str, chunk_id: int) -> int | None:
        """Read block ``h`` into chunk ``chunk_id`` (fanned out to every slot). Bytes read, or None (a miss)."""
        rel = self.relpath(h)
        base = self._chunk_base(chunk_id)  # before the read token: a bad chunk id takes nothing
        if not self._usable():
            return None
        shared = self.shared
        token = shared.read_begin(rel) if shared is not None else None
        if shared is not None and token is None:  # doomed by the shared root's evictor, or no current view of it
            return None
        since = self.index.pin(rel)
        try:
            dst = self.flat[base:base + self.payload_bytes] if self.plan.contiguous else self._buffer(0)
            try:
                hdr = self._read_into(rel, dst, BlockKey(h, self.layout.group))
            except FileNotFoundError:
                self.index.remove(rel, since)  # kept if a store indexed a file published after this read
                self.counters.add(missing_files=1)
                if shared is not None:
                    shared.removed(rel)
                self.on_removed([rel])
                return None
            except KVFormatError as e:
                self.quarantine(rel, e, since)
                return None
            except OSError as e:
                self.index.remove(rel, since)
                self.counters.add(io_errors=1)
                self.warn(f"OSError{e.errno}", "reading %s failed: %s; served as a miss", rel, e)
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
            if shared is not None:
                shared.used(rel)
            return int(hdr.file_bytes)
        finally:
            self._unpin(rel)
            if shared is not None:
                shared.read_end(token)

    # -- lookup of a file the index does not know (written by another instance) ------------------
    def probe_many(self, hs: list[str]) -> list[bool]:
        """:meth:`probe` for many blocks with one batched header read (one round trip on remote roots).

        A block whose header cannot be read now (storage unreachable) is reported absent: a miss, never a
        false hit.
        """
        rels = [self.relpath(h) for h in hs]
        readable = [self.can_read(r) for r in rels]
        todo = [i for i, r in enumerate(rels) if readable[i] and r not in self.index]
        if todo:
            pinned = [rels[i] for i in todo]
            # before the reads: an eviction meanwhile makes add_found refuse the file
            since = [self.index.pin(rel) for rel in pinned]
            try:
                keys = {rels[i]: BlockKey(hs[i], self.layout.group) for i in todo}
                got: list[Any] = self.store.read_headers_many(
                    pinned, verify=True, check=lambda rel, hdr: self._header_check(keys[rel])(rel, hdr))
                for i, hdr, t in zip(todo, got, since):
                    try:
                        size = self._accept_header(rels[i], hdr, t)
                    except OSError as e:
                        self.warn(f"probe:{type(e).__name__}", "lookup failed: %s", e)
                        size = None
                    if size is not None:
                        self.index.add_found(rels[i], size, t)
            finally:
                for rel in pinned:
                    self.index.unpin(rel)
            self.delete_victims(self.index.victims())
        return [ok and r in self.index for ok, r in zip(readable, rels)]

    # -- start-up ----------------------------------------------------------------------------------

    def scan(self, stop: threading.Event, progress: ScanProgress | None = None) -> ScanProgress:
        """Rebuild usage and LRU order from the files under the root (a background thread): see ``_scan``."""
        return scan_root(self, stop, progress)
