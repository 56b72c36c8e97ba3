"""What one rank's Stager did (per-rank byte counts and waits)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["StagingStats"]


@dataclass
class StagingStats:
    """What one rank's :class:`Stager` did. Bytes count payload bytes moved by THIS rank."""

    bytes_out: int = 0  # KV -> row copies made by this rank (device-to-host on CUDA)
    bytes_in: int = 0  # row -> KV copies made by this rank (host-to-device on CUDA)
    bytes_to_file: int = 0  # file bytes written by this rank
    bytes_from_file: int = 0  # payload bytes read from files into the row by this rank
    chunks_written: int = 0  # stage_out calls where this rank was the writer and copied
    chunks_observed: int = 0  # stage_out calls where another rank was the writer
    wait_s: float = 0.0  # time spent waiting for other ranks' publications
    bytes_verified_device: int = 0  # file data bytes whose checksum this rank checked on its device

    def to_dict(self) -> dict[str, Any]:
        return {"bytes_out": self.bytes_out, "bytes_in": self.bytes_in, "bytes_to_file": self.bytes_to_file,
                "bytes_from_file": self.bytes_from_file, "chunks_written": self.chunks_written,
                "chunks_observed": self.chunks_observed, "wait_s": self.wait_s,
                "bytes_verified_device": self.bytes_verified_device}
