"""Reading vLLM's built-in fs-tier trees (the "legacy" files kvformat compacts).

vLLM 0.33's ``FileSystemTierManager`` (``vllm/v1/kv_offload/tiering/fs/``, ``file_mapper.py``) writes::

    <root>/<model '/'->'_'>_<sha256(fields)[:12]>/config.json
    <root>/<model '/'->'_'>_<sha256(fields)[:12]>_r<rank>/<hash[:3]>/<hash[3:5]>_g<group>/<hash>.bin

Each ``.bin`` is one whole primary row, raw bytes, no header: ``|W0|W1|...|W(n-1)|pad|`` (one slot per
worker) or ``|slot|pad|`` (``replicated_layout``), padded to a multiple of 4096. A slot holds, per layer
in the group's layer order, ``page_bytes * blocks_per_file`` bytes. config.json does not record the
per-layer page size, so it is inferred from the file size (:func:`infer_row`); ``page_bytes`` is the
hint when that is ambiguous.

Supported rows: replicated and per-worker (TP only: every slot must hold the same MLA latent, which
is checked byte for byte). Refused with :class:`LegacyLayoutError`: pipeline parallel (stage slots
hold different layers and config.json does not say which stage owns which layers), decode/prefill
context parallel (slots hold different tokens) and vLLM's canonical rows (``canonical_format``:
where the pages sit depends on the writer's worker count, which config.json does not record).

This module reads only; it never imports vLLM. :func:`legacy_paths` and :func:`write_legacy_row`
reproduce vLLM's naming for demos and tests (tests check them against vLLM's own ``FileMapper``).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from ._consts import round_up
from ._header import xxh3_hex
from ._io import UnsafeFileError, is_regular_file, read_small_file, write_atomic
from ._spec import BlockKey, CanonicalLayout, Provenance
from .errors import LegacyLayoutError, ReplicaMismatchError, SchemaError
from .layout import (
    DeploymentFacts, GroupFacts, LayerFacts, ParallelFacts, RowPlan, formula_layer, plan_groups, pp_stage_names,
    stage_layer_facts,
)

__all__ = [
    "ROW_ALIGN", "LegacyNamespace", "LegacyFile", "RowLayout", "Ignored", "find_namespaces", "is_legacy_root",
    "iter_legacy_files", "infer_row", "extract_payload", "legacy_fields", "legacy_paths", "write_legacy_row",
]

ROW_ALIGN = 4096  # vLLM SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT: rows are padded to this
CONFIG_FILE = "config.json"
_BASE_RE = re.compile(r"^(?P<model>.+)_(?P<digest>[0-9a-f]{12})$")
_RANK_RE = re.compile(r"^(?P<base>.+_[0-9a-f]{12})_r(?P<rank>[0-9]+)$")
_HASH_RE = re.compile(r"^[0-9a-f]{2,128}$")
_GROUP_RE = re.compile(r"^(?P<hh>[0-9a-f]{2})_g(?P<group>[0-9]+)$")
_memcmp: Any
try:  # memcmp releases the GIL and stops at the first difference; memoryview == is ~50x slower
    _memcmp = ctypes.CDLL(None).memcmp
    _memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    _memcmp.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
    _memcmp = None


@dataclass(frozen=True)
class LegacyNamespace:
    """One ``<model>_<digest>`` directory of a legacy root: its config.json and rank directories.

    config.json is untrusted input (any process that can write the cache directory can write it):
    every accessor checks the type and range of what it returns and raises LegacyLayoutError
    (naming config.json and the field) instead of a TypeError or a wrong default.
    :meth:`validate` runs them all; :func:`find_namespaces` calls it.
    """

    root: str
    base: str  # "<model>_<digest>"
    config: Mapping[str, Any]
    rank_dirs: tuple[tuple[int, str], ...]  # (rank, absolute path)
    digest_ok: bool  # sha256 of config.json fields reproduces the directory digest

    @property
    def config_path(self) -> str:
        return os.path.join(self.root, self.base, CONFIG_FILE)

    def _bad(self, key: str, want: str, value: Any) -> LegacyLayoutError:
        return LegacyLayoutError(f"config.json: {key} must be {want}, got {_short(value)}", path=self.config_path)

    def _str(self, key: str, *, required: bool) -> str | None:
        v = self.config.get(key)
        if v is None and not required:
            return None
        if not isinstance(v, str) or not v:
            raise self._bad(key, "a non-empty string", v)
        return v

    def _int(self, key: str, default: int, lo: int) -> int:
        v = self.config.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise self._bad(key, f"an integer >= {lo}", v)
        return v

    @property
    def model(self) -> str:
        return self._str("model_name", required=True) or ""

    @property
    def dtype(self) -> str:
        return self._str("dtype", required=True) or ""

    @property
    def blocks_per_file(self) -> int:
        return self._int("blocks_per_file", 1, 1)

    @property
    def tokens_per_hash(self) -> int:
        """0 when config.json does not say (the layout then uses tokens_per_block)."""
        return self._int("tokens_per_hash", 0, 0)

    @property
    def replicated(self) -> bool:
        v = self.config.get("replicated_layout", False)
        if not isinstance(v, bool):
            raise self._bad("replicated_layout", "true or false", v)
        return v

    @property
    def canonical_format(self) -> str | None:
        return self._str("canonical_format", required=False)

    def groups(self) -> list[Mapping[str, Any]]:
        """The KV-cache groups, each with a ``layer_names`` list of strings and a positive ``tokens_per_block``."""
        gs = self.config.get("kv_cache_groups")
        if not isinstance(gs, list):
            raise self._bad("kv_cache_groups", "a list of groups", gs)
        out: list[Mapping[str, Any]] = []
        for i, g in enumerate(gs):
            where = f"kv_cache_groups[{i}]"
            if not isinstance(g, Mapping):
                raise self._bad(where, "an object", g)
            names = g.get("layer_names", [])
            if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
                raise self._bad(f"{where}.layer_names", "a list of non-empty strings", names)
            tpb = g.get("tokens_per_block")
            if isinstance(tpb, bool) or not isinstance(tpb, int) or tpb < 1:
                raise self._bad(f"{where}.tokens_per_block", "an integer >= 1", tpb)
            out.append(dict(g))
        return out

    def parallel(self) -> dict[str, int]:
        return {k: self._int(f"{k}_size", 1, 1) for k in ("tp", "pp", "pcp", "dcp")}

    def validate(self) -> None:
        """Check every field the accessors read; raises LegacyLayoutError on the first bad one."""
        _ = (self.model, self.dtype, self.blocks_per_file, self.tokens_per_hash, self.replicated,
             self.canonical_format, self.groups(), self.parallel())


def _short(value: Any) -> str:
    """A config value for an error message: its type and at most 60 characters of its repr."""
    r = repr(value)
    return f"{type(value).__name__} {r[:60]}{'...' if len(r) > 60 else ''}"


@dataclass(frozen=True)
class LegacyFile:
    """One legacy block file."""

    path: str
    rank: int
    group: int
    hash: str
    size: int
    mtime: float


@dataclass(frozen=True)
class Ignored:
    """A path under a legacy root that is not converted, and why."""

    path: str
    why: str


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

    @property
    def padding(self) -> int:
        return self.row_bytes - self.slot_bytes * self.copies


def legacy_fields(model: str, *, tokens_per_hash: int, blocks_per_file: int, dtype: str,
                  kv_cache_groups: Sequence[Mapping[str, Any]], tp: int = 1, pp: int = 1, pcp: int = 1,
                  dcp: int = 1, replicated: bool = False, canonical_format: str | None = None,
                  inference_engine: str = "vllm") -> dict[str, Any]:
    """The hashed ``fields`` of vLLM's FileMapper as its fs tier builds them (parallel_agnostic when replicated)."""
    agnostic = replicated
    if agnostic:
        tp = pp = pcp = dcp = 1
    f: dict[str, Any] = {
        "model_name": model, "tokens_per_hash": tokens_per_hash, "blocks_per_file": blocks_per_file,
        "tp_size": tp, "pp_size": pp, "pcp_size": pcp, "dcp_size": dcp, "dtype": str(dtype),
        "kv_cache_groups": [dict(g) for g in kv_cache_groups], "inference_engine": inference_engine,
    }
    if not agnostic:
        f["parallel_agnostic"] = False
    if replicated:
        f["replicated_layout"] = True
    if canonical_format is not None:
        f["canonical_format"] = canonical_format
    return f


