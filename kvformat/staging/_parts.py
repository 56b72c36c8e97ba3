"""The Stager's copies of one rank's *part* of a chunk (pipeline stage layers, DCP rank tokens).

A mixin of :class:`kvformat.staging.Stager`: the part's bytes sit in the canonical slot at strided
positions (each DCP rank's tokens of a logical block, interleaved as vLLM does); these methods gather
them from, and scatter them into, one rank's paged KV. See :mod:`kvformat.staging._placement`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._cuda import after_compute, on_stream, sync_point

if TYPE_CHECKING:
    import torch

    from ..format._spec import CanonicalLayout
    from ._placement import RankPlacement
    from ._row import SharedRow

__all__ = ["PartCopies"]


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
        slot = self.row.slot(chunk)
        n = len(ids)
        local = self._local_pages(ids)  # (n, page) per own layer, on the host
        for k, i in enumerate(self._mine):
            view = self._part_view(slot, i)
            view[:n] = local[k].view(n, *view.shape[1:])
            if n < view.shape[0]:
                view[n:] = 0  # a short chunk still has one defined payload (and file checksum)

    def _part_view(self, flat: "torch.Tensor", i: int) -> "torch.Tensor":
        """Layer ``i``'s bytes of this rank's part in a payload: ``(blocks, runs, interleave * row)``, the
        strided positions of its DCP rank's tokens (the whole pages without DCP)."""
        assert self.placement is not None
        dcp, inter = self.placement.dcp, self.placement.interleave
        lay = self.layout.layers[i]
        row = lay.page_bytes // self.layout.tokens_per_block  # bytes per token
        runs = self.layout.tokens_per_block // dcp // inter
        view = self._layer_view(flat, i).view(self.layout.blocks_per_chunk, runs, dcp, inter * row)
        return view[:, :, self._part % dcp, :]

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

        slot = self.row.slot(chunk)
        n = len(ids)
        local = [self._part_view(slot, i)[:n].reshape(n, -1).clone() for i in self._mine]
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
