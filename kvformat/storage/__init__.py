"""Where kvformat files live: one small interface, a backend per kind of storage.

``open_store("/path")`` gives a :class:`LocalStore` (O_DIRECT, zero-copy reads); URLs
(``s3://``, ``memory://``, ``gs://`` …) give an fsspec-backed store.

Modules: ``_base`` (``Store``: the shared public methods and the backend primitives they need),
``_local`` (local files), ``_fsspec`` (the generic remote store), ``_batch`` (the remote batch runner:
deadlines, retries, error translation), ``_redact`` (credentials out of reprs, logs, errors), ``_s3``
(S3-only calls), ``_exists`` (the remote existence cache), ``_root`` (``split_root``: a local path or a
URL). The conformance suite every backend passes is ``kvformat.testing.StoreTests``.
"""

from typing import TYPE_CHECKING, Any

from ._base import REPLACED, Quarantined, Store, StoreEntry
from ._local import LocalStore, scan_entries
from ._options import check_storage_options
from ._probe import ReadSpeed, measure_read, probe_store
from ._root import join_root, split_root
from ._safepath import MOVED, open_in, unlink_in

if TYPE_CHECKING:  # imported on first use: fsspec is needed only for URL roots
    from ._fsspec import FsspecStore


def open_store(root: str, **storage_options: Any) -> Store:
    """A store for a plain path, ``file://`` URL, or any fsspec URL.

    Parameters
    ----------
    root: a directory path or URL.
    storage_options: passed to the backend (fsspec ``storage_options`` for URLs).

    Raises
    ------
    ImportError naming the package to install when a URL's fsspec backend is missing.
    """
    scheme, path = split_root(root)
    if not scheme:
        return LocalStore(path, **storage_options)
    from ._fsspec import FsspecStore

    return FsspecStore(root, **storage_options)


__all__ = ["Store", "StoreEntry", "Quarantined", "LocalStore", "open_store", "split_root", "join_root"]

# Used by other kvformat packages, which import this face, never its private modules (issue 44).
__all__ += [
    "MOVED", "REPLACED", "FsspecStore", "ReadSpeed", "check_storage_options", "measure_read", "open_in", "probe_store",
    "scan_entries", "unlink_in",
]


def __getattr__(name: str) -> Any:
    if name == "FsspecStore":
        from ._fsspec import FsspecStore

        return FsspecStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
