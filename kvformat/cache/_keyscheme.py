"""How chunk files are named across engines: the ``key_scheme`` parameter of every adapter.

``"engine"`` (the default): a chunk is named by its engine's own block key (vLLM's block hash, SGLang's page
hash) in a namespace only that engine writes. ``"token-chain"``: a chunk of plain token ids is named by
:func:`page_chain`, SGLang's storage page chain (``h_i = sha256(h_{i-1} || u32le(page token ids))``, the first
page unseeded), which both adapters compute: SGLang passes it as the page key, vLLM's tier computes it from the
request's token ids. Files of the two schemes never mix: the scheme is in the namespace identity
(:func:`chain_layout` pins it), and so is everything else the two engines may do differently for the same
tokens (RoPE convention, fp8 scale handling), so a namespace two engines share holds bytes both compute.

No engine import: the adapters pass in token ids and their engine's facts.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Mapping, Sequence

from ..errors import SchemaError
from ..format import CanonicalLayout, LayerSpec

__all__ = ["KEY_SCHEMES", "ENGINE", "TOKEN_CHAIN", "ROPE_STYLES", "page_chain", "chain_layer_name", "chain_layout",
           "parse_key_scheme"]

ENGINE = "engine"
TOKEN_CHAIN = "token-chain"
KEY_SCHEMES = (ENGINE, TOKEN_CHAIN)
# The pin's value names the chain function: bump it if page_chain ever changes (files would be misnamed).
CHAIN_VERSION = "sglang-page-sha256-v1"
ROPE_STYLES = ("interleaved", "neox")

_U32_MAX = 0xFFFFFFFF
_WIDE_TAG = b"\xff"  # SGLang marks a page holding a token id above u32 (hash_binding.cpp: odd byte count)


def parse_key_scheme(value: object) -> str:
    """``value`` checked as a key scheme (SchemaError naming ``key_scheme`` otherwise)."""
    if value not in KEY_SCHEMES:
        raise SchemaError("key_scheme", f"expected one of {', '.join(KEY_SCHEMES)}, got {value!r}")
    return str(value)


def page_chain(token_ids: Sequence[int], page_tokens: int, prior: str | None = None,
               start_page: int = 0, out: list[str] | None = None) -> list[str]:
    """SGLang's storage key of every FULL page of ``token_ids`` (hex, one per page), the chain seeded by ``prior``.

    Page ``i`` hashes ``sha256(bytes.fromhex(h_{i-1}) || u32le(tokens of page i))`` with ``h_{-1} = prior``
    (nothing hashed before the first page when ``prior`` is None), exactly as SGLang 0.5.23's
    ``get_hash_str`` (``mem_cache/cpp_utils/hash_binding.cpp``); a page holding a token id above u32 is
    hashed as SGLang hashes it, ``0xff || u64le(tokens)``. ``start_page``/``out`` extend a chain already
    computed for the first ``start_page`` pages (``out`` holds them; ``prior`` is then ignored).

    Raises SchemaError for a page size below 1 or a negative token id.
    """
    if page_tokens < 1:
        raise SchemaError("page_tokens", f"expected a positive page size, got {page_tokens}")
    keys = out if out is not None else []
    digest = bytes.fromhex(keys[start_page - 1]) if start_page else (bytes.fromhex(prior) if prior else b"")
    for p in range(start_page, len(token_ids) // page_tokens):
        page = token_ids[p * page_tokens:(p + 1) * page_tokens]
        try:
            data = array("I", page).tobytes()  # native order: little-endian on every platform SGLang runs on
        except OverflowError:
            if min(page) < 0:
                raise SchemaError("token_ids", f"token ids must be non-negative, page {p} holds {min(page)}") from None
            data = _WIDE_TAG + struct.pack(f"<{len(page)}Q", *page)
        h = hashlib.sha256(digest + data).digest()
        keys.append(h.hex())
        digest = h
    return keys


def chain_layer_name(index: int) -> str:
    """The engine-neutral name of decoder layer ``index`` in a token-chain file (vLLM's DeepSeek naming)."""
    return f"model.layers.{index}.self_attn.attn"


def chain_layout(model: str, kv_dtype: str, page_tokens: int, layer_index: Sequence[int], layers: Sequence[LayerSpec],
                 revision: str | None, pins: Mapping[str, str]) -> CanonicalLayout:
    """The layout both engines compute for a token-chain namespace: one page per file.

    ``layers`` are the engine's per-layer specs in model order (their bytes per token must already be the
    canonical latent: ``[page_tokens, width]`` per layer), ``layer_index`` each one's decoder-layer index
    (renamed :func:`chain_layer_name`: engines name layers differently). ``pins`` are the engine's facts that
    change bytes for the same tokens (``rope``, and ``kv_scale`` for fp8); the key scheme is pinned here.
    Raises SchemaError when the layers are not a pure MLA latent stack (only those have one byte form).
    """
    if list(layer_index) != list(range(len(layers))):
        raise SchemaError("layers", "token-chain files hold the whole decoder stack from layer 0, in order (pipeline "
                          f"stages are not supported); got layers {list(layer_index)[:8]}")
    if pins.get("rope") not in ROPE_STYLES:
        raise SchemaError("rope", f"the RoPE convention (one of {', '.join(ROPE_STYLES)}) must be known for a "
                          f"token-chain namespace, got {pins.get('rope')!r}")
    out = []
    for i, l in zip(layer_index, layers):
        if l.role != "mla" or l.kv_dtype not in (None, kv_dtype) or len(l.shape) != 2:
            raise SchemaError("layers", f"layer {l.name} is not a plain MLA latent of {kv_dtype}; token-chain "
                              "namespaces hold pure MLA stacks only")
        if page_tokens % l.shape[0]:
            raise SchemaError("layers", f"layer {l.name}: blocks of {l.shape[0]} tokens do not tile a "
                              f"{page_tokens}-token page")
        out.append(LayerSpec(chain_layer_name(i), l.dtype, (page_tokens, l.shape[1])))
    return CanonicalLayout(model=model, kv_dtype=kv_dtype, tokens_per_block=page_tokens, blocks_per_chunk=1,
                           tokens_per_hash=page_tokens, layers=tuple(out), family="mla", revision=revision, group=0,
                           pins={**pins, "key_scheme": CHAIN_VERSION})
