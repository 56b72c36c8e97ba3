"""Encode a payload into file parts, decode file bytes into a caller's buffer. No file I/O."""

from __future__ import annotations

from typing import Any

from . import _codec, _planes
from ._header import _hxxh3_pos as header_checksum_pos
from ._header import check_layout, decode_header, encode_header, sealed_positions, xxh3_hex
from ._consts import HEX64_LEN, HEX64_ZERO, SEAL_TAG_HEX, parse_uint
from ._seal import Keyring, header_aad, key_for, new_nonce, seal_data, unseal_data
from ._spec import BlockHeader, BlockKey, CanonicalLayout, Provenance, SealFields
from ..errors import ChecksumError, LayoutMismatchError, SchemaError, TruncatedError, UsageError


def as_bytes_view(obj: Any, *, writable: bool = False) -> memoryview:
    """A flat unsigned-byte memoryview over bytes, bytearray, memoryview, mmap or numpy array (a tensor is
    seen as bytes by its caller: ``kvformat.torch.as_buffer``)."""
    mv = memoryview(obj)
    if writable and mv.readonly:
        raise ValueError("the destination buffer is read-only")
    if not mv.c_contiguous:
        raise ValueError("expected a contiguous buffer")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def encode(payload: Any, layout: CanonicalLayout, key: BlockKey, *, provenance: Provenance | None = None,
           codec: str = "none", level: int | None = None,
           keys: Keyring | None = None) -> tuple[bytes, memoryview | bytes]:
    """Return ``(header_region, data)``; the file is their concatenation.

    ``data`` is ``payload`` itself (no copy) when uncompressed or sealed with ``authenticate``, the zstd
    frame, or the ciphertext of a layout sealed with ``encrypt``. A sealed layout (``layout.seal``) is
    sealed under ``keys.write_key`` (spec §12). ``level``: the zstd level (default 3 for zstd, 1 for planes).
    """
    hdr, data, _ = encode_block(payload, layout, key, provenance=provenance, codec=codec, level=level, keys=keys)
    return hdr, data


def encode_block(payload: Any, layout: CanonicalLayout, key: BlockKey, *, provenance: Provenance | None = None,
                 codec: str = "none", level: int | None = None, payload_xxh3: int | None = None,
                 keys: Keyring | None = None, nonce: str | None = None,
                 out: memoryview | None = None) -> tuple[bytes, memoryview | bytes, BlockHeader]:
    """:func:`encode` plus the :class:`BlockHeader` it wrote (built from what was encoded, not re-parsed).

    ``payload_xxh3``: the xxh3-64 of ``payload`` when the caller has just computed it over these same
    bytes (the tier's replica check does), so the payload is not hashed twice; 0 leaves kvf.dxxh3 (and
    kvf.hxxh3) for a fused writer to patch. Sealed layouts: ``keys`` seals, ``nonce`` (tests and vectors
    only) replaces the random one, ``out`` (payload-sized) receives the ciphertext of ``encrypt``.
    """
    mv = as_bytes_view(payload)
    if len(mv) != layout.payload_bytes:
        raise LayoutMismatchError("payload_bytes", layout.payload_bytes, len(mv))
    if layout.seal is not None:
        if codec != "none":
            raise SchemaError("kvf.codec", "a sealed file is not compressed (spec §12.1)")
        return _encode_sealed(mv, layout, key, provenance or Provenance(), keys, nonce, payload_xxh3, out)
    raw = xxh3_hex(mv) if payload_xxh3 is None else f"{payload_xxh3:016x}"
    if codec == "none":
        data: memoryview | bytes = mv
        dx = raw
    elif codec in ("zstd", "planes"):
        if level is None:  # planes codes one near-entropy plane: level 1 is smaller and faster to decode there
            level = 1 if codec == "planes" else 3
        parse_uint("kvf.level", level, maximum=22)  # refuse before spending time compressing
        if codec == "zstd":
            data = _codec.compress(mv, level)
        else:
            table, data = _planes.compress(mv, _planes.width_for([l.dtype for l in layout.layers]), level)
        if len(mv) > _codec.decoded_limit(len(data)):  # readers refuse it: store it plain, still readable
            codec, data = "none", mv
            dx = raw
        else:
            dx = xxh3_hex(data)
    else:
        raise SchemaError("codec", f"expected none, zstd or planes, got {codec!r}")
    prov = provenance or Provenance()
    lvl = level if codec != "none" else None
    planes = tuple(table) if codec == "planes" else ()
    hdr = encode_header(layout, key, prov, codec=codec, data_bytes=len(data), data_xxh3=dx, raw_xxh3=raw, level=lvl,
                        plane_table=_planes.table_json(planes) if planes else None)
    pos = header_checksum_pos(hdr)
    info = BlockHeader(version=layout.version, layout=layout, key=key, provenance=prov, codec=codec,
                       data_offset=len(hdr), data_bytes=len(data), raw_bytes=layout.payload_bytes,
                       header_xxh3=hdr[pos:pos + 16].decode(), data_xxh3=dx, raw_xxh3=raw, level=lvl, planes=planes)
    return hdr, data, info


