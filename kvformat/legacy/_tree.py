"""vLLM's built-in fs-tier trees: naming, config.json (untrusted), discovery of namespaces and block files.

vLLM's ``FileSystemTierManager`` (``vllm/v1/kv_offload/tiering/fs/``, ``file_mapper.py``) writes::

    <root>/<model '/'->'_'>_<sha256(fields)[:12]>/config.json
    <root>/<model '/'->'_'>_<sha256(fields)[:12]>_r<rank>/<hash[:3]>/<hash[3:5]>_g<group>/<hash>.bin

:func:`legacy_paths` and :func:`write_legacy_row` reproduce that naming for demos and tests (tests check
them against vLLM's own ``FileMapper``). Reads only what it is given; never imports vLLM. The row layout
of the files is :mod:`kvformat.legacy`'s concern.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from ..format import is_regular_file, read_small_file, write_atomic
from ..errors import LegacyLayoutError, UnsafeFileError

__all__ = [
    "CONFIG_FILE", "LegacyNamespace", "LegacyFile", "Ignored", "find_namespaces", "is_legacy_root", "iter_legacy_files",
    "legacy_fields", "legacy_paths", "write_legacy_row",
]

CONFIG_FILE = "config.json"
_BASE_RE = re.compile(r"^(?P<model>.+)_(?P<digest>[0-9a-f]{12})$")
_RANK_RE = re.compile(r"^(?P<base>.+_[0-9a-f]{12})_r(?P<rank>[0-9]+)$")
_HASH_RE = re.compile(r"^[0-9a-f]{2,128}$")
_GROUP_RE = re.compile(r"^(?P<hh>[0-9a-f]{2})_g(?P<group>[0-9]+)$")


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
