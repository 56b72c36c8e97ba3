"""The layout model: how a deployment's primary row holds a chunk, and the canonical payload it maps to.

One module for every user of the rule (the vLLM tier, the legacy converter, the CLI, the staging path),
so a compacted file and a stored one name the same namespace. No vLLM import: callers describe what
they know as :class:`LayerFacts` / :class:`DeploymentFacts` and get one :class:`RowPlan` per KV-cache
group (spec/FORMAT.md §2, §4.3, §9).

What vLLM's offloading worker places in a CPU row (``offloading/worker.py``, ``cpu/gpu_worker.py``,
``cpu/shared_offload_region.py``; vLLM 0.33/0.34):

* layer-outer KV layouts (``LBNHC``, ``LBHNC``…): one region per distinct GPU tensor, in the order of
  the selected groups' layer names, layers aliasing the same bytes (several groups overlaid from byte
  0) sharing one region; a region holds ``page * blocks_per_chunk`` bytes, block ``j`` at ``j * page``.
* block-outer layouts (``BLHNC``…, every layer of a block packed side by side): ONE region of
  ``bytes_per_block * blocks_per_chunk``, block ``j`` at ``j * bytes_per_block``, each layer at its
  offset inside the block.
* vLLM's canonical layout: the canonical tensors from offset 0 of the row, shared by every worker.

The file's payload is always canonical: the group's layers in layer order, each ``page *
blocks_per_chunk`` bytes with block ``j`` at ``j * page``. A plan knows the runs that copy between the
two, so a block-outer and a layer-outer deployment share files. When the per-layer truth cannot be
established, the plan is *opaque*: the row region is stored as one ``U8`` tensor ``kvf.opaque`` and
the layout's ``pins`` name every input of its byte order, so only identical deployments share it.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from ._spec import OPAQUE_LAYER, CanonicalLayout, LayerSpec, st_dtype_for
from .errors import SchemaError

__all__ = [
    "ROLE_MLA", "ROLE_INDEXER", "ROLE_OPAQUE", "PACKED_DTYPES", "LayerFacts", "GroupFacts", "DeploymentFacts",
    "RowPlan", "Shard", "ParallelFacts", "plan_groups", "role_from_name", "formula_layer", "cp_canonical_token",
    "pp_stage_names", "stage_layer_facts",
]

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
    ``w // tp`` and TP rank ``w % tp``; its decode-context (DCP) rank is ``tp rank % dcp`` (vLLM's DCP
    groups are consecutive TP ranks). A DCP rank holds the block's tokens ``t`` with
    ``(t // interleave) % dcp == its rank`` (:func:`cp_canonical_token`).
    """

    tp: int
    pp: int = 1
    dcp: int = 1
    interleave: int = 1
    stages: tuple[tuple[str, ...], ...] = ()
    stage_layers: tuple[int, ...] = ()  # decoder layers per stage (vLLM's partition; provenance)

    @property
    def trivial(self) -> bool:
        return self.pp == 1 and self.dcp == 1


def cp_canonical_token(local: int, cp_rank: int, cp_size: int, interleave: int) -> int:
    """The token position (in the logical block of ``cp_size`` local blocks) of a context-parallel rank's
    local token ``local``: vLLM's interleave (``canonical_mapping._local_to_canonical_token``)."""
    chunk, pos = divmod(local, interleave)
    return (chunk * cp_size + cp_rank) * interleave + pos


def _split_index(name: str) -> tuple[str, int] | None:
    """``name`` as (template with ``{}`` for its layer index, the index), by vLLM's rule for layer names
    (``extract_layer_index``: exactly one dot-separated integer component); None otherwise."""
    parts = name.split(".")
    pos = [i for i, p in enumerate(parts) if p.isdigit()]
    if len(pos) != 1:
        return None
    idx = int(parts[pos[0]])
    parts[pos[0]] = "{}"
    return ".".join(parts), idx


