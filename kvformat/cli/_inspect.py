"""``kvformat inspect`` and ``kvformat verify``: what is on disk, and is it intact."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Callable

from ..format import BlockHeader, Keyring, read_header, read_row, verify_file
from ..errors import KVFormatError, LegacyLayoutError, ReplicaMismatchError, TagMismatchError, UnknownKeyError
from ..legacy import (
    Ignored, LegacyFile, LegacyNamespace, extract_payload, find_namespaces, infer_row, iter_legacy_files,
)
from ..admin import ProgressSink, find_store_root, os_error_text, quarantine_summary, scan_root, totals
from ._util import UsageError, human, iso, shown, table


NOT_OUR_KEY = "sealed under a key this run was not given (another deployment's, or a key left out): never quarantined"


# -- one file ------------------------------------------------------------------------------------------
def inspect_file(path: str, *, verify: bool = True, keys: Keyring | None = None) -> dict[str, Any]:
    """Header, layout table and checksum status of one kvformat file (the ``--json`` "file" object)."""
    return file_view(path, lambda: read_header(path, verify=True), lambda hdr: verify_file(path, keys=keys),
                     verify=verify, keys=keys)


def file_view(path: str, read_hdr: Callable[[], BlockHeader], read_data: Callable[[BlockHeader], Any], *,
              verify: bool = True, keys: Keyring | None = None) -> dict[str, Any]:
    """The "file" object of ``path`` from a header reader and a payload reader (local file or remote object).

    ``seal`` (spec §12) is None for a clear file, else its level, key id and ``tag``: ``ok``, ``bad``,
    ``unknown_key`` (no key given opens it), ``unchecked`` (no key given, or data not read).
    """
    out: dict[str, Any] = {"kind": "file", "path": path, "header": None, "layers": [],
                           "checksum": {"header": "unknown", "data": "skipped"}, "seal": None, "error": None}
    try:
        hdr = read_hdr()
    except KVFormatError as e:
        out["checksum"]["header"] = "bad"
        out["error"] = {"reason": e.reason, "message": e.message}
        return out
    out["checksum"]["header"] = "ok"
    out["header"] = hdr.to_dict()
    if hdr.seal is not None:
        held = keys is not None and keys.get(hdr.seal.key_id) is not None
        out["seal"] = {"level": hdr.layout.seal, "key_id": hdr.seal.key_id,
                       "tag": "unchecked" if keys is None else ("unchecked" if held else "unknown_key")}
    out["header"]["ratio"] = round(hdr.ratio, 4)
    bpc = hdr.layout.blocks_per_chunk
    for l, off, n in zip(hdr.layout.layers, hdr.layout.layer_offsets, hdr.layout.chunk_bytes_per_layer):
        out["layers"].append({"name": l.name, "dtype": l.dtype, "shape": [bpc, *l.shape], "offset": off, "bytes": n})
    if verify:
        try:
            read_data(hdr)
            out["checksum"]["data"] = "ok"
            if out["seal"] is not None and keys is not None:
                out["seal"]["tag"] = "ok"
        except UnknownKeyError as e:  # the stored bytes were not read: only the key was missing
            out["checksum"]["data"] = "skipped"
            out["seal"]["tag"] = "unknown_key"
            out["error"] = {"reason": e.reason, "message": e.message}
        except KVFormatError as e:
            out["checksum"]["data"] = "ok" if isinstance(e, TagMismatchError) else "bad"
            if isinstance(e, TagMismatchError):
                out["seal"]["tag"] = "bad"
            out["error"] = {"reason": e.reason, "message": e.message}
    return out


def render_file(d: dict[str, Any]) -> str:
    lines = [f"file        {shown(d['path'])}"]
    h = d["header"]
    if h is None:
        lines.append(f"checksum    header BAD: {d['error']['reason']}: {shown(d['error']['message'])}")
        return "\n".join(lines)
    lay, prov = h["layout"], h["provenance"]
    lines += [
        f"format      kvformat {h['version']}",
        f"namespace   {h['namespace']}",
        f"model       {shown(lay['model'])}" + (f" @ {lay['revision']}" if lay["revision"] else ""),
        f"kv dtype    {lay['kv_dtype']} ({lay['family']})",
        f"blocks      {lay['blocks_per_chunk']} per chunk x {lay['tokens_per_block']} tokens "
        f"(tokens per hash {lay['tokens_per_hash']}), group {lay['group']}",
        f"key         {h['key']['hash']}:{h['key']['group']}",
        f"provenance  tp={prov['tp']} pp={prov['pp']} dcp={prov['dcp']} pcp={prov['pcp']} row={prov['row']} "
        f"writer={prov['writer'] or '-'!s} created={iso(prov['created']) if prov['created'] else '-'}",
        f"codec       {h['codec']}" + (f" (level {h['level']})" if h["level"] is not None else "")
        + f", ratio {h['ratio']:.2f}: {h['raw_bytes']} payload bytes stored in {h['data_bytes']}",
        f"file bytes  {h['file_bytes']} (header {h['data_offset']}, data {h['data_bytes']})",
    ]
    c = d["checksum"]
    data = {"ok": "data ok", "bad": "data BAD", "skipped": "data not checked (--no-verify)"}[c["data"]]
    sealed = d.get("seal")
    if sealed is not None and sealed["tag"] == "unknown_key":
        data = "data not checked (no key given opens it)"
    lines.append(f"checksum    header ok, {data} (xxh3 {h['checksums']['data_xxh3']})")
    if sealed is not None:
        tag = {"ok": "tag ok", "bad": "tag BAD (written without the key, or altered)",
               "unknown_key": "tag not checked: no key given has this id",
               "unchecked": "tag not checked (give --key to check it)"}[sealed["tag"]]
        lines.append(f"sealed      {sealed['level']}, key id {sealed['key_id']}: {tag}")
    if d["error"]:
        lines.append(f"error       {d['error']['reason']}: {shown(d['error']['message'])}")
    lines.append("")
    rows = [(i, l["name"], l["dtype"], "x".join(map(str, l["shape"])), l["offset"], l["bytes"])
            for i, l in enumerate(d["layers"])]
    lines.append(table(["#", "layer", "dtype", "shape", "offset", "bytes"], rows, right=(0, 4, 5)))
    return "\n".join(lines)


# -- a kvformat root -----------------------------------------------------------------------------------
def inspect_root(root: str, *, verify: bool = False, jobs: int = 4,
                 progress: ProgressSink | None = None, keys: Keyring | None = None) -> dict[str, Any]:
    """The ``inspect`` object of a kvformat root or one namespace directory (per-namespace table)."""
    store_root, prefix = find_store_root(root)
    if prefix and "/" in prefix:
        raise UsageError(f"{root}: a directory inside a namespace; give the root, the namespace or a file")
    res = scan_root(store_root, prefix, verify=verify, jobs=jobs, progress=progress, keys=keys)
    nss = [a.to_dict() for a in res.accs]
    return {"kind": "kvformat_root", "path": root, "verified_data": verify, "namespaces": nss,
            "totals": totals(nss), "ignored": [{"path": i.path, "why": i.why} for i in res.ignored],
            "unreadable": [{"path": os.path.join(store_root, r), "error": os_error_text(e)}
                           for r, e in res.unreadable],
            "quarantine": quarantine_summary(store_root)}


# -- a legacy vLLM root --------------------------------------------------------------------------------
def inspect_legacy(root: str, *, verify: bool = False, page_bytes: int | None = None,
                   progress: ProgressSink | None = None) -> dict[str, Any]:
    """Per legacy namespace and group: what compacting it would give. ``verify`` checks replicas.

    A namespace whose config.json is malformed is listed under ``errors`` and skipped; a file that
    cannot be read is listed under its namespace's ``unreadable``; the other files are still checked.
    """
    nss = []
    ignored: list[Ignored] = []
    cfg_errors: list[LegacyLayoutError] = []
    for ns in find_namespaces(root, ignored=ignored, errors=cfg_errors):
        files = list(iter_legacy_files(ns, ignored, root))
        groups: dict[int, list[LegacyFile]] = {}
        for f in files:
            groups.setdefault(f.group, []).append(f)
        for g in sorted(groups) or [0]:
            gf = groups.get(g, [])
            d: dict[str, Any] = {
                "namespace": ns.base, "group": g, "model": ns.model, "kv_dtype": ns.dtype,
                "tokens_per_block": _tpb(ns, g), "blocks_per_chunk": ns.blocks_per_file, "layers": _nlayers(ns, g),
                "files": len(gf), "bytes": sum(f.size for f in gf), "tp_sizes": [ns.parallel()["tp"]],
                "compression_ratio": None, "corrupt": 0,
                "oldest": min((f.mtime for f in gf), default=None), "newest": max((f.mtime for f in gf), default=None),
                "bad_files": [], "unreadable": [],
                "legacy": {"row": None, "slots": None, "page_bytes": None, "row_bytes": None,
                                            "padding": None, "digest_ok": ns.digest_ok, "compacted_bytes": None,
                                            "compacted_namespace": None, "error": None},
            }
            if gf:
                size = Counter(f.size for f in gf).most_common(1)[0][0]
                try:
                    row = infer_row(ns, g, size, page_bytes=page_bytes)
                except LegacyLayoutError as e:
                    d["legacy"]["error"] = e.message
                    nss.append(d)
                    continue
                ok = [f for f in gf if f.size == row.row_bytes]
                for f in gf:
                    if f.size != row.row_bytes:
                        d["corrupt"] += 1
                        d["bad_files"].append({"path": f.path, "reason": "SizeFitsNoLayout",
                                               "message": f"{f.size} bytes, rows are {row.row_bytes}"})
                if verify:
                    buf = memoryview(bytearray(row.row_bytes))
                    if progress is not None:
                        progress.add_total(len(ok), sum(f.size for f in ok))
                    for f in ok:
                        try:
                            n = read_row(f.path, buf)
                            if n != row.row_bytes:
                                raise LegacyLayoutError(f"short read: {n} of {row.row_bytes} bytes")
                            extract_payload(row, buf, path=f.path)
                        except (ReplicaMismatchError, LegacyLayoutError) as e:
                            d["corrupt"] += 1
                            d["bad_files"].append({"path": f.path, "reason": e.reason, "message": e.message})
                        except FileNotFoundError:  # removed since the listing
                            pass
                        except OSError as e:  # reported; the other files are still checked
                            d["unreadable"].append({"path": f.path, "error": os_error_text(e)})
                        if progress is not None:
                            progress.update(f.size)
                from ..legacy import output_header_bytes

                per = output_header_bytes(row, ok[0]) + row.layout.payload_bytes if ok else 0
                d["tp_sizes"] = [row.copies] if row.kind == "per_worker" else [ns.parallel()["tp"]]
                d["legacy"].update({"row": row.kind, "slots": row.copies, "page_bytes": row.page_bytes,
                                    "row_bytes": row.row_bytes, "padding": row.padding,
                                    "compacted_bytes": per * len(ok), "compacted_namespace": row.layout.namespace()})
            nss.append(d)
    return {"kind": "legacy_root", "path": root, "verified_data": verify, "namespaces": nss, "totals": totals(nss),
            "ignored": [{"path": i.path, "why": i.why} for i in ignored],
            "errors": [{"path": e.path or root, "message": e.message} for e in cfg_errors],
            "unreadable": [u for n in nss for u in n["unreadable"]]}


def _tpb(ns: LegacyNamespace, g: int) -> int | None:
    gs = ns.groups()  # validated: tokens_per_block is a positive int
    return int(gs[g]["tokens_per_block"]) if g < len(gs) else None


def _nlayers(ns: LegacyNamespace, g: int) -> int | None:
    gs = ns.groups()
    return len(gs[g].get("layer_names") or []) if g < len(gs) else None


def render_root(d: dict[str, Any]) -> str:
    legacy = d["kind"] == "legacy_root"
    what = "legacy vLLM fs-tier root" if legacy else "kvformat root"
    checked = ("headers + replicas" if d["verified_data"] else "headers/sizes") if legacy else \
        ("headers + data" if d["verified_data"] else "headers")
    lines = [f"{what}: {shown(d['path'])}  (checked: {checked})", ""]
    rows = []
    for n in d["namespaces"]:
        ratio = f"{n['compression_ratio']:.2f}" if n["compression_ratio"] else "-"
        name = shown(f"{n['namespace']}/g{n['group']}" if legacy else n["namespace"])
        rows.append((name, shown(n["model"] or "-"), n["kv_dtype"] or "-", n["tokens_per_block"] or "-", n["files"],
                     human(n["bytes"]), ",".join(map(str, n["tp_sizes"])) or "-", ratio, n["corrupt"],
                     iso(n["oldest"]), iso(n["newest"])))
    lines.append(table(["namespace", "model", "dtype", "tok/blk", "files", "bytes", "tp", "ratio", "corrupt",
                        "oldest", "newest"], rows, right=(3, 4, 5, 7, 8)))
    t = d["totals"]
    lines.append("")
    lines.append(f"total: {t['namespaces']} namespaces, {t['files']} files, {human(t['bytes'])}, "
                 f"{t['corrupt']} corrupt")
    for n in d["namespaces"]:  # spec §12: how a namespace is sealed and under which key ids (no key needed)
        if n.get("seal"):
            ids = ", ".join(f"{k} ({c} files)" for k, c in n["key_ids"].items()) or "no files yet"
            lines.append(f"sealed: {shown(n['namespace'])}: {n['seal']}, key ids {ids}")
    if legacy:
        lines.append("")
        lrows = []
        for n in d["namespaces"]:
            lg = n["legacy"]
            if lg["error"]:
                lrows.append((shown(f"{n['namespace']}/g{n['group']}"), "?", "-", "-", "-", "-", shown(lg["error"])))
                continue
            saved = n["bytes"] - (lg["compacted_bytes"] or 0)
            lrows.append((shown(f"{n['namespace']}/g{n['group']}"), lg["row"] or "-", lg["slots"] or "-",
                          lg["page_bytes"] or "-", lg["padding"] if lg["padding"] is not None else "-",
                          human(lg["compacted_bytes"] or 0),
                          (f"saves {human(saved)}" if saved >= 0 else f"adds {human(-saved)} of headers")
                          + f" -> {lg['compacted_namespace']}"))
        lines.append(table(["legacy namespace", "row", "slots", "page B", "pad B", "compacted", "note"], lrows,
                           right=(2, 3, 4, 5)))
    q = d.get("quarantine")
    if q and q["files"]:
        why = ", ".join(f"{n} {r}" for r, n in sorted(q["reasons"].items()))
        lines.append(f"quarantine: {q['files']} files, {human(q['bytes'])} in {shown(q['path'])} ({why}); "
                     "not counted above; purge with kvformat gc ROOT --quarantine")
    for e in d.get("errors", []):
        lines.append(f"ERROR {shown(e['path'])}: {shown(e['message'])}")
    ign = d.get("ignored") or []
    for i in ign[:20]:
        lines.append(f"ignored {shown(i['path'])}: {shown(i['why'])}")
    if len(ign) > 20:
        lines.append(f"... and {len(ign) - 20} more ignored paths (see --json)")
    for u in d.get("unreadable", []):
        lines.append(f"UNREADABLE {shown(u['path'])}: {u['error']}")
    for n in d["namespaces"]:
        for b in n["bad_files"][:20]:
            lines.append(f"BAD {shown(b['path'])}: {b['reason']}: {shown(b['message'])}")
    return "\n".join(lines)


# -- one legacy file -------------------------------------------------------------------------------------
def inspect_legacy_file(ns: Any, f: LegacyFile, *, verify: bool = True,
                        page_bytes: int | None = None) -> dict[str, Any]:
    """Row layout of one legacy file, its replica status and the kvformat file it compacts to."""
    from ..format import block_relpath
    from ..legacy import key_for

    out: dict[str, Any] = {"kind": "legacy_file", "path": f.path, "namespace": ns.base, "group": f.group,
                           "hash": f.hash, "bytes": f.size, "mtime": f.mtime, "model": ns.model, "kv_dtype": ns.dtype,
                           "config": dict(ns.config), "row": None, "replicas": "skipped", "compacts_to": None,
                           "error": None}
    try:
        row = infer_row(ns, f.group, f.size, page_bytes=page_bytes)
    except LegacyLayoutError as e:
        out["error"] = {"reason": e.reason, "message": e.message}
        return out
    out["row"] = {"kind": row.kind, "slots": row.copies, "page_bytes": row.page_bytes, "slot_bytes": row.slot_bytes,
                  "row_bytes": row.row_bytes, "padding": row.padding,
                  "slot_offsets": [i * row.slot_bytes for i in range(row.copies)]}
    out["compacts_to"] = block_relpath(row.layout, key_for(f))
    if verify:
        buf = memoryview(bytearray(row.row_bytes))
        read_row(f.path, buf)
        try:
            extract_payload(row, buf, path=f.path)
            out["replicas"] = "identical" if row.copies > 1 else "single"
        except ReplicaMismatchError as e:
            out["replicas"] = "differ"
            out["error"] = {"reason": e.reason, "message": e.message}
    return out


def render_legacy_file(d: dict[str, Any]) -> str:
    lines = [f"legacy file {shown(d['path'])}",
             f"namespace   {shown(d['namespace'])} (vLLM fs tier, group {d['group']})",
             f"model       {shown(d['model'])}", f"kv dtype    {shown(d['kv_dtype'])}",
             f"key         {d['hash']}:{d['group']}",
             f"bytes       {d['bytes']}  mtime {iso(d['mtime'])}"]
    c = d["config"]
    lines.append(f"config      tp={c.get('tp_size')} pp={c.get('pp_size')} dcp={c.get('dcp_size')} "
                 f"pcp={c.get('pcp_size')} blocks_per_file={c.get('blocks_per_file')} "
                 f"replicated_layout={c.get('replicated_layout', False)}")
    r = d["row"]
    if r:
        lines.append(f"row         {r['kind']}: {r['slots']} slot(s) of {r['slot_bytes']} B at "
                     f"{', '.join(map(str, r['slot_offsets']))}; page {r['page_bytes']} B; padding {r['padding']} B")
        lines.append(f"replicas    {d['replicas']}")
        lines.append(f"compacts to {d['compacts_to']}")
    if d["error"]:
        lines.append(f"error       {d['error']['reason']}: {shown(d['error']['message'])}")
    return "\n".join(lines)
