"""Two groups of I/O threads over two queues: readers prefer loads, writers prefer stores.

A load (promotion) is on a request's critical path; a store (cascade) is not, so loads never wait
behind a backlog of stores, and neither queue starves because each group drains the other queue
when its own is empty.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

Task = Callable[[], None]


class DualPool:
    def __init__(self, read_threads: int, write_threads: int, name: str = "kvformat_tier") -> None:
        self._cv = threading.Condition()
        self._loads: collections.deque[Task] = collections.deque()
        self._stores: collections.deque[Task] = collections.deque()
        self._busy = 0
        self._stop = False
        self._threads = [threading.Thread(target=self._run, args=(True,), name=f"{name}_r{i}", daemon=True)
                         for i in range(read_threads)]
        self._threads += [threading.Thread(target=self._run, args=(False,), name=f"{name}_w{i}", daemon=True)
                          for i in range(write_threads)]
        for t in self._threads:
            t.start()

    def submit(self, tasks: list[Task], *, load: bool) -> None:
        with self._cv:
            (self._loads if load else self._stores).extend(tasks)
            self._cv.notify(len(tasks))

    def _run(self, prefer_loads: bool) -> None:
        first, second = (self._loads, self._stores) if prefer_loads else (self._stores, self._loads)
        while True:
            with self._cv:
                while not (first or second or self._stop):
                    self._cv.wait()
                if self._stop and not (first or second):
                    return
                task = first.popleft() if first else second.popleft()
                self._busy += 1
            try:
                task()  # tasks catch their own errors and report through their job
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def wait_idle(self) -> None:
        """Block until both queues are empty and no task is running."""
        with self._cv:
            while self._loads or self._stores or self._busy:
                self._cv.wait()

    def shutdown(self) -> None:
        """Finish queued tasks (a job must never be left half done), then stop the threads."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