def pp_stage_names(stage0: Sequence[str], ranges: Sequence[tuple[int, int]]
                   ) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...], dict[str, str]]:
    """The layer names of every pipeline stage, from stage 0's names and the partition ``ranges``
    (``[(first layer, end)]`` per stage: vLLM's ``get_pp_indices``, or a legacy tree's recorded partition).

    Stage 0 must hold exactly layers ``ranges[0]``, each with the same modules (name templates), in
    layer-major or module-major order; the other stages are named and ordered the same way. Returns
    (names per stage, the group's names in model order, each name's stage-0 counterpart). Raises
    SchemaError when stage 0's names are not of that form (the other stages cannot then be named).
    """
    split = [_split_index(n) for n in stage0]
    if not stage0 or any(x is None for x in split):
        raise SchemaError("parallel", "pipeline parallelism: a layer name without exactly one layer index; the "
                          "other stages' layers cannot be named; not stored")
    templates = list(dict.fromkeys(x[0] for x in split if x is not None))
    lo, hi = ranges[0]

    def order(idx: range, major: str) -> list[str]:
        if major == "index":
            return [t.format(i) for i in idx for t in templates]
        return [t.format(i) for t in templates for i in idx]

    major = next((m for m in ("index", "template") if order(range(lo, hi), m) == list(stage0)), None)
    if major is None or lo != 0 or any(b < a for a, b in ranges):
        raise SchemaError("parallel", f"pipeline parallelism: stage 0's layers are not layers {lo}..{hi - 1} of the "
                          "partition with the same modules each; not stored")
    if any(ranges[i][1] != ranges[i + 1][0] for i in range(len(ranges) - 1)):
        raise SchemaError("parallel", f"the partition {list(ranges)} is not contiguous")
    stages = tuple(tuple(order(range(a, b), major)) for a, b in ranges)
    canonical = tuple(order(range(0, ranges[-1][1]), major))
    twin = {}
    for n in canonical:
        sp = _split_index(n)
        assert sp is not None
        twin[n] = sp[0].format(lo)
    return stages, canonical, twin


def stage_layer_facts(stage0: Mapping[str, LayerFacts], canonical: Sequence[str],
                      twin: Mapping[str, str]) -> dict[str, LayerFacts]:
    """Every stage's LayerFacts from stage 0's (each layer is its stage-0 counterpart's module, renamed).

    Raises SchemaError when two stage-0 layers of one module differ (then stage 0 does not describe the
    others)."""
    for n, lf in stage0.items():
        b = stage0.get(twin.get(n, n), lf)
        if (lf.role, lf.kv_dtype, lf.st_dtype, lf.shape, lf.page) != (b.role, b.kv_dtype, b.st_dtype, b.shape, b.page):
            raise SchemaError("parallel", f"layers {n} and {b.name} (one module, two layers) differ: the other "
                              "stages' layers cannot be described from stage 0's; not stored")
    return {n: stage0[n] if n in stage0 else replace(stage0[twin[n]], name=n, gpu_offset=None, gpu_block_stride=None)
            for n in canonical}


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


