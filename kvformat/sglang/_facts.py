"""What an SGLang deployment stores per page, read from SGLang's own objects (the backend's fact extraction).

SGLang hands a storage backend its ``HiCacheStorageConfig`` (ranks, sizes, the served model name, the extra
config) and, after construction, its host KV pool (``MLATokenToKVPoolHost``: dtype, page size, layer count,
latent width, host layout). The KV dtype of an fp8 cache, the model revision and the RoPE convention are not
in either (SGLang issue #33268): they come from the extra config, else from SGLang's process-wide server args
when they are set, and a fact that neither gives is refused by name, never guessed. This module is the one
place SGLang's objects are read; SGLang is imported only inside functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..cache import ENGINE, ROPE_STYLES, TOKEN_CHAIN, chain_layer_name, chain_layout
from ..errors import SchemaError
from ..format import CanonicalLayout, LayerSpec
from ..layout import RowPlan

__all__ = ["HOST_LAYOUTS", "PageFacts", "page_facts", "page_plan"]

#: SGLang host layouts this backend stores (the MLA pool's three byte orders; see :func:`page_plan`).
HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
# SGLang's float host dtypes are the KV dtype itself; uint8 (fp8 caches) needs the configured name.
_FLOAT_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
                 "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
_FP8_NAMES = {"fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}  # SGLang's --kv-cache-dtype spellings
_KVD_NAMES = {**_FP8_NAMES, "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
              "fp32": "float32", "float32": "float32"}
_ST = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "fp8_e4m3": "F8_E4M3", "fp8_e5m2": "F8_E5M2"}
_ITEM = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class PageFacts:
    """One SGLang rank's storage facts: identity inputs, the host pool's geometry and the rank's role."""

    model: str
    kv_dtype: str
    revision: str | None
    page_tokens: int
    n_layers: int
    width: int
    host_layout: str
    host_tokens: int  # tokens the host pool holds (a layer_first layer's length)
    tp_size: int
    writer: bool  # SGLang's is_storage_writer: one writer per TP group for MLA
    key_scheme: str = ENGINE
    rope: str | None = None
    quantization: str | None = None  # weight quantization, pinned in a token-chain namespace (vLLM pins it)
    sources: Mapping[str, str] = field(default_factory=dict)  # fact -> where it came from (logs)

    @property
    def st_dtype(self) -> str:
        return _ST[self.kv_dtype]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer."""
        return self.page_tokens * self.width * _ITEM[self.st_dtype]

    def layout(self) -> CanonicalLayout:
        """The namespace identity of this deployment's files under its key scheme."""
        layers = tuple(LayerSpec(chain_layer_name(i), self.st_dtype, (self.page_tokens, self.width))
                       for i in range(self.n_layers))
        if self.key_scheme == TOKEN_CHAIN:
            pins = {"rope": self.rope or ""}
            if self.st_dtype.startswith("F8"):
                pins["kv_scale"] = "none"  # SGLang casts the latent to fp8 unscaled (vLLM divides by k_scale)
            if self.quantization:
                pins["quantization"] = self.quantization
            return chain_layout(self.model, self.kv_dtype, self.page_tokens, range(self.n_layers), layers,
                                self.revision, pins)
        # SGLang's own page keys (seeded by LoRA id / cache salt when set), in a namespace of its own.
        return CanonicalLayout(model=self.model, kv_dtype=self.kv_dtype, tokens_per_block=self.page_tokens,
                               blocks_per_chunk=1, tokens_per_hash=self.page_tokens, layers=layers,
                               revision=self.revision, pins={"key_scheme": "sglang-page-keys"})


def _server_args() -> Any:
    """SGLang's process-wide server args when the process has them (a running server), else None."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except (ImportError, ValueError, AttributeError):
        return None


def _fact(name: str, configured: Any, from_server: Any, sources: dict[str, str]) -> Any:
    """The configured value, else the server's; both given and different is refused (never one guessed)."""
    if configured is not None and from_server is not None and configured != from_server:
        raise SchemaError(name, f"the extra config says {configured!r} but SGLang's server args say {from_server!r}")
    if configured is not None:
        sources[name] = "extra config"
        return configured
    if from_server is not None:
        sources[name] = "server args"
    return from_server


