"""The schemas of every command's ``--json`` output (docs/schema/kvformat-cli.schema.json is generated from them).

Run ``python -m kvformat.cli._schema [PATH]`` to regenerate the published file; tests check it matches.

A JSON-Schema subset (type, properties, required, items, enum, anyOf, additionalProperties) and a
tiny validator for it, so the check needs no extra package.
"""

from __future__ import annotations

from typing import Any

_INT = {"type": "integer"}
_STR = {"type": "string"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_BAD = {"type": "array", "items": {"type": "object", "required": ["path", "reason", "message"],
                                    "properties": {"path": _STR, "reason": _STR, "message": _STR}}}

_NAMESPACE = {
    "type": "object",
    "required": ["namespace", "model", "kv_dtype", "tokens_per_block", "blocks_per_chunk", "layers", "files", "bytes",
                 "tp_sizes", "compression_ratio", "corrupt", "oldest", "newest", "bad_files"],
    "properties": {
        "namespace": _STR, "model": {"type": ["string", "null"]}, "kv_dtype": {"type": ["string", "null"]},
        "tokens_per_block": {"type": ["integer", "null"]}, "blocks_per_chunk": {"type": ["integer", "null"]},
        "layers": {"type": ["integer", "null"]}, "files": _INT, "bytes": _INT,
        "tp_sizes": {"type": "array", "items": _INT}, "compression_ratio": _NUM_OR_NULL, "corrupt": _INT,
        "oldest": _NUM_OR_NULL, "newest": _NUM_OR_NULL, "bad_files": _BAD,
        "unreadable": {"type": "array", "items": {"type": "object", "required": ["path", "error"]}},
        "seal": {"type": ["string", "null"], "enum": ["authenticate", "encrypt", None]},
        "key_ids": {"type": "object", "additionalProperties": _INT},
        "group": _INT,
        "legacy": {"type": "object",
                   "required": ["row", "slots", "page_bytes", "row_bytes", "padding", "digest_ok", "compacted_bytes",
                                "compacted_namespace", "error"],
                   "properties": {"row": {"type": ["string", "null"], "enum": ["replicated", "per_worker",
                                                                                 None]},
                                  "slots": {"type": ["integer", "null"]}, "page_bytes": {"type": ["integer", "null"]},
                                  "row_bytes": {"type": ["integer", "null"]}, "padding": {"type": ["integer", "null"]},
                                  "digest_ok": {"type": "boolean"}, "compacted_bytes": {"type": ["integer", "null"]},
                                  "compacted_namespace": {"type": ["string", "null"]},
                                  "error": {"type": ["string", "null"]}}},
    },
}

_FILE = {
    "type": "object",
    "required": ["kind", "path", "header", "layers", "checksum", "seal", "error"],
    "properties": {
        "kind": {"enum": ["file"]}, "path": _STR,
        "header": {"anyOf": [{"type": "null"}, {
            "type": "object",
            "required": ["version", "layout", "namespace", "key", "provenance", "codec", "level", "data_offset",
                         "data_bytes", "raw_bytes", "file_bytes", "checksums", "ratio"],
            "properties": {
                "version": _STR, "namespace": _STR, "codec": {"enum": ["none", "zstd", "planes"]},
                "level": {"type": ["integer", "null"]}, "data_offset": _INT, "data_bytes": _INT, "raw_bytes": _INT,
                "file_bytes": _INT, "ratio": {"type": "number"},
                "layout": {"type": "object", "required": ["model", "revision", "kv_dtype", "family", "tokens_per_block",
                                                          "blocks_per_chunk", "tokens_per_hash", "group", "layers"]},
                "key": {"type": "object", "required": ["hash", "group"],
                        "properties": {"hash": _STR, "group": _INT}},
                "provenance": {"type": "object", "required": ["tp", "pp", "dcp", "pcp", "row", "writer", "created"]},
                "checksums": {"type": "object", "required": ["header_xxh3", "data_xxh3", "raw_xxh3"]},
                "seal": {"type": "object", "required": ["level", "key_id", "nonce", "tag"]},
            }}]},
        "layers": {"type": "array", "items": {
            "type": "object", "required": ["name", "dtype", "shape", "offset", "bytes"],
            "properties": {"name": _STR, "dtype": _STR, "shape": {"type": "array", "items": _INT}, "offset": _INT,
                           "bytes": _INT}}},
        "checksum": {"type": "object", "required": ["header", "data"],
                     "properties": {"header": {"enum": ["ok", "bad", "unknown"]},
                                    "data": {"enum": ["ok", "bad", "skipped"]}}},
        "seal": {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["level", "key_id", "tag"],
            "properties": {"level": {"enum": ["authenticate", "encrypt"]}, "key_id": _STR,
                           "tag": {"enum": ["ok", "bad", "unknown_key", "unchecked"]}}}]},
        "error": {"anyOf": [{"type": "null"}, {"type": "object", "required": ["reason", "message"]}]},
    },
}