def _addr(mv: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if len(mv) else 0


def _copy_runs(src: memoryview, dst: memoryview, runs: Sequence[tuple[int, int, int, int, int, int]],
               *, to_payload: bool) -> None:
    # ctypes.memmove releases the GIL: reorders of several chunks run on several cores.
    s, d = _addr(src), _addr(dst)
    src_arr = dst_arr = None
    for so, po, nb, cnt, ss, ps in runs:
        a, b, sa, sb = (so, po, ss, ps) if to_payload else (po, so, ps, ss)
        if cnt > 4:
            # Many small pieces (DCP token rows): one strided numpy copy instead of a memmove per piece.
            import numpy as np
            from numpy.lib.stride_tricks import as_strided

            if src_arr is None:
                src_arr = np.frombuffer(src, dtype=np.uint8)
                dst_arr = np.frombuffer(dst, dtype=np.uint8)
            assert dst_arr is not None
            if a + (cnt - 1) * sa + nb > len(src_arr) or b + (cnt - 1) * sb + nb > len(dst_arr):
                raise ValueError("a copy run lies outside its buffer")
            np.copyto(as_strided(dst_arr[b:], (cnt, nb), (sb, 1)), as_strided(src_arr[a:], (cnt, nb), (sa, 1)))
            continue
        for i in range(cnt):
            ctypes.memmove(d + b + i * sb, s + a + i * sa, nb)


def formula_layer(name: str, role: str, kv_dtype: str, tokens_per_block: int, page: int) -> LayerFacts | None:
    """The LayerFacts the known formulas give for a ``page``-byte block, or None if none fits exactly.

    MLA latents: a shipped latent width of ``kv_dtype`` (bf16/f16/f32/fp8 elements), or vLLM's packed
    ``fp8_ds_mla`` (656 bytes per token, also what an ``fp8`` cache of a sparse-MLA model holds). DSA
    indexer caches: 132 bytes per token.
    """
    if page <= 0 or page % tokens_per_block:
        return None
    per_token = page // tokens_per_block
    if role == ROLE_INDEXER:
        if per_token != PACKED_DTYPES["dsa_indexer_fp8"][0]:
            return None
        return LayerFacts(name, role, "dsa_indexer_fp8", "U8", (tokens_per_block, per_token), page)
    if role != ROLE_MLA:
        return None
    if kv_dtype in ("fp8_ds_mla", "fp8", "fp8_e4m3") and per_token == PACKED_DTYPES["fp8_ds_mla"][0]:
        return LayerFacts(name, role, "fp8_ds_mla", "U8", (tokens_per_block, per_token), page)
    st = st_dtype_for(kv_dtype)
    item = _ITEMSIZE.get(st)
    if item is None or st == "U8" or per_token % item or per_token // item not in MLA_WIDTHS:
        return None
    return LayerFacts(name, role, kv_dtype, st, (tokens_per_block, per_token // item), page)


def _layout(facts: DeploymentFacts, g: GroupFacts, specs: tuple[LayerSpec, ...], family: str,
            pins: Mapping[str, str]) -> CanonicalLayout:
    return CanonicalLayout(model=facts.model, kv_dtype=facts.kv_dtype, tokens_per_block=g.tokens_per_block,
                           blocks_per_chunk=facts.blocks_per_chunk, tokens_per_hash=facts.tokens_per_hash,
                           layers=specs, family=family, revision=facts.revision, group=g.group, pins=pins)


def _family(facts: DeploymentFacts) -> str:
    # vLLM's canonical byte format is its own family: never shares a namespace with direct rows.
    return f"mla+{facts.canonical_family}" if facts.canonical_family else "mla"


def _opaque(facts: DeploymentFacts, g: GroupFacts, why: str) -> RowPlan:
    """The whole slot as one region, its identity pinning every input of its byte order."""
    bpc = facts.blocks_per_chunk
    slot = facts.worker_bytes_per_block * bpc
    import hashlib

    names = "\n".join(f"{gf.group}:{n}" for gf in facts.groups for n in gf.layer_names)
    # Stable inputs only (never the reason text): the namespace must not move with a log message.
    pins = {**facts.pins, "opaque": "v1", "row.kv_cache_layout": str(facts.kv_cache_layout or ""),
            "row.worker_bytes_per_block": str(facts.worker_bytes_per_block),
            "row.layers_sha256": hashlib.sha256(names.encode()).hexdigest()}
    spec = LayerSpec(OPAQUE_LAYER, "U8", (facts.worker_bytes_per_block,), role=ROLE_OPAQUE)
    layout = _layout(facts, g, (spec,), _family(facts), pins)
    return RowPlan(layout, slot, ((0, 0, slot, 1, slot, slot),), "opaque", f"{facts.source}; opaque: {why}")


def _group_layer_facts(facts: DeploymentFacts, g: GroupFacts) -> tuple[list[LayerFacts] | None, str]:
    """Per-layer facts of a group from vLLM's config, else from the formulas; or (None, why not)."""
    if facts.layers is not None:
        missing = [n for n in g.layer_names if n not in facts.layers]
        if missing:
            return None, f"no KV-cache spec for layer {missing[0]}"
        out = [facts.layers[n] for n in g.layer_names]
        for lf in out:
            if lf.role != role_from_name(lf.name) and lf.role in (ROLE_MLA, ROLE_INDEXER):
                return None, f"layer {lf.name} is a {lf.role} but its name says {role_from_name(lf.name)}"
        return out, facts.source
    if len(facts.groups) != 1:
        # Which bytes of a row belong to which group is only known from vLLM's placement.
        raise SchemaError("groups", f"{len(facts.groups)} KV-cache groups and no per-layer placement from vLLM's "
                          "KV-cache config: where each group's layers sit in the row is unknown; not stored")
    names = g.layer_names
    roles = [role_from_name(n) for n in names]
    n_mla, n_idx = roles.count(ROLE_MLA), roles.count(ROLE_INDEXER)
    total = facts.worker_bytes_per_block
    tpb = g.tokens_per_block
    if n_idx == 0:
        # One group of one role: vLLM merges its layers into one spec, so every page is total / n.
        if total % len(names):
            return None, f"{total} bytes per block do not split into {len(names)} equal pages"
        page = total // len(names)
        known = formula_layer("x", ROLE_MLA, facts.kv_dtype, tpb, page)
        if known is None:
            # An unknown width is still one uniform page per layer: describe it as bytes, not as values.
            st = st_dtype_for(facts.kv_dtype)
            item = _ITEMSIZE.get(st, 1)
            if st == "U8" or page % (tpb * item):
                st, item = "U8", 1
            if page % tpb:
                return None, f"a {page}-byte page does not split into {tpb} tokens"
            shape: tuple[int, ...] = (tpb, page // (tpb * item))
            kvd = facts.kv_dtype
        else:
            st, shape, kvd = known.st_dtype, known.shape, known.kv_dtype
        return [LayerFacts(n, ROLE_MLA, kvd, st, shape, page) for n in names], "uniform pages"
    idx_page = PACKED_DTYPES["dsa_indexer_fp8"][0] * tpb
    rest = total - n_idx * idx_page
    if n_mla == 0 or rest <= 0 or rest % n_mla:
        return None, "the DSA formulas do not add up to worker_kv_bytes_per_block"
    mla = formula_layer("x", ROLE_MLA, facts.kv_dtype, tpb, rest // n_mla)
    idx = formula_layer("x", ROLE_INDEXER, facts.kv_dtype, tpb, idx_page)
    if mla is None or idx is None:
        return None, f"{rest // n_mla} bytes per MLA block match no known latent format of {facts.kv_dtype}"
    out = []
    for n, r in zip(names, roles):
        t = mla if r == ROLE_MLA else idx
        out.append(LayerFacts(n, r, t.kv_dtype, t.st_dtype, t.shape, t.page))
    return out, "DSA formulas (exact sum)"


def _fallback_placement(facts: DeploymentFacts, g: GroupFacts, lfs: list[LayerFacts]) -> list[LayerFacts]:
    """GPU placement vLLM's planner gives one group (kv_cache_planning.get_kv_cache_config_from_groups):
    layers grouped by spec in order of first appearance; block-outer: side by side inside each block."""
    order: dict[tuple[Any, ...], list[LayerFacts]] = {}
    for lf in lfs:
        order.setdefault((lf.role, lf.kv_dtype, lf.st_dtype, lf.shape, lf.page), []).append(lf)
    out: dict[str, LayerFacts] = {}
    off = 0
    for members in order.values():
        for lf in members:
            out[lf.name] = LayerFacts(lf.name, lf.role, lf.kv_dtype, lf.st_dtype, lf.shape, lf.page, off,
                                      facts.worker_bytes_per_block if facts.block_outer else lf.page)
            off += lf.page
    return [out[lf.name] for lf in lfs]


def _plan_group(facts: DeploymentFacts, g: GroupFacts, all_facts: dict[str, LayerFacts]) -> RowPlan:
    lfs = [all_facts[n] for n in g.layer_names]
    bpc = facts.blocks_per_chunk
    specs = tuple(lf.spec(facts.kv_dtype) for lf in lfs)
    layout = _layout(facts, g, specs, _family(facts), facts.pins)
    slot = facts.worker_bytes_per_block * bpc
    # The payload: each layer's pages in layer order, block j at j * page.
    pay_off = list(layout.layer_offsets)
    packed = any(lf.gpu_block_stride is not None and lf.gpu_block_stride != lf.page for lf in all_facts.values())
    runs = []
    if packed and facts.row != "canonical":
        # One region of block_stride bytes per block; each layer at its offset inside the block.
        stride = next(lf.gpu_block_stride for lf in all_facts.values() if lf.gpu_block_stride != lf.page)
        assert stride is not None
        if any(lf.gpu_offset is None or lf.gpu_offset + lf.page > stride for lf in lfs):
            raise SchemaError("layout", "a layer lies outside its packed block")
        for lf, po in zip(lfs, pay_off):
            runs.append((lf.gpu_offset or 0, po, lf.page, bpc, stride, lf.page))
        return RowPlan(layout, slot, tuple(runs), "block_outer", facts.source)
    # Layer-outer: one region per distinct GPU tensor (aliased layers share one), in the order of the
    # selected groups' layer names, each page * bpc bytes.
    region_of: dict[Any, int] = {}
    region_off = 0
    where: dict[str, int] = {}
    for gf in facts.groups:
        for n in gf.layer_names:
            lf = all_facts[n]
            k = (lf.gpu_offset, lf.gpu_block_stride) if lf.gpu_offset is not None else ("layer", n)
            if k not in region_of:
                region_of[k] = region_off
                region_off += lf.page * bpc
            where[n] = region_of[k]
    if region_off > slot:
        raise SchemaError("layout", f"the layers' regions ({region_off} bytes) exceed the row slot ({slot})")
    for lf, po in zip(lfs, pay_off):
        runs.append((where[lf.name], po, lf.page * bpc, 1, lf.page * bpc, lf.page * bpc))
    merged = _coalesce(runs)
    return RowPlan(layout, slot, merged, "layer_outer", facts.source)


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


def _plan_parallel(facts: DeploymentFacts, g: GroupFacts, all_facts: dict[str, LayerFacts]) -> RowPlan:
    """A chunk assembled from pipeline stages and decode-context ranks (vLLM's per-worker rows).

    Each layer's facts are those of ONE worker's block (``tokens_per_block / dcp`` tokens); the file holds
    the logical block of ``tokens_per_block`` tokens in token order, layers in the group's canonical order,
    so a PP x TP, a DCP x TP and a TP-only deployment of the same model store the same payload.
    """
    par = facts.parallel
    assert par is not None
    cp, inter, bpc = par.dcp, par.interleave, facts.blocks_per_chunk
    if facts.row != "per_worker":
        raise SchemaError("parallel", f"pipeline/decode-context parallel rows are per-worker rows in vLLM, got "
                          f"{facts.row!r} rows; not stored")
    if facts.block_outer:
        raise SchemaError("parallel", "pipeline/decode-context parallelism with a block-outer KV layout "
                          f"({facts.kv_cache_layout}) is not supported; not stored")
    if len(facts.groups) != 1:
        raise SchemaError("parallel", f"pipeline/decode-context parallelism with {len(facts.groups)} KV-cache "
                          "groups is not supported; not stored")
    local_tpb = g.tokens_per_block // cp
    if local_tpb * cp != g.tokens_per_block or local_tpb % inter:
        raise SchemaError("parallel", f"a {g.tokens_per_block}-token block does not split into {cp} DCP ranks "
                          f"of whole interleave runs of {inter} tokens")
    if len(par.stages) != par.pp or sorted(n for st in par.stages for n in st) != sorted(g.layer_names):
        raise SchemaError("parallel", "the pipeline stages do not hold exactly the group's layers")
    canon: list[LayerFacts] = []
    for n in g.layer_names:
        lf = all_facts[n]
        if lf.role == ROLE_OPAQUE or len(lf.shape) < 2 or lf.shape[0] != local_tpb or lf.page % local_tpb:
            raise SchemaError("parallel", f"layer {n}: a {lf.page}-byte page is not {local_tpb} token rows; "
                              "its tokens cannot be placed across DCP ranks")
        canon.append(LayerFacts(n, lf.role, lf.kv_dtype, lf.st_dtype, (lf.shape[0] * cp, *lf.shape[1:]), lf.page * cp))
    specs = tuple(lf.spec(facts.kv_dtype) for lf in canon)
    layout = _layout(facts, g, specs, _family(facts), facts.pins)
    pay_off = dict(zip(g.layer_names, layout.layer_offsets))
    slot = facts.worker_bytes_per_block * bpc
    by_part: dict[tuple[int, int], list[int]] = {}
    for w in range(par.pp * par.tp):
        by_part.setdefault((w // par.tp, (w % par.tp) % cp), []).append(w)
    shards = []
    for (stage, cp_rank), slots in sorted(by_part.items()):
        runs: list[Run] = []
        region = 0
        for n in par.stages[stage]:
            lf = all_facts[n]
            row = lf.page // local_tpb  # bytes per token (vLLM's canonical mapping treats MLA pages as token rows)
            piece, count = inter * row, local_tpb // inter
            for j in range(bpc):
                # Local tokens [c, c + inter) sit at cp_canonical_token(c): one strided run per block.
                po = pay_off[n] + j * lf.page * cp + cp_canonical_token(0, cp_rank, cp, inter) * row
                if cp == 1:
                    runs.append((region + j * lf.page, po, lf.page, 1, lf.page, lf.page))
                else:
                    runs.append((region + j * lf.page, po, piece, count, piece, cp * piece))
            region += lf.page * bpc
        if region > slot:
            raise SchemaError("parallel", f"pipeline stage {stage} holds {region} bytes per chunk, more than vLLM's "
                              f"per-worker slot ({slot} bytes, sized from stage 0's layers): vLLM's CPU row cannot "
                              "hold this partition either; not stored")
        shards.append(Shard(tuple(slots), _coalesce(runs), region))
    return RowPlan(layout, slot, (), "layer_outer", facts.source, tuple(shards))


def plan_groups(facts: DeploymentFacts) -> dict[int, RowPlan]:
    """One :class:`RowPlan` per group of ``facts``.

    A group whose per-layer truth cannot be established becomes opaque (its reason is in
    ``plan.source`` and in its pins). Raises SchemaError for deployments that must not be stored at all
    (a group that is not MLA, a packed row shared by several groups).
    """
    for g in facts.groups:
        if g.kind not in ("full", "sliding_window"):
            raise SchemaError("groups", f"group {g.group} is {g.kind}: kvformat stores MLA KV only")
    all_facts: dict[str, LayerFacts] = {}
    reasons: dict[int, str] = {}
    rules: dict[int, str] = {}
    for g in facts.groups:
        lfs, why = _group_layer_facts(facts, g)
        if lfs is None:
            reasons[g.group] = why
            continue
        rules[g.group] = why
        if facts.layers is None:
            lfs = _fallback_placement(facts, g, lfs)
        unknown = next((lf for lf in lfs if lf.role == ROLE_OPAQUE), None)
        if unknown is not None:
            reasons[g.group] = (f"layer {unknown.name}: a {unknown.page}-byte page that is padded, compressed or "
                                "of no known format")
            for lf in lfs:
                all_facts[lf.name] = lf
            continue
        for lf in lfs:
            if lf.role not in (ROLE_MLA, ROLE_INDEXER):
                raise SchemaError("layers", f"layer {lf.name} of group {g.group} is {lf.role}, not MLA KV: its "
                                  "KV is sharded across TP ranks and kvformat stores replicated (MLA) KV only")
            all_facts[lf.name] = lf
    packed = any(lf.gpu_block_stride is not None and lf.gpu_block_stride != lf.page for lf in all_facts.values())
    if packed and len(facts.groups) > 1:
        raise SchemaError("layout", f"a packed block-outer row shared by {len(facts.groups)} KV-cache groups: each "
                          "group's chunk is the whole packed block, mixing other groups' bytes; not stored")
    if facts.parallel is not None and not facts.parallel.trivial:
        g = facts.groups[0]
        if reasons:
            raise SchemaError("parallel", f"group {g.group}: {reasons[g.group]}; an opaque chunk cannot be assembled "
                              "from pipeline stages or DCP ranks; not stored")
        return {g.group: _plan_parallel(facts, g, all_facts)}
    out = {}
    for g in facts.groups:
        if g.group in reasons:
            out[g.group] = _opaque(facts, g, reasons[g.group])
            continue
        try:
            plan = _plan_group(facts, g, all_facts)
            out[g.group] = RowPlan(plan.layout, plan.slot_bytes, plan.runs, plan.order, rules[g.group])
        except SchemaError as e:
            out[g.group] = _opaque(facts, g, e.message)
    return out
