"""Parsing and checking of the tier's parameters (the tier dict of vLLM's ``secondary_tiers``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..format import SEAL_LEVELS, format_size, looks_like_key, parse_limit
from ..errors import SchemaError, UsageError
from ..storage import check_storage_options, split_root
from ._keyscheme import parse_key_scheme

REPLICA_POLICIES = ("verify", "trust_rank0")
O_DIRECT_MODES = ("auto", "on", "off")
SEAL_MODES = ("off", *SEAL_LEVELS)


def parse_size(name: str, value: Any) -> int | None:
    """Bytes from an int or a string such as ``"500GiB"``, ``"1.5TB"``, ``"800G"``; None means unbounded.

    The syntax and the meaning of 0 (unbounded) are kvformat's one size syntax (:mod:`kvformat.format._sizes`),
    shared with the CLI. A bad value raises SchemaError naming ``name``.
    """
    try:
        return parse_limit(value, name)
    except UsageError as e:
        raise SchemaError(name, e.message.removeprefix(f"{name}: ")) from None


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise SchemaError(name, f"expected one of {', '.join(choices)}, got {value!r}")
    return str(value)  # one of ``choices``: already a str


def _locality(value: Any) -> str:
    # Named as vLLM's own tiers name it (its Locality enum), so a caller matching vLLM's refusal matches ours.
    if value not in ("LOCAL", "REMOTE"):
        raise SchemaError("locality", f"{value!r} is not a valid Locality: expected one of LOCAL, REMOTE")
    return str(value)


def _number(name: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise SchemaError(name, f"expected a number in {lo:g}..{hi:g}, got {value!r}")
    return float(value)


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SchemaError(name, f"expected an integer in {lo}..{hi}, got {value!r}")
    return value


# The zstd level when none is set. planes (spec §6.2) codes a near-entropy plane: level 1 is both smaller and
# faster to decode there than 3 (docs/benchmarks/codec.md). "auto" only ever picks planes (or none).
_DEFAULT_LEVEL = {"zstd": 3, "planes": 1, "auto": 1}
# "auto": the tier picks planes or none per root at start-up from what it measures (cache/_autocodec.py).
COMPRESSIONS = ("none", "zstd", "planes", "auto")
# Which file the bound evicts next (docs/benchmarks/capacity.md): "ghost-slru" (cache/_ghost.py, the default)
# or plain "lru".
EVICTIONS = ("ghost-slru", "lru")


@dataclass(frozen=True)
class TierConfig:
    """The checked parameters of a KVFormatTier (see docs/vllm.md for each one)."""

    root: str
    read_threads: int = 8
    write_threads: int = 8
    compression: str = "none"
    compression_level: int = 3
    verify: bool = True
    max_bytes: int | None = None
    o_direct: str = "off"
    fsync: bool = False
    replica_policy: str = "verify"
    model_revision: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    enable_kv_events: bool = False
    locality: str | None = None
    # Sealed files (spec §12): the level, and key SOURCES (a path or env:NAME), never keys.
    seal: str = "off"
    seal_key: str | None = None
    seal_read_keys: tuple[str, ...] = ()
    start_degraded: bool = False
    shared_allowance: int | None = None
    shared_interval_s: float = 1.0
    # A load not finished this long after it was asked for is a miss, and a read running longer no longer holds
    # back the shared root's deletions (docs/vllm.md "read_deadline_s"); 0 turns both off.
    read_deadline_s: float = 10.0
    # How files are named across engines (kvformat.cache._keyscheme): "engine" or "token-chain".
    key_scheme: str = "engine"
    eviction: str = "ghost-slru"

    @classmethod
    def parse(cls, root: Any, **kw: Any) -> "TierConfig":
        """Check every parameter; raises SchemaError (a ValueError) naming the bad one."""
        if not isinstance(root, str) or not root or "\0" in root:
            raise SchemaError("root", f"expected a directory path or URL, got {root!r}")
        scheme, local = split_root(root)
        if not scheme:
            if os.path.exists(local) and not os.path.isdir(local):
                raise SchemaError("root", f"{local} exists and is not a directory")
        rev = kw.get("model_revision")
        if rev is not None and (not isinstance(rev, str) or not rev):
            raise SchemaError("model_revision", f"expected a non-empty string, got {rev!r}")
        so = kw.get("storage_options") or {}
        check_storage_options(root, so)
        for b in ("verify", "fsync", "enable_kv_events", "start_degraded"):
            if b in kw and not isinstance(kw[b], bool):
                raise SchemaError(b, f"expected true or false, got {kw[b]!r}")
        compression = _choice("compression", kw.get("compression", "none"), COMPRESSIONS)
        seal, seal_key, read_keys = _seal_params(kw.get("seal", "off"), kw.get("seal_key"), kw.get("seal_read_keys"),
                                                 compression)
        return cls(
            root=root,
            read_threads=_int("read_threads", kw.get("read_threads", 8), 1, 256),
            write_threads=_int("write_threads", kw.get("write_threads", 8), 1, 256),
            compression=compression,
            compression_level=_int("compression_level", _DEFAULT_LEVEL.get(compression, 3)
                                   if kw.get("compression_level") is None else kw["compression_level"], 0, 22),
            verify=kw.get("verify", True),
            max_bytes=parse_size("max_bytes", kw.get("max_bytes")),
            o_direct=_choice("o_direct", kw.get("o_direct", "off"), O_DIRECT_MODES),
            fsync=kw.get("fsync", False),
            replica_policy=_choice("replica_policy", kw.get("replica_policy", "verify"), REPLICA_POLICIES),
            model_revision=rev,
            storage_options=dict(so),
            enable_kv_events=kw.get("enable_kv_events", False),
            locality=_locality(kw["locality"]) if kw.get("locality") is not None else None,
            start_degraded=kw.get("start_degraded", False),
            shared_allowance=parse_size("shared_allowance", kw.get("shared_allowance")),
            shared_interval_s=_number("shared_interval_s", kw.get("shared_interval_s", 1.0), 0.01, 60.0),
            read_deadline_s=_number("read_deadline_s", kw.get("read_deadline_s", 10.0), 0.0, 3600.0),
            seal=seal,
            seal_key=seal_key,
            seal_read_keys=read_keys,
            key_scheme=parse_key_scheme(kw.get("key_scheme", "engine")),
            eviction=_choice("eviction", kw.get("eviction", "ghost-slru"), EVICTIONS),
        )

    def check_bound(self, file_bytes: int) -> str | None:
        """Refuse a ``max_bytes`` below one chunk file of ``file_bytes`` (SchemaError naming it and the size);
        return a warning for one below 16 files (the LRU then keeps only a handful of chunks), else None."""
        if self.max_bytes is None:
            return None
        if self.shared_allowance is not None and self.shared_allowance < file_bytes:
            raise SchemaError("shared_allowance", f"{self.shared_allowance} bytes is smaller than one chunk file "
                              f"({file_bytes} bytes): no engine sharing the root could store anything")
        if self.max_bytes < file_bytes:
            raise SchemaError("max_bytes", f"{self.max_bytes} bytes ({format_size(self.max_bytes)}) is smaller than "
                              f"one chunk file of this deployment ({file_bytes} bytes, {format_size(file_bytes)}): "
                              "nothing could ever be stored. Sizes take units: \"500GiB\", \"1.5TB\"")
        if self.max_bytes < 16 * file_bytes:
            return (f"max_bytes={self.max_bytes} ({format_size(self.max_bytes)}) holds only "
                    f"{self.max_bytes // file_bytes} chunk files of {file_bytes} bytes ({format_size(file_bytes)}): "
                    "was a unit forgotten (\"500GiB\")?")
        return None


def _key_source(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SchemaError(name, f"expected a key file path or env:NAME, got {type(value).__name__}")
    if looks_like_key(value):  # never echo it: it is a secret
        raise SchemaError(name, "holds what looks like a key itself (not shown); give a key file path or env:NAME "
                          "(a key in the tier config leaks into logs and process listings; if a path was meant, "
                          "no such file exists)")
    return value


def _seal_params(seal: Any, key: Any, read: Any, compression: str) -> tuple[str, str | None, tuple[str, ...]]:
    """The checked seal, seal_key and seal_read_keys parameters (the keys are loaded by ``_sealing``)."""
    seal = _choice("seal", seal, SEAL_MODES)
    if read is None:
        read = ()
    if isinstance(read, str) or not isinstance(read, (list, tuple)):
        raise SchemaError("seal_read_keys", f"expected a list of key file paths or env:NAME, got {type(read).__name__}")
    read_keys = tuple(_key_source("seal_read_keys", r) for r in read)
    if seal == "off":
        if key is not None or read_keys:
            raise SchemaError("seal_key", "keys are given but seal is \"off\": set seal to \"authenticate\" or "
                              "\"encrypt\", or drop the keys")
        return seal, None, ()
    if key is None:
        raise SchemaError("seal_key", f"seal {seal!r} needs the key new files are sealed under (a key file path or "
                          "env:NAME)")
    if compression != "none":
        raise SchemaError("compression", "sealed files are not compressed (spec §12.1): use compression \"none\"")
    return seal, _key_source("seal_key", key), read_keys
