"""The scan engine of ``kvformat inspect`` and ``verify``: walk a kvformat root, local or remote, and check
every block file exactly as a load would (header, placement, checksums), per namespace.

The CLI renders what these functions return; tools and tests can call them directly. Nothing here
prints. ``progress`` arguments take any object with ``add_total(files, bytes)`` and ``update(bytes)``
(:class:`ProgressSink`).
"""

from __future__ import annotations

import errno
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from ._files import UnsafeFileError, is_regular_file, iter_files, read_small_file
from ._io import read_header, read_into
from ._paths import BLOCK_PATH_HELP, NAMESPACE_FILE, QUARANTINE_DIR, block_path_parts
from ._placement import placement_error
from ._spec import BlockHeader, CanonicalLayout
from .errors import KVFormatError
from .legacy import Ignored
from .storage import Store, StoreEntry
from .storage._local import scan_entries

__all__ = ["ProgressSink", "NamespaceStats", "ScanResult", "namespace_dirs", "scan_root", "scan_store",
           "quarantine_summary", "find_store_root", "os_error_text", "totals"]

# Objects per header round, and payload bytes held in memory per verify round (remote stores).
_BATCH = 256
_VERIFY_BATCH_BYTES = 256 << 20


class ProgressSink(Protocol):
    """What a long scan reports to: first how much there is (possibly in parts), then each file done."""

    def add_total(self, files: int, nbytes: int) -> None: ...

    def update(self, n_bytes: int, n: int = 1) -> None: ...


@dataclass
class NamespaceStats:
    """Per-namespace totals of a scan; ``to_dict`` is one entry of inspect's ``namespaces``."""

    namespace: str
    layout: CanonicalLayout | None = None
    files: int = 0
    bytes: int = 0
    raw: int = 0
    data: int = 0
    tps: Counter[int] = field(default_factory=Counter)
    corrupt: int = 0
    oldest: float | None = None
    newest: float | None = None
    bad: list[dict[str, str]] = field(default_factory=list)
    unreadable: list[dict[str, str]] = field(default_factory=list)

    def add_time(self, t: float) -> None:
        self.oldest = t if self.oldest is None else min(self.oldest, t)
        self.newest = t if self.newest is None else max(self.newest, t)

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "namespace": self.namespace, "model": lay.model if lay else None, "kv_dtype": lay.kv_dtype if lay else None,
            "tokens_per_block": lay.tokens_per_block if lay else None,
            "blocks_per_chunk": lay.blocks_per_chunk if lay else None,
            "layers": len(lay.layers) if lay else None, "files": self.files, "bytes": self.bytes,
            "tp_sizes": sorted(self.tps), "compression_ratio": round(self.raw / self.data, 4) if self.data else None,
            "corrupt": self.corrupt, "oldest": self.oldest, "newest": self.newest, "bad_files": self.bad,
            "unreadable": self.unreadable,
        }


@dataclass
class ScanResult:
    """A scan of a kvformat root: per-namespace totals, bad files, unreadable files, skipped paths."""

    accs: list[NamespaceStats]
    bad: list[tuple[str, KVFormatError]]  # (relpath from the store root, error): the file is wrong
    unreadable: list[tuple[str, OSError]]  # (relpath, error): the file could not be read, so not checked
    ignored: list[Ignored]
    namespaces: set[str] = field(default_factory=set)  # directories holding a regular namespace.json


def namespace_dirs(root: str) -> set[str]:
    """Top-level directories of ``root`` holding a regular namespace.json (never through a symlink)."""
    try:
        with os.scandir(root) as it:
            return {d.name for d in it if d.is_dir(follow_symlinks=False)
                    and is_regular_file(os.path.join(d.path, NAMESPACE_FILE))}
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _check_entry(root: str, e: StoreEntry, verify: bool
                 ) -> tuple[StoreEntry, BlockHeader | None, KVFormatError | OSError | None]:
    """What a load of the file would find: its header (and payload), checked against its path."""
    path = os.path.join(root, e.relpath)
    try:
        hdr = read_header(path, verify=True)
        err = placement_error(e.relpath, hdr)
        if err is not None:
            return e, None, err.with_path(path)
        if verify:
            read_into(path, bytearray(hdr.raw_bytes), verify=True)
        return e, hdr, None
    except KVFormatError as err:
        return e, None, err
    except FileNotFoundError:  # removed since listing (gc, a tier quarantining it)
        return e, None, None
    except OSError as err:  # EACCES, EIO…: reported, and the scan goes on with the other files
        return e, None, err


