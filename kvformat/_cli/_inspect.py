"""``kvformat inspect`` and ``kvformat verify``: what is on disk, and is it intact."""

from __future__ import annotations

import os
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .._io import UnsafeFileError, is_regular_file, read_header, read_into, read_small_file
from .._spec import NAMESPACE_FILE, BlockHeader, CanonicalLayout
from ..errors import KVFormatError, LegacyLayoutError, ReplicaMismatchError
from ..legacy import Ignored, LegacyFile, extract_payload, find_namespaces, infer_row, iter_legacy_files
from ..storage import StoreEntry
from ..storage._local import scan_entries
from ._util import human, iso, table


# -- one file ------------------------------------------------------------------------------------------
def inspect_file(path: str, *, verify: bool = True) -> dict[str, Any]:
    """Header, layout table and checksum status of one kvformat file (the ``--json`` "file" object)."""
    return file_view(path, lambda: read_header(path, verify=True),
                     lambda hdr: read_into(path, bytearray(hdr.raw_bytes), verify=True), verify=verify)


def file_view(path: str, read_hdr: Callable[[], BlockHeader], read_data: Callable[[BlockHeader], Any], *,
              verify: bool = True) -> dict[str, Any]:
    """The "file" object of ``path`` from a header reader and a payload reader (local file or remote object)."""
    out: dict[str, Any] = {"kind": "file", "path": path, "header": None, "layers": [],
                           "checksum": {"header": "unknown", "data": "skipped"}, "error": None}
    try:
        hdr = read_hdr()
    except KVFormatError as e:
        out["checksum"]["header"] = "bad"
        out["error"] = {"reason": e.reason, "message": e.message}
        return out
    out["checksum"]["header"] = "ok"
    out["header"] = hdr.to_dict()
    out["header"]["ratio"] = round(hdr.ratio, 4)
    bpc = hdr.layout.blocks_per_chunk
    for l, off, n in zip(hdr.layout.layers, hdr.layout.layer_offsets, hdr.layout.chunk_bytes_per_layer):
        out["layers"].append({"name": l.name, "dtype": l.dtype, "shape": [bpc, *l.shape], "offset": off, "bytes": n})
    if verify:
        try:
            read_data(hdr)
            out["checksum"]["data"] = "ok"
        except KVFormatError as e:
            out["checksum"]["data"] = "bad"
            out["error"] = {"reason": e.reason, "message": e.message}
    return out


def render_file(d: dict[str, Any]) -> str:
    lines = [f"file        {d['path']}"]
    h = d["header"]
    if h is None:
        lines.append(f"checksum    header BAD: {d['error']['reason']}: {d['error']['message']}")
        return "\n".join(lines)
    lay, prov = h["layout"], h["provenance"]
    lines += [
        f"format      kvformat {h['version']}",
        f"namespace   {h['namespace']}",
        f"model       {lay['model']}" + (f" @ {lay['revision']}" if lay["revision"] else ""),
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
    lines.append(f"checksum    header ok, {data} (xxh3 {h['checksums']['data_xxh3']})")
    if d["error"]:
        lines.append(f"error       {d['error']['reason']}: {d['error']['message']}")
    lines.append("")
    rows = [(i, l["name"], l["dtype"], "x".join(map(str, l["shape"])), l["offset"], l["bytes"])
            for i, l in enumerate(d["layers"])]
    lines.append(table(["#", "layer", "dtype", "shape", "offset", "bytes"], rows, right=(0, 4, 5)))
    return "\n".join(lines)


# -- a kvformat root -----------------------------------------------------------------------------------
@dataclass
class _NsAcc:
    namespace: str
    layout: CanonicalLayout | None = None
    files: int = 0
    bytes: int = 0
    raw: int = 0
    data: int = 0
    tps: Counter = field(default_factory=Counter)
    corrupt: int = 0
    oldest: float | None = None
    newest: float | None = None
    bad: list[dict[str, str]] = field(default_factory=list)

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
        }


def _walk(root: str) -> list[StoreEntry]:
    """Every ``.kvf`` file under ``root``, as ``LocalStore.list`` gives them (without creating ``root``)."""
    return list(scan_entries(root))


def _check_entry(root: str, e: StoreEntry, verify: bool) -> tuple[StoreEntry, BlockHeader | None, KVFormatError | None]:
    path = os.path.join(root, e.relpath)
    try:
        hdr = read_header(path, verify=True)
        if verify:
            read_into(path, bytearray(hdr.raw_bytes), verify=True)
        return e, hdr, None
    except KVFormatError as err:
        return e, None, err
    except FileNotFoundError:  # removed since listing (gc, a tier quarantining it)
        return e, None, None


