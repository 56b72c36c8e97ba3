"""CUDA glue of the staging path: page-locking the shared row, and the staging stream's copies.

Everything here is reached only when torch reports CUDA; on a CPU-only host the row stays pageable and
the Stager copies with plain tensor operations.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..errors import StagingError

__all__ = ["pin_host", "unpin_host", "on_stream", "after_compute", "sync_point", "record_event", "device_ids"]


def pin_host(ptr: int, nbytes: int, *, required: bool) -> bool:
    """cudaHostRegister ``nbytes`` at ``ptr`` (DMA-speed copies); True when pinned.

    Not pinned (False) when CUDA is unavailable or the call fails, unless ``required``: then StagingError.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        if required:
            raise
        return False
    if not torch.cuda.is_available():
        if required:
            raise StagingError("pin='on' needs CUDA, and torch.cuda.is_available() is False")
        return False
    cudart = torch.cuda.cudart()
    res = cudart.cudaHostRegister(ptr, nbytes, 0)
    if res != cudart.cudaError.success:
        clear = getattr(cudart, "cudaGetLastError", None)  # else torch's next launch check reports it
        if clear is not None:
            clear()
        msg = f"cudaHostRegister of {nbytes} bytes failed ({res}); copies stay pageable"
        if required:
            raise StagingError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
        return False
    return True


def unpin_host(ptr: int) -> None:
    """Undo :func:`pin_host` (a failure is a warning: the mapping is going away anyway)."""
    import torch

    cudart = torch.cuda.cudart()
    res = cudart.cudaHostUnregister(ptr)
    if res != cudart.cudaError.success:
        warnings.warn(f"cudaHostUnregister failed ({res})", RuntimeWarning, stacklevel=3)


def on_stream(stream: Any, device: Any) -> Any:
    """Enter ``stream`` after it waited for the compute stream (the KV blocks were written there).

    Use as ``with on_stream(s, dev): ...``; the compute stream of ``device`` is taken before the context
    makes ``stream`` current.
    """
    import torch

    compute = torch.cuda.current_stream(device)
    stream.wait_stream(compute)
    return torch.cuda.stream(stream)


def after_compute(stream: Any, device: Any) -> None:
    """Make the compute stream wait for what was queued on ``stream`` (no host sync)."""
    import torch

    done = torch.cuda.Event()
    done.record(stream)
    torch.cuda.current_stream(device).wait_event(done)


def sync_point(stream: Any) -> None:
    """Block the host until ``stream``'s queued work is done (sleeping, not spinning)."""
    import torch

    done = torch.cuda.Event(blocking=True)
    done.record(stream)
    done.synchronize()


def record_event(stream: Any) -> Any:
    """An event marking what is queued on ``stream`` now; poll it with ``.query()`` (no host sync)."""
    import torch

    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def device_ids(ids: list[int], device: Any) -> Any:
    """Block ids as a long tensor on ``device``, copied from pinned memory: a copy from pageable memory would
    make the host wait for the stream's earlier work, the per-chunk sync the pipeline exists to avoid."""
    import torch

    return torch.tensor(ids, dtype=torch.long).pin_memory().to(device, non_blocking=True)
