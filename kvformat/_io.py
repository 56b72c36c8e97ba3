"""Local-file edge of the format: atomic writes and zero-copy reads. All file I/O of the core lives here."""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import socket
import stat
import threading
import time
from typing import Any, Iterator, Mapping

from ._format import as_bytes_view, check_expected, decode, encode_block, invalidate, verify_data
from ._header import decode_header, header_length
from ._spec import ALIGNMENT, BlockHeader, BlockKey, CanonicalLayout, Provenance
from .errors import KVFormatError, LayoutMismatchError, NotKVFormatError, TruncatedError

FIRST_READ = 2 * ALIGNMENT  # a 61-layer header fits here, so most files need one header read
TMP_PREFIX = ".kvf-tmp-"  # temp files: never matched by readers, removed by gc/start-up (spec §10)
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _as_payload(payload: Any, layout: CanonicalLayout) -> Any:
    if isinstance(payload, Mapping):  # {layer name: tensor}, assembled in layout order
        import torch

        # Each layer is checked on its own: a matching total can hide fp16 data under a bf16 layout,
        # or one layer two pages long next to an empty one.
        names = [l.name for l in layout.layers]
        extra = sorted(set(payload) - set(names), key=str)
        if extra:
            raise LayoutMismatchError("layers", names, [*names, *extra])
        parts = []
        for l in layout.layers:
            if l.name not in payload:
                raise LayoutMismatchError(f"layer {l.name}", "a tensor", "missing")
            t = payload[l.name]
            want = getattr(torch, _TORCH_DTYPES[l.dtype])
            if not isinstance(t, torch.Tensor):
                raise LayoutMismatchError(f"layer {l.name}", "a tensor", type(t).__name__)
            if t.dtype != want:
                raise LayoutMismatchError(f"layer {l.name} dtype", str(want), str(t.dtype))
            shape = [layout.blocks_per_chunk, *l.shape]
            if list(t.shape) != shape:
                raise LayoutMismatchError(f"layer {l.name} shape", shape, list(t.shape))
            parts.append(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))
        return torch.cat(parts)
    return payload


def write_atomic(path: str, parts: list[Any], *, fsync: bool = False, overwrite: bool = True) -> bool:
    """Write ``parts`` to ``path`` through a temp file and a rename; no partial file is ever visible.

    Returns False (and writes nothing) when ``overwrite`` is False and ``path`` exists.
    """
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, temp_name())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        views = [memoryview(p).cast("B") if not isinstance(p, (bytes, bytearray)) else p for p in parts]
        total = sum(len(v) for v in views)
        done = 0
        while done < total:  # writev may write less than asked (signals, huge files)
            n = os.writev(fd, views)
            done += n
            if done < total:
                views = _advance(views, n)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quiet(tmp)
        raise
    os.close(fd)
    return publish(tmp, path, d, overwrite=overwrite, fsync=fsync)


def publish(tmp: str, path: str, d: str, *, overwrite: bool, fsync: bool) -> bool:
    """Make the complete temp file ``tmp`` visible as ``path`` (spec §10); False if ``path`` existed and not
    ``overwrite``. The temp name is gone afterwards either way; with ``fsync`` the directory entry is durable."""
    try:
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if path exists: first writer wins, nothing is replaced
            except FileExistsError:
                return False
            finally:
                _unlink_quiet(tmp)
        if fsync:
            dfd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    return True


_HOST_TAG = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def temp_name() -> str:
    """``.kvf-tmp-<pid>-<random>-<host tag>``: enough to tell, later, whether its writer is gone."""
    return f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{_HOST_TAG}"


