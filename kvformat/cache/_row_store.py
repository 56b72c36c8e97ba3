"""The row engine's store path: one chunk's canonical payload from a primary row to a file (replica checks,
the shared root's bound, the fused local write)."""

from __future__ import annotations

import os
import time
from typing import Any

from ..errors import KVFormatError, ReplicaMismatchError
from ..format import BlockKey, Provenance, encode_block, xxh3_64
from ._row_core import EXISTS, FAILED, REFUSED, REPLICA_MISMATCH, STORE_ATTEMPTS, WRITTEN, RowCore
from .shared import Bound

# The other worker slots the fused write compares with the payload: (buffer, count, stride).
_Others = tuple[memoryview, int, int]


class RowStore(RowCore):
    """Stores of chunks: :meth:`store_chunk`."""

    # -- store ---------------------------------------------------------------------------------
    def store_chunk(self, h: str, chunk_id: int) -> tuple[str, int]:
        """Write chunk ``chunk_id``'s canonical payload as block ``h``. Returns (outcome, bytes written)."""
        rel = self.relpath(h)
        base = self._chunk_base(chunk_id)
        early = self._decided_early(rel)
        if early is not None:
            return early
        got = self._chunk_payload(h, base)
        if got is None:
            return REPLICA_MISMATCH, 0
        payload, digests, others = got
        key = BlockKey(h, self.layout.group)
        fuse = self._fused and digests is None and self.cfg.compression == "none"
        hdr, data = self._encode_chunk(key, payload, digests, fuse)
        for attempt in range(STORE_ATTEMPTS):
            if attempt and self.index.touch(rel):  # the store we waited for (wait_gone) indexed the file
                self.counters.add(dedup_saved_bytes=self.chunk_row_bytes)
                return EXISTS, 0
            shared = self.shared
            done = self._write_once(h, base, rel, hdr, data, others, fuse, shared)
            if done is None:  # another writer (instance, TP size) was first, or the file is a victim being deleted
                done = self._adopt_existing(rel, key, shared)
            if done is not None:
                return done
            self.index.wait_gone(rel)  # an eviction or another store of this file is finishing
        return FAILED, 0

    def _decided_early(self, rel: str) -> tuple[str, int] | None:
        """The outcome of a store settled before any work (root unusable, file being evicted, already indexed)."""
        if not self._usable():
            assert self.health is not None
            self.store_failed(f"root_{self.health.state}")
            return REFUSED, 0
        if self.shared.refused(rel):  # being evicted: written again once it is gone
            self.store_failed("evicting")
            return REFUSED, 0
        if self.index.touch(rel):
            self.counters.add(dedup_saved_bytes=self.chunk_row_bytes)
            return EXISTS, 0
        return None

    def _chunk_payload(self, h: str, base: int) -> tuple[Any, list[int] | None, _Others | None] | None:
        """(payload, the worker slots' digests or None, the slots the fused write compares or None); None when
        the replicas differ (counted and logged)."""
        digests: list[int] | None = None
        if self.plan.shards:
            payload: Any = self._gather_shards(h, base)
            if payload is None:
                return None
        else:
            payload = self._payload_of(base)
        others: _Others | None = None
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
                    return None
        return payload, digests, others

    def _encode_chunk(self, key: BlockKey, payload: Any, digests: list[int] | None, fuse: bool) -> tuple[bytes, Any]:
        """The file's header region and data."""
        if fuse and self.layout.seal is None:  # kvf.dxxh3 zero, patched by the write that hashes the payload
            return self._encoder.encode(key), payload
        prov = Provenance(**{**self.provenance.to_dict(), "created": int(time.time())})
        hdr, data, _ = encode_block(payload, self.layout, key, provenance=prov, codec=self.cfg.compression,
                                    level=self.cfg.compression_level,
                                    payload_xxh3=digests[0] if digests else (0 if fuse else None),
                                    keys=self.keys,
                                    out=self._buffer(2) if self.layout.seal == "encrypt" else None)
        return hdr, data

    def _write_once(self, h: str, base: int, rel: str, hdr: bytes, data: Any,
                    others: _Others | None, fuse: bool,
                    shared: Bound) -> tuple[str, int] | None:
        """One attempt to publish the file under room reserved for it; None when a file was already there."""
        size = len(hdr) + len(data)
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
            self._unreserve(rel, size, shared)
            # The digests for the log: the rare path pays for them.
            self._replicas_differ(h, [xxh3_64(self._payload_of(base + r * self.slot, 1))
                                      for r in range(self.copies)], "the worker slots", found=True)
            return REPLICA_MISMATCH, 0
        except BaseException:
            self._unreserve(rel, size, shared)
            raise
        if wrote:
            self._mtimes[rel] = time.time()
            shared.wrote(rel, size)
            self.delete_victims(self.index.add(rel, size, reserved=size))
            # The replicas not written (a sharded row holds the payload once across its shards).
            saved = (max(0, self.copies * self.slot - self.payload_bytes) if self.plan.shards
                     else (self.copies - 1) * self.slot)
            self.counters.add(bytes_written=size, files_written=1, dedup_saved_bytes=saved)
            return WRITTEN, size
        self._unreserve(rel, size, shared)
        return None

    def _unreserve(self, rel: str, size: int, shared: Bound) -> None:
        self.index.release(size, rel)
        shared.unreserve(size)

    def _adopt_existing(self, rel: str, key: BlockKey, shared: Bound) -> tuple[str, int] | None:
        """Index the valid file another writer published (EXISTS), refuse one being evicted; None to try again."""
        # The pin, taken before the header read, makes add_found refuse a file evicted meanwhile.
        # On a shared root the evictor may have doomed the file since the check at the top: indexing it
        # then would leave a ghost once it is deleted (a later load finds it missing). The read token
        # keeps the evictor from deleting it until the refused() check after add_found has run.
        token = shared.read_begin(rel)
        if token is None:
            self.store_failed("evicting" if shared.refused(rel) else "coordination")
            return REFUSED, 0
        since = self.index.pin(rel)
        try:
            existing = self._check_existing(rel, key, since)
            if existing is not None and self.index.add_found(rel, existing, since):
                if shared.refused(rel):
                    self.index.remove(rel)
                    self.store_failed("evicting")
                    return REFUSED, 0
                self.counters.add(dedup_saved_bytes=self.chunk_row_bytes)
                shared.used(rel)
                return EXISTS, 0
        finally:
            self._unpin(rel)
            shared.read_end(token)
        return None

    def _make_parent(self, rel: str) -> None:
        # A local tier creates its hash directories itself, never the namespace directory (LocalStore.make_parent):
        # after its mount went away the store fails here instead of growing a tree on the disk underneath.
        # Only where the root's health is watched: there the namespace directory was made at start-up.
        path = self.store.local_path(rel) if self.health is not None else None
        if path is not None and not os.path.isdir(os.path.dirname(path)):
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


    def _check_existing(self, rel: str, key: BlockKey, since: int) -> int | None:
        """Size of a valid existing file; None after quarantining an invalid one (or if it vanished)."""
        try:
            hdr: Any = self.store.read_header(rel, verify=True, check=self._header_check(key))
        except (FileNotFoundError, KVFormatError) as e:
            hdr = e
        return self._accept_header(rel, hdr, since)


    def _put_fused(self, rel: str, hdr: bytes, data: Any, others: tuple[memoryview, int, int] | None = None) -> bool:
        """store.put of header + payload in one pass; ``hdr`` carries a zero kvf.dxxh3 that the write patches;
        ``others``: the other worker slots, compared with the payload in the same pass."""
        watched = self.health is not None and self.store.is_local  # see _make_parent
        return self.store.put_fused(rel, hdr, data, fsync=self.cfg.fsync, o_direct=self._o_direct,
                                    keep_parents=1 if watched else None, others=others)

