"""Prove a root usable before a tier relies on it: the write path a store takes, done once with a small object."""

from __future__ import annotations

import os
import secrets

from ..format import CONTROL_DIR, host_tag
from ._base import Store

__all__ = ["PROBE_DIR", "PROBE_TIMEOUT_S", "probe_store"]

PROBE_DIR = f"{CONTROL_DIR}/probe"
PROBE_TIMEOUT_S = 30.0


def probe_store(store: Store, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[str, BaseException] | None:
    """Create, write, publish (rename or conditional PUT), read back and delete one probe object under
    ``.kvformat/probe/``, with the store's own credentials and paths.

    Returns None when every step worked, else ``(step, error)`` for the first one that did not: ``"write"``
    (create + write + publish: one call on every backend), ``"read back"``, ``"compare"`` (the bytes read
    differ: a ValueError), ``"delete"``. Storage errors are returned, never raised. Each remote step may take up
    to ``timeout_s`` (more patient than a store's per-call deadline: a slow start is not a broken root; a refused
    connection or a denied request still fails at once).
    """
    rel = f"{PROBE_DIR}/{host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"
    body = f"kvformat probe {secrets.token_hex(16)}\n".encode()
    deadline = max(timeout_s, float(getattr(store, "timeout_s", 0.0)))
    try:
        r = store.put_many([(rel, [body])], overwrite=False, timeout_s=deadline)[0]
        if isinstance(r, BaseException):
            raise r
    except (OSError, ValueError) as e:
        return "write", e
    try:
        many = getattr(store, "read_many_bytes", None)
        got: object = many([rel], timeout_s=deadline)[0] if many is not None else store.read_bytes(rel)
        if isinstance(got, BaseException):
            raise got
    except (OSError, ValueError) as e:
        return "read back", e
    if got != body:
        return "compare", ValueError(f"read back {len(got) if isinstance(got, bytes) else '?'} bytes that differ "
                                     f"from the {len(body)} written")
    try:
        d = store.delete_many([rel], timeout_s=deadline)[0]
        if isinstance(d, BaseException):
            raise d
    except (OSError, ValueError) as e:
        return "delete", e
    return None