def temp_writer_gone(name: str) -> bool:
    """Whether the process that wrote temp file ``name`` certainly no longer runs.

    Only decidable for writers of this host (the host tag matches, or an untagged name): a pid of
    another host says nothing here, so such files are left to the age rule.
    """
    parts = name[len(TMP_PREFIX):].split("-")
    if not parts[0].isdigit() or (len(parts) >= 3 and parts[2] != _HOST_TAG):
        return False
    try:
        os.kill(int(parts[0]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # runs, as another user
        return False
    return False


def _advance(views: list[Any], n: int) -> list[Any]:
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(memoryview(v)[n:])
        n = 0
    return out


def _unlink_quiet(p: str) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def save_file(payload: Any, path: str | os.PathLike[str], layout: CanonicalLayout, key: BlockKey, *,
              provenance: Provenance | None = None, codec: str = "none", level: int = 3,
              fsync: bool = False) -> BlockHeader:
    """Write one kvformat file atomically.

    Parameters
    ----------
    payload: the canonical payload (bytes-like, CPU tensor, or ``{layer name: tensor}``).
    path: destination file.
    layout, key: what the payload is (the header records both).
    provenance: who wrote it (informational).
    codec, level: ``"none"`` or ``"zstd"`` and its level.
    fsync: fsync the file and its directory before returning.

    Returns
    -------
    The header written.

    Raises
    ------
    LayoutMismatchError if the payload size does not match ``layout``; OSError from the filesystem.
    """
    prov = provenance or Provenance(writer=_writer(), created=int(time.time()))
    hdr, data, info = encode_block(_as_payload(payload, layout), layout, key, provenance=prov, codec=codec,
                                   level=level)
    write_atomic(os.fspath(path), [hdr, data], fsync=fsync)
    return info


def _writer() -> str:
    from . import __version__

    return f"kvformat {__version__}"


def _read_exact(fd: int, buf: memoryview, offset: int) -> int:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


class FileSource:
    """One open, validated regular file that a whole read goes through.

    Header and payload are read through this one descriptor, never by reopening the name: a file
    renamed over the path, or a FIFO planted there, after validation cannot supply part of a read.
    ``o_direct`` reads the page-aligned part of a payload with O_DIRECT set on this same descriptor
    (``fcntl(F_SETFL)``), falling back to buffered reads where the filesystem refuses it.
    ``direct_bytes`` counts the bytes actually read with O_DIRECT.
    """

    def __init__(self, path: str, *, o_direct: bool = False) -> None:
        self.path = path
        self.fd = _open_regular(path)
        try:
            self.size = os.fstat(self.fd).st_size
        except BaseException:
            os.close(self.fd)
            raise
        self.o_direct = o_direct and bool(_O_DIRECT)
        self.direct_bytes = 0

    def pread(self, offset: int, n: int) -> bytearray:
        """Up to ``n`` bytes at ``offset`` (fewer only at the end of the file)."""
        buf = bytearray(max(0, n))
        got = _read_exact(self.fd, memoryview(buf), offset)
        del buf[got:]
        return buf

    def readinto(self, offset: int, dst: memoryview) -> int:
        """Fill ``dst`` from ``offset``; returns the bytes read (short only at the end of the file)."""
        if not self.o_direct:
            return _read_exact(self.fd, dst, offset)
        import ctypes
        import fcntl

        aligned = len(dst) - len(dst) % ALIGNMENT
        addr = ctypes.addressof(ctypes.c_char.from_buffer(dst)) if aligned else 0
        if not aligned or addr % ALIGNMENT or offset % ALIGNMENT:  # O_DIRECT needs aligned memory and offsets
            return _read_exact(self.fd, dst, offset)
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | _O_DIRECT)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # filesystems without O_DIRECT: buffered
                return _read_exact(self.fd, dst, offset)
            raise
        got = -1
        try:
            got = _read_exact(self.fd, dst[:aligned], offset)
            self.direct_bytes += got
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: accepted at fcntl time, refused at read time (some FUSE)
                raise
        finally:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags)  # the unaligned tail is read buffered
        if got < 0:
            got = _read_exact(self.fd, dst[:aligned], offset)
        if got == aligned and aligned < len(dst):
            got += _read_exact(self.fd, dst[aligned:], offset + aligned)
        return got

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "FileSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class BytesSource:
    """A file, or its first bytes, held in memory (what a remote store fetched).

    ``size`` is the object's full size when ``buf`` holds only a prefix of it (a ranged header read).
    """

    def __init__(self, buf: Any, size: int | None = None) -> None:
        self._mv = as_bytes_view(buf)
        self.size = len(self._mv) if size is None else int(size)
        self.path = ""

    def pread(self, offset: int, n: int) -> memoryview:
        """Up to ``n`` held bytes at ``offset`` (no copy)."""
        return self._mv[offset:offset + max(0, n)]

    def readinto(self, offset: int, dst: memoryview) -> int:
        """Copy held bytes from ``offset`` into ``dst``; returns how many."""
        src = self._mv[offset:offset + len(dst)]
        dst[:len(src)] = src
        return len(src)

    def close(self) -> None:
        """Drop the reference to the held bytes."""
        self._mv = memoryview(b"")

    def __enter__(self) -> "BytesSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


