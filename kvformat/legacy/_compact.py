"""Compaction: legacy vLLM fs-tier rows -> one TP-independent kvformat file per block (``kvformat compact``).

The public API is :func:`compact` (and :func:`check_destination`); it prints nothing: progress and
failure lines go to an optional :class:`CompactProgress` (the CLI passes its progress bar).

Every output goes through ``Store.put_block`` (the tier's own write path: temp file + rename, so a
killed run leaves no partial file under a final name). Outputs are deterministic (provenance
``created`` is the source file's mtime, the writer string is fixed), so a re-run after ``kill -9``
skips what was done and produces the same tree as one clean run.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from ._convert import WRITER, Converter, FileResult, Task
from ..format import NAMESPACE_FILE, Keyring, SealFields, block_relpath, encode_header
from ..errors import LegacyLayoutError, UsageError
from ._rows import (
    Ignored, LegacyFile, LegacyNamespace, RowLayout, find_namespaces, infer_row, iter_legacy_files,
    key_for, provenance_for,
)
from ..storage import Store, open_store, split_root

__all__ = ["WRITER", "CompactProgress", "CompactReport", "FileResult", "check_destination", "compact", "dir_mode",
           "output_header_bytes"]


class CompactProgress(Protocol):
    """Where :func:`compact` reports: the work to do, each file done, lines (failures) and the end."""

    def add_total(self, files: int, nbytes: int) -> None: ...

    def update(self, n_bytes: int, n: int = 1) -> None: ...

    def note(self, line: str) -> None: ...

    def close(self) -> None: ...


class _Silent:
    def add_total(self, files: int, nbytes: int) -> None:
        pass

    def update(self, n_bytes: int, n: int = 1) -> None:
        pass

    def note(self, line: str) -> None:
        pass

    def close(self) -> None:
        pass


def dir_mode(file_mode: int) -> int:
    """The directory mode that goes with a file mode: search (x) wherever read is granted."""
    return file_mode | ((file_mode & 0o444) >> 2)


@dataclass
class CompactReport:
    """Everything a compaction did; ``to_dict`` is the ``--json`` output."""

    src: str
    dst: str
    dry_run: bool
    jobs: int
    converted: int = 0
    skipped: int = 0
    failed: int = 0
    ignored: list[Ignored] = field(default_factory=list)
    failures: list[FileResult] = field(default_factory=list)
    layout_errors: list[str] = field(default_factory=list)
    would_write: list[FileResult] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    bytes_read: int = 0
    deleted_sources: int = 0
    elapsed_s: float = 0.0
    namespaces: list[dict[str, Any]] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.layout_errors:
            return 2
        return 1 if self.failed else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": "compact", "src": self.src, "dst": self.dst, "dry_run": self.dry_run, "jobs": self.jobs,
            "converted": self.converted, "skipped": self.skipped, "failed": self.failed,
            "ignored": len(self.ignored), "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
            "bytes_saved": self.bytes_before - self.bytes_after, "bytes_read": self.bytes_read,
            "deleted_sources": self.deleted_sources, "elapsed_s": round(self.elapsed_s, 6),
            "throughput_bytes_per_s": round(self.bytes_read / self.elapsed_s) if self.elapsed_s > 0 else 0,
            "namespaces": self.namespaces,
            "failures": [{"path": f.src, "reason": f.reason, "error": f.error} for f in self.failures],
            "ignored_paths": [{"path": i.path, "why": i.why} for i in self.ignored],
            "layout_errors": self.layout_errors,
            "would_write": [{"path": f.rel, "src": f.src, "before": f.before, "after": f.after}
                            for f in self.would_write],
            "exit_code": self.exit_code,
        }


def output_header_bytes(row: RowLayout, f: LegacyFile) -> int:
    """Bytes of the header region compact writes for ``f`` (what inspect's "compacted" size adds per file)."""
    seal = SealFields("0" * 16, "0" * 48, "0" * 32) if row.layout.seal else None  # same lengths as the real ones
    hdr = encode_header(row.layout, key_for(f), provenance_for(row, int(f.mtime), WRITER), codec="none",
                        data_bytes=row.layout.payload_bytes, data_xxh3="0" * 16, raw_xxh3="0" * 16, seal=seal)
    return len(hdr)


def _prune_empty_dirs(ns: LegacyNamespace) -> None:
    for _rank, rdir in ns.rank_dirs:
        for dirpath, _dirs, _files in os.walk(rdir, topdown=False):
            if dirpath == rdir:
                continue
            try:
                os.rmdir(dirpath)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    raise


def check_destination(src: str, dst: str) -> None:
    """UsageError unless ``dst`` can hold the outputs: not SRC itself, and a place that outlives this process.

    An in-memory filesystem (``memory://``) loses every output when the process exits, which with
    ``--delete-source`` would delete the only copy of the cache.
    """
    proto, d = split_root(dst)
    if proto:
        import fsspec
        from fsspec.implementations.memory import MemoryFileSystem

        try:
            cls = fsspec.get_filesystem_class(proto)
        except (ValueError, ImportError):
            return  # open_store names the package to install
        if issubclass(cls, MemoryFileSystem):
            raise UsageError(f"{dst}: an in-memory filesystem does not outlive this process; the outputs would be "
                             "lost (and with --delete-source the sources too). Give a directory or a durable URL")
        return
    if os.path.realpath(d) == os.path.realpath(src):
        raise UsageError("DST must differ from SRC")


def compact(src: str, dst: str, *, jobs: int = 1, dry_run: bool = False, delete_source: bool = False,
            page_bytes: int | None = None, codec: str = "none", level: int = 3, fsync: bool = False,
            mode: int | None = None, progress: CompactProgress | None = None,
            pp_layers: tuple[int, ...] | None = None, cp_interleave: int | None = None,
            platform: str | None = None, seal: str | None = None, keys: Keyring | None = None) -> CompactReport:
    """Compact the legacy root ``src`` into the kvformat root ``dst``. See the module docstring.

    ``pp_layers`` / ``cp_interleave`` / ``platform``: a pipeline-parallel writer's partition, a DCP writer's
    token interleave (required for a DCP tree) and the writer's platform (required when it decides the bytes:
    FP8 caches, the DSA indexer), none of which config.json records (:func:`kvformat.legacy.infer_row` checks
    them).

    ``seal`` (``"authenticate"`` or ``"encrypt"``): write sealed files (spec §12) under ``keys.write_key``;
    existing outputs are opened with any key of ``keys``. Sealed outputs differ byte-wise between runs (each
    file has a fresh random nonce); a re-run still skips every valid output.

    ``progress`` (optional) gets the total, each file and the failure lines.
    ``mode``: exact permission bits of the files written (directories created get ``dir_mode(mode)``);
    None keeps the defaults (0644 files, 0755 directories, filtered by the umask).

    Raises LegacyLayoutError when ``src`` is not a legacy root; OSError passes through.
    """
    check_destination(src, dst)
    if seal is not None and (keys is None or codec != "none"):
        raise UsageError("--seal needs --key (the key the outputs are sealed under) and --codec none "
                         "(sealed files are not compressed)")
    opts = _Options(jobs=jobs, dry_run=dry_run, delete_source=delete_source, page_bytes=page_bytes, codec=codec,
                    level=level, fsync=fsync, mode=None if mode is None or dry_run else mode,
                    hints={"pp_layers": pp_layers, "cp_interleave": cp_interleave, "platform": platform},
                    seal=seal, keys=keys)
    if opts.mode is None:
        return _compact(src, dst, opts, progress or _Silent())
    # A umask no wider than the mode while writing: a file or directory is never created more open than
    # asked, not even between its creation and the chmod. The CLI is its own process; restored after.
    old = os.umask(0o777 & ~dir_mode(opts.mode))
    try:
        return _compact(src, dst, opts, progress or _Silent())
    finally:
        os.umask(old)


@dataclass(frozen=True)
class _Options:
    """What :func:`compact` was asked to do, handed to its steps as one value."""

    jobs: int
    dry_run: bool
    delete_source: bool
    page_bytes: int | None
    codec: str
    level: int
    fsync: bool
    mode: int | None
    hints: dict[str, Any]
    seal: str | None
    keys: Keyring | None


def _compact(src: str, dst: str, opts: _Options, progress: CompactProgress) -> CompactReport:
    t0 = time.monotonic()
    skipped: list[Ignored] = []
    cfg_errors: list[LegacyLayoutError] = []
    namespaces = find_namespaces(src, ignored=skipped, errors=cfg_errors)
    if not namespaces and not cfg_errors:
        raise LegacyLayoutError(f"{src} is not a vLLM fs-tier root: no <model>_<digest>/config.json under it")
    rep = CompactReport(src=src, dst=dst, dry_run=opts.dry_run, jobs=opts.jobs)
    rep.ignored.extend(skipped)
    rep.layout_errors.extend(str(e) for e in cfg_errors)  # reported, exit 2; the other namespaces still convert
    tasks: list[Task] = []
    for ns in namespaces:
        tasks += _plan_namespace(ns, src, rep, opts)
    if opts.dry_run:
        _dry_run(dst, tasks, rep)
    else:
        _convert_all(_open_destination(dst, tasks, opts.mode), src, tasks, rep, opts, progress)
        if opts.delete_source:
            for ns in namespaces:
                _prune_empty_dirs(ns)
    rep.elapsed_s = time.monotonic() - t0
    return rep


def _plan_namespace(ns: LegacyNamespace, src: str, rep: CompactReport, opts: _Options) -> list[Task]:
    """The tasks of one legacy namespace, group by group; what cannot be converted goes into ``rep``."""
    tasks: list[Task] = []
    files = list(iter_legacy_files(ns, rep.ignored, src))
    by_group: dict[int, list[LegacyFile]] = {}
    for f in files:
        by_group.setdefault(f.group, []).append(f)
    for group, gfiles in sorted(by_group.items()):
        size = Counter(f.size for f in gfiles).most_common(1)[0][0]
        try:
            row = infer_row(ns, group, size, page_bytes=opts.page_bytes, **opts.hints)
        except LegacyLayoutError as e:
            e.with_path(os.path.join(ns.root, ns.base))
            rep.layout_errors.append(str(e))
            for f in gfiles:
                rep.ignored.append(Ignored(f.path, f"row layout unknown: {e.message}"))
            continue
        if opts.seal is not None:  # spec §12: the seal level is part of the output namespace
            row = dataclasses.replace(row, layout=row.layout.with_seal(opts.seal))
        hdr_bytes = output_header_bytes(row, gfiles[0])
        n_ok = 0
        for f in gfiles:
            if f.size != row.row_bytes:
                rep.ignored.append(Ignored(f.path, f"size {f.size} fits no row layout of this namespace "
                                           f"(rows are {row.row_bytes} bytes)"))
                continue
            tasks.append(Task(f, row, block_relpath(row.layout, key_for(f)), hdr_bytes + row.layout.payload_bytes))
            n_ok += 1
        rep.namespaces.append({
            "legacy": ns.base, "group": group, "namespace": row.layout.namespace(), "model": ns.model,
            "row": row.kind, "slots": row.copies, "page_bytes": row.page_bytes, "row_bytes": row.row_bytes,
            "padding": row.padding, "files": n_ok,
        })
    return tasks


def _open_destination(dst: str, tasks: list[Task], mode: int | None) -> Store:
    """The destination store, stale temp files removed and every output namespace's namespace.json written."""
    store = open_store(dst)
    store.cleanup_temp(older_than_s=3600.0, dead_writers=True)
    seen = set()
    for t in tasks:
        if t.row.layout.namespace() not in seen:
            seen.add(t.row.layout.namespace())
            ns_name = store.ensure_namespace(t.row.layout)
            if mode is not None and (ns_path := store.local_path(f"{ns_name}/{NAMESPACE_FILE}")) is not None:
                os.chmod(ns_path, mode)
    return store


def _dry_run(dst: str, tasks: list[Task], rep: CompactReport) -> None:
    dst_store = open_store(dst) if os.path.isdir(dst) or split_root(dst) != ("", dst) else None  # any URL
    for t in tasks:
        if dst_store is not None and dst_store.exists(t.rel):
            rep.skipped += 1
            continue
        rep.would_write.append(FileResult("would_write", t.file.path, t.rel, t.file.size, t.after))
        rep.bytes_before += t.file.size
        rep.bytes_after += t.after


def _convert_all(store: Store, src: str, tasks: list[Task], rep: CompactReport, opts: _Options,
                 bar: CompactProgress) -> None:
    worker = Converter(store, codec=opts.codec, level=opts.level, delete_source=opts.delete_source,
                       fsync=opts.fsync, mode=opts.mode, keys=opts.keys, src_root=src if os.path.isdir(src) else None)
    bar.add_total(len(tasks), sum(t.file.size for t in tasks))
    for ig in rep.ignored:
        bar.note(f"ignored {ig.path}: {ig.why}")  # raw: the sink escapes for its terminal

    def handle(r: FileResult) -> None:
        if r.status == "failed":
            rep.failed += 1
            rep.failures.append(r)
            bar.note(f"FAILED {r.src}: {r.error} (source kept)")
        else:
            if r.status == "converted":
                rep.converted += 1
                rep.bytes_read += r.before
            else:
                rep.skipped += 1
            rep.bytes_before += r.before
            rep.bytes_after += r.after
            rep.deleted_sources += int(r.deleted)
        bar.update(r.before)

    if opts.jobs <= 1:
        for t in tasks:
            handle(worker.run(t))
    else:
        with ThreadPoolExecutor(max_workers=opts.jobs, thread_name_prefix="kvf-compact") as ex:
            for r in ex.map(worker.run, tasks):
                handle(r)
    bar.close()
