"""The Stager's copies of one rank's *part* of a chunk (pipeline stage layers, DCP rank tokens).

A mixin of :class:`kvformat.staging.Stager`: the part's bytes sit in the canonical slot at strided
positions (each DCP rank's tokens of a logical block, interleaved as vLLM does); these methods gather
them from, and scatter them into, one rank's paged KV. See :mod:`kvformat.staging._placement`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import StagingError
from ._cuda import after_compute, on_stream, sync_point

if TYPE_CHECKING:
    import torch

    from ..format import CanonicalLayout
    from ._placement import RankPlacement
    from ._row import SharedRow

__all__ = ["PartCopies"]


def _bytes_of(t: "torch.Tensor") -> memoryview:
    """A host tensor's bytes, writable, without a copy."""
    return memoryview(t.numpy()).cast("B")


def _layer_part_runs(layout: "CanonicalLayout", i: int, pl: "RankPlacement | None", part: int) -> list[bytes]:
    """Per block, layer ``i``'s runs from a rank's local page (offset 0) into the payload (the tier's rule:
    kvformat.layout page_runs over the layer's sub-layouts and vLLM's DCP token map)."""
    import numpy as np

    from ..layout import canonical, cp_canonical_token, describe, page_runs

    lay = layout.layers[i]
    dcp, inter = (pl.dcp, pl.interleave) if pl is not None else (1, 1)
    platform = pl.platform if pl is not None else None
    tokens = layout.tokens_per_block // dcp
    kvd = lay.kv_dtype or layout.kv_dtype
    tb = lay.page_bytes // layout.tokens_per_block
    local = describe(lay.role, kvd, tb, platform, tokens)
    can = canonical(lay.role, kvd, tb, local.encoding) if local is not None else None
    if local is None and dcp > 1:
        raise StagingError(f"layer {lay.name}: where a token's bytes sit in a {lay.role} {kvd} page on platform "
                           f"{platform or 'unknown'} is not described; decode-context parallelism is refused for it")
    tmap = tuple(cp_canonical_token(t, part % dcp, dcp, inter) for t in range(tokens))
    out = []
    page = lay.page_bytes // dcp
    for j in range(layout.blocks_per_chunk):
        if local is None:  # whole pages (no DCP): nothing moves inside a page
            runs = [(j * page, layout.layer_offsets[i] + j * lay.page_bytes, page, 1, page, page)]
        else:
            runs = page_runs(local, tokens, can, layout.tokens_per_block, tmap, j * page,
                             layout.layer_offsets[i] + j * lay.page_bytes)
        out.append(np.asarray(runs, dtype=np.int64).reshape(-1, 6).tobytes())
    return out


def _shift_src(runs: bytes, by: int) -> bytes:
    import numpy as np

    r = np.frombuffer(runs, dtype=np.int64).reshape(-1, 6).copy()
    r[:, 0] += by
    return r.tobytes()


def _swap(runs: bytes) -> bytes:
    """Runs reversed (payload -> local pages)."""
    import numpy as np

    r = np.frombuffer(runs, dtype=np.int64).reshape(-1, 6)
    return r[:, [1, 0, 2, 3, 5, 4]].copy().tobytes()


class PartCopies:
    """Part copies for :class:`~kvformat.staging.Stager` (which holds the attributes used here)."""

    # Set by Stager.__init__.
    placement: "RankPlacement | None"
    layout: "CanonicalLayout"
    row: "SharedRow"
    stats: Any
    cuda: bool
    device: Any
    _mine: list[int]
    _part: int
    _pages: list[Any]
    _stream: Any
    _host: Any

    def _copy_out_part(self, ids: list[int], chunk: int) -> None:
        """This rank's part into the slot: its layers, its DCP rank's tokens at their logical positions."""
        from ..format import copy_runs

        slot = _bytes_of(self.row.slot(chunk))
        n = len(ids)
        local = self._local_pages(ids)  # (n, page) per own layer, on the host
        for k, i in enumerate(self._mine):
            per_block = self._part_runs(i)
            src = _bytes_of(local[k])
            for j in range(n):
                copy_runs(slot, src, per_block[j])
            if n < len(per_block):
                # A short chunk still has one defined payload (and file checksum): this part's bytes are zero.
                zero = bytes(self.layout.layers[i].page_bytes // self.placement.dcp) if self.placement else b""
                for j in range(n, len(per_block)):
                    copy_runs(slot, zero, _shift_src(per_block[j], -j * len(zero)))

    def _part_runs(self, i: int) -> list[bytes]:
        """Per block of the chunk, the runs (local page -> payload) of layer ``i``'s part, built once from the
        layer's sub-layouts (kvformat.layout._sublayout): the worker's order and the file's, the DCP token map."""
        cache = self.__dict__.setdefault("_part_runs_cache", {})
        if i not in cache:
            cache[i] = _layer_part_runs(self.layout, i, self.placement, self._part)
        out: list[bytes] = cache[i]
        return out

    def _local_pages(self, ids: list[int]) -> list["torch.Tensor"]:
        """This rank's pages of blocks ``ids``, one ``(n, page)`` host tensor per own layer."""
        import torch

        n = len(ids)
        if not self.cuda:
            idx = torch.tensor(ids, dtype=torch.long)
            return [torch.index_select(p, 0, idx) for p in self._pages]
        host = self._get_host()
        out, off = [], 0
        with on_stream(self._stream, self.device):
            idx = torch.tensor(ids, dtype=torch.long, device=self.device)
            for p in self._pages:
                nb = n * p.shape[1]
                host[off:off + nb].view(n, -1).copy_(torch.index_select(p, 0, idx), non_blocking=True)
                out.append(host[off:off + nb].view(n, -1))
                off += nb
        sync_point(self._stream)
        return out

    def _get_host(self) -> "torch.Tensor":
        import torch

        if self._host is None:
            self._host = torch.empty(self.layout.payload_bytes, dtype=torch.uint8, pin_memory=self.cuda)
        return self._host

    def _copy_in_part(self, chunk: int, epoch: int, ids: list[int]) -> None:
        """This rank's part of the slot into its KV: copied out first, used only if the slot did not change."""
        import torch

        from ..format import copy_runs

        slot = _bytes_of(self.row.slot(chunk))
        n = len(ids)
        local = []
        for i in self._mine:
            page = self.layout.layers[i].page_bytes // (self.placement.dcp if self.placement else 1)
            buf = torch.empty((n, page), dtype=torch.uint8)
            dst = _bytes_of(buf)
            for runs in self._part_runs(i)[:n]:
                copy_runs(dst, slot, _swap(runs))
            local.append(buf)
        self._check_unchanged(chunk, epoch)  # before a single byte reaches the KV
        if not self.cuda:
            self._scatter_runs(ids, local)
        else:
            with on_stream(self._stream, self.device):
                idx = torch.tensor(ids, dtype=torch.long, device=self.device)
                for p, x in zip(self._pages, local):
                    p.index_copy_(0, idx, x.to(self.device, non_blocking=True))
            after_compute(self._stream, self.device)
        self.stats.bytes_in += n * self._block_bytes

    # Stager's own helpers, used here.
    def _layer_view(self, flat: "torch.Tensor", i: int) -> "torch.Tensor":
        raise NotImplementedError

    def _check_unchanged(self, chunk: int, epoch: int) -> None:
        raise NotImplementedError

    def _scatter_runs(self, ids: list[int], src: list["torch.Tensor"]) -> None:
        raise NotImplementedError

    @property
    def _block_bytes(self) -> int:
        raise NotImplementedError