Source = FileSource | BytesSource


def read_header_from(src: Source, verify: bool = True) -> BlockHeader:
    """Read and check the header region of ``src`` (spec §11 steps 1-3, F-3.3). The one header reader."""
    size = src.size
    first = bytes(src.pread(0, min(FIRST_READ, size)))
    end = header_length(first)
    if end > len(first):
        if end > size:
            raise TruncatedError("header", end, size)  # F-3.3
        first += bytes(src.pread(len(first), end - len(first)))
    return decode_header(first, file_bytes=size, verify=verify)


def read_payload_from(src: Source, out: Any, *, expect: CanonicalLayout | None = None, key: BlockKey | None = None,
                      verify: bool = True) -> BlockHeader:
    """The read pipeline every reader shares (``kvformat.read_into`` and every ``Store``).

    Header, schema, file length, ``expect`` and ``key`` are checked before ``out`` is touched; after
    that, ANY failure (short read, data checksum, zstd frame with or without ``verify``, decoded
    checksum, an OSError mid-read) zero-fills ``out[:payload_bytes]`` before raising (F-5.5, G-1.2).
    """
    dst = as_bytes_view(out, writable=True)
    hdr = read_header_from(src, verify)
    check_expected(hdr, expect, key)
    if len(dst) < hdr.raw_bytes:
        raise LayoutMismatchError("payload_bytes", len(dst), hdr.raw_bytes)  # the file decides: kvformat error
    dst = dst[:hdr.raw_bytes]
    try:
        if hdr.codec == "none":
            got = src.readinto(hdr.data_offset, dst)
            if got != hdr.data_bytes:
                raise TruncatedError("data", hdr.data_bytes, got)
            if verify:
                verify_data(hdr, dst, None)  # F-5.2
        else:
            data = src.pread(hdr.data_offset, hdr.data_bytes)
            if verify:
                verify_data(hdr, data, dst)  # F-5.2, F-6.3, F-6.4, F-5.3
            else:
                if len(data) != hdr.data_bytes:
                    raise TruncatedError("data", hdr.data_bytes, len(data))
                from . import _codec

                _codec.decompress_into(data, dst)  # F-6.3, F-6.4
    except BaseException:
        invalidate(dst)  # F-5.5: never leave partly read or partly decoded bytes behind
        raise
    return hdr


def _open_regular(p: str) -> int:
    # O_NONBLOCK: opening a FIFO planted under a block's name must not block a reader forever
    # (it is a no-op for regular files); anything but a regular file is not a kvformat file.
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):  # an OS error, as a plain read of a directory would give
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), p)
        raise NotKVFormatError("not a regular file", path=p)
    return fd


SMALL_FILE_LIMIT = 1 << 20


class UnsafeFileError(OSError):
    """A small metadata file that is not read: a symlink, not a regular file, or too large."""


