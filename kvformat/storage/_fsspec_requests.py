"""The single-object requests of :class:`~kvformat.storage._fsspec.FsspecStore`, as coroutines on fsspec's
loop: HEAD, GET (whole or ranged), the header prefix, PUT with its atomicity rules (conditional or locked
create, temp object + move where a PUT is not atomic), DELETE and find. Batching, deadlines and retries
are the caller's (:mod:`._batch`).
"""

from __future__ import annotations

import asyncio
import threading
from datetime import datetime
from typing import Any

from ..format import FIRST_READ, BytesSource, header_length, temp_name
from ..errors import KVFormatError
from ._s3 import _precondition_failed, s3_get, s3_head

_MEMORY_LOCK = threading.Lock()


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


class Requests:
    """Mixin: the store's filesystem handles and write rules, and one request each (see the module)."""

    _s3: bool
    _fs: Any
    _afs: Any
    protocol: str
    atomic_put: bool
    _conditional_put: bool

    def _full(self, relpath: str) -> str:
        raise NotImplementedError

    def _where(self, relpath: str) -> str:
        raise NotImplementedError

    async def _a_head(self, path: str) -> dict[str, Any] | None:
        if self._s3:
            return await s3_head(self._fs, path)
        try:
            info = await self._afs._info(path)
        except FileNotFoundError:
            return None
        return info if info.get("type", "file") == "file" else None

    async def _a_get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        if self._s3 and start is None:
            data = await self._afs._cat_file(path, max_concurrency=1)  # one GET, no HEAD for the size first
        elif start is None:
            data = await self._afs._cat_file(path)
        else:
            data = await self._afs._cat_file(path, start=start, end=end)
        return bytes(data)

    async def _a_get_tagged(self, path: str, start: int | None = None, end: int | None = None
                            ) -> tuple[bytes, str | None]:
        """:meth:`_a_get` plus the ETag of the object the bytes came from (S3; None elsewhere)."""
        if self._s3:
            return await s3_get(self._fs, path, start, end)
        return await self._a_get(path, start, end), None

    async def _a_whole(self, rel: str) -> BytesSource:
        """The whole object as a source that knows which object it read (:meth:`BytesSource.identity`)."""
        data, etag = await self._a_get_tagged(self._full(rel))
        return BytesSource(data, etag=etag)

    async def _a_prefix(self, rel: str) -> BytesSource:
        """The header region (as far as the length field says, within the object) and the object size:
        a HEAD and a ranged GET of the first 8 KiB, one more ranged GET for a longer header."""
        path = self._full(rel)
        info, (first, etag) = await asyncio.gather(self._a_head(path), self._a_get_tagged(path, 0, FIRST_READ))
        if info is None:
            raise FileNotFoundError(f"{self._where(rel)}: no such object")
        size = int(info["size"])
        first = bytes(first)
        try:
            end = min(header_length(first), size)
        except KVFormatError:  # the shared pipeline reports it, from these same bytes
            end = len(first)
        if end > len(first):
            first += await self._a_get(path, len(first), end)
        return BytesSource(first, size, etag=etag)

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
                    if type(e) is not OSError or not _precondition_failed(e):
                        raise
                    return False  # a 412 without the condition name (RGW 16.2 sends neither Condition nor Message)
            else:
                if await self._a_head(path) is not None:
                    return False
                await self._afs._pipe_file(path, data)
            return True
        tmp = f"{path.rsplit('/', 1)[0]}/{temp_name()}"
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

    async def _a_delete(self, rel: str) -> bool:
        path = self._full(rel)
        if await self._a_head(path) is None:
            return False
        try:
            await self._afs._rm_file(path)
        except FileNotFoundError:
            return False
        return True

    async def _a_find(self, base: str) -> dict[str, Any]:
        try:
            found: dict[str, Any] = await self._afs._find(base, detail=True)
            return found
        except FileNotFoundError:
            return {}
