"""The Stager: one rank's paged MLA KV (GPU or CPU) <-> the shared row <-> kvformat files.

On the way out only the elected writer of each part copies (device-to-host) and the other ranks wait for
it to publish; on the way in every rank copies its part of the slot into its own KV. Row <-> file goes
through :meth:`kvformat.storage.Store.put_block` / :meth:`~kvformat.storage.Store.read_into`, the code the
vLLM tier uses. The protocol is :mod:`kvformat.staging._row`'s.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..format import BlockKey, CanonicalLayout, Provenance, block_relpath
from ..errors import LayoutMismatchError, StagingConflictError, StagingError
from ._cuda import after_compute, on_stream, sync_point
from ._parts import PartCopies
from ._placement import RankPlacement
from ._row import SharedRow
from ._shm import _STATE_NAMES, BUSY, DONE, FAILED, fence
from ._stats import StagingStats
from ._verify import check_verify, device_check
from ._xxh3_device import xxh3_64_gathered

if TYPE_CHECKING:
    import torch

    from ..storage import Store

__all__ = ["Stager"]


class Stager(PartCopies):
    """Moves chunks between one rank's paged MLA KV cache and a :class:`SharedRow`.

    Parameters
    ----------
    row: the shared row (its ``rank``/``world_size`` are this rank and the TP size).
    kv: one tensor per layer, in ``layout.layers`` order: ``(num_blocks, block_size, latent)`` (any
        dtype) or vLLM-style ``(num_blocks, page_bytes)`` int8/uint8 views; all on one device (CUDA
        or CPU) and contiguous per block.
    layout: the canonical layout; its ``payload_bytes`` must equal ``row.slot_bytes``.
    rotate: elect ``chunk % world_size`` as the writer of each chunk (spreads the D2H load) instead
        of ``writer_rank``.
    writer_rank: the writer when not rotating (TP rank 0 by default).
    timeout_s: how long a rank waits for another rank's publication.
    placement: for a pipeline- and/or decode-context-parallel group (:class:`RankPlacement`): ``kv`` then
        holds only this rank's stage's layers (in the stage's order) with blocks of
        ``tokens_per_block / dcp`` tokens (its DCP rank's tokens); the row needs ``parts=placement.parts``.
        One TP replica of each part writes it (the lowest rank, or rotating by chunk); a chunk is in the row,
        and can be saved, only once every part was published: a stage or DCP rank that never publishes
        makes waiting ranks time out naming it, and nothing is saved.

    Calls that publish a chunk (:meth:`stage_out`, :meth:`load`) are collective: every rank calls
    them, for each chunk in the same order. :meth:`stage_in` and :meth:`save` are per rank.
    """

    def __init__(self, row: SharedRow, kv: Sequence["torch.Tensor"], layout: CanonicalLayout, *,
                 rotate: bool = False, writer_rank: int = 0, timeout_s: float = 60.0,
                 placement: RankPlacement | None = None) -> None:
        import torch

        if row.slot_bytes != layout.payload_bytes:
            raise LayoutMismatchError("slot_bytes", layout.payload_bytes, row.slot_bytes)
        self.placement = placement
        self._mine = list(range(len(layout.layers))) if placement is None else placement.layer_indices(layout, row.rank)
        self._part = 0 if placement is None else placement.part_of(row.rank)
        dcp = 1 if placement is None else placement.dcp
        if placement is not None and (row.world_size != placement.world or row.parts != placement.parts):
            raise StagingError(f"placement: expected a row of {placement.world} ranks and {placement.parts} parts, "
                               f"got {row.world_size} ranks and {row.parts} parts")
        if placement is None and row.parts != 1:
            raise StagingError(f"a row of {row.parts} parts needs a placement")
        if layout.tokens_per_block % dcp:
            raise StagingError(f"tokens_per_block {layout.tokens_per_block} does not split into {dcp} DCP ranks")
        if len(kv) != len(self._mine):
            raise LayoutMismatchError("layers", len(self._mine), len(kv))
        if not 0 <= writer_rank < row.world_size:
            raise StagingError(f"writer_rank: expected 0..{row.world_size - 1}, got {writer_rank}")
        self.row = row
        self.layout = layout
        self.rotate = rotate
        self.writer_rank = writer_rank
        self.timeout_s = timeout_s
        self.stats = StagingStats()
        self._epochs = np.zeros(row.num_chunks, dtype=np.int64)
        self._pages: list[torch.Tensor] = []
        device = kv[0].device if kv else torch.device("cpu")
        num_blocks = int(kv[0].shape[0]) if kv else 0
        for t, spec in zip(kv, [layout.layers[i] for i in self._mine]):
            if t.device != device:
                raise StagingError(f"layer {spec.name}: expected device {device}, got {t.device}")
            if t.dim() < 2 or int(t.shape[0]) != num_blocks:
                raise LayoutMismatchError(f"layer {spec.name}.num_blocks", num_blocks, tuple(t.shape))
            local_page = spec.page_bytes // dcp  # a DCP rank's block holds tokens_per_block / dcp tokens
            if not t[0].is_contiguous() or t.stride(0) * t.element_size() < local_page:
                raise StagingError(f"layer {spec.name}: each block must be contiguous, got strides {t.stride()}")
            page = t[0].numel() * t.element_size()
            if page != local_page:
                raise LayoutMismatchError(f"layer {spec.name}.page_bytes", local_page, page)
            # One (num_blocks, page_bytes) uint8 view per layer: the copy code never sees the model dtype.
            try:
                flat = t.view(num_blocks, -1) if t.dim() > 2 else t
            except RuntimeError:
                raise StagingError(f"layer {spec.name}: each block must be contiguous, "
                                   f"got strides {t.stride()}") from None
            self._pages.append(flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat)
        self.device = device
        self.num_blocks = num_blocks
        self.cuda = device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(device=device) if self.cuda else None
        self._scratch: torch.Tensor | None = None  # payload-sized buffer on the KV's device
        self._host: torch.Tensor | None = None  # a part's bounce buffer on the host (pinned on CUDA)
        self._holds: tuple[int, int] | None = None  # (chunk, epoch) whose verified payload the scratch holds

    # -- election --------------------------------------------------------------------------------
    def writer_of(self, chunk: int, part: int | None = None) -> int:
        """The rank that copies ``chunk`` out (of this rank's part, or of ``part``); the writer of part 0 also
        loads the chunk from a file and saves it."""
        if self.placement is None:
            return chunk % self.row.world_size if self.rotate else self.writer_rank
        replicas = self.placement.replicas(self._part if part is None else part)
        return replicas[chunk % len(replicas)] if self.rotate else replicas[0]

    def _writers(self, chunk: int) -> list[int]:
        return [self.writer_of(chunk, p) for p in range(self.row.parts)]

    def _what(self) -> list[str]:
        return [] if self.placement is None else [self.placement.describe(p) for p in range(self.row.parts)]

    def _wait(self, chunk: int, epoch: int, *, exact: bool) -> None:
        self.stats.wait_s += self.row.wait(chunk, epoch, writer=self._writers(chunk), timeout_s=self.timeout_s,
                                           exact=exact, what=self._what())

    def epoch(self, chunk: int) -> int:
        """How many times ``chunk`` has been published by this group (this rank's count)."""
        return int(self._epochs[chunk])

    # -- KV -> row ---------------------------------------------------------------------------------
    def stage_out(self, block_ids: Sequence[int], chunk: int, *, wait: bool = True) -> bool:
        """Publish blocks ``block_ids`` of the KV as ``chunk`` of the row. Collective.

        Only the elected writer copies (``len(block_ids) * sum(page_bytes)`` bytes, D2H on CUDA); the
        slot's blocks past ``len(block_ids)`` are zeroed. The other ranks wait (``wait``) until the
        writer has published, so that on return the chunk is in the row on every rank.

        Returns True on the rank that copied. Raises StagingTimeoutError (naming the chunk and the
        writer) if the writer does not publish in time; StagingError for bad block ids.
        """
        ids = self._check_ids(block_ids)
        self.row._check_chunk(chunk)
        epoch = int(self._epochs[chunk]) + 1
        self._epochs[chunk] = epoch
        writer = self.writer_of(chunk)
        copied = self.row.rank == writer
        if copied:
            self.row._set(chunk, epoch, BUSY, part=self._part)
            try:
                if self.placement is None:
                    self._copy_out(ids, chunk)
                else:
                    self._copy_out_part(ids, chunk)
            except BaseException as e:
                self.row._set(chunk, epoch, FAILED, type(e).__name__, part=self._part)
                raise
            self.row._set(chunk, epoch, DONE, part=self._part)
            self.stats.bytes_out += len(ids) * self._block_bytes
            self.stats.chunks_written += 1
        else:
            self.stats.chunks_observed += 1
        # A lone writer needs nothing more; with several parts every rank waits for the others' parts.
        if wait and (not copied or self.row.parts > 1):
            self._wait(chunk, epoch, exact=False)
        return copied

    def _copy_out(self, ids: list[int], chunk: int) -> None:
        import torch

        slot = self.row.slot(chunk)
        n = len(ids)
        if not self.cuda:
            idx = torch.tensor(ids, dtype=torch.long)
            for i in range(len(self._pages)):
                self._copy_out_layer(i, idx, self._layer_view(slot, i), n)
            return
        scratch = self._get_scratch()
        with on_stream(self._stream, self.device):  # after the compute stream that wrote the KV blocks
            idx = torch.tensor(ids, dtype=torch.long, device=self.device)
            for i in range(len(self._pages)):
                self._copy_out_layer(i, idx, self._layer_view(scratch, i), n)
            # One large D2H copy of the gathered payload: pinned destination, so it runs at DMA speed.
            slot.copy_(scratch, non_blocking=True)
        sync_point(self._stream)

    def _copy_out_layer(self, i: int, idx: "torch.Tensor", dst: "torch.Tensor", n: int) -> None:
        import torch

        torch.index_select(self._pages[i], 0, idx, out=dst[:n])
        if n < dst.shape[0]:
            dst[n:].zero_()  # a short chunk still has one defined payload (and file checksum)

    # -- row -> KV ---------------------------------------------------------------------------------
    def stage_in(self, chunk: int, block_ids: Sequence[int]) -> None:
        """Copy ``chunk`` of the row into blocks ``block_ids`` of this rank's KV (every rank does this).

        Waits for the chunk's current epoch to be DONE, copies the slot, re-checks the epoch and only
        then writes the KV: a slot that is half-published, failed or republished is never written
        into the KV. Raises StagingTimeoutError, StagingError (writer failed) or StagingConflictError.
        """
        import torch

        ids = self._check_ids(block_ids)
        self.row._check_chunk(chunk)
        epoch = int(self._epochs[chunk])
        if epoch == 0:
            raise StagingError(f"chunk {chunk}: nothing was staged out or loaded into it by this group")
        self._wait(chunk, epoch, exact=True)
        if self.placement is not None:
            self._copy_in_part(chunk, epoch, ids)
            return
        slot = self.row.slot(chunk)
        held = self._holds == (chunk, epoch)  # this rank's GPU-verified load left the payload in the scratch
        scratch = self._get_scratch()
        n = len(ids)
        if not self.cuda:
            if not held:
                scratch.copy_(slot)
            self._check_unchanged(chunk, epoch)
            self._scatter_runs(ids, [self._layer_view(scratch, i) for i in range(len(self._pages))])
        else:
            with on_stream(self._stream, self.device):  # compute is done with the blocks about to be overwritten
                if not held:
                    scratch.copy_(slot, non_blocking=True)
            if not held:
                sync_point(self._stream)
            self._check_unchanged(chunk, epoch)  # before a single byte reaches the KV
            with torch.cuda.stream(self._stream):
                idx = torch.tensor(ids, dtype=torch.long, device=self.device)
                for i in range(len(self._pages)):
                    self._pages[i].index_copy_(0, idx, self._layer_view(scratch, i)[:n])
            after_compute(self._stream, self.device)  # compute sees the blocks, no host sync
        self.stats.bytes_in += n * self._block_bytes

    def _scatter_runs(self, ids: list[int], src: list["torch.Tensor"]) -> None:
        # CPU index_copy_ runs at ~1 GB/s; slice copies of block runs at memcpy speed
        for i, s in enumerate(src):
            for j, b, k in _runs(ids):
                self._pages[i][b:b + k].copy_(s[j:j + k])

    def _check_unchanged(self, chunk: int, epoch: int) -> None:
        fence()
        for p in range(self.row.parts):
            e, s = self.row.state(chunk, p)
            if (e, s) != (epoch, DONE):
                raise StagingConflictError(f"chunk {chunk}: slot changed to {_STATE_NAMES[s]} at epoch {e} while "
                                           f"this rank read epoch {epoch}; the KV was not modified")

    # -- row <-> file --------------------------------------------------------------------------------
    def save(self, chunk: int, key: BlockKey, store: "Store", *, codec: str = "none", level: int = 3,
             provenance: Provenance | None = None, fsync: bool = False, overwrite: bool = False,
             all_ranks: bool = False) -> tuple[str, int, bool] | None:
        """Write ``chunk`` of the row to ``store`` as the kvformat file of ``key``.

        Only the chunk's writer saves (other ranks return None) unless ``all_ranks``. Waits for the
        current epoch to be DONE, copies the slot, and checks the slot was not republished during the
        copy before anything is written: a republished slot raises StagingConflictError and no file
        ever becomes visible (a reader could otherwise load, or quarantine, a file of mixed epochs).
        The file is written from the copy, so later reuse of the slot cannot reach it. Returns
        ``store.put_block``'s (relpath, file bytes, written).
        """
        self.row._check_chunk(chunk)
        writer = self.writer_of(chunk, 0)
        if self.row.rank != writer and not all_ranks:
            return None
        epoch = int(self._epochs[chunk])
        if epoch == 0:
            raise StagingError(f"chunk {chunk}: nothing was staged out or loaded into it by this group")
        self._wait(chunk, epoch, exact=True)  # every part: a chunk missing a stage or DCP rank is never saved
        prov = provenance or self._provenance()
        # Seqlock read: copy, then confirm (epoch, DONE) still holds; a publisher marks the slot BUSY
        # before it touches a byte, so an unchanged word means the copy is of one epoch.
        snapshot = self.row.slot(chunk).numpy().tobytes()
        self._check_unchanged(chunk, epoch)
        out = store.put_block(snapshot, self.layout, key, provenance=prov, codec=codec, level=level,
                              fsync=fsync, overwrite=overwrite)
        if out[2]:
            self.stats.bytes_to_file += out[1]
        return out

    def _provenance(self) -> Provenance:
        pl = self.placement
        if pl is None:
            return Provenance(tp=self.row.world_size, row="canonical", writer=_writer_name(), created=int(time.time()))
        counts = tuple(len({i for i in (_layer_index(n) for n in st) if i is not None} or set(st)) for st in pl.stages)
        return Provenance(tp=pl.tp, pp=pl.pp, dcp=pl.dcp, pcp=pl.pcp, row="canonical", writer=_writer_name(),
                          created=int(time.time()), pp_layers=counts if pl.pp > 1 else (),
                          cp_interleave=pl.interleave if pl.dcp > 1 else 1)

    def load(self, chunk: int, key: BlockKey, store: "Store", *, verify: bool | str = True,
             wait: bool = True) -> bool:
        """Publish the file of ``key`` as ``chunk`` of the row. Collective, like :meth:`stage_out`.

        The chunk's writer reads the file into the slot through ``store.read_into`` (header, layout
        and checksums checked; the slot is zeroed on a bad checksum) and publishes DONE, or FAILED on
        any error, which it re-raises (OSError such as FileNotFoundError unchanged). Other ranks then
        wait (``wait``) and raise StagingError naming the writer when it failed.

        ``verify="device"`` (a GPU-verified load, needs Triton): the host checks the header but does not
        hash the data; the writer copies the slot to its KV's device and checks ``kvf.dxxh3`` there before
        it publishes DONE. A mismatch fails the load exactly as the CPU's check does (ChecksumError naming
        the file, for ``store.quarantine_read``; the slot zeroed; FAILED published, so no rank stages the
        chunk in). The writer's :meth:`stage_in` of the chunk then reuses the verified device copy instead of
        copying the slot again. Compressed and sealed files are checked on the CPU as with ``verify=True``.

        Returns True on the rank that read the file.
        """
        on_device = check_verify(verify)
        self.row._check_chunk(chunk)
        epoch = int(self._epochs[chunk]) + 1
        self._epochs[chunk] = epoch
        writer = self.writer_of(chunk, 0)
        if self.row.rank != writer:
            if wait:
                self.stats.wait_s += self.row.wait(chunk, epoch, writer=writer, timeout_s=self.timeout_s, exact=True,
                                                   what=self._what())
            return False
        parts = range(self.row.parts)  # the file holds every part: one rank publishes them all
        for p in parts:
            self.row._set(chunk, epoch, BUSY, part=p)
        self._holds = None
        try:
            slot = self.row.slot(chunk)
            check = None
            if on_device:
                def verified(n: int) -> None:
                    self._holds = (chunk, epoch)
                    self.stats.bytes_verified_device += n

                check = device_check(slot, self._get_scratch(), self._stream, verified)
            store.read_into(block_relpath(self.layout, key), slot, expect=self.layout, key=key,
                            verify=bool(verify), data_check=check)
        except BaseException as e:
            self._holds = None
            for p in parts:
                self.row._set(chunk, epoch, FAILED, type(e).__name__, part=p)
            raise
        for p in parts:
            self.row._set(chunk, epoch, DONE, part=p)
        self.stats.bytes_from_file += self.layout.payload_bytes
        return True

    def checksum_blocks(self, block_ids: Sequence[int]) -> int:
        """XXH3-64 of the chunk held by this rank's KV blocks ``block_ids``, in file order, on the KV's device.

        The payload a file of this layout holds for those blocks (per layer, their pages, zeros past a short
        chunk), hashed where the blocks are (:func:`xxh3_64_gathered`): after :meth:`stage_in` it equals the
        file's ``kvf.dxxh3`` (``int(header.data_xxh3, 16)``; a compressed file's ``kvf.raw_xxh3``) when every
        byte landed intact. Needs Triton. Raises StagingError for bad ids, and for a rank of a PP/DCP placement
        (its KV holds only its part of each chunk).
        """
        if self.placement is not None:
            raise StagingError("checksum_blocks: a rank of a PP/DCP placement holds only its part of a chunk")
        ids = self._check_ids(block_ids)
        scratch = self._get_scratch()
        bpc = self.layout.blocks_per_chunk
        if not self.cuda:
            return xxh3_64_gathered(self._pages, ids, bpc, buffer=scratch)
        with on_stream(self._stream, self.device):  # after the compute stream and the staging stream's copies
            return xxh3_64_gathered(self._pages, ids, bpc, buffer=scratch)

    # -- helpers -------------------------------------------------------------------------------------
    @property
    def _block_bytes(self) -> int:
        dcp = 1 if self.placement is None else self.placement.dcp
        return sum(self.layout.layers[i].page_bytes // dcp for i in self._mine)

    def _layer_view(self, flat: "torch.Tensor", i: int) -> "torch.Tensor":
        off, n = self.layout.layer_offsets[i], self.layout.chunk_bytes_per_layer[i]
        return flat[off:off + n].view(self.layout.blocks_per_chunk, self.layout.layers[i].page_bytes)

    def _get_scratch(self) -> "torch.Tensor":
        import torch

        self._holds = None  # whoever takes the scratch now overwrites what a verified load left there
        if self._scratch is None:
            self._scratch = torch.empty(self.layout.payload_bytes, dtype=torch.uint8, device=self.device)
            if self.cuda:  # used on the staging stream: the allocator must not recycle it before that stream ends
                self._scratch.record_stream(self._stream)
        return self._scratch

    def _check_ids(self, block_ids: Sequence[int]) -> list[int]:
        ids = [int(b) for b in (block_ids.tolist() if hasattr(block_ids, "tolist") else block_ids)]
        bpc = self.layout.blocks_per_chunk
        if not 1 <= len(ids) <= bpc:
            raise StagingError(f"block_ids: expected 1..{bpc} ids (blocks_per_chunk), got {len(ids)}")
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise StagingError(f"block_ids: expected ids in 0..{self.num_blocks - 1}, got {bad[:8]}")
        return ids


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``(position in chunk, first block id, length)`` of each run of consecutive block ids."""
    out: list[tuple[int, int, int]] = []
    for j, b in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((j, b, 1))
    return out


def _writer_name() -> str:
    from ..format import __version__

    return f"kvformat {__version__} staging"


def _layer_index(name: str) -> int | None:
    parts = [p for p in name.split(".") if p.isdigit()]
    return int(parts[0]) if len(parts) == 1 else None