def read_small_file(path: str, *, limit: int = SMALL_FILE_LIMIT) -> bytes:
    """The bytes of a small metadata file (namespace.json, a legacy config.json) in an untrusted tree.

    Never follows a symlink in the last component, never opens anything but a regular file (a FIFO
    would block, a device node would stream forever) and reads at most ``limit`` bytes.

    Raises
    ------
    UnsafeFileError (an OSError) naming why the file was not read; other OSErrors pass through.
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFileError(errno.ELOOP, "a symlink (not followed)", path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(errno.EINVAL, "not a regular file", path)
    try:
        # The lstat above and this open race with a swap: O_NOFOLLOW/O_NONBLOCK and fstat close that gap.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFileError(errno.ELOOP, "a symlink (not followed)", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(errno.EINVAL, "not a regular file", path)
        if st.st_size > limit:
            raise UnsafeFileError(errno.EFBIG, f"over the {limit}-byte limit ({st.st_size} bytes)", path)
        chunks: list[bytes] = []
        n = 0
        while True:
            b = os.read(fd, limit + 1 - n)
            if not b:
                break
            chunks.append(b)
            n += len(b)
            if n > limit:  # grew since fstat
                raise UnsafeFileError(errno.EFBIG, f"over the {limit}-byte limit", path)
        return b"".join(chunks)
    finally:
        os.close(fd)


def is_regular_file(path: str) -> bool:
    """True for a regular file that is not a symlink (lstat; nothing is opened)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def read_header(path: str | os.PathLike[str], *, verify: bool = True) -> BlockHeader:
    """Read and check a file's header only (no payload read).

    Raises a KVFormatError subclass for a bad header (with ``path`` set); OSError passes through.
    """
    p = os.fspath(path)
    try:
        with FileSource(p) as src:
            return read_header_from(src, verify)
    except KVFormatError as e:
        raise e.with_path(p) from None  # the same error, now naming its file


def read_into(path: str | os.PathLike[str], out: Any, *, expect: CanonicalLayout | None = None,
              key: BlockKey | None = None, verify: bool = True, o_direct: bool = False) -> BlockHeader:
    """Read a file's payload straight into ``out`` (memoryview, mmap slice, bytearray, CPU tensor).

    The header is checked (and against ``expect``/``key`` when given) before ``out`` is touched.
    Any failure after that (checksum, zstd frame, short read, with or without ``verify``) zero-fills
    ``out[:payload_bytes]`` before raising: wrong bytes never stay in the destination. ``o_direct``
    reads page-aligned parts with O_DIRECT on the same descriptor when the filesystem allows it
    (falls back to buffered reads otherwise).

    Returns the header. Raises KVFormatError subclasses (``path`` set); OSError passes through.
    """
    p = os.fspath(path)
    try:
        with FileSource(p, o_direct=o_direct) as src:
            return read_payload_from(src, out, expect=expect, key=key, verify=verify)
    except KVFormatError as e:
        raise e.with_path(p) from None  # the same error, now naming its file


def load_file(path: str | os.PathLike[str], *, expect: CanonicalLayout | None = None, key: BlockKey | None = None,
              verify: bool = True) -> dict[str, Any]:
    """safetensors-style: ``{layer name: torch.Tensor}`` of shape ``(blocks_per_chunk, *layer.shape)``.

    Packed dtypes come back as uint8 (the header's ``kv_dtype`` says what they hold).
    """
    import torch

    hdr = read_header(path, verify=False)
    buf = torch.empty(hdr.raw_bytes, dtype=torch.uint8)
    hdr = read_into(path, buf, expect=expect, key=key, verify=verify)
    return tensors_from_payload(buf, hdr.layout)