_ROOT = {
    "type": "object",
    "required": ["kind", "path", "verified_data", "namespaces", "totals"],
    "properties": {
        "kind": {"enum": ["kvformat_root", "legacy_root"]}, "path": _STR, "verified_data": {"type": "boolean"},
        "namespaces": {"type": "array", "items": _NAMESPACE},
        "totals": {"type": "object", "required": ["namespaces", "files", "bytes", "corrupt"],
                   "properties": {"namespaces": _INT, "files": _INT, "bytes": _INT, "corrupt": _INT}},
        "ignored": {"type": "array", "items": {"type": "object", "required": ["path", "why"]}},
        "unreadable": {"type": "array", "items": {"type": "object", "required": ["path", "error"],
                                                  "properties": {"path": _STR, "error": _STR}}},
        "errors": {"type": "array", "items": {"type": "object", "required": ["path", "message"],
                                              "properties": {"path": _STR, "message": _STR}}},
        "quarantine": {"type": "object", "required": ["path", "files", "bytes", "reasons"],
                       "properties": {"path": _STR, "files": _INT, "bytes": _INT, "reasons": {"type": "object"}}},
    },
}

_LEGACY_FILE = {
    "type": "object",
    "required": ["kind", "path", "namespace", "group", "hash", "bytes", "mtime", "model", "kv_dtype", "config", "row",
                 "replicas", "compacts_to", "error"],
    "properties": {
        "kind": {"enum": ["legacy_file"]}, "path": _STR, "namespace": _STR, "group": _INT, "hash": _STR,
        "bytes": _INT, "mtime": {"type": "number"}, "model": _STR, "kv_dtype": _STR, "config": {"type": "object"},
        "row": {"anyOf": [{"type": "null"}, {
            "type": "object",
            "required": ["kind", "slots", "page_bytes", "slot_bytes", "row_bytes", "padding", "slot_offsets"],
            "properties": {"kind": {"enum": ["replicated", "per_worker"]}, "slots": _INT,
                           "page_bytes": _INT, "slot_bytes": _INT, "row_bytes": _INT, "padding": _INT,
                           "slot_offsets": {"type": "array", "items": _INT}}}]},
        "replicas": {"enum": ["identical", "single", "differ", "skipped"]},
        "compacts_to": {"type": ["string", "null"]},
        "error": {"anyOf": [{"type": "null"}, {"type": "object", "required": ["reason", "message"]}]},
    },
}

INSPECT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "kvformat inspect --json",
    "anyOf": [_FILE, _ROOT, _LEGACY_FILE],
}

_PATHS = {"type": "array", "items": _STR}
_PATH_ERR = {"type": "array", "items": {"type": "object", "required": ["path", "error"],
                                        "properties": {"path": _STR, "error": _STR}}}
_PATH_WHY = {"type": "array", "items": {"type": "object", "required": ["path", "why"],
                                        "properties": {"path": _STR, "why": _STR}}}
_PATH_MSG = {"type": "array", "items": {"type": "object", "required": ["path", "message"],
                                        "properties": {"path": _STR, "message": _STR}}}
_EXIT = {"enum": [0, 1, 2]}

VERIFY_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "kvformat verify --json",
    "type": "object",
    "required": ["command", "path", "checked", "bad", "unreadable", "errors", "quarantined", "quarantine_failed",
                 "ignored", "exit_code"],
    "properties": {
        "command": {"enum": ["verify"]}, "path": _STR, "checked": _INT, "bad": _BAD, "unreadable": _PATH_ERR,
        "errors": _PATH_MSG, "quarantined": _PATHS, "quarantine_failed": _PATH_ERR, "ignored": _PATH_WHY,
        "exit_code": _EXIT,
    },
}

_ENTRY = {"type": "array", "items": {"type": "object", "required": ["path", "bytes", "mtime"],
                                     "properties": {"path": _STR, "bytes": _INT, "mtime": {"type": "number"}}}}
GC_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "kvformat gc --json",
    "type": "object",
    "required": ["command", "root", "max_bytes", "dry_run", "files_before", "bytes_before", "evict_files",
                 "evict_bytes", "bytes_after", "deleted", "freed_bytes", "temp_removed", "evicted",
                 "quarantine_purged", "failed", "ignored", "exit_code"],
    "properties": {
        "command": {"enum": ["gc"]}, "root": _STR, "max_bytes": {"type": ["integer", "null"]},
        "dry_run": {"type": "boolean"}, "files_before": _INT, "bytes_before": _INT, "evict_files": _INT,
        "evict_bytes": _INT, "bytes_after": _INT, "deleted": _INT, "freed_bytes": _INT, "temp_removed": _INT,
        "evicted": _ENTRY, "quarantine_purged": _ENTRY, "failed": _PATH_ERR, "ignored": _PATH_WHY,
        "exit_code": {"enum": [0, 2]},
    },
}

