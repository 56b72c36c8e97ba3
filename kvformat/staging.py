"""Paged MLA KV (GPU or CPU) ⇄ one shared host row in /dev/shm ⇄ kvformat files.

The MLA latent is identical on every TP rank, so one copy per block is enough for the whole TP
group. :class:`SharedRow` is a page-aligned ``/dev/shm`` mapping shared by the ranks of one node:
one canonical slot per chunk (the kvformat payload, byte for byte) and a control area holding a
per-chunk sequence word. :class:`Stager` moves blocks between one rank's paged KV cache and that
row: on the way out only the elected writer copies (device-to-host) and the other ranks wait for it
to publish; on the way in every rank copies the slot into its own KV. Row ⇄ file goes through
:meth:`kvformat.storage.Store.put_block` / :meth:`~kvformat.storage.Store.read_into`, the code the
vLLM tier uses.

Protocol (every publishing call is *collective*: every rank of the group calls it, for a given chunk
in the same order, so each rank's local per-chunk epoch counter agrees with the others'):

- a chunk's control word is ``epoch << 2 | state`` (state EMPTY, BUSY, DONE or FAILED);
- the writer stores ``(e, BUSY)``, fills the slot, then stores ``(e, DONE)`` (or ``(e, FAILED)``);
- a reader waits for ``(e, DONE)``, copies the slot into scratch memory, re-reads the word and only
  then scatters into its KV: a slot that was BUSY, FAILED or republished while being copied is
  never written into a rank's KV;
- waiting backs off from 50 µs to 5 ms between polls and raises :class:`StagingTimeoutError`
  naming the chunk and the writer rank when the deadline passes (the writer died or hung).

The row file is unlinked as soon as every rank has mapped it, so the memory goes back to the
kernel when the last process exits, however it exits.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ._spec import ALIGNMENT, BlockKey, CanonicalLayout, Provenance, block_relpath
from .errors import KVFormatError, LayoutMismatchError

if TYPE_CHECKING:
    import torch

    from .storage import Store

__all__ = [
    "SharedRow", "Stager", "StagingStats", "StagingError", "StagingTimeoutError", "StagingConflictError",
    "row_path", "EMPTY", "BUSY", "DONE", "FAILED",
]

SHM_DIR = "/dev/shm"
ROW_PREFIX = "kvformat_row_"
_MAGIC = int.from_bytes(b"KVFROW01", "little")
_MAX_WORLD = 1024
_HDR_WORDS = 16  # magic, num_chunks, slot_bytes, slot_stride, world_size, creator pid, control bytes, start time
_MAPPED_OFF = 256  # one byte per rank: "I have mapped the row"
_CHUNK_REC = 64  # bytes of control per chunk: one cache line, so writers of different chunks never share one
_CHUNK_BASE = _MAPPED_OFF + _MAX_WORLD  # 1280: first chunk record
_REASON_BYTES = 32  # FAILED records keep the writer's error class name here

EMPTY, BUSY, DONE, FAILED = 0, 1, 2, 3
_STATE_NAMES = ("EMPTY", "BUSY", "DONE", "FAILED")
_MIN_SLEEP_S = 50e-6
_MAX_SLEEP_S = 5e-3


class StagingError(KVFormatError, ValueError):
    """A staging call cannot complete: bad arguments, or the writer of a chunk reported a failure."""


class StagingTimeoutError(StagingError):
    """Waiting on another rank passed its deadline. ``chunk``/``writer`` say what was waited for."""

    def __init__(self, message: str, *, chunk: int | None = None, writer: int | None = None,
                 epoch: int | None = None, state: str | None = None, waited_s: float = 0.0) -> None:
        self.chunk = chunk
        self.writer = writer
        self.epoch = epoch
        self.state = state
        self.waited_s = waited_s
        super().__init__(message)


class StagingConflictError(StagingError):
    """A slot was republished while a rank was still reading it (the caller reused the chunk too early)."""


def row_path(name: str) -> str:
    """The /dev/shm path of the row called ``name`` (present only while ranks are joining)."""
    if not name or "/" in name or "\x00" in name or len(name) > 200:
        raise StagingError(f"row name: expected 1..200 characters without '/', got {name[:80]!r}")
    return os.path.join(SHM_DIR, ROW_PREFIX + name)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


_FENCE_LOCK = threading.Lock()


def _fence() -> None:
    # A release followed by an acquire on the same lock orders every earlier memory access before every
    # later one (needed on weakly ordered CPUs: the slot bytes must be visible before the DONE word).
    with _FENCE_LOCK:
        pass
    with _FENCE_LOCK:
        pass


class _Backoff:
    """Sleeps 50 µs, doubling to 5 ms: waiters cost no CPU, and a fast writer is seen within ~5 ms."""

    def __init__(self, timeout_s: float) -> None:
        self.start = time.monotonic()
        self.deadline = self.start + timeout_s
        self.sleep_s = _MIN_SLEEP_S

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def waited(self) -> float:
        return time.monotonic() - self.start

    def pause(self) -> None:
        time.sleep(min(self.sleep_s, max(0.0, self.deadline - time.monotonic())))
        self.sleep_s = min(self.sleep_s * 2, _MAX_SLEEP_S)


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

    def to_dict(self) -> dict[str, Any]:
        return {"bytes_out": self.bytes_out, "bytes_in": self.bytes_in, "bytes_to_file": self.bytes_to_file,
                "bytes_from_file": self.bytes_from_file, "chunks_written": self.chunks_written,
                "chunks_observed": self.chunks_observed, "wait_s": self.wait_s}


class SharedRow:
    """A page-aligned /dev/shm region of ``num_chunks`` canonical slots shared by ``world_size`` ranks.

    Open it with :meth:`open` from every rank (a collective call). Layout: a control area (header,
    one "mapped" byte per rank, one 64-byte record per chunk), then the slots, each starting on a
    4096-byte boundary. The slot of a chunk holds exactly the kvformat payload of that chunk.
    """

    def __init__(self, *, path: str, fd: int, mm: mmap.mmap, rank: int, world_size: int, num_chunks: int,
                 slot_bytes: int, creator: bool) -> None:
        self.path = path
        self.rank = rank
        self.world_size = world_size
        self.num_chunks = num_chunks
        self.slot_bytes = slot_bytes
        self.slot_stride = _round_up(slot_bytes, ALIGNMENT)
        self.control_bytes = _control_bytes(num_chunks)
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
             timeout_s: float = 60.0, pin: str = "auto") -> "SharedRow":
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
        ctl = _control_bytes(num_chunks)
        total = ctl + _round_up(slot_bytes, ALIGNMENT) * num_chunks
        backoff = _Backoff(timeout_s)
        while True:
            row = cls._create_or_join(path, name, total, ctl, (num_chunks, slot_bytes, world_size), rank, backoff)
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
    def _create_or_join(cls, path: str, name: str, total: int, ctl: int, shape: tuple[int, int, int], rank: int,
                        backoff: _Backoff) -> "SharedRow | None":
        """One attempt; None when the file found was left by a dead group (it is removed: try again)."""
        num_chunks, slot_bytes, world_size = shape
        creator = False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            creator = True
        except FileExistsError:
            fd = _open_existing(path, backoff)
        mm: mmap.mmap | None = None
        hdr: np.ndarray | None = None
        try:
            if creator:
                os.ftruncate(fd, total)
            else:
                _wait_for_size(fd, path, total, backoff)
            mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            hdr = np.frombuffer(mm, dtype=np.int64, count=_HDR_WORDS)
            want = (num_chunks, slot_bytes, _round_up(slot_bytes, ALIGNMENT), world_size)
            if creator:
                hdr[1:5] = want
                hdr[5] = os.getpid()
                hdr[6] = ctl
                hdr[7] = _start_time(os.getpid())
                _fence()
                hdr[0] = _MAGIC  # last: joiners read the other fields only once this is set
            else:
                while int(hdr[0]) != _MAGIC:
                    if backoff.expired():
                        raise StagingTimeoutError(f"row {name!r}: the creator sized {path} but never wrote its "
                                                  f"header in time (it likely died)", waited_s=backoff.waited())
                    backoff.pause()
                _fence()
                got = tuple(int(x) for x in hdr[1:5])
                if got != want:
                    raise StagingError(f"row {name!r}: expected (num_chunks, slot_bytes, slot_stride, world_size) "
                                       f"= {want}, got {got} from the rank that created it")
                if not _creator_alive(int(hdr[5]), int(hdr[7])):
                    # Left by a group that died while opening it: its control words must never be trusted.
                    hdr = None
                    mm.close()
                    _unlink_if_same(path, fd)
                    os.close(fd)
                    return None
            hdr = None
            return cls(path=path, fd=fd, mm=mm, rank=rank, world_size=world_size, num_chunks=num_chunks,
                       slot_bytes=slot_bytes, creator=creator)
        except BaseException as exc:
            hdr = None
            if mm is not None:
                with contextlib.suppress(BufferError):
                    mm.close()
            # The creator, or a joiner whose creator died, removes the name; a joiner that found another
            # group's row (shape mismatch) leaves it alone.
            if creator or isinstance(exc, StagingTimeoutError):
                _unlink_if_same(path, fd)
            os.close(fd)
            raise

    def _join(self, backoff: _Backoff, name: str, timeout_s: float) -> None:
        assert self._ctl_bytes is not None and self._fd is not None
        self._ctl_bytes[_MAPPED_OFF + self.rank] = 1
        _fence()
        while True:
            # A copy, not a view: a view alive in a traceback would keep the mapping from closing.
            flags = bytes(self._ctl_bytes[_MAPPED_OFF:_MAPPED_OFF + self.world_size])
            if all(flags):
                break
            if backoff.expired():
                missing = [r for r, f in enumerate(flags) if not f]
                _unlink_if_same(self.path, self._fd)  # a rank that never comes must not leave the file behind
                raise StagingTimeoutError(f"row {name!r}: ranks {missing} did not map it within {timeout_s:g} s",
                                          waited_s=backoff.waited())
            backoff.pause()
        # Every rank has mapped it: drop the name now so a crash of any process leaks nothing.
        _unlink_if_same(self.path, self._fd)

    def _pin(self, *, required: bool) -> None:
        try:
            import torch
        except ImportError:  # pragma: no cover - torch is a dependency
            if required:
                raise
            return
        if not torch.cuda.is_available():
            if required:
                raise StagingError("pin='on' needs CUDA, and torch.cuda.is_available() is False")
            return
        cudart = torch.cuda.cudart()
        res = cudart.cudaHostRegister(self._base_tensor().data_ptr(), self.nbytes, 0)
        if res != cudart.cudaError.success:
            clear = getattr(cudart, "cudaGetLastError", None)  # else torch's next launch check reports it
            if clear is not None:
                clear()
            msg = f"cudaHostRegister of {self.nbytes} bytes failed ({res}); copies stay pageable"
            if required:
                raise StagingError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            return
        self.pinned = True

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
    def _rec(self, chunk: int) -> int:
        return (_CHUNK_BASE + chunk * _CHUNK_REC) // 8

    def state(self, chunk: int) -> tuple[int, int]:
        """``(epoch, state)`` of a chunk as published now (state is EMPTY, BUSY, DONE or FAILED)."""
        self._check_chunk(chunk)
        assert self._ctl is not None
        w = int(self._ctl[self._rec(chunk)])
        return w >> 2, w & 3

    def _set(self, chunk: int, epoch: int, state: int, reason: str = "") -> None:
        assert self._ctl is not None and self._ctl_bytes is not None
        i = self._rec(chunk)
        if state == BUSY:
            self._ctl[i + 1] = self.rank
            self._ctl[i + 2] = os.getpid()
        if state == FAILED:
            b = reason.encode("ascii", "replace")[:_REASON_BYTES].ljust(_REASON_BYTES, b"\0")
            self._ctl_bytes[i * 8 + 24:i * 8 + 24 + _REASON_BYTES] = np.frombuffer(b, dtype=np.uint8)
        _fence()  # slot bytes (and the fields above) before the word that publishes them
        self._ctl[i] = epoch << 2 | state
        _fence()

    def _who(self, chunk: int) -> tuple[int, int, str]:
        assert self._ctl is not None and self._ctl_bytes is not None
        i = self._rec(chunk)
        raw = bytes(self._ctl_bytes[i * 8 + 24:i * 8 + 24 + _REASON_BYTES]).rstrip(b"\0").decode("ascii", "replace")
        return int(self._ctl[i + 1]), int(self._ctl[i + 2]), raw

    def wait(self, chunk: int, epoch: int, *, writer: int, timeout_s: float, exact: bool) -> float:
        """Block until ``chunk`` is DONE at ``epoch`` (or later unless ``exact``); returns seconds waited.

        Raises StagingTimeoutError naming the chunk and ``writer`` at the deadline, StagingError if
        the writer published FAILED, StagingConflictError if ``exact`` and a later epoch is there.
        """
        backoff = _Backoff(timeout_s)
        while True:
            e, s = self.state(chunk)
            if e == epoch and s == DONE or (e > epoch and not exact):
                _fence()  # the slot bytes are read only after the DONE word was seen
                return backoff.waited()
            if e == epoch and s == FAILED:
                r, pid, reason = self._who(chunk)
                raise StagingError(f"chunk {chunk}: writer rank {r} (pid {pid}) failed to publish epoch {epoch}: "
                                   f"{reason or 'error'}")
            if e > epoch:
                raise StagingConflictError(f"chunk {chunk}: expected epoch {epoch}, the slot already holds "
                                           f"epoch {e} (republished before every rank read it)")
            if backoff.expired():
                raise StagingTimeoutError(
                    f"chunk {chunk}: writer rank {writer} did not publish epoch {epoch} within {timeout_s:g} s "
                    f"(slot is {_STATE_NAMES[s]} at epoch {e}); the writer likely died or hung",
                    chunk=chunk, writer=writer, epoch=epoch, state=_STATE_NAMES[s], waited_s=backoff.waited())
            backoff.pause()

    # -- closing ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Unpin, unmap and close. Slot tensors taken from this row must be dropped before."""
        if self._mm is None:
            return
        if self.pinned:
            import torch

            cudart = torch.cuda.cudart()
            res = cudart.cudaHostUnregister(self._base_tensor().data_ptr())
            if res != cudart.cudaError.success:
                warnings.warn(f"cudaHostUnregister failed ({res})", RuntimeWarning, stacklevel=2)
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
            _unlink_if_same(self.path, self._fd)  # in case close comes before every rank joined
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
                f"slot_bytes={self.slot_bytes}, pinned={self.pinned})")