def _digest(fields: Mapping[str, Any]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:12]


def legacy_paths(root: str, fields: Mapping[str, Any], block_hash: str, group: int = 0,
                 rank: int = 0) -> tuple[str, str]:
    """``(config.json path, block file path)`` exactly as vLLM's FileMapper names them."""
    base = f"{root}/{fields['model_name'].replace('/', '_')}_{_digest(fields)}"
    return f"{base}/{CONFIG_FILE}", f"{base}_r{rank}/{block_hash[:3]}/{block_hash[3:5]}_g{group}/{block_hash}.bin"


def write_legacy_row(root: str, fields: Mapping[str, Any], block_hash: str, row: Any, *, group: int = 0,
                     rank: int = 0) -> str:
    """Write one legacy block file (and config.json if missing) as vLLM's fs tier does. Returns its path."""
    cfg, path = legacy_paths(root, fields, block_hash, group, rank)
    if not os.path.exists(cfg):
        os.makedirs(os.path.dirname(cfg), exist_ok=True)
        with open(cfg, "w") as f:
            json.dump(dict(fields), f, indent=2, sort_keys=True)
    write_atomic(path, [row])
    return path


# -- discovery ---------------------------------------------------------------------------------------
def _inside(path: str, root_real: str) -> bool:
    real = os.path.realpath(path)
    return real == root_real or real.startswith(root_real + os.sep)


