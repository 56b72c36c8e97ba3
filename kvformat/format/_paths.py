"""The on-disk path scheme (spec §9) and its inverse: the one place that spells it.

``<root>/<namespace>/namespace.json`` beside ``<root>/<namespace>/<h[:2]>/<h[2:4]>/<hash>.kvf``;
quarantined files under ``<root>/.quarantine/``; the tiers' coordination of a shared root (lease, engines'
journals, the evictor's state, start-up probes) under ``<root>/.kvformat/``. No I/O here.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..errors import SchemaError

if TYPE_CHECKING:
    from ._spec import BlockKey, CanonicalLayout

__all__ = ["FILE_SUFFIX", "NAMESPACE_FILE", "QUARANTINE_DIR", "CONTROL_DIR", "BLOCK_PATH_HELP", "hash_relpath",
           "block_relpath", "block_path_parts"]

FILE_SUFFIX = ".kvf"
NAMESPACE_FILE = "namespace.json"
QUARANTINE_DIR = ".quarantine"
CONTROL_DIR = ".kvformat"  # never holds .kvf files, so scans and gc pass it by
BLOCK_PATH_HELP = "<namespace>/<hh>/<hh>/<hash>.kvf"
_BLOCK_RE = re.compile(r"(?P<ns>[^/]*)/(?P<a>[0-9a-f]{2})/(?P<b>[0-9a-f]{2})/(?P<h>[0-9a-f]+)"
                       + re.escape(FILE_SUFFIX))


def hash_relpath(namespace: str, h: str) -> str:
    """``<namespace>/<h[:2]>/<h[2:4]>/<h>.kvf``: where block hash ``h`` of a namespace lives."""
    return f"{namespace}/{h[:2]}/{h[2:4]}/{h}{FILE_SUFFIX}"


def block_relpath(layout: CanonicalLayout, key: BlockKey) -> str:
    """``<namespace>/<h[:2]>/<h[2:4]>/<hash>.kvf`` (spec §9): the same path at every TP size."""
    if key.group != layout.group:
        raise SchemaError("key.group", f"expected the layout's group {layout.group}, got {key.group}")
    return hash_relpath(layout.namespace(), key.hash)


def block_path_parts(relpath: str, *, strict: bool = True) -> tuple[str, str] | None:
    """``(namespace, hash)`` when ``relpath`` (relative to a root, '/'-separated) is a block path, else None.

    ``strict`` (what a load would open): a namespace that is not hidden, 4 to 128 hex digits whose first
    four name the two directories. Not strict: only the shape ``<any>/<hh>/<hh>/<hex>.kvf``.
    """
    m = _BLOCK_RE.fullmatch(relpath)
    if m is None:
        return None
    if strict and (not m["ns"] or m["ns"].startswith(".") or not 4 <= len(m["h"]) <= 128
                   or m["h"][:2] != m["a"] or m["h"][2:4] != m["b"]):
        return None
    return m["ns"], m["h"]
