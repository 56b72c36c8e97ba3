"""Reusable test suites for kvformat components (needs pytest).

``kvformat.testing.store.StoreTests`` is the conformance suite of the :class:`~kvformat.storage.Store`
contract: subclass it, give it a ``store`` fixture (a fresh, empty store) and, for a backend other
than the two built in, the ``raw_*`` helpers that reach the storage without going through the store.
"""

from .store import StoreTests, raw_exists, raw_read, raw_write

__all__ = ["StoreTests", "raw_read", "raw_write", "raw_exists"]
