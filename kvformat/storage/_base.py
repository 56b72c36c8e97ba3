"""The storage interface: shared public methods on a few backend primitives.

The split follows fsspec's public/``_private`` pattern. Everything that must behave the same on every
backend lives here once: the read pipeline (header, ``expect``/``key``, copy or decode, zero on
failure: :func:`kvformat.format._read.read_payload_from`), error paths, quarantine names, taking a write's body
before an asynchronous backend may outlive the caller. A backend implements only:

``_open_many(relpaths, head_only, timeout_s)``
    yield ``(index, source or exception)`` per path, as each becomes ready; a source is an open
    :class:`~kvformat.format._read.FileSource` or a fetched :class:`~kvformat.format._read.BytesSource`
    (``head_only``: at least the header region, and the object's true size).
``_put_many(items, overwrite, fsync, timeout_s)``
    atomic writes, per item True / False (existed) / the exception.
``_delete_many``, ``_move`` (one file to a new relpath, for quarantine: only the file that was read,
when its identity is given), ``_exists_many``, ``list``, ``touch``, ``read_bytes``, ``cleanup_temp``.
"""

from __future__ import annotations

import builtins  # annotations inside Store name builtins.list: Store.list shadows it there
import abc
import functools
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..format import (
    FILE_SUFFIX, NAMESPACE_FILE, QUARANTINE_DIR, BlockHeader, BlockKey, BytesSource, CanonicalLayout, FileId,
    FileSource, HeaderTemplates, Keyring, Provenance, as_bytes_view, block_relpath, encode, namespace_doc,
    read_header_from, read_payload_from,
)
from ..errors import KVFormatError


@dataclass(frozen=True)
class StoreEntry:
    """One stored file: path relative to the root, size in bytes, mtime (LRU clock, seconds)."""

    relpath: str
    size: int
    mtime: float


# What a move for quarantine found: the file read is now in quarantine; no file is at the name any more;
# the name holds another file than the one read (published since): left where it is.
MOVED, GONE, REPLACED = "moved", "gone", "replaced"
UNKNOWN = "unknown"  # the error names no file identity: nothing is moved by name


@dataclass(frozen=True)
class Quarantined:
    """What :meth:`Store.quarantine_read` did: ``outcome`` is ``"moved"`` (the file that was read is now at
    ``relpath``), ``"gone"`` (no file at the name any more), ``"replaced"`` (the name holds another file
    than the one read, published since: left alone) or ``"unknown"`` (the error carried no identity)."""

    outcome: str
    relpath: str | None = None


# A check run on each header while its file is still open (a key, layout or placement check): an error it
# raises names the file read, like an error of the pipeline itself, so a quarantine can move exactly it.
HeaderCheck = Callable[[str, BlockHeader], None]


def quarantine_relpath(relpath: str, reason: str) -> str:
    """Where :meth:`Store.quarantine` moves ``relpath``: ``.quarantine/<relpath>.<reason>``."""
    return f"{QUARANTINE_DIR}/{relpath}.{reason}"