def scan_root(root: str, prefix: str = "", *, verify: bool = False, jobs: int = 4,
              progress: ProgressSink | None = None) -> ScanResult:
    """Read every block file's header under a kvformat root (and every payload with ``verify``).

    ``root`` is the store root; ``prefix`` a namespace to scan alone. Only files at a block path
    (``<namespace>/<hh>/<hh>/<hash>.kvf``) in a namespace directory are checked, each exactly as a
    load checks it (header, key and namespace against its path; checksums); other ``.kvf`` files
    are listed in ``ignored``, as is a namespace.json that is a symlink or not a regular file.
    ``progress`` is told the number of files once listed, then each file's size once it is checked.

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
        results = ex.map(lambda e: _check_entry(root, e, verify), entries)
    else:
        results = (_check_entry(root, e, verify) for e in entries)
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
            if acc.layout is None:
                acc.layout = hdr.layout
            acc.tps[hdr.provenance.tp] += 1
            acc.raw += hdr.raw_bytes
            acc.data += hdr.data_bytes
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


def os_error_text(e: OSError) -> str:
    """An OSError without its file name (the report already names the file)."""
    name = errno.errorcode.get(e.errno or 0, type(e).__name__)
    return f"{name}: {e.strerror or e}"


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
        doc = json.loads(read_small_file(path))
    except UnsafeFileError as e:
        if ignored is not None:
            ignored.append(Ignored(path, f"namespace.json is {e.strerror}: not read"))
        return None
    except (OSError, ValueError):
        return None
    try:
        ident = doc["identity"]
        return CanonicalLayout.from_dict({**ident, "layers": [x[:3] for x in ident["layers"]]})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def totals(nss: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``totals`` object of inspect: namespaces, files, bytes, corrupt."""
    return {"namespaces": len(nss), "files": sum(n["files"] for n in nss), "bytes": sum(n["bytes"] for n in nss),
            "corrupt": sum(n["corrupt"] for n in nss)}



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



def _layout_from_doc_bytes(raw: bytes) -> CanonicalLayout | None:
    try:
        ident = json.loads(raw)["identity"]
        return CanonicalLayout.from_dict({**ident, "layers": [x[:3] for x in ident["layers"]]})
    except (ValueError, KeyError, TypeError):
        return None


def _chunks(entries: Sequence[StoreEntry], n: int) -> Iterator[Sequence[StoreEntry]]:
    for i in range(0, len(entries), n):
        yield entries[i:i + n]


def _headers(store: Store, rels: list[str]) -> list[BlockHeader | BaseException]:
    return store.read_headers_many(rels, verify=True)  # batched and concurrent on remote stores


def _payloads(store: Store, items: list[tuple[str, Any, None]]) -> list[BlockHeader | BaseException]:
    many = getattr(store, "read_many_into", None)
    if many is not None:
        got: list[BlockHeader | BaseException] = many(items, verify=True)
        return got
    out: list[BlockHeader | BaseException] = []
    for r, buf, _ in items:
        try:
            out.append(store.read_into(r, buf, verify=True))
        except (KVFormatError, OSError) as e:
            out.append(e)
    return out


