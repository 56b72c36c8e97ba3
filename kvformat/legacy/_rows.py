"""Reading vLLM's built-in fs-tier trees (the "legacy" files kvformat compacts).

vLLM 0.33's ``FileSystemTierManager`` (``vllm/v1/kv_offload/tiering/fs/``, ``file_mapper.py``) writes::

    <root>/<model '/'->'_'>_<sha256(fields)[:12]>/config.json
    <root>/<model '/'->'_'>_<sha256(fields)[:12]>_r<rank>/<hash[:3]>/<hash[3:5]>_g<group>/<hash>.bin

Each ``.bin`` is one whole primary row, raw bytes, no header: ``|W0|W1|...|W(n-1)|pad|`` (one slot per
worker) or ``|slot|pad|`` (``replicated_layout``), padded to a multiple of 4096. A slot holds, per layer
in the group's layer order, ``page_bytes * blocks_per_file`` bytes. config.json does not record the
per-layer page size, so it is inferred from the file size (:func:`infer_row`); ``page_bytes`` is the
hint when that is ambiguous.

Supported rows: replicated and per-worker (every TP replica must hold the same MLA latent, checked byte
for byte), also of pipeline- and decode-context-parallel writers (the partition and the token interleave,
which config.json does not record, are given by the caller and checked: :func:`infer_row`). Refused with
:class:`LegacyLayoutError`: prefill context parallel rows and vLLM's canonical rows (``canonical_format``:
where the pages sit depends on the writer's worker count, which config.json does not record).

This module reads only; it never imports vLLM. Naming and discovery of the trees: :mod:`kvformat.legacy._tree`.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from ..format import BlockKey, CanonicalLayout, Provenance, round_up, xxh3_hex
from ._tree import (
    CONFIG_FILE, Ignored, LegacyFile, LegacyNamespace, find_namespaces, is_legacy_root, iter_legacy_files,
    legacy_fields, legacy_paths, write_legacy_row,
)
from ..errors import LegacyLayoutError, ReplicaMismatchError, SchemaError
from ..layout import (
    PLATFORMS, DeploymentFacts, GroupFacts, LayerFacts, ParallelFacts, RowPlan, formula_layer, plan_groups,
    platform_dependent, pp_stage_names, stage_layer_facts,
)

__all__ = [
    "ROW_ALIGN", "LegacyNamespace", "LegacyFile", "RowLayout", "Ignored", "find_namespaces", "is_legacy_root",
    "iter_legacy_files", "infer_row", "extract_payload", "legacy_fields", "legacy_paths", "write_legacy_row",
]

ROW_ALIGN = 4096  # vLLM SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT: rows are padded to this
_memcmp: Any
try:  # memcmp releases the GIL and stops at the first difference; memoryview == is ~50x slower
    _memcmp = ctypes.CDLL(None).memcmp
    _memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    _memcmp.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
    _memcmp = None


@dataclass(frozen=True)
class RowLayout:
    """How one legacy row is laid out, and the kvformat layout its payload gets."""

    kind: str  # "replicated" | "per_worker" (kvformat Provenance.row values)
    copies: int  # worker slots in the row
    page_bytes: int  # one block of one layer
    slot_bytes: int  # one worker's slot: n_layers * page_bytes * blocks_per_file
    row_bytes: int  # file size: round_up(slot_bytes * copies, 4096)
    layout: CanonicalLayout
    provenance_tp: int
    parallel: Mapping[str, int] = field(default_factory=dict)
    # Pipeline / DCP rows: the plan that assembles the payload from the stages' and DCP ranks' slots.
    plan: RowPlan | None = None
    pp_layers: tuple[int, ...] = ()
    cp_interleave: int = 1
    # Pipeline rows: per stage, (slot offset, bytes) of each of its layers' regions (what the writer filled).
    stage_regions: tuple[tuple[tuple[int, int], ...], ...] = ()

    @property
    def padding(self) -> int:
        return self.row_bytes - self.slot_bytes * self.copies


# -- row layout ---------------------------------------------------------------------------------------
def infer_row(ns: LegacyNamespace, group: int, file_size: int, *, page_bytes: int | None = None,
              kv_cache_layout: str = "LBNHC", pp_layers: Sequence[int] | None = None,
              cp_interleave: int | None = None, platform: str | None = None) -> RowLayout:
    """The row layout of a ``file_size``-byte file of ``group``, from config.json and the size.

    Unknowns are the bytes per block and the padding: ``row = round_up(bytes_per_block * bpf * copies,
    4096)``; each candidate goes through :mod:`kvformat.layout` (the tier's own rule: uniform MLA pages,
    the DSA formulas), so a compacted file names the tier's namespace. When several sizes fit (small
    models, padded rows), a format the model knows exactly breaks the tie; otherwise ``page_bytes`` (CLI
    ``--page-bytes``, one layer's page of a uniform model) must say. config.json does not record the KV
    cache layout: ``kv_cache_layout`` is the writer's (vLLM's default layer-outer ``LBNHC`` unless told).

    Pipeline-parallel rows (``pp_size`` > 1) hold each stage's layers in that stage's workers' slots, and
    config.json names only stage 0's layers (vLLM's scheduler config is stage 0's): ``pp_layers`` is the
    writer's partition (decoder layers per stage, CLI ``--pp-layers``), checked against config.json's stage 0,
    against vLLM's per-worker slot (a stage never holds more than stage 0) and, per file, against the bytes
    (the slot bytes past a stage's layers are never written by vLLM, so they must be zero). DCP rows
    (``dcp_size`` > 1) hold each DCP rank's tokens of a block; ``cp_interleave`` is vLLM's
    ``cp_kv_cache_interleave_size`` (CLI ``--cp-interleave``), which config.json does not record: it is required
    for such a tree (a wrong interleave would put every token's bytes at another token's place with valid
    checksums), and it must split a DCP rank's block into whole runs. ``platform`` (CLI ``--platform``) names
    the writer's platform when a layer's bytes depend on it (FP8 caches, the DSA indexer: kvformat.layout.
    _sublayout); config.json does not record it either, so such a tree is refused without it.

    Raises LegacyLayoutError (``hint`` names the CLI flag when a hint would resolve it).
    """
    where = os.path.join(ns.root, ns.base, CONFIG_FILE)
    groups = ns.groups()
    if not 0 <= group < len(groups):
        raise LegacyLayoutError(f"group {group} is not in config.json ({len(groups)} groups)", path=where)
    g = groups[group]
    names = list(g.get("layer_names") or [])
    tpb = int(g.get("tokens_per_block", 0))
    if not names or tpb <= 0:
        raise LegacyLayoutError(f"group {group} has no layers or tokens_per_block", path=where)
    par = ns.parallel()
    cp_interleave, sharded = _check_parallel(ns, par, tpb, pp_layers, cp_interleave, len(groups), where)
    bpf = ns.blocks_per_file
    kind = "replicated" if ns.replicated else "per_worker"
    copies = 1 if kind != "per_worker" else par["tp"] * par["pp"] * par["pcp"]
    if sharded and kind != "per_worker":
        raise LegacyLayoutError("pipeline/decode-context parallel rows are per-worker rows in vLLM, but config.json "
                                "says replicated_layout", path=where)
    full_tpb, tpb = tpb, tpb // par["dcp"]  # a worker's block holds tokens_per_block / dcp tokens
    cands = _candidates(file_size, bpf * copies, tpb, page_bytes, len(names))
    facts = DeploymentFacts(model=ns.model, kv_dtype=ns.dtype, tokens_per_hash=ns.tokens_per_hash or tpb,
                            blocks_per_chunk=bpf, worker_bytes_per_block=0,  # each candidate's: _fitting_plan
                            groups=(GroupFacts(group, tpb, tuple(names)),), row=kind, copies=copies,
                            kv_cache_layout=kv_cache_layout, source="legacy config.json + file size",
                            platform=platform)
    w, plan = _fitting_plan(ns, facts, group, cands, file_size, where)
    if platform is None and any(platform_dependent(l.role, l.kv_dtype or ns.dtype) for l in plan.layout.layers):
        raise LegacyLayoutError(
            f"{ns.dtype} layers ({', '.join(sorted({l.role for l in plan.layout.layers}))}): the platform that wrote "
            "them decides their bytes (FP8 flavour, the DSA indexer's order) and config.json does not record it; "
            f"give the writer's platform ({', '.join(PLATFORMS)})", hint="--platform", path=where)
    if sharded:
        return _sharded_row(ns, group, file_size, w, plan, full_tpb, par, tuple(pp_layers or ()), cp_interleave,
                            kv_cache_layout, where, platform)
    return RowLayout(kind=kind, copies=copies, page_bytes=plan.layout.layers[0].page_bytes, slot_bytes=w * bpf,
                     row_bytes=file_size, layout=plan.layout, provenance_tp=par["tp"] if kind == "per_worker" else 1,
                     parallel=par)


def _check_parallel(ns: LegacyNamespace, par: Mapping[str, int], tpb: int, pp_layers: Sequence[int] | None,
                    cp_interleave: int | None, n_groups: int, where: str) -> tuple[int, bool]:
    """The hints PP/DCP rows need and the rows no layer table can be proven for; (interleave, sharded)."""
    if par["pp"] > 1 and pp_layers is None:
        raise LegacyLayoutError(
            f"pipeline-parallel rows (pp_size={par['pp']}): each stage's slot holds only its own layers and "
            "config.json names only stage 0's; give the writer's partition (decoder layers per stage)",
            hint="--pp-layers", path=where)
    if pp_layers is not None and (par["pp"] == 1 or len(pp_layers) != par["pp"] or min(pp_layers) < 1):
        raise LegacyLayoutError(f"--pp-layers {','.join(map(str, pp_layers))} does not give {par['pp']} stage(s) "
                                "of at least one layer (config.json's pp_size)", path=where)
    if par["dcp"] > 1 and cp_interleave is None:
        raise LegacyLayoutError(
            f"decode-context-parallel rows (dcp_size={par['dcp']}): each DCP rank holds interleaved runs of a "
            "block's tokens and config.json does not record the run length; give the writer's "
            "cp_kv_cache_interleave_size", hint="--cp-interleave", path=where)
    cp_interleave = cp_interleave or 1
    sharded = par["pp"] > 1 or par["dcp"] > 1 or par["pcp"] > 1  # PCP ranks are replicas (see the tier)
    if sharded and (tpb % par["dcp"] or (tpb // par["dcp"]) % cp_interleave):
        raise LegacyLayoutError(f"tokens_per_block {tpb} does not split into {par['dcp']} DCP ranks of whole "
                                f"interleave runs of {cp_interleave}", path=where)
    if ns.canonical_format:
        raise LegacyLayoutError(
            f"canonical rows ({ns.canonical_format}) are not supported: where the canonical pages sit in the row "
            "depends on the writer's worker count, which config.json does not record", path=where)
    if n_groups > 1:
        # Several groups share each row (overlaid from byte 0, or packed side by side): which bytes are this
        # group's depends on vLLM's placement, which config.json does not record.
        raise LegacyLayoutError(f"{n_groups} KV-cache groups: config.json does not record where each group's "
                                "layers sit in the row, so no per-layer table can be proven", path=where)
    return cp_interleave, sharded


def _candidates(file_size: int, unit: int, tpb: int, page_bytes: int | None, n_layers: int) -> list[int]:
    """Worker bytes per block that fit the file; ``unit``: row bytes per such byte (before the 4096 padding)."""
    if page_bytes is not None:
        # The hint is one layer's page of a uniform model (what --page-bytes has always meant).
        cands = [page_bytes * n_layers]
        row_bytes = round_up(cands[0] * unit, ROW_ALIGN)
        if row_bytes != file_size:
            raise LegacyLayoutError(
                f"--page-bytes {page_bytes} gives a {row_bytes}-byte row, the file has {file_size}")
        return cands
    if file_size <= 0 or file_size % ROW_ALIGN:
        raise LegacyLayoutError(f"size {file_size} is not a multiple of {ROW_ALIGN}: fits no row layout")
    lo = (file_size - ROW_ALIGN) // unit + 1
    hi = file_size // unit
    return [w for w in range(round_up(lo, tpb), hi + 1, tpb) if w > 0]


def _fitting_plan(ns: LegacyNamespace, facts: DeploymentFacts, group: int, cands: list[int], file_size: int,
                  where: str) -> tuple[int, RowPlan]:
    """The one candidate the layout model describes layer by layer (``facts`` with each candidate's bytes)."""
    # The same layout model as the tier (kvformat.layout), fed what config.json says plus a candidate
    # bytes-per-block: a legacy row compacts to exactly the file the tier writes for that deployment.
    names, tpb = facts.groups[0].layer_names, facts.groups[0].tokens_per_block
    bpf, copies = facts.blocks_per_chunk, facts.copies
    plans = []
    for w in cands:
        try:
            plan = plan_groups(replace(facts, worker_bytes_per_block=w))[group]
        except SchemaError as e:
            raise LegacyLayoutError(e.message, path=where) from None
        if plan.order != "opaque":
            plans.append((w, plan))
    if len(plans) > 1:
        # Several sizes fit a padded row: only formats the model knows exactly break the tie.
        known = [(w, p) for w, p in plans if all(formula_layer(l.name, l.role, ns.dtype, tpb, l.page_bytes)
                                                 for l in p.layout.layers)]
        if len(known) != 1:
            pages = [w // len(names) for w, _ in plans]
            raise LegacyLayoutError(
                f"{len(plans)} page sizes fit a {file_size}-byte row of {len(names)} layers x {bpf} blocks x "
                f"{copies} slots ({pages[0]}..{pages[-1]} bytes)", hint="--page-bytes", path=where)
        plans = known
    if not plans:
        raise LegacyLayoutError(f"size {file_size} fits no row of {len(names)} layers x {bpf} blocks x "
                                f"{copies} slots that kvformat can describe layer by layer")
    return plans[0]


def _sharded_row(ns: LegacyNamespace, group: int, file_size: int, w: int, stage0: RowPlan, full_tpb: int,
                 par: Mapping[str, int], pp_layers: tuple[int, ...], inter: int, kv_cache_layout: str,
                 where: str, platform: str | None) -> RowLayout:
    """The row of a PP and/or DCP writer: stage 0's layers as inferred, the other stages named by the partition,
    and the plan that assembles the canonical payload (the same rule as the tier: kvformat.layout)."""
    lay = stage0.layout
    names = tuple(l.name for l in lay.layers)
    facts0 = {l.name: LayerFacts(l.name, l.role, l.kv_dtype or lay.kv_dtype, l.dtype, tuple(l.shape), l.page_bytes)
              for l in lay.layers}
    try:
        if par["pp"] > 1:
            ranges, start = [], 0
            for n in pp_layers:
                ranges.append((start, start + n))
                start += n
            stages, canonical, twin = pp_stage_names(names, ranges)
            facts = stage_layer_facts(facts0, canonical, twin)
        else:
            stages, canonical, facts = (names,), names, facts0
        pf = ParallelFacts(tp=par["tp"], pp=par["pp"], dcp=par["dcp"], interleave=inter, stages=stages,
                           stage_layers=pp_layers, pcp=par["pcp"])
        df = DeploymentFacts(model=ns.model, kv_dtype=ns.dtype, tokens_per_hash=ns.tokens_per_hash or full_tpb,
                             blocks_per_chunk=ns.blocks_per_file, worker_bytes_per_block=w,
                             groups=(GroupFacts(group, full_tpb, canonical),), row="per_worker",
                             copies=par["tp"] * par["pp"] * par["pcp"], kv_cache_layout=kv_cache_layout, layers=facts,
                             source="legacy config.json + file size + partition", parallel=pf,
                             platform=platform)
        plan = plan_groups(df)[group]
    except SchemaError as e:
        raise LegacyLayoutError(e.message, path=where) from None
    regions = []
    for st in stages if par["pp"] > 1 else ():
        off, mine = 0, []
        for name in st:
            size = facts[name].page * ns.blocks_per_file
            mine.append((off, size))
            off += size
        regions.append(tuple(mine))
    return RowLayout(kind="per_worker", copies=par["tp"] * par["pp"] * par["pcp"], page_bytes=lay.layers[0].page_bytes,
                     slot_bytes=w * ns.blocks_per_file, row_bytes=file_size, layout=plan.layout,
                     provenance_tp=par["tp"], parallel=par, plan=plan, pp_layers=pp_layers, cp_interleave=inter,
                     stage_regions=tuple(regions))


def _addr(buf: memoryview) -> int:
    try:  # writable buffers (bytearray, copy-on-write maps): no numpy import on the hot path
        c = ctypes.c_char.from_buffer(buf)
        addr = ctypes.addressof(c)
        del c  # drop the export at once; the caller keeps ``buf`` alive
        return addr
    except TypeError:
        import numpy as np

        return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def extract_payload(row: RowLayout, buf: memoryview, *, path: str | None = None) -> memoryview:
    """The canonical payload of a row held in ``buf`` (a writable buffer of ``row.row_bytes``).

    For per-worker rows every slot must equal slot 0, byte for byte (an MLA latent is replicated
    across TP ranks); otherwise ReplicaMismatchError lists each slot's xxh3.
    """
    s = row.slot_bytes
    if row.plan is not None and row.plan.shards:
        return _assemble(row, row.plan, buf, path)
    if row.copies > 1 and not _replicas_equal(buf, [i * s for i in range(row.copies)], s):
        raise ReplicaMismatchError([xxh3_hex(buf[i * s:(i + 1) * s]) for i in range(row.copies)], path=path)
    return buf[:s]


def _replicas_equal(buf: memoryview, offsets: Sequence[int], n: int) -> bool:
    """Whether the ``n`` bytes at every offset of ``buf`` equal those at the first, stopping at a difference."""
    base = _addr(buf) if _memcmp is not None else None
    for off in offsets[1:]:
        if base is not None:
            if _memcmp(base + offsets[0], base + off, n) != 0:
                return False
        elif buf[offsets[0]:offsets[0] + n] != buf[off:off + n]:
            return False
    return True


def _assemble(row: RowLayout, plan: RowPlan, buf: memoryview, path: str | None) -> memoryview:
    """The canonical payload of a PP/DCP row: each shard's replicas must agree, and the slot bytes past a
    stage's layers (never written by vLLM) must be zero, else the partition does not describe this file."""
    s = row.slot_bytes
    out = memoryview(bytearray(row.layout.payload_bytes))
    for k, shard in enumerate(plan.shards):  # sorted by (stage, DCP rank)
        first = shard.slots[0] * s
        if not _replicas_equal(buf, [w * s for w in shard.slots], shard.used):
            raise ReplicaMismatchError([xxh3_hex(buf[x * s:x * s + shard.used]) for x in shard.slots], path=path)
        for w in shard.slots:
            tail = buf[w * s + shard.used:(w + 1) * s]
            if tail.nbytes and tail != bytes(tail.nbytes):
                raise LegacyLayoutError(
                    f"worker {w}'s slot holds data past its stage's {shard.used} bytes of layers: the partition "
                    f"{','.join(map(str, row.pp_layers))} does not describe this file", hint="--pp-layers", path=path)
        if row.stage_regions:
            # vLLM writes every layer of a stored chunk and no KV page is all zero bytes (the scales of FP8
            # caches are powers of two, latents are normalised): an all-zero layer is one the writer did not
            # have, so the partition claims more layers than the writer's stage held.
            for lo, n in row.stage_regions[k // max(1, row.parallel.get("dcp", 1))]:
                if buf[first + lo:first + lo + n] == bytes(n):
                    raise LegacyLayoutError(
                        f"worker {shard.slots[0]}'s slot holds no data at {lo}..{lo + n} (a layer of its stage by the "
                        f"partition {','.join(map(str, row.pp_layers))}): the writer did not have that layer, so the "
                        "partition does not add up to the writer's layers", hint="--pp-layers", path=path)
        plan.gather_shard(shard, buf[first:first + s], out)
    return out


def provenance_for(row: RowLayout, created: int, writer: str) -> Provenance:
    """Provenance of a compacted file: who wrote the legacy row (tp/pp/row kind, partition) and when."""
    p = row.parallel
    return Provenance(tp=row.provenance_tp, pp=p.get("pp", 1), dcp=p.get("dcp", 1), pcp=p.get("pcp", 1),
                      row=row.kind, writer=writer, created=created, pp_layers=row.pp_layers,
                      cp_interleave=row.cp_interleave if p.get("dcp", 1) > 1 else 1)


def key_for(f: LegacyFile) -> BlockKey:
    return BlockKey(f.hash, f.group)
