"""The scan of a store (remote roots): batched header rounds, payload rounds bounded in bytes held."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ..format import (
    BLOCK_PATH_HELP, NAMESPACE_FILE, BlockHeader, Keyring, block_path_parts, layout_from_namespace_doc,
    placement_error,
)
from ._scan_stats import NamespaceStats, ProgressSink
from ..errors import KVFormatError
from ..storage import Store, StoreEntry

# Objects per header round, and payload bytes held in memory per verify round (remote stores).
_BATCH = 256
_VERIFY_BATCH_BYTES = 256 << 20


def _chunks(entries: Sequence[StoreEntry], n: int) -> Iterator[Sequence[StoreEntry]]:
    for i in range(0, len(entries), n):
        yield entries[i:i + n]


def placed(relpath: str, hdr: BlockHeader) -> None:
    """Raise the error a load would raise for a file stored at ``relpath`` (:func:`placement_error`): a check
    for :meth:`Store.read_headers_many`, so the error names the object read (a quarantine moves only it)."""
    err = placement_error(relpath, hdr)
    if err is not None:
        raise err


def _headers(store: Store, rels: list[str]) -> list[BlockHeader | BaseException]:
    return store.read_headers_many(rels, verify=True, check=placed)  # batched and concurrent on remote stores


def _payloads(store: Store, items: list[tuple[str, Any, None]],
              keys: Keyring | None) -> list[BlockHeader | BaseException]:
    # Sealed files: authenticated with ``keys``; without keys, their stored bytes are checked (spec §12.6).
    got: list[BlockHeader | BaseException] = store.read_many_into(items, verify=True, keys=keys,
                                                                   stored_only=keys is None)
    return got


def scan_store(store: Store, prefix: str = "", *, verify: bool = False,
               progress: ProgressSink | None = None, ignored: list[dict[str, str]] | None = None,
               keys: Keyring | None = None) -> tuple[list[NamespaceStats], list[tuple[str, KVFormatError]]]:
    """Every block file's header under ``prefix`` (every payload too with ``verify``), per namespace.

    As for local roots, only objects at a block path inside a namespace (one holding namespace.json)
    are checked, each exactly as a load checks it (key and namespace against its path); others are
    appended to ``ignored``.

    Objects removed since the listing are skipped; a transport failure (server down, timeout) raises
    its OSError (exit 2), since a partial pass must not read as "all good".
    """
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
    t = _Tally(verify, progress)
    for chunk in _chunks(entries, _BATCH):
        # sort() keeps only entries whose header read gave a BlockHeader
        good: list[tuple[Any, BlockHeader]] = [
            (e, h) for e, h in zip(chunk, _headers(store, [e.relpath for e in chunk]))
            if t.sort(e, h) and isinstance(h, BlockHeader)]
        if not verify:
            for e, h in good:
                t.ok(e, h)
            continue
        while good:  # payload rounds bounded in bytes held at once
            take, held = 0, 0
            while take < len(good) and (take == 0 or held + good[take][1].raw_bytes <= _VERIFY_BATCH_BYTES):
                held += good[take][1].raw_bytes
                take += 1
            part, good = good[:take], good[take:]
            res = _payloads(store, [(e.relpath, bytearray(h.raw_bytes), None) for e, h in part], keys)
            for (e, _), r in zip(part, res):
                if t.sort(e, r) and isinstance(r, BlockHeader):
                    t.ok(e, r)
                if progress is not None:
                    progress.update(e.size)
    accs = t.accs
    if prefix:
        accs.setdefault(prefix, NamespaceStats(prefix))
    else:  # empty namespaces still show up
        for ns in store.namespace_dirs():
            accs.setdefault(ns, NamespaceStats(ns))
    for acc in accs.values():
        if acc.layout is None:
            try:
                acc.layout = layout_from_namespace_doc(store.read_bytes(f"{acc.namespace}/{NAMESPACE_FILE}"))
            except (FileNotFoundError, ValueError):
                pass
    return [accs[k] for k in sorted(accs)], t.bad


class _Tally:
    """The per-namespace stats and bad files of one :func:`scan_store` pass, fed one read result at a time."""

    def __init__(self, verify: bool, progress: ProgressSink | None) -> None:
        self.verify, self.progress = verify, progress
        self.accs: dict[str, NamespaceStats] = {}
        self.bad: list[tuple[str, KVFormatError]] = []

    def ok(self, e: StoreEntry, h: BlockHeader) -> None:
        self._acc(e).add_header(h)

    def fail(self, e: StoreEntry, err: KVFormatError) -> None:
        acc = self._acc(e)
        acc.corrupt += 1
        acc.bad.append({"path": e.relpath, "reason": err.reason, "message": err.message})
        self.bad.append((e.relpath, err))

    def _acc(self, e: StoreEntry) -> NamespaceStats:
        ns = e.relpath.split("/", 1)[0]
        acc = self.accs.get(ns) or self.accs.setdefault(ns, NamespaceStats(ns))
        acc.files += 1
        acc.bytes += e.size
        acc.add_time(e.mtime)
        return acc

    def sort(self, e: StoreEntry, r: Any) -> bool:
        """True when ``r`` is a header of a file in its place; records a bad file; raises a transport error."""
        if isinstance(r, FileNotFoundError):
            return False  # removed since the listing (gc, a tier quarantining it)
        if isinstance(r, KVFormatError):
            self.fail(e, r)
            return False
        if isinstance(r, BaseException):
            raise r
        if self.progress is not None and not self.verify:
            self.progress.update(e.size)
        return True
