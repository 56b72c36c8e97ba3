"""The scan engine of ``kvformat inspect`` and ``verify``: walk a kvformat root, local or remote, and check
every block file exactly as a load would (header, placement, checksums), per namespace. The local walk is
here; remote stores are scanned by :mod:`._scan_store`, the result types are in :mod:`._scan_stats`.

The CLI renders what these functions return; tools and tests can call them directly. Nothing here
prints. ``progress`` arguments take any object with ``add_total(files, bytes)`` and ``update(bytes)``
(:class:`ProgressSink`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..format import (
    BLOCK_PATH_HELP, NAMESPACE_FILE, QUARANTINE_DIR, BlockHeader, CanonicalLayout, FileSource, Keyring,
    block_path_parts, is_regular_file, iter_files, layout_from_namespace_doc, payload_buffer, placement_error,
    read_header_from, read_payload_from, read_small_file,
)
from ._scan_stats import NamespaceStats, ProgressSink, ScanResult, os_error_text, totals
from ._scan_store import scan_store
from ..errors import KVFormatError, UnsafeFileError
from ..legacy import Ignored
from ..storage import StoreEntry, scan_entries

__all__ = ["ProgressSink", "NamespaceStats", "ScanResult", "namespace_dirs", "orphan_namespaces", "not_a_root",
           "scan_root", "scan_store", "quarantine_summary", "find_store_root", "os_error_text", "totals",
           "check_block_file"]


def namespace_dirs(root: str) -> set[str]:
    """Top-level directories of ``root`` holding a regular namespace.json (never through a symlink)."""
    try:
        with os.scandir(root) as it:
            return {d.name for d in it if d.is_dir(follow_symlinks=False)
                    and is_regular_file(os.path.join(d.path, NAMESPACE_FILE))}
    except (FileNotFoundError, NotADirectoryError):
        return set()


def orphan_namespaces(root: str) -> list[str]:
    """Top-level directories of ``root`` that hold block files but no namespace.json: written by a kvformat
    older than 0.1.0's namespace-once ``Store.put_block`` (and ``Stager.save``), which did not write it."""
    out = []
    try:
        with os.scandir(root) as it:
            dirs = sorted(d.name for d in it if d.is_dir(follow_symlinks=False) and not d.name.startswith("."))
    except OSError:
        return []
    for name in dirs:
        if is_regular_file(os.path.join(root, name, NAMESPACE_FILE)):
            continue
        if any(block_path_parts(f"{name}/{rel}") is not None for rel, _ in iter_files(os.path.join(root, name))):
            out.append(name)
    return out


def not_a_root(path: str, verb: str) -> str:
    """THE message of inspect, verify and gc for a directory that is not a kvformat root, saying what is missing
    and, for block files without their namespace.json, how to add it."""
    msg = (f"{path}: not a kvformat root, namespace or legacy vLLM fs-tier root (no <namespace>/namespace.json or "
           f"<model>_<digest>/config.json under it): nothing to {verb}")
    orphans = orphan_namespaces(path) if os.path.isdir(path) else []
    if orphans:
        msg += (f"; {', '.join(orphans[:3])}{' …' if len(orphans) > 3 else ''} hold block files but no "
                "namespace.json (written by an older Store.put_block/Stager.save): any put_block of that layout "
                "with this kvformat, or Store.ensure_namespace(layout), writes it")
    return msg


def check_block_file(path: str, relpath: str | None, *, verify: bool, keys: Keyring | None = None) -> BlockHeader:
    """What a load of the file at ``path`` would find: its header, checked against its place (``relpath``
    inside a root, None: not checked) and, with ``verify``, its payload. A sealed file is authenticated with
    ``keys``; without them its stored bytes are checked as far as no key allows.

    Header and payload come through one descriptor, so a KVFormatError names the one file read
    (``file_id``): ``verify --quarantine`` then moves that file and never one that replaced it since.
    """
    try:
        with FileSource(path) as src:
            hdr = read_header_from(src, True)
            err = placement_error(relpath, hdr) if relpath is not None else None
            if err is not None:
                raise err
            if verify:
                read_payload_from(src, payload_buffer(hdr), verify=True, keys=keys, stored_only=keys is None)
    except KVFormatError as e:
        raise e.with_path(path) from None
    return hdr


def _check_entry(root: str, e: StoreEntry, verify: bool, keys: Keyring | None = None,
                 ) -> tuple[StoreEntry, BlockHeader | None, KVFormatError | OSError | None]:
    """What a load of the file would find: its header (and payload), checked against its path."""
    try:
        return e, check_block_file(os.path.join(root, e.relpath), e.relpath, verify=verify, keys=keys), None
    except KVFormatError as err:
        return e, None, err
    except FileNotFoundError:  # removed since listing (gc, a tier quarantining it)
        return e, None, None
    except OSError as err:  # EACCES, EIO…: reported, and the scan goes on with the other files
        return e, None, err