def page_facts(storage_config: Any, pool: Any, extra: Mapping[str, Any], key_scheme: str) -> PageFacts:
    """The facts of this rank from SGLang's storage config, its host pool and the backend's extra config.

    Raises SchemaError naming what is refused: a model that is not pure MLA (or its DSA/packed fp8 form), an
    MTP draft layer in the pool, pipeline, decode-context or attention-context parallelism, an unknown host
    layout, a missing model name or fp8 dtype, or a token-chain deployment without a RoPE convention.
    """
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    sc = storage_config
    if not getattr(sc, "is_mla_model", False) or not isinstance(pool, MLATokenToKVPoolHost):
        raise SchemaError("model", "kvformat stores MLA KV only; SGLang's storage config says is_mla_model="
                          f"{getattr(sc, 'is_mla_model', None)} and its host pool is {type(pool).__name__}")
    if getattr(pool, "dsa_kv_cache_store_fp8", False) or pool.kv_cache_dim != pool.kv_lora_rank + pool.qk_rope_head_dim:
        raise SchemaError("model", "DSA (sparse MLA) pages with a packed fp8 latent are not supported yet")
    if pool.layer_num != pool.target_layer_num:
        raise SchemaError("model", f"the host pool packs {pool.layer_num - pool.target_layer_num} MTP draft layer(s) "
                          "with the target's; MTP draft pools are not supported yet")
    for what, size in (("pipeline", sc.pp_size), ("attention context", sc.attn_cp_size),
                       ("decode context", getattr(sc, "dcp_size", 1))):
        if size != 1:
            raise SchemaError("parallel", f"{what} parallelism (size {size}) is not supported yet: a rank then "
                              "holds part of a page")
    if pool.layout not in HOST_LAYOUTS:
        raise SchemaError("host_layout", f"SGLang host layout {pool.layout!r} is not supported (one of "
                          f"{', '.join(HOST_LAYOUTS)})")
    sources: dict[str, str] = {}
    args = _server_args()
    model = _fact("model", extra.get("model"), None, sources) or sc.model_name
    if not model:
        raise SchemaError("model", "SGLang passed no model name; set \"model\" in the extra config")
    sources.setdefault("model", "storage config")
    revision = _fact("model_revision", extra.get("model_revision"), getattr(args, "revision", None) or None, sources)
    host_dtype = str(pool.dtype).removeprefix("torch.")
    kv_dtype = _FLOAT_DTYPES.get(host_dtype)
    server_kvd = getattr(args, "kv_cache_dtype", None)
    configured = extra.get("kv_cache_dtype")
    if kv_dtype is not None:
        sources["kv_cache_dtype"] = "host pool dtype"
        for said in (configured, server_kvd):
            if said not in (None, "auto") and _KVD_NAMES.get(said, said) != kv_dtype:
                raise SchemaError("kv_cache_dtype", f"{said!r} is configured but SGLang's host pool holds {host_dtype}")
    elif host_dtype == "uint8":
        said = _fact("kv_cache_dtype", configured, server_kvd if server_kvd in _FP8_NAMES else None, sources)
        if said not in _FP8_NAMES:
            raise SchemaError("kv_cache_dtype", "SGLang stores an fp8 cache as uint8 and does not say which fp8 "
                              "(SGLang issue #33268); set \"kv_cache_dtype\": \"fp8_e4m3\" or \"fp8_e5m2\" in the "
                              f"extra config (got {said!r})")
        kv_dtype = _FP8_NAMES[said]
    else:
        raise SchemaError("kv_cache_dtype", f"SGLang host dtype {host_dtype} is not a KV dtype kvformat stores")
    quant = _fact("quantization", extra.get("quantization"), getattr(args, "quantization", None) or None, sources)
    rope = extra.get("rope")
    if rope is not None and rope not in ROPE_STYLES:
        raise SchemaError("rope", f"expected one of {', '.join(ROPE_STYLES)}, got {rope!r}")
    if key_scheme == TOKEN_CHAIN and rope is None:
        raise SchemaError("rope", "the token-chain key scheme shares files with vLLM, which must compute the same "
                          "RoPE: set \"rope\": \"interleaved\" (DeepSeek with rope_interleave true, SGLang's "
                          "default) or \"neox\" in the extra config")
    return PageFacts(model=str(model), kv_dtype=kv_dtype, revision=revision, page_tokens=int(pool.page_size),
                     n_layers=int(pool.layer_num), width=int(pool.kv_cache_dim), host_layout=pool.layout,
                     host_tokens=int(pool.size), tp_size=int(sc.tp_size), writer=bool(sc.is_storage_writer),
                     key_scheme=key_scheme, rope=rope, quantization=quant, sources=sources)


def page_plan(facts: PageFacts, layout: CanonicalLayout) -> tuple[RowPlan, int, bool]:
    """Where a page's bytes sit in the host pool: ``(plan, stride, interleaved)``.

    Page ``i`` (host index ``i * page_tokens``) starts at ``i * stride`` of the pool's buffer; the plan's runs
    copy between there and the canonical payload (per layer, the page's tokens):

    * ``page_first_direct`` (``[page][layer][token][latent]``): the page is the payload, as it is.
    * ``page_first`` (``[token][layer][latent]``): a transpose, one strided run per layer.
    * ``layer_first`` (``[layer][token][latent]``): one page-sized run per layer, a whole layer apart, so
      consecutive pages' windows interleave (``interleaved``).
    """
    e = facts.width * _ITEM[facts.st_dtype]  # one token of one layer
    pb, n = facts.page_bytes, facts.n_layers
    runs: tuple[tuple[int, int, int, int, int, int], ...]
    if facts.host_layout == "page_first_direct":
        stride, slot, interleaved = n * pb, n * pb, False
        runs = ((0, 0, n * pb, 1, n * pb, n * pb),)
    elif facts.host_layout == "page_first":
        stride, slot, interleaved = n * pb, n * pb, False
        runs = tuple((l * e, l * pb, e, facts.page_tokens, n * e, e) for l in range(n))
    else:
        layer = facts.host_tokens * e
        stride, slot, interleaved = pb, (n - 1) * layer + pb, True
        runs = tuple((l * layer, l * pb, pb, 1, pb, pb) for l in range(n))
    order = "layer_outer" if facts.host_layout != "page_first" else "token_outer"
    return RowPlan(layout, slot, runs, order, f"SGLang host pool ({facts.host_layout})"), stride, interleaved
