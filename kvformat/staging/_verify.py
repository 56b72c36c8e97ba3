"""GPU-verified loads: the data checksum of a file read without a CPU hash, computed where its bytes landed.

The host reads the file with the header checked as always and hands the format's read pipeline a *data check*
in place of its CPU pass over the data (:func:`kvformat.format._read.read_payload_from`'s ``data_check``): the
check copies the bytes now in the slot to the device and hashes them there (:func:`xxh3_64_device`). It runs
while the file is still open, so a mismatch is the very error a CPU checksum failure is (ChecksumError, region
``data``, naming the file read): the slot is zeroed, the chunk is published FAILED, and the caller quarantines
the file as it does today (``store.quarantine_read(relpath, err)``). Compressed and sealed files are still
checked on the CPU (their stored bytes are decoded or authenticated there anyway).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ..errors import ChecksumError
from ._xxh3_device import xxh3_64_device

if TYPE_CHECKING:
    import torch

    from ..format import BlockHeader

__all__ = ["DEVICE", "device_check", "check_verify"]

DEVICE = "device"  # the load mode: verify="device"


def check_verify(verify: object) -> bool:
    """True for ``verify="device"``, False for True/False; StagingError for anything else. Imports Triton
    first, so a host without it fails before any file is read."""
    from ..errors import StagingError

    if verify is True or verify is False:
        return False
    if verify != DEVICE:
        raise StagingError(f"verify: expected True, False or {DEVICE!r}, got {verify!r}")
    from ._xxh3_device import _triton

    _triton()
    return True


def device_check(slot: "torch.Tensor", buf: "torch.Tensor", stream: Any,
                 done: Callable[[int], None] | None = None) -> Callable[["BlockHeader", memoryview], None]:
    """The read pipeline's data check for a read into ``slot``: copy the stored bytes to ``buf`` (on the device,
    on ``stream`` when CUDA), hash them there and compare with ``kvf.dxxh3``. ``done(nbytes)`` after a match."""

    def check(hdr: "BlockHeader", dst: memoryview) -> None:
        import torch

        n = hdr.data_bytes
        if buf.device.type == "cuda":
            with torch.cuda.stream(stream):
                buf[:n].copy_(slot[:n], non_blocking=True)  # pinned slot: a DMA copy
                got = xxh3_64_device(buf[:n])  # queued after the copy on the same stream; waits for 8 bytes
        else:
            buf[:n].copy_(slot[:n])
            got = xxh3_64_device(buf[:n])
        actual = f"{got:016x}"
        if actual != hdr.data_xxh3:
            raise ChecksumError("data", hdr.data_xxh3, actual)  # F-5.2, as the CPU's check raises it
        if done is not None:
            done(n)

    return check
