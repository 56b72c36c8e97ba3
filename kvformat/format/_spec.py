"""Spec objects of kvformat v1 (spec/FORMAT.md): frozen dataclasses with ``to_dict``/``from_dict``. No I/O here.

The constants and field validators live in :mod:`._consts`; they are named here too (``from ._spec
import ALIGNMENT`` keeps working)."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ._consts import (
    DEFAULT_ROLE, DTYPE_SIZES, FORM_ORDERS, FORM_PIN, FORM_UNKNOWN, FORMAT_MAJOR, FORMAT_VERSION_BASE,
    FORMAT_VERSION_ROLES, FORMAT_VERSION_SEAL, MAX_DIMS, MAX_LAYERS, MAX_PAYLOAD_BYTES, ROLES, ROW_LAYOUTS,
    SEAL_KEY_ID_HEX, SEAL_LEVELS, SEAL_NONCE_HEX, SEAL_TAG_HEX, parse_hex, parse_name, parse_uint,
)
# Named here too for the modules that import them from this one (layout, staging).
from ._consts import ALIGNMENT as ALIGNMENT, OPAQUE_LAYER as OPAQUE_LAYER, st_dtype_for as st_dtype_for
from ..errors import SchemaError


@dataclass(frozen=True)
class LayerSpec:
    """One layer of the canonical payload: its vLLM name, safetensors dtype and per-block shape.

    ``shape`` is the shape of ONE block of this layer, e.g. ``(64, 576)`` for 64 tokens of a
    576-wide MLA latent; in the file the tensor is ``(blocks_per_chunk, *shape)``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    role: str = DEFAULT_ROLE
    kv_dtype: str | None = None  # the layer's true KV dtype when it differs from the layout's kvf.kv_dtype

    def __post_init__(self) -> None:
        parse_name("layer.name", self.name)
        if self.role not in ROLES:
            raise SchemaError("kvf.roles", f"expected a role in {ROLES}, got {str(self.role)[:40]!r}")  # F-4.13
        if self.kv_dtype is not None:
            parse_name("kvf.roles", self.kv_dtype)
        if self.role == "opaque":
            if self.name != OPAQUE_LAYER or self.dtype != "U8":
                raise SchemaError("kvf.roles", f"an opaque layer is the U8 tensor {OPAQUE_LAYER}")  # F-4.14
        elif self.name == "__metadata__" or self.name.startswith("kvf."):
            raise SchemaError("layer.name", f"reserved name {self.name!r}")  # F-4.11
        if self.dtype not in DTYPE_SIZES:
            raise SchemaError("layer.dtype", f"expected one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        shape = tuple(self.shape)
        if not 1 <= len(shape) <= MAX_DIMS or any(not isinstance(d, int) or isinstance(d, bool) or d < 1
                                                  for d in shape):
            raise SchemaError("layer.shape", f"expected 1..{MAX_DIMS} positive ints, got {self.shape!r}")  # F-8.5
        object.__setattr__(self, "shape", shape)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of this layer (vLLM's page size for the layer)."""
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def to_list(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape)]

    def role_entry(self, layout_kv_dtype: str) -> list[str]:
        """This layer's ``kvf.roles`` entry: ``[role, true KV dtype]`` (§4.3)."""
        return [self.role, self.kv_dtype or layout_kv_dtype]

    @classmethod
    def from_list(cls, item: Any) -> "LayerSpec":
        if not isinstance(item, list) or len(item) != 3 or not isinstance(item[2], list):
            raise SchemaError("kvf.layers", f"expected [name, dtype, shape], got {str(item)[:80]}")
        return cls(item[0], item[1], tuple(item[2]))


def _check_form_pin(key: str, value: str, roles: set[str]) -> None:
    """§4.5: a ``form.<kv dtype>`` pin names the byte form of that dtype's layers in the file's one order."""
    if not roles:
        raise SchemaError("kvf.pins", f"{key}: no layer of KV dtype {key[len(FORM_PIN):]!r}")  # F-4.17
    if value.startswith(FORM_UNKNOWN):
        return
    orders = {FORM_ORDERS.get(r) for r in roles}
    order, _, encoding = value.partition("/")
    if len(orders) != 1 or order not in orders or not encoding:
        raise SchemaError("kvf.pins", f"{key}: expected '{'|'.join(sorted(str(o) for o in orders))}/<encoding>' "
                          f"or '{FORM_UNKNOWN}<platform>', got {value[:60]!r}")  # F-4.17


@dataclass(frozen=True)
class CanonicalLayout:
    """The TP-independent layout of a chunk's payload (spec §2).

    The payload is the concatenation, in ``layers`` order, of ``page_bytes * blocks_per_chunk``
    bytes per layer, block j of the chunk at ``j * page_bytes`` inside its layer: exactly vLLM's
    single-slot primary row for the chunk.
    """

    model: str
    kv_dtype: str
    tokens_per_block: int
    blocks_per_chunk: int
    tokens_per_hash: int
    layers: tuple[LayerSpec, ...]
    family: str = "mla"
    revision: str | None = None
    group: int = 0
    # §9: more identity (weight quantization, the writer's row order for an opaque layout, …): every
    # input that changes the bytes for the same tokens and is not already a field above.
    pins: Mapping[str, str] = field(default_factory=dict)
    # §12: "authenticate" or "encrypt" for a sealed file, None for a clear one. Part of the identity, so
    # sealed and clear files (and the two levels) never share a namespace.
    seal: str | None = None

    def __post_init__(self) -> None:
        if self.seal is not None and self.seal not in SEAL_LEVELS:
            raise SchemaError("kvf.seal", f"expected one of {SEAL_LEVELS}, got {str(self.seal)[:40]!r}")  # F-12.1
        parse_name("model", self.model)
        parse_name("kv_dtype", self.kv_dtype)
        parse_name("family", self.family)
        if self.revision is not None:
            parse_name("revision", self.revision)
        parse_uint("tokens_per_block", self.tokens_per_block, minimum=1, maximum=1 << 20)
        parse_uint("blocks_per_chunk", self.blocks_per_chunk, minimum=1, maximum=1 << 16)
        parse_uint("tokens_per_hash", self.tokens_per_hash, minimum=1, maximum=1 << 20)
        parse_uint("group", self.group, maximum=1 << 16)
        layers = tuple(self.layers)
        if not 1 <= len(layers) <= MAX_LAYERS:
            raise SchemaError("layers", f"expected 1..{MAX_LAYERS} layers, got {len(layers)}")
        if len({l.name for l in layers}) != len(layers):
            raise SchemaError("layers", "layer names repeat")
        if not isinstance(self.pins, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                         for k, v in self.pins.items()):
            raise SchemaError("kvf.pins", "expected an object of strings")  # F-4.15
        for k, v in self.pins.items():
            parse_name("kvf.pins", k)
            parse_name("kvf.pins", v, allow_empty=True)
        object.__setattr__(self, "pins", dict(sorted(self.pins.items())))
        for k, v in self.pins.items():
            if k.startswith(FORM_PIN):
                _check_form_pin(k, v, {l.role for l in layers if (l.kv_dtype or self.kv_dtype) == k[len(FORM_PIN):]})
        if any(l.role == "opaque" for l in layers) and len(layers) != 1:
            raise SchemaError("kvf.roles", "an opaque layer is the only layer of its file")  # F-4.14
        for l in layers:
            if l.role == "opaque":
                continue  # an opaque region has no per-token structure (§4.3)
            if l.shape[0] != self.tokens_per_block:  # F-4.10
                raise SchemaError(f"layer {l.name}.shape", f"expected first dim {self.tokens_per_block} "
                                  f"(tokens_per_block), got {l.shape[0]}")
        object.__setattr__(self, "layers", layers)
        if self.payload_bytes > MAX_PAYLOAD_BYTES:
            raise SchemaError("payload", f"{self.payload_bytes} bytes is over the limit {MAX_PAYLOAD_BYTES}")  # F-8.4

    def __hash__(self) -> int:
        return hash(self.namespace())

    @classmethod
    def uniform(cls, model: str, kv_dtype: str, layer_names: list[str] | tuple[str, ...], tokens_per_block: int,
                width: int, *, blocks_per_chunk: int = 1, tokens_per_hash: int | None = None,
                **kw: Any) -> "CanonicalLayout":
        """A pure-MLA layout: every layer ``(tokens_per_block, width)`` of ``kv_dtype``.

        For packed dtypes (``fp8_ds_mla``) ``width`` is bytes per token.
        """
        dt = st_dtype_for(kv_dtype)
        layers = tuple(LayerSpec(n, dt, (tokens_per_block, width)) for n in layer_names)
        return cls(model=model, kv_dtype=kv_dtype, tokens_per_block=tokens_per_block,
                   blocks_per_chunk=blocks_per_chunk, tokens_per_hash=tokens_per_hash or tokens_per_block,
                   layers=layers, **kw)

    @functools.cached_property
    def chunk_bytes_per_layer(self) -> tuple[int, ...]:
        return tuple(l.page_bytes * self.blocks_per_chunk for l in self.layers)

    @functools.cached_property
    def payload_bytes(self) -> int:
        """Bytes of the canonical payload (one slot of vLLM's primary row, without row padding)."""
        return sum(l.page_bytes for l in self.layers) * self.blocks_per_chunk

    @functools.cached_property
    def layer_offsets(self) -> tuple[int, ...]:
        out, off = [], 0
        for n in self.chunk_bytes_per_layer:
            out.append(off)
            off += n
        return tuple(out)

    @functools.cached_property
    def _tensor_entries_json(self) -> str:
        # The safetensors tensor entries of an uncompressed file (§4.2) as JSON text without the outer
        # braces: the same for every file of this layout, so a writer builds it once, not per file.
        bpc = self.blocks_per_chunk
        doc = {l.name: {"dtype": l.dtype, "shape": [bpc, *l.shape], "data_offsets": [off, off + n]}
               for l, off, n in zip(self.layers, self.layer_offsets, self.chunk_bytes_per_layer)}
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)[1:-1]

    @functools.cached_property
    def has_roles(self) -> bool:
        """Whether any layer is not a plain MLA latent of the layout's KV dtype (then ``kvf.roles`` is written)."""
        return any(l.role != DEFAULT_ROLE or (l.kv_dtype not in (None, self.kv_dtype)) for l in self.layers)

    @functools.cached_property
    def roles_json(self) -> str:
        return json.dumps([l.role_entry(self.kv_dtype) for l in self.layers], separators=(",", ":"))

    @functools.cached_property
    def pins_json(self) -> str:
        return json.dumps(dict(self.pins), sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @functools.cached_property
    def version(self) -> str:
        """The format version a writer records for files of this layout (§7)."""
        if self.seal is not None:
            return FORMAT_VERSION_SEAL
        return FORMAT_VERSION_ROLES if (self.has_roles or self.pins) else FORMAT_VERSION_BASE

    def with_seal(self, seal: str | None) -> "CanonicalLayout":
        """This layout with another seal level (``None``: clear). A new layout, hence a new namespace."""
        if seal == self.seal:
            return self
        return CanonicalLayout(model=self.model, kv_dtype=self.kv_dtype, tokens_per_block=self.tokens_per_block,
                               blocks_per_chunk=self.blocks_per_chunk, tokens_per_hash=self.tokens_per_hash,
                               layers=self.layers, family=self.family, revision=self.revision, group=self.group,
                               pins=self.pins, seal=seal)

    @functools.cached_property
    def _layers_json(self) -> str:
        # kvf.layers of a compressed file (§6), cached for the same reason.
        return json.dumps([l.to_list() for l in self.layers], separators=(",", ":"))

    def identity(self) -> dict[str, Any]:
        """The TP-invariant identity that names the namespace (spec §9). No tp/pp/rank/row layout.

        ``roles``, ``pins`` and ``seal`` appear only when used, so a 1.0 layout keeps its namespace.
        """
        ident = {
            "format_major": FORMAT_MAJOR,
            "model": self.model,
            "revision": self.revision,
            "kv_dtype": self.kv_dtype,
            "family": self.family,
            "tokens_per_block": self.tokens_per_block,
            "blocks_per_chunk": self.blocks_per_chunk,
            "tokens_per_hash": self.tokens_per_hash,
            "group": self.group,
            "layers": [[l.name, l.dtype, list(l.shape), l.page_bytes] for l in self.layers],
        }
        if self.has_roles:
            ident["roles"] = [l.role_entry(self.kv_dtype) for l in self.layers]
        if self.pins:
            ident["pins"] = dict(self.pins)
        if self.seal is not None:
            ident["seal"] = self.seal  # §12: how files are sealed, never which key
        return ident

    @functools.cached_property
    def _namespace(self) -> str:
        blob = json.dumps(self.identity(), sort_keys=True, separators=(",", ":")).encode()
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", self.model)[:80]
        return f"{safe}-{hashlib.sha256(blob).hexdigest()[:16]}"

    def namespace(self) -> str:
        """``<model with / as _>-<first 16 hex of sha256(identity JSON)>`` (spec §9)."""
        return self._namespace

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "model": self.model, "revision": self.revision, "kv_dtype": self.kv_dtype, "family": self.family,
            "tokens_per_block": self.tokens_per_block, "blocks_per_chunk": self.blocks_per_chunk,
            "tokens_per_hash": self.tokens_per_hash, "group": self.group,
            "layers": [l.to_list() for l in self.layers],
        }
        if self.has_roles:
            d["roles"] = [l.role_entry(self.kv_dtype) for l in self.layers]
        if self.pins:
            d["pins"] = dict(self.pins)
        if self.seal is not None:
            d["seal"] = self.seal
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CanonicalLayout":
        try:
            layers = tuple(LayerSpec.from_list(x) for x in d["layers"])
            if d.get("roles") is not None:
                layers = with_roles(layers, d["roles"], d["kv_dtype"])
            return cls(model=d["model"], kv_dtype=d["kv_dtype"], tokens_per_block=d["tokens_per_block"],
                       blocks_per_chunk=d["blocks_per_chunk"], tokens_per_hash=d["tokens_per_hash"],
                       layers=layers, family=d.get("family", "mla"),
                       revision=d.get("revision"), group=d.get("group", 0), pins=d.get("pins") or {},
                       seal=d.get("seal"))
        except KeyError as e:
            raise SchemaError(str(e.args[0]), "missing") from None