COMPACT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "kvformat compact --json",
    "type": "object",
    "required": ["command", "src", "dst", "dry_run", "jobs", "converted", "skipped", "failed", "ignored",
                 "bytes_before", "bytes_after", "bytes_saved", "bytes_read", "deleted_sources", "elapsed_s",
                 "throughput_bytes_per_s", "namespaces", "failures", "ignored_paths", "layout_errors",
                 "would_write", "exit_code"],
    "properties": {
        "command": {"enum": ["compact"]}, "src": _STR, "dst": _STR, "dry_run": {"type": "boolean"}, "jobs": _INT,
        "converted": _INT, "skipped": _INT, "failed": _INT, "ignored": _INT, "bytes_before": _INT,
        "bytes_after": _INT, "bytes_saved": _INT, "bytes_read": _INT, "deleted_sources": _INT,
        "elapsed_s": {"type": "number"}, "throughput_bytes_per_s": _INT,
        "namespaces": {"type": "array", "items": {
            "type": "object", "required": ["legacy", "group", "namespace", "model", "row", "slots", "page_bytes",
                                           "row_bytes", "padding", "files"]}},
        "failures": {"type": "array", "items": {"type": "object", "required": ["path", "reason", "error"],
                                                "properties": {"path": _STR, "reason": _STR, "error": _STR}}},
        "ignored_paths": _PATH_WHY, "layout_errors": _PATHS,
        "would_write": {"type": "array", "items": {"type": "object", "required": ["path", "src", "before", "after"],
                                                   "properties": {"path": _STR, "src": _STR, "before": _INT,
                                                                  "after": _INT}}},
        "exit_code": _EXIT,
    },
}

DEMO_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "kvformat demo --json",
    "type": "object",
    "required": ["command", "dir", "layers", "blocks", "ok", "converted", "bytes_before", "bytes_after",
                 "read_back_identical", "corruption_caught", "elapsed_s", "exit_code"],
    "properties": {
        "command": {"enum": ["demo"]}, "dir": {"type": ["string", "null"]}, "layers": _INT, "blocks": _INT,
        "ok": {"type": "boolean"}, "converted": _INT, "bytes_before": _INT, "bytes_after": _INT,
        "read_back_identical": {"type": "object", "required": ["1", "2"], "properties": {"1": _INT, "2": _INT}},
        "corruption_caught": {"type": "boolean"}, "elapsed_s": {"type": "number"}, "exit_code": {"enum": [0, 1]},
    },
}

SCHEMAS: dict[str, dict[str, Any]] = {"inspect": INSPECT_SCHEMA, "verify": VERIFY_SCHEMA, "compact": COMPACT_SCHEMA,
                                      "gc": GC_SCHEMA, "demo": DEMO_SCHEMA}

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value: Any, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[t])


def validate(value: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """Errors of ``value`` against ``schema`` (empty when it conforms)."""
    errs: list[str] = []
    if "anyOf" in schema:
        alts = [validate(value, s, where) for s in schema["anyOf"]]
        if all(alts):
            errs.append(f"{where}: matches no alternative ({'; '.join(a[0] for a in alts)})")
        return errs
    t = schema.get("type")
    if t is not None:
        types = t if isinstance(t, list) else [t]
        if not any(_is(value, x) for x in types):
            return [f"{where}: expected {t}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{where}: {value!r} not in {schema['enum']}")
    if isinstance(value, dict):
        for k in schema.get("required", []):
            if k not in value:
                errs.append(f"{where}: missing {k!r}")
        for k, sub in schema.get("properties", {}).items():
            if k in value:
                errs += validate(value[k], sub, f"{where}.{k}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            errs += validate(v, schema["items"], f"{where}[{i}]")
    return errs


def document() -> dict[str, Any]:
    """Every command's schema as one JSON Schema (draft 2020-12) document: ``$defs`` keyed by command name.

    This is what docs/schema/kvformat-cli.schema.json holds; ``python -m kvformat.cli._schema`` writes it, so the
    published schema is the one the tests check output against, never a hand copy.
    """
    defs = {name: {k: v for k, v in s.items() if k != "$schema"} for name, s in SCHEMAS.items()}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://kvformat.invalid/schema/kvformat-cli.schema.json",
        "title": "kvformat --json output",
        "description": "Generated by `python -m kvformat.cli._schema` from kvformat/cli/_schema.py; do not edit. "
                       "The document of `kvformat CMD --json` conforms to `#/$defs/CMD`.",
        "$defs": defs,
        "anyOf": [{"$ref": f"#/$defs/{name}"} for name in defs],
    }


def render() -> str:
    import json

    return json.dumps(document(), indent=1, sort_keys=False) + "\n"


def _main(argv: list[str]) -> int:
    import os

    path = argv[0] if argv else os.path.join("docs", "schema", "kvformat-cli.schema.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(render())
    print(path)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(_main(sys.argv[1:]))