def scan_root(root: str, *, verify: bool = False, jobs: int = 4, ignored: list[Ignored] | None = None,
              ) -> tuple[list[_NsAcc], list[tuple[str, KVFormatError]]]:
    """Read every header under a kvformat root (and every payload with ``verify``).

    A namespace.json that is a symlink, a FIFO or another non-regular file is not read; it is
    recorded in ``ignored`` when given.

    Header checks are CPU-bound Python (GIL), so the header-only scan runs in one thread; data
    verification reads and hashes in threads (I/O and xxh3 release the GIL).
    """
    root = os.path.abspath(root)
    accs: dict[str, _NsAcc] = {}
    bad: list[tuple[str, KVFormatError]] = []
    entries = _walk(root)
    # A namespace directory itself (it holds namespace.json): every file belongs to it.
    single = os.path.basename(root) if is_regular_file(os.path.join(root, NAMESPACE_FILE)) else None
    results: Iterable[tuple[StoreEntry, BlockHeader | None, KVFormatError | None]]
    ex = None
    if verify and jobs > 1 and len(entries) > 16:
        ex = ThreadPoolExecutor(max_workers=jobs)
        results = ex.map(lambda e: _check_entry(root, e, verify), entries)
    else:
        results = (_check_entry(root, e, verify) for e in entries)
    try:
        for e, hdr, err in results:
            ns = single or e.relpath.split("/", 1)[0]
            acc = accs.get(ns) or accs.setdefault(ns, _NsAcc(ns))
            if hdr is None and err is None:
                continue
            acc.files += 1
            acc.bytes += e.size
            acc.add_time(e.mtime)
            if err is not None:
                acc.corrupt += 1
                acc.bad.append({"path": e.relpath, "reason": err.reason, "message": err.message})
                bad.append((e.relpath, err))
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
    if single is not None:
        accs.setdefault(single, _NsAcc(single))
        acc = accs[single]
        if acc.layout is None:
            acc.layout = _layout_from_doc(os.path.dirname(root), single, ignored)
        return [acc], bad
    try:  # empty namespaces still show up
        for d in os.scandir(root):
            if d.is_dir(follow_symlinks=False) and is_regular_file(os.path.join(d.path, NAMESPACE_FILE)):
                accs.setdefault(d.name, _NsAcc(d.name))
    except FileNotFoundError:
        pass
    for acc in accs.values():
        if acc.layout is None:
            acc.layout = _layout_from_doc(root, acc.namespace, ignored)
    return [accs[k] for k in sorted(accs)], bad


def _layout_from_doc(root: str, ns: str, ignored: list[Ignored] | None = None) -> CanonicalLayout | None:
    import json

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


def inspect_root(root: str, *, verify: bool = False, jobs: int = 4) -> dict[str, Any]:
    ignored: list[Ignored] = []
    accs, _bad = scan_root(root, verify=verify, jobs=jobs, ignored=ignored)
    nss = [a.to_dict() for a in accs]
    return {"kind": "kvformat_root", "path": root, "verified_data": verify, "namespaces": nss,
            "totals": _totals(nss), "ignored": [{"path": i.path, "why": i.why} for i in ignored]}


def _totals(nss: list[dict[str, Any]]) -> dict[str, Any]:
    return {"namespaces": len(nss), "files": sum(n["files"] for n in nss), "bytes": sum(n["bytes"] for n in nss),
            "corrupt": sum(n["corrupt"] for n in nss)}