def with_roles(layers: tuple[LayerSpec, ...], roles: Any, layout_kv_dtype: str) -> tuple[LayerSpec, ...]:
    """``layers`` with the roles and true KV dtypes of a ``kvf.roles`` list (§4.3, F-4.13)."""
    if (not isinstance(roles, list) or len(roles) != len(layers)
            or not all(isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r) for r in roles)):
        raise SchemaError("kvf.roles", f"expected one [role, kv_dtype] per layer ({len(layers)})")  # F-4.13
    return tuple(LayerSpec(l.name, l.dtype, l.shape, role=r, kv_dtype=None if kd == layout_kv_dtype else kd)
                 for l, (r, kd) in zip(layers, roles))


@dataclass(frozen=True)
class BlockKey:
    """The block a file holds: vLLM's block hash (lowercase hex) and KV-cache group index."""

    hash: str
    group: int = 0

    def __post_init__(self) -> None:
        parse_hex("key.hash", self.hash)
        if not 2 <= len(self.hash) <= 128:
            raise SchemaError("key.hash", f"expected 2..128 hex digits, got {len(self.hash)}")  # F-4.12
        parse_uint("key.group", self.group, maximum=1 << 16)

    @classmethod
    def from_bytes(cls, block_hash: bytes, group: int = 0) -> "BlockKey":
        return cls(block_hash.hex(), group)

    def to_str(self) -> str:
        return f"{self.hash}:{self.group}"


