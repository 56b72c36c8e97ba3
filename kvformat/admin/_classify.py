"""What a local path handed to ``inspect`` or ``verify`` is, decided in one place for both commands.

One vLLM fs-tier file, one other file, a kvformat root or namespace, a legacy vLLM fs-tier root, or a root
holding both; and the paths each command refuses, with the messages it refuses them with.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import UsageError
from ..format import block_path_parts
from ..legacy import LegacyFile, find_namespaces, is_legacy_root
from ._scan import find_store_root, namespace_dirs, not_a_root

Verb = Literal["inspect", "verify"]

NO_QUARANTINE_LEGACY = "--quarantine applies to kvformat roots; legacy files have no checksum to quarantine by"


@dataclass(frozen=True)
class PathTarget:
    """A classified local path.

    ``kind`` is ``"legacy_file"`` (``legacy_hit`` holds its namespace and file), ``"file"`` or ``"dir"``.
    For a file checked by ``verify``, ``root``/``rel`` are its store root and path under it and ``in_namespace``
    says whether it is a block file inside a kvformat namespace (placement checked, may be quarantined). For a
    directory, ``root``/``rel`` are the store root and namespace prefix (``""``: the root itself), ``legacy``
    says a legacy tree is to be walked and ``kvformat`` a kvformat one.
    """

    kind: Literal["legacy_file", "file", "dir"]
    path: str
    root: str = ""
    rel: str = ""
    in_namespace: bool = False
    legacy: bool = False
    kvformat: bool = False
    legacy_hit: tuple[Any, LegacyFile] | None = None


def classify_path(path: str, verb: Verb, *, quarantine: bool = False) -> PathTarget:
    """Classify ``path`` for ``verb``; raises :class:`UsageError` for a path the command refuses.

    Parameters
    ----------
    path : a local path (a URL is the store's business, not this function's).
    verb : ``"inspect"`` or ``"verify"``: inspect shows a legacy root as legacy only and any directory under a
        namespace; verify walks both trees of a mixed root and refuses a directory inside a namespace.
    quarantine : verify's ``--quarantine``: refused for a legacy file or a legacy-only root.
    """
    if os.path.isfile(path):
        return _classify_file(path, verb, quarantine)
    if not os.path.isdir(path):
        raise UsageError(f"{path}: no such file or directory")
    if verb == "inspect":
        legacy = is_legacy_root(path)
        if not legacy:
            root, prefix = find_store_root(path)
            if not prefix and not namespace_dirs(root):  # the same test as verify's and gc's: one definition
                raise UsageError(not_a_root(path, "inspect"))
        return PathTarget("dir", path, legacy=legacy, kvformat=not legacy)
    root, prefix = find_store_root(path)
    if "/" in prefix:
        raise UsageError(f"{path}: a directory inside a namespace; give the root, the namespace or a file")
    legacy = not prefix and is_legacy_root(path)
    kv = bool(prefix) or bool(namespace_dirs(root))
    if not legacy and not kv:
        raise UsageError(not_a_root(path, "verify"))
    if legacy and quarantine and not kv:
        raise UsageError(NO_QUARANTINE_LEGACY)
    return PathTarget("dir", path, root=root, rel=prefix, legacy=legacy, kvformat=kv)


def _classify_file(path: str, verb: Verb, quarantine: bool) -> PathTarget:
    hit = legacy_file_namespace(path) if path.endswith(".bin") else None
    if hit is not None:
        if verb == "verify" and quarantine:
            raise UsageError(NO_QUARANTINE_LEGACY)
        return PathTarget("legacy_file", path, legacy_hit=hit)
    if verb == "inspect":
        return PathTarget("file", path)
    root, rel = find_store_root(path)
    in_ns = block_path_parts(rel) is not None and rel.split("/", 1)[0] in namespace_dirs(root)
    return PathTarget("file", path, root=root, rel=rel, in_namespace=in_ns)


def legacy_file_namespace(path: str) -> tuple[Any, LegacyFile] | None:
    """(namespace, file) when ``path`` is a block file of vLLM's fs tier.

    That is ``<root>/<base>_r<n>/<hhh>/<hh>_g<g>/<hash>.bin``.
    """
    p = os.path.abspath(path)
    parts = p.split(os.sep)
    if len(parts) < 5 or not p.endswith(".bin"):
        return None
    root = os.sep.join(parts[:-4]) or os.sep
    m = re.match(r"^([0-9a-f]{2})_g([0-9]+)$", parts[-2])
    h = parts[-1][:-4]
    if not m or h[:3] != parts[-3] or h[3:5] != m.group(1):
        return None
    for ns in find_namespaces(root):
        for rank, rdir in ns.rank_dirs:
            if os.path.basename(rdir) == parts[-4]:
                st = os.stat(p)
                return ns, LegacyFile(p, rank, int(m.group(2)), h, st.st_size, st.st_mtime)
    return None
