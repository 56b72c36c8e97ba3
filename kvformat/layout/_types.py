"""The layout model's types: deployment facts, row plans and the copies between a row slot and a payload.

No I/O and no vLLM; :mod:`kvformat.layout` holds the rules that build plans from facts and re-exports
these names.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..format import CanonicalLayout, LayerSpec, copy_runs
from ..errors import SchemaError
from ._sublayout import SubLayout, canonical, describe, identity_pins, token_runs

ROLE_MLA = "mla"
ROLE_INDEXER = "dsa_indexer"
ROLE_OPAQUE = "opaque"

# Packed KV formats: per-token bytes and the parts of one token slot (spec §4.3). fp8_ds_mla is vLLM's
# FlashMLA-sparse cache (DeepSeek-V3.2, GLM-5): the 512-wide no-rope latent in FP8 E4M3, four F32
# scales (one per 128 values), the 64-wide rope part in BF16. dsa_indexer_fp8 is the DSA indexer's
# key cache (128 FP8 E4M3 values and one F32 scale per token; the order inside a block is vLLM's).
PACKED_DTYPES: Mapping[str, tuple[int, tuple[tuple[str, str, int], ...]]] = {
    "fp8_ds_mla": (656, (("nope", "F8_E4M3", 512), ("scale", "F32", 4), ("rope", "BF16", 64))),
    "dsa_indexer_fp8": (132, (("key", "F8_E4M3", 128), ("scale", "F32", 1))),
}
# Latent widths (values per token) of shipped MLA models: 512+64 (DeepSeek V2/V3/V3.2/R1, Kimi K2,
# GLM-5) and 256+32 (MiniCPM3). The fallback rule accepts only these.
MLA_WIDTHS = (576, 288)
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1}


def role_from_name(name: str) -> str:
    """The role a vLLM layer name implies (DSA indexer caches are ``*.indexer.k_cache``)."""
    return ROLE_INDEXER if name.endswith(".indexer.k_cache") else ROLE_MLA


@dataclass(frozen=True)
class LayerFacts:
    """What is known about one layer: role, true KV dtype, storage dtype, per-block shape, page bytes,
    and where vLLM's allocator put it (``gpu_offset``: bytes from the allocation start, or from the block
    start for block-outer layouts; ``gpu_block_stride``: bytes between its consecutive blocks).
    """

    name: str
    role: str
    kv_dtype: str
    st_dtype: str
    shape: tuple[int, ...]
    page: int
    gpu_offset: int | None = None
    gpu_block_stride: int | None = None

    def spec(self, layout_kv_dtype: str) -> LayerSpec:
        return LayerSpec(self.name, self.st_dtype, self.shape, role=self.role,
                         kv_dtype=None if self.kv_dtype == layout_kv_dtype else self.kv_dtype)


@dataclass(frozen=True)
class GroupFacts:
    """One selected KV-cache group: its index, tokens per block and layer names (vLLM's order)."""

    group: int
    tokens_per_block: int
    layer_names: tuple[str, ...]
    kind: str = "full"  # "full" | "sliding_window" (a refusal names anything else)


@dataclass(frozen=True)
class ParallelFacts:
    """Where a deployment's workers keep a chunk beyond TP replication, as vLLM places it.

    ``stages`` lists, per pipeline stage, the group's layer names that stage's workers hold, in the
    order their slots hold them (vLLM's per-stage group order). Worker ``w`` of a row is pipeline stage
    ``w // (pcp * tp)``, prefill-context (PCP) rank ``(w // tp) % pcp`` and TP rank ``w % tp`` (vLLM's rank
    order: dp, pp, pcp, tp); its decode-context (DCP) rank is ``tp rank % dcp`` (vLLM's DCP groups are
    consecutive TP ranks). A DCP rank holds the block's tokens ``t`` with ``(t // interleave) % dcp == its
    rank`` (:func:`cp_canonical_token`). PCP ranks (without DCP) hold the whole KV: vLLM gathers it back to
    every PCP rank, so they are replicas like TP ranks (checked byte for byte on every store).
    """

    tp: int
    pp: int = 1
    dcp: int = 1
    interleave: int = 1
    stages: tuple[tuple[str, ...], ...] = ()
    stage_layers: tuple[int, ...] = ()  # decoder layers per stage (vLLM's partition; provenance)
    pcp: int = 1

    @property
    def trivial(self) -> bool:
        return self.pp == 1 and self.dcp == 1 and self.pcp == 1


def cp_canonical_token(local: int, cp_rank: int, cp_size: int, interleave: int) -> int:
    """The token position (in the logical block of ``cp_size`` local blocks) of a context-parallel rank's
    local token ``local``: vLLM's interleave (``canonical_mapping._local_to_canonical_token``)."""
    chunk, pos = divmod(local, interleave)
    return (chunk * cp_size + cp_rank) * interleave + pos


@dataclass(frozen=True)
class DeploymentFacts:
    """A deployment as the tier (or the legacy converter) sees it.

    ``layers`` maps layer name to :class:`LayerFacts` when they are known (from vLLM's KV-cache config);
    None means only names and totals are known and the fallback rules apply. ``source`` says where the
    facts came from (recorded in logs and the layout table, never in the identity).
    """

    model: str
    kv_dtype: str
    tokens_per_hash: int
    blocks_per_chunk: int
    worker_bytes_per_block: int
    groups: tuple[GroupFacts, ...]
    row: str = "replicated"  # replicated | per_worker | canonical
    copies: int = 1
    kv_cache_layout: str | None = None
    canonical_family: str | None = None
    revision: str | None = None
    pins: Mapping[str, str] = field(default_factory=dict)
    layers: Mapping[str, LayerFacts] | None = None
    source: str = "offloading-config"
    # Whether vLLM itself says every layer's KV is replicated on every TP rank (per-layer MLA specs, or
    # model_config.use_mla): what replica_policy "trust_rank0" needs before it may skip the check.
    replicated_kv_known: bool = False
    # Pipeline / decode-context parallel placement (None or trivial: every worker slot holds the chunk).
    parallel: ParallelFacts | None = None
    # The platform whose vLLM writers filled the pages (kvformat.layout._sublayout.PLATFORMS), read from vLLM
    # at start-up (or given to compact); None: unknown, so only layers whose bytes no platform changes have a
    # described sub-layout.
    platform: str | None = None

    @property
    def block_outer(self) -> bool:
        return bool(self.kv_cache_layout) and str(self.kv_cache_layout).upper().startswith("B")


Run = tuple[int, int, int, int, int, int]


@dataclass(frozen=True)
class Shard:
    """The workers whose slots hold the same part of a chunk (TP replicas of one pipeline stage and
    decode-context rank), the runs between one such slot and the payload, and the slot bytes they use."""

    slots: tuple[int, ...]
    runs: tuple[Run, ...]
    used: int


@dataclass(frozen=True)
class RowPlan:
    """One group's chunk: its canonical layout, where its bytes sit in a row slot, and how to copy them.

    ``runs`` are ``(slot offset, payload offset, bytes, count, slot stride, payload stride)``: ``count``
    pieces of ``bytes``, the i-th at ``slot offset + i * slot stride`` in the slot and ``payload offset
    + i * payload stride`` in the payload.
    """

    layout: CanonicalLayout
    slot_bytes: int  # one worker's slot (the row region every copy of the chunk occupies)
    runs: tuple[tuple[int, int, int, int, int, int], ...]
    order: str  # "layer_outer" | "block_outer" | "opaque"
    source: str
    # Pipeline / decode-context parallel rows: each shard's slots hold one part of the payload. Empty:
    # every worker slot holds the whole chunk (``runs``).
    shards: tuple[Shard, ...] = ()

    @functools.cached_property
    def contiguous(self) -> bool:
        """The payload is the slot's first ``payload_bytes`` bytes as they are (no copy needed)."""
        n = self.layout.payload_bytes
        if self.shards:
            return False
        return all(so == po for so, po, *_ in self.runs) and _covers(self.runs, n)

    def gather(self, slot: memoryview, out: memoryview) -> None:
        """Copy the canonical payload out of a row slot (``slot`` at least ``slot_bytes``)."""
        _copy_runs(slot, out, self.runs, to_payload=True)

    def scatter(self, payload: memoryview, slot: memoryview) -> None:
        """Place a canonical payload into a row slot, each layer where the deployment keeps it."""
        _copy_runs(payload, slot, self.runs, to_payload=False)

    def gather_shard(self, shard: Shard, slot: memoryview, out: memoryview) -> None:
        """Copy one shard's part of the payload out of one of its slots."""
        _copy_runs(slot, out, shard.runs, to_payload=True)

    def scatter_shard(self, shard: Shard, payload: memoryview, slot: memoryview) -> None:
        """Place one shard's part of a payload into one of its slots."""
        _copy_runs(payload, slot, shard.runs, to_payload=False)

    def describe(self) -> str:
        roles = sorted({l.role for l in self.layout.layers})
        parts = f", {len(self.shards)} shards" if self.shards else ""
        return f"{self.order} ({'+'.join(roles)}, {len(self.layout.layers)} layers{parts}, from {self.source})"


def _covers(runs: Sequence[tuple[int, int, int, int, int, int]], n: int) -> bool:
    pieces = sorted((po + i * ps, po + i * ps + nb) for _, po, nb, cnt, _, ps in runs for i in range(cnt))
    pos = 0
    for a, b in pieces:
        if a != pos:
            return False
        pos = b
    return pos == n


@functools.lru_cache(maxsize=256)
def _runs_array(runs: tuple[tuple[int, int, int, int, int, int], ...], to_payload: bool) -> bytes:
    """A plan's runs as the int64 sextuples copy_runs takes, source first (built once per plan and direction)."""
    import numpy as np

    rows = [(so, po, nb, cnt, ss, ps) if to_payload else (po, so, nb, cnt, ps, ss) for so, po, nb, cnt, ss, ps in runs]
    return np.asarray(rows, dtype=np.int64).reshape(-1, 6).tobytes()


def _copy_runs(src: memoryview, dst: memoryview, runs: Sequence[tuple[int, int, int, int, int, int]],
               *, to_payload: bool) -> None:
    # One native call with the GIL released (every piece bounds-checked first): reorders of several chunks,
    # thousands of token runs each for a DCP row, run on several cores.
    copy_runs(dst, src, _runs_array(tuple(runs), to_payload))


def layer_forms(lf: LayerFacts, platform: str | None, tokens: int) -> tuple[SubLayout | None, SubLayout | None]:
    """A layer's sub-layout in a worker's ``tokens``-token page (None: not described) and in the file's
    page (the canonical one, same encoding; None with the first)."""
    tb = lf.page // tokens
    local = describe(lf.role, lf.kv_dtype, tb, platform, tokens)
    if local is None:
        return None, None
    return local, canonical(lf.role, lf.kv_dtype, tb, local.encoding)


@functools.lru_cache(maxsize=1024)
def _rel_runs(local: SubLayout, tokens: int, canon: SubLayout, logical: int,
              dst_token: tuple[int, ...]) -> tuple[Run, ...]:
    return tuple(token_runs(local, tokens, canon, logical, dst_token))


def page_runs(local: SubLayout | None, tokens: int, canon: SubLayout | None, logical: int,
              dst_token: tuple[int, ...], src: int, dst: int) -> list[Run]:
    """Runs placing one worker page (at ``src``) into the file's page (at ``dst``): the whole page when the
    two orders coincide and the map is the identity, else every token through its sub-layouts.

    Raises SchemaError when a token would move and a sub-layout is not described."""
    page = (local.token_bytes if local else 0) * tokens
    if local is not None and canon is not None and tokens == logical and local.name == canon.name and \
            dst_token == tuple(range(tokens)):
        return [(src, dst, page, 1, page, page)]
    if local is None or canon is None:
        raise SchemaError("sublayout", "a page whose sub-layout is not described cannot be moved token by token")
    return [(src + so, dst + do, n, c, ss, ds) for so, do, n, c, ss, ds in _rel_runs(local, tokens, canon, logical,
                                                                                        dst_token)]


def form_pins(facts: DeploymentFacts, lfs: Sequence[LayerFacts], tokens: int) -> dict[str, str]:
    """The identity pins naming the file's byte form of ``lfs`` (see :func:`identity_pins`)."""
    return identity_pins([(lf.role, lf.kv_dtype, layer_forms(lf, facts.platform, tokens)[0]) for lf in lfs],
                         facts.platform)


def _layout(facts: DeploymentFacts, g: GroupFacts, specs: tuple[LayerSpec, ...], family: str,
            pins: Mapping[str, str]) -> CanonicalLayout:
    return CanonicalLayout(model=facts.model, kv_dtype=facts.kv_dtype, tokens_per_block=g.tokens_per_block,
                           blocks_per_chunk=facts.blocks_per_chunk, tokens_per_hash=facts.tokens_per_hash,
                           layers=specs, family=family, revision=facts.revision, group=g.group, pins=pins)


def _family(facts: DeploymentFacts) -> str:
    # vLLM's canonical byte format is its own family: never shares a namespace with direct rows.
    return f"mla+{facts.canonical_family}" if facts.canonical_family else "mla"


def _coalesce(runs: list[tuple[int, int, int, int, int, int]]) -> tuple[tuple[int, int, int, int, int, int], ...]:
    out: list[tuple[int, int, int, int, int, int]] = []
    for r in runs:
        prev = out[-1] if out else None
        if (prev is not None and prev[3] == 1 and r[3] == 1 and prev[0] + prev[2] == r[0]
                and prev[1] + prev[2] == r[1]):
            so, po, nb, _, _, _ = out[-1]
            n = nb + r[2]
            out[-1] = (so, po, n, 1, n, n)
        else:
            out.append(r)
    return tuple(out)