class Store(abc.ABC):
    """A root holding kvformat namespaces. All paths are '/'-separated and relative to ``root``.

    Writes are atomic (no partial file is ever visible under a final name). Reads check the
    header (and ``expect``/``key``) before touching ``out``; any later failure zero-fills
    ``out[:payload_bytes]`` (F-5.5), on every backend alike. Use as a context manager or call
    :meth:`close`.

    Capability flags (class attributes, read by callers and by the shared methods):

    ``asynchronous``: I/O runs on another thread with deadlines, so a call may return (time out)
    while requests are still in flight; :meth:`put_many` then copies each body before handing it
    over, so a timed-out write never reads the caller's buffer again.
    ``exclusive_create``: concurrent ``put(overwrite=False)`` of one path leaves exactly one winner.
    ``supports_o_direct``: payload reads can bypass the page cache.
    ``durable_put``: a completed put survives power loss without ``fsync`` (object stores).
    ``reads_may_hang``: a read may block far longer than any request waits (network or FUSE storage: a stopped
    server, a partition). Loads from such a store read into a private buffer, so one given up on at its deadline
    can never write into KV memory later (cache/_row_load.py).
    ``is_local``: the root is a local directory tree (:meth:`local_path` names its files).
    """

    root: str
    asynchronous: bool = False
    exclusive_create: bool = True
    supports_o_direct: bool = False
    durable_put: bool = False
    reads_may_hang: bool = True
    is_local: bool = False
    closed: bool = False

    # -- backend primitives -------------------------------------------------------------------
    @abc.abstractmethod
    def _open_many(self, relpaths: Sequence[str], *, head_only: bool,
                   timeout_s: float | None) -> Iterator[tuple[int, FileSource | BytesSource | BaseException]]:
        """Yield ``(index, source or exception)`` for every path, each exactly once, in any order."""

    @abc.abstractmethod
    def _put_many(self, items: Sequence[tuple[str, list[Any]]], *, overwrite: bool, fsync: bool,
                  timeout_s: float | None) -> builtins.list[bool | BaseException]:
        """Atomically write each item's parts; per item True, False (existed) or the exception."""

    @abc.abstractmethod
    def _delete_many(self, relpaths: Sequence[str], timeout_s: float | None) -> builtins.list[bool | BaseException]:
        """Remove each path; per item True, False (absent) or the exception."""

    @abc.abstractmethod
    def _move(self, src: str, dst: str, file_id: FileId | None = None) -> str:
        """Move one file to a new relpath (replacing one there): MOVED, GONE (``src`` is gone) or, with
        ``file_id``, REPLACED when the file at ``src`` is not that one (it is then left at ``src``)."""

    @abc.abstractmethod
    def _exists_many(self, relpaths: Sequence[str], timeout_s: float | None) -> builtins.list[bool]:
        """Whether each path is a stored file (a failed lookup reads as absent: a miss, never a false hit)."""

    @abc.abstractmethod
    def _where(self, relpath: str) -> str:
        """The path or URL of ``relpath`` as errors report it (never with credentials)."""

    def _check(self, relpath: str) -> None:
        """Raise ValueError for a path that is not a plain relative path inside the root."""
        parts = relpath.split("/")
        if not relpath or relpath.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"path {relpath!r} leaves the store root")

    def _noted(self, relpath: str, present: bool) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Hook: an operation just learned whether ``relpath`` exists (remote stores cache it)."""

    def _live(self) -> None:
        """Hook called before every operation: raise on a closed store (backends also re-arm after fork)."""
        if self.closed:
            raise ValueError(f"{self!r}: I/O operation on a closed store")

    # -- other backend operations ---------------------------------------------------------------
    @abc.abstractmethod
    def read_bytes(self, relpath: str) -> bytes:
        """The whole file (small files: namespace.json, tests)."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[StoreEntry]:
        """Every regular ``.kvf`` file under ``prefix`` (never follows symlinks; skips temp and quarantine)."""

    @abc.abstractmethod
    def touch(self, relpath: str) -> None:
        """Mark as recently used (sets mtime to now); nothing happens if the file is gone."""

    def cleanup_temp(self, older_than_s: float = 0.0, *, dead_writers: bool = False) -> int:
        """Remove leftover temp files of crashed writers: those older than ``older_than_s`` and, with
        ``dead_writers``, those whose writer process is known to be gone (where the backend can tell).
        Returns how many were removed."""
        return 0

    @abc.abstractmethod
    def list_dir(self, prefix: str) -> builtins.list[StoreEntry]:
        """The regular files directly under directory ``prefix`` (any name; none if it does not exist).

        For small control directories (the tiers' coordination under ``.kvformat/``), not for block trees."""

    def root_identity(self) -> tuple[int, ...] | None:
        """What makes the root *this* root for as long as the store runs (a local directory: its device and
        inode, which change when the mount under the path goes away); None where storage has no such notion."""
        return None

    def _namespace_dirs(self) -> Iterable[str]:
        return ()

    # -- capabilities (what a caller asks of any store instead of testing its type) --------------------
    def local_path(self, relpath: str) -> str | None:
        """The filesystem path of ``relpath`` on a local root (for a stat, a chmod); None elsewhere."""
        return None

    def fsspec_location(self, relpath: str) -> tuple[Any, str] | None:
        """``(fsspec filesystem, path)`` of ``relpath`` on an fsspec store (raw access past it: tests); else None."""
        return None

    def forget(self, relpaths: Iterable[str] | None = None) -> None:  # noqa: B027 (optional, not abstract)
        """Drop cached existence answers (all by default), where the store caches them."""

    def namespace_dirs(self) -> builtins.list[str]:
        """Directories holding a ``namespace.json``, found without listing block files (none if unknowable)."""
        return sorted(self._namespace_dirs())

    def make_parent(self, relpath: str, keep: int = 1) -> None:  # noqa: B027 (optional, not abstract)
        """Create the directories above ``relpath`` below its first ``keep`` levels (which must exist)."""

    @property
    def fused_io(self) -> bool:
        """Whether :meth:`read_into_fused` and :meth:`put_fused` are offered (a plain local root)."""
        return False

    def read_into_fused(self, relpath: str, out: Any, *, expect: CanonicalLayout, key: BlockKey | None = None,
                        verify: bool = True, o_direct: bool = False, keys: Keyring | None = None,
                        templates: HeaderTemplates | None = None) -> BlockHeader:
        """:meth:`read_into` in one read, hashed as it lands (where :attr:`fused_io`); ``out`` is zeroed on any
        failure, even a header's: for the tier, to which all are misses. ``templates``: spec §11.1."""
        raise NotImplementedError(f"{type(self).__name__} has no fused I/O")

    def put_fused(self, relpath: str, header: bytes, payload: Any, *, fsync: bool = False, o_direct: bool = False,
                  keep_parents: int | None = None, others: tuple[Any, int, int] | None = None) -> bool:
        """One write of a new uncompressed file (False if one is there), hashing ``payload`` into ``header``'s zero
        ``kvf.dxxh3`` (:attr:`fused_io`). ``keep_parents``: see :meth:`make_parent`; ``others``: copies to match."""
        raise NotImplementedError(f"{type(self).__name__} has no fused I/O")

    # -- shared public methods ------------------------------------------------------------------
    def read_into(self, relpath: str, out: Any, *, expect: CanonicalLayout | None = None,
                  key: BlockKey | None = None, verify: bool = True, keys: Keyring | None = None,
                  data_check: Callable[[BlockHeader, memoryview], None] | None = None) -> BlockHeader:
        """Read and check a file, payload into ``out``. KVFormatError on bad bytes, OSError passes.

        ``out`` is untouched unless the header, layout and key passed; after that any failure
        leaves ``out[:payload_bytes]`` zeroed. A sealed file is opened with ``keys`` (spec §12).
        ``data_check``: the data checksum's check done by the caller (format's ``read_payload_from``).
        """
        r = self.read_many_into([(relpath, out, key)], expect=expect, verify=verify, keys=keys,
                                data_check=data_check)[0]
        if isinstance(r, BaseException):
            raise r
        return r

    def read_many_into(self, items: Sequence[tuple[str, Any, BlockKey | None]], *,
                       expect: CanonicalLayout | None = None, verify: bool = True,
                       timeout_s: float | None = None, keys: Keyring | None = None,
                       stored_only: bool = False, data_check: Callable[[BlockHeader, memoryview], None] | None = None,
                       ) -> builtins.list[BlockHeader | BaseException]:
        """Read many files, each into its ``out`` (concurrently where the backend can).

        Per item the header or the exception (KVFormatError with ``path`` set, OSError, or ValueError
        for an unusable destination). Each ``out`` follows :meth:`read_into`'s rules. ``stored_only``
        (maintenance without keys): sealed files are checked against their stored-data checksum only and
        ``out`` receives their stored bytes (spec §12.6); never for serving.
        """
        self._live()
        rels = [r for r, _, _ in items]
        for r in rels:
            self._check(r)
        res: builtins.list[BlockHeader | BaseException | None] = [None] * len(items)
        for i, src in self._open_many(rels, head_only=False, timeout_s=timeout_s):
            rel, out, key = items[i]
            res[i] = self._one(rel, src, functools.partial(_read_payload, out=_buffer(out), expect=expect, key=key,
                                                           verify=verify, keys=keys, stored_only=stored_only,
                                                           data_check=data_check))
        return res  # type: ignore[return-value]

    def read_header(self, relpath: str, *, verify: bool = True, check: HeaderCheck | None = None) -> BlockHeader:
        """Read and check only the header (no payload read); ``check`` as in :meth:`read_headers_many`."""
        r = self.read_headers_many([relpath], verify=verify, check=check)[0]
        if isinstance(r, BaseException):
            raise r
        return r

    def read_headers_many(self, relpaths: Iterable[str], *, verify: bool = True, timeout_s: float | None = None,
                          check: HeaderCheck | None = None) -> builtins.list[BlockHeader | BaseException]:
        """Headers of many files; per item the header or the error (KVFormatError or OSError) it raised.

        ``check(relpath, header)`` runs while the file is still open; a KVFormatError it raises is that
        item's result and, like every error of a bad file, names the file read (``file_id``), so
        :meth:`quarantine_read` moves exactly that file.
        """
        self._live()
        rels = list(relpaths)
        for r in rels:
            self._check(r)
        res: builtins.list[BlockHeader | BaseException | None] = [None] * len(rels)
        for i, src in self._open_many(rels, head_only=True, timeout_s=timeout_s):
            res[i] = self._one(rels[i], src, functools.partial(_read_checked, rel=rels[i], verify=verify, check=check))
        return res  # type: ignore[return-value]

    def _one(self, rel: str, src: Any, fn: Any) -> Any:
        """Run one pipeline step on an opened source; the result or the (annotated) exception."""
        if isinstance(src, BaseException):
            if isinstance(src, FileNotFoundError):
                self._noted(rel, False)
            return src.with_path(self._where(rel)) if isinstance(src, KVFormatError) else src
        try:
            with src:
                r = fn(src)
        except KVFormatError as e:
            return e.with_path(self._where(rel))
        except (OSError, ValueError) as e:  # OS errors pass through; ValueError: the caller's destination
            return e
        self._noted(rel, True)
        return r

    def put(self, relpath: str, parts: builtins.list[Any], *, overwrite: bool = False, fsync: bool = False) -> bool:
        """Atomically write the concatenation of ``parts``. False if it existed and not ``overwrite``."""
        r = self.put_many([(relpath, parts)], overwrite=overwrite, fsync=fsync)[0]
        if isinstance(r, BaseException):
            raise r
        return bool(r)

    def put_many(self, items: Sequence[tuple[str, builtins.list[Any]]], *, overwrite: bool = False,
                 fsync: bool = False, timeout_s: float | None = None) -> builtins.list[bool | BaseException]:
        """Write many files (concurrently where the backend can). Per item: True (written), False
        (existed, not ``overwrite``), or the exception. No buffer in ``parts`` is read after return."""
        self._live()
        for rel, _ in items:
            self._check(rel)
        items = [(rel, [_buffer(p) for p in parts]) for rel, parts in items]
        if self.asynchronous:
            # Taken here, in the caller's thread: a request still queued or retried after the
            # caller's deadline must not read a buffer the caller has since reused (a vLLM row slot).
            items = [(rel, [b"".join(as_bytes_view(p) for p in parts)]) for rel, parts in items]
        res = self._put_many(items, overwrite=overwrite, fsync=fsync, timeout_s=timeout_s)
        for (rel, _), r in zip(items, res):
            if not isinstance(r, BaseException):
                self._noted(rel, True)
        return res

    def exists(self, relpath: str) -> bool:
        """Whether ``relpath`` is a stored file."""
        return self.exists_many([relpath])[0]

    def exists_many(self, relpaths: Iterable[str], *, timeout_s: float | None = None) -> builtins.list[bool]:
        """Existence of many files (a failed lookup reads as absent)."""
        self._live()
        rels = list(relpaths)
        for r in rels:
            self._check(r)
        return self._exists_many(rels, timeout_s)

    def delete(self, relpath: str) -> bool:
        """Remove; False if it was not there."""
        r = self.delete_many([relpath])[0]
        if isinstance(r, BaseException):
            raise r
        return bool(r)

    def delete_many(self, relpaths: Sequence[str], *,
                    timeout_s: float | None = None) -> builtins.list[bool | BaseException]:
        """Remove many files. Per item: True, False (absent) or the exception."""
        self._live()
        rels = list(relpaths)
        for r in rels:
            self._check(r)
        res = self._delete_many(rels, timeout_s)
        for r in rels:
            self._noted(r, False)
        return res

    def quarantine(self, relpath: str, reason: str, *, file_id: FileId | None = None) -> str | None:
        """Move a bad file aside to ``.quarantine/<relpath>.<reason>``; its new relpath (None if nothing moved).

        With ``file_id`` (the ``file_id`` of the error the read raised) only that very file is moved: a file
        published under the same name since the read (a concurrent store, another process) stays where it
        is. Without it, whatever file is at ``relpath`` is moved (an operator's explicit request).
        """
        return self._quarantine(relpath, reason, file_id).relpath

    def quarantine_read(self, relpath: str, err: KVFormatError) -> Quarantined:
        """Move aside the file whose read raised ``err``, and only that file (``err.file_id``, G-5.5).

        The one quarantine of files found bad (the tier's loads, stores and probes, ``verify
        --quarantine``, local and remote). An error that carries no identity moves nothing. OSError
        passes (the move failed: the file stays where it was).
        """
        if err.file_id is None:
            return Quarantined(UNKNOWN)
        return self._quarantine(relpath, err.reason, err.file_id)

    def _quarantine(self, relpath: str, reason: str, file_id: FileId | None) -> Quarantined:
        self._live()
        self._check(relpath)
        dst = quarantine_relpath(relpath, reason)
        self._check(dst)
        outcome = self._move(relpath, dst, file_id)
        if outcome != REPLACED:
            self._noted(relpath, False)
        return Quarantined(outcome, dst if outcome == MOVED else None)

    def put_block(self, payload: Any, layout: CanonicalLayout, key: BlockKey, *,
                  provenance: Provenance | None = None, codec: str = "none", level: int = 3,
                  fsync: bool = False, overwrite: bool = False,
                  keys: Keyring | None = None) -> tuple[str, int, bool]:
        """Encode and store one block at its canonical path (sealed under ``keys`` when ``layout.seal``).
        Returns (relpath, file bytes, written).

        The block's namespace gets its ``namespace.json`` first (once per store and namespace), so a root
        written only through this call is one that ``kvformat inspect``/``verify``/``gc`` accept.
        """
        rel = block_relpath(layout, key)
        hdr, data = encode(_buffer(payload), layout, key, provenance=provenance, codec=codec, level=level, keys=keys)
        self._namespace_once(layout)
        wrote = self.put(rel, [hdr, data], overwrite=overwrite, fsync=fsync)
        return rel, len(hdr) + len(data), wrote

    def _namespace_once(self, layout: CanonicalLayout) -> None:
        # A set filled on first use: backends do not call a base __init__. Two threads racing here both
        # call ensure_namespace, whose put never overwrites, so the race costs one extra existence check.
        done: set[str] = self.__dict__.setdefault("_namespaces_ensured", set())
        ns = layout.namespace()
        if ns not in done:
            self.ensure_namespace(layout)
            done.add(ns)

    def ensure_namespace(self, layout: CanonicalLayout) -> str:
        """Write ``<namespace>/namespace.json`` if missing; returns the namespace."""
        ns = layout.namespace()
        rel = f"{ns}/{NAMESPACE_FILE}"
        if not self.exists(rel):
            self.put(rel, [json.dumps(namespace_doc(layout), indent=2, sort_keys=True).encode() + b"\n"])
        return ns

    def namespaces(self) -> builtins.list[str]:
        """Namespaces present (directories holding a namespace.json)."""
        return sorted({e.relpath.split("/", 1)[0] for e in self.list()} | set(self._namespace_dirs()))

    def close(self) -> None:
        """Release connections, sessions and threads (idempotent); later calls raise ValueError."""
        self.closed = True

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["Store", "StoreEntry", "Quarantined", "quarantine_relpath", "FILE_SUFFIX", "QUARANTINE_DIR"]


def _buffer(obj: Any) -> Any:  # a tensor (the stager's rows, a user's) as bytes for format/: torch only if given one
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):
        from ..torch import as_buffer
        return as_buffer(obj)
    return obj


def _read_checked(src: Any, *, rel: str, verify: bool, check: HeaderCheck | None) -> BlockHeader:
    hdr = read_header_from(src, verify)
    if check is not None:
        check(rel, hdr)  # inside the source's with-block: its error is tagged with the file read
    return hdr


def _read_payload(src: Any, *, out: Any, expect: Any, key: Any, verify: bool, keys: Keyring | None,
                  stored_only: bool, data_check: Any = None) -> BlockHeader:
    # One bound call per item (a lambda in the loop would see the loop's last item when called later).
    return read_payload_from(src, out, expect=expect, key=key, verify=verify, keys=keys, stored_only=stored_only,
                             data_check=data_check)
