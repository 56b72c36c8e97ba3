"""Remote roots through fsspec (``s3://``, ``gs://``, ``az://``, ``memory://``, ``sftp://`` …).

All I/O runs as coroutines on fsspec's I/O event loop (a synchronous filesystem is wrapped so its
calls run in worker threads), many keys per call, at most ``max_in_flight`` requests at once, with a
deadline per call and bounded retries (:mod:`._batch`). Transport errors surface as ``OSError``
subclasses; kvformat errors for bad bytes, decided by the same pipeline as local files
(:class:`~kvformat.storage.Store`).

Atomicity: a PUT to an object store is atomic per object, so blocks are written in one request;
``overwrite=False`` uses a conditional PUT (``If-None-Match: *``) where the backend has one. Other
filesystems (SFTP, HDFS, SMB …) get a temp object and a move, like local files.

Credentials (from ``storage_options`` or the environment, as fsspec/s3fs read them) are never put in
``repr``/``str``, log records or the errors this module raises (:mod:`._redact`).

Fork: a store built before ``os.fork()`` works in the child: the first call there rebuilds the
filesystem, event loop and connections (the parent's belong to threads the child does not have).
"""

from __future__ import annotations

import builtins  # annotations inside Store name builtins.list: Store.list shadows it there
import asyncio
import inspect
import logging
import os
import time
from typing import Any, Iterable, Iterator, Sequence

from ..format import FILE_SUFFIX, NAMESPACE_FILE, QUARANTINE_DIR, TMP_PREFIX, BytesSource, FileId, xxh3_64
from ._base import GONE, MOVED, REPLACED, Store, StoreEntry
from ._batch import BatchRunner
from ._exists import ExistsCache
from ._fsspec_requests import Requests, _mtime
from ._redact import Redactor, redact_url
from ._s3 import S3_PROTOCOLS, is_s3, s3_close, s3_move_if, s3_options, s3_touch

log = logging.getLogger("kvformat.storage")

# Object stores: one PUT replaces an object atomically (readers see the old or the new object, never a mix).
# memory:// assigns a finished buffer to a dict entry, which is atomic too.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss", "r2", "cos",
                            "tos", "obs", "memory"})


