"""Header encode/decode (spec §3-§5, §7): the binary frame (length, fixed prefix, checksum). Takes and returns
bytes; never opens files. The JSON inside is parsed by :mod:`._header_json`."""

from __future__ import annotations

import json
import re
import struct
from typing import Any

import xxhash

from . import _native
from ._consts import (
    ALIGNMENT, CODECS, FORMAT_MAJOR, HEADER_PREFIX, HEX64_LEN, HEX64_ZERO, HXXH3_FIELD, LENGTH_BYTES,
    MAX_HEADER_BYTES, SEAL_AFTER_DXXH3, SEAL_AFTER_HXXH3, SEAL_AFTER_TAG, SEAL_TAG_HEX, SEALED_TENSOR, ZSTD_TENSOR,
    PLANES_TENSOR,
    parse_name, parse_uint, round_up,
)
from ._spec import BlockHeader, BlockKey, CanonicalLayout, Provenance, SealFields
from ._header_json import _DECODER, _from_parts, _parse_tensors
from ..errors import (
    ChecksumError, HeaderError, InvalidJSONError, KVFormatError, NotKVFormatError, OversizedHeaderError, SchemaError,
    TruncatedError, UnsupportedVersionError,
)

_U64 = struct.Struct("<Q")
_VERSION_RE = re.compile(rb"(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})")  # F-4.2: canonical decimal
_HX_START = LENGTH_BYTES + len(HEADER_PREFIX)  # where the version string starts


def xxh3_hex(data: Any) -> str:
    """xxh3-64 of a bytes-like object as 16 lowercase hex digits (spec §5)."""
    return xxhash.xxh3_64_hexdigest(data)


if _native.HAVE_NATIVE:  # GIL released for payload-sized inputs; python-xxhash holds it
    _nx: Any = _native.xxh3_64

    def xxh3_hex(data: Any) -> str:  # noqa: F811 (same function, the native hash)
        """xxh3-64 of a bytes-like object as 16 lowercase hex digits (spec §5)."""
        return f"{_nx(data):016x}"


def _meta_for(layout: CanonicalLayout, key: BlockKey, prov: Provenance) -> dict[str, str]:
    m = {"kvf.model": layout.model}
    if layout.revision is not None:
        m["kvf.revision"] = layout.revision
    m.update({
        "kvf.kv_dtype": layout.kv_dtype, "kvf.family": layout.family,
        "kvf.tokens_per_block": str(layout.tokens_per_block), "kvf.blocks_per_chunk": str(layout.blocks_per_chunk),
        "kvf.tokens_per_hash": str(layout.tokens_per_hash), "kvf.group": str(layout.group), "kvf.key": key.hash,
        "kvf.tp": str(prov.tp), "kvf.pp": str(prov.pp), "kvf.dcp": str(prov.dcp), "kvf.pcp": str(prov.pcp),
        "kvf.row": prov.row, "kvf.writer": prov.writer, "kvf.created": str(prov.created),
    })
    if prov.pp_layers:
        m["kvf.pp_layers"] = ",".join(map(str, prov.pp_layers))  # §4.4
    if prov.cp_interleave != 1:
        m["kvf.cp_interleave"] = str(prov.cp_interleave)
    if layout.has_roles:
        m["kvf.roles"] = layout.roles_json  # §4.3
    if layout.pins:
        m["kvf.pins"] = layout.pins_json  # §9
    return m


