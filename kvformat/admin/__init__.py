"""Maintenance of a root: the inspect/verify walk (local and remote) and garbage collection.

``_classify`` (what a local path given to inspect or verify is), ``_scan`` (the walk of a local root),
``_scan_store`` (the batched walk of any store), ``_scan_stats`` (result types, the progress protocol), ``_gc`` (gc
of a root to a size bound).
"""

from ._classify import PathTarget, classify_path
from ._gc import open_gc_root, plan_gc, run_gc
from ._scan import (
    check_block_file, find_store_root, namespace_dirs, not_a_root, orphan_namespaces, os_error_text,
    quarantine_summary, scan_root,
)
from ._scan_stats import NamespaceStats, ProgressSink, ScanResult, totals
from ._scan_store import placed, scan_store

__all__ = [
    "scan_root", "scan_store", "quarantine_summary", "not_a_root", "orphan_namespaces", "find_store_root",
    "namespace_dirs", "classify_path", "PathTarget", "NamespaceStats", "ScanResult", "ProgressSink", "totals",
    "run_gc", "plan_gc", "open_gc_root",
]

# Used by other kvformat packages, which import this face, never its private modules (issue 44).
__all__ += ["check_block_file", "os_error_text", "placed"]
