"""The row engine's load path: a file read into a primary row (fanned out to every worker slot), and the
probe of files the index does not know (written by another instance)."""

from __future__ import annotations

import ctypes
import time
from typing import Any, Callable

from ..errors import KVFormatError
from ..format import BlockKey
from ._row_core import TOUCH_INTERVAL_S, RowCore


class RowLoad(RowCore):
    """Loads of chunks (:meth:`load_chunk`) and lookups of unindexed files (:meth:`probe_many`)."""

    def _read_into(self, rel: str, dst: memoryview, key: BlockKey) -> Any:
        if self._fused:  # one read of header + payload; dst is ours, zeroed on any failure
            return self.store.read_into_fused(rel, dst, expect=self.layout, key=key, verify=self.cfg.verify,
                                              o_direct=self._o_direct, keys=self.keys, templates=self.templates)
        return self.store.read_into(rel, dst, expect=self.layout, key=key, verify=self.cfg.verify, keys=self.keys)

    # -- load ----------------------------------------------------------------------------------
    def load_chunk(self, h: str, chunk_id: int, claim: Callable[[], bool] | None = None) -> int | None:
        """Read block ``h`` into chunk ``chunk_id`` (fanned out to every slot). Bytes read, or None (a miss).

        ``claim()`` (the job's deadline, cache/_jobs.py) is asked once before anything is written into the
        row: False means the load was given up on, and nothing is written. With isolated reads it is asked
        after the read (which went to a private buffer), else before it.
        """
        rel = self.relpath(h)
        base = self._chunk_base(chunk_id)  # before the read token: a bad chunk id takes nothing
        if not self._usable():
            return None
        isolated = claim is not None and self.isolated_reads
        if claim is not None and not isolated and not claim():
            return None
        shared = self.shared
        token = shared.read_begin(rel)
        if token is None:  # doomed by the shared root's evictor, or no current view of it
            self.note_stale_view("load")
            return None
        since = self.index.pin(rel)
        try:
            direct = self.plan.contiguous and not isolated
            dst = self.flat[base:base + self.payload_bytes] if direct else self._buffer(0)
            try:
                hdr = self._read_into(rel, dst, BlockKey(h, self.layout.group))
            except FileNotFoundError:
                self.index.remove(rel, since)  # kept if a store indexed a file published after this read
                self.counters.add(missing_files=1)
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
            if isolated and claim is not None and not claim():
                self.counters.add(late_reads_dropped=1)  # the job reported a miss long ago: the row is not ours
                return None
            if self.plan.contiguous and isolated:
                self.flat[base:base + self.payload_bytes] = dst
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
            shared.used(rel)
            return int(hdr.file_bytes)
        finally:
            self._unpin(rel)
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

