"""The asynchronous staging API: submit many chunk transfers, poll for the finished ones.

Shaped like vLLM's offloading handlers (``transfer_async`` then ``get_finished``): every ``submit_*`` call
returns a job id at once and :meth:`AsyncStager.poll` returns the jobs that finished since the last poll,
each with its result or its error. Nothing here blocks the host on the device: a copy is a *completion*
(a CUDA event recorded on a staging stream, polled with ``query()``; on the CPU a future of the copy
thread), and a job moves on only when its completion is ready.

The row's protocol holds per job, whatever the order jobs finish in:

- the writer publishes ``(e, BUSY)`` before queuing the copy and ``(e, DONE)`` only once the copy's
  completion is ready (an error in the copy publishes FAILED);
- a reader waits for ``(e, DONE)``, queues the slot copy into its own buffer and, once that copy completed,
  re-reads the control word before the scatter into the KV is queued: a slot half-published, failed or
  republished is never applied;
- a writer that never publishes makes the readers' jobs fail with StagingTimeoutError naming its rank.

Pipelining: each of ``buffers`` device scratch buffers is bound to its own stream, so the gather (or
scatter) of one chunk runs while the copy of the previous one uses the link; a chunk whose block ids form
one run is copied out layer by layer straight from the KV, with no gather. :meth:`shutdown` drives every
job in flight to its end (each reported once, none applied twice) before closing the threads.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..errors import StagingConflictError, StagingError, StagingTimeoutError
from ._completion import JobResult, Ready, _Event, _Future, _result
from ._cuda import after_compute, device_ids, on_stream, record_event
from ._shm import _STATE_NAMES, BUSY, DONE, FAILED, Backoff, fence
from ._verify import check_verify, device_check

if TYPE_CHECKING:
    import torch

    from ..format import BlockKey
    from ..storage import Store
    from ._stager import Stager

__all__ = ["AsyncStager", "JobResult"]


class _Job:
    def __init__(self, job_id: int, kind: str, chunk: int, epoch: int, deadline: float) -> None:
        self.job_id, self.kind, self.chunk, self.epoch, self.deadline = job_id, kind, chunk, epoch, deadline
        self.phase = "wait"  # wait (for the row) -> copy (a completion in flight) -> apply -> done
        self.done: Any = None
        self.buf = -1
        self.value: Any = None
        self.ids: list[int] = []
        self.extra: dict[str, Any] = {}


class AsyncStager:
    """Asynchronous, pipelined front of a :class:`Stager` (same row, KV, layout, election and timeout).

    Parameters
    ----------
    stager: the synchronous Stager of this rank (a TP group's: placements of several parts are not
        supported here and raise StagingError).
    buffers: device scratch buffers, each on its own stream (2 = double-buffered).
    io_workers: threads for loads and saves (file I/O).

    Submission order is the protocol's order: publishing jobs (stage_out, load) must be submitted by every
    rank, for each chunk, in the same order, as with the synchronous calls. Use from one thread.
    """

    def __init__(self, stager: "Stager", *, buffers: int = 2, io_workers: int = 2) -> None:
        import torch

        if stager.row.parts != 1:
            raise StagingError(f"AsyncStager: rows of {stager.row.parts} parts (PP/DCP) are not supported; "
                               f"use the Stager's synchronous calls")
        if buffers < 1 or io_workers < 1:
            raise StagingError(f"buffers and io_workers: expected >= 1, got {buffers}, {io_workers}")
        self.st = stager
        self.row = stager.row
        dev = stager.device
        self._streams: list[Any] = [torch.cuda.Stream(device=dev) for _ in range(buffers)] if stager.cuda else []
        self._bufs: list["torch.Tensor | None"] = [None] * buffers
        self._free = list(range(buffers))
        # CPU: one copy thread stands in for the device's copy engine (torch copies release the GIL).
        self._copier = None if stager.cuda else ThreadPoolExecutor(1, thread_name_prefix="kvf-copy")
        self._io = ThreadPoolExecutor(io_workers, thread_name_prefix="kvf-io")
        self._ids = itertools.count(1)
        self._jobs: list[_Job] = []
        self._closed = False
        self._backlog: list[JobResult] = []

    # -- submission ------------------------------------------------------------------------------
    def submit_stage_out(self, block_ids: Sequence[int], chunk: int) -> int:
        """Queue publishing blocks ``block_ids`` as ``chunk`` (collective, like :meth:`Stager.stage_out`).

        On the writer the job ends once its copy completed and DONE is published (value True); on the
        other ranks once the writer published (value False).
        """
        st = self.st
        ids = st._check_ids(block_ids)
        self.row._check_chunk(chunk)
        job = self._new("stage_out", chunk, int(st._epochs[chunk]) + 1)
        st._epochs[chunk] = job.epoch
        job.ids = ids
        if self.row.rank == st.writer_of(chunk):
            self.row._set(chunk, job.epoch, BUSY)
            job.phase = "queue_out"
        self._step(job)
        return job.job_id

    def submit_stage_in(self, chunk: int, block_ids: Sequence[int]) -> int:
        """Queue copying ``chunk`` of the row into blocks ``block_ids`` of this rank's KV (per rank)."""
        ids = self.st._check_ids(block_ids)
        self.row._check_chunk(chunk)
        epoch = int(self.st._epochs[chunk])
        if epoch == 0:
            raise StagingError(f"chunk {chunk}: nothing was staged out or loaded into it by this group")
        job = self._new("stage_in", chunk, epoch)
        job.ids = ids
        self._step(job)
        return job.job_id

    def submit_load(self, chunk: int, key: "BlockKey", store: "Store", *, verify: bool | str = True) -> int:
        """Queue publishing the file of ``key`` as ``chunk`` (collective, like :meth:`Stager.load`).

        ``verify="device"``: the data checksum is computed on the KV's device (Stager.load's GPU-verified
        mode), into a buffer of the job's own, on a stream of its own; DONE is published only after it matched.
        """
        import torch

        from ..format import block_relpath

        st = self.st
        on_device = check_verify(verify)
        self.row._check_chunk(chunk)
        job = self._new("load", chunk, int(st._epochs[chunk]) + 1)
        st._epochs[chunk] = job.epoch
        if self.row.rank == st.writer_of(chunk, 0):
            self.row._set(chunk, job.epoch, BUSY)
            slot = self.row.slot(chunk)
            check = None
            if on_device:  # a buffer per job: loads run concurrently on the I/O threads
                buf = torch.empty(st.layout.payload_bytes, dtype=torch.uint8, device=st.device)
                stream = torch.cuda.Stream(device=st.device) if st.cuda else None
                check = device_check(slot, buf, stream, lambda n: job.extra.__setitem__("verified", n))
            job.done = _Future(self._io.submit(store.read_into, block_relpath(st.layout, key), slot,
                                               expect=st.layout, key=key, verify=bool(verify), data_check=check))
            job.phase = "publish"
        self._step(job)
        return job.job_id

    def submit_save(self, chunk: int, key: "BlockKey", store: "Store", **put: Any) -> int:
        """Queue writing ``chunk`` to ``store`` (the chunk's writer saves; other ranks' jobs end with None).

        ``put``: :meth:`Stager.save`'s keywords (codec, level, provenance, fsync, overwrite).
        """
        st = self.st
        self.row._check_chunk(chunk)
        epoch = int(st._epochs[chunk])
        if epoch == 0:
            raise StagingError(f"chunk {chunk}: nothing was staged out or loaded into it by this group")
        job = self._new("save", chunk, epoch)
        job.extra = {"key": key, "store": store, "put": put}
        if self.row.rank != st.writer_of(chunk, 0):
            job.phase = "done"
        self._step(job)
        return job.job_id

    # -- the synchronous calls, as wrappers -------------------------------------------------------------
    def stage_out(self, block_ids: Sequence[int], chunk: int) -> bool:
        """:meth:`submit_stage_out` and wait for it; raises the job's error."""
        return bool(self._one(self.submit_stage_out(block_ids, chunk)))

    def stage_in(self, chunk: int, block_ids: Sequence[int]) -> None:
        """:meth:`submit_stage_in` and wait for it; raises the job's error (the KV is then untouched)."""
        self._one(self.submit_stage_in(chunk, block_ids))

    def load(self, chunk: int, key: "BlockKey", store: "Store", *, verify: bool | str = True) -> bool:
        """:meth:`submit_load` and wait for it; raises the job's error."""
        return bool(self._one(self.submit_load(chunk, key, store, verify=verify)))

    def save(self, chunk: int, key: "BlockKey", store: "Store", **put: Any) -> Any:
        """:meth:`submit_save` and wait for it; returns ``put_block``'s result (None on other ranks)."""
        return self._one(self.submit_save(chunk, key, store, **put))

    def _one(self, job_id: int) -> Any:
        got = self.wait([job_id])
        (r,) = [x for x in got if x.job_id == job_id]
        self._backlog += [x for x in got if x.job_id != job_id]  # other jobs' results wait for the next poll
        if r.error is not None:
            raise r.error
        return r.value

    # -- completion ------------------------------------------------------------------------------
    def poll(self) -> list[JobResult]:
        """Advance every job as far as it goes without blocking; returns the jobs finished since the last poll
        (in the order they finished, which need not be the order they were submitted in)."""
        out, self._backlog = self._backlog, []
        for job in list(self._jobs):
            self._step(job)
            if job.phase == "done":
                self._jobs.remove(job)
                err = job.value if isinstance(job.value, BaseException) else None
                out.append(JobResult(job.job_id, job.kind, job.chunk, None if err else job.value, err))
        return out

    def wait(self, job_ids: Sequence[int] | None = None) -> list[JobResult]:
        """Poll (sleeping 50 µs to 5 ms between rounds) until the given jobs (default: all) finished; returns
        every job finished meanwhile. Each job carries its own deadline (the Stager's ``timeout_s``)."""
        want = {j.job_id for j in self._jobs} if job_ids is None else set(job_ids)
        out: list[JobResult] = []
        backoff = Backoff(float("inf"))
        while True:
            got = self.poll()
            out += got
            want -= {r.job_id for r in got}
            if not want & {j.job_id for j in self._jobs}:
                return out
            if got:
                backoff = Backoff(float("inf"))
            backoff.pause()

    def pending(self) -> int:
        """Jobs submitted and not yet returned by :meth:`poll`."""
        return len(self._jobs)

    def shutdown(self) -> list[JobResult]:
        """Drive every job in flight to its end (a publication, an error or its deadline), then stop the threads.

        Returns the jobs not returned by an earlier poll: each job is reported exactly once and none is
        applied twice. Later submissions raise StagingError.
        """
        out = self.wait()
        self._closed = True
        self._io.shutdown(wait=True)
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        return out

    def __enter__(self) -> "AsyncStager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- the state machine ---------------------------------------------------------------------------
    def _new(self, kind: str, chunk: int, epoch: int) -> _Job:
        if self._closed:
            raise StagingError("AsyncStager: already shut down")
        job = _Job(next(self._ids), kind, chunk, epoch, time.monotonic() + self.st.timeout_s)
        self._jobs.append(job)
        return job

    def _step(self, job: _Job) -> None:
        try:
            self._advance(job)
        except BaseException as e:  # the job ends with its error; other jobs go on
            if job.phase in ("queue_out", "publish"):  # this rank announced BUSY: never leave it so
                self.row._set(job.chunk, job.epoch, FAILED, type(e).__name__)
            self._release(job)
            job.value, job.phase = e, "done"
            if not isinstance(e, Exception):
                raise

    def _advance(self, job: _Job) -> None:
        st = self.st
        if job.phase == "queue_out":
            if not self._take_buffer(job):
                return
            job.done = self._queue_out(job)
            job.phase = "publish"
        if job.phase == "publish":  # writer of a stage_out or load: DONE only once the copy completed
            if not job.done.ready():
                return
            _result(job.done)  # raises the copy's error (then FAILED is published)
            self._release(job)
            self.row._set(job.chunk, job.epoch, DONE)
            if job.kind == "stage_out":
                st.stats.bytes_out += len(job.ids) * st._block_bytes
                st.stats.chunks_written += 1
            else:
                st.stats.bytes_from_file += st.layout.payload_bytes
                st.stats.bytes_verified_device += int(job.extra.get("verified", 0))
            job.value, job.phase = True, "done"
            return
        if job.phase == "wait":
            if not self._published(job, exact=job.kind != "stage_out"):
                return
            if job.kind == "stage_out":  # a rank that only observed the writer's publication
                st.stats.chunks_observed += 1
                job.value, job.phase = False, "done"
                return
            if job.kind == "load":
                job.value, job.phase = False, "done"
                return
            job.phase = "queue_in" if job.kind == "stage_in" else "queue_save"
        if job.phase == "queue_save":
            job.done = _Future(self._io.submit(self._save, job))
            job.phase = "saved"
        if job.phase == "saved":
            if job.done.ready():
                job.value, job.phase = _result(job.done), "done"
            return
        if job.phase == "queue_in":
            if not self._take_buffer(job):
                return
            job.done = self._queue_slot_copy(job)
            job.phase = "apply"
        if job.phase == "apply":
            if not job.done.ready():
                return
            _result(job.done)
            self._check_unchanged(job)  # after the slot copy completed, before any byte reaches the KV
            job.done = self._queue_scatter(job)
            job.phase = "applied"
        if job.phase == "applied" and job.done.ready():
            _result(job.done)
            self._release(job)
            st.stats.bytes_in += len(job.ids) * st._block_bytes
            job.phase = "done"

    def _published(self, job: _Job, *, exact: bool) -> bool:
        """The row's wait, one look: True once DONE at the job's epoch; raises what :meth:`SharedRow.wait`
        raises (the writer's failure, a republished slot, the deadline naming the writer)."""
        e, s = self.row.state(job.chunk)
        if e == job.epoch and s == DONE or (e > job.epoch and not exact):
            fence()  # the slot's bytes are read only after the DONE word was seen
            return True
        writer = self.st.writer_of(job.chunk, 0)
        if e == job.epoch and s == FAILED:
            r, pid, reason = self.row._who(job.chunk)
            raise StagingError(f"chunk {job.chunk}: writer rank {r} (pid {pid}) failed to publish epoch "
                               f"{job.epoch}: {reason or 'error'}")
        if e > job.epoch:
            raise StagingConflictError(f"chunk {job.chunk}: expected epoch {job.epoch}, the slot already holds "
                                       f"epoch {e} (republished before every rank read it)")
        if time.monotonic() >= job.deadline:
            raise StagingTimeoutError(
                f"chunk {job.chunk}: writer rank {writer} did not publish epoch {job.epoch} within "
                f"{self.st.timeout_s:g} s (slot is {_STATE_NAMES[s]} at epoch {e}); the writer likely died or hung",
                chunk=job.chunk, writer=writer, epoch=job.epoch, state=_STATE_NAMES[s], waited_s=self.st.timeout_s)
        return False

    def _check_unchanged(self, job: _Job) -> None:
        fence()
        e, s = self.row.state(job.chunk)
        if (e, s) != (job.epoch, DONE):
            raise StagingConflictError(f"chunk {job.chunk}: slot changed to {_STATE_NAMES[s]} at epoch {e} while "
                                       f"this rank read epoch {job.epoch}; the KV was not modified")

    # -- buffers and copies ----------------------------------------------------------------------------
    def _take_buffer(self, job: _Job) -> bool:
        if job.buf >= 0:
            return True
        if not self._free:
            return False  # every buffer is in flight: the job waits for one (the pipeline's depth)
        job.buf = self._free.pop(0)
        if self._bufs[job.buf] is None:
            import torch

            buf = torch.empty(self.st.layout.payload_bytes, dtype=torch.uint8, device=self.st.device)
            if self._streams:  # used on its stream only: the allocator must not recycle it before that stream ends
                buf.record_stream(self._streams[job.buf])
            self._bufs[job.buf] = buf
        return True

    def _release(self, job: _Job) -> None:
        if job.buf >= 0:
            self._free.append(job.buf)
            job.buf = -1

    def _run(self, fn: Callable[[], Any], job: _Job) -> Any:
        """On the device: queue ``fn`` on the job's buffer's stream and return its event; on the CPU: run it on
        the copy thread and return its future."""
        if self._copier is not None:
            return _Future(self._copier.submit(fn))
        stream = self._streams[job.buf]
        with on_stream(stream, self.st.device):  # after the compute stream's work on the KV
            fn()
        return _Event(record_event(stream))

    def _queue_out(self, job: _Job) -> Any:
        st, ids = self.st, job.ids
        slot = self.row.slot(job.chunk)
        runs = _one_run(ids)
        if st.cuda and runs is not None:  # contiguous blocks: one D2H copy per layer, no gather
            first, n = runs
            for i in range(len(st._pages)):
                view = st._layer_view(slot, i)
                if n < view.shape[0]:
                    view[n:].zero_()  # host memory, BUSY: no reader uses it yet
            # The job keeps its buffer unused: the copies go on that buffer's stream, which bounds the depth.
            return self._run(lambda: [st._layer_view(slot, i)[:n].copy_(p[first:first + n], non_blocking=True)
                                      for i, p in enumerate(st._pages)], job)
        buf = self._bufs[job.buf]
        assert buf is not None

        def gather_copy() -> None:
            import torch

            idx = device_ids(ids, st.device) if st.cuda else torch.tensor(ids, dtype=torch.long)
            for i in range(len(st._pages)):
                st._copy_out_layer(i, idx, st._layer_view(buf, i), len(ids))
            slot.copy_(buf, non_blocking=st.cuda)  # one large copy: pinned slot, DMA speed on CUDA

        return self._run(gather_copy, job)

    def _queue_slot_copy(self, job: _Job) -> Any:
        buf = self._bufs[job.buf]
        assert buf is not None
        slot = self.row.slot(job.chunk)
        return self._run(lambda: buf.copy_(slot, non_blocking=self.st.cuda), job)

    def _queue_scatter(self, job: _Job) -> Any:
        st, ids = self.st, job.ids
        buf = self._bufs[job.buf]
        assert buf is not None
        views = [st._layer_view(buf, i) for i in range(len(st._pages))]
        if not st.cuda:
            st._scatter_runs(ids, views)  # memcpy-speed run copies, on this thread: the check just passed
            return Ready()

        def scatter() -> None:
            idx = device_ids(ids, st.device)
            for p, v in zip(st._pages, views):
                p.index_copy_(0, idx, v[:len(ids)])

        done = self._run(scatter, job)
        after_compute(self._streams[job.buf], st.device)  # the engine's compute sees the blocks, no host sync
        return done

    def _save(self, job: _Job) -> Any:
        st = self.st
        snapshot = self.row.slot(job.chunk).numpy().tobytes()
        self._check_unchanged(job)  # a file of mixed epochs never becomes visible
        put = dict(job.extra["put"])
        prov = put.pop("provenance", None) or st._provenance()
        out = job.extra["store"].put_block(snapshot, st.layout, job.extra["key"], provenance=prov, **put)
        if out[2]:
            st.stats.bytes_to_file += out[1]
        return out


def _one_run(ids: list[int]) -> tuple[int, int] | None:
    """``(first, count)`` when the ids are one run of consecutive blocks, else None."""
    return (ids[0], len(ids)) if ids == list(range(ids[0], ids[0] + len(ids))) else None