_TORCH_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
                 "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64",
                 "U64": "uint64", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def tensors_from_payload(buf: Any, layout: CanonicalLayout) -> dict[str, Any]:
    """One tensor per layer: a view of ``buf`` where the layer's offset suits its dtype, else a copy.

    Layers of mixed dtypes can start at offsets that are not a multiple of a later layer's element
    size (a U8 layer of odd length before an F32 one); torch cannot view such bytes, so they are copied.
    """
    import torch

    flat = buf if isinstance(buf, torch.Tensor) else torch.frombuffer(buf, dtype=torch.uint8)
    out = {}
    for l, off, n in zip(layout.layers, layout.layer_offsets, layout.chunk_bytes_per_layer):
        dt = getattr(torch, _TORCH_DTYPES[l.dtype])
        raw = flat[off:off + n]
        if raw.storage_offset() % dt.itemsize:  # the condition torch.Tensor.view(dtype) imposes
            raw = raw.clone()  # a fresh allocation is aligned for every dtype
        out[l.name] = raw.view(dt).reshape(layout.blocks_per_chunk, *l.shape)
    return out


class BlockFile:
    """An open kvformat file: ``header`` now, payload on demand. Use as a context manager."""

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True) -> None:
        self.path = os.fspath(path)
        self._verify = verify
        self.header = read_header(self.path, verify=verify)

    def read_into(self, out: Any, **kw: Any) -> BlockHeader:
        """See :func:`kvformat.read_into`."""
        return read_into(self.path, out, verify=self._verify, **kw)

    def tensors(self) -> dict[str, Any]:
        """See :func:`kvformat.load_file`."""
        return load_file(self.path, verify=self._verify)

    def __enter__(self) -> "BlockFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def open_block(path: str | os.PathLike[str], *, verify: bool = True) -> BlockFile:
    """Open a kvformat file and check its header. See :class:`BlockFile`."""
    return BlockFile(path, verify=verify)


def iter_files(root: str, suffix: str = ".kvf", *,
               skip_top: tuple[str, ...] = ()) -> Iterator[tuple[str, os.DirEntry[str]]]:
    """``(relative path with '/', entry)`` of the regular files under ``root`` ending in ``suffix``.

    Never follows symlinks, skips temp files, and skips the top-level directories named in ``skip_top``.
    The relative path is built while walking (no per-file ``os.path.relpath``: scans of 10k-file trees).
    """
    stack = [("", root)]
    while stack:
        rel, d = stack.pop()
        try:
            it = os.scandir(d)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with it:
            for e in it:
                name = e.name
                if e.is_dir(follow_symlinks=False):
                    if not (not rel and name in skip_top):
                        stack.append((rel + name + "/", e.path))
                elif name.endswith(suffix) and not name.startswith(TMP_PREFIX) and e.is_file(follow_symlinks=False):
                    yield rel + name, e


_ = decode  # decode(bytes) is the in-memory twin of read_into


# -- fused paths (kvformat._native): one read / one write per file, the payload hashed in the same pass ------
# Kept apart from read_into/write_atomic so they stay small and merge cleanly; the tier calls these two.
# With the C extension each payload piece is hashed while it is still in cache (no second trip through
# DRAM) and the GIL is released for the whole read or write; without it the same syscalls run from
# Python (one preadv / one pwritev) and python-xxhash hashes the payload.

_DXXH3_FIELD = b'"kvf.dxxh3":"'


