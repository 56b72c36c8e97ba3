"""Paged MLA KV (GPU or CPU) ⇄ one shared host row in /dev/shm ⇄ kvformat files.

The MLA latent is identical on every TP rank, so one copy per block is enough for the whole TP
group. :class:`SharedRow` (``_row``) is a page-aligned ``/dev/shm`` mapping shared by the ranks of one
node: one canonical slot per chunk (the kvformat payload, byte for byte) and a control area holding a
per-chunk sequence word. :class:`Stager` (``_stager``) moves blocks between one rank's paged KV cache and
that row: on the way out only the elected writer copies (device-to-host) and the other ranks wait for
it to publish; on the way in every rank copies the slot into its own KV.

Pipeline- and decode-context-parallel groups compose (:class:`RankPlacement`, ``_placement``): each
(stage, DCP rank) is one *part* of a chunk, written by one of its TP replicas into its place in the
canonical slot (its stage's layers, its DCP rank's tokens), so the row and the file are the same as a
TP-only group's. Modules: ``_shm`` (the /dev/shm file, stale rows, fences), ``_row`` (the row and its
protocol), ``_cuda`` (pinning, stream glue, events), ``_placement``, ``_stager``, ``_async``
(:class:`AsyncStager`: submit many transfers, poll for the finished ones; pipelined), ``_completion``,
``_xxh3_device`` (:func:`xxh3_64_device`, :func:`xxh3_64_gathered`: the data checksum computed on the tensor's
device with Triton) and ``_verify`` (GPU-verified loads: ``load(..., verify="device")``). Errors are in
:mod:`kvformat.errors`.
"""

from ..errors import StagingConflictError, StagingError, StagingTimeoutError
from ._async import AsyncStager
from ._completion import JobResult
from ._placement import RankPlacement
from ._row import SharedRow
from ._shm import _CHUNK_BASE, BUSY, DONE, EMPTY, FAILED, row_path
from ._stager import Stager
from ._stats import StagingStats
from ._xxh3_device import xxh3_64_device, xxh3_64_gathered

__all__ = [
    "SharedRow", "Stager", "AsyncStager", "JobResult", "StagingStats", "RankPlacement", "StagingError",
    "StagingTimeoutError", "StagingConflictError", "row_path", "EMPTY", "BUSY", "DONE", "FAILED",
    "xxh3_64_device", "xxh3_64_gathered",
]

_ = _CHUNK_BASE  # the control area's first chunk record (tests forge stale rows with it)
