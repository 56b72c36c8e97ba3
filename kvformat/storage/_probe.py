"""Prove a root usable before a tier relies on it: the write path a store takes, done once with a small object."""

from __future__ import annotations

import os
import secrets

from ..format._paths import CONTROL_DIR
from ..format._write import host_tag
from ._base import Store

__all__ = ["PROBE_DIR", "probe_store"]

PROBE_DIR = f"{CONTROL_DIR}/probe"


def probe_store(store: Store) -> tuple[str, BaseException] | None:
    """Create, write, publish (rename or conditional PUT), read back and delete one probe object under
    ``.kvformat/probe/``, with the store's own credentials and paths.

    Returns None when every step worked, else ``(step, error)`` for the first one that did not: ``"write"``
    (create + write + publish: one call on every backend), ``"read back"``, ``"compare"`` (the bytes read
    differ: a ValueError), ``"delete"``. Storage errors are returned, never raised.
    """
    rel = f"{PROBE_DIR}/{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"
    body = f"kvformat probe {secrets.token_hex(16)}\n".encode()
    try:
        store.put(rel, [body], overwrite=False)
    except (OSError, ValueError) as e:
        return "write", e
    try:
        got = store.read_bytes(rel)
    except (OSError, ValueError) as e:
        return "read back", e
    if got != body:
        return "compare", ValueError(f"read back {len(got)} bytes that differ from the {len(body)} written")
    try:
        store.delete(rel)
    except (OSError, ValueError) as e:
        return "delete", e
    return None
