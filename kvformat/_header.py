"""Header encode/decode (spec §3-§5, §7). Takes and returns bytes; never opens files."""

from __future__ import annotations

import functools
import json
import re
import struct
from typing import Any, cast

import xxhash

from . import _native
from ._spec import (
    ALIGNMENT, CODECS, DTYPE_SIZES, FORMAT_MAJOR, HEADER_PREFIX, HEX64_LEN, HEX64_ZERO,
    HXXH3_FIELD, LENGTH_BYTES, MAX_HEADER_BYTES, MAX_LAYERS, MAX_PAYLOAD_BYTES, ZSTD_TENSOR, BlockHeader,
    OPAQUE_LAYER, BlockKey, CanonicalLayout, LayerSpec, Provenance, parse_hex, parse_name, parse_uint, with_roles,
)
from .errors import (
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
                  data_xxh3: str, raw_xxh3: str, level: int | None = None) -> bytes:
    """Build the complete header region (length field + JSON + space padding), checksum patched in.

    Its length is the data offset: a multiple of ALIGNMENT (§3).
    """
    if codec not in CODECS:
        raise SchemaError("kvf.codec", f"expected one of {CODECS}, got {codec!r}")
    if key.group != layout.group:
        raise SchemaError("key.group", f"expected the layout's group {layout.group}, got {key.group}")
    if codec != "none":  # never write a level the reader refuses (kvf.level is 0..22, spec §4.2)
        parse_uint("kvf.level", level if level is not None else 0, maximum=22)
    meta: dict[str, str] = {"kvformat": layout.version, "kvf.hxxh3": HEX64_ZERO.decode(), "kvf.codec": codec,
                            "kvf.dxxh3": data_xxh3}
    if codec != "none":
        meta.update({"kvf.level": str(level if level is not None else 0), "kvf.raw_xxh3": raw_xxh3,
                     "kvf.layers": layout._layers_json})
    meta.update(_meta_for(layout, key, provenance))
    if codec == "none":
        tensors = layout._tensor_entries_json  # per-layout constant text (cached)
    else:
        tensors = json.dumps({ZSTD_TENSOR: {"dtype": "U8", "shape": [data_bytes], "data_offsets": [0, data_bytes]}},
                             separators=(",", ":"))[1:-1]
    # Same bytes as json.dumps of {"__metadata__": meta, **tensors} (the vectors pin them).
    body = ('{"__metadata__":' + json.dumps(meta, separators=(",", ":"), ensure_ascii=False) + "," + tensors
            + "}").encode()
    total = -(-(LENGTH_BYTES + len(body)) // ALIGNMENT) * ALIGNMENT
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


def _no_dups(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise InvalidJSONError(f"duplicate key {dup[:60]!r} in header JSON")  # F-4.3
    return d


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
    if file_bytes is not None:
        if file_bytes < hdr.file_bytes:
            raise TruncatedError("data", hdr.file_bytes, file_bytes)  # F-3.4
        if file_bytes > hdr.file_bytes:
            raise HeaderError(f"{file_bytes - hdr.file_bytes} trailing bytes after the data section")  # F-3.4
    return hdr


_DECODER = json.JSONDecoder(object_pairs_hook=_no_dups)


class _TensorTable:
    """A parsed tensor table; hashed by identity so caches keyed on it stay cheap."""

    __slots__ = ("entries", "data_bytes", "__weakref__")

    def __init__(self, entries: tuple[tuple[str, str, tuple[int, ...]], ...], data_bytes: int) -> None:
        self.entries = entries
        self.data_bytes = data_bytes

    def __iter__(self) -> Any:
        return iter((self.entries, self.data_bytes))


@functools.lru_cache(maxsize=32)
def _parse_tensors(text: str) -> _TensorTable:
    """The tensor table: ((name, dtype, shape) sorted by offset, total bytes). Checks tiling (§4.2)."""
    doc = json.loads(text, object_pairs_hook=_no_dups)
    if not isinstance(doc, dict):
        raise SchemaError("tensors", "expected an object")
    if "__metadata__" in doc:
        raise InvalidJSONError("duplicate key '__metadata__' in header JSON")
    entries = []
    for name, t in doc.items():
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
            raise SchemaError(f"tensor {name[:60]}", "expected exactly dtype, shape and data_offsets")  # F-4.7
        shape, offs = t["shape"], t["data_offsets"]
        if (not isinstance(shape, list) or not isinstance(offs, list) or len(offs) != 2
                or any(type(x) is not int for x in shape + offs)):
            raise SchemaError(f"tensor {name[:60]}", "shape and data_offsets must be lists of ints")
        if not isinstance(t["dtype"], str) or t["dtype"] not in DTYPE_SIZES:  # a list/dict is unhashable
            raise SchemaError(f"tensor {name[:60]}.dtype", f"unknown dtype {str(t['dtype'])[:20]!r}")  # F-4.7
        numel = 1
        for d in shape:
            if d < 0:
                raise SchemaError(f"tensor {name[:60]}.shape", "negative dimension")
            numel *= d
        if offs[0] < 0 or offs[1] - offs[0] != numel * DTYPE_SIZES[t["dtype"]]:
            raise SchemaError(f"tensor {name[:60]}.data_offsets",  # F-4.7
                              f"{offs} does not hold shape {shape} of {t['dtype']}")
        entries.append((offs[0], offs[1], name, t["dtype"], tuple(shape)))
    if not 1 <= len(entries) <= MAX_LAYERS:
        raise SchemaError("tensors", f"expected 1..{MAX_LAYERS} tensors, got {len(entries)}")  # F-8.2
    entries.sort()
    pos = 0
    for begin, stop, name, _, _ in entries:
        if begin != pos:
            raise SchemaError(f"tensor {name[:60]}.data_offsets",  # F-4.8
                              f"expected to start at {pos}, starts at {begin}")
        pos = stop
    return _TensorTable(tuple((name, dtype, shape) for _, _, name, dtype, shape in entries), pos)


def _meta_str(meta: dict[str, Any], k: str, required: bool = True) -> Any:
    v = meta.get(k)
    if v is None:
        if required:
            raise SchemaError(k, "missing from __metadata__")  # F-4.4
        return None
    return v


def _from_parts(meta: Any, tensors: _TensorTable, data_offset: int, hxxh3: str) -> BlockHeader:
    if not isinstance(meta, dict):
        raise SchemaError("__metadata__", "expected an object")
    for k, v in meta.items():
        if not isinstance(v, str):
            raise SchemaError(k, f"__metadata__ values must be strings, got {type(v).__name__}")  # F-4.4
    version = meta["kvformat"]
    codec = _meta_str(meta, "kvf.codec")
    if codec not in CODECS:
        raise SchemaError("kvf.codec", f"expected one of {CODECS}, got {codec[:40]!r}")  # F-4.6
    bpc = parse_uint("kvf.blocks_per_chunk", _meta_str(meta, "kvf.blocks_per_chunk"), minimum=1, maximum=1 << 16)
    entries, data_bytes = tensors
    if codec == "none":
        layers_key: Any = (tensors, bpc)  # identity-hashed: cheap cache key
        raw_xxh3 = data_xxh3 = parse_hex("kvf.dxxh3", _meta_str(meta, "kvf.dxxh3"), HEX64_LEN)
        level = None
    else:
        if len(entries) != 1 or entries[0][0] != ZSTD_TENSOR or entries[0][1] != "U8" or len(entries[0][2]) != 1:
            raise SchemaError("tensors", f"a compressed file holds exactly one U8 tensor named {ZSTD_TENSOR}")  # F-6.1
        layers_key = _meta_str(meta, "kvf.layers")
        try:
            raw_layers = json.loads(layers_key)
        except (ValueError, RecursionError):
            raise SchemaError("kvf.layers", "not valid JSON") from None
        if not isinstance(raw_layers, list):
            raise SchemaError("kvf.layers", "expected a list")
        if not all(isinstance(x, list) and len(x) == 3 and isinstance(x[2], list) for x in raw_layers):
            raise SchemaError("kvf.layers", "expected a list of [name, dtype, shape]")  # F-6.2
        try:
            _layers(tuple((x[0], x[1], tuple(x[2])) for x in raw_layers))
        except TypeError:
            raise SchemaError("kvf.layers", "unhashable layer entry") from None
        data_xxh3 = parse_hex("kvf.dxxh3", _meta_str(meta, "kvf.dxxh3"), HEX64_LEN)
        raw_xxh3 = parse_hex("kvf.raw_xxh3", _meta_str(meta, "kvf.raw_xxh3"), HEX64_LEN)
        level = parse_uint("kvf.level", _meta_str(meta, "kvf.level"), maximum=22)
    try:
        static = tuple(meta.get(k) for k in _STATIC_KEYS)
        layout, prov0 = _static(static, bpc, layers_key)
        key = BlockKey(_meta_str(meta, "kvf.key"), layout.group)
        prov = _with_created(prov0, parse_uint("kvf.created", _meta_str(meta, "kvf.created")))
    except TypeError as e:  # a field of the wrong JSON type reached a dataclass check
        raise SchemaError("__metadata__", str(e)[:120]) from None
    if codec == "none" and data_bytes != layout.payload_bytes:
        raise SchemaError("tensors", f"tensors hold {data_bytes} bytes, the layout {layout.payload_bytes}")  # F-4.9
    if codec != "none" and data_bytes > MAX_PAYLOAD_BYTES + (MAX_PAYLOAD_BYTES >> 7) + (1 << 20):
        raise OversizedHeaderError("compressed data bytes", MAX_PAYLOAD_BYTES, data_bytes)
    min_keys = len(_KNOWN) - len(_OPTIONAL_KEYS) - 3  # less level, raw_xxh3, layers (zstd only)
    extra = {k: v for k, v in meta.items() if k not in _KNOWN} if len(meta) > min_keys else {}  # F-7.2
    return BlockHeader(version=version, layout=layout, key=key, provenance=prov, codec=codec,
                       data_offset=data_offset, data_bytes=data_bytes, raw_bytes=layout.payload_bytes,
                       header_xxh3=hxxh3, data_xxh3=data_xxh3, raw_xxh3=raw_xxh3, level=level, extra=extra)


# Metadata that is the same for every file of one writer and layout: parsed and validated once (cached),
# so a read of one more file of a known deployment only parses its per-file fields (key, checksums, time).
_STATIC_KEYS = ("kvf.model", "kvf.revision", "kvf.kv_dtype", "kvf.family", "kvf.tokens_per_block",
                "kvf.tokens_per_hash", "kvf.group", "kvf.tp", "kvf.pp", "kvf.dcp", "kvf.pcp", "kvf.row", "kvf.writer",
                "kvf.roles", "kvf.pins", "kvf.pp_layers", "kvf.cp_interleave")
_OPTIONAL_KEYS = ("kvf.revision", "kvf.roles", "kvf.pins", "kvf.pp_layers", "kvf.cp_interleave")


@functools.lru_cache(maxsize=64)
def _static(values: tuple[str | None, ...], bpc: int, layers_key: Any) -> tuple[CanonicalLayout, Provenance]:
    m = dict(zip(_STATIC_KEYS, values))
    for k, v in m.items():
        if v is None and k not in _OPTIONAL_KEYS:
            raise SchemaError(k, "missing from __metadata__")  # F-4.4
    layout = _layout(
        model=m["kvf.model"], revision=m["kvf.revision"], kv_dtype=m["kvf.kv_dtype"], family=m["kvf.family"],
        tokens_per_block=parse_uint("kvf.tokens_per_block", m["kvf.tokens_per_block"], minimum=1),
        blocks_per_chunk=bpc, tokens_per_hash=parse_uint("kvf.tokens_per_hash", m["kvf.tokens_per_hash"], minimum=1),
        group=parse_uint("kvf.group", m["kvf.group"], maximum=1 << 16), layers_key=layers_key,
        roles=m["kvf.roles"], pins=m["kvf.pins"])
    prov = Provenance(tp=parse_uint("kvf.tp", m["kvf.tp"], minimum=1), pp=parse_uint("kvf.pp", m["kvf.pp"], minimum=1),
                      dcp=parse_uint("kvf.dcp", m["kvf.dcp"], minimum=1),
                      pcp=parse_uint("kvf.pcp", m["kvf.pcp"], minimum=1),
                      row=cast(str, m["kvf.row"]), writer=cast(str, m["kvf.writer"]),  # non-None: checked above
                      pp_layers=_pp_layers(m["kvf.pp_layers"]),
                      cp_interleave=parse_uint("kvf.cp_interleave", m["kvf.cp_interleave"] or "1", minimum=1,
                                              maximum=1 << 16))
    return layout, prov


def _pp_layers(value: str | None) -> tuple[int, ...]:
    if value is None:
        return ()
    # maxsplit bounds the work on a hostile list: its last part then holds commas and fails to parse.
    return tuple(parse_uint("kvf.pp_layers", v, maximum=MAX_LAYERS) for v in value.split(",", 1 << 16))


def _with_created(prov: Provenance, created: int) -> Provenance:
    """A copy of an already validated Provenance with another creation time (no re-validation)."""
    out = object.__new__(Provenance)
    out.__dict__.update(prov.__dict__, created=created)
    return out


_KNOWN = frozenset({"kvformat", "kvf.hxxh3", "kvf.codec", "kvf.dxxh3", "kvf.level", "kvf.raw_xxh3", "kvf.layers",
             "kvf.model", "kvf.revision", "kvf.kv_dtype", "kvf.family", "kvf.tokens_per_block",
             "kvf.blocks_per_chunk", "kvf.tokens_per_hash", "kvf.group", "kvf.key", "kvf.tp", "kvf.pp", "kvf.dcp",
             "kvf.pcp", "kvf.row", "kvf.writer", "kvf.created", "kvf.roles", "kvf.pins", "kvf.pp_layers",
             "kvf.cp_interleave"})


def _layers_from_key(layers_key: Any) -> tuple[LayerSpec, ...]:
    if isinstance(layers_key, str):  # compressed: the kvf.layers JSON (already checked by the caller)
        return _layers(tuple((x[0], x[1], tuple(x[2])) for x in json.loads(layers_key)))
    table, bpc = layers_key
    for name, _, shape in table.entries:
        if len(shape) < 2 or shape[0] != bpc:
            raise SchemaError(f"tensor {name[:60]}.shape", f"expected [{bpc}, tokens, ...], got {list(shape)}")  # F-4.9
    return _layers(tuple((name, dtype, shape[1:]) for name, dtype, shape in table.entries))


@functools.lru_cache(maxsize=64)
def _layers(items: tuple[tuple[Any, Any, tuple[Any, ...]], ...]) -> tuple[LayerSpec, ...]:
    # The one reserved name a layer may have is an opaque region's; kvf.roles must then confirm it.
    return tuple(LayerSpec(n, d, s, role="opaque" if n == OPAQUE_LAYER else "mla") for n, d, s in items)


def _json_field(name: str, text: str | None, kind: type) -> Any:
    if text is None:
        return None
    try:
        v = json.loads(text)
    except (ValueError, RecursionError):
        raise SchemaError(name, "not valid JSON") from None  # F-4.13, F-4.15
    if not isinstance(v, kind):
        raise SchemaError(name, f"expected a JSON {kind.__name__}")
    return v


@functools.lru_cache(maxsize=64)
def _layout(layers_key: Any, roles: str | None = None, pins: str | None = None, **kw: Any) -> CanonicalLayout:
    # Files of one deployment share one layout: build and validate it once, not per file.
    layers = _layers_from_key(layers_key)
    role_list = _json_field("kvf.roles", roles, list)
    if role_list is None and any(l.role == "opaque" for l in layers):
        raise SchemaError("layer.name", f"reserved name {OPAQUE_LAYER!r} without kvf.roles")  # F-4.11
    if role_list is not None:
        layers = with_roles(layers, role_list, kw["kv_dtype"])  # F-4.13
    pin_map = _json_field("kvf.pins", pins, dict)
    layout = CanonicalLayout(layers=layers, pins=pin_map or {}, **kw)
    if role_list is not None and not layout.has_roles:
        raise SchemaError("kvf.roles", "present but every layer is a plain MLA latent of kvf.kv_dtype")  # F-4.13
    if pin_map is not None and not pin_map:
        raise SchemaError("kvf.pins", "present but empty")  # F-4.15
    return layout


def check_layout(found: CanonicalLayout, expected: CanonicalLayout) -> None:
    """Fail closed: raise LayoutMismatchError naming the first field that differs (spec §9)."""
    from .errors import LayoutMismatchError

    for f in ("model", "revision", "kv_dtype", "family", "tokens_per_block", "blocks_per_chunk", "tokens_per_hash",
              "group", "pins"):
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


__all__ = ["encode_header", "decode_header", "header_length", "xxh3_hex", "check_layout"]
_ = parse_name  # re-exported for symmetry with _spec validators