@dataclass(frozen=True)
class Provenance:
    """Who wrote the file. Informational: never part of identity or of the payload."""

    tp: int = 1
    pp: int = 1
    dcp: int = 1
    pcp: int = 1
    row: str = "unknown"
    writer: str = ""
    created: int = 0
    # The writer's pipeline partition (decoder layers per stage) and context-parallel token interleave
    # (spec §4.4): provenance too, recorded when pp > 1 / dcp x pcp > 1.
    pp_layers: tuple[int, ...] = ()
    cp_interleave: int = 1

    def __post_init__(self) -> None:
        for f in ("tp", "pp", "dcp", "pcp"):
            parse_uint(f"kvf.{f}", getattr(self, f), minimum=1, maximum=1 << 16)
        if self.row not in ROW_LAYOUTS:
            raise SchemaError("kvf.row", f"expected one of {ROW_LAYOUTS}, got {self.row!r}")  # F-4.12
        parse_name("kvf.writer", self.writer, allow_empty=True)
        parse_uint("kvf.created", self.created)
        pp_layers: Any = self.pp_layers
        if not isinstance(pp_layers, tuple):  # a list from to_dict()/JSON: kept as a tuple, so hashable
            object.__setattr__(self, "pp_layers", tuple(pp_layers))
        if self.pp_layers and (len(self.pp_layers) != self.pp
                               or not all(type(n) is int and 0 <= n <= MAX_LAYERS for n in self.pp_layers)):
            raise SchemaError("kvf.pp_layers", f"expected {self.pp} layer counts (kvf.pp), got "
                              f"{list(self.pp_layers)[:8]!r}")  # F-4.16
        parse_uint("kvf.cp_interleave", self.cp_interleave, minimum=1, maximum=1 << 16)  # F-4.16

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tp": self.tp, "pp": self.pp, "dcp": self.dcp, "pcp": self.pcp, "row": self.row,
                               "writer": self.writer, "created": self.created}
        if self.pp_layers:
            out["pp_layers"] = list(self.pp_layers)
        if self.cp_interleave != 1:
            out["cp_interleave"] = self.cp_interleave
        return out


