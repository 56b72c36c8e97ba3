"""vLLM's built-in fs-tier trees (headerless rows, one slot per worker or one shared slot) and their
compaction into kvformat files.

``_tree`` (the tree's naming, its untrusted config.json, discovery), ``_rows`` (the row layout of one
file: TP, PP and DCP rows, replica checks), ``_convert`` (one legacy file -> one kvformat file),
``_compact`` (the whole-tree job and its report).
"""

from ._compact import CompactReport, check_destination, compact, output_header_bytes
from ._rows import (
    ROW_ALIGN, Ignored, LegacyFile, LegacyNamespace, RowLayout, extract_payload, find_namespaces, infer_row,
    is_legacy_root, iter_legacy_files, key_for, legacy_fields, legacy_paths, write_legacy_row,
)

__all__ = [
    "ROW_ALIGN", "LegacyNamespace", "LegacyFile", "RowLayout", "Ignored", "find_namespaces", "is_legacy_root",
    "iter_legacy_files", "infer_row", "extract_payload", "legacy_fields", "legacy_paths", "write_legacy_row",
    "compact", "check_destination", "CompactReport",
]

# Used by other kvformat packages, which import this face, never its private modules (issue 44).
__all__ += ["key_for", "output_header_bytes"]