def _control_bytes(num_chunks: int) -> int:
    return _round_up(_CHUNK_BASE + num_chunks * _CHUNK_REC, ALIGNMENT)


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); 0 if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _creator_alive(pid: int, start: int) -> bool:
    """False only when the creating process surely is gone (its pid is free, or now another process's).

    Ranks of one group share a pid namespace, as the processes of one engine on one node do.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _start_time(pid)
    return not (start and now and now != start)


def _open_existing(path: str, backoff: _Backoff) -> int:
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            # The creator failed (and unlinked) between our O_EXCL and this open: the group cannot form.
            if backoff.expired():
                raise
            backoff.pause()
            try:  # become the creator ourselves if the name is free again
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue


def _wait_for_size(fd: int, path: str, total: int, backoff: _Backoff) -> None:
    while True:
        st = os.fstat(fd)
        if st.st_size == total:
            return
        if st.st_size not in (0, total):
            raise StagingError(f"{path}: expected a row of {total} bytes, found {st.st_size} "
                               f"(another group uses this name, or the ranks disagree on the layout)")
        if st.st_nlink == 0:
            raise StagingError(f"{path}: the creating rank failed before sizing the row")
        if backoff.expired():
            raise StagingTimeoutError(f"{path}: the creating rank did not size the row in time",
                                      waited_s=backoff.waited())
        backoff.pause()


def _unlink_if_same(path: str, fd: int | None) -> None:
    """Unlink ``path`` only if it is still the file behind ``fd`` (never a newer group's row)."""
    try:
        if fd is not None:
            a, b = os.stat(path), os.fstat(fd)
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                return
        os.unlink(path)
    except FileNotFoundError:
        pass


class Stager:
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

    Calls that publish a chunk (:meth:`stage_out`, :meth:`load`) are collective: every rank calls
    them, for each chunk in the same order. :meth:`stage_in` and :meth:`save` are per rank.
    """

    def __init__(self, row: SharedRow, kv: Sequence["torch.Tensor"], layout: CanonicalLayout, *,
                 rotate: bool = False, writer_rank: int = 0, timeout_s: float = 60.0) -> None:
        import torch

        if row.slot_bytes != layout.payload_bytes:
            raise LayoutMismatchError("slot_bytes", layout.payload_bytes, row.slot_bytes)
        if len(kv) != len(layout.layers):
            raise LayoutMismatchError("layers", len(layout.layers), len(kv))
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
        for t, spec in zip(kv, layout.layers):
            if t.device != device:
                raise StagingError(f"layer {spec.name}: expected device {device}, got {t.device}")
            if t.dim() < 2 or int(t.shape[0]) != num_blocks:
                raise LayoutMismatchError(f"layer {spec.name}.num_blocks", num_blocks, tuple(t.shape))
            if not t[0].is_contiguous() or t.stride(0) * t.element_size() < spec.page_bytes:
                raise StagingError(f"layer {spec.name}: each block must be contiguous, got strides {t.stride()}")
            page = t[0].numel() * t.element_size()
            if page != spec.page_bytes:
                raise LayoutMismatchError(f"layer {spec.name}.page_bytes", spec.page_bytes, page)
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

    # -- election --------------------------------------------------------------------------------
    def writer_of(self, chunk: int) -> int:
        """The rank that copies ``chunk`` out (and loads it from a file)."""
        return chunk % self.row.world_size if self.rotate else self.writer_rank

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
        if self.row.rank != writer:
            self.stats.chunks_observed += 1
            if wait:
                self.stats.wait_s += self.row.wait(chunk, epoch, writer=writer, timeout_s=self.timeout_s, exact=False)
            return False
        self.row._set(chunk, epoch, BUSY)
        try:
            self._copy_out(ids, chunk)
        except BaseException as e:
            self.row._set(chunk, epoch, FAILED, type(e).__name__)
            raise
        self.row._set(chunk, epoch, DONE)
        self.stats.bytes_out += len(ids) * self._block_bytes
        self.stats.chunks_written += 1
        return True

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
        compute = torch.cuda.current_stream(self.device)  # taken before the context makes ours current
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(compute)  # the KV blocks were written by the compute stream
            idx = torch.tensor(ids, dtype=torch.long, device=self.device)
            for i in range(len(self._pages)):
                self._copy_out_layer(i, idx, self._layer_view(scratch, i), n)
            # One large D2H copy of the gathered payload: pinned destination, so it runs at DMA speed.
            slot.copy_(scratch, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # blocking sync: the host sleeps instead of spinning
            done.record(self._stream)
        done.synchronize()

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
        writer = self.writer_of(chunk)
        self.stats.wait_s += self.row.wait(chunk, epoch, writer=writer, timeout_s=self.timeout_s, exact=True)
        slot = self.row.slot(chunk)
        scratch = self._get_scratch()
        n = len(ids)
        if not self.cuda:
            scratch.copy_(slot)
            self._check_unchanged(chunk, epoch)
            runs = _runs(ids)  # CPU index_copy_ runs at ~1 GB/s; slice copies of block runs at memcpy speed
            for i in range(len(self._pages)):
                src = self._layer_view(scratch, i)
                for j, b, k in runs:
                    self._pages[i][b:b + k].copy_(src[j:j + k])
        else:
            compute = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._stream):
                self._stream.wait_stream(compute)  # compute is done with the blocks about to be overwritten
                scratch.copy_(slot, non_blocking=True)
                h2d = torch.cuda.Event(blocking=True)
                h2d.record(self._stream)
            h2d.synchronize()
            self._check_unchanged(chunk, epoch)  # before a single byte reaches the KV
            with torch.cuda.stream(self._stream):
                idx = torch.tensor(ids, dtype=torch.long, device=self.device)
                for i in range(len(self._pages)):
                    self._pages[i].index_copy_(0, idx, self._layer_view(scratch, i)[:n])
                done = torch.cuda.Event()
                done.record(self._stream)
            compute.wait_event(done)  # compute sees the blocks, no host sync
        self.stats.bytes_in += n * self._block_bytes

    def _check_unchanged(self, chunk: int, epoch: int) -> None:
        _fence()
        e, s = self.row.state(chunk)
        if (e, s) != (epoch, DONE):
            raise StagingConflictError(f"chunk {chunk}: slot changed to {_STATE_NAMES[s]} at epoch {e} while this "
                                       f"rank read epoch {epoch}; the KV was not modified")

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
        writer = self.writer_of(chunk)
        if self.row.rank != writer and not all_ranks:
            return None
        epoch = int(self._epochs[chunk])
        if epoch == 0:
            raise StagingError(f"chunk {chunk}: nothing was staged out or loaded into it by this group")
        self.stats.wait_s += self.row.wait(chunk, epoch, writer=writer, timeout_s=self.timeout_s, exact=True)
        prov = provenance or Provenance(tp=self.row.world_size, row="canonical", writer=_writer_name(),
                                        created=int(time.time()))
        # Seqlock read: copy, then confirm (epoch, DONE) still holds; a publisher marks the slot BUSY
        # before it touches a byte, so an unchanged word means the copy is of one epoch.
        snapshot = self.row.slot(chunk).numpy().tobytes()
        self._check_unchanged(chunk, epoch)
        out = store.put_block(snapshot, self.layout, key, provenance=prov, codec=codec, level=level,
                              fsync=fsync, overwrite=overwrite)
        if out[2]:
            self.stats.bytes_to_file += out[1]
        return out

    def load(self, chunk: int, key: BlockKey, store: "Store", *, verify: bool = True, wait: bool = True) -> bool:
        """Publish the file of ``key`` as ``chunk`` of the row. Collective, like :meth:`stage_out`.

        The chunk's writer reads the file into the slot through ``store.read_into`` (header, layout
        and checksums checked; the slot is zeroed on a bad checksum) and publishes DONE, or FAILED on
        any error, which it re-raises (OSError such as FileNotFoundError unchanged). Other ranks then
        wait (``wait``) and raise StagingError naming the writer when it failed.

        Returns True on the rank that read the file.
        """
        self.row._check_chunk(chunk)
        epoch = int(self._epochs[chunk]) + 1
        self._epochs[chunk] = epoch
        writer = self.writer_of(chunk)
        if self.row.rank != writer:
            if wait:
                self.stats.wait_s += self.row.wait(chunk, epoch, writer=writer, timeout_s=self.timeout_s, exact=True)
            return False
        self.row._set(chunk, epoch, BUSY)
        try:
            store.read_into(block_relpath(self.layout, key), self.row.slot(chunk), expect=self.layout, key=key,
                            verify=verify)
        except BaseException as e:
            self.row._set(chunk, epoch, FAILED, type(e).__name__)
            raise
        self.row._set(chunk, epoch, DONE)
        self.stats.bytes_from_file += self.layout.payload_bytes
        return True

    # -- helpers -------------------------------------------------------------------------------------
    @property
    def _block_bytes(self) -> int:
        return sum(l.page_bytes for l in self.layout.layers)

    def _layer_view(self, flat: "torch.Tensor", i: int) -> "torch.Tensor":
        off, n = self.layout.layer_offsets[i], self.layout.chunk_bytes_per_layer[i]
        return flat[off:off + n].view(self.layout.blocks_per_chunk, self.layout.layers[i].page_bytes)

    def _get_scratch(self) -> "torch.Tensor":
        import torch

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
    from . import __version__

    return f"kvformat {__version__} staging"