@dataclass(frozen=True)
class SealFields:
    """The per-file fields of a sealed file (spec §12): which key, the nonce its file key is derived from,
    and the authentication tag. The level is the layout's (``CanonicalLayout.seal``)."""

    key_id: str
    nonce: str
    tag: str

    def __post_init__(self) -> None:
        parse_hex("kvf.key_id", self.key_id, SEAL_KEY_ID_HEX)  # F-12.2
        parse_hex("kvf.nonce", self.nonce, SEAL_NONCE_HEX)  # F-12.2
        parse_hex("kvf.tag", self.tag, SEAL_TAG_HEX)  # F-12.2: a truncated tag is refused, never compared

    def to_dict(self) -> dict[str, str]:
        return {"key_id": self.key_id, "nonce": self.nonce, "tag": self.tag}


@dataclass(frozen=True)
class BlockHeader:
    """Everything the header of one file says (spec §4), plus where its regions are."""

    version: str
    layout: CanonicalLayout
    key: BlockKey
    provenance: Provenance
    codec: str
    data_offset: int  # where the data section starts (a multiple of ALIGNMENT)
    data_bytes: int  # stored bytes (compressed size for zstd)
    raw_bytes: int  # decoded payload bytes (== layout.payload_bytes)
    header_xxh3: str
    data_xxh3: str
    raw_xxh3: str  # xxh3 of the decoded payload (== data_xxh3 when codec is none; "" when encrypted, §12.3)
    level: int | None = None
    extra: Mapping[str, str] = field(default_factory=dict)  # unknown kvf.* keys of a newer minor
    seal: SealFields | None = None  # §12: present exactly when layout.seal is
    planes: tuple[tuple[str, int], ...] = ()  # §6.2: (method, stored bytes) per plane of a plane-coded file

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.data_bytes

    @property
    def ratio(self) -> float:
        """Decoded / stored bytes (1.0 when uncompressed)."""
        return self.raw_bytes / self.data_bytes if self.data_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version, "layout": self.layout.to_dict(), "namespace": self.layout.namespace(),
            "key": {"hash": self.key.hash, "group": self.key.group}, "provenance": self.provenance.to_dict(),
            "codec": self.codec, "level": self.level, "data_offset": self.data_offset, "data_bytes": self.data_bytes,
            "raw_bytes": self.raw_bytes, "file_bytes": self.file_bytes,
            "checksums": {"header_xxh3": self.header_xxh3, "data_xxh3": self.data_xxh3, "raw_xxh3": self.raw_xxh3},
            **({"seal": {"level": self.layout.seal, **self.seal.to_dict()}} if self.seal is not None else {}),
            **({"planes": [list(p) for p in self.planes]} if self.planes else {}),
        }


def layout_from_namespace_doc(raw: bytes) -> CanonicalLayout | None:
    """The layout a ``namespace.json`` describes (:func:`namespace_doc`'s inverse); None when it describes none."""
    try:
        ident = json.loads(raw)["identity"]
        return CanonicalLayout.from_dict({**ident, "layers": [x[:3] for x in ident["layers"]]})
    except (ValueError, KeyError, TypeError):
        return None


def namespace_doc(layout: CanonicalLayout) -> dict[str, Any]:
    """The human-readable ``namespace.json`` written beside a namespace's files."""
    return {"kvformat": layout.version, "namespace": layout.namespace(), "identity": layout.identity()}
