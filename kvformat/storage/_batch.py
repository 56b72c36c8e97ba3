"""Many requests per call on an event loop, with one deadline per call and bounded retries.

A remote store hands :class:`BatchRunner` one coroutine factory per key. The caller's thread blocks
at most ``timeout_s`` (+ a short grace if the loop itself is stuck); requests still running at the
deadline are cancelled and report ``TimeoutError``. Transient failures (connection, timeout,
unclassified transport errors such as 5xx) are retried with jittered backoff inside the deadline;
answers (missing, exists, denied, bad bytes) never are. Transport errors come out as ``OSError``
subclasses with credentials removed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import secrets
import time
from typing import Any, Awaitable, Callable, Coroutine, Iterator, Sequence

from ..errors import KVFormatError
from ._redact import Redactor

# Answers that say the request itself is wrong, not that the service hiccupped: never retried.
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
_TIMEOUTS: tuple[type[BaseException], ...] = (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)


def translate(e: BaseException, what: str, redact: Redactor) -> BaseException:
    """A transport failure as an OSError subclass with no credentials in its message."""
    if isinstance(e, KVFormatError):
        return e
    if isinstance(e, _TIMEOUTS):
        return TimeoutError(f"{what}: timed out")
    if isinstance(e, OSError) and type(e).__module__ == "builtins":  # botocore's OSError subclasses: below
        msg = str(e)
        red = redact(msg)
        if red == msg:
            return e
        new = type(e)(red) if type(e) is not OSError else OSError(e.errno, red)
        new.__cause__ = None
        return new
    name = type(e).__name__
    text = redact(str(e))
    if "Timeout" in name:
        return TimeoutError(f"{what}: {name}: {text}")
    if "Connect" in name or "Connection" in name or "ServerDisconnected" in name or "ClientOSError" in name:
        return ConnectionError(f"{what}: {name}: {text}")
    return OSError(f"{what}: {name}: {text}")


def _transient(e: BaseException) -> bool:
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    return type(e) is OSError  # 5xx and unclassified transport errors; typed OSErrors are answers


def on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the calling code runs on ``loop`` (where a blocking call would deadlock)."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class BatchRunner:
    """Runs per-key coroutines on ``loop`` under a shared in-flight bound. ``stats`` counts requests,
    retries, errors and timeouts."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, timeout_s: float, max_retries: int, max_in_flight: int,
                 redact: Redactor, stats: dict[str, int]) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.max_in_flight = max_in_flight
        self.redact = redact
        self.stats = stats
        self._sem: asyncio.Semaphore | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        if self._sem is None:  # created on the loop thread, the only place it is used
            self._sem = asyncio.Semaphore(self.max_in_flight)
        return self._sem

    async def attempts(self, what: str, fn: Callable[[], Awaitable[Any]], deadline: float) -> Any:
        """``await fn()`` until it succeeds, fails for good, or ``deadline`` (loop time) passes."""
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                self.stats["timeouts"] += 1
                raise TimeoutError(f"{what}: timed out")
            try:
                async with self._semaphore():
                    self.stats["requests"] += 1
                    return await asyncio.wait_for(fn(), remaining)
            except (KVFormatError, *_PERMANENT, ValueError) as e:  # answers, not hiccups: never retried
                raise (translate(e, what, self.redact) if isinstance(e, OSError) else e) from None
            except Exception as e:  # transport: translate, maybe retry
                err = translate(e, what, self.redact)
                if isinstance(err, TimeoutError) and deadline - loop.time() <= 0:
                    self.stats["timeouts"] += 1
                    raise err from None
                if not _transient(err) or attempt >= self.max_retries:
                    self.stats["errors"] += 1
                    raise err from None
                attempt += 1
                self.stats["retries"] += 1
                delay = min(0.05 * 4 ** attempt * (0.5 + secrets.randbelow(1000) / 1000), 2.0)
                await asyncio.sleep(max(0.0, min(delay, deadline - loop.time())))

    def iter_many(self, what: str, fn: Callable[[Any], Awaitable[Any]], items: Sequence[Any],
                  labels: Sequence[str], timeout_s: float | None = None) -> Iterator[tuple[int, Any]]:
        """Run ``fn(item)`` for every item concurrently; yield ``(index, result or exception)`` as each
        finishes, so the caller decodes one block while the others are still in flight."""
        if not items:
            return
        if on_loop(self.loop):
            raise RuntimeError("remote store calls block; do not make them from fsspec's I/O loop")
        t = self.timeout_s if timeout_s is None else timeout_s
        q: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()

        async def batch() -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + t

            async def one(i: int) -> None:
                try:
                    q.put((i, await self.attempts(f"{what} {labels[i]}", lambda: fn(items[i]), deadline)))
                except asyncio.CancelledError:
                    self.stats["timeouts"] += 1
                    q.put((i, TimeoutError(f"{what} {labels[i]}: timed out after {t:g}s")))
                    raise
                except BaseException as e:  # noqa: BLE001  (handed to the caller per item)
                    q.put((i, e))

            tasks = [asyncio.ensure_future(one(i)) for i in range(len(items))]
            try:
                _, pending = await asyncio.wait(tasks, timeout=t)
            except asyncio.CancelledError:  # the caller gave up: its tasks must not outlive it
                pending = {x for x in tasks if not x.done()}
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)  # let cancellations release connections

        fut = asyncio.run_coroutine_threadsafe(batch(), self.loop)
        seen: set[int] = set()
        end = time.monotonic() + t + 2.0
        try:
            while len(seen) < len(items):
                try:
                    i, r = q.get(timeout=max(0.0, end - time.monotonic()))
                except queue.Empty:  # the loop itself is stuck: give up on what is left
                    break
                if i not in seen:
                    seen.add(i)
                    yield i, r
        finally:
            if len(seen) < len(items):
                fut.cancel()
        for i in range(len(items)):
            if i not in seen:
                self.stats["timeouts"] += 1
                yield i, TimeoutError(f"{what} {labels[i]}: timed out after {t:g}s")

    def run_many(self, what: str, fn: Callable[[Any], Awaitable[Any]], items: Sequence[Any],
                 labels: Sequence[str], timeout_s: float | None = None) -> list[Any]:
        """:meth:`iter_many` collected: a result or an exception per item, in order."""
        out: list[Any] = [None] * len(items)
        for i, r in self.iter_many(what, fn, items, labels, timeout_s):
            out[i] = r
        return out

    def run_one(self, what: str, fn: Callable[[Any], Awaitable[Any]], item: Any, label: str,
                timeout_s: float | None = None) -> Any:
        """One request: its result, or its exception raised."""
        r = self.run_many(what, fn, [item], [label], timeout_s)[0]
        if isinstance(r, BaseException):
            raise r
        return r

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        """Run one coroutine on the loop (housekeeping: closing sessions); waits at most ``timeout_s``."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"timed out after {timeout_s:g}s") from None


__all__ = ["BatchRunner", "translate", "on_loop"]