def encode_header(layout: CanonicalLayout, key: BlockKey, provenance: Provenance, *, codec: str, data_bytes: int,
                  data_xxh3: str, raw_xxh3: str, level: int | None = None, seal: SealFields | None = None,
                  plane_table: str | None = None) -> bytes:
    """Build the complete header region (length field + JSON + space padding), checksum patched in.

    Its length is the data offset: a multiple of ALIGNMENT (§3). A sealed layout needs ``seal`` (its tag
    may still be zeros: :mod:`._seal` patches it in). ``plane_table``: the ``kvf.plane_table`` text of a
    plane-coded file (§6.2).
    """
    if codec not in CODECS:
        raise SchemaError("kvf.codec", f"expected one of {CODECS}, got {codec!r}")
    if key.group != layout.group:
        raise SchemaError("key.group", f"expected the layout's group {layout.group}, got {key.group}")
    if (seal is None) != (layout.seal is None):
        raise SchemaError("kvf.seal", "a sealed layout needs the seal fields, a clear one none")
    if layout.seal is not None and codec != "none":
        raise SchemaError("kvf.codec", "a sealed file is not compressed (spec §12.1)")
    if codec != "none":  # never write a level the reader refuses (kvf.level is 0..22, spec §4.2)
        parse_uint("kvf.level", level if level is not None else 0, maximum=22)
    meta: dict[str, str] = {"kvformat": layout.version, "kvf.hxxh3": HEX64_ZERO.decode(), "kvf.codec": codec,
                            "kvf.dxxh3": data_xxh3}
    if seal is not None:  # §12.2: tag right after dxxh3, then the level, key id and nonce
        meta.update({"kvf.tag": seal.tag, "kvf.seal": str(layout.seal), "kvf.key_id": seal.key_id,
                     "kvf.nonce": seal.nonce})
        if layout.seal == "encrypt":
            meta["kvf.layers"] = layout._layers_json
    if codec != "none":
        meta.update({"kvf.level": str(level if level is not None else 0), "kvf.raw_xxh3": raw_xxh3,
                     "kvf.layers": layout._layers_json})
    if (codec == "planes") != (plane_table is not None):
        raise SchemaError("kvf.plane_table", "a plane-coded file needs its plane table, another file none")
    if plane_table is not None:
        meta["kvf.plane_table"] = plane_table
    meta.update(_meta_for(layout, key, provenance))
    if layout.seal == "encrypt" or codec != "none":  # one opaque U8 tensor (§6, §12.3)
        name = SEALED_TENSOR if layout.seal == "encrypt" else PLANES_TENSOR if codec == "planes" else ZSTD_TENSOR
        tensors = json.dumps({name: {"dtype": "U8", "shape": [data_bytes], "data_offsets": [0, data_bytes]}},
                             separators=(",", ":"))[1:-1]
    else:
        tensors = layout._tensor_entries_json  # per-layout constant text (cached)
    # Same bytes as json.dumps of {"__metadata__": meta, **tensors} (the vectors pin them).
    body = ('{"__metadata__":' + json.dumps(meta, separators=(",", ":"), ensure_ascii=False) + "," + tensors
            + "}").encode()
    total = round_up(LENGTH_BYTES + len(body), ALIGNMENT)
    n = total - LENGTH_BYTES
    if n > MAX_HEADER_BYTES:
        raise OversizedHeaderError("header length", MAX_HEADER_BYTES, n)
    buf = bytearray(total)
    _U64.pack_into(buf, 0, n)
    buf[LENGTH_BYTES:LENGTH_BYTES + len(body)] = body
    buf[LENGTH_BYTES + len(body):] = b" " * (total - LENGTH_BYTES - len(body))
    pos = _hxxh3_pos(buf)
    buf[pos:pos + HEX64_LEN] = xxh3_hex(buf).encode()
    return bytes(buf)


def _hxxh3_pos(buf: bytes | bytearray | memoryview) -> int:
    """Offset of the 16 header-checksum hex digits; raises if the fixed prefix is not there (§4.1)."""
    avail = len(buf)
    pre = bytes(buf[LENGTH_BYTES:min(avail, _HX_START)])
    if pre != HEADER_PREFIX[:len(pre)]:
        raise NotKVFormatError("not a kvformat file: the header does not start with the kvformat prefix")  # F-4.1
    window = bytes(buf[_HX_START:min(avail, _HX_START + 10)])
    m = _VERSION_RE.match(window)
    if not m or not window[m.end():m.end() + 1] == b'"':
        if avail < _HX_START + 10:
            raise TruncatedError("header", _HX_START + 10, avail)
        raise HeaderError("the version string is not MAJOR.MINOR")  # F-4.2
    if int(m.group(1)) != FORMAT_MAJOR:
        raise UnsupportedVersionError(m.group(0).decode(), FORMAT_MAJOR)  # F-7.1
    pos = _HX_START + m.end()
    field = bytes(buf[pos:pos + len(HXXH3_FIELD)])
    if field != HXXH3_FIELD[:len(field)]:
        raise HeaderError("kvf.hxxh3 does not follow the version string")  # F-4.2
    return pos + len(HXXH3_FIELD)


def sealed_positions(region: bytes | bytearray | memoryview, hx_pos: int) -> tuple[int, int]:
    """Offsets of the kvf.dxxh3 and kvf.tag digits of a sealed header whose kvf.hxxh3 digits are at ``hx_pos``.

    §12.2 fixes the order of the members after kvf.hxxh3, so the three runs of digits the tag does not
    cover are found without parsing. Raises HeaderError when a sealed header does not have that order.
    """
    d = hx_pos + HEX64_LEN + len(SEAL_AFTER_HXXH3)
    t = d + HEX64_LEN + len(SEAL_AFTER_DXXH3)
    if (bytes(region[hx_pos + HEX64_LEN:d]) != SEAL_AFTER_HXXH3
            or bytes(region[d + HEX64_LEN:t]) != SEAL_AFTER_DXXH3
            or bytes(region[t + SEAL_TAG_HEX:t + SEAL_TAG_HEX + len(SEAL_AFTER_TAG)]) != SEAL_AFTER_TAG):
        raise HeaderError("a sealed header must continue kvf.hxxh3 with kvf.codec, kvf.dxxh3, kvf.tag and "
                          "kvf.seal, in this order")  # F-12.2
    return d, t