def _encode_sealed(mv: memoryview, layout: CanonicalLayout, key: BlockKey, prov: Provenance, keys: Keyring | None,
                   nonce: str | None, payload_xxh3: int | None,
                   out: memoryview | None) -> tuple[bytes, memoryview | bytes, BlockHeader]:
    if keys is None:
        raise UsageError(f"layout sealed with {layout.seal!r}: writing it needs a keyring (keys=...)")
    wk = keys.write_key
    n = nonce if nonce is not None else new_nonce()
    level = str(layout.seal)
    zeros = SealFields(wk.key_id, n, "0" * SEAL_TAG_HEX)
    hdr = bytearray(encode_header(layout, key, prov, codec="none", data_bytes=len(mv), data_xxh3=HEX64_ZERO.decode(),
                                  raw_xxh3="", seal=zeros))
    if level == "encrypt":
        data: memoryview = out[:len(mv)] if out is not None else memoryview(bytearray(len(mv)))
        tag = seal_data(level, wk, n, header_aad(hdr), mv, data)
    else:
        data = mv
        tag = seal_data(level, wk, n, header_aad(hdr), mv)
    h = header_checksum_pos(hdr)
    d, t = sealed_positions(hdr, h)
    if payload_xxh3 == 0:
        dx = HEX64_ZERO.decode()  # a fused writer patches kvf.dxxh3 and kvf.hxxh3 while it writes
    elif payload_xxh3 is not None and level == "authenticate":
        dx = f"{payload_xxh3:016x}"
    else:
        dx = xxh3_hex(data)  # F-5.2: of the stored bytes (the ciphertext when encrypted)
    hdr[t:t + SEAL_TAG_HEX] = tag.encode()
    hdr[d:d + HEX64_LEN] = dx.encode()
    hdr[h:h + HEX64_LEN] = HEX64_ZERO
    hdr[h:h + HEX64_LEN] = xxh3_hex(hdr).encode()  # F-5.1: over the region with its own digits as zeros
    info = BlockHeader(version=layout.version, layout=layout, key=key, provenance=prov, codec="none",
                       data_offset=len(hdr), data_bytes=len(data), raw_bytes=layout.payload_bytes,
                       header_xxh3=hdr[h:h + HEX64_LEN].decode(), data_xxh3=dx,
                       raw_xxh3=dx if level == "authenticate" else "", seal=SealFields(wk.key_id, n, tag))
    return bytes(hdr), data, info


def check_expected(hdr: BlockHeader, expect: CanonicalLayout | None, key: BlockKey | None) -> None:
    """F-9.1 and F-9.2: the file is the layout and block the caller expects (LayoutMismatchError)."""
    if expect is not None:
        check_layout(hdr.layout, expect)
    if key is not None and key != hdr.key:
        raise LayoutMismatchError("key", key.to_str(), hdr.key.to_str())  # F-9.2


def _check_stored(hdr: BlockHeader, data: Any) -> None:
    """F-3.4 and F-5.2: the stored bytes are all there and hash to kvf.dxxh3."""
    if len(data) != hdr.data_bytes:
        raise TruncatedError("data", hdr.data_bytes, len(data))
    actual = xxh3_hex(data)
    if actual != hdr.data_xxh3:
        raise ChecksumError("data", hdr.data_xxh3, actual)


def verify_data(hdr: BlockHeader, data: Any, out: memoryview | None, *, stored_checked: bool = False) -> None:
    """Check stored data (and decode it into ``out`` when compressed).

    On any failure ``out`` is zero-filled (explicitly invalidated, F-5.5) before the error is raised.
    ``stored_checked`` skips the kvf.dxxh3 check when the caller has just done it.
    """
    try:
        if not stored_checked:
            _check_stored(hdr, data)
        if hdr.codec != "none" and out is not None:
            decompress_into(hdr, data, out)  # F-6.3, F-6.4 (zstd); F-6.6, F-6.7 (planes)
            actual = xxh3_hex(out)
            if actual != hdr.raw_xxh3:
                raise ChecksumError("raw", hdr.raw_xxh3, actual)  # F-5.3
    except Exception:
        if out is not None:
            invalidate(out)
        raise


