"""Job results and *completions* of the asynchronous staging API: one interface, ``ready()``, over what a
queued copy is on each device (a CUDA event, a CPU copy thread's future, or nothing left to wait for), so the
pipeline's logic is the same code on the CPU and on a GPU."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

__all__ = ["JobResult", "Ready"]


@dataclass(frozen=True)
class JobResult:
    """One finished job: ``kind`` is stage_out, stage_in, load or save; ``error`` is None on success, else the
    exception (StagingTimeoutError naming the writer, StagingConflictError, StagingError, OSError...)."""

    job_id: int
    kind: str
    chunk: int
    value: Any = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Ready:
    """A completion that is already complete (nothing was queued)."""

    @staticmethod
    def ready() -> bool:
        return True


class _Event:
    """A CUDA event: ready once the device ran what was queued before it."""

    def __init__(self, ev: Any) -> None:
        self.ev = ev

    def ready(self) -> bool:
        return bool(self.ev.query())


class _Future:
    """A worker thread's future: ready once the call returned (its error surfaces in :meth:`result`)."""

    def __init__(self, fut: "Future[Any]") -> None:
        self.fut = fut

    def ready(self) -> bool:
        return self.fut.done()


def _result(c: Any) -> Any:
    return c.fut.result() if isinstance(c, _Future) else None