def read_into_fused(path: str | os.PathLike[str], out: Any, *, expect: CanonicalLayout | None = None,
                    key: BlockKey | None = None, verify: bool = True, o_direct: bool = False) -> BlockHeader:
    """:func:`read_into` with header and payload in ONE read and the payload hashed as it lands.

    The header region's size is guessed as (file size - payload size), exact for every uncompressed
    file of ``expect``'s layout. Unlike :func:`read_into`, ``out`` is written before the header is
    checked: on any kvformat error it is zero-filled (never left holding the file's bytes), so it suits
    a caller for which any failure is a miss (the tier), not one that needs ``out`` untouched on a
    layout mismatch. Anything the guess does not fit (compressed files, other layouts) takes
    :func:`read_into`. ``o_direct``: the same one read through an O_DIRECT descriptor when ``out`` is
    page-aligned and the payload a whole number of pages (else, or where the filesystem refuses it,
    buffered). Raises what :func:`read_into` raises.
    """
    from . import _native
    from ._spec import MAX_HEADER_BYTES
    from .errors import ChecksumError

    p = os.fspath(path)
    dst = as_bytes_view(out, writable=True)
    raw = expect.payload_bytes if expect is not None else len(dst)
    direct = o_direct and _O_DIRECT and raw % ALIGNMENT == 0 and raw <= len(dst) and _addr(dst) % ALIGNMENT == 0
    fd = _open_direct(p) if direct else _open_regular(p)
    touched = False
    try:
        size = os.fstat(fd).st_size
        guess = size - raw
        if raw > len(dst) or guess < ALIGNMENT or guess % ALIGNMENT or guess > MAX_HEADER_BYTES + ALIGNMENT:
            return read_into(p, out, expect=expect, key=key, verify=verify, o_direct=o_direct)
        head = _head_buffer(guess) if direct else bytearray(guess)
        body = dst[:raw]
        try:
            hgot, dgot, digest = _native.pread_hash(fd, head, body, 0, hash=verify)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            os.close(fd)  # O_DIRECT refused at read time (some FUSE filesystems): the same read, buffered
            fd = _open_regular(p)
            direct = False
            head = bytearray(guess)
            hgot, dgot, digest = _native.pread_hash(fd, head, body, 0, hash=verify)
        touched = dgot > 0
        hdr = decode_header(memoryview(head)[:hgot], file_bytes=size, verify=verify)
        check_expected(hdr, expect, key)
        if hdr.codec != "none" or hdr.data_offset != guess or hdr.raw_bytes != raw:
            invalidate(body)
            touched = False
            return read_into(p, out, expect=expect, key=key, verify=verify, o_direct=o_direct)
        if dgot != hdr.data_bytes:  # the file shrank under us
            raise TruncatedError("data", hdr.data_bytes, dgot)
        if verify:
            actual = f"{digest:016x}"
            if actual != hdr.data_xxh3:
                raise ChecksumError("data", hdr.data_xxh3, actual)  # F-5.2
        return hdr
    except KVFormatError as e:
        if touched:
            invalidate(dst[:raw])  # F-5.5: wrong bytes never stay in the destination
        raise e.with_path(p) from None  # the same error, now naming its file
    except BaseException:
        if touched:
            invalidate(dst[:raw])
        raise
    finally:
        os.close(fd)


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
                      overwrite: bool = True, o_direct: bool = False) -> tuple[bool, str]:
    """Write one uncompressed kvformat file atomically, hashing the payload in the same pass.

    ``header`` is the header region as :func:`encode_block` makes it with ``payload_xxh3=0``: its
    ``kvf.dxxh3`` digits are patched with the payload's xxh3 (and ``kvf.hxxh3`` recomputed) in the
    write itself, so the payload is read once. Publishing is :func:`write_atomic`'s (temp file, then
    rename or, with ``overwrite=False``, link: first writer wins); the parent directory is created only
    when the temp file cannot be (it exists on every write but the first of a directory).

    ``o_direct``: write through an O_DIRECT descriptor (the page cache is bypassed, as the built-in
    vLLM tier does) when the payload is page-aligned and a whole number of pages; buffered otherwise or
    where the filesystem refuses it.

    Returns ``(written, payload xxh3 as 16 hex)``; ``written`` is False when ``overwrite`` is False
    and ``path`` exists.
    """
    from . import _native
    from ._header import _hxxh3_pos

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
        os.makedirs(d, exist_ok=True)
        fd = _open_new(tmp, flags, direct)
    try:
        try:
            dh, _ = _native.pwrite_hash(fd, header, body, dpos, hpos)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            os.close(fd)  # O_DIRECT refused at write time: the same write, buffered
            fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0))
            dh, _ = _native.pwrite_hash(fd, header, body, dpos, hpos)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quiet(tmp)
        raise
    os.close(fd)
    return publish(tmp, path, d, overwrite=overwrite, fsync=fsync), f"{dh:016x}"