# -- a legacy vLLM root --------------------------------------------------------------------------------
def inspect_legacy(root: str, *, verify: bool = False, page_bytes: int | None = None) -> dict[str, Any]:
    """Per legacy namespace and group: what compacting it would give. ``verify`` checks replicas."""
    nss = []
    ignored: list[Ignored] = []
    for ns in find_namespaces(root, ignored=ignored):
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
                "bad_files": [], "legacy": {"row": None, "slots": None, "page_bytes": None, "row_bytes": None,
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
                    for f in ok:
                        try:
                            with open(f.path, "rb") as fh:
                                n = fh.readinto(buf)
                            if n != row.row_bytes:
                                raise LegacyLayoutError(f"short read: {n} of {row.row_bytes} bytes")
                            extract_payload(row, buf, path=f.path)
                        except (ReplicaMismatchError, LegacyLayoutError) as e:
                            d["corrupt"] += 1
                            d["bad_files"].append({"path": f.path, "reason": e.reason, "message": e.message})
                from ._compact import _header_bytes

                per = _header_bytes(row, ok[0]) + row.layout.payload_bytes if ok else 0
                d["tp_sizes"] = [row.copies] if row.kind == "per_worker" else [ns.parallel()["tp"]]
                d["legacy"].update({"row": row.kind, "slots": row.copies, "page_bytes": row.page_bytes,
                                    "row_bytes": row.row_bytes, "padding": row.padding,
                                    "compacted_bytes": per * len(ok), "compacted_namespace": row.layout.namespace()})
            nss.append(d)
    return {"kind": "legacy_root", "path": root, "verified_data": verify, "namespaces": nss, "totals": _totals(nss),
            "ignored": [{"path": i.path, "why": i.why} for i in ignored]}


def _tpb(ns: Any, g: int) -> int | None:
    gs = ns.groups()
    return int(gs[g].get("tokens_per_block", 0)) if g < len(gs) else None


def _nlayers(ns: Any, g: int) -> int | None:
    gs = ns.groups()
    return len(gs[g].get("layer_names") or []) if g < len(gs) else None


def render_root(d: dict[str, Any]) -> str:
    legacy = d["kind"] == "legacy_root"
    what = "legacy vLLM fs-tier root" if legacy else "kvformat root"
    checked = ("headers + replicas" if d["verified_data"] else "headers/sizes") if legacy else \
        ("headers + data" if d["verified_data"] else "headers")
    lines = [f"{what}: {d['path']}  (checked: {checked})", ""]
    rows = []
    for n in d["namespaces"]:
        ratio = f"{n['compression_ratio']:.2f}" if n["compression_ratio"] else "-"
        name = f"{n['namespace']}/g{n['group']}" if legacy else n["namespace"]
        rows.append((name, n["model"] or "-", n["kv_dtype"] or "-", n["tokens_per_block"] or "-", n["files"],
                     human(n["bytes"]), ",".join(map(str, n["tp_sizes"])) or "-", ratio, n["corrupt"],
                     iso(n["oldest"]), iso(n["newest"])))
    lines.append(table(["namespace", "model", "dtype", "tok/blk", "files", "bytes", "tp", "ratio", "corrupt",
                        "oldest", "newest"], rows, right=(3, 4, 5, 7, 8)))
    t = d["totals"]
    lines.append("")
    lines.append(f"total: {t['namespaces']} namespaces, {t['files']} files, {human(t['bytes'])}, {t['corrupt']} corrupt")
    if legacy:
        lines.append("")
        lrows = []
        for n in d["namespaces"]:
            lg = n["legacy"]
            if lg["error"]:
                lrows.append((f"{n['namespace']}/g{n['group']}", "?", "-", "-", "-", "-", lg["error"]))
                continue
            saved = n["bytes"] - (lg["compacted_bytes"] or 0)
            lrows.append((f"{n['namespace']}/g{n['group']}", lg["row"] or "-", lg["slots"] or "-",
                          lg["page_bytes"] or "-", lg["padding"] if lg["padding"] is not None else "-",
                          human(lg["compacted_bytes"] or 0),
                          (f"saves {human(saved)}" if saved >= 0 else f"adds {human(-saved)} of headers")
                          + f" -> {lg['compacted_namespace']}"))
        lines.append(table(["legacy namespace", "row", "slots", "page B", "pad B", "compacted", "note"], lrows,
                           right=(2, 3, 4, 5)))
    if d.get("ignored"):
        lines.append(f"ignored {len(d['ignored'])} paths (see --json)")
    for n in d["namespaces"]:
        for b in n["bad_files"][:20]:
            lines.append(f"BAD {b['path']}: {b['reason']}: {b['message']}")
    return "\n".join(lines)


# -- verify --------------------------------------------------------------------------------------------
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


# -- one legacy file -------------------------------------------------------------------------------------
def legacy_file_namespace(path: str) -> tuple[Any, LegacyFile] | None:
    """(namespace, file) when ``path`` is a block file of vLLM's fs tier (``<root>/<base>_r<n>/<hhh>/<hh>_g<g>/<hash>.bin``)."""
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


def inspect_legacy_file(ns: Any, f: LegacyFile, *, verify: bool = True, page_bytes: int | None = None) -> dict[str, Any]:
    """Row layout of one legacy file, its replica status and the kvformat file it compacts to."""
    from .._spec import block_relpath
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
        with open(f.path, "rb") as fh:
            fh.readinto(buf)
        try:
            extract_payload(row, buf, path=f.path)
            out["replicas"] = "identical" if row.copies > 1 else "single"
        except ReplicaMismatchError as e:
            out["replicas"] = "differ"
            out["error"] = {"reason": e.reason, "message": e.message}
    return out


def render_legacy_file(d: dict[str, Any]) -> str:
    lines = [f"legacy file {d['path']}", f"namespace   {d['namespace']} (vLLM fs tier, group {d['group']})",
             f"model       {d['model']}", f"kv dtype    {d['kv_dtype']}", f"key         {d['hash']}:{d['group']}",
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
        lines.append(f"error       {d['error']['reason']}: {d['error']['message']}")
    return "\n".join(lines)
