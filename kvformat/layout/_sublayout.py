"""Page sub-layouts: where token ``t``'s bytes live inside one block's page, per role, KV dtype and platform.

Every token-level movement (DCP de-/interleave, the staging path's part copies, legacy DCP rows, a worker
page whose order is not the file's) goes through :func:`token_runs` over two :class:`SubLayout` objects:
nothing else in kvformat knows how a page is ordered inside. Each description below is transcribed from the
vLLM writer that fills such pages (file and function of vLLM 0.34 in ``source``); ``tests/test_sublayout.py``
runs those writers (Triton's interpreter) and checks the transcriptions byte for byte, and checks that the
cited index arithmetic is still in the installed vLLM's source text.

A role/dtype/platform without a description here (an unknown platform, an indexer block size its vLLM backend
does not support) has no sub-layout: such layers are stored as whole pages only, their namespace pinned to the
platform, and decode-context parallelism is refused for them by name (:func:`describe`).

The file's byte order is one sub-layout per role (:func:`canonical`), whatever the writer's platform: MLA
latents are token rows (what every vLLM MLA writer produces), the DSA indexer is vLLM's CUDA order for one
block of ``tokens_per_block`` tokens (all 128-byte FP8 keys, then all 4-byte scales). A ROCm deployment's
shuffled indexer pages are converted on store and load, so a CUDA and a ROCm deployment with the same byte
*encoding* share files; a different encoding (FP8 e4m3fnuz, UE8M0-packed scales) changes the bytes of the
same tokens and is pinned in the identity (:func:`identity_pins`, spec/FORMAT.md §4.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import SchemaError
from ..format import FORM_ORDERS, FORM_PIN, FORM_UNKNOWN

__all__ = [
    "PLATFORMS", "SubLayout", "canonical", "describe", "identity_pins", "token_runs", "encoding_of",
    "platform_dependent",
    "ROWS", "SPLIT", "SHUFFLE16",
]

ROWS, SPLIT, SHUFFLE16 = "rows", "split", "shuffle16"

# The platforms whose writers are described (vLLM's current_platform, read by the adapter at start-up):
# cuda: NVIDIA, fp8 e4m3fn, indexer scales as fp32; cuda-mx: NVIDIA SM100, whose MQA-logits kernels make the
# indexer store each token's power-of-two scale as four UE8M0 bytes (``deep_gemm.mqa_logits_use_mx_scales``);
# rocm: AMD with OCP fp8 (e4m3fn, gfx950); rocm-fnuz: AMD gfx942, fp8 e4m3fnuz (``fp8_dtype()``).
PLATFORMS = ("cuda", "cuda-mx", "rocm", "rocm-fnuz")

_INDEXER_KEY, _INDEXER_SCALE = 128, 4  # bytes of one token's FP8 key and its scale (DSA index_head_dim 128)
_TILE = 16  # rocm shuffle: 16 tokens x 16 bytes per contiguous tile (kernels.py _INDEXER_CACHE_*_TILE*)

_SRC_VIEWS = ("vllm/v1/kv_cache_interface.py create_kv_cache_views: every MLA layer is a [blocks, 1, tokens, bytes] "
              "view, a token's bytes contiguous")
_SRC_MLA = ("vllm/models/deepseek_v32/common/kernels.py _fused_norm_rope_kernel (pid 1, MLA concat_and_cache): "
            "token at block_idx * block_stride + block_off * entry_stride")
_SRC_DS_MLA = ("vllm/models/deepseek_v32/common/kernels.py _fused_norm_rope_kernel (MLA_CACHE_DS_MLA): per token "
               "512 fp8 NoPE, 4 fp32 scales, 64 bf16 RoPE at block_off * entry_stride")
_SRC_SPLIT = ("vllm/models/deepseek_v32/common/kernels.py _fp8_quant_and_cache_write (SHUFFLE=False): values at "
              "block_offset * HEAD_DIM, scales at cache_block_size * HEAD_DIM + block_offset * 4; kernel block "
              "64 on CUDA (vllm/v1/attention/backends/mla/indexer.py DeepseekV32IndexerBackend"
              ".get_supported_kernel_block_sizes)")
_SRC_SHUFFLE = ("vllm/v1/attention/ops/rocm_aiter_mla_sparse.py _indexer_k_quant_and_cache_kernel (SHUFFLE) and "
                "vllm/models/deepseek_v32/common/kernels.py _fp8_quant_and_cache_write (SHUFFLE=True): "
                "[blk/16, head_dim/16, 16, 16] values, then fp32 scales at block_size * head_dim + block_offset * 4; "
                "shuffled above kernel block 1 (rocm_aiter_mla_sparse.indexer_k_cache_is_shuffled, "
                "models/deepseek_v32/amd/rocm.py DeepseekV32ROCmIndexerCache.uses_shuffled_layout), kernel block "
                "= the block (indexer backend: [1, MultipleOf(16)] on ROCm)")


@dataclass(frozen=True)
class SubLayout:
    """Where each token's bytes sit in one page of ``tokens`` tokens.

    ``order``: ``rows`` (token ``t`` at ``t * token_bytes``), ``split`` (per kernel block of ``tile``
    tokens: every token's 128 key bytes, then every token's 4 scale bytes) or ``shuffle16`` (the same
    split, the keys in 16-token x 16-byte tiles). ``tile``: the kernel block the pattern repeats over (0:
    the whole page). ``encoding``: how the bytes encode values (``bf16``, ``e4m3fn``, ``e4m3fn+f32``,
    ``e4m3fnuz+f32``, ``e4m3fn+ue8m0x4`` ...). ``source``: the vLLM writer this is transcribed from.
    """

    order: str
    token_bytes: int
    encoding: str
    tile: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        if self.order not in (ROWS, SPLIT, SHUFFLE16) or self.token_bytes < 1 or self.tile < 0:
            raise SchemaError("sublayout", f"expected a rows/split/shuffle16 order, got {self.order!r}")
        if self.order != ROWS and self.token_bytes != _INDEXER_KEY + _INDEXER_SCALE:
            raise SchemaError("sublayout", f"a {self.order} page holds 132-byte indexer tokens, got {self.token_bytes}")

    @property
    def name(self) -> str:
        """The order's name as the identity and the layout table spell it (``split@64``, ``rows``)."""
        return self.order + (f"@{self.tile}" if self.tile else "")

    def check(self, tokens: int) -> None:
        """Raise SchemaError unless a page of ``tokens`` tokens is whole kernel blocks of this order."""
        t = self.tile or tokens
        if tokens < 1 or tokens % t or (self.order == SHUFFLE16 and t % _TILE):
            raise SchemaError("sublayout", f"a {tokens}-token page is not whole {self.name} kernel blocks")

    def segments(self, t: int, tokens: int) -> tuple[tuple[int, int], ...]:
        """``(page offset, bytes)`` of token ``t``'s bytes in a ``tokens``-token page, in the token's record
        order (its key bytes, then its scale: the order of a token row)."""
        if self.order == ROWS:
            return ((t * self.token_bytes, self.token_bytes),)
        tile = self.tile or tokens
        base = (t // tile) * tile * self.token_bytes
        tt = t % tile
        scale = (base + tile * _INDEXER_KEY + tt * _INDEXER_SCALE, _INDEXER_SCALE)
        if self.order == SPLIT:
            return ((base + tt * _INDEXER_KEY, _INDEXER_KEY), scale)
        row = base + (tt // _TILE) * _TILE * _INDEXER_KEY + (tt % _TILE) * _TILE
        return tuple((row + k * _TILE * _TILE, _TILE) for k in range(_INDEXER_KEY // _TILE)) + (scale,)


_FP8 = ("fp8", "fp8_e4m3", "fp8_ds_mla")


def platform_dependent(role: str, kv_dtype: str) -> bool:
    """Whether the platform changes this layer's bytes for the same tokens (FP8 flavour, indexer order)."""
    return role != "mla" or kv_dtype in _FP8


def encoding_of(role: str, kv_dtype: str, platform: str | None) -> str:
    """How ``platform``'s writer encodes ``kv_dtype`` (vLLM: ``current_platform.fp8_dtype()`` for every FP8
    write, ``mqa_logits_use_mx_scales`` for the indexer's scales)."""
    fp8 = "e4m3fnuz" if platform == "rocm-fnuz" else "e4m3fn"
    if role == "dsa_indexer":
        return fp8 + ("+ue8m0x4" if platform == "cuda-mx" else "+f32")
    if kv_dtype in _FP8:
        return fp8
    return kv_dtype


def canonical(role: str, kv_dtype: str, token_bytes: int, encoding: str) -> SubLayout:
    """The file's sub-layout of a layer (one per role: token rows, or the DSA indexer's split block)."""
    if role == "dsa_indexer":
        return SubLayout(SPLIT, token_bytes, encoding, 0, _SRC_SPLIT)
    return SubLayout(ROWS, token_bytes, encoding, 0, _SRC_DS_MLA if kv_dtype == "fp8_ds_mla" else _SRC_MLA)


def describe(role: str, kv_dtype: str, token_bytes: int, platform: str | None, tokens: int) -> SubLayout | None:
    """The sub-layout ``platform``'s vLLM writer gives a ``tokens``-token page of this layer, or None when
    there is no description (unknown platform or role, a block size the platform's kernel does not take).

    MLA latents of a 16/32-bit dtype are token rows of the same bytes on every platform (the views and the
    writers index ``block * block_stride + offset * entry_stride`` alike), so they need no platform."""
    if role == "mla" and kv_dtype not in _FP8:
        return SubLayout(ROWS, token_bytes, kv_dtype, 0, _SRC_VIEWS)
    if platform not in PLATFORMS:
        return None
    enc = encoding_of(role, kv_dtype, platform)
    if role == "mla":
        return SubLayout(ROWS, token_bytes, enc, 0, _SRC_DS_MLA if kv_dtype == "fp8_ds_mla" else _SRC_MLA)
    if role != "dsa_indexer" or kv_dtype != "dsa_indexer_fp8" or token_bytes != _INDEXER_KEY + _INDEXER_SCALE:
        return None
    if platform.startswith("rocm"):
        if tokens == 1:
            return SubLayout(SPLIT, token_bytes, enc, 0, _SRC_SHUFFLE)  # one token: split and rows coincide
        if tokens % _TILE:
            return None
        return SubLayout(SHUFFLE16, token_bytes, enc, 0, _SRC_SHUFFLE)
    if tokens % 64:
        return None  # vLLM's CUDA indexer takes kernel blocks of 64 tokens only
    return SubLayout(SPLIT, token_bytes, enc, 64 if tokens != 64 else 0, _SRC_SPLIT)


def identity_pins(layers: Sequence[tuple[str, str, SubLayout | None]], platform: str | None) -> dict[str, str]:
    """The ``kvf.pins`` entries that name the file's byte form where it is not the spec's default (§4.5).

    ``layers``: ``(role, true kv dtype, the writer's sub-layout or None)``. ``form.<kv dtype>`` =
    ``<order>/<encoding>`` for every DSA indexer dtype (its order is kvformat's, so it is always named) and
    for every encoding other than the default (FP8 e4m3fn, f32 scales); ``unknown:<platform>`` when the
    writer's sub-layout is not described (whole pages of an unknown order: only the same platform shares).
    """
    pins: dict[str, str] = {}
    for role, kvd, sub in layers:
        key = f"{FORM_PIN}{kvd}"
        if sub is None:
            pins[key] = f"{FORM_UNKNOWN}{platform or 'unknown'}"[:256]
            continue
        order = FORM_ORDERS.get(role, ROWS)
        default = {"dsa_indexer": "e4m3fn+f32"}.get(role, "e4m3fn" if kvd in _FP8 else kvd)
        if role == "dsa_indexer" or sub.encoding != default:
            pins[key] = f"{order}/{sub.encoding}"
    return pins


Run = tuple[int, int, int, int, int, int]


def token_runs(src: SubLayout, src_tokens: int, dst: SubLayout, dst_tokens: int, dst_token: Sequence[int],
               src_base: int = 0, dst_base: int = 0) -> list[Run]:
    """Copy runs placing every token of a ``src_tokens``-token page of sub-layout ``src`` at token
    ``dst_token[t]`` of a ``dst_tokens``-token page of ``dst``: ``(src offset, dst offset, bytes, count,
    src stride, dst stride)``, offsets from ``src_base`` / ``dst_base``.

    Raises SchemaError when the two do not hold the same bytes per token, when either page is not whole
    kernel blocks of its order, or when a destination token is out of range or repeats.
    """
    if src.token_bytes != dst.token_bytes or src.encoding != dst.encoding:
        raise SchemaError("sublayout", f"{src.name} ({src.token_bytes} B, {src.encoding}) and {dst.name} "
                          f"({dst.token_bytes} B, {dst.encoding}) do not hold the same token bytes")
    src.check(src_tokens)
    dst.check(dst_tokens)
    if len(dst_token) != src_tokens or len(set(dst_token)) != src_tokens or \
            any(not 0 <= c < dst_tokens for c in dst_token):
        raise SchemaError("sublayout", f"the token map does not place {src_tokens} tokens at distinct positions "
                          f"of a {dst_tokens}-token page")
    pieces: list[list[tuple[int, int, int]]] = []
    for t in range(src_tokens):
        for k, (so, do, n) in enumerate(_cut(src.segments(t, src_tokens), dst.segments(dst_token[t], dst_tokens))):
            if k == len(pieces):
                pieces.append([])
            pieces[k].append((src_base + so, dst_base + do, n))
    out: list[Run] = []
    for seq in pieces:  # one segment kind at a time, tokens in order: long contiguous and strided runs
        out.extend(_fold(_merge(seq)))
    return out


def _cut(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> list[tuple[int, int, int]]:
    """One token's record as (src offset, dst offset, bytes) pieces, cut wherever either side is cut."""
    out: list[tuple[int, int, int]] = []
    i = j = 0
    ai = bj = 0  # bytes already used of a[i] / b[j]
    while i < len(a) and j < len(b):
        n = min(a[i][1] - ai, b[j][1] - bj)
        out.append((a[i][0] + ai, b[j][0] + bj, n))
        ai, bj = ai + n, bj + n
        if ai == a[i][1]:
            i, ai = i + 1, 0
        if bj == b[j][1]:
            j, bj = j + 1, 0
    return out


def _merge(seq: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for so, do, n in seq:
        if out and out[-1][0] + out[-1][2] == so and out[-1][1] + out[-1][2] == do:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((so, do, n))
    return out


def _fold(seq: list[tuple[int, int, int]]) -> list[Run]:
    """Equal-sized pieces at constant strides become one run."""
    out: list[Run] = []
    for so, do, n in seq:
        if out:
            s0, d0, n0, cnt, ss, ds = out[-1]
            if n0 == n:
                if cnt == 1 and so > s0 and do > d0:  # copy_runs takes non-negative strides
                    out[-1] = (s0, d0, n, 2, so - s0, do - d0)
                    continue
                if cnt > 1 and so == s0 + cnt * ss and do == d0 + cnt * ds:
                    out[-1] = (s0, d0, n, cnt + 1, ss, ds)
                    continue
        out.append((so, do, n, 1, n, n))
    return out
