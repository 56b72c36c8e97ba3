"""The public file API of the format over buffers: :func:`save_file`, :func:`read_header`, :func:`read_into`,
:func:`open_block` (``kvformat.torch`` wraps the ones that take or give tensors). The work is done by
:mod:`._write` (atomic publication),
:mod:`._read` (the one read pipeline) and :mod:`._fused` (the tier's one-syscall paths); :mod:`._files`
holds the torch-free helpers for untrusted trees.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ._block import decode, encode_block
from ._read import FileSource, read_header_from, read_payload_from, payload_buffer
from ._seal import Keyring
from ._spec import BlockHeader, BlockKey, CanonicalLayout, Provenance
from ._write import write_atomic
from ..errors import KVFormatError


def save_file(payload: Any, path: str | os.PathLike[str], layout: CanonicalLayout, key: BlockKey, *,
              provenance: Provenance | None = None, codec: str = "none", level: int | None = None,
              fsync: bool = False, keys: Keyring | None = None) -> BlockHeader:
    """Write one kvformat file atomically.

    Parameters
    ----------
    payload: the canonical payload, bytes-like (``kvformat.save_file`` also takes a CPU tensor or
        ``{layer name: tensor}``: :mod:`kvformat.torch`).
    path: destination file.
    layout, key: what the payload is (the header records both). A layout with ``seal`` set
        (``layout.with_seal("encrypt")``) writes a sealed file (spec §12).
    provenance: who wrote it (informational).
    codec, level: ``"none"``, ``"zstd"`` or ``"planes"`` (spec §6.2) and its zstd level (default 3 for zstd, 1
        for planes; sealed files are not compressed).
    fsync: fsync the file and its directory before returning.
    keys: the keyring whose write key seals the file (sealed layouts only).

    Returns
    -------
    The header written.

    Raises
    ------
    LayoutMismatchError if the payload size does not match ``layout``; OSError from the filesystem.
    """
    prov = provenance or Provenance(writer=_writer(), created=int(time.time()))
    hdr, data, info = encode_block(payload, layout, key, provenance=prov, codec=codec, level=level, keys=keys)
    write_atomic(os.fspath(path), [hdr, data], fsync=fsync)
    return info


def _writer() -> str:
    from .._version import __version__

    return f"kvformat {__version__}"


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
              key: BlockKey | None = None, verify: bool = True, o_direct: bool = False,
              keys: Keyring | None = None) -> BlockHeader:
    """Read a file's payload straight into ``out`` (memoryview, mmap slice, bytearray, numpy array; a CPU tensor
    through ``kvformat.read_into``).

    The header is checked (and against ``expect``/``key`` when given) before ``out`` is touched.
    Any failure after that (checksum, zstd frame, short read, with or without ``verify``) zero-fills
    ``out[:payload_bytes]`` before raising: wrong bytes never stay in the destination. ``o_direct``
    reads page-aligned parts with O_DIRECT on the same descriptor when the filesystem allows it
    (falls back to buffered reads otherwise). A sealed file needs ``keys`` holding the key it names
    (else UnknownKeyError, ``out`` untouched); its tag is always checked (TagMismatchError, ``out`` zeroed).

    Returns the header. Raises KVFormatError subclasses (``path`` set); OSError passes through.
    """
    p = os.fspath(path)
    try:
        with FileSource(p, o_direct=o_direct) as src:
            return read_payload_from(src, out, expect=expect, key=key, verify=verify, keys=keys)
    except KVFormatError as e:
        raise e.with_path(p) from None  # the same error, now naming its file


def verify_file(path: str | os.PathLike[str], *, keys: Keyring | None = None) -> BlockHeader:
    """Check every byte of a file as a load would, without delivering it (maintenance: verify, inspect).

    A sealed file is authenticated when ``keys`` holds its key (UnknownKeyError when ``keys`` is given
    but does not); without ``keys`` it is checked as far as no key allows: header and stored-data
    checksums. Returns the header; raises KVFormatError subclasses (``path`` set), OSError passes through.
    """
    p = os.fspath(path)
    try:
        with FileSource(p) as src:
            hdr = read_header_from(src, True)
            return read_payload_from(src, payload_buffer(hdr), verify=True, keys=keys, stored_only=keys is None)
    except KVFormatError as e:
        raise e.with_path(p) from None


class BlockFile:
    """An open kvformat file: ``header`` now, payload on demand. Use as a context manager."""

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True, keys: Keyring | None = None) -> None:
        self.path = os.fspath(path)
        self._verify = verify
        self._keys = keys
        self.header = read_header(self.path, verify=verify)

    def read_into(self, out: Any, **kw: Any) -> BlockHeader:
        """See :func:`kvformat.read_into`."""
        return read_into(self.path, out, verify=self._verify, **{"keys": self._keys, **kw})

    def __enter__(self) -> "BlockFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def open_block(path: str | os.PathLike[str], *, verify: bool = True, keys: Keyring | None = None) -> BlockFile:
    """Open a kvformat file and check its header. See :class:`BlockFile`."""
    return BlockFile(path, verify=verify, keys=keys)


_ = decode  # decode(bytes) is the in-memory twin of read_into
