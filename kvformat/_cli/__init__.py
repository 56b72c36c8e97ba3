"""The ``kvformat`` command line: inspect, verify, compact, gc, demo. See docs/cli.md.

Exit codes: 0 all good; 1 bad files found / some files failed; 2 usage error, unreadable input or
an I/O error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

from ..errors import KVFormatError
from ._util import UsageError, human, parse_size

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvformat", description="Inspect, verify, compact and bound kvformat KV caches.")
    from .. import __version__

    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    s = sub.add_parser("inspect", help="show a file, a kvformat root or a legacy vLLM fs-tier root")
    s.add_argument("path")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--verify", dest="verify", action="store_true", default=None,
                   help="also check data checksums (default for a file; directories check headers only)")
    g.add_argument("--no-verify", dest="verify", action="store_false", help="read headers only")
    s.add_argument("--json", action="store_true", help="machine-readable output (schema in docs/cli.md)")
    s.add_argument("--jobs", type=int, default=4, help="threads checking payloads with --verify (default 4)")
    s.add_argument("--page-bytes", type=int, default=None, help="legacy roots: bytes of one block of one layer")

    s = sub.add_parser("verify", help="full checksum pass over a file or root")
    s.add_argument("path")
    s.add_argument("--quarantine", action="store_true", help="move bad files to <root>/.quarantine/")
    s.add_argument("--json", action="store_true")
    s.add_argument("--jobs", type=int, default=2)
    s.add_argument("--page-bytes", type=int, default=None, help="legacy roots: bytes of one block of one layer")

    s = sub.add_parser("compact", help="convert a legacy vLLM fs-tier root into kvformat files")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--jobs", "-j", type=int, default=1)
    s.add_argument("--dry-run", action="store_true", help="print what would be written and the bytes saved")
    s.add_argument("--delete-source", action="store_true",
                   help="remove each source file after its output is written and verified")
    s.add_argument("--page-bytes", type=int, default=None,
                   help="bytes of one block of one layer when the file size allows several layouts")
    s.add_argument("--codec", choices=("none", "zstd"), default="none")
    s.add_argument("--level", type=int, default=3, help="zstd level")
    s.add_argument("--fsync", action="store_true", help="fsync each output before counting it done")
    s.add_argument("--json", action="store_true")
    s.add_argument("--quiet", "-q", action="store_true", help="no progress output")

    s = sub.add_parser("gc", help="evict least recently used files until a root is under a size")
    s.add_argument("root")
    s.add_argument("--max-bytes", required=True, help="e.g. 500G, 64MiB, 1000000")
    s.add_argument("--dry-run", action="store_true")
    s.add_argument("--json", action="store_true")

    s = sub.add_parser("demo", help="the whole story on a small DeepSeek-shaped cache, in a temp directory")
    s.add_argument("--dir", default=None, help="work here instead of a temp directory (kept)")
    s.add_argument("--layers", type=int, default=8)
    s.add_argument("--blocks", type=int, default=12)
    return p


def _emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 bad files / failures, 2 usage or I/O error)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
        return int(e.code or 0)
    if args.cmd is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(_COMMANDS[args.cmd](args))
    except UsageError as e:
        print(f"kvformat {args.cmd}: {e}", file=sys.stderr)
        return 2
    except KVFormatError as e:
        print(f"kvformat {args.cmd}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kvformat {args.cmd}: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # a URL whose fsspec backend is not installed
        print(f"kvformat {args.cmd}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvformat {args.cmd}: interrupted", file=sys.stderr)
        return 130


def _cmd_inspect(a: argparse.Namespace) -> int:
    from ._inspect import inspect_file, inspect_legacy, inspect_root, render_file, render_root
    from ..legacy import is_legacy_root

    path = a.path
    if path.startswith("file://"):
        path = path[len("file://"):]
    if "://" in path:
        from ._remote import inspect_url

        d = inspect_url(path, verify=a.verify)
        if d["kind"] == "file":
            _emit(d) if a.json else print(render_file(d))
            return 1 if d["error"] else 0
        _emit(d) if a.json else print(render_root(d))
        return 1 if d["totals"]["corrupt"] else 0
    if os.path.isfile(path):
        from ._inspect import inspect_legacy_file, legacy_file_namespace, render_legacy_file

        hit = legacy_file_namespace(path) if path.endswith(".bin") else None
        if hit is not None:
            d = inspect_legacy_file(*hit, verify=a.verify is not False, page_bytes=a.page_bytes)
            _emit(d) if a.json else print(render_legacy_file(d))
            return 1 if d["error"] else 0
        d = inspect_file(path, verify=a.verify is not False)
        _emit(d) if a.json else print(render_file(d))
        return 1 if d["error"] else 0
    if not os.path.isdir(path):
        raise UsageError(f"{path}: no such file or directory")
    if is_legacy_root(path):
        d = inspect_legacy(path, verify=bool(a.verify), page_bytes=a.page_bytes)
    else:
        d = inspect_root(path, verify=bool(a.verify), jobs=a.jobs)
    _emit(d) if a.json else print(render_root(d))
    return 1 if d["totals"]["corrupt"] else 0


def _cmd_verify(a: argparse.Namespace) -> int:
    from ._inspect import (
        find_store_root, inspect_file, inspect_legacy, inspect_legacy_file, legacy_file_namespace, scan_root,
    )
    from ..legacy import Ignored, is_legacy_root
    from ..storage import LocalStore

    path = a.path
    if path.startswith("file://"):
        path = path[len("file://"):]
    bad: list[dict[str, Any]] = []
    ignored: list[dict[str, str]] = []
    checked = 0
    quarantined: list[str] = []
    targets: list[tuple[str, str]] = []
    if "://" in path:
        from ._remote import verify_url

        checked, bad, quarantined = verify_url(path, quarantine=a.quarantine)
    elif os.path.isfile(path) and path.endswith(".bin") and legacy_file_namespace(path) is not None:
        if a.quarantine:
            raise UsageError("--quarantine applies to kvformat roots; legacy files have no checksum to quarantine by")
        d = inspect_legacy_file(*legacy_file_namespace(path), verify=True, page_bytes=a.page_bytes)  # type: ignore[misc]
        checked = 1
        if d["error"]:
            if d["row"] is None:
                raise UsageError(f"{path}: {d['error']['message']}")
            bad.append({"path": path, "reason": d["error"]["reason"], "message": d["error"]["message"]})
        targets = []
    elif os.path.isfile(path):
        d = inspect_file(path, verify=True)
        checked = 1
        if d["error"]:
            bad.append({"path": path, "reason": d["error"]["reason"], "message": d["error"]["message"]})
        root, rel = find_store_root(path)
        targets = [(root, rel)] if bad else []
    elif os.path.isdir(path) and is_legacy_root(path):
        d = inspect_legacy(path, verify=True, page_bytes=a.page_bytes)
        checked = d["totals"]["files"]
        ignored = d["ignored"]
        for n in d["namespaces"]:
            bad += n["bad_files"]
            if n["legacy"]["error"]:
                raise UsageError(f"{n['namespace']}: {n['legacy']['error']}")
        if a.quarantine:
            raise UsageError("--quarantine applies to kvformat roots; legacy files have no checksum to quarantine by")
        targets = []
    elif os.path.isdir(path):
        root, prefix = find_store_root(path)
        scan_dir = path if not prefix else os.path.join(root, prefix)
        skipped: list[Ignored] = []
        accs, errs = scan_root(scan_dir, verify=True, jobs=a.jobs, ignored=skipped)
        ignored = [{"path": i.path, "why": i.why} for i in skipped]
        checked = sum(x.files for x in accs)
        rel_base = os.path.relpath(scan_dir, root).replace(os.sep, "/")
        targets = []
        for rel, err in errs:
            full_rel = rel if rel_base == "." else f"{rel_base}/{rel}"
            bad.append({"path": os.path.join(root, full_rel), "reason": err.reason, "message": err.message})
            targets.append((root, full_rel))
    else:
        raise UsageError(f"{path}: no such file or directory")
    if a.quarantine and targets:
        for (root, rel), b in zip(targets, bad):
            new = LocalStore(root).quarantine(rel, b["reason"])
            if new:
                quarantined.append(os.path.join(root, new))
    out = {"command": "verify", "path": path, "checked": checked, "bad": bad, "quarantined": quarantined,
           "ignored": ignored, "exit_code": 1 if bad else 0}
    if a.json:
        _emit(out)
    else:
        for b in bad:
            print(f"BAD {b['path']}: {b['reason']}: {b['message']}")
        for q in quarantined:
            print(f"quarantined -> {q}")
        for i in ignored:
            print(f"ignored {i['path']}: {i['why']}")
        print(f"checked {checked} files: {len(bad)} bad" + (f", {len(quarantined)} quarantined" if a.quarantine else ""))
    return out["exit_code"]


def _cmd_compact(a: argparse.Namespace) -> int:
    from ._compact import compact, summary_lines

    if a.jobs < 1:
        raise UsageError(f"--jobs: expected at least 1, got {a.jobs}")
    if not os.path.isdir(a.src):
        raise UsageError(f"{a.src}: not a directory")
    if os.path.realpath(a.dst) == os.path.realpath(a.src):
        raise UsageError("DST must differ from SRC")
    rep = compact(a.src, a.dst, jobs=a.jobs, dry_run=a.dry_run, delete_source=a.delete_source,
                  page_bytes=a.page_bytes, codec=a.codec, level=a.level, fsync=a.fsync,
                  progress=not (a.quiet or a.json))
    if a.json:
        _emit(rep.to_dict())
    else:
        for line in summary_lines(rep):
            print(line)
    return rep.exit_code


def _cmd_gc(a: argparse.Namespace) -> int:
    from .._gc import run_gc
    from ..storage import open_store

    max_bytes = parse_size(a.max_bytes)
    if "://" not in a.root and not os.path.isdir(a.root):
        raise UsageError(f"{a.root}: not a directory")
    rep = run_gc(open_store(a.root), max_bytes, dry_run=a.dry_run)
    if a.json:
        _emit(rep.to_dict())
    else:
        verb = "would evict" if a.dry_run else "evicted"
        n = len(rep.victims) if a.dry_run else rep.deleted
        b = sum(v.size for v in rep.victims) if a.dry_run else rep.freed_bytes
        print(f"{rep.files_before} files, {human(rep.bytes_before)} (limit {human(max_bytes)}): "
              f"{verb} {n} least recently used files, {human(b)}; now {human(rep.bytes_after)}"
              + (f"; removed {rep.temp_removed} stale temp files" if rep.temp_removed else ""))
    return 0


def _cmd_demo(a: argparse.Namespace) -> int:
    from ._demo import run_demo

    return run_demo(a.dir, n_layers=a.layers, n_blocks=a.blocks)


_COMMANDS = {"inspect": _cmd_inspect, "verify": _cmd_verify, "compact": _cmd_compact, "gc": _cmd_gc,
             "demo": _cmd_demo}
