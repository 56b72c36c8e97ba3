"""``kvformat verify``: check every file as a load would, on kvformat and legacy trees alike.

The report is a plain dict (the ``--json`` document, schema in ``_schema.VERIFY_SCHEMA``). Exit code:
2 when the pass was incomplete (an unreadable file, a malformed config.json, a legacy layout that
needs ``--page-bytes``, a quarantine move that failed), else 1 when a bad file was found, else 0.
"""

from __future__ import annotations

import os
from typing import Any

from ..format import Keyring
from ..errors import KVFormatError, UnknownKeyError
from ..storage import LocalStore, split_root
from ..admin import PathTarget, ProgressSink, check_block_file, classify_path, os_error_text, scan_root
from ._inspect import NOT_OUR_KEY, inspect_legacy, inspect_legacy_file
from ._util import note_quarantine


def _report(path: str) -> dict[str, Any]:
    return {"command": "verify", "path": path, "checked": 0, "bad": [], "unreadable": [], "errors": [],
            "quarantined": [], "quarantine_failed": [], "ignored": [], "exit_code": 0}


def verify_path(path: str, *, quarantine: bool = False, jobs: int = 2, page_bytes: int | None = None,
                progress: ProgressSink | None = None, keys: Keyring | None = None) -> dict[str, Any]:
    """Verify a file, a namespace, a kvformat root, a legacy root (or a root holding both) or a URL.

    Sealed files (spec §12) are authenticated with ``keys``; without keys, checked as far as no key allows.
    A sealed file under a key not in ``keys`` is bad (it cannot be checked) but never quarantined.
    """
    if split_root(path)[0]:
        from ._remote import verify_url

        rep = verify_url(path, quarantine=quarantine, progress=progress, keys=keys)
        return _finish(rep)
    rep = _report(path)
    t = classify_path(path, "verify", quarantine=quarantine)
    targets: list[tuple[str, str, KVFormatError]] = []  # (store root, relpath, error) of files that may be quarantined
    if t.kind == "legacy_file":
        return _finish(_verify_legacy_file(rep, t, page_bytes))
    if t.kind == "file":
        if not _verify_file(rep, t, quarantine, keys, targets):
            return _finish(rep)
    else:
        if t.kvformat:
            _verify_kvformat(rep, t, quarantine, jobs, progress, keys, targets)
        if t.legacy:
            _verify_legacy_tree(rep, path, quarantine, page_bytes, progress)
    if quarantine:
        _quarantine(rep, targets)
    return _finish(rep)


def _verify_legacy_file(rep: dict[str, Any], t: PathTarget, page_bytes: int | None) -> dict[str, Any]:
    assert t.legacy_hit is not None
    try:
        d = inspect_legacy_file(*t.legacy_hit, verify=True, page_bytes=page_bytes)
    except OSError as e:
        rep["unreadable"].append({"path": t.path, "error": os_error_text(e)})
        return rep
    rep["checked"] = 1
    if d["error"]:
        if d["row"] is None:  # no layout: nothing was checked
            rep["errors"].append({"path": t.path, "message": d["error"]["message"]})
        else:
            rep["bad"].append({"path": t.path, "reason": d["error"]["reason"], "message": d["error"]["message"]})
    return rep


def _verify_file(rep: dict[str, Any], t: PathTarget, quarantine: bool, keys: Keyring | None,
                 targets: list[tuple[str, str, KVFormatError]]) -> bool:
    """Check one file into ``rep``; False when it could not be read (the report is then final)."""
    path, in_ns = t.path, t.in_namespace
    rep["checked"] = 1
    err: KVFormatError | None = None
    try:
        check_block_file(path, t.rel if in_ns else None, verify=True, keys=keys)
    except KVFormatError as e:
        err = e
    except OSError as e:
        rep["unreadable"].append({"path": path, "error": os_error_text(e)})
        return False
    if err is not None:
        rep["bad"].append({"path": path, "reason": err.reason, "message": err.message})
        if in_ns and isinstance(err, UnknownKeyError):
            if quarantine:
                rep["ignored"].append({"path": path, "why": NOT_OUR_KEY})
        elif in_ns:
            targets.append((t.root, t.rel, err))
    if not in_ns:
        rep["ignored"].append({"path": path, "why": "not a block file inside a kvformat namespace: placement "
                               "not checked, never quarantined"})
    return True


def _verify_kvformat(rep: dict[str, Any], t: PathTarget, quarantine: bool, jobs: int,
                     progress: ProgressSink | None, keys: Keyring | None,
                     targets: list[tuple[str, str, KVFormatError]]) -> None:
    root = t.root
    res = scan_root(root, t.rel, verify=True, jobs=jobs, progress=progress, keys=keys)
    rep["checked"] += sum(x.files for x in res.accs)
    rep["ignored"] += [{"path": i.path, "why": i.why} for i in res.ignored]
    for rel, err in res.bad:
        rep["bad"].append({"path": os.path.join(root, rel), "reason": err.reason, "message": err.message})
        if isinstance(err, UnknownKeyError):
            if quarantine:
                rep["ignored"].append({"path": os.path.join(root, rel), "why": NOT_OUR_KEY})
        elif rel.split("/", 1)[0] in res.namespaces:
            targets.append((root, rel, err))
        elif quarantine:
            rep["ignored"].append({"path": os.path.join(root, rel), "why": "not inside a kvformat namespace "
                                   "(no regular namespace.json): never quarantined"})
    rep["unreadable"] += [{"path": os.path.join(root, r), "error": os_error_text(e)} for r, e in res.unreadable]


def _verify_legacy_tree(rep: dict[str, Any], path: str, quarantine: bool, page_bytes: int | None,
                        progress: ProgressSink | None) -> None:
    d = inspect_legacy(path, verify=True, page_bytes=page_bytes, progress=progress)
    rep["checked"] += d["totals"]["files"]
    rep["ignored"] += d["ignored"]
    rep["errors"] += d["errors"]
    rep["unreadable"] += d["unreadable"]
    for n in d["namespaces"]:
        rep["bad"] += n["bad_files"]
        if n["legacy"]["error"]:
            rep["errors"].append({"path": os.path.join(path, n["namespace"]), "message": n["legacy"]["error"]})
    if quarantine and any(n["bad_files"] for n in d["namespaces"]):
        rep["ignored"].append({"path": path, "why": "legacy files are never quarantined (no checksum to "
                               "quarantine by)"})


def _quarantine(rep: dict[str, Any], targets: list[tuple[str, str, KVFormatError]]) -> None:
    for root, rel, bad in targets:
        try:
            q = LocalStore(root).quarantine_read(rel, bad)  # only the file that was read (G-5.5)
        except OSError as e:  # a read-only tree: keep the report, say what was not moved
            rep["quarantine_failed"].append({"path": os.path.join(root, rel), "error": os_error_text(e)})
            continue
        note_quarantine(rep, os.path.join(root, rel), q, root, os.sep)


def _finish(rep: dict[str, Any]) -> dict[str, Any]:
    if rep["unreadable"] or rep["errors"] or rep["quarantine_failed"]:
        rep["exit_code"] = 2
    else:
        rep["exit_code"] = 1 if rep["bad"] else 0
    return rep
