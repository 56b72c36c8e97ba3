"""Is the root usable, and is it still the root it was at start-up? (no engine import)

At start-up :meth:`RootHealth.startup` proves the root usable with a probe object (create, write, publish, read
back, delete, with the store's real paths and credentials) and fails with a :class:`RootUnusableError` naming the
parameter to fix, unless the operator chose to start degraded. While the cache runs, :meth:`RootHealth.check`
(called periodically, and at once after a store failed) compares the root with what it was: a local root whose
device or inode changed (its mount went away: the path now leads to the mount point on the disk underneath), or a
namespace file that is gone, stops the cache's stores and loads until it is back. A degraded root is probed again
on every check and used once the probe passes.
"""

from __future__ import annotations

import errno
import os
import threading

from ..errors import RootUnusableError
from ..format import NAMESPACE_FILE, CanonicalLayout
from ..storage import Store, probe_store
from ._log import CacheLog

__all__ = ["OK", "DEGRADED", "LOST", "RootHealth", "unusable_root"]

OK, DEGRADED, LOST = "ok", "degraded", "lost"


def unusable_root(root: str, remote: bool, step: str, e: BaseException) -> RootUnusableError:
    """The error for a root whose probe failed at ``step`` with ``e``, blaming the parameter an operator must fix."""
    cause = f"{type(e).__name__}: {e}"
    if not remote:
        eno = getattr(e, "errno", None)
        if isinstance(e, (FileExistsError, NotADirectoryError)) or eno in (errno.EEXIST, errno.ENOTDIR):
            msg = f"{root} is not a directory (a regular file, or a path through one)"
        elif eno == errno.EROFS:
            msg = f"{root} is on a read-only filesystem"
        elif eno in (errno.EACCES, errno.EPERM):
            msg = f"no permission to create files under {root}"
        elif eno in (errno.ENOSPC, errno.EDQUOT):
            msg = f"the filesystem of {root} is full (or the quota is reached)"
        else:
            msg = f"{root} cannot be used"
        return RootUnusableError("root", f"{msg} (start-up probe: {step} failed: {cause})", step=step, cause=e)
    if isinstance(e, FileNotFoundError):
        return RootUnusableError("root", f"{root}: the bucket (or container) does not exist (start-up probe: {step} "
                                 f"failed: {cause})", step=step, cause=e)
    if isinstance(e, PermissionError):
        return RootUnusableError("storage_options", f"access to {root} was denied with these credentials (the "
                                 "key/secret/token in storage_options, or the environment's: AWS_ACCESS_KEY_ID …); "
                                 f"start-up probe: {step} failed: {cause}", step=step, cause=e)
    if isinstance(e, (ConnectionError, TimeoutError)):
        return RootUnusableError("storage_options.endpoint_url", f"the storage endpoint of {root} cannot be reached "
                                 "(storage_options.endpoint_url, or the environment's AWS_ENDPOINT_URL; a timeout is "
                                 f"storage_options.timeout_s); start-up probe: {step} failed: {cause}",
                                 step=step, cause=e)
    return RootUnusableError("root", f"{root} cannot be used (start-up probe: {step} failed: {cause})", step=step,
                             cause=e)


class RootHealth:
    """The root's state for the cache: ``OK`` (stores and loads run), ``DEGRADED`` (unusable since start-up, and
    started anyway: stores fail, loads miss, probed again on each check), ``LOST`` (no longer the root it was at
    start-up: the same until it is back). Thread-safe."""

    def __init__(self, store: Store, root: str, log: CacheLog, *, start_degraded: bool = False) -> None:
        self.store = store
        self.root = root
        self.remote = not store.is_local
        self.log = log
        self.start_degraded = start_degraded
        self.state = OK
        self.reason = ""
        self._identity: tuple[int, ...] | None = None
        self._layouts: list[CanonicalLayout] = []
        self._lock = threading.Lock()
        self.wake = threading.Event()  # set by a failed store: check now, not at the next tick

    @property
    def usable(self) -> bool:
        return self.state == OK

    def startup(self, layouts: list[CanonicalLayout]) -> None:
        """Probe the root and write each layout's namespace file; raise RootUnusableError (or, with
        ``start_degraded``, log it as an error and start DEGRADED)."""
        self._layouts = list(layouts)
        err = self._probe()
        if err is None:
            return
        if not self.start_degraded:
            raise err
        self.state, self.reason = DEGRADED, str(err)
        self.log.error("starting DEGRADED (start_degraded is set): %s. Nothing is stored or loaded until the "
                       "root works; it is probed again every few seconds", err)

    def _probe(self) -> RootUnusableError | None:
        failed = probe_store(self.store)
        if failed is None:
            try:
                for layout in self._layouts:
                    self.store.ensure_namespace(layout)
                self._identity = self.store.root_identity()
            except OSError as e:
                failed = ("namespace file", e)
        return None if failed is None else unusable_root(self.root, self.remote, failed[0], failed[1])

    def check(self) -> bool:
        """Re-examine the root; log each change of state once. True when it is usable now."""
        with self._lock:
            if self.state == DEGRADED:
                if self._probe() is None:
                    self.state, self.reason = OK, ""
                    self.log.warning("the root is usable now: stores and loads resume")
                return self.state == OK
            why = self._changed()
            if why is None:
                if self.state == LOST:
                    self.state, self.reason = OK, ""
                    self.log.warning("%s is the root it was at start-up again: stores and loads resume", self.root)
                return True
            if self.state != LOST:
                self.state, self.reason = LOST, why
                self.log.error("%s is no longer the root it was at start-up (%s): stores stopped and loads are "
                               "misses until it is back (nothing is written to the disk under the mount point); "
                               "kvformat_root_healthy is 0", self.root, why)
            return False

    def _changed(self) -> str | None:
        """Why the root is not the start-up root any more, or None. Only what is known counts: a root that cannot
        be examined now (an endpoint down, a timeout) is not called lost; its stores fail on their own and are
        counted by reason."""
        try:
            ident = self.store.root_identity()
        except FileNotFoundError:
            return f"the root directory {self.root} is gone"
        except OSError:
            return None
        if ident != self._identity:
            was = self._identity or ()
            now = ident or ()
            return (f"it is another directory now: device {_dev(was)} inode {was[1] if len(was) > 1 else '?'} at "
                    f"start-up, device {_dev(now)} inode {now[1] if len(now) > 1 else '?'} now (a mount that went "
                    "away?)")
        for layout in self._layouts:
            rel = f"{layout.namespace()}/{NAMESPACE_FILE}"
            try:
                self._read(rel)
            except FileNotFoundError:
                return f"{rel} is gone"
            except OSError:
                return None
        return None

    def _read(self, rel: str) -> None:
        path = self.store.local_path(rel)
        if path is not None:
            os.stat(path)
        else:
            self.store.read_bytes(rel)  # a fresh request: the store's existence cache would not notice a change


def _dev(ident: tuple[int, ...]) -> str:
    if not ident:
        return "?"
    return f"{os.major(ident[0])}:{os.minor(ident[0])}"
