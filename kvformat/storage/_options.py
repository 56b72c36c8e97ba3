"""Checking ``storage_options`` before a store is built: every key known (to the store or to the protocol's
fsspec backend), the store's own values of the right type and range, each problem named as
``storage_options.<key>``."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from ..errors import SchemaError

__all__ = ["STORE_OPTIONS", "check_storage_options"]

# The store's own options (FsspecStore's keywords): (what, lowest allowed, None allowed).
STORE_OPTIONS: dict[str, tuple[str, float, bool]] = {
    "timeout_s": ("number", 0.0, False),
    "max_retries": ("int", 0, False),
    "max_in_flight": ("int", 1, False),
    "exists_cache_s": ("number", 0.0, False),
    "missing_cache_s": ("number", 0.0, False),
    "list_timeout_s": ("number", 0.0, False),
    "connect_timeout_s": ("number", 0.0, False),
    "read_timeout_s": ("number", 0.0, True),
    "atomic_put": ("bool", 0, True),
}
# Keywords every fsspec filesystem takes (AbstractFileSystem / AsyncFileSystem), beyond a backend's own.
_FSSPEC_COMMON = ("use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache", "asynchronous",
                  "loop", "batch_size")
_STRICT_ZERO = ("timeout_s", "list_timeout_s", "connect_timeout_s", "read_timeout_s")


def _check_value(key: str, value: Any) -> None:
    kind, lo, none_ok = STORE_OPTIONS[key]
    if value is None and none_ok:
        return
    if kind == "bool":
        if not isinstance(value, bool):
            raise SchemaError(f"storage_options.{key}", f"expected true, false or null, got {value!r}")
        return
    ok_type = isinstance(value, int) if kind == "int" else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        raise SchemaError(f"storage_options.{key}", f"expected {'an integer' if kind == 'int' else 'a number'}"
                          f"{' or null' if none_ok else ''}, got {value!r}")
    if value < lo or (key in _STRICT_ZERO and value <= 0):
        bound = "> 0" if key in _STRICT_ZERO else f">= {lo}"
        raise SchemaError(f"storage_options.{key}", f"expected a value {bound}, got {value!r}")


def _backend_keywords(protocol: str) -> set[str] | None:
    """The keywords the protocol's fsspec class names (its own and its bases'); None when it cannot say (no
    such backend installed, or one that takes anything)."""
    try:
        import fsspec

        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError):
        return None  # open_store reports a missing backend by name
    names: set[str] = set(_FSSPEC_COMMON)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                names.add(p.name)
    # A backend that names nothing of its own takes anything (its options go to another library).
    return names if len(names) > len(_FSSPEC_COMMON) else None


def check_storage_options(root: str, options: Mapping[str, Any]) -> None:
    """Raise SchemaError naming ``storage_options.<key>`` for a key neither the store nor the root's fsspec
    backend knows (with the closest known key), or a store option of the wrong type or range."""
    if not isinstance(options, Mapping):
        raise SchemaError("storage_options", f"expected a dict, got {type(options).__name__}")
    for key in options:
        if not isinstance(key, str):
            raise SchemaError("storage_options", f"expected string keys, got {key!r}")
    if "://" not in root or root.startswith("file://"):
        return  # a local root takes no storage options (the tier ignores them, and says so)
    for key, value in options.items():
        if key in STORE_OPTIONS:
            _check_value(key, value)
    known = _backend_keywords(root.split("://", 1)[0].lower())
    if known is None:
        return
    known |= set(STORE_OPTIONS)
    for key in options:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise SchemaError(f"storage_options.{key}", f"not an option of the store or of the "
                              f"{root.split('://', 1)[0]}:// backend{hint}")
