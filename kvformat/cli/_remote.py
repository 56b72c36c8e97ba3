"""``inspect`` and ``verify`` on remote roots (``s3://…``, ``memory://…``, any fsspec URL).

Everything goes through the store's batched calls (``list``, ``read_headers_many``, ``read_many_into``,
``quarantine``), so a root of many objects costs a few concurrent rounds, not one request at a time.
Legacy vLLM trees are local only (vLLM's fs tier writes to a file system).
"""

from __future__ import annotations

from typing import Any

from ..format import FILE_SUFFIX, NAMESPACE_FILE, Keyring, block_path_parts
from ..errors import KVFormatError, UnknownKeyError
from ..storage import Store, join_root, open_store, split_root
from ..admin import ProgressSink, placed, scan_store, totals
from ._inspect import NOT_OUR_KEY, file_view
from ._util import UsageError, note_quarantine

# Objects per header round, and payload bytes held in memory per verify round.
_BATCH = 256
_VERIFY_BATCH_BYTES = 256 << 20


def _parent(url: str) -> tuple[str, str] | None:
    """(parent URL, last component) when the URL has a path below its bucket/host."""
    scheme, rest = split_root(url)
    if "/" not in rest.strip("/"):
        return None
    head, last = rest.rstrip("/").rsplit("/", 1)
    return join_root(scheme, head), last


def _open_file(url: str) -> tuple[Store, str]:
    """(store at the kvformat root, relpath) for an object URL: ``<root>/<namespace>/<hh>/<hh>/<hash>.kvf``
    gives the root (so ``--quarantine`` moves it to ``<root>/.quarantine/``), anything else its parent."""
    scheme, rest = split_root(url)
    parts = rest.split("/")
    if len(parts) >= 5 and block_path_parts("/".join(parts[-4:]), strict=False) is not None:
        return open_store(join_root(scheme, "/".join(parts[:-4]))), "/".join(parts[-4:])
    par = _parent(url)
    if par is None:
        raise UsageError(f"{url}: not an object path")
    return open_store(par[0]), par[1]


def _open_dir(url: str) -> tuple[Store, str]:
    """(store at the kvformat root, namespace prefix or "") for a root or a namespace URL."""
    url = url.rstrip("/")
    st = open_store(url)
    par = _parent(url)
    if par is not None and st.exists(NAMESPACE_FILE):  # a namespace itself: its root is one level up
        return open_store(par[0]), par[1]
    return st, ""


def _check_data(store: Store, rel: str, h: Any, keys: Keyring | None) -> Any:
    """A remote file's data checked as a load would; sealed: with ``keys``, else keylessly (spec §12.6)."""
    r = store.read_many_into([(rel, bytearray(h.raw_bytes), None)], verify=True, keys=keys,
                             stored_only=keys is None)[0]
    if isinstance(r, BaseException):
        raise r
    return r


def inspect_url(url: str, *, verify: bool | None, keys: Keyring | None = None) -> dict[str, Any]:
    """The ``inspect`` object of a remote object (file view) or a remote root / namespace (per-namespace table).

    ``verify`` None: data checked for one object, headers only for a root.
    """
    if url.rstrip("/").endswith(FILE_SUFFIX):
        store, rel = _open_file(url)
        try:
            return file_view(f"{store.root}/{rel}", lambda: store.read_header(rel, verify=True),
                             lambda h: _check_data(store, rel, h, keys), verify=verify is not False, keys=keys)
        except FileNotFoundError:
            raise UsageError(f"{store.root}/{rel}: no such object") from None
    store, prefix = _open_dir(url)
    ignored: list[dict[str, str]] = []
    accs, _ = scan_store(store, prefix, verify=bool(verify), ignored=ignored, keys=keys)
    nss = [a.to_dict() for a in accs]
    where = f"{store.root}/{prefix}" if prefix else store.root  # the URL without credentials
    return {"kind": "kvformat_root", "path": where, "verified_data": bool(verify), "namespaces": nss,
            "totals": totals(nss), "ignored": ignored, "unreadable": []}


def verify_url(url: str, *, quarantine: bool = False, progress: ProgressSink | None = None,
               keys: Keyring | None = None) -> dict[str, Any]:
    """A full checksum and placement pass over a remote object, namespace or root: the verify report.

    Only objects at a block path inside a namespace are ever quarantined.
    """
    rep: dict[str, Any] = {"command": "verify", "path": url, "checked": 0, "bad": [], "unreadable": [],
                           "errors": [], "quarantined": [], "quarantine_failed": [], "ignored": [], "exit_code": 0}
    if url.rstrip("/").endswith(FILE_SUFFIX):
        store, rel = _open_file(url)
        nss: set[str] | None = None  # one object: in_ns decides
        parts = block_path_parts(rel)
        in_ns = parts is not None and store.exists(f"{parts[0]}/{NAMESPACE_FILE}")
        errs: list[tuple[str, KVFormatError]] = []
        try:
            h = store.read_header(rel, verify=True, check=placed if in_ns else None)
            _check_data(store, rel, h, keys)
        except KVFormatError as e:
            errs = [(rel, e)]
        except FileNotFoundError:
            raise UsageError(f"{store.root}/{rel}: no such object") from None
        rep["checked"] = 1
        if not in_ns:
            rep["ignored"].append({"path": f"{store.root}/{rel}", "why": "not a block object inside a kvformat "
                                   "namespace: placement not checked, never quarantined"})
    else:
        store, prefix = _open_dir(url)
        if not prefix and not store.namespace_dirs():
            raise UsageError(f"{store.root}: no kvformat namespace (<namespace>/namespace.json) under it: "
                             "nothing to verify")
        accs, errs = scan_store(store, prefix, verify=True, progress=progress, ignored=rep["ignored"], keys=keys)
        rep["checked"] = sum(a.files for a in accs)
        nss = set(store.namespace_dirs())
        in_ns = True
    for rel, bad_err in errs:
        rep["bad"].append({"path": f"{store.root}/{rel}", "reason": bad_err.reason, "message": bad_err.message})
        may_move = in_ns if nss is None else rel.split("/", 1)[0] in nss  # never outside a namespace
        if quarantine and isinstance(bad_err, UnknownKeyError):
            rep["ignored"].append({"path": f"{store.root}/{rel}", "why": NOT_OUR_KEY})
        elif quarantine and not may_move:
            if nss is not None:  # (one object outside a namespace is already listed as such)
                rep["ignored"].append({"path": f"{store.root}/{rel}", "why": "not inside a kvformat namespace (no "
                                       "namespace.json): never quarantined"})
        elif quarantine:
            try:
                q = store.quarantine_read(rel, bad_err)  # only the object that was read (its ETag or bytes)
            except OSError as qe:
                rep["quarantine_failed"].append({"path": f"{store.root}/{rel}", "error": str(qe)})
                continue
            note_quarantine(rep, f"{store.root}/{rel}", q, store.root, "/")
    return rep
