"""The storage interface. Backends implement the underscore methods; shared work lives here."""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from .._format import encode
from ..errors import KVFormatError
from .._spec import (
    FILE_SUFFIX, NAMESPACE_FILE, QUARANTINE_DIR, BlockHeader, BlockKey, CanonicalLayout, Provenance,
    block_relpath, namespace_doc,
)


@dataclass(frozen=True)
class StoreEntry:
    """One stored file: path relative to the root, size in bytes, mtime (LRU clock, seconds)."""

    relpath: str
    size: int
    mtime: float


class Store(abc.ABC):
    """A root holding kvformat namespaces. All paths are '/'-separated and relative to ``root``.

    Writes are atomic (no partial file is ever visible under a final name). Reads check the
    header (and ``expect``/``key``) before touching ``out``, and zero ``out`` on a checksum error.
    """

    root: str

    # -- backend primitives -------------------------------------------------------------------
    @abc.abstractmethod
    def put(self, relpath: str, parts: list[Any], *, overwrite: bool = False, fsync: bool = False) -> bool:
        """Atomically write the concatenation of ``parts``. False if it existed and not ``overwrite``."""

    @abc.abstractmethod
    def read_into(self, relpath: str, out: Any, *, expect: CanonicalLayout | None = None,
                  key: BlockKey | None = None, verify: bool = True) -> BlockHeader:
        """Read and check a file, payload into ``out``. KVFormatError on bad bytes, OSError passes."""

    @abc.abstractmethod
    def read_header(self, relpath: str, *, verify: bool = True) -> BlockHeader:
        """Read and check only the header."""

    @abc.abstractmethod
    def read_bytes(self, relpath: str) -> bytes:
        """The whole file (small files: namespace.json, tests)."""

    @abc.abstractmethod
    def exists(self, relpath: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, relpath: str) -> bool:
        """Remove; False if it was not there."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[StoreEntry]:
        """Every regular ``.kvf`` file under ``prefix`` (never follows symlinks; skips temp and quarantine)."""

    @abc.abstractmethod
    def touch(self, relpath: str) -> None:
        """Mark as recently used (sets mtime to now)."""

    @abc.abstractmethod
    def quarantine(self, relpath: str, reason: str) -> str | None:
        """Move a bad file aside under ``.quarantine/``; returns its new relpath (None if gone)."""

    def cleanup_temp(self, older_than_s: float = 0.0, *, dead_writers: bool = False) -> int:
        """Remove leftover temp files of crashed writers: those older than ``older_than_s`` and, with
        ``dead_writers``, those whose writer process is known to be gone (where the backend can tell).
        Returns how many were removed."""
        return 0

    # -- batched forms (remote backends override with concurrent versions) ----------------------
    def exists_many(self, relpaths: Iterable[str]) -> list[bool]:
        return [self.exists(p) for p in relpaths]

    def read_headers_many(self, relpaths: Iterable[str], *, verify: bool = True) -> list[BlockHeader | BaseException]:
        """Headers of many files; per item the header or the error (KVFormatError or OSError) it raised."""
        out: list[BlockHeader | BaseException] = []
        for p in relpaths:
            try:
                out.append(self.read_header(p, verify=verify))
            except (OSError, KVFormatError) as e:
                out.append(e)
        return out

    # -- shared work ------------------------------------------------------------------------------
    def put_block(self, payload: Any, layout: CanonicalLayout, key: BlockKey, *,
                  provenance: Provenance | None = None, codec: str = "none", level: int = 3,
                  fsync: bool = False, overwrite: bool = False) -> tuple[str, int, bool]:
        """Encode and store one block at its canonical path. Returns (relpath, file bytes, written)."""
        rel = block_relpath(layout, key)
        hdr, data = encode(payload, layout, key, provenance=provenance, codec=codec, level=level)
        wrote = self.put(rel, [hdr, data], overwrite=overwrite, fsync=fsync)
        return rel, len(hdr) + len(data), wrote

    def ensure_namespace(self, layout: CanonicalLayout) -> str:
        """Write ``<namespace>/namespace.json`` if missing; returns the namespace."""
        ns = layout.namespace()
        rel = f"{ns}/{NAMESPACE_FILE}"
        if not self.exists(rel):
            self.put(rel, [json.dumps(namespace_doc(layout), indent=2, sort_keys=True).encode() + b"\n"])
        return ns

    def namespaces(self) -> list[str]:
        """Namespaces present (directories holding a namespace.json)."""
        return sorted({e.relpath.split("/", 1)[0] for e in self.list()} | set(self._namespace_dirs()))

    def _namespace_dirs(self) -> Iterable[str]:
        return ()


__all__ = ["Store", "StoreEntry", "FILE_SUFFIX", "QUARANTINE_DIR"]