def scan_store(store: Store, prefix: str = "", *, verify: bool = False,
               progress: ProgressSink | None = None, ignored: list[dict[str, str]] | None = None,
               ) -> tuple[list[NamespaceStats], list[tuple[str, KVFormatError]]]:
    """Every block file's header under ``prefix`` (every payload too with ``verify``), per namespace.

    As for local roots, only objects at a block path inside a namespace (one holding namespace.json)
    are checked, each exactly as a load checks it (key and namespace against its path); others are
    appended to ``ignored``.

    Objects removed since the listing are skipped; a transport failure (server down, timeout) raises
    its OSError (exit 2), since a partial pass must not read as "all good".
    """
    accs: dict[str, NamespaceStats] = {}
    bad: list[tuple[str, KVFormatError]] = []
    entries = []
    for e in store.list(prefix):
        if block_path_parts(e.relpath) is None:  # no load ever opens it
            if ignored is not None:
                ignored.append({"path": f"{store.root}/{e.relpath}",
                                "why": f"not a block path ({BLOCK_PATH_HELP}): not checked"})
            continue
        entries.append(e)  # checked even outside a namespace; only verify_url decides what may move
    if progress is not None:
        progress.add_total(len(entries), sum(e.size for e in entries))

    def ok(e: StoreEntry, h: BlockHeader) -> None:
        acc = _acc(e)
        if acc.layout is None:
            acc.layout = h.layout
        acc.tps[h.provenance.tp] += 1
        acc.raw += h.raw_bytes
        acc.data += h.data_bytes

    def fail(e: StoreEntry, err: KVFormatError) -> None:
        acc = _acc(e)
        acc.corrupt += 1
        acc.bad.append({"path": e.relpath, "reason": err.reason, "message": err.message})
        bad.append((e.relpath, err))

    def _acc(e: StoreEntry) -> NamespaceStats:
        ns = e.relpath.split("/", 1)[0]
        acc = accs.get(ns) or accs.setdefault(ns, NamespaceStats(ns))
        acc.files += 1
        acc.bytes += e.size
        acc.add_time(e.mtime)
        return acc

    def sort(e: StoreEntry, r: Any) -> bool:
        """True when ``r`` is a header of a file in its place; records a bad file; raises a transport error."""
        if isinstance(r, FileNotFoundError):
            return False  # removed since the listing (gc, a tier quarantining it)
        if isinstance(r, KVFormatError):
            fail(e, r)
            return False
        if isinstance(r, BaseException):
            raise r
        err = placement_error(e.relpath, r)
        if err is not None:
            fail(e, err)
            return False
        if progress is not None and not verify:
            progress.update(e.size)
        return True

    for chunk in _chunks(entries, _BATCH):
        # sort() keeps only entries whose header read gave a BlockHeader
        good: list[tuple[Any, BlockHeader]] = [
            (e, h) for e, h in zip(chunk, _headers(store, [e.relpath for e in chunk]))
            if sort(e, h) and isinstance(h, BlockHeader)]
        if not verify:
            for e, h in good:
                ok(e, h)
            continue
        while good:  # payload rounds bounded in bytes held at once
            take, held = 0, 0
            while take < len(good) and (take == 0 or held + good[take][1].raw_bytes <= _VERIFY_BATCH_BYTES):
                held += good[take][1].raw_bytes
                take += 1
            part, good = good[:take], good[take:]
            res = _payloads(store, [(e.relpath, bytearray(h.raw_bytes), None) for e, h in part])
            for (e, _), r in zip(part, res):
                if sort(e, r) and isinstance(r, BlockHeader):
                    ok(e, r)
                if progress is not None:
                    progress.update(e.size)
    if prefix:
        accs.setdefault(prefix, NamespaceStats(prefix))
    else:  # empty namespaces still show up
        for ns in getattr(store, "_namespace_dirs", lambda: [])():
            accs.setdefault(ns, NamespaceStats(ns))
    for acc in accs.values():
        if acc.layout is None:
            try:
                acc.layout = _layout_from_doc_bytes(store.read_bytes(f"{acc.namespace}/{NAMESPACE_FILE}"))
            except (FileNotFoundError, ValueError):
                pass
    return [accs[k] for k in sorted(accs)], bad


