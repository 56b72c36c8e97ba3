"""What the remote store does differently on S3 (s3fs): client settings, HEAD, touch, session close."""

from __future__ import annotations

import time
from typing import Any

S3_PROTOCOLS = ("s3", "s3a")


def s3_options(opts: dict[str, Any], *, timeout_s: float, max_retries: int, max_in_flight: int,
               connect_timeout_s: float, read_timeout_s: float | None) -> dict[str, Any]:
    """``storage_options`` with botocore's own timeouts bounded by the store's deadline and its retries
    off (the store retries within its deadline); whatever the caller gave wins."""
    opts = dict(opts)
    ck = dict(opts.get("config_kwargs") or {})
    ck.setdefault("connect_timeout", connect_timeout_s)
    ck.setdefault("read_timeout", read_timeout_s or max(1.0, timeout_s / (max_retries + 1)))
    ck.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
    ck.setdefault("max_pool_connections", max(10, max_in_flight))
    opts["config_kwargs"] = ck
    opts.setdefault("use_listings_cache", False)
    return opts


def is_s3(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem (whose client calls the helpers below use)."""
    return type(fs).__module__.startswith("s3fs")


async def s3_head(fs: Any, path: str) -> dict[str, Any] | None:
    """One HEAD request: ``{"size", "LastModified", "type"}`` or None if there is no such object."""
    bucket, key, _ = fs.split_path(path)
    try:
        out = await fs._call_s3("head_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return None
    return {"size": out["ContentLength"], "LastModified": out.get("LastModified"), "type": "file"}


async def s3_get(fs: Any, path: str, start: int | None = None, end: int | None = None) -> tuple[bytes, str | None]:
    """One GET of the object (or of bytes ``[start, end)``): its bytes and the ETag the server answered with,
    which names the object those bytes came from (a quarantine moves only that object)."""
    bucket, key, _ = fs.split_path(path)
    rng = {"Range": f"bytes={start}-{end - 1}"} if start is not None and end is not None else {}
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **rng)
    try:
        data = await resp["Body"].read()
    finally:
        resp["Body"].close()
    return bytes(data), resp.get("ETag")


def _precondition_failed(e: BaseException) -> bool:
    code = (getattr(e.__cause__, "response", None) or {}).get("Error", {}).get("Code")
    return code == "PreconditionFailed" or "precondition" in str(e).lower()


async def s3_move_if(fs: Any, src: str, dst: str, etag: str) -> str:
    """Move object ``src`` to ``dst`` only if it is still the object whose ETag is ``etag``: "moved",
    "gone" (no object at ``src``) or "replaced" (another object is there now: left alone).

    The copy is conditional (``CopySourceIfMatch``) and so is the delete of ``src`` (``IfMatch``), so an
    object published under the name since the read is neither copied nor deleted. A server that ignores
    the copy's condition is caught by the copy's own ETag (or, where encryption makes that differ, a
    HEAD of ``src``).
    """
    sb, sk, _ = fs.split_path(src)
    db, dk, _ = fs.split_path(dst)
    try:
        out = await fs._call_s3("copy_object", Bucket=db, Key=dk, CopySource={"Bucket": sb, "Key": sk},
                                CopySourceIfMatch=etag)
    except FileNotFoundError:
        return "gone"
    except OSError as e:
        if _precondition_failed(e):
            return "replaced"
        raise
    copied = (out.get("CopyObjectResult") or {}).get("ETag")
    if copied != etag:
        head = await fs._call_s3("head_object", Bucket=sb, Key=sk) if copied else None
        if head is None or head.get("ETag") != etag:
            await fs._call_s3("delete_object", Bucket=db, Key=dk)  # a copy of another object: not ours to keep
            return "replaced"
    try:
        await fs._call_s3("delete_object", Bucket=sb, Key=sk, IfMatch=etag)
    except FileNotFoundError:
        pass  # someone else removed it meanwhile: the copy kept is the object read
    except OSError as e:
        if not _precondition_failed(e):
            raise
        await fs._call_s3("delete_object", Bucket=db, Key=dk)  # the name holds a newer object: leave it
        return "replaced"
    return "moved"


async def s3_touch(fs: Any, path: str) -> None:
    """Bump LastModified with an in-place copy carrying new metadata (server side, no data moved)."""
    bucket, key, _ = fs.split_path(path)
    await fs._call_s3("copy_object", Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": key},
                      MetadataDirective="REPLACE", Metadata={"kvf-used": str(int(time.time()))})


async def s3_close(fs: Any) -> None:
    """Close the client session (its connection pool) if one was opened."""
    client = getattr(fs, "_s3", None)
    if client is not None:
        fs._s3 = None
        await client.__aexit__(None, None, None)


__all__ = ["S3_PROTOCOLS", "s3_options", "is_s3", "s3_head", "s3_get", "s3_move_if", "s3_touch", "s3_close"]
