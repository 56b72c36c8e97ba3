"""Remote roots through fsspec (``s3://``, ``gs://``, ``az://``, ``memory://``, ``sftp://`` …).

All I/O runs as coroutines on fsspec's I/O event loop (a synchronous filesystem is wrapped so its
calls run in worker threads), many keys per call, at most ``max_in_flight`` requests at once. Every
call has a deadline (``timeout_s``): the caller thread is never blocked longer than that, requests
still running at the deadline are cancelled and their keys report ``TimeoutError``. Transient
failures (connection refused/reset, timeouts, 5xx) are retried ``max_retries`` times with backoff
inside the deadline. Transport errors surface as ``OSError`` subclasses; kvformat errors for bad
bytes, as with local files.

Atomicity: a PUT to an object store is atomic per object, so blocks are written in one request;
``overwrite=False`` uses a conditional PUT (``If-None-Match: *``) where the backend has one. Other
filesystems (SFTP, HDFS, SMB …) get a temp object and a move, like local files.

Credentials (from ``storage_options`` or the environment, as fsspec/s3fs read them) are never put in
``repr``/``str``, log records or the errors this module raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import os
import queue
import re
import secrets
import threading
import time
from datetime import datetime
from typing import Any, Awaitable, Callable, Iterable, Iterator, Sequence

from .._format import as_bytes_view, decode, invalidate
from .._header import decode_header, header_length
from .._io import FIRST_READ, TMP_PREFIX
from .._spec import FILE_SUFFIX, NAMESPACE_FILE, QUARANTINE_DIR, BlockHeader, BlockKey, CanonicalLayout
from ..errors import ChecksumError, CodecError, KVFormatError, TruncatedError
from ._base import Store, StoreEntry

log = logging.getLogger("kvformat.storage")

# Object stores: one PUT replaces an object atomically (readers see the old or the new object, never a mix).
# memory:// assigns a finished buffer to a dict entry, which is atomic too.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss", "r2", "cos",
                            "tos", "obs", "memory"})
_SECRET_OPTION = re.compile(r"key|secret|token|passw|credential|sas|auth|session|signature", re.I)
_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")
# Answers that say the request itself is wrong, not that the service hiccupped: never retried.
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
_MEMORY_LOCK = threading.Lock()
_TIMEOUTS: tuple[type[BaseException], ...] = (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)


def _redact_url(url: str) -> str:
    return _URL_USERINFO.sub("***@", url)


def _secret_values(options: dict[str, Any]) -> list[str]:
    out: list[str] = []

    def walk(k: str, v: Any) -> None:
        if isinstance(v, dict):
            for k2, v2 in v.items():
                walk(str(k2), v2)
        elif isinstance(v, str) and len(v) >= 4 and _SECRET_OPTION.search(k):
            out.append(v)

    for k, v in options.items():
        walk(k, v)
    for k in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "GOOGLE_APPLICATION_CREDENTIALS",
              "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CONNECTION_STRING"):
        v = os.environ.get(k)
        if v and len(v) >= 4:
            out.append(v)
    return sorted(set(out), key=len, reverse=True)


def _mtime(info: dict[str, Any]) -> float:
    for k in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        v = info.get(k)
        if v is None or v == "":
            continue
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
        try:
            return datetime.fromisoformat(str(v).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
    return 0.0


class FsspecStore(Store):
    """kvformat files under an fsspec URL. See the module docstring for the I/O model.

    Parameters
    ----------
    url: ``protocol://bucket/prefix``; the prefix is created implicitly by the first write.
    timeout_s: deadline of one call (a batch included); the caller never waits longer.
    max_retries: retries of one request after a transient failure (connection, timeout, 5xx).
    max_in_flight: requests in flight at once for this store, across all calling threads.
    exists_cache_s: how long a positive existence answer is trusted without asking again (own
        writes and deletes update it at once; another host's delete is seen after this long, or
        sooner through a failed read).
    missing_cache_s: the same for "absent" answers (short: another host may write the key).
    list_timeout_s: deadline of a listing (``list``, ``cleanup_temp``): a large root takes many pages.
    atomic_put: force (True) or avoid (False) single-request writes; default: by protocol.
    storage_options: given to fsspec (``endpoint_url``, ``key``, ``secret``, ``anon``, ``client_kwargs``…);
        anything not given is read from the environment by the backend (``AWS_ENDPOINT_URL``,
        ``AWS_ACCESS_KEY_ID`` …). For S3, ``config_kwargs`` gets connect/read timeouts and botocore
        retries turned off (this store retries) unless given.

    Raises
    ------
    ImportError naming the package to install when the protocol's backend is missing.
    """

    def __init__(self, url: str, *, timeout_s: float = 30.0, max_retries: int = 2, max_in_flight: int = 32,
                 exists_cache_s: float = 30.0, missing_cache_s: float = 1.0, atomic_put: bool | None = None,
                 connect_timeout_s: float = 3.0, read_timeout_s: float | None = None,
                 list_timeout_s: float = 600.0, **storage_options: Any) -> None:
        import fsspec
        from fsspec.asyn import AsyncFileSystem, get_loop

        if timeout_s <= 0 or max_retries < 0 or max_in_flight < 1:
            raise ValueError("expected timeout_s > 0, max_retries >= 0 and max_in_flight >= 1")
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.max_in_flight = int(max_in_flight)
        self.exists_cache_s = float(exists_cache_s)
        self.missing_cache_s = float(missing_cache_s)
        self.list_timeout_s = max(float(list_timeout_s), self.timeout_s)
        self._secrets = _secret_values(storage_options)
        m = re.search(r"://([^/@\s]+)@", url)
        if m:  # user:password@host in the URL: the password (and the pair) count as secrets
            self._secrets = sorted({*self._secrets, m.group(1), m.group(1).partition(":")[2]} - {""}, key=len,
                                   reverse=True)
        protocol = url.split("://", 1)[0].lower()
        opts = dict(storage_options)
        if protocol in ("s3", "s3a"):
            ck = dict(opts.get("config_kwargs") or {})
            ck.setdefault("connect_timeout", connect_timeout_s)
            ck.setdefault("read_timeout", read_timeout_s or max(1.0, self.timeout_s / (self.max_retries + 1)))
            ck.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
            ck.setdefault("max_pool_connections", max(10, self.max_in_flight))
            opts["config_kwargs"] = ck
            opts.setdefault("use_listings_cache", False)
        # Our own instance: the retry and timeout settings below must not leak into other users'
        # cached filesystem objects, nor theirs into ours.
        fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True, **opts)
        if protocol in ("s3", "s3a"):
            fs.retries = 1  # s3fs retries on its own with long sleeps; this store retries within its deadline
        self._s3 = type(fs).__module__.startswith("s3fs")
        if isinstance(fs, AsyncFileSystem):
            self._afs: Any = fs
            self._loop = fs.loop if not fs.asynchronous else get_loop()
        else:
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            self._afs = AsyncFileSystemWrapper(fs, asynchronous=True)
            self._loop = get_loop()
        self._fs = fs
        self._base = fs._strip_protocol(path).rstrip("/")
        self.protocol = protocol
        self.root = _redact_url(url.rstrip("/"))
        self.atomic_put = (protocol in _OBJECT_STORES) if atomic_put is None else bool(atomic_put)
        self._conditional_put = self.atomic_put and "mode" in inspect.signature(self._afs._pipe_file).parameters
        self._sem: asyncio.Semaphore | None = None
        self._known: dict[str, tuple[bool, float]] = {}  # relpath -> (exists, monotonic time of the answer)
        self._known_lock = threading.Lock()
        self._pending_exists: set[str] = set()
        self.stats = {"requests": 0, "retries": 0, "errors": 0, "timeouts": 0}

    def __repr__(self) -> str:
        return f"FsspecStore({self.root!r})"

    __str__ = __repr__

    # -- plumbing -----------------------------------------------------------------------------------
    def _full(self, relpath: str) -> str:
        parts = relpath.split("/")
        if not relpath or relpath.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"path {relpath!r} leaves the store root")
        return f"{self._base}/{relpath}"

    def _where(self, relpath: str) -> str:
        return f"{self.root}/{relpath}"

    def _redact(self, text: str) -> str:
        text = _redact_url(text)
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def _translate(self, e: BaseException, what: str) -> BaseException:
        """A transport failure as an OSError subclass with no credentials in its message."""
        if isinstance(e, KVFormatError):
            return e
        if isinstance(e, _TIMEOUTS):
            return TimeoutError(f"{what}: timed out")
        if isinstance(e, OSError) and type(e).__module__ == "builtins":  # botocore's OSError subclasses are translated below
            msg = str(e)
            red = self._redact(msg)
            if red == msg:
                return e
            new = type(e)(red) if type(e) is not OSError else OSError(e.errno, red)
            new.__cause__ = None
            return new
        name = type(e).__name__
        text = self._redact(str(e))
        if "Timeout" in name:
            return TimeoutError(f"{what}: {name}: {text}")
        if "Connect" in name or "Connection" in name or "ServerDisconnected" in name or "ClientOSError" in name:
            return ConnectionError(f"{what}: {name}: {text}")
        return OSError(f"{what}: {name}: {text}")

    @staticmethod
    def _transient(e: BaseException) -> bool:
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        return type(e) is OSError  # 5xx and unclassified transport errors; typed OSErrors are answers

    def _semaphore(self) -> asyncio.Semaphore:
        if self._sem is None:  # created on the loop thread, the only place it is used
            self._sem = asyncio.Semaphore(self.max_in_flight)
        return self._sem

    async def _attempts(self, what: str, fn: Callable[[], Awaitable[Any]], deadline: float) -> Any:
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
                raise (self._translate(e, what) if isinstance(e, OSError) else e) from None
            except Exception as e:  # transport: translate, maybe retry
                err = self._translate(e, what)
                if isinstance(err, TimeoutError) and deadline - loop.time() <= 0:
                    self.stats["timeouts"] += 1
                    raise err from None
                if not self._transient(err) or attempt >= self.max_retries:
                    self.stats["errors"] += 1
                    raise err from None
                attempt += 1
                self.stats["retries"] += 1
                delay = min(0.05 * 4 ** attempt * (0.5 + secrets.randbelow(1000) / 1000), 2.0)
                await asyncio.sleep(max(0.0, min(delay, deadline - loop.time())))

    def _iter_many(self, what: str, fn: Callable[[Any], Awaitable[Any]], items: Sequence[Any],
                   labels: Sequence[str], timeout_s: float | None = None) -> Iterator[tuple[int, Any]]:
        """Run ``fn(item)`` for every item concurrently on the I/O loop; yield ``(index, result or exception)``
        as each finishes, so the caller decodes one block while the others are still in flight."""
        if not items:
            return
        if _on_loop(self._loop):
            raise RuntimeError("FsspecStore calls block; do not make them from fsspec's I/O loop")
        t = self.timeout_s if timeout_s is None else timeout_s
        q: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()

        async def batch() -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + t

            async def one(i: int) -> None:
                try:
                    q.put((i, await self._attempts(f"{what} {labels[i]}", lambda: fn(items[i]), deadline)))
                except asyncio.CancelledError:
                    self.stats["timeouts"] += 1
                    q.put((i, TimeoutError(f"{what} {labels[i]}: timed out after {t:g}s")))
                    raise
                except BaseException as e:  # noqa: BLE001  (handed to the caller per item)
                    q.put((i, e))

            tasks = [asyncio.ensure_future(one(i)) for i in range(len(items))]
            _, pending = await asyncio.wait(tasks, timeout=t)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)  # let cancellations release connections

        fut = asyncio.run_coroutine_threadsafe(batch(), self._loop)
        seen: set[int] = set()
        end = time.monotonic() + t + 2.0
        try:
            while len(seen) < len(items):
                try:
                    i, r = q.get(timeout=max(0.0, end - time.monotonic()))
                except queue.Empty:  # the loop itself is stuck: give up on what is left
                    fut.cancel()
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

    def _run_many(self, what: str, fn: Callable[[Any], Awaitable[Any]], items: Sequence[Any],
                  labels: Sequence[str], timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(item)`` for every item concurrently on the I/O loop; a result or an exception per item."""
        out: list[Any] = [None] * len(items)
        for i, r in self._iter_many(what, fn, items, labels, timeout_s):
            out[i] = r
        return out

    def _run_one(self, what: str, fn: Callable[[Any], Awaitable[Any]], relpath: str,
                 timeout_s: float | None = None) -> Any:
        r = self._run_many(what, fn, [relpath], [self._where(relpath)], timeout_s)[0]
        if isinstance(r, BaseException):
            raise r
        return r

    def _remember(self, relpath: str, present: bool) -> None:
        with self._known_lock:
            self._known[relpath] = (present, time.monotonic())

    def _cached(self, relpath: str) -> bool | None:
        with self._known_lock:
            v = self._known.get(relpath)
        if v is None:
            return None
        present, at = v
        return present if time.monotonic() - at < (self.exists_cache_s if present else self.missing_cache_s) else None

    def forget(self, relpaths: Iterable[str] | None = None) -> None:
        """Drop cached existence answers (all of them by default), e.g. after another host ran gc."""
        with self._known_lock:
            if relpaths is None:
                self._known.clear()
            else:
                for r in relpaths:
                    self._known.pop(r, None)

    # -- async primitives ---------------------------------------------------------------------------
    async def _a_head(self, path: str) -> dict[str, Any] | None:
        if self._s3:
            bucket, key, _ = self._fs.split_path(path)
            try:
                out = await self._fs._call_s3("head_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return None
            return {"size": out["ContentLength"], "LastModified": out.get("LastModified"), "type": "file"}
        try:
            info = await self._afs._info(path)
        except FileNotFoundError:
            return None
        return info if info.get("type", "file") == "file" else None

    async def _a_get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        if self._s3 and start is None:
            return await self._afs._cat_file(path, max_concurrency=1)  # one GET, no HEAD for the size first
        if start is None:
            return await self._afs._cat_file(path)
        return await self._afs._cat_file(path, start=start, end=end)

    async def _a_put(self, relpath: str, data: bytes, overwrite: bool) -> bool:
        path = self._full(relpath)
        if self.atomic_put:
            if overwrite:
                await self._afs._pipe_file(path, data)
            elif self.protocol == "memory":  # one process-wide dict: a lock makes check-and-set exclusive
                return await asyncio.to_thread(self._memory_create, path, data)
            elif self._conditional_put:
                try:
                    await self._afs._pipe_file(path, data, mode="create")
                except FileExistsError:
                    return False
                except OSError as e:
                    if type(e) is not OSError or "precondition" not in str(e).lower():
                        raise
                    return False  # a backend that reports If-None-Match failures without the condition name
            else:
                if await self._a_head(path) is not None:
                    return False
                await self._afs._pipe_file(path, data)
            return True
        tmp = f"{path.rsplit('/', 1)[0]}/{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        await self._afs._pipe_file(tmp, data)
        try:
            if not overwrite and await self._a_head(path) is not None:
                return False
            await self._afs._mv(tmp, path)
            tmp = ""
            return True
        finally:
            if tmp:
                try:
                    await self._afs._rm_file(tmp)
                except FileNotFoundError:
                    pass

    def _memory_create(self, path: str, data: bytes) -> bool:
        with _MEMORY_LOCK:
            if self._fs.exists(path):
                return False
            self._fs.pipe_file(path, data)
            return True

    # -- Store interface ----------------------------------------------------------------------------
    def put(self, relpath: str, parts: list[Any], *, overwrite: bool = False, fsync: bool = False) -> bool:
        """Write the concatenation of ``parts`` atomically (``fsync`` is implied by a completed PUT)."""
        r = self.put_many([(relpath, parts)], overwrite=overwrite)[0]
        if isinstance(r, BaseException):
            raise r
        return bool(r)

    def put_many(self, items: Sequence[tuple[str, list[Any]]], *, overwrite: bool = False,
                 fsync: bool = False, timeout_s: float | None = None) -> list[bool | BaseException]:
        """Write many files concurrently. Per item: True (written), False (existed), or the exception."""
        for rel, _ in items:
            self._full(rel)
        # Joined on the loop when its turn comes: the first PUT starts before the last body is built.
        res = self._run_many("put", lambda it: self._a_put(it[0], b"".join(as_bytes_view(p) for p in it[1]), overwrite),
                             items, [self._where(r) for r, _ in items], timeout_s)
        for (rel, _), r in zip(items, res):
            if not isinstance(r, BaseException):
                self._remember(rel, True)
        return res

    def read_bytes(self, relpath: str) -> bytes:
        try:
            return self._run_one("get", lambda rel: self._a_get(self._full(rel)), relpath)
        except FileNotFoundError:
            self._remember(relpath, False)
            raise

    def read_many_bytes(self, relpaths: Sequence[str], *, timeout_s: float | None = None) -> list[bytes | BaseException]:
        """Whole files, fetched concurrently; per item the bytes or the exception."""
        for r in relpaths:
            self._full(r)
        res = self._run_many("get", lambda rel: self._a_get(self._full(rel)), list(relpaths),
                             [self._where(r) for r in relpaths], timeout_s)
        for rel, r in zip(relpaths, res):
            if isinstance(r, FileNotFoundError):
                self._remember(rel, False)
        return res

    def read_into(self, relpath: str, out: Any, *, expect: CanonicalLayout | None = None,
                  key: BlockKey | None = None, verify: bool = True) -> BlockHeader:
        r = self.read_many_into([(relpath, out, key)], expect=expect, verify=verify)[0]
        if isinstance(r, BaseException):
            raise r
        return r

    def read_many_into(self, items: Sequence[tuple[str, Any, BlockKey | None]], *,
                       expect: CanonicalLayout | None = None, verify: bool = True,
                       timeout_s: float | None = None) -> list[BlockHeader | BaseException]:
        """Fetch many files concurrently and decode each into its ``out``.

        Per item the header or the exception (the bytes are checked before ``out`` is touched; a
        checksum failure leaves ``out`` zeroed). Decoding runs in the calling thread.
        """
        for rel, _, _ in items:
            self._full(rel)
        res: list[BlockHeader | BaseException | None] = [None] * len(items)
        for i, buf in self._iter_many("get", lambda rel: self._a_get(self._full(rel)), [r for r, _, _ in items],
                                      [self._where(r) for r, _, _ in items], timeout_s):
            rel, out, key = items[i]
            if isinstance(buf, BaseException):
                if isinstance(buf, FileNotFoundError):
                    self._remember(rel, False)
                res[i] = buf
                continue
            try:
                res[i], _ = decode(buf, out, expect=expect, key=key, verify=verify)
            except KVFormatError as e:
                if isinstance(e, (ChecksumError, CodecError)):  # decode checks before copying; the contract is zeroed
                    invalidate(as_bytes_view(out, writable=True))
                res[i] = e.with_path(self._where(rel))
            except ValueError as e:  # destination too small: the caller's bug, reported as such
                res[i] = e
            del buf
        return res  # type: ignore[return-value]

    async def _a_header(self, rel: str, verify: bool) -> BlockHeader:
        path = self._full(rel)
        info, first = await asyncio.gather(self._a_head(path), self._a_get(path, 0, FIRST_READ))
        if info is None:
            raise FileNotFoundError(f"{self._where(rel)}: no such object")
        size = int(info["size"])
        first = bytes(first)
        end = header_length(first)
        if end > len(first):
            if end > size:
                raise TruncatedError("header", end, size)
            first += await self._a_get(path, len(first), end)
        return decode_header(first, file_bytes=size, verify=verify)

    def read_header(self, relpath: str, *, verify: bool = True) -> BlockHeader:
        """Header only: a ranged GET of the first 8 KiB (more if the header is longer) and a HEAD for the size."""
        r = self.read_headers_many([relpath], verify=verify)[0]
        if isinstance(r, BaseException):
            raise r
        return r

    def read_headers_many(self, relpaths: Sequence[str], *, verify: bool = True,
                          timeout_s: float | None = None) -> list[BlockHeader | BaseException]:
        """Headers of many files, fetched concurrently (see :meth:`read_header`); per item the header or the exception."""
        for r in relpaths:
            self._full(r)
        res = self._run_many("head", lambda rel: self._a_header(rel, verify), list(relpaths),
                             [self._where(r) for r in relpaths], timeout_s)
        out: list[BlockHeader | BaseException] = []
        for rel, r in zip(relpaths, res):
            if isinstance(r, KVFormatError):
                r = r.with_path(self._where(rel))
            elif isinstance(r, FileNotFoundError):
                self._remember(rel, False)
            elif isinstance(r, BlockHeader):
                self._remember(rel, True)
            out.append(r)
        return out

    def exists(self, relpath: str) -> bool:
        c = self._cached(relpath)
        if c is not None:
            return c
        r = self._run_one("exists", lambda rel: self._a_head(self._full(rel)), relpath)
        self._remember(relpath, r is not None)
        return r is not None

    def exists_many(self, relpaths: Iterable[str], *, timeout_s: float | None = None) -> list[bool]:
        """Existence of many files: cached answers, one concurrent HEAD round for the rest.

        A key whose lookup failed (server down, timeout) reads as absent: a miss, never a false hit.
        """
        rels = list(relpaths)
        out: list[bool | None] = [self._cached(r) for r in rels]
        ask = [r for r, v in zip(rels, out) if v is None]
        if ask:
            for r in ask:
                self._full(r)
            res = self._run_many("exists", lambda rel: self._a_head(self._full(rel)), ask,
                                 [self._where(r) for r in ask], timeout_s)
            got: dict[str, bool] = {}
            failed = 0
            for r, v in zip(ask, res):
                if isinstance(v, BaseException):
                    failed += 1
                    got[r] = False
                else:
                    got[r] = v is not None
                    self._remember(r, got[r])
            if failed:
                log.warning("%s: %d of %d existence lookups failed; reading them as misses", self.root, failed,
                            len(ask))
            out = [got[r] if v is None else v for r, v in zip(rels, out)]
        return [bool(v) for v in out]

    def exists_nowait(self, relpaths: Iterable[str]) -> list[bool | None]:
        """Cached existence answers without waiting: None = unknown, a batched lookup is started.

        Meant for a scheduler step (answer RETRY for None, ask again next step).
        """
        rels = list(relpaths)
        out = [self._cached(r) for r in rels]
        with self._known_lock:
            ask = [r for r, v in zip(rels, out) if v is None and r not in self._pending_exists]
            self._pending_exists.update(ask)
        if ask:
            for r in ask:
                self._full(r)

            async def bg() -> None:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + self.timeout_s

                async def one(rel: str) -> None:
                    try:
                        info = await self._attempts(f"exists {self._where(rel)}",
                                                    lambda: self._a_head(self._full(rel)), deadline)
                        self._remember(rel, info is not None)
                    except Exception:
                        self._remember(rel, False)  # failed lookups read as misses until missing_cache_s passes
                    finally:
                        with self._known_lock:
                            self._pending_exists.discard(rel)

                await asyncio.gather(*(one(r) for r in ask))

            asyncio.run_coroutine_threadsafe(bg(), self._loop)
        return out

    def delete(self, relpath: str) -> bool:
        async def go(rel: str) -> bool:
            path = self._full(rel)
            if await self._a_head(path) is None:
                return False
            try:
                await self._afs._rm_file(path)
            except FileNotFoundError:
                return False
            return True

        r = self._run_one("delete", go, relpath)
        self._remember(relpath, False)
        return r

    def delete_many(self, relpaths: Sequence[str], *, timeout_s: float | None = None) -> list[bool | BaseException]:
        """Remove many files concurrently (gc). Per item: True, False (absent) or the exception."""
        async def go(rel: str) -> bool:
            path = self._full(rel)
            if await self._a_head(path) is None:
                return False
            await self._afs._rm_file(path)
            return True

        res = self._run_many("delete", go, list(relpaths), [self._where(r) for r in relpaths], timeout_s)
        for r in relpaths:
            self._remember(r, False)
        return res

    def list(self, prefix: str = "") -> Iterator[StoreEntry]:
        base = self._full(prefix.rstrip("/")) if prefix.strip("/") else self._base

        async def go(_: str) -> dict[str, Any]:
            try:
                return await self._afs._find(base, detail=True)
            except FileNotFoundError:
                return {}

        found = self._run_one("list", go, prefix or ".", self.list_timeout_s)
        try:
            self._fs.invalidate_cache()
        except Exception:  # some backends keep no listings cache
            pass
        skip = f"{self._base}/{QUARANTINE_DIR}/"
        cut = len(self._base) + 1
        for name in sorted(found):
            info = found[name]
            name = self._fs._strip_protocol(name)
            if (info.get("type", "file") != "file" or not name.endswith(FILE_SUFFIX) or name.startswith(skip)
                    or name.rsplit("/", 1)[-1].startswith(TMP_PREFIX) or not name.startswith(self._base + "/")):
                continue
            yield StoreEntry(name[cut:], int(info.get("size") or 0), _mtime(info))

    def touch(self, relpath: str) -> None:
        """Set the mtime to now. S3: an in-place copy with new metadata (server side, no data moved)."""
        async def go(rel: str) -> None:
            path = self._full(rel)
            try:
                if self._s3:
                    bucket, key, _ = self._fs.split_path(path)
                    await self._fs._call_s3("copy_object", Bucket=bucket, Key=key,
                                            CopySource={"Bucket": bucket, "Key": key},
                                            MetadataDirective="REPLACE", Metadata={"kvf-used": str(int(time.time()))})
                    return
                if not self.atomic_put:
                    try:
                        await self._afs._touch(path, truncate=False)
                        return
                    except (NotImplementedError, ValueError):
                        pass
                # Rewrite the same bytes: atomic on object stores, and the only portable way to bump mtime.
                data = await self._a_get(path)
                if self.atomic_put:
                    await self._afs._pipe_file(path, data)
                else:
                    await self._a_put(rel, data, True)
            except FileNotFoundError:
                pass

        self._run_one("touch", go, relpath)

    def quarantine(self, relpath: str, reason: str) -> str | None:
        dst_rel = f"{QUARANTINE_DIR}/{relpath}.{reason}"

        async def go(rel: str) -> str | None:
            src, dst = self._full(rel), self._full(dst_rel)
            try:
                await self._afs._copy(src, dst) if self.atomic_put else await self._afs._mv(src, dst)
            except FileNotFoundError:
                return None
            if self.atomic_put:
                try:
                    await self._afs._rm_file(src)
                except FileNotFoundError:
                    pass
            return dst_rel

        r = self._run_one("quarantine", go, relpath)
        self._remember(relpath, False)
        return r

    def cleanup_temp(self, older_than_s: float = 0.0, *, dead_writers: bool = False) -> int:
        # dead_writers: an object store cannot tell whether a writer runs; the age rule alone applies.
        async def go(_: str) -> dict[str, Any]:
            try:
                return await self._afs._find(self._base, detail=True)
            except FileNotFoundError:
                return {}

        found = self._run_one("list", go, ".", self.list_timeout_s)
        now = time.time()
        old = [self._fs._strip_protocol(n)[len(self._base) + 1:] for n, i in found.items()
               if n.rsplit("/", 1)[-1].startswith(TMP_PREFIX) and now - _mtime(i) >= older_than_s]
        if not old:
            return 0
        res = self._run_many("delete", lambda rel: self._afs._rm_file(self._full(rel)), old,
                             [self._where(r) for r in old])
        for r in old:
            self._remember(r, False)
        return sum(1 for r in res if not isinstance(r, BaseException))

    def _namespace_dirs(self) -> list[str]:
        async def go(_: str) -> list[str]:
            try:
                ls = await self._afs._ls(self._base, detail=False)
            except FileNotFoundError:
                return []
            return [self._fs._strip_protocol(p).rstrip("/").rsplit("/", 1)[-1] for p in ls]

        dirs = [d for d in self._run_one("list", go, ".") if d != QUARANTINE_DIR and not d.startswith(".")]
        has = self.exists_many([f"{d}/{NAMESPACE_FILE}" for d in dirs])
        return [d for d, h in zip(dirs, has) if h]


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


__all__ = ["FsspecStore"]
