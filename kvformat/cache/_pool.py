"""Two groups of I/O threads over two queues: readers prefer loads, writers prefer stores.

A load (promotion) is on a request's critical path; a store (cascade) is not, so loads never wait
behind a backlog of stores, and neither queue starves because each group drains the other queue
when its own is empty.

Every task comes with a ``fail`` callback: a task that will never run (queued at shutdown, or
submitted after it) is failed instead, so its job still reports exactly once.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

Task = Callable[[], None]
TaskPair = tuple[Task, Task]  # (run, fail)


class DualPool:
    """The tier's I/O threads (``read_threads`` preferring loads, ``write_threads`` preferring stores)."""

    def __init__(self, read_threads: int, write_threads: int, name: str = "kvformat_tier") -> None:
        lock = threading.Lock()
        self._cv = threading.Condition(lock)  # workers wait here for tasks
        self._idle_cv = threading.Condition(lock)  # wait_idle waits here: a submit's notify never wakes it instead
        self._loads: collections.deque[TaskPair] = collections.deque()
        self._stores: collections.deque[TaskPair] = collections.deque()
        self._busy = 0
        self._stop = False
        self._name = name
        self._spares = 0
        self._threads = [threading.Thread(target=self._run, args=(True,), name=f"{name}_r{i}", daemon=True)
                         for i in range(read_threads)]
        self._threads += [threading.Thread(target=self._run, args=(False,), name=f"{name}_w{i}", daemon=True)
                          for i in range(write_threads)]
        for t in self._threads:
            t.start()

    def add_reader(self, limit: int) -> bool:
        """Start one more load-preferring thread, at most ``limit`` over the life of the pool: the replacement
        of a reader stuck in a read that was given up on (its deadline passed). False when none was started."""
        with self._cv:
            if self._stop or self._spares >= limit:
                return False
            self._spares += 1
            t = threading.Thread(target=self._run, args=(True,), name=f"{self._name}_r+{self._spares}", daemon=True)
            self._threads.append(t)
        t.start()
        return True

    def submit(self, tasks: list[TaskPair], *, load: bool) -> None:
        """Queue ``(run, fail)`` pairs; after :meth:`shutdown` each ``fail`` is called at once instead."""
        with self._cv:
            if not self._stop:
                (self._loads if load else self._stores).extend(tasks)
                self._cv.notify(len(tasks))
                return
        for _, fail in tasks:
            fail()

    def _run(self, prefer_loads: bool) -> None:
        first, second = (self._loads, self._stores) if prefer_loads else (self._stores, self._loads)
        while True:
            with self._cv:
                while not (first or second or self._stop):
                    self._cv.wait()
                if self._stop:
                    return  # shutdown fails what is still queued
                run, _ = first.popleft() if first else second.popleft()
                self._busy += 1
            try:
                run()  # tasks catch their own errors and report through their job
            finally:
                with self._cv:
                    self._busy -= 1
                    # Only wait_idle waits for this, on its own condition: waking every idle I/O thread after
                    # every chunk (they went back to sleep at once) cost each chunk a round of context switches.
                    if not (self._busy or self._loads or self._stores):
                        self._idle_cv.notify_all()

    def map(self, fns: list[Callable[[], object]], *, load: bool) -> list[object]:
        """Run every ``fn`` on the pool and wait for all: their results, in order (None for one that never ran
        because the pool shut down). For adapters whose engine calls block until the I/O is done (SGLang's
        storage calls); each ``fn`` handles its own errors."""
        out: list[object] = [None] * len(fns)
        left = [len(fns)]
        done = threading.Condition()

        def finish() -> None:
            with done:
                left[0] -= 1
                done.notify_all()

        def pair(i: int, fn: Callable[[], object]) -> TaskPair:
            def run() -> None:
                try:
                    out[i] = fn()
                finally:
                    finish()
            return run, finish

        if fns:
            self.submit([pair(i, fn) for i, fn in enumerate(fns)], load=load)
        with done:
            while left[0]:
                done.wait()
        return out

    def wait_idle(self) -> None:
        """Block until both queues are empty and no task is running."""
        with self._idle_cv:
            while self._loads or self._stores or self._busy:
                self._idle_cv.wait()

    def shutdown(self, timeout: float | None = None) -> bool:
        """Fail every queued task, then wait up to ``timeout`` s for the running ones to end.

        A running task is never interrupted (a half-done copy would corrupt the row or the file).
        Returns True when every thread has exited; False if some task still runs after ``timeout``
        (its thread is a daemon: it cannot keep the process alive).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._stop = True
            queued = list(self._loads) + list(self._stores)
            self._loads.clear()
            self._stores.clear()
            self._cv.notify_all()
            if not self._busy:
                self._idle_cv.notify_all()
        for _, fail in queued:
            fail()
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


class BatchWorker:
    """One daemon thread that applies ``fn`` to batches of submitted keys, duplicates coalesced.

    For work that must stay off a request's critical path (the tier's mtime touches: a copy_object
    on S3, a re-upload on other remote roots). At most ``max_pending`` keys wait; more are dropped
    (the work is an optimisation: a lost touch only makes a restart's LRU order older).
    """

    def __init__(self, fn: Callable[[list[str]], None], name: str, max_pending: int = 65536) -> None:
        self._fn = fn
        self._cv = threading.Condition()
        self._pending: dict[str, None] = {}  # insertion-ordered set
        self._busy = False
        self._stop = False
        self.max_pending = max_pending
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: str) -> bool:
        """Queue ``key``; False if it was dropped (stopped, or ``max_pending`` keys already wait)."""
        with self._cv:
            if self._stop or (key not in self._pending and len(self._pending) >= self.max_pending):
                self.dropped += 1
                return False
            self._pending[key] = None
            self._cv.notify()
            return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._pending or self._stop):
                    self._cv.wait()
                if self._stop:
                    return
                batch, self._pending = list(self._pending), {}
                self._busy = True
            try:
                self._fn(batch)
            except Exception:  # noqa: BLE001 - fn handles its own errors; this thread must survive a bug
                pass
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def flush(self) -> None:
        """Block until every key submitted so far has been processed."""
        with self._cv:
            while (self._pending or self._busy) and not self._stop:
                self._cv.wait()

    def close(self, timeout: float | None = None) -> bool:
        """Drop what is pending and stop; True if the thread ended within ``timeout``."""
        with self._cv:
            self._stop = True
            self._pending.clear()
            self._cv.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()
