"""The one test of what a root names: a local directory or a URL."""

from __future__ import annotations

_SEP = "://"


def split_root(root: str) -> tuple[str, str]:
    """``(scheme, rest)`` of a root URL (``s3://bucket/p`` -> ``("s3", "bucket/p")``), or ``("", path)`` for a
    local root: a plain path, or a ``file://`` URL (its path).

    Every "is this a URL?" question in kvformat is ``split_root(root)[0] != ""``.
    """
    scheme, sep, rest = root.partition(_SEP)
    if not sep:
        return "", root
    if scheme == "file":
        return "", rest
    return scheme, rest


def join_root(scheme: str, rest: str) -> str:
    """The inverse of :func:`split_root` for a URL: ``scheme://rest`` (``rest`` alone for a local root)."""
    return f"{scheme}{_SEP}{rest}" if scheme else rest
