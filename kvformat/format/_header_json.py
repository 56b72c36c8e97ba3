"""The header JSON's tensor table and ``__metadata__`` -> :class:`BlockHeader` (spec §4, §6, §7.2).
Takes text; no bytes framing (that is :mod:`._header`), never opens files."""

from __future__ import annotations

import functools
import json
from typing import Any, cast

from ._consts import (
    CODECS, DTYPE_SIZES, HEX64_LEN, MAX_DIMS, MAX_LAYERS, MAX_PAYLOAD_BYTES, OPAQUE_LAYER, PLANES_TENSOR, SEAL_LEVELS,
    SEALED_TENSOR, ZSTD_TENSOR, parse_hex, parse_uint,
)
from ._planes import parse_table
from ._spec import BlockHeader, BlockKey, CanonicalLayout, LayerSpec, Provenance, SealFields, with_roles
from ..errors import InvalidJSONError, OversizedHeaderError, SchemaError


def _no_dups(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise InvalidJSONError(f"duplicate key {dup[:60]!r} in header JSON")  # F-4.3
    return d


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
        if len(shape) > MAX_DIMS + 1:  # [blocks, *per-block shape]: checked before the product, which grows
            # with every dimension (a 1 MiB list of large ints made it quadratic: G-1.4, work linear in the file)
            raise SchemaError("layer.shape", f"expected 1..{MAX_DIMS} positive ints, got {_dims(shape[1:])}")  # F-8.5
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


def _dims(shape: list[int]) -> str:
    """A per-block shape as LayerSpec's F-8.5 message shows it, bounded in length."""
    if len(shape) <= 2 * MAX_DIMS:
        return repr(tuple(shape))
    return "(" + ", ".join(str(d)[:20] for d in shape[:MAX_DIMS + 1]) + f", ... {len(shape)} dimensions)"


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
    seal, sealed = _seal_fields(meta, codec)
    if codec == "none" and sealed != "encrypt":
        layers_key: Any = (tensors, bpc)  # identity-hashed: cheap cache key
        raw_xxh3 = data_xxh3 = parse_hex("kvf.dxxh3", _meta_str(meta, "kvf.dxxh3"), HEX64_LEN)
        level = None
    else:
        # One opaque U8 tensor: the zstd frame (§6) or the ciphertext (§12.3); the layers are in kvf.layers.
        one = SEALED_TENSOR if sealed == "encrypt" else PLANES_TENSOR if codec == "planes" else ZSTD_TENSOR
        if len(entries) != 1 or entries[0][0] != one or entries[0][1] != "U8" or len(entries[0][2]) != 1:
            raise SchemaError("tensors", f"{'an encrypted' if sealed else 'a compressed'} file holds exactly one "
                              f"U8 tensor named {one}")  # F-6.1, F-12.3
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
        if sealed:  # §12.3: no checksum of the plaintext is stored (it would tell equal payloads apart)
            raw_xxh3, level = "", None
        else:
            raw_xxh3 = parse_hex("kvf.raw_xxh3", _meta_str(meta, "kvf.raw_xxh3"), HEX64_LEN)
            level = parse_uint("kvf.level", _meta_str(meta, "kvf.level"), maximum=22)
    try:
        static = tuple(meta.get(k) for k in _STATIC_KEYS)
        layout, prov0 = _static(static, bpc, layers_key)
        key = BlockKey(_meta_str(meta, "kvf.key"), layout.group)
        prov = _with_created(prov0, parse_uint("kvf.created", _meta_str(meta, "kvf.created")))
    except TypeError as e:  # a field of the wrong JSON type reached a dataclass check
        raise SchemaError("__metadata__", str(e)[:120]) from None
    if codec == "none" and data_bytes != layout.payload_bytes:  # F-4.9; F-12.3: ciphertext is payload-sized
        raise SchemaError("tensors", f"tensors hold {data_bytes} bytes, the layout {layout.payload_bytes}")  # F-4.9
    if codec != "none" and data_bytes > MAX_PAYLOAD_BYTES + (MAX_PAYLOAD_BYTES >> 7) + (1 << 20):
        raise OversizedHeaderError("compressed data bytes", MAX_PAYLOAD_BYTES, data_bytes)
    planes = parse_table(meta.get("kvf.plane_table"), layout.payload_bytes, data_bytes) if codec == "planes" else ()
    if codec != "planes" and "kvf.plane_table" in meta:  # a table no reader would apply must not pass unnoticed
        raise SchemaError("kvf.plane_table", "present in a file that is not plane-coded")  # F-6.5
    # less level, raw_xxh3, layers (compressed only), the plane table and the per-file seal fields
    min_keys = len(_KNOWN) - len(_OPTIONAL_KEYS) - 4 - len(_SEAL_FILE_KEYS)
    extra = {k: v for k, v in meta.items() if k not in _KNOWN} if len(meta) > min_keys else {}  # F-7.2
    return BlockHeader(version=version, layout=layout, key=key, provenance=prov, codec=codec,
                       data_offset=data_offset, data_bytes=data_bytes, raw_bytes=layout.payload_bytes,
                       header_xxh3=hxxh3, data_xxh3=data_xxh3, raw_xxh3=raw_xxh3, level=level, extra=extra, seal=seal,
                       planes=planes)


_SEAL_FILE_KEYS = ("kvf.key_id", "kvf.nonce", "kvf.tag")


def _seal_fields(meta: dict[str, Any], codec: str) -> tuple[SealFields | None, str | None]:
    """The per-file seal fields and the level of a sealed file; (None, None) for a clear one (§12)."""
    level = meta.get("kvf.seal")
    present = [k for k in _SEAL_FILE_KEYS if k in meta]
    if level is None:
        if present:  # a sealed file stripped of its level must not pass as a clear one
            raise SchemaError(present[0], "seal fields without kvf.seal")  # F-12.1
        return None, None
    if level not in SEAL_LEVELS:
        raise SchemaError("kvf.seal", f"expected one of {SEAL_LEVELS}, got {level[:40]!r}")  # F-12.1
    if codec != "none":
        raise SchemaError("kvf.codec", "a sealed file is not compressed")  # F-12.1
    return SealFields(key_id=_meta_str(meta, "kvf.key_id"), nonce=_meta_str(meta, "kvf.nonce"),
                      tag=_meta_str(meta, "kvf.tag")), level


# Metadata that is the same for every file of one writer and layout: parsed and validated once (cached),
# so a read of one more file of a known deployment only parses its per-file fields (key, checksums, time).
_STATIC_KEYS = ("kvf.model", "kvf.revision", "kvf.kv_dtype", "kvf.family", "kvf.tokens_per_block",
                "kvf.tokens_per_hash", "kvf.group", "kvf.tp", "kvf.pp", "kvf.dcp", "kvf.pcp", "kvf.row", "kvf.writer",
                "kvf.roles", "kvf.pins", "kvf.pp_layers", "kvf.cp_interleave", "kvf.seal")
_OPTIONAL_KEYS = ("kvf.revision", "kvf.roles", "kvf.pins", "kvf.pp_layers", "kvf.cp_interleave", "kvf.seal")


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
        roles=m["kvf.roles"], pins=m["kvf.pins"], seal=m["kvf.seal"])
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
             "kvf.cp_interleave", "kvf.seal", "kvf.key_id", "kvf.nonce", "kvf.tag", "kvf.plane_table"})


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