def is_legacy_root(root: str) -> bool:
    """True when ``root`` holds at least one ``<model>_<digest>/config.json`` of vLLM's fs tier."""
    return bool(find_namespaces(root, _probe=True))


def find_namespaces(root: str, *, ignored: list[Ignored] | None = None,
                    errors: list[LegacyLayoutError] | None = None, _probe: bool = False,
                    ) -> list[LegacyNamespace]:
    """Every legacy namespace directly under ``root`` (sorted by directory name).

    A config.json that is a symlink, a FIFO, a device node or over 1 MiB is never opened or read:
    its namespace is skipped and, when ``ignored`` is given, recorded there.

    A config.json that is not valid JSON, lacks the fields vLLM writes or holds a value of the wrong
    type or range (:meth:`LegacyNamespace.validate`) raises LegacyLayoutError; when ``errors`` is
    given, the error is appended there instead and that namespace skipped, so the others are still
    found.
    """
    try:
        names = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    ranks: dict[str, list[tuple[int, str]]] = {}
    for n in names:
        m = _RANK_RE.match(n)
        if m and os.path.isdir(os.path.join(root, n)):
            ranks.setdefault(m["base"], []).append((int(m["rank"]), os.path.join(root, n)))
    for n in names:
        if not _BASE_RE.match(n):
            continue
        cfg_path = os.path.join(root, n, CONFIG_FILE)
        if not os.path.lexists(cfg_path):
            continue
        if _probe:
            if is_regular_file(cfg_path):
                return [LegacyNamespace(root, n, {}, (), False)]
            continue
        try:
            cfg = json.loads(read_small_file(cfg_path))
        except UnsafeFileError as e:
            if ignored is not None:
                ignored.append(Ignored(cfg_path, f"config.json is {e.strerror}: namespace skipped"))
            continue
        except (FileNotFoundError, NotADirectoryError):
            continue
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            err = LegacyLayoutError(f"config.json is not valid JSON: {e}", path=cfg_path)
            if errors is None:
                raise err from None
            errors.append(err)
            continue
        try:
            if not isinstance(cfg, dict) or "model_name" not in cfg or "kv_cache_groups" not in cfg:
                raise LegacyLayoutError("config.json lacks model_name/kv_cache_groups (not a vLLM fs-tier config)",
                                        path=cfg_path)
            ns = LegacyNamespace(root, n, cfg, tuple(sorted(ranks.get(n, []))), _digest_ok(cfg, n))
            ns.validate()
        except LegacyLayoutError as e:
            if errors is None:
                raise
            errors.append(e)
            continue
        out.append(ns)
    return out


def _digest_ok(cfg: Mapping[str, Any], base: str) -> bool:
    try:
        return _digest(cfg) == base[-12:]
    except (TypeError, ValueError):  # not JSON-serialisable back (cannot happen for parsed JSON; be safe)
        return False


def iter_legacy_files(ns: LegacyNamespace, ignored: list[Ignored] | None = None,
                      src_root: str | None = None) -> Iterator[LegacyFile]:
    """Block files of a namespace in a stable order (rank, then path).

    Symlinks are followed only while they stay inside ``src_root`` (default: the namespace's root);
    those that leave it, in-flight vLLM temp files and names that do not follow vLLM's scheme are
    skipped and, when ``ignored`` is given, recorded there.
    """
    root_real = os.path.realpath(src_root or ns.root)

    def skip(path: str, why: str) -> None:
        if ignored is not None:
            ignored.append(Ignored(path, why))

    for rank, rdir in ns.rank_dirs:
        if os.path.islink(rdir) and not _inside(rdir, root_real):
            skip(rdir, "symlink leaves the source root")
            continue
        for d1 in _sorted_scandir(rdir):
            if not _dir_ok(d1, root_real, skip):
                continue
            for d2 in _sorted_scandir(d1.path):
                if not _dir_ok(d2, root_real, skip):
                    continue
                m = _GROUP_RE.match(d2.name)
                if not m:
                    skip(d2.path, "not a <hh>_g<group> directory")
                    continue
                group = int(m["group"])
                for e in _sorted_scandir(d2.path):
                    name = e.name
                    if name.endswith(".tmp") and ".bin_" in name:
                        skip(e.path, "vLLM temp file (write in flight or crashed)")
                        continue
                    h = name[:-4] if name.endswith(".bin") else ""
                    if not h or not _HASH_RE.match(h) or h[:3] != d1.name or h[3:5] != m["hh"]:
                        skip(e.path, "not a vLLM block file name")
                        continue
                    try:
                        if e.is_symlink():
                            if not _inside(e.path, root_real):
                                skip(e.path, "symlink leaves the source root")
                                continue
                            st = os.stat(e.path)
                        else:
                            st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        skip(e.path, "not a regular file")
                        continue
                    yield LegacyFile(e.path, rank, group, h, st.st_size, st.st_mtime)


