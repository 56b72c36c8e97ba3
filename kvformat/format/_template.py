"""Header templates (spec §11.1): the headers of one deployment's files differ only in a few per-file fields.

A reader that has fully decoded and checked a header region (F-3.x, F-4.x, F-5.1, F-9.1, F-9.2) keeps it. A later
region of the same length that equals it byte for byte outside the per-file fields (``kvf.key``, ``kvf.dxxh3``,
``kvf.hxxh3``, ``kvf.created``), whose fields still hold their syntax (lowercase hex, canonical decimal) and
whose header checksum holds (when verifying), decodes to the same header with those values: the values are
JSON strings of hex digits or decimal digits, which cannot change the document's structure. So the reader
checks it with one ``memcmp`` and one xxh3 (``_native.header_match``) instead of parsing JSON on every load.

A writer does the converse (:class:`HeaderEncoder`): the header region of a deployment's next file is its last
one with the key's digits and the creation time replaced, byte-identical to :func:`encode_header`'s.

Bytes only; never opens files.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from . import _native
from ._consts import HEX64_LEN
from ._header import _hxxh3_pos, encode_header
from ._header_json import _with_created
from ._spec import BlockHeader, BlockKey, CanonicalLayout, Provenance
from ..errors import ChecksumError

_HEX, _DEC = 0, 1
_KEY, _DXXH3, _CREATED = b'"kvf.key":"', b'"kvf.dxxh3":"', b'"kvf.created":"'


def _value_span(region: bytes, field: bytes, value: str) -> tuple[int, int] | None:
    """Where ``field``'s string value sits, if the field occurs exactly once and holds ``value``."""
    at = region.find(field)
    if at < 0 or region.find(field, at + 1) >= 0:
        return None
    start = at + len(field)
    end = start + len(value)
    if region[start:end] != value.encode() or region[end:end + 1] != b'"':
        return None
    return start, end


class _Template:
    __slots__ = ("region", "hdr", "spans", "key", "dxxh3", "hxxh3", "created")

    def __init__(self, region: bytes, hdr: BlockHeader, key: tuple[int, int], dxxh3: tuple[int, int], hxxh3: int,
                 created: tuple[int, int]) -> None:
        self.region, self.hdr, self.key, self.dxxh3, self.hxxh3, self.created = region, hdr, key, dxxh3, hxxh3, created
        spans = sorted([(*key, _HEX), (*dxxh3, _HEX), (hxxh3, hxxh3 + HEX64_LEN, _HEX), (*created, _DEC)])
        self.spans = np.array(spans, dtype=np.int64).tobytes()


class HeaderTemplates:
    """The last few header regions a reader of ``layout`` fully decoded and checked (thread-safe: many I/O threads
    match at once; a lost :meth:`learn` race only costs one more full parse)."""

    def __init__(self, layout: CanonicalLayout, limit: int = 4) -> None:
        self.layout = layout
        self.limit = limit
        self._items: tuple[_Template, ...] = ()
        self.matched = 0  # loads checked by template (tests and benchmarks read these)
        self.parsed = 0

    def learn(self, region: bytes, hdr: BlockHeader) -> None:
        """Keep ``region``, which decoded to ``hdr`` and passed every check against :attr:`layout` and its key."""
        self.parsed += 1
        if hdr.codec != "none" or len(region) != hdr.data_offset or hdr.layout is not self.layout and \
                hdr.layout != self.layout:
            return
        if any(t.region == region for t in self._items):
            return
        key = _value_span(region, _KEY, hdr.key.hash)
        dxxh3 = _value_span(region, _DXXH3, hdr.data_xxh3)
        created = _value_span(region, _CREATED, str(hdr.provenance.created))
        if key is None or dxxh3 is None or created is None:
            return  # a field we cannot place exactly once: this header is always parsed
        t = _Template(bytes(region), hdr, key, dxxh3, _hxxh3_pos(region), created)
        self._items = (t,) + self._items[:self.limit - 1]

    def match(self, head: memoryview, file_bytes: int, key: BlockKey, verify: bool) -> BlockHeader | None:
        """The header of ``head`` (the file's whole header region) if it matches a template and holds ``key``;
        None: parse it. Raises :class:`ChecksumError` (region header) when it matches but its checksum is wrong,
        as the full decode would (F-5.1)."""
        want = None
        for t in self._items:
            if len(head) != len(t.region) or file_bytes != t.hdr.file_bytes or key.group != t.hdr.key.group:
                continue
            ks, ke = t.key
            if want is None:
                want = key.hash.encode()
            if head[ks:ke] != want:
                continue
            status, computed = _native.header_match(head, t.region, t.spans, t.hxxh3, verify)
            if status == 1:
                continue
            stored = bytes(head[t.hxxh3:t.hxxh3 + HEX64_LEN]).decode()
            if status == 2:
                raise ChecksumError("header", stored, f"{computed:016x}")  # F-5.1
            self.matched += 1
            dx = bytes(head[t.dxxh3[0]:t.dxxh3[1]]).decode()
            created = int(bytes(head[t.created[0]:t.created[1]]))
            if created > (1 << 62):
                return None  # out of kvf.created's range: the full decode says so (F-4.5)
            out = object.__new__(BlockHeader)
            out.__dict__.update(t.hdr.__dict__, key=key, provenance=_with_created(t.hdr.provenance, created),
                                header_xxh3=stored, data_xxh3=dx, raw_xxh3=dx)
            return out
        return None


class HeaderEncoder:
    """:func:`encode_header` for one writer's uncompressed files with ``kvf.dxxh3`` left as zeros (the fused
    write patches it): the last region made, with the key's digits and the creation time replaced."""

    def __init__(self, layout: CanonicalLayout, provenance: Provenance) -> None:
        self.layout = layout
        self.provenance = provenance
        self._lock = threading.Lock()
        self._last: tuple[int, bytes, tuple[int, int], int] | None = None  # created, region, key span, hash length

    def encode(self, key: BlockKey, created: int | None = None) -> bytes:
        """The header region for ``key``, created ``created`` (default: now), with ``kvf.dxxh3`` zero. Its
        ``kvf.hxxh3`` digits are stale: the fused write (``pwrite_hash``) recomputes them after patching
        ``kvf.dxxh3``, so only that write may publish it."""
        when = int(time.time()) if created is None else created
        last = self._last
        if last is not None and last[0] == when and last[3] == len(key.hash) and key.group == self.layout.group:
            _, region, (ks, ke), _ = last
            buf = bytearray(region)
            buf[ks:ke] = key.hash.encode()
            return bytes(buf)
        prov = _with_created(self.provenance, when)
        region = encode_header(self.layout, key, prov, codec="none", data_bytes=self.layout.payload_bytes,
                               data_xxh3="0" * HEX64_LEN, raw_xxh3="0" * HEX64_LEN)
        span = _value_span(region, _KEY, key.hash)
        if span is not None:
            with self._lock:
                self._last = (when, region, span, len(key.hash))
        return region


__all__ = ["HeaderTemplates", "HeaderEncoder"]