def decompress_into(hdr: BlockHeader, data: Any, out: memoryview) -> None:
    """Decode the stored bytes of compressed file ``hdr`` into ``out`` (payload-sized), bounded by the
    decompression cap; no checksum here (:func:`verify_data` checks them)."""
    if hdr.codec == "planes":
        _codec.check_bounds(len(data), len(out))  # the cap on the whole data section; each frame's size after
        _planes.decompress_into(hdr.planes, data, out)
    else:
        _codec.decompress_into(data, out)


def invalidate(out: memoryview) -> None:
    """Zero-fill ``out`` (F-5.5)."""
    out[:] = bytes(len(out)) if len(out) < (1 << 16) else memoryview(bytearray(len(out)))


def unseal_into(hdr: BlockHeader, region: Any, dst: memoryview, keys: Keyring | None, *,
                zero_on_failure: bool = True) -> None:
    """Authenticate (and, for ``encrypt``, decrypt in place) the stored bytes of sealed file ``hdr`` that are
    in ``dst``, ``region`` being its header region. On failure ``dst`` is zero-filled (F-5.5; unless the
    caller's bytes were only read) and TagMismatchError raised (F-12.6); UnknownKeyError (F-12.5) is raised
    before ``dst`` is touched."""
    k = key_for(hdr, keys)
    assert hdr.seal is not None and hdr.layout.seal is not None
    try:
        unseal_data(hdr.layout.seal, k, hdr.seal, header_aad(region), dst)
    except BaseException:
        if zero_on_failure:
            invalidate(dst)
        raise


def decode(buf: Any, out: Any | None = None, *, expect: CanonicalLayout | None = None, key: BlockKey | None = None,
           verify: bool = True, keys: Keyring | None = None) -> tuple[BlockHeader, memoryview]:
    """Decode a whole file held in memory.

    Returns ``(header, payload)``. With ``out`` the payload is written there and ``payload`` is a view
    of ``out``; without it, an uncompressed (or authenticated) payload is a zero-copy view of ``buf``
    (valid as long as ``buf`` is) and a compressed or decrypted one a fresh bytearray. A sealed file is
    opened with ``keys`` (its tag is always checked, ``verify`` or not; UnknownKeyError without the key).
    """
    mv = as_bytes_view(buf)
    hdr = decode_header(mv, file_bytes=len(mv), verify=verify)
    check_expected(hdr, expect, key)
    data = mv[hdr.data_offset:hdr.file_bytes]
    dst = as_bytes_view(out, writable=True) if out is not None else None
    if dst is not None and len(dst) < hdr.raw_bytes:
        # The file, not the caller, decides the size: a bad file must raise a kvformat error.
        raise LayoutMismatchError("payload_bytes", len(dst), hdr.raw_bytes)
    if dst is not None:
        dst = dst[:hdr.raw_bytes]
    if hdr.seal is not None:
        key_for(hdr, keys)  # F-12.5: before anything is written to the destination
        if verify:
            _check_stored(hdr, data)  # F-5.2 first: damage is a checksum failure, forgery a tag failure
        if dst is None and hdr.layout.seal == "authenticate":
            unseal_into(hdr, mv[:hdr.data_offset], data, keys, zero_on_failure=False)  # only read: stays the file
            return hdr, data
        if dst is None:
            dst = memoryview(bytearray(hdr.raw_bytes))
        dst[:] = data
        unseal_into(hdr, mv[:hdr.data_offset], dst, keys)
        return hdr, dst
    if hdr.codec == "none":
        if verify:
            verify_data(hdr, data, None)
        if dst is None:
            return hdr, data
        dst[:] = data
        return hdr, dst
    if dst is None:
        if verify:  # a corrupt frame is refused before the payload-sized allocation
            _check_stored(hdr, data)
        _codec.check_bounds(len(data), hdr.raw_bytes)  # a bomb is refused before the allocation too
        dst = memoryview(bytearray(hdr.raw_bytes))
        if verify:
            verify_data(hdr, data, dst, stored_checked=True)
        else:
            decompress_into(hdr, data, dst)
        return hdr, dst
    try:
        if verify:
            verify_data(hdr, data, dst)
        else:
            decompress_into(hdr, data, dst)
    except BaseException:
        invalidate(dst)  # F-5.5 with verify off too: a frame that fails half-way leaves nothing behind
        raise
    return hdr, dst