def _sorted_scandir(d: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(d) as it:
            return sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _dir_ok(e: os.DirEntry[str], root_real: str, skip: Any) -> bool:
    if e.is_symlink():
        if not _inside(e.path, root_real):
            skip(e.path, "symlink leaves the source root")
            return False
        return os.path.isdir(e.path)
    if not e.is_dir(follow_symlinks=False):
        skip(e.path, "not a vLLM directory level")
        return False
    return True


# -- row layout ---------------------------------------------------------------------------------------
def infer_row(ns: LegacyNamespace, group: int, file_size: int, *, page_bytes: int | None = None,
              kv_cache_layout: str = "LBNHC", pp_layers: Sequence[int] | None = None,
              cp_interleave: int = 1) -> RowLayout:
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
    ``cp_kv_cache_interleave_size`` (CLI ``--cp-interleave``, vLLM's default 1), which config.json does not record.

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
    if par["pcp"] > 1:
        raise LegacyLayoutError(
            f"prefill-context-parallel rows (pcp_size={par['pcp']}) are not supported (as in the tier)", path=where)
    if par["pp"] > 1 and pp_layers is None:
        raise LegacyLayoutError(
            f"pipeline-parallel rows (pp_size={par['pp']}): each stage's slot holds only its own layers and "
            "config.json names only stage 0's; give the writer's partition (decoder layers per stage)",
            hint="--pp-layers", path=where)
    if pp_layers is not None and (par["pp"] == 1 or len(pp_layers) != par["pp"] or min(pp_layers) < 1):
        raise LegacyLayoutError(f"--pp-layers {','.join(map(str, pp_layers))} does not give {par['pp']} stage(s) "
                                "of at least one layer (config.json's pp_size)", path=where)
    sharded = par["pp"] > 1 or par["dcp"] > 1
    if sharded and (tpb % par["dcp"] or (tpb // par["dcp"]) % cp_interleave):
        raise LegacyLayoutError(f"tokens_per_block {tpb} does not split into {par['dcp']} DCP ranks of whole "
                                f"interleave runs of {cp_interleave}", path=where)
    if ns.canonical_format:
        raise LegacyLayoutError(
            f"canonical rows ({ns.canonical_format}) are not supported: where the canonical pages sit in the row "
            "depends on the writer's worker count, which config.json does not record", path=where)
    if len(groups) > 1:
        # Several groups share each row (overlaid from byte 0, or packed side by side): which bytes are this
        # group's depends on vLLM's placement, which config.json does not record.
        raise LegacyLayoutError(f"{len(groups)} KV-cache groups: config.json does not record where each group's "
                                "layers sit in the row, so no per-layer table can be proven", path=where)
    bpf = ns.blocks_per_file
    kind = "replicated" if ns.replicated else "per_worker"
    copies = 1 if kind != "per_worker" else par["tp"] * par["pp"]
    if sharded and kind != "per_worker":
        raise LegacyLayoutError("pipeline/decode-context parallel rows are per-worker rows in vLLM, but config.json "
                                "says replicated_layout", path=where)
    full_tpb, tpb = tpb, tpb // par["dcp"]  # a worker's block holds tokens_per_block / dcp tokens
    unit = bpf * copies  # row bytes per byte of worker_kv_bytes_per_block (before the 4096 padding)
    if page_bytes is not None:
        # The hint is one layer's page of a uniform model (what --page-bytes has always meant).
        cands = [page_bytes * len(names)]
        row_bytes = round_up(cands[0] * unit, ROW_ALIGN)
        if row_bytes != file_size:
            raise LegacyLayoutError(
                f"--page-bytes {page_bytes} gives a {row_bytes}-byte row, the file has {file_size}")
    else:
        if file_size <= 0 or file_size % ROW_ALIGN:
            raise LegacyLayoutError(f"size {file_size} is not a multiple of {ROW_ALIGN}: fits no row layout")
        lo = (file_size - ROW_ALIGN) // unit + 1
        hi = file_size // unit
        cands = [w for w in range(round_up(lo, tpb), hi + 1, tpb) if w > 0]
    # The same layout model as the tier (kvformat.layout), fed what config.json says plus a candidate
    # bytes-per-block: a legacy row compacts to exactly the file the tier writes for that deployment.
    plans = []
    for w in cands:
        facts = DeploymentFacts(model=ns.model, kv_dtype=ns.dtype, tokens_per_hash=ns.tokens_per_hash or tpb,
                                blocks_per_chunk=bpf, worker_bytes_per_block=w,
                                groups=(GroupFacts(group, tpb, tuple(names)),), row=kind, copies=copies,
                                kv_cache_layout=kv_cache_layout, source="legacy config.json + file size")
        try:
            plan = plan_groups(facts)[group]
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
    w, plan = plans[0]
    if sharded:
        return _sharded_row(ns, group, file_size, w, plan, full_tpb, par, tuple(pp_layers or ()), cp_interleave,
                            kv_cache_layout, where)
    return RowLayout(kind=kind, copies=copies, page_bytes=plan.layout.layers[0].page_bytes, slot_bytes=w * bpf,
                     row_bytes=file_size, layout=plan.layout, provenance_tp=par["tp"] if kind == "per_worker" else 1,
                     parallel=par)


def _sharded_row(ns: LegacyNamespace, group: int, file_size: int, w: int, stage0: RowPlan, full_tpb: int,
                 par: Mapping[str, int], pp_layers: tuple[int, ...], inter: int, kv_cache_layout: str,
                 where: str) -> RowLayout:
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
                           stage_layers=pp_layers)
        df = DeploymentFacts(model=ns.model, kv_dtype=ns.dtype, tokens_per_hash=ns.tokens_per_hash or full_tpb,
                             blocks_per_chunk=ns.blocks_per_file, worker_bytes_per_block=w,
                             groups=(GroupFacts(group, full_tpb, canonical),), row="per_worker",
                             copies=par["tp"] * par["pp"], kv_cache_layout=kv_cache_layout, layers=facts,
                             source="legacy config.json + file size + partition", parallel=pf)
        plan = plan_groups(df)[group]
    except SchemaError as e:
        raise LegacyLayoutError(e.message, path=where) from None
    return RowLayout(kind="per_worker", copies=par["tp"] * par["pp"], page_bytes=lay.layers[0].page_bytes,
                     slot_bytes=w * ns.blocks_per_file, row_bytes=file_size, layout=plan.layout,
                     provenance_tp=par["tp"], parallel=par, plan=plan, pp_layers=pp_layers, cp_interleave=inter)


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
    if row.copies > 1:
        same = True
        base = _addr(buf) if _memcmp is not None else None
        for i in range(1, row.copies):
            if base is not None:
                same = _memcmp(base, base + i * s, s) == 0
            else:
                same = buf[:s] == buf[i * s:(i + 1) * s]
            if not same:
                break
        if not same:
            raise ReplicaMismatchError([xxh3_hex(buf[i * s:(i + 1) * s]) for i in range(row.copies)], path=path)
    return buf[:s]


def _assemble(row: RowLayout, plan: RowPlan, buf: memoryview, path: str | None) -> memoryview:
    """The canonical payload of a PP/DCP row: each shard's replicas must agree, and the slot bytes past a
    stage's layers (never written by vLLM) must be zero, else the partition does not describe this file."""
    s = row.slot_bytes
    out = memoryview(bytearray(row.layout.payload_bytes))
    for shard in plan.shards:
        first = shard.slots[0] * s
        ref = buf[first:first + shard.used]
        for w in shard.slots[1:]:
            if buf[w * s:w * s + shard.used] != ref:
                raise ReplicaMismatchError([xxh3_hex(buf[x * s:x * s + shard.used]) for x in shard.slots], path=path)
        for w in shard.slots:
            tail = buf[w * s + shard.used:(w + 1) * s]
            if tail.nbytes and tail != bytes(tail.nbytes):
                raise LegacyLayoutError(
                    f"worker {w}'s slot holds data past its stage's {shard.used} bytes of layers: the partition "
                    f"{','.join(map(str, row.pp_layers))} does not describe this file", hint="--pp-layers", path=path)
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
