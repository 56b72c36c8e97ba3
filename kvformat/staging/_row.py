"""The shared row: a /dev/shm mapping of canonical slots and the per-chunk control words ranks publish with.

Protocol (every publishing call is *collective*: every rank of the group calls it, for a given chunk
in the same order, so each rank's local per-chunk epoch counter agrees with the others'):

- a chunk part's control word is ``epoch << 2 | state`` (state EMPTY, BUSY, DONE or FAILED);
- the writer of a part stores ``(e, BUSY)``, fills its bytes of the slot, then stores ``(e, DONE)`` (or
  ``(e, FAILED)``);
- a reader waits for every part at ``(e, DONE)``, copies the slot, re-reads the words and only then uses
  the copy: a slot that was BUSY, FAILED or republished while being copied is never used;
- waiting backs off from 50 µs to 5 ms between polls and raises StagingTimeoutError naming the chunk,
  the part and its writer rank when the deadline passes (the writer died or hung).

The row file is unlinked as soon as every rank has mapped it, so the memory goes back to the kernel
when the last process exits, however it exits.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..format import ALIGNMENT, round_up
from ..errors import StagingConflictError, StagingError, StagingTimeoutError
from ._cuda import pin_host, unpin_host
from ._shm import (
    _CHUNK_BASE, _CHUNK_REC, _HDR_WORDS, _MAGIC, _MAPPED_OFF, _MAX_WORLD, _REASON_BYTES, _STATE_NAMES, BUSY, DONE,
    FAILED, Backoff, creator_alive, fence, open_existing, row_path, start_time, unlink_if_same, wait_for_size,
)

if TYPE_CHECKING:
    import torch

__all__ = ["SharedRow"]


class SharedRow:
    """A page-aligned /dev/shm region of ``num_chunks`` canonical slots shared by ``world_size`` ranks.

    Open it with :meth:`open` from every rank (a collective call). Layout: a control area (header,
    one "mapped" byte per rank, one 64-byte record per chunk and part), then the slots, each starting on
    a 4096-byte boundary. The slot of a chunk holds exactly the kvformat payload of that chunk.

    ``parts``: how many writers publish one chunk (pipeline stages x DCP ranks, each writing its part of
    the payload; 1 for a TP group). Each part has its own control word; a chunk is published at an epoch
    when every part is DONE at that epoch.
    """

    def __init__(self, *, path: str, fd: int, mm: mmap.mmap, rank: int, world_size: int, num_chunks: int,
                 slot_bytes: int, creator: bool, parts: int = 1) -> None:
        self.path = path
        self.rank = rank
        self.world_size = world_size
        self.num_chunks = num_chunks
        self.slot_bytes = slot_bytes
        self.parts = parts
        self.slot_stride = round_up(slot_bytes, ALIGNMENT)
        self.control_bytes = _control_bytes(num_chunks, parts)
        self.nbytes = self.control_bytes + self.slot_stride * num_chunks
        self.creator = creator
        self.pinned = False
        self._fd: int | None = fd
        self._mm: mmap.mmap | None = mm
        self._ctl: np.ndarray | None = np.frombuffer(mm, dtype=np.int64, count=self.control_bytes // 8)
        self._ctl_bytes: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8, count=self.control_bytes)
        self._base: Any = None  # torch.uint8 view of the whole mapping, made on first use

    # -- opening ---------------------------------------------------------------------------------
    @classmethod
    def open(cls, name: str, *, rank: int, world_size: int, num_chunks: int, slot_bytes: int,
             timeout_s: float = 60.0, pin: str = "auto", parts: int = 1) -> "SharedRow":
        """Create or join the row ``name``; returns once every rank has mapped it (then it is unlinked).

        The first rank to arrive creates ``/dev/shm/kvformat_row_<name>`` with O_EXCL and sizes it; the
        others wait (with backoff) for the size and the header, and check that they agree on it.

        Parameters
        ----------
        name: unique per group instance (e.g. an engine id); the same on every rank of the group.
        rank, world_size: this rank and the number of ranks that share the row (ranks of one node).
        num_chunks: slots in the row. slot_bytes: bytes of one slot (``layout.payload_bytes``).
        timeout_s: how long to wait for the creator and for every rank to map the row.
        pin: ``"auto"`` pins the mapping with cudaHostRegister when CUDA is available, ``"on"``
            requires it, ``"off"`` never pins.
        parts: writers per chunk (see the class); every rank must give the same number.

        Raises
        ------
        StagingTimeoutError if the row is not ready or not every rank mapped it in time (the file is
        then unlinked, so nothing leaks); StagingError for bad arguments or a row of another shape;
        OSError from /dev/shm (e.g. ENOSPC) passes through.
        """
        path = row_path(name)
        if not 1 <= world_size <= _MAX_WORLD or not 0 <= rank < world_size:
            raise StagingError(f"rank/world_size: expected 0 <= rank < world_size <= {_MAX_WORLD}, "
                               f"got rank={rank}, world_size={world_size}")
        if num_chunks < 1 or slot_bytes < 1:
            raise StagingError(f"num_chunks and slot_bytes: expected >= 1, got {num_chunks}, {slot_bytes}")
        if pin not in ("auto", "on", "off"):
            raise StagingError(f"pin: expected auto, on or off, got {pin!r}")
        if not 1 <= parts <= _MAX_WORLD:
            raise StagingError(f"parts: expected 1..{_MAX_WORLD}, got {parts}")
        ctl = _control_bytes(num_chunks, parts)
        total = ctl + round_up(slot_bytes, ALIGNMENT) * num_chunks
        backoff = Backoff(timeout_s)
        while True:
            row = cls._create_or_join(path, name, total, ctl, (num_chunks, slot_bytes, world_size, parts), rank,
                                      backoff)
            if row is not None:
                break
            if backoff.expired():
                raise StagingTimeoutError(f"row {name!r}: could not create or join {path} in time",
                                          waited_s=backoff.waited())
        try:
            row._join(backoff, name, timeout_s)
            if pin != "off":
                row._pin(required=pin == "on")
        except BaseException:
            row.close()
            raise
        return row

    @classmethod
    def _create_or_join(cls, path: str, name: str, total: int, ctl: int, shape: tuple[int, int, int, int],
                        rank: int, backoff: Backoff) -> "SharedRow | None":
        """One attempt; None when the file found was left by a dead group (it is removed: try again)."""
        num_chunks, slot_bytes, world_size, parts = shape
        creator = False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            creator = True
        except FileExistsError:
            fd = open_existing(path, backoff)
        mm: mmap.mmap | None = None
        hdr: np.ndarray | None = None
        try:
            if creator:
                os.ftruncate(fd, total)
            else:
                wait_for_size(fd, path, total, backoff)
            mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            hdr = np.frombuffer(mm, dtype=np.int64, count=_HDR_WORDS)
            want = (num_chunks, slot_bytes, round_up(slot_bytes, ALIGNMENT), world_size, parts)
            if creator:
                hdr[1:5] = want[:4]
                hdr[8] = parts
                hdr[5] = os.getpid()
                hdr[6] = ctl
                hdr[7] = start_time(os.getpid())
                fence()
                hdr[0] = _MAGIC  # last: joiners read the other fields only once this is set
            else:
                while int(hdr[0]) != _MAGIC:
                    if backoff.expired():
                        raise StagingTimeoutError(f"row {name!r}: the creator sized {path} but never wrote its "
                                                  f"header in time (it likely died)", waited_s=backoff.waited())
                    backoff.pause()
                fence()
                got = (*(int(x) for x in hdr[1:5]), int(hdr[8]))
                if got != want:
                    raise StagingError(f"row {name!r}: expected (num_chunks, slot_bytes, slot_stride, world_size, "
                                       f"parts) = {want}, got {got} from the rank that created it")
                if not creator_alive(int(hdr[5]), int(hdr[7])):
                    # Left by a group that died while opening it: its control words must never be trusted.
                    hdr = None
                    mm.close()
                    unlink_if_same(path, fd)
                    os.close(fd)
                    return None
            hdr = None
            return cls(path=path, fd=fd, mm=mm, rank=rank, world_size=world_size, num_chunks=num_chunks,
                       slot_bytes=slot_bytes, creator=creator, parts=parts)
        except BaseException as exc:
            hdr = None
            if mm is not None:
                with contextlib.suppress(BufferError):
                    mm.close()
            # The creator, or a joiner whose creator died, removes the name; a joiner that found another
            # group's row (shape mismatch) leaves it alone.
            if creator or isinstance(exc, StagingTimeoutError):
                unlink_if_same(path, fd)
            os.close(fd)
            raise

    def _join(self, backoff: Backoff, name: str, timeout_s: float) -> None:
        assert self._ctl_bytes is not None and self._fd is not None
        self._ctl_bytes[_MAPPED_OFF + self.rank] = 1
        fence()
        while True:
            # A copy, not a view: a view alive in a traceback would keep the mapping from closing.
            flags = bytes(self._ctl_bytes[_MAPPED_OFF:_MAPPED_OFF + self.world_size])
            if all(flags):
                break
            if backoff.expired():
                missing = [r for r, f in enumerate(flags) if not f]
                unlink_if_same(self.path, self._fd)  # a rank that never comes must not leave the file behind
                raise StagingTimeoutError(f"row {name!r}: ranks {missing} did not map it within {timeout_s:g} s",
                                          waited_s=backoff.waited())
            backoff.pause()
        # Every rank has mapped it: drop the name now so a crash of any process leaks nothing.
        unlink_if_same(self.path, self._fd)

    def _pin(self, *, required: bool) -> None:
        try:
            import torch
        except ImportError:  # pragma: no cover - torch is a dependency
            if required:
                raise
            return
        if not torch.cuda.is_available():
            pin_host(0, 0, required=required)  # raises when required, else nothing to do
            return
        self.pinned = pin_host(self._base_tensor().data_ptr(), self.nbytes, required=required)

    # -- views -----------------------------------------------------------------------------------
    def _base_tensor(self) -> "torch.Tensor":
        if self._mm is None:
            raise StagingError(f"row {self.path}: already closed")
        if self._base is None:
            import torch

            self._base = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._base

    def slot(self, chunk: int) -> "torch.Tensor":
        """A uint8 tensor over the slot of ``chunk`` (``slot_bytes`` long; valid until :meth:`close`)."""
        self._check_chunk(chunk)
        off = self.control_bytes + chunk * self.slot_stride
        return self._base_tensor()[off:off + self.slot_bytes]

    def _check_chunk(self, chunk: int) -> None:
        if not isinstance(chunk, (int, np.integer)) or not 0 <= chunk < self.num_chunks:
            raise StagingError(f"chunk: expected 0..{self.num_chunks - 1}, got {chunk!r}")

    # -- control words ---------------------------------------------------------------------------
    def _rec(self, chunk: int, part: int = 0) -> int:
        return (_CHUNK_BASE + (chunk * self.parts + part) * _CHUNK_REC) // 8

    def state(self, chunk: int, part: int = 0) -> tuple[int, int]:
        """``(epoch, state)`` of a chunk's part as published now (state is EMPTY, BUSY, DONE or FAILED)."""
        self._check_chunk(chunk)
        if not 0 <= part < self.parts:
            raise StagingError(f"part: expected 0..{self.parts - 1}, got {part!r}")
        assert self._ctl is not None
        w = int(self._ctl[self._rec(chunk, part)])
        return w >> 2, w & 3

    def _set(self, chunk: int, epoch: int, state: int, reason: str = "", part: int = 0) -> None:
        assert self._ctl is not None and self._ctl_bytes is not None
        i = self._rec(chunk, part)
        if state == BUSY:
            self._ctl[i + 1] = self.rank
            self._ctl[i + 2] = os.getpid()
        if state == FAILED:
            b = reason.encode("ascii", "replace")[:_REASON_BYTES].ljust(_REASON_BYTES, b"\0")
            self._ctl_bytes[i * 8 + 24:i * 8 + 24 + _REASON_BYTES] = np.frombuffer(b, dtype=np.uint8)
        fence()  # slot bytes (and the fields above) before the word that publishes them
        self._ctl[i] = epoch << 2 | state
        fence()

    def _who(self, chunk: int, part: int = 0) -> tuple[int, int, str]:
        assert self._ctl is not None and self._ctl_bytes is not None
        i = self._rec(chunk, part)
        raw = bytes(self._ctl_bytes[i * 8 + 24:i * 8 + 24 + _REASON_BYTES]).rstrip(b"\0").decode("ascii", "replace")
        return int(self._ctl[i + 1]), int(self._ctl[i + 2]), raw

    def wait(self, chunk: int, epoch: int, *, writer: int | Sequence[int], timeout_s: float, exact: bool,
             what: Sequence[str] = ()) -> float:
        """Block until every part of ``chunk`` is DONE at ``epoch`` (or later unless ``exact``); returns
        seconds waited. ``writer``: the rank publishing each part (one rank for every part, or one per part);
        ``what``: per part, what it is (named in errors: "pipeline stage 1, DCP rank 0").

        Raises StagingTimeoutError naming the chunk, the part and its writer at the deadline, StagingError if
        a writer published FAILED, StagingConflictError if ``exact`` and a later epoch is there.
        """
        writers = [writer] * self.parts if isinstance(writer, int) else list(writer)
        backoff = Backoff(timeout_s)
        pending = list(range(self.parts))
        while True:
            for p in list(pending):
                e, s = self.state(chunk, p)
                if e == epoch and s == DONE or (e > epoch and not exact):
                    pending.remove(p)
                    continue
                part = f" ({what[p]})" if p < len(what) else ""
                if e == epoch and s == FAILED:
                    r, pid, reason = self._who(chunk, p)
                    raise StagingError(f"chunk {chunk}{part}: writer rank {r} (pid {pid}) failed to publish epoch "
                                       f"{epoch}: {reason or 'error'}")
                if e > epoch:
                    raise StagingConflictError(f"chunk {chunk}{part}: expected epoch {epoch}, the slot already holds "
                                               f"epoch {e} (republished before every rank read it)")
                if backoff.expired():
                    raise StagingTimeoutError(
                        f"chunk {chunk}{part}: writer rank {writers[p]} did not publish epoch {epoch} within "
                        f"{timeout_s:g} s (slot is {_STATE_NAMES[s]} at epoch {e}); the writer likely died or hung",
                        chunk=chunk, writer=writers[p], epoch=epoch, state=_STATE_NAMES[s],
                        waited_s=backoff.waited())
                break  # wait for this part before polling the next
            if not pending:
                fence()  # the slot bytes are read only after the DONE words were seen
                return backoff.waited()
            backoff.pause()

    # -- closing ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Unpin, unmap and close. Slot tensors taken from this row must be dropped before."""
        if self._mm is None:
            return
        if self.pinned:
            unpin_host(self._base_tensor().data_ptr())
            self.pinned = False
        self._base = None
        self._ctl = None
        self._ctl_bytes = None
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            warnings.warn(f"{self.path}: slot views are still alive; the mapping stays until they are dropped",
                          RuntimeWarning, stacklevel=2)
        if self._fd is not None:
            unlink_if_same(self.path, self._fd)  # in case close comes before every rank joined
            os.close(self._fd)
            self._fd = None

    @property
    def closed(self) -> bool:
        return self._mm is None

    def __enter__(self) -> "SharedRow":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SharedRow({self.path!r}, rank={self.rank}/{self.world_size}, chunks={self.num_chunks}, "
                f"slot_bytes={self.slot_bytes}, parts={self.parts}, pinned={self.pinned})")


def _control_bytes(num_chunks: int, parts: int = 1) -> int:
    return round_up(_CHUNK_BASE + num_chunks * parts * _CHUNK_REC, ALIGNMENT)
