"""Deletes and moves that cannot leave a root.

Every path is resolved from a descriptor of the root, one component at a time, with ``O_NOFOLLOW |
O_DIRECTORY``: a directory that is (or has just become) a symlink stops the walk with
:class:`~kvformat.errors.PathEscapeError` instead of leading it outside the root. The last step
(``unlink``/``rename``) runs against the parent's descriptor, so a swap of any directory above it after the
walk changes nothing. With ``expect`` (device, inode of what was listed or checked) a file that is not that
one is left alone.
"""

from __future__ import annotations

import errno
import os
import stat

from ..errors import PathEscapeError

__all__ = ["GONE", "MOVED", "REPLACED", "split_rel", "unlink_in", "rename_in", "link_in", "open_in"]

GONE, MOVED, REPLACED = "gone", "moved", "replaced"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def split_rel(rel: str) -> list[str]:
    """The components of a relative path under a root; PathEscapeError for any other shape."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise PathEscapeError(rel, "not a relative path of plain components (no '..', '.', empty or absolute)")
    return parts


def _open_parent(root: str, parts: list[str], rel: str, create: bool = False) -> int:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))  # the root itself: the operator's
    try:
        for part in parts[:-1]:
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = _open_step(part, fd, rel)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise PathEscapeError(rel, f"component {part!r} is a symlink or not a directory") from None
                raise
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_step(part: str, fd: int, rel: str) -> int:
    try:
        return os.open(part, _DIR_FLAGS, dir_fd=fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PathEscapeError(rel, f"component {part!r} is a symlink or not a directory") from None
        raise


def _same(st: os.stat_result, expect: tuple[int, int] | None) -> bool:
    return expect is None or (st.st_dev, st.st_ino) == expect


def unlink_in(root: str, rel: str, expect: tuple[int, int] | None = None) -> str:
    """Remove ``rel`` under ``root`` (a symlink there is removed itself, never its target).

    Returns GONE (nothing there), REPLACED (not the ``expect`` file: kept) or MOVED (removed). Raises
    PathEscapeError when the path would leave the root; OSError passes through.
    """
    parts = split_rel(rel)
    try:
        fd = _open_parent(root, parts, rel)
    except FileNotFoundError:
        return GONE
    try:
        try:
            st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return GONE
        if stat.S_ISDIR(st.st_mode):
            raise PathEscapeError(rel, "a directory, not a file")
        if not _same(st, expect):
            return REPLACED
        try:
            os.unlink(parts[-1], dir_fd=fd)
        except FileNotFoundError:
            return GONE
        return MOVED
    finally:
        os.close(fd)


def rename_in(root: str, src: str, dst: str, expect: tuple[int, int] | None = None) -> str:
    """Move ``src`` to ``dst``, both under ``root`` (``dst``'s directories are made, never through a symlink).

    Returns GONE, REPLACED (not the ``expect`` file: nothing moved) or MOVED. A file published at ``src``
    between the check and the rename may be moved in its place: that race stays inside the root.
    """
    sp, dp = split_rel(src), split_rel(dst)
    try:
        sfd = _open_parent(root, sp, src)
    except FileNotFoundError:
        return GONE
    try:
        try:
            st = os.stat(sp[-1], dir_fd=sfd, follow_symlinks=False)
        except FileNotFoundError:
            return GONE
        if not _same(st, expect):
            return REPLACED
        dfd = _open_parent(root, dp, dst, create=True)
        try:
            try:
                os.rename(sp[-1], dp[-1], src_dir_fd=sfd, dst_dir_fd=dfd)
            except FileNotFoundError:
                return GONE
            return MOVED
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def link_in(root: str, src: str, dst: str) -> None:
    """Hard-link ``src`` to the new name ``dst``, both under ``root`` (FileExistsError if ``dst`` is taken)."""
    sp, dp = split_rel(src), split_rel(dst)
    sfd = _open_parent(root, sp, src)
    try:
        dfd = _open_parent(root, dp, dst)
        try:
            os.link(sp[-1], dp[-1], src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def open_in(root: str, rel: str, flags: int = os.O_RDONLY) -> int:
    """A descriptor of the file ``rel`` under ``root``, no symlink followed on the way nor at the end."""
    parts = split_rel(rel)
    fd = _open_parent(root, parts, rel)
    try:
        return os.open(parts[-1], flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PathEscapeError(rel, "the file is a symlink") from None
        raise
    finally:
        os.close(fd)