def scan_root(root: str, prefix: str = "", *, verify: bool = False, jobs: int = 4,
              progress: ProgressSink | None = None, keys: Keyring | None = None) -> ScanResult:
    """Read every block file's header under a kvformat root (and every payload with ``verify``).

    ``root`` is the store root; ``prefix`` a namespace to scan alone. Only files at a block path
    (``<namespace>/<hh>/<hh>/<hash>.kvf``) in a namespace directory are checked, each exactly as a
    load checks it (header, key and namespace against its path; checksums); other ``.kvf`` files
    are listed in ``ignored``, as is a namespace.json that is a symlink or not a regular file.
    ``progress`` is told the number of files once listed, then each file's size once it is checked.
    ``keys``: sealed files are authenticated with them (spec §12); without, they are checked keylessly.

    Header checks are CPU-bound Python (GIL), so the header-only scan runs in one thread; data
    verification reads and hashes in threads (I/O and xxh3 release the GIL).
    """
    root = os.path.abspath(root)
    accs: dict[str, NamespaceStats] = {}
    res = ScanResult([], [], [], [])
    nss = namespace_dirs(root)
    if prefix:
        nss &= {prefix}
    entries = []
    for e in scan_entries(os.path.join(root, prefix) if prefix else root, f"{prefix}/" if prefix else ""):
        parts = block_path_parts(e.relpath)
        if parts is None:  # no load ever opens it: not the tier's file, so not ours to judge
            res.ignored.append(Ignored(os.path.join(root, e.relpath), f"not a block path ({BLOCK_PATH_HELP}): "
                                       "not checked"))
            continue
        # A block path in a directory without a regular namespace.json is still checked (reading is
        # harmless), but it is not inside a namespace, so nothing ever moves or deletes it.
        entries.append(e)
    results: Iterable[tuple[StoreEntry, BlockHeader | None, KVFormatError | OSError | None]]
    if progress is not None:
        progress.add_total(len(entries), sum(e.size for e in entries))
    ex = None
    if verify and jobs > 1 and len(entries) > 16:
        ex = ThreadPoolExecutor(max_workers=jobs)
        results = ex.map(lambda e: _check_entry(root, e, verify, keys), entries)
    else:
        results = (_check_entry(root, e, verify, keys) for e in entries)
    try:
        for e, hdr, err in results:
            ns = e.relpath.split("/", 1)[0]
            acc = accs.get(ns) or accs.setdefault(ns, NamespaceStats(ns))
            if progress is not None:
                progress.update(e.size)
            if hdr is None and err is None:
                continue
            if isinstance(err, OSError):
                acc.unreadable.append({"path": e.relpath, "error": os_error_text(err)})
                res.unreadable.append((e.relpath, err))
                continue
            acc.files += 1
            acc.bytes += e.size
            acc.add_time(e.mtime)
            if err is not None:
                acc.corrupt += 1
                acc.bad.append({"path": e.relpath, "reason": err.reason, "message": err.message})
                res.bad.append((e.relpath, err))
                continue
            assert hdr is not None
            acc.add_header(hdr)
    finally:
        if ex is not None:
            ex.shutdown()
    for ns in nss:  # empty namespaces still show up
        accs.setdefault(ns, NamespaceStats(ns))
    res.namespaces = nss
    for acc in accs.values():
        if acc.layout is None:
            acc.layout = _layout_from_doc_file(root, acc.namespace, res.ignored)
    res.accs = [accs[k] for k in sorted(accs)]
    return res


def quarantine_summary(root: str) -> dict[str, Any]:
    """Files under ``<root>/.quarantine`` (never through a symlink): count, bytes, count per reason."""
    out: dict[str, Any] = {"path": os.path.join(root, QUARANTINE_DIR), "files": 0, "bytes": 0, "reasons": {}}
    qdir = os.path.join(root, QUARANTINE_DIR)
    if not os.path.isdir(qdir) or os.path.islink(qdir):
        return out
    for _rel, e in iter_files(qdir, ""):
        try:
            size = e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
        reason = e.name.rsplit(".", 1)[-1] if "." in e.name else "-"
        out["files"] += 1
        out["bytes"] += size
        out["reasons"][reason] = out["reasons"].get(reason, 0) + 1
    return out


def _layout_from_doc_file(root: str, ns: str, ignored: list[Ignored] | None = None) -> CanonicalLayout | None:
    path = os.path.join(root, ns, NAMESPACE_FILE)
    try:
        raw = read_small_file(path)
    except UnsafeFileError as e:
        if ignored is not None:
            ignored.append(Ignored(path, f"namespace.json is {e.strerror}: not read"))
        return None
    except OSError:
        return None
    return layout_from_namespace_doc(raw)


def find_store_root(path: str) -> tuple[str, str]:
    """(store root, relpath prefix) for a kvformat root, a namespace directory, or a file inside one."""
    p = os.path.abspath(path)
    d = p if os.path.isdir(p) else os.path.dirname(p)
    probe = d
    while True:
        if is_regular_file(os.path.join(probe, NAMESPACE_FILE)):
            root = os.path.dirname(probe)
            return root, os.path.relpath(p, root).replace(os.sep, "/")
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if os.path.isdir(p):
        return p, ""
    return os.path.dirname(p), os.path.basename(p)


