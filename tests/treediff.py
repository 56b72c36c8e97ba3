"""What changed between two snapshots of a file tree ({name: bytes}), by name: an assertion on whole snapshots
prints kilobytes of random bytes and leaves out which file it was (a CI failure once showed only that)."""

from __future__ import annotations

import os
from typing import Any, Mapping


def changes(before: Mapping[Any, bytes], after: Mapping[Any, bytes]) -> dict[str, list[str]]:
    """Names gone, added and changed (empty lists dropped): ``assert not changes(a, b), changes(a, b)``."""
    out = {"gone": sorted(str(k) for k in before if k not in after),
           "added": sorted(str(k) for k in after if k not in before),
           "changed": sorted(f"{k} ({len(before[k])} -> {len(after[k])} bytes)" for k in before
                             if k in after and after[k] != before[k])}
    return {k: v for k, v in out.items() if v}


def snapshot(root: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every file under ``root`` (symlinked directories not followed), by path relative to it: its bytes."""
    out = {}
    for dp, _d, fn in os.walk(root):
        for f in fn:
            p = os.path.join(dp, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out
