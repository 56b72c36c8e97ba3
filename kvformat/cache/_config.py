"""Parsing and checking of the tier's parameters (the tier dict of vLLM's ``secondary_tiers``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..format._sizes import parse_limit
from ..errors import SchemaError, UsageError
from ._keyscheme import parse_key_scheme

REPLICA_POLICIES = ("verify", "trust_rank0")
O_DIRECT_MODES = ("auto", "on", "off")


def parse_size(name: str, value: Any) -> int | None:
    """Bytes from an int or a string such as ``"500GiB"``, ``"1.5TB"``, ``"800G"``; None means unbounded.

    The syntax and the meaning of 0 (unbounded) are kvformat's one size syntax (:mod:`kvformat._sizes`),
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


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SchemaError(name, f"expected an integer in {lo}..{hi}, got {value!r}")
    return value


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
    # How files are named across engines (kvformat.cache._keyscheme): "engine" or "token-chain".
    key_scheme: str = "engine"

    @classmethod
    def parse(cls, root: Any, **kw: Any) -> "TierConfig":
        """Check every parameter; raises SchemaError (a ValueError) naming the bad one."""
        if not isinstance(root, str) or not root:
            raise SchemaError("root", f"expected a directory path or URL, got {root!r}")
        rev = kw.get("model_revision")
        if rev is not None and (not isinstance(rev, str) or not rev):
            raise SchemaError("model_revision", f"expected a non-empty string, got {rev!r}")
        so = kw.get("storage_options") or {}
        if not isinstance(so, Mapping):
            raise SchemaError("storage_options", f"expected a dict, got {type(so).__name__}")
        for b in ("verify", "fsync", "enable_kv_events"):
            if b in kw and not isinstance(kw[b], bool):
                raise SchemaError(b, f"expected true or false, got {kw[b]!r}")
        compression = _choice("compression", kw.get("compression", "none"), ("none", "zstd"))
        return cls(
            root=root,
            read_threads=_int("read_threads", kw.get("read_threads", 8), 1, 256),
            write_threads=_int("write_threads", kw.get("write_threads", 8), 1, 256),
            compression=compression,
            compression_level=_int("compression_level", kw.get("compression_level", 3), 0, 22),
            verify=kw.get("verify", True),
            max_bytes=parse_size("max_bytes", kw.get("max_bytes")),
            o_direct=_choice("o_direct", kw.get("o_direct", "off"), O_DIRECT_MODES),
            fsync=kw.get("fsync", False),
            replica_policy=_choice("replica_policy", kw.get("replica_policy", "verify"), REPLICA_POLICIES),
            model_revision=rev,
            storage_options=dict(so),
            enable_kv_events=kw.get("enable_kv_events", False),
            locality=kw.get("locality"),
            key_scheme=parse_key_scheme(kw.get("key_scheme", "engine")),
        )
