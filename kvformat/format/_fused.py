"""The fused tier paths (kvformat.format._native): one read / one write per file, the payload hashed in the
same pass. With the C extension each payload piece is hashed while it is still in cache (no second trip
through DRAM) and the GIL is released for the whole read or write; without it the same syscalls run from
Python (one preadv / one pwritev) and python-xxhash hashes the payload. The tier calls these two.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from typing import Any, Callable

from ._block import as_bytes_view, check_expected, invalidate, unseal_into
from ._header import _hxxh3_pos, decode_header
from . import _native
from ._seal import Keyring
from ._read import _O_DIRECT, FileId, _open_regular, _open_regular_stat
from ._consts import ALIGNMENT, MAX_HEADER_BYTES
from ._spec import BlockHeader, BlockKey, CanonicalLayout
from ._template import HeaderTemplates
from ._write import TempFile, publish, temp_name
from ..errors import ChecksumError, KVFormatError, ReplicaMismatchError, TruncatedError

_DXXH3_FIELD = b'"kvf.dxxh3":"'


def read_into_fused(path: str | os.PathLike[str], out: Any, *, expect: CanonicalLayout | None = None,
                    key: BlockKey | None = None, verify: bool = True, o_direct: bool = False,
                    keys: Keyring | None = None, templates: HeaderTemplates | None = None) -> BlockHeader:
    """:func:`read_into` with header and payload in ONE read and the payload hashed as it lands.

    The header region's size is guessed as (file size - payload size), exact for every uncompressed
    file of ``expect``'s layout. Unlike :func:`read_into`, ``out`` is written before the header is
    checked: on any failure once the read has started (a kvformat error, or an OSError such as EIO
    part-way through) it is zero-filled (never left holding the file's bytes), so it suits a caller for
    which any failure is a miss (the tier), not one that needs ``out`` untouched on a layout mismatch.
    A destination smaller than the payload of a file that is what ``expect`` says raises
    ``DestinationError`` (the file is not at fault), as :func:`read_into` does. Anything the guess does
    not fit (compressed files, other layouts) takes :func:`read_into`. ``o_direct``: the same one read
    through an O_DIRECT descriptor when ``out`` is page-aligned and the payload a whole number of pages
    (else, or where the filesystem refuses it, buffered). A sealed file (``keys``) is authenticated, and
    decrypted, in ``out`` after the one read. ``templates`` (of ``expect``'s layout, with ``key`` given): a
    header equal to one already checked outside its per-file fields is checked by comparison instead of
    parsed (spec §11.1), and a header parsed and checked here becomes a template. Raises what
    :func:`read_into` raises; every kvformat error carries the ``file_id`` of the file read.
    """
    try:
        return _read_fused(os.fspath(path), out, expect, key, verify, o_direct, keys, templates, whole_ok=True)
    except _NoIdentity:
        # The one-call native read keeps no descriptor, so its error cannot say which file it read. Read
        # again through a descriptor (rare: only bad files get here): the error raised then names the file
        # it read, and a file replaced by a good one since is served.
        return _read_fused(os.fspath(path), out, expect, key, verify, o_direct, keys, templates, whole_ok=False)


class _NoIdentity(Exception):
    """A kvformat error of the native one-call read, which has no fstat of the file it read."""


def _read_fused(p: str, out: Any, expect: CanonicalLayout | None, key: BlockKey | None, verify: bool,
                o_direct: bool, keys: Keyring | None, templates: HeaderTemplates | None, *,
                whole_ok: bool) -> BlockHeader:
    dst = as_bytes_view(out, writable=True)
    raw = expect.payload_bytes if expect is not None else len(dst)
    direct = o_direct and _O_DIRECT and raw % ALIGNMENT == 0 and raw <= len(dst) and _addr(dst) % ALIGNMENT == 0
    size, fd = -1, -1
    st: os.stat_result | None = None
    whole = whole_ok and not direct and raw <= len(dst) and _native.read_file_hash is not None
    head: Any
    if direct:
        fd = _open_direct(p)
    elif not whole:
        fd, st = _open_regular_stat(p)  # the regular-file check's fstat gives the size too
        size = st.st_size
    # Set before any read, not after it returns: a read that fails part-way (EIO on a later piece) has
    # already put unverified file bytes into the destination, and they must not stay there (F-5.5).
    touched = True
    try:
        got = _read_whole(p, dst[:raw], verify) if whole else None
        if got is not None:  # open, fstat, read + hash and close in one GIL-free native call
            size, head, hgot, dgot, digest = got
            guess = size - raw
        else:
            whole = False
            if fd < 0:
                fd, st = _open_regular_stat(p)
                size = st.st_size
            if st is None:
                st = os.fstat(fd)
                size = st.st_size
            guess = size - raw
            if raw > len(dst) or guess < ALIGNMENT or guess % ALIGNMENT or guess > MAX_HEADER_BYTES + ALIGNMENT:
                touched = False
                return _general_read(p, out, expect, key, verify, o_direct, keys)
            head = _head_buffer(guess) if direct else bytearray(guess)
            body = dst[:raw]
            try:
                hgot, dgot, digest = _native.pread_hash(fd, head, body, 0, hash=verify)
            except OSError as e:
                if not direct or e.errno != errno.EINVAL:
                    raise
                os.close(fd)  # O_DIRECT refused at read time (some FUSE filesystems): the same read, buffered
                fd = -1
                fd, st = _open_regular_stat(p)
                direct = False
                head = bytearray(guess)
                hgot, dgot, digest = _native.pread_hash(fd, head, body, 0, hash=verify)
        body = dst[:raw]
        hdr = _checked_header(head, hgot, dgot, digest, size, guess, raw, body, expect, key, verify, keys,
                              templates)
        if hdr is None:
            invalidate(body)
            touched = False
            return _general_read(p, out, expect, key, verify, o_direct, keys)
        return hdr
    except KVFormatError as e:
        if touched:
            invalidate(dst[:raw])  # F-5.5: wrong bytes never stay in the destination
        if e.file_id is None:  # the file this descriptor read, for a quarantine (FileId)
            if st is None:
                raise _NoIdentity() from None
            e.file_id = FileId.of_stat(st)
        raise e.with_path(p) from None  # the same error, now naming its file
    except BaseException:
        if touched:
            invalidate(dst[:raw])  # F-5.5: an OSError part-way through the read too
        raise
    finally:
        if fd >= 0:
            os.close(fd)


def _checked_header(head: Any, hgot: int, dgot: int, digest: int | None, size: int, guess: int, raw: int, body: Any,
                    expect: CanonicalLayout | None, key: BlockKey | None, verify: bool, keys: Keyring | None,
                    templates: HeaderTemplates | None) -> BlockHeader | None:
    """The header read with the payload ``body``, checked (and unsealed into ``body``); None when the file does
    not fit the fused read (a codec, another header size, another payload size): read it the general way."""
    # Sealed headers differ per file (nonce, tag): never templates (the tier passes none for them).
    usable = templates is not None and key is not None and expect is templates.layout
    hdr = templates.match(memoryview(head)[:hgot], size, key, verify) if usable else None  # type: ignore[union-attr,arg-type]
    learn = usable and hdr is None
    if hdr is None:
        hdr = decode_header(memoryview(head)[:hgot], file_bytes=size, verify=verify)
        check_expected(hdr, expect, key)
    if hdr.codec != "none" or hdr.data_offset != guess or hdr.raw_bytes != raw:
        return None
    if dgot != hdr.data_bytes:  # the file shrank under us
        raise TruncatedError("data", hdr.data_bytes, dgot)
    if verify:
        actual = f"{digest:016x}"
        if actual != hdr.data_xxh3:
            raise ChecksumError("data", hdr.data_xxh3, actual)  # F-5.2
    if hdr.seal is not None:  # after F-5.2: a damaged file is a checksum failure, a forged one fails here
        unseal_into(hdr, memoryview(head)[:hdr.data_offset], body, keys)  # F-12.5, F-12.6
    elif learn:
        templates.learn(bytes(memoryview(head)[:hgot]), hdr)  # type: ignore[union-attr]
    return hdr


def _general_read(p: str, out: Any, expect: CanonicalLayout | None, key: BlockKey | None, verify: bool,
                  o_direct: bool, keys: Keyring | None) -> BlockHeader:
    """:func:`read_into`, for the files the guess does not fit (compressed, other layouts): imported here, off the
    fused path (``_io`` imports this module)."""
    from . import _io

    return _io.read_into(p, out, expect=expect, key=key, verify=verify, o_direct=o_direct, keys=keys)


def _read_whole(p: str, body: memoryview, verify: bool) -> tuple[int, memoryview, int, int, int | None] | None:
    """The native one-call read into a per-thread header buffer: (file size, header buffer, header bytes read,
    payload bytes read, payload xxh3). None when the size does not fit the guess (the caller's general path);
    what is not a regular file raises as :func:`_open_regular` does."""
    buf = _HEADS.__dict__.get("whole")
    for _ in range(2):
        if buf is None:
            buf = _HEADS.whole = bytearray(1 << 16)
        status, size, hgot, dgot, digest = _native.read_file_hash(p, buf, body, hash=verify,
                                                                  max_head=MAX_HEADER_BYTES + ALIGNMENT,
                                                                  align=ALIGNMENT)
        if status == 0:
            return size, memoryview(buf), hgot, dgot, digest
        if status == 1:
            os.close(_open_regular(p))  # raises what it raises for a directory or a FIFO; replaced since: retry
            return None
        if status == 2:
            return None
        buf = _HEADS.whole = bytearray(size - len(body))  # status 3: a larger header region than seen so far
    return None


_HEADS = threading.local()  # per-thread page-aligned header buffers for O_DIRECT reads (no mmap per read)


def _head_buffer(n: int) -> memoryview:
    bufs = _HEADS.__dict__.setdefault("bufs", {})
    if n not in bufs:
        import mmap

        bufs[n] = memoryview(mmap.mmap(-1, n))  # anonymous mappings are page-aligned
    buf: memoryview = bufs[n]
    return buf


def _addr(mv: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mv)) if len(mv) else 0


def _open_direct(p: str) -> int:
    """:func:`_open_regular` with O_DIRECT; a filesystem that refuses O_DIRECT at open gets the plain open."""
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0) | _O_DIRECT)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return _open_regular(p)
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return _open_regular(p)  # it raises the right error for a directory or a FIFO
    return fd


def _addr_ro(mv: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if len(mv) else 0


def _open_new(tmp: str, flags: int, direct: bool) -> int:
    if direct:
        try:
            return os.open(tmp, flags | _O_DIRECT, 0o644)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return os.open(tmp, flags, 0o644)


def write_block_fused(path: str, header: bytes, payload: Any, *, fsync: bool = False,
                      overwrite: bool = True, o_direct: bool = False,
                      make_parent: Callable[[], None] | None = None,
                      others: tuple[Any, int, int] | None = None) -> tuple[bool, str]:
    """Write one uncompressed kvformat file atomically, hashing the payload in the same pass.

    ``header`` is the header region as :func:`encode_block` makes it with ``payload_xxh3=0``: its
    ``kvf.dxxh3`` digits are patched with the payload's xxh3 (and ``kvf.hxxh3`` recomputed) in the
    write itself, so the payload is read once. Publishing is :func:`write_atomic`'s (temp file, then
    rename or, with ``overwrite=False``, link: first writer wins); the parent directory is created only
    when the temp file cannot be (it exists on every write but the first of a directory), by
    ``make_parent`` where given (a tier that must not re-create its root under a lost mount), else
    ``os.makedirs``.

    ``o_direct``: write through an O_DIRECT descriptor (the page cache is bypassed, as the built-in
    vLLM tier does) when the payload is page-aligned and a whole number of pages; buffered otherwise or
    where the filesystem refuses it.

    ``others``: ``(buffer, count, stride)``, count more copies of the payload that must be byte-identical
    to it (the worker slots of a per-worker row); each piece is compared with them while it is in cache,
    and ``ReplicaMismatchError`` (without digests) is raised, nothing published, if one differs.

    Returns ``(written, payload xxh3 as 16 hex)``; ``written`` is False when ``overwrite`` is False
    and ``path`` exists.
    """
    dpos = header.index(_DXXH3_FIELD) + len(_DXXH3_FIELD)
    hpos = _hxxh3_pos(header)
    d = os.path.dirname(path) or "."
    tmp = os.path.join(d, temp_name())
    body = as_bytes_view(payload)
    direct = bool(o_direct and _O_DIRECT and len(body) % ALIGNMENT == 0 and _addr_ro(body) % ALIGNMENT == 0)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = _open_new(tmp, flags, direct)
    except FileNotFoundError:
        if make_parent is not None:
            make_parent()
        else:
            os.makedirs(d, exist_ok=True)
        fd = _open_new(tmp, flags, direct)
    more: dict[str, Any] = {} if others is None else {"others": others[0], "count": others[1], "stride": others[2]}
    with TempFile(tmp, fd) as t:
        try:
            got = _native.pwrite_hash(t.fd, header, body, dpos, hpos, **more)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            os.close(t.fd)  # O_DIRECT refused at write time: the same write, buffered
            t.fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0))
            got = _native.pwrite_hash(t.fd, header, body, dpos, hpos, **more)
        if got is None:  # TempFile removes the temp file
            raise ReplicaMismatchError([], path=path)
        dh = got[0]
        if fsync:
            os.fsync(t.fd)
    return publish(tmp, path, d, overwrite=overwrite, fsync=fsync), f"{dh:016x}"