def header_length(prefix: bytes | bytearray | memoryview) -> int:
    """From the first bytes of a file, the size of its header region (= data offset).

    Needs at least 8 bytes; checks the prefix as far as ``prefix`` reaches.
    """
    if len(prefix) < LENGTH_BYTES:
        raise TruncatedError("length field", LENGTH_BYTES, len(prefix))  # F-3.1
    (n,) = _U64.unpack_from(prefix, 0)
    _hxxh3_pos(prefix) if len(prefix) > LENGTH_BYTES else None
    if n > MAX_HEADER_BYTES:
        raise OversizedHeaderError("header length", MAX_HEADER_BYTES, n)  # F-8.1
    if (LENGTH_BYTES + n) % ALIGNMENT:
        raise HeaderError(f"header length {n} does not put the data section on a {ALIGNMENT}-byte boundary")  # F-3.2
    return LENGTH_BYTES + int(n)


def decode_header(buf: bytes | bytearray | memoryview, *, file_bytes: int | None = None,
                  verify: bool = True) -> BlockHeader:
    """Parse and check a header region. ``buf`` holds at least the header (more is ignored).

    ``file_bytes``, when known, is checked against the regions the header declares.
    Raises a :class:`~kvformat.errors.KVFormatError` subclass; never returns a partial header.
    """
    end = header_length(buf)
    if len(buf) < end:
        raise TruncatedError("header", end, len(buf))  # F-3.3
    region = bytes(buf[:end])
    pos = _hxxh3_pos(region)
    stored = region[pos:pos + HEX64_LEN]
    if verify:
        actual = xxh3_hex(region[:pos] + HEX64_ZERO + region[pos + HEX64_LEN:]).encode()
        if stored != actual:
            # F-5.1, before any parsing (F-5.4):
            raise ChecksumError("header", stored.decode("ascii", "replace"), actual.decode())  # F-5.1
    text = region[LENGTH_BYTES:].rstrip(b" ")
    if not text.endswith(b"}"):
        raise InvalidJSONError("header JSON is not one object followed by space padding")  # F-3.5
    try:
        s = text.decode("utf-8")
        # Parse __metadata__ alone (it changes per file), then the tensor table, which is the same
        # for every file of a layout and is parsed and validated once per distinct text (cached).
        meta, meta_end = _DECODER.raw_decode(s, len(HEADER_PREFIX) - len('{"kvformat":"'))
        rest = s[meta_end:].lstrip(" \t\r\n")
        if not rest.startswith(","):
            raise InvalidJSONError("the header holds no tensors after __metadata__")
        tensors = _parse_tensors("{" + rest[1:])
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, KVFormatError):  # a schema error of the tensor table keeps its class (F-4.7, F-4.8)
            raise
        raise InvalidJSONError(f"header is not valid UTF-8 JSON: {str(e)[:120]}") from None  # F-4.3
    hdr = _from_parts(meta, tensors, end, stored.decode())
    if hdr.seal is not None:
        d, t = sealed_positions(region, pos)  # F-12.2
        if region[d:d + HEX64_LEN].decode() != hdr.data_xxh3 or region[t:t + SEAL_TAG_HEX].decode() != hdr.seal.tag:
            raise HeaderError("the sealed header's fixed positions do not hold its kvf.dxxh3 and kvf.tag")  # F-12.2
    if file_bytes is not None:
        if file_bytes < hdr.file_bytes:
            raise TruncatedError("data", hdr.file_bytes, file_bytes)  # F-3.4
        if file_bytes > hdr.file_bytes:
            raise HeaderError(f"{file_bytes - hdr.file_bytes} trailing bytes after the data section")  # F-3.4
    return hdr


def check_layout(found: CanonicalLayout, expected: CanonicalLayout) -> None:
    """Fail closed: raise LayoutMismatchError naming the first field that differs (spec §9)."""
    from ..errors import LayoutMismatchError

    for f in ("seal", "model", "revision", "kv_dtype", "family", "tokens_per_block", "blocks_per_chunk",
              "tokens_per_hash", "group", "pins"):
        a, b = getattr(expected, f), getattr(found, f)
        if a != b:
            raise LayoutMismatchError(f, a, b)  # F-9.1
    if len(found.layers) != len(expected.layers):
        raise LayoutMismatchError("layers", len(expected.layers), len(found.layers))
    for i, (a, b) in enumerate(zip(expected.layers, found.layers)):
        if a != b:  # names, dtypes and shapes first; then the role and true KV dtype (§4.3)
            if a.to_list() != b.to_list():
                raise LayoutMismatchError(f"layers[{i}]", a.to_list(), b.to_list())
            raise LayoutMismatchError(f"layers[{i}].role", a.role_entry(expected.kv_dtype),
                                      b.role_entry(found.kv_dtype))


__all__ = ["encode_header", "decode_header", "header_length", "xxh3_hex", "check_layout", "sealed_positions"]
_ = parse_name  # re-exported for symmetry with _spec validators