class FsspecStore(Store, Requests):
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

    asynchronous = True
    durable_put = True

    def __init__(self, url: str, *, timeout_s: float = 30.0, max_retries: int = 2, max_in_flight: int = 32,
                 exists_cache_s: float = 30.0, missing_cache_s: float = 1.0, atomic_put: bool | None = None,
                 connect_timeout_s: float = 3.0, read_timeout_s: float | None = None,
                 list_timeout_s: float = 600.0, **storage_options: Any) -> None:
        if timeout_s <= 0 or max_retries < 0 or max_in_flight < 1:
            raise ValueError("expected timeout_s > 0, max_retries >= 0 and max_in_flight >= 1")
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.max_in_flight = int(max_in_flight)
        self.exists_cache_s = float(exists_cache_s)
        self.missing_cache_s = float(missing_cache_s)
        self.list_timeout_s = max(float(list_timeout_s), self.timeout_s)
        self._redact = Redactor(url, storage_options)
        self._secrets = self._redact.secrets
        self.protocol = url.split("://", 1)[0].lower()
        self._url = url
        self._opts = dict(storage_options)
        if self.protocol in S3_PROTOCOLS:
            self._opts = s3_options(self._opts, timeout_s=self.timeout_s, max_retries=self.max_retries,
                                    max_in_flight=self.max_in_flight, connect_timeout_s=connect_timeout_s,
                                    read_timeout_s=read_timeout_s)
        self.root = redact_url(url.rstrip("/"))
        self.stats = {"requests": 0, "retries": 0, "errors": 0, "timeouts": 0}
        self._exists = ExistsCache(self.exists_cache_s, self.missing_cache_s)
        self._connect()
        self.atomic_put = (self.protocol in _OBJECT_STORES) if atomic_put is None else bool(atomic_put)
        self.exclusive_create = self.atomic_put
        self._conditional_put = self.atomic_put and "mode" in inspect.signature(self._afs._pipe_file).parameters

    def _connect(self) -> None:
        """Build the filesystem, loop and locks for this process (at start, and again after a fork)."""
        import fsspec
        from fsspec.asyn import AsyncFileSystem, get_loop

        # Our own instance: the retry and timeout settings must not leak into other users' cached
        # filesystem objects, nor theirs into ours.
        fs, path = fsspec.core.url_to_fs(self._url, skip_instance_cache=True, **self._opts)
        if self.protocol in S3_PROTOCOLS:
            fs.retries = 1  # s3fs retries on its own with long sleeps; this store retries within its deadline
        self._s3 = is_s3(fs)
        if isinstance(fs, AsyncFileSystem):
            self._afs: Any = fs
            loop = fs.loop if not fs.asynchronous else get_loop()
        else:
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            self._afs = AsyncFileSystemWrapper(fs, asynchronous=True)
            loop = get_loop()
        self._fs = fs
        self._base = fs._strip_protocol(path).rstrip("/")
        self._runner = BatchRunner(loop, timeout_s=self.timeout_s, max_retries=self.max_retries,
                                   max_in_flight=self.max_in_flight, redact=self._redact, stats=self.stats)
        self._loop = loop
        self._exists.after_fork()
        self._pid = os.getpid()

    def _live(self) -> None:
        super()._live()
        if os.getpid() != self._pid:  # forked: the parent's loop thread and sockets are not ours
            self._connect()

    def close(self) -> None:
        """Close the connection pool (S3 client session); idempotent. In a forked child nothing of the
        parent's is touched (its sockets are shared with the parent)."""
        if self.closed:
            return
        self.closed = True
        if self._s3 and os.getpid() == self._pid:
            try:
                self._runner.call(s3_close(self._fs), min(self.timeout_s, 5.0))
            except (OSError, RuntimeError) as e:  # a dead or hung endpoint must not make close() fail
                log.debug("%s: closing the session: %s", self.root, self._redact(str(e)))

    def __repr__(self) -> str:
        return f"FsspecStore({self.root!r})"

    __str__ = __repr__

    # -- plumbing -----------------------------------------------------------------------------------
    def _full(self, relpath: str) -> str:
        self._check(relpath)
        return f"{self._base}/{relpath}"

    def _where(self, relpath: str) -> str:
        return f"{self.root}/{relpath}"

    def _labels(self, rels: Sequence[str]) -> builtins.list[str]:
        return [self._where(r) for r in rels]

    def _noted(self, relpath: str, present: bool) -> None:
        self._exists.note(relpath, present)

    def _cached(self, relpath: str) -> bool | None:
        return self._exists.get(relpath)

    def fsspec_location(self, relpath: str) -> tuple[Any, str]:
        return self._fs, f"{self._base}/{relpath}"

    def forget(self, relpaths: Iterable[str] | None = None) -> None:
        """Drop cached existence answers (all of them by default), e.g. after another host ran gc."""
        self._exists.forget(relpaths)

    # -- Store primitives ---------------------------------------------------------------------------
    def _open_many(self, relpaths: Sequence[str], *, head_only: bool,
                   timeout_s: float | None) -> Iterator[tuple[int, BytesSource | BaseException]]:
        fn = self._a_prefix if head_only else self._a_whole
        yield from self._runner.iter_many("head" if head_only else "get", fn, list(relpaths),
                                          self._labels(relpaths), timeout_s)

    def _put_many(self, items: Sequence[tuple[str, list[Any]]], *, overwrite: bool, fsync: bool,
                  timeout_s: float | None) -> builtins.list[bool | BaseException]:
        # Store.put_many has already joined each body into one bytes object (``asynchronous``).
        return self._runner.run_many("put", lambda it: self._a_put(it[0], it[1][0], overwrite), list(items),
                                     self._labels([r for r, _ in items]), timeout_s)

    def _delete_many(self, relpaths: Sequence[str], timeout_s: float | None) -> builtins.list[bool | BaseException]:
        return self._runner.run_many("delete", self._a_delete, list(relpaths), self._labels(relpaths), timeout_s)

    def _move(self, src: str, dst: str, file_id: FileId | None = None) -> str:
        async def go(_: str) -> str:
            s, d = self._full(src), self._full(dst)
            if file_id is not None:
                if self._s3 and file_id.etag:  # exact: a conditional copy and a conditional delete
                    return await s3_move_if(self._fs, s, d, file_id.etag)
                if not await self._a_same(s, file_id):
                    return GONE if await self._a_head(s) is None else REPLACED
            try:
                # Object stores: copy then delete (a copy is atomic per object, a "move" is not one request).
                await self._afs._copy(s, d) if self.atomic_put else await self._afs._mv(s, d)
            except FileNotFoundError:
                return GONE
            if self.atomic_put:
                try:
                    await self._afs._rm_file(s)
                except FileNotFoundError:
                    pass
            return MOVED

        return str(self._runner.run_one("quarantine", go, src, self._where(src)))

    async def _a_same(self, path: str, file_id: FileId) -> bool:
        """Whether the object at ``path`` is the one read, by the identity its read recorded.

        Without an ETag (backends other than S3) that is its size and the xxh3 of the bytes read, fetched
        again: an object published since the read with other bytes does not match. A replacement between
        this check and the move is not excluded on those backends (no conditional requests there).
        """
        if file_id.digest is None:  # no identity this backend can check: move nothing
            return False
        info = await self._a_head(path)
        if info is None or int(info["size"]) != file_id.size:
            return False
        cur = await self._a_get(path, 0, file_id.span) if file_id.span < file_id.size else await self._a_get(path)
        return bool(xxh3_64(cur) == file_id.digest)

    def _exists_many(self, relpaths: Sequence[str], timeout_s: float | None) -> builtins.list[bool]:
        """Cached answers, one concurrent HEAD round for the rest."""
        out: builtins.list[bool | None] = [self._cached(r) for r in relpaths]
        ask = [r for r, v in zip(relpaths, out) if v is None]
        if ask:
            res = self._runner.run_many("exists", lambda rel: self._a_head(self._full(rel)), ask,
                                        self._labels(ask), timeout_s)
            got: dict[str, bool] = {}
            failed = 0
            for r, v in zip(ask, res):
                if isinstance(v, BaseException):
                    failed += 1
                    got[r] = False
                else:
                    got[r] = v is not None
                    self._noted(r, got[r])
            if failed:
                log.warning("%s: %d of %d existence lookups failed; reading them as misses", self.root, failed,
                            len(ask))
            out = [got[r] if v is None else v for r, v in zip(relpaths, out)]
        return [bool(v) for v in out]

    # -- other operations ---------------------------------------------------------------------------
    def read_bytes(self, relpath: str) -> bytes:
        """The whole object."""
        r = self.read_many_bytes([relpath])[0]
        if isinstance(r, BaseException):
            raise r
        return r

    def read_many_bytes(self, relpaths: Sequence[str], *,
                        timeout_s: float | None = None) -> builtins.list[bytes | BaseException]:
        """Whole files, fetched concurrently; per item the bytes or the exception."""
        self._live()
        rels = list(relpaths)
        res = self._runner.run_many("get", lambda rel: self._a_get(self._full(rel)), rels, self._labels(rels),
                                    timeout_s)
        for rel, r in zip(rels, res):
            if isinstance(r, FileNotFoundError):
                self._noted(rel, False)
        return res

    def exists_nowait(self, relpaths: Iterable[str]) -> builtins.list[bool | None]:
        """Cached existence answers without waiting: None = unknown, a batched lookup is started.

        Meant for a scheduler step (answer RETRY for None, ask again next step).
        """
        self._live()
        rels = list(relpaths)
        out = [self._cached(r) for r in rels]
        ask = self._exists.claim([r for r, v in zip(rels, out) if v is None])
        if ask:
            for r in ask:
                self._check(r)
            runner = self._runner

            async def bg() -> None:
                deadline = asyncio.get_running_loop().time() + self.timeout_s

                async def one(rel: str) -> None:
                    try:
                        info = await runner.attempts(f"exists {self._where(rel)}",
                                                     lambda: self._a_head(self._full(rel)), deadline)
                        self._noted(rel, info is not None)
                    except Exception:
                        self._noted(rel, False)  # failed lookups read as misses until missing_cache_s passes
                    finally:
                        self._exists.release(rel)

                await asyncio.gather(*(one(r) for r in ask))

            asyncio.run_coroutine_threadsafe(bg(), self._loop)
        return out

    def list(self, prefix: str = "") -> Iterator[StoreEntry]:
        self._live()
        base = self._full(prefix.rstrip("/")) if prefix.strip("/") else self._base
        found = self._runner.run_one("list", self._a_find, base, prefix or ".", self.list_timeout_s)
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
        self._live()

        async def go(rel: str) -> None:
            path = self._full(rel)
            try:
                if self._s3:
                    await s3_touch(self._fs, path)
                    return
                if not self.atomic_put:
                    if await self._a_head(path) is None:  # touch() would create an empty file
                        return
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

        self._runner.run_one("touch", go, relpath, self._where(relpath))

    def list_dir(self, prefix: str) -> builtins.list[StoreEntry]:
        self._live()
        base = self._full(prefix.rstrip("/"))

        async def go(_: str) -> builtins.list[dict[str, Any]]:
            try:
                found: builtins.list[dict[str, Any]] = await self._afs._ls(base, detail=True)
                return found
            except FileNotFoundError:
                return []

        out = []
        for info in self._runner.run_one("list", go, prefix, self._where(prefix)):
            name = self._fs._strip_protocol(info.get("name", "")).rsplit("/", 1)[-1]
            if info.get("type", "file") == "file" and name and not name.startswith(TMP_PREFIX):
                out.append(StoreEntry(f"{prefix.rstrip('/')}/{name}", int(info.get("size") or 0), _mtime(info)))
        try:
            self._fs.invalidate_cache()
        except Exception:  # some backends keep no listings cache
            pass
        return out

    def cleanup_temp(self, older_than_s: float = 0.0, *, dead_writers: bool = False) -> int:
        # dead_writers: an object store cannot tell whether a writer runs; the age rule alone applies.
        self._live()
        found = self._runner.run_one("list", self._a_find, self._base, ".", self.list_timeout_s)
        now = time.time()
        old = [self._fs._strip_protocol(n)[len(self._base) + 1:] for n, i in found.items()
               if n.rsplit("/", 1)[-1].startswith(TMP_PREFIX) and now - _mtime(i) >= older_than_s]
        if not old:
            return 0
        res = self._runner.run_many("delete", lambda rel: self._afs._rm_file(self._full(rel)), old, self._labels(old))
        for r in old:
            self._noted(r, False)
        return sum(1 for r in res if not isinstance(r, BaseException))

    def _namespace_dirs(self) -> builtins.list[str]:
        async def go(_: str) -> builtins.list[str]:
            try:
                ls = await self._afs._ls(self._base, detail=False)
            except FileNotFoundError:
                return []
            return [self._fs._strip_protocol(p).rstrip("/").rsplit("/", 1)[-1] for p in ls]

        dirs = [d for d in self._runner.run_one("list", go, ".", self.root) if d != QUARANTINE_DIR
                and not d.startswith(".")]
        has = self.exists_many([f"{d}/{NAMESPACE_FILE}" for d in dirs])
        return [d for d, h in zip(dirs, has) if h]


__all__ = ["FsspecStore"]
