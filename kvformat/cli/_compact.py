"""Rendering of ``kvformat compact``: the human summary of a :class:`kvformat.compact.CompactReport`."""

from __future__ import annotations

from collections.abc import Iterable

from ..legacy import CompactReport
from ._util import human, shown


def summary_lines(rep: CompactReport) -> Iterable[str]:
    """The human summary printed at the end."""
    if rep.dry_run:
        for f in rep.would_write:
            yield f"would write {shown(f.rel)}  ({human(f.before)} -> {human(f.after)})"
    for ns in rep.namespaces:
        yield (f"{shown(ns['legacy'])} g{ns['group']} -> {shown(ns['namespace'])}: {ns['files']} files, "
               f"{ns['row']} rows of "
               f"{ns['slots']} slot(s), page {ns['page_bytes']} B, padding {ns['padding']} B")
    for e in rep.layout_errors:
        yield f"error: {shown(e)}"
    saved = rep.bytes_before - rep.bytes_after
    pct = 100.0 * saved / rep.bytes_before if rep.bytes_before else 0.0
    verb = "would convert" if rep.dry_run else "converted"
    yield (f"{verb} {len(rep.would_write) if rep.dry_run else rep.converted}, skipped {rep.skipped}, "
           f"failed {rep.failed}, ignored {len(rep.ignored)}")
    yield f"bytes before {human(rep.bytes_before)}, after {human(rep.bytes_after)}, saved {human(saved)} ({pct:.1f}%)"
    if not rep.dry_run:
        rate = rep.bytes_read / rep.elapsed_s if rep.elapsed_s > 0 else 0.0
        yield f"read {human(rep.bytes_read)} in {rep.elapsed_s:.2f} s ({human(rate)}/s), jobs {rep.jobs}"
        if rep.deleted_sources:
            yield f"deleted {rep.deleted_sources} source files (outputs verified first)"
