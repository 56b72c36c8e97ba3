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


__all__ = ["S3_PROTOCOLS", "s3_options", "is_s3", "s3_head", "s3_touch", "s3_close"]
