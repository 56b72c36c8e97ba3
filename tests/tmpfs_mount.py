"""A tmpfs mounted for one test (root only): the operator, disk-full, shared-root, health and SGLang tests need a
filesystem they can fill, make read-only or unmount under a running cache."""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest


@contextmanager
def tmpfs(path: Path, opts: str, why: str = "") -> Iterator[str]:
    """Mount a tmpfs with mount options ``opts`` at ``path`` (created) and unmount it (lazily) afterwards; where
    mounting is impossible the test skips, saying why (``why`` adds what the skip costs)."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()[:200]}){why}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
