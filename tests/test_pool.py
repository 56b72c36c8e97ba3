"""The tier's I/O pool: wait_idle (the tier's drain_jobs, which vLLM's reset_cache calls) waits on a condition of its
own, woken only when the pool goes idle, so a missed wake-up would hang it; these check that it returns exactly when
every queued and running task is done, and when shutdown fails what was queued."""

from __future__ import annotations

import threading

from kvformat.cache._pool import DualPool

HANG = 60.0  # a liveness guard only: a wait_idle that never returns fails the test instead of hanging it


def _waiter(pool: DualPool, seen: list[int], done: list[int]) -> threading.Thread:
    def wait() -> None:
        pool.wait_idle()
        seen.append(len(done))  # how many tasks had finished when wait_idle returned

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t


def test_wait_idle_returns_when_every_load_and_store_is_done() -> None:
    pool = DualPool(2, 2, name="test_pool")
    gate = threading.Event()
    done: list[int] = []
    lock = threading.Lock()

    def task(i: int) -> None:
        gate.wait(HANG)
        with lock:
            done.append(i)

    try:
        # more tasks than threads: some are queued, not running, when the waiter starts
        pool.submit([(lambda i=i: task(i), lambda: None) for i in range(6)], load=True)
        pool.submit([(lambda i=i: task(i), lambda: None) for i in range(6, 12)], load=False)
        seen: list[int] = []
        waiters = [_waiter(pool, seen, done) for _ in range(3)]
        assert seen == []  # nothing can have finished: every task waits on the gate
        gate.set()
        for t in waiters:
            t.join(HANG)
        assert not any(t.is_alive() for t in waiters), "wait_idle never returned"
        assert seen == [12, 12, 12] and sorted(done) == list(range(12))
        # idle again: a later wait returns at once, and a second round of work is waited for too
        pool.wait_idle()
        pool.submit([(lambda i=i: task(i), lambda: None) for i in range(12, 20)], load=True)
        pool.wait_idle()
        assert sorted(done) == list(range(20))
    finally:
        gate.set()
        assert pool.shutdown(HANG)


def test_wait_idle_returns_after_shutdown_fails_the_queued_tasks() -> None:
    pool = DualPool(1, 1, name="test_pool")
    gate, started = threading.Event(), threading.Semaphore(0)
    done: list[int] = []
    failed: list[int] = []

    def task(i: int) -> None:
        started.release()
        gate.wait(HANG)
        done.append(i)

    try:
        pool.submit([(lambda i=i: task(i), lambda i=i: failed.append(i)) for i in range(6)], load=True)
        for _ in range(2):  # both threads are inside a task; the other four are queued
            assert started.acquire(timeout=HANG)
        seen: list[int] = []
        waiter = _waiter(pool, seen, done)
        stopper = threading.Thread(target=pool.shutdown, args=(HANG,), daemon=True)
        stopper.start()
        while len(failed) < 4 and stopper.is_alive():  # shutdown fails the queued ones before it joins
            stopper.join(0.01)
        assert sorted(failed) == [2, 3, 4, 5] and seen == []  # two tasks still run: not idle yet
        gate.set()
        waiter.join(HANG)
        stopper.join(HANG)
        assert not waiter.is_alive(), "wait_idle never returned"
        assert seen == [2] and sorted(done) == [0, 1]
    finally:
        gate.set()
        pool.shutdown(HANG)
