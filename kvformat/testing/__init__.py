"""Reusable test suites and harnesses for kvformat components.

``kvformat.testing.store.StoreTests`` is the conformance suite of the :class:`~kvformat.storage.Store`
contract (needs pytest): subclass it, give it a ``store`` fixture (a fresh, empty store) and, for a
backend other than the two built in, the ``raw_*`` helpers that reach the storage without going
through the store. ``kvformat.testing.ranks`` runs a function as N "TP rank" processes (no pytest).
The suite's names are imported on first use, so the rank harness never imports pytest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .store import StoreTests, raw_exists, raw_read, raw_write

__all__ = ["StoreTests", "raw_read", "raw_write", "raw_exists"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
