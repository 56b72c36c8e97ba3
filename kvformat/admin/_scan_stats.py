"""What a scan returns and reports to: per-namespace totals, the scan result, the progress protocol."""

from __future__ import annotations

import errno
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..format import BlockHeader, CanonicalLayout
from ..errors import KVFormatError
from ..legacy import Ignored


class ProgressSink(Protocol):
    """What a long scan reports to: first how much there is (possibly in parts), then each file done."""

    def add_total(self, files: int, nbytes: int) -> None: ...

    def update(self, n_bytes: int, n: int = 1) -> None: ...


@dataclass
class NamespaceStats:
    """Per-namespace totals of a scan; ``to_dict`` is one entry of inspect's ``namespaces``."""

    namespace: str
    layout: CanonicalLayout | None = None
    files: int = 0
    bytes: int = 0
    raw: int = 0
    data: int = 0
    tps: Counter[int] = field(default_factory=Counter)
    key_ids: Counter[str] = field(default_factory=Counter)  # sealed files per key id (spec §12): no key needed
    corrupt: int = 0
    oldest: float | None = None
    newest: float | None = None
    bad: list[dict[str, str]] = field(default_factory=list)
    unreadable: list[dict[str, str]] = field(default_factory=list)

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
            "unreadable": self.unreadable, "seal": lay.seal if lay else None,
            "key_ids": dict(sorted(self.key_ids.items())),
        }

    def add_header(self, hdr: BlockHeader) -> None:
        """Count a good file's header (its layout, writer TP, sizes, seal key id)."""
        if self.layout is None:
            self.layout = hdr.layout
        self.tps[hdr.provenance.tp] += 1
        self.raw += hdr.raw_bytes
        self.data += hdr.data_bytes
        if hdr.seal is not None:
            self.key_ids[hdr.seal.key_id] += 1


@dataclass
class ScanResult:
    """A scan of a kvformat root: per-namespace totals, bad files, unreadable files, skipped paths."""

    accs: list[NamespaceStats]
    bad: list[tuple[str, KVFormatError]]  # (relpath from the store root, error): the file is wrong
    unreadable: list[tuple[str, OSError]]  # (relpath, error): the file could not be read, so not checked
    ignored: list[Ignored]
    namespaces: set[str] = field(default_factory=set)  # directories holding a regular namespace.json


def os_error_text(e: OSError) -> str:
    """An OSError without its file name (the report already names the file)."""
    name = errno.errorcode.get(e.errno or 0, type(e).__name__)
    return f"{name}: {e.strerror or e}"


def totals(nss: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``totals`` object of inspect: namespaces, files, bytes, corrupt."""
    return {"namespaces": len(nss), "files": sum(n["files"] for n in nss), "bytes": sum(n["bytes"] for n in nss),
            "corrupt": sum(n["corrupt"] for n in nss)}
