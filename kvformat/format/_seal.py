"""Sealed files (spec §12): keys, key ids, and the seal / unseal of a header region and its data over
memoryviews. No file I/O here (key files are read by :mod:`._keys`).

The cryptography is the ``cryptography`` package's (OpenSSL): AES-256-GCM through its streaming cipher
context, whose ``authenticate_additional_data`` and ``update_into`` release the GIL on large buffers
(tests/test_seal.py checks it), and HKDF-SHA256. Nothing here implements a primitive.

* ``authenticate``: the payload stays in clear; the tag is GCM's over the header and then the payload,
  both as associated data (GMAC).
* ``encrypt``: the payload is GCM's plaintext; the data section holds the ciphertext.

Each file gets its own AES key and IV from HKDF-SHA256(deployment key, salt = the file's 192-bit random
nonce), so no (key, IV) pair ever repeats, however many files one deployment key seals (GCM with random
96-bit IVs under one key is limited to 2^32 messages).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._consts import HEX64_LEN, SEAL_KEY_BYTES, SEAL_NONCE_HEX, SEAL_TAG_HEX
from ._header import _hxxh3_pos, header_length, sealed_positions
from ._spec import BlockHeader, SealFields
from ..errors import TagMismatchError, UnknownKeyError

__all__ = ["SealKey", "Keyring", "key_id_of", "new_nonce", "header_aad", "seal_data", "unseal_data", "key_for"]

_KEY_ID_LABEL = b"kvformat key id v1"  # §12.4
_KDF_INFO = b"kvformat seal v1 "  # §12.4, followed by the level: the two levels never share a file key
_IV_BYTES = 12
_TAG_BYTES = SEAL_TAG_HEX // 2


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError as e:
        raise ImportError(f'sealed kvformat files need the cryptography package: pip install "kvformat[seal]" '
                          f"(import failed: {e})") from e
    return hashes, Cipher, algorithms, modes, HKDF


def key_id_of(secret: bytes) -> str:
    """The key id of a deployment key (§12.4): 16 hex digits of HMAC-SHA256(key, label), never the key itself."""
    return hmac.new(secret, _KEY_ID_LABEL, hashlib.sha256).hexdigest()[:HEX64_LEN]


@dataclass(frozen=True, repr=False)
class SealKey:
    """One 256-bit deployment key and its id. ``repr`` shows the id only, so a key never reaches a log."""

    secret: bytes = field(compare=False)
    key_id: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) != SEAL_KEY_BYTES:
            raise ValueError(f"a seal key is {SEAL_KEY_BYTES} bytes")
        object.__setattr__(self, "key_id", key_id_of(self.secret))

    def __repr__(self) -> str:
        return f"SealKey(id={self.key_id})"


@dataclass(frozen=True, repr=False)
class Keyring:
    """The keys a deployment holds: the first seals new files, every one opens files (rotation: put the new
    key first and keep the old ones, so the files they sealed stay readable until they age out)."""

    keys: tuple[SealKey, ...]
    _by_id: Mapping[str, SealKey] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("a keyring holds at least one key")
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "_by_id", {k.key_id: k for k in reversed(self.keys)})

    @classmethod
    def of(cls, secrets: Iterable[bytes]) -> "Keyring":
        """A keyring of raw 32-byte keys, the first being the write key."""
        return cls(tuple(SealKey(s) for s in secrets))

    @property
    def write_key(self) -> SealKey:
        """The key new files are sealed under."""
        return self.keys[0]

    @property
    def ids(self) -> tuple[str, ...]:
        """The key ids held, write key first."""
        return tuple(k.key_id for k in self.keys)

    def get(self, key_id: str) -> SealKey | None:
        """The key with this id, or None."""
        return self._by_id.get(key_id)

    def __repr__(self) -> str:
        return f"Keyring(ids={list(self.ids)})"


def new_nonce() -> str:
    """A fresh file nonce: 192 bits from the OS's CSPRNG, as 48 hex digits."""
    return os.urandom(SEAL_NONCE_HEX // 2).hex()


def key_for(hdr: BlockHeader, keys: Keyring | None) -> SealKey:
    """The key that opens sealed file ``hdr``; UnknownKeyError when ``keys`` does not hold it (F-12.5)."""
    assert hdr.seal is not None
    k = keys.get(hdr.seal.key_id) if keys is not None else None
    if k is None:
        raise UnknownKeyError(hdr.seal.key_id, keys.ids if keys is not None else ())  # F-12.5
    return k


def header_aad(region: bytes | bytearray | memoryview) -> bytes:
    """The associated data of a sealed header region (§12.2): the region with the digits of kvf.hxxh3,
    kvf.dxxh3 and kvf.tag replaced by ASCII zeros (the three values the tag cannot cover)."""
    buf = bytearray(region[:header_length(region)])  # the header region only, however much was read
    h = _hxxh3_pos(buf)
    d, t = sealed_positions(buf, h)
    buf[h:h + HEX64_LEN] = b"0" * HEX64_LEN
    buf[d:d + HEX64_LEN] = b"0" * HEX64_LEN
    buf[t:t + SEAL_TAG_HEX] = b"0" * SEAL_TAG_HEX
    return bytes(buf)


def _file_key(secret: bytes, level: str, nonce: str) -> tuple[bytes, bytes]:
    """(AES-256 key, 96-bit IV) of one file: HKDF-SHA256(key, salt=nonce, info=label+level), 44 bytes (§12.4)."""
    hashes, _, _, _, HKDF = _crypto()
    okm: bytes = HKDF(algorithm=hashes.SHA256(), length=SEAL_KEY_BYTES + _IV_BYTES, salt=bytes.fromhex(nonce),
                      info=_KDF_INFO + level.encode()).derive(secret)
    return okm[:SEAL_KEY_BYTES], okm[SEAL_KEY_BYTES:]


def seal_data(level: str, key: SealKey, nonce: str, aad: bytes, payload: memoryview,
              out: memoryview | None = None) -> str:
    """The tag (32 hex digits) of a file of seal ``level``; with ``encrypt`` the ciphertext goes to ``out``
    (payload-sized, never the payload itself: the engine's row must keep its plaintext)."""
    _, Cipher, algorithms, modes, _ = _crypto()
    k, iv = _file_key(key.secret, level, nonce)
    enc = Cipher(algorithms.AES(k), modes.GCM(iv)).encryptor()
    enc.authenticate_additional_data(aad)
    if level == "encrypt":
        if out is None or len(out) != len(payload):
            raise ValueError("encrypt needs a payload-sized output buffer")
        if len(payload):
            enc.update_into(payload, out)
    elif len(payload):
        enc.authenticate_additional_data(payload)
    enc.finalize()
    tag: bytes = enc.tag
    return tag.hex()


_PIECE = 1 << 20  # decrypted through a per-thread scratch of this size: a fraction of a block, in cache
_scratch = threading.local()


def _decrypt_in_place(dec: Any, data: memoryview) -> None:
    """Decrypt ``data`` in place, piece by piece through a scratch buffer: cryptography 51 refuses an output
    that overlaps the input, even exactly (50 allowed it). Each piece's ``update_into`` releases the GIL."""
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        # update_into wants block size - 1 bytes of room past the input's length
        buf = _scratch.buf = memoryview(bytearray(_PIECE + 16))
    for at in range(0, len(data), _PIECE):
        piece = data[at:at + _PIECE]
        n = dec.update_into(piece, buf)
        piece[:n] = buf[:n]


def unseal_data(level: str, key: SealKey, fields: SealFields, aad: bytes, data: memoryview) -> None:
    """Check the tag of a sealed file over ``aad`` and ``data``; with ``encrypt`` decrypt ``data`` in place.

    Raises TagMismatchError (F-12.6). On failure after decryption began, ``data`` holds unauthenticated
    bytes: the caller zero-fills it (F-5.5) before anything reads it.
    """
    _, Cipher, algorithms, modes, _ = _crypto()
    from cryptography.exceptions import InvalidTag

    k, iv = _file_key(key.secret, level, fields.nonce)
    dec = Cipher(algorithms.AES(k), modes.GCM(iv, bytes.fromhex(fields.tag), min_tag_length=_TAG_BYTES)).decryptor()
    dec.authenticate_additional_data(aad)
    if level == "encrypt":
        _decrypt_in_place(dec, data)
    elif len(data):
        dec.authenticate_additional_data(data)
    try:
        dec.finalize()
    except InvalidTag:
        raise TagMismatchError(fields.key_id) from None  # F-12.6
