"""The ``kvformat`` command line: inspect, verify, compact, gc, demo. See docs/cli.md.

The CLI parses arguments, calls the library and renders; ``main(argv) -> int`` returns the exit code
(see ``EXIT_CODES``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import KVFormatError, UsageError
from ._args import (
    EXIT_BAD, EXIT_CODES, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_PIPE, EXIT_USAGE, build_parser,
)
from ._util import human, iso, progress_wanted, shown, terminal_safe

__all__ = ["EXIT_CODES", "main"]


class _StdoutClosed(Exception):
    """stdout's reader went away (``| head``): stop quietly."""


def _out(text: str = "") -> None:
    try:
        sys.stdout.write(terminal_safe(text) + "\n")
    except BrokenPipeError:
        raise _StdoutClosed() from None


def _emit(obj: Any) -> None:
    # ensure_ascii: undecodable bytes of file names (lone surrogates) stay lossless \udcXX escapes
    _out(json.dumps(obj, indent=2, sort_keys=True))


def _err(cmd: str | None, msg: str) -> None:
    try:
        sys.stderr.write(terminal_safe(f"kvformat{' ' + cmd if cmd else ''}: {msg}") + "\n")
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):
        pass


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail on the closed pipe."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (``EXIT_CODES``: 0 ok, 1 bad files, 2 usage or I/O, 3 internal, …)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
        return int(e.code or 0)
    if args.cmd is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        rc = int(_COMMANDS[args.cmd](args))
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            raise _StdoutClosed() from None
        return rc
    except _StdoutClosed:
        _silence_stdout()
        return EXIT_PIPE
    except KVFormatError as e:  # UsageError, a malformed config.json or header, a layout needing a hint
        _err(args.cmd, shown(str(e)))
        return EXIT_USAGE
    except OSError as e:
        _err(args.cmd, shown(str(e)))
        return EXIT_USAGE
    except ImportError as e:  # a URL whose fsspec backend is not installed
        _err(args.cmd, str(e))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _err(args.cmd, "interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - last resort: a bug must not read as "bad files" (1) or a bare traceback
        _err(args.cmd, f"internal error (a bug in kvformat; please report it): {type(e).__name__}: {shown(str(e))}")
        if os.environ.get("KVFORMAT_DEBUG"):
            traceback.print_exc()
        return EXIT_INTERNAL


def _local(path: str) -> str:
    return path.removeprefix("file://")


def _bar(a: argparse.Namespace, label: str, total: int, total_bytes: int = 0) -> Any:
    from ._util import Progress

    return Progress(total, total_bytes, label=label, enabled=progress_wanted(a.quiet, a.json))


def _keyring(a: argparse.Namespace) -> Any:
    """The keyring of the --key sources given (None without any); KeySourceError (exit 2) names a bad source."""
    if not a.keys:
        return None
    from ..format import load_keyring

    return load_keyring(a.keys[0], a.keys[1:])


def _cmd_inspect(a: argparse.Namespace) -> int:
    from ..admin import classify_path
    from ..storage import split_root
    from ._inspect import (
        inspect_file,
        inspect_legacy,
        inspect_legacy_file,
        inspect_root,
        render_file,
        render_legacy_file,
        render_root,
    )

    path = _local(a.path)
    keys = _keyring(a)
    if split_root(path)[0]:
        from ._remote import inspect_url

        d = inspect_url(path, verify=a.verify, keys=keys)
        if d["kind"] == "file":
            _emit(d) if a.json else _out(render_file(d))
            return EXIT_BAD if d["error"] else EXIT_OK
        _emit(d) if a.json else _out(render_root(d))
        return EXIT_BAD if d["totals"]["corrupt"] else EXIT_OK
    t = classify_path(path, "inspect")
    if t.kind == "legacy_file":
        assert t.legacy_hit is not None
        d = inspect_legacy_file(*t.legacy_hit, verify=a.verify is not False, page_bytes=a.page_bytes)
        _emit(d) if a.json else _out(render_legacy_file(d))
        if d["error"] and d["row"] is None:
            return EXIT_USAGE  # no layout: nothing could be checked
        return EXIT_BAD if d["error"] else EXIT_OK
    if t.kind == "file":
        d = inspect_file(path, verify=a.verify is not False, keys=keys)
        _emit(d) if a.json else _out(render_file(d))
        return EXIT_BAD if d["error"] else EXIT_OK
    verify = bool(a.verify)
    with _Scanning(a, "inspect", enabled=verify) as tick:
        if t.legacy:
            d = inspect_legacy(path, verify=verify, page_bytes=a.page_bytes, progress=tick)
        else:
            d = inspect_root(path, verify=verify, jobs=a.jobs, progress=tick, keys=keys)
    _emit(d) if a.json else _out(render_root(d))
    if d.get("errors") or d.get("unreadable") or any(n.get("legacy", {}).get("error") for n in d["namespaces"]):
        return EXIT_USAGE
    return EXIT_BAD if d["totals"]["corrupt"] else EXIT_OK


class _Scanning:
    """A progress bar for a scan: the scan adds its total once it has listed, then ticks per file."""

    def __init__(self, a: argparse.Namespace, label: str, *, enabled: bool = True) -> None:
        self.bar = _bar(a, label, 0) if enabled else None

    def __enter__(self) -> Any:
        return self.bar if self.bar is not None and self.bar.enabled else None

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _cmd_verify(a: argparse.Namespace) -> int:
    from ._verify import verify_path

    keys = _keyring(a)
    with _Scanning(a, "verify") as tick:
        rep = verify_path(_local(a.path), quarantine=a.quarantine, jobs=a.jobs, page_bytes=a.page_bytes,
                          progress=tick, keys=keys)
    # What made the pass incomplete (exit 2) goes to stderr as errors do, in both modes; the report
    # (text or JSON) on stdout still lists everything.
    for u in rep["unreadable"]:
        _err("verify", f"UNREADABLE {shown(u['path'])}: {shown(u['error'])}")
    for e in rep["errors"]:
        _err("verify", f"ERROR {shown(e['path'])}: {shown(e['message'])}")
    for q in rep["quarantine_failed"]:
        _err("verify", f"NOT quarantined {shown(q['path'])}: {shown(q['error'])}")
    if a.json:
        _emit(rep)
        return int(rep["exit_code"])
    for b in rep["bad"]:
        _out(f"BAD {shown(b['path'])}: {b['reason']}: {shown(b['message'])}")
    for q in rep["quarantined"]:
        _out(f"quarantined -> {shown(q)}")
    for i in rep["ignored"]:
        _out(f"ignored {shown(i['path'])}: {shown(i['why'])}")
    tail = [f"{len(rep['bad'])} bad"]
    if a.quarantine:
        tail.append(f"{len(rep['quarantined'])} quarantined")
    if rep["unreadable"]:
        tail.append(f"{len(rep['unreadable'])} unreadable")
    if rep["errors"]:
        tail.append(f"{len(rep['errors'])} errors")
    _out(f"checked {rep['checked']} files: " + ", ".join(tail))
    return int(rep["exit_code"])


def _cmd_compact(a: argparse.Namespace) -> int:
    from ..legacy import check_destination, compact
    from ._compact import summary_lines

    if not os.path.isdir(a.src):
        raise UsageError(f"{a.src}: not a directory")
    if a.source == "sglang":
        return _compact_sglang(a)
    check_destination(a.src, a.dst)
    if a.keys and a.seal is None:
        raise UsageError("--key is for --seal: compact writes clear files without it")
    if a.seal is not None and not a.keys:
        raise UsageError("--seal needs --key SOURCE (a key file path or env:NAME): the key the outputs are sealed "
                         "under")
    keys = _keyring(a)
    bar = _bar(a, "compact", 0)  # draws only on a terminal; failure lines always reach stderr
    try:
        rep = compact(a.src, a.dst, jobs=a.jobs, dry_run=a.dry_run, delete_source=a.delete_source,
                      page_bytes=a.page_bytes, codec=a.codec, level=a.level, fsync=a.fsync, mode=a.mode,
                      progress=bar, pp_layers=a.pp_layers, cp_interleave=a.cp_interleave,
                      platform=a.platform, seal=a.seal, keys=keys)
    finally:
        bar.close()
    if a.json:
        _emit(rep.to_dict())
    else:
        for line in summary_lines(rep):
            _out(line)
    return rep.exit_code


def _compact_sglang(a: argparse.Namespace) -> int:
    from ..sglang import compact_sglang

    missing = [f"--{n.replace('_', '-')}" for n in ("model", "n_layers", "page_size", "host_layout")
               if getattr(a, n) is None]
    if missing:
        raise UsageError(f"--from sglang needs {', '.join(missing).replace('--n-layers', '--layers')}")
    rep = compact_sglang(a.src, a.dst, model=a.model, n_layers=a.n_layers, page_tokens=a.page_size,
                         host_layout=a.host_layout, kv_dtype=a.kv_dtype, width=a.width, revision=a.revision,
                         key_scheme=a.key_scheme, rope=a.rope, dry_run=a.dry_run, delete_source=a.delete_source,
                         fsync=a.fsync)
    if a.json:
        _emit(vars(rep))
    else:
        _out(f"{rep.seen} SGLang files: {rep.written} pages written, {rep.existed} already there, "
             f"{sum(rep.skipped.values())} skipped, {rep.deleted} sources deleted -> namespace {rep.namespace}")
        _out(f"read {rep.bytes_in} bytes, wrote {rep.bytes_out} bytes")
        for why, n in sorted(rep.skipped.items()):
            _out(f"skipped {n}: {why}")
    return 1 if rep.skipped else 0


def _cmd_gc(a: argparse.Namespace) -> int:
    from ..admin import open_gc_root, run_gc

    if a.max_bytes is None and not a.quarantine:
        raise UsageError("nothing to do: give --max-bytes SIZE, --quarantine, or both")
    store = open_gc_root(a.root)
    limit = a.max_bytes or None  # 0: no limit, as the tier's max_bytes
    bar = _bar(a, "gc", 0)
    rep = run_gc(store, limit, dry_run=a.dry_run, quarantine=a.quarantine, evict=a.max_bytes is not None,
                 namespaces_only=True,
                 progress=bar.update if bar.enabled else None, on_plan=lambda n: setattr(bar, "total", n))
    bar.close()
    if a.json:
        _emit(rep.to_dict())
        return rep.exit_code
    verb = "would delete" if a.dry_run else "deleted"
    for v in rep.victims:
        _out(f"{verb} {shown(v.relpath)}  ({human(v.size)}, last used {iso(v.mtime)})")
    for v in rep.quarantine_victims:
        _out(f"{verb} {shown(v.relpath)}  ({human(v.size)}, quarantined {iso(v.mtime)})")
    for f in rep.failed:
        _out(f"NOT deleted {shown(f['path'])}: {shown(f['error'])}")
    for i in rep.ignored:
        _out(f"ignored {shown(i['path'])}: {shown(i['why'])}")
    lim = "no limit" if limit is None else f"limit {human(limit)}"
    n = len(rep.victims)
    line = (f"{rep.files_before} block files, {human(rep.bytes_before)} ({lim}): {verb} {n} least recently "
            f"used files, {human(sum(v.size for v in rep.victims))}; {'would leave' if a.dry_run else 'now'} "
            f"{human(rep.bytes_after)}")
    if a.quarantine:
        line += (f"; {verb} {len(rep.quarantine_victims)} quarantined files, "
                 f"{human(sum(v.size for v in rep.quarantine_victims))}")
    if rep.temp_removed:
        line += f"; removed {rep.temp_removed} stale temp files"
    elif a.dry_run:
        line += "; stale temp files (over an hour old) are removed by a real run"
    _out(line)
    return rep.exit_code


def _cmd_demo(a: argparse.Namespace) -> int:
    import contextlib
    import io

    from ._demo import run_demo

    if not a.json:
        return run_demo(a.dir, n_layers=a.layers, n_blocks=a.blocks)
    summary: dict[str, Any] = {}
    with contextlib.redirect_stdout(io.StringIO()):
        rc = run_demo(a.dir, n_layers=a.layers, n_blocks=a.blocks, summary=summary)
    _emit({"command": "demo", **summary, "exit_code": rc})
    return rc


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "inspect": _cmd_inspect, "verify": _cmd_verify, "compact": _cmd_compact, "gc": _cmd_gc, "demo": _cmd_demo}
