"""Where a block file belongs: the path checks a load makes, shared by verify, gc and quarantine.

A load of block ``key`` in layout ``L`` opens exactly ``block_relpath(L, key)`` and refuses a file
whose header names another layout or key. So a file is usable only at the path its own header
gives; anywhere else it is dead weight that a scan must report, not pass. Only files at a block
path (``<namespace>/<hh>/<hh>/<hash>.kvf``) inside a namespace directory (one holding a regular
``namespace.json``) are ever moved or deleted by the tools.
"""

from __future__ import annotations

from ._paths import block_path_parts, block_relpath
from ._spec import BlockHeader
from ..errors import KVFormatError, LayoutMismatchError

__all__ = ["placement_error"]


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
