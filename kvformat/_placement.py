"""Where a block file belongs: the path checks a load makes, shared by verify, gc and quarantine.

A load of block ``key`` in layout ``L`` opens exactly ``block_relpath(L, key)`` and refuses a file
whose header names another layout or key. So a file is usable only at the path its own header
gives; anywhere else it is dead weight that a scan must report, not pass. Only files at a block
path (``<namespace>/<hh>/<hh>/<hash>.kvf``) inside a namespace directory (one holding a regular
``namespace.json``) are ever moved or deleted by the tools.
"""

from __future__ import annotations

import re

from ._spec import FILE_SUFFIX, QUARANTINE_DIR, BlockHeader, block_relpath
from .errors import KVFormatError, LayoutMismatchError

__all__ = ["BLOCK_PATH_HELP", "block_path_parts", "placement_error"]

BLOCK_PATH_HELP = "<namespace>/<hh>/<hh>/<hash>.kvf"
_BLOCK_RE = re.compile(r"(?P<ns>[^/.][^/]*)/(?P<a>[0-9a-f]{2})/(?P<b>[0-9a-f]{2})/(?P<h>[0-9a-f]{4,128})"
                       + re.escape(FILE_SUFFIX))


def block_path_parts(relpath: str) -> tuple[str, str] | None:
    """``(namespace, hash)`` when ``relpath`` (relative to a root, '/'-separated) is a block path, else None."""
    m = _BLOCK_RE.fullmatch(relpath)
    if m is None or m["ns"] == QUARANTINE_DIR or m["h"][:2] != m["a"] or m["h"][2:4] != m["b"]:
        return None
    return m["ns"], m["h"]


def placement_error(relpath: str, hdr: BlockHeader) -> KVFormatError | None:
    """The error a load would raise for a valid file stored at ``relpath``: None when it is where its header says.

    A namespace that differs from the layout's is reported on ``namespace`` (another model's or
    layout's file), a name that differs from the key on ``key`` (another block's bytes).
    """
    try:
        want = block_relpath(hdr.layout, hdr.key)
    except KVFormatError as e:  # key group not the layout's group: no load finds it anywhere
        return e
    if want == relpath:
        return None
    ns, _, _ = relpath.partition("/")
    if ns != hdr.layout.namespace():
        return LayoutMismatchError("namespace", ns, hdr.layout.namespace(), path=relpath)
    parts = block_path_parts(relpath)
    return LayoutMismatchError("key", parts[1] if parts else relpath.rsplit("/", 1)[-1], hdr.key.hash, path=relpath)
