"""Sealed files at the format level (spec §12): the sealed vectors re-derived from the spec's words with other
code paths (stdlib HMAC for the key id and RFC 5869, cryptography's one-shot AESGCM), the GIL released by the
AEAD calls kvformat uses, every single-bit flip of a sealed file refused, fresh nonces, key sources, keyless
maintenance checks."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
import sys
import threading
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

import kvformat as K
from kvformat.errors import (
    ChecksumError, KeySourceError, KVFormatError, SchemaError, TagMismatchError, UnknownKeyError, UsageError,
)
from kvformat.format._keys import load_key, load_keyring

ROOT = Path(__file__).resolve().parent.parent
VALID = ROOT / "spec" / "vectors" / "valid"
SEALED = sorted(p.stem for p in VALID.glob("sealed-*.kvf"))


def small(level: str | None = None) -> K.CanonicalLayout:
    return K.CanonicalLayout.uniform("test/seal", "bfloat16", ["l0", "l1"], 4, 33, seal=level)  # 528 B: GCM tails


def ring(*secrets: bytes) -> K.Keyring:
    return K.Keyring.of(secrets or [os.urandom(32)])


# -- the spec's words, implemented again ---------------------------------------------------------------------
def _hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869, from its text (extract, then expand), with the standard library's HMAC."""
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    okm, t, i = b"", b"", 1
    while len(okm) < length:
        t = hmac.new(prk, t + info + bytes([i]), hashlib.sha256).digest()
        okm += t
        i += 1
    return okm[:length]


@pytest.mark.parametrize("name", SEALED)
def test_sealed_vector_follows_the_spec_text(name):
    raw = (VALID / f"{name}.kvf").read_bytes()
    exp = json.loads((VALID / f"{name}.json").read_text())
    secret = bytes.fromhex(exp["keys"][0])
    (n,) = struct.unpack_from("<Q", raw, 0)
    head, data = raw[:8 + n], raw[8 + n:]
    meta = json.loads(head[8:].rstrip(b" "))["__metadata__"]
    # §12.4 key id
    assert meta["kvf.key_id"] == hmac.new(secret, b"kvformat key id v1", hashlib.sha256).hexdigest()[:16]
    # §12.2 associated data: the three digit runs as ASCII zeros, found by the members' text
    aad = head
    for member, digits in (("kvf.hxxh3", 16), ("kvf.dxxh3", 16), ("kvf.tag", 32)):
        text = f'"{member}":"{meta[member]}"'.encode()
        assert aad.count(text) == 1
        aad = aad.replace(text, f'"{member}":"{"0" * digits}"'.encode())
    okm = _hkdf_sha256(secret, bytes.fromhex(meta["kvf.nonce"]), b"kvformat seal v1 " + meta["kvf.seal"].encode(), 44)
    gcm, iv, tag = AESGCM(okm[:32]), okm[32:], bytes.fromhex(meta["kvf.tag"])
    if meta["kvf.seal"] == "encrypt":
        payload = gcm.decrypt(iv, data + tag, aad)
        assert "kvf.raw_xxh3" not in meta
    else:
        assert gcm.encrypt(iv, b"", aad + data) == tag  # GMAC over header and payload
        payload = data
    hdr, decoded = K.decode(raw, keys=ring(secret))
    assert bytes(decoded) == payload
    sizes = hdr.layout.chunk_bytes_per_layer
    got = {l.name: __import__("xxhash").xxh3_64_hexdigest(payload[o:o + m])
           for l, o, m in zip(hdr.layout.layers, hdr.layout.layer_offsets, sizes)}
    assert got == exp["layers_xxh3"]


# -- the GIL -------------------------------------------------------------------------------------------------
def _python_ran_during(call) -> int:
    """How many loop iterations this thread ran while another thread was inside ``call()``.

    The switch interval is set far above the call's duration, so the only way this thread runs before the
    other one finishes is that ``call`` released the GIL: 0 means it held it throughout. Each iteration gives
    the GIL back (``sleep(0)``), so a call that releases it many times gets it back at once each time, not after
    a switch interval; an exception in the call is raised here (before, the loop waited for it for ever).
    """
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        started, state = threading.Event(), {"done": False, "error": None}

        def other() -> None:
            started.set()
            try:
                call()
            except BaseException as e:  # noqa: BLE001 - handed to the test's thread
                state["error"] = e
            finally:
                state["done"] = True

        t = threading.Thread(target=other)
        t.start()
        started.wait()
        n = 0
        while not state["done"]:
            n += 1
            time.sleep(0)
        t.join()
        if state["error"] is not None:
            raise state["error"]
        return n
    finally:
        sys.setswitchinterval(old)


def test_aead_calls_release_the_gil_on_large_buffers():
    """The three calls kvformat seals and opens with (cryptography's streaming AES-GCM): the GHASH of associated
    data (authenticate), update_into (encrypt) and in-place update_into (decrypt) run without the GIL on a
    32 MiB buffer, so several I/O threads seal on several cores. The control, a copy that holds the GIL,
    shows the probe can tell."""
    big = bytearray(os.urandom(32 << 20))
    out = bytearray(len(big))
    key, iv = os.urandom(32), os.urandom(12)
    assert _python_ran_during(lambda: memoryview(big).tobytes()) == 0  # holds the GIL: the probe sees it

    enc = Cipher(algorithms.AES(key), modes.GCM(iv)).encryptor()
    assert _python_ran_during(lambda: enc.authenticate_additional_data(big)) > 0
    enc = Cipher(algorithms.AES(key), modes.GCM(iv)).encryptor()
    assert _python_ran_during(lambda: enc.update_into(big, out)) > 0
    dec = Cipher(algorithms.AES(key), modes.GCM(iv, b"\0" * 16)).decryptor()
    assert _python_ran_during(lambda: dec.update_into(out, big)) > 0  # (cryptography 51: no overlap, even exact)
    # and kvformat's own entry points, end to end
    L = K.CanonicalLayout.uniform("test/seal", "bfloat16", ["l0"], 64, 576, blocks_per_chunk=256, seal="encrypt")
    payload = memoryview(big)[:L.payload_bytes]
    keys = ring()
    hdr, data = K.encode(payload, L, K.BlockKey("ab" * 8), keys=keys)
    assert _python_ran_during(lambda: K.encode(payload, L, K.BlockKey("ab" * 8), keys=keys)) > 0
    whole, back = bytes(hdr) + bytes(data), bytearray(len(payload))
    assert _python_ran_during(lambda: K.decode(whole, back, keys=keys)) > 0  # decrypted in place, piece by piece
    assert back == payload


# -- round trips and damage ----------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["authenticate", "encrypt"])
def test_every_bit_flip_of_a_sealed_file_is_refused(level):
    L = small(level)
    keys = ring()
    pay = os.urandom(L.payload_bytes)
    hdr, data = K.encode(pay, L, K.BlockKey("cd" * 8), keys=keys)
    f = hdr + bytes(data)
    assert bytes(K.decode(f, keys=keys)[1]) == pay
    # With verify off only the tag stands guard: it covers every byte but the two checksums' digits (§12.2).
    unguarded = {i for field in (b'"kvf.hxxh3":"', b'"kvf.dxxh3":"') for i in range(f.index(field) + 13,
                                                                                      f.index(field) + 29)}
    buf = bytearray(f)
    for bit in range(len(f) * 8):
        buf[bit >> 3] ^= 1 << (bit & 7)
        for verify in (True, False):
            if not verify and bit >> 3 in unguarded:
                continue
            try:
                K.decode(bytes(buf), keys=keys, verify=verify)
            except KVFormatError:
                pass
            else:
                pytest.fail(f"bit {bit} flipped and the file still opened (verify={verify})")
        buf[bit >> 3] ^= 1 << (bit & 7)


def test_nonces_are_fresh_and_ciphertexts_differ():
    L, keys, pay = small("encrypt"), ring(), os.urandom(small().payload_bytes)
    files = [K.encode(pay, L, K.BlockKey("ee" * 8), keys=keys) for _ in range(4)]
    hdrs = [K.decode(h + bytes(d), keys=keys)[0] for h, d in files]
    assert len({h.seal.nonce for h in hdrs}) == 4 and len({bytes(d) for _, d in files}) == 4
    assert all(bytes(K.decode(h + bytes(d), keys=keys)[1]) == pay for h, d in files)


def test_writer_refusals():
    with pytest.raises(UsageError, match="needs a keyring"):
        K.encode(os.urandom(small().payload_bytes), small("encrypt"), K.BlockKey("aa" * 8))
    with pytest.raises(SchemaError, match="not compressed"):
        K.encode(os.urandom(small().payload_bytes), small("encrypt"), K.BlockKey("aa" * 8), keys=ring(), codec="zstd")
    with pytest.raises(SchemaError) as ei:
        small("sign")
    assert ei.value.field == "kvf.seal"


def test_file_api_and_keyless_maintenance(tmp_path):
    keys = ring()
    L = small("encrypt")
    pay = os.urandom(L.payload_bytes)
    p = tmp_path / "b.kvf"
    K.save_file(pay, p, L, K.BlockKey("ab" * 8), keys=keys)
    out = bytearray(L.payload_bytes)
    K.read_into(p, out, expect=L, keys=keys)
    assert bytes(out) == pay
    with K.open_block(p, keys=keys) as b:
        assert b.header.seal.key_id == keys.write_key.key_id
    assert K.verify_file(p).layout == L  # no key: header and stored-data checksums
    assert K.verify_file(p, keys=keys).seal is not None  # the tag too
    with pytest.raises(UnknownKeyError):
        K.verify_file(p, keys=ring())
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0x80
    p.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError):  # damage shows without a key ...
        K.verify_file(p)
    with pytest.raises(ChecksumError):  # ... and, with one, as damage (F-5.2 first), not as a forgery
        K.read_into(p, out, keys=keys)
    with pytest.raises(TagMismatchError):  # verify off: the tag still refuses it
        K.read_into(p, out, keys=keys, verify=False)
    assert bytes(out) == bytes(len(out))


# -- key sources ---------------------------------------------------------------------------------------------
def test_key_sources(tmp_path, monkeypatch):
    secret = os.urandom(32)
    kid = K.SealKey(secret).key_id
    f = tmp_path / "k"
    f.write_text("\n  " + secret.hex().upper() + "  \n")  # whitespace and either case
    assert load_key(str(f)).key_id == kid
    link = tmp_path / "link"
    link.symlink_to(f)  # secret mounts (Kubernetes) are symlinks
    assert load_key(str(link)).key_id == kid
    monkeypatch.setenv("KVF_SEAL_TEST", secret.hex())
    assert load_key("env:KVF_SEAL_TEST").key_id == kid
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases = {str(fifo): "not a regular file", str(tmp_path / "none"): "No such file",
             "env:KVF_SEAL_UNSET": "not set", str(tmp_path): "not a regular file"}
    (tmp_path / "two").write_text(secret.hex() + "\n" + os.urandom(32).hex())
    cases[str(tmp_path / "two")] = "expected one key"
    for src, why in cases.items():
        with pytest.raises(KeySourceError, match=why) as ei:
            load_key(src)
        assert secret.hex() not in str(ei.value)
    with pytest.raises(KeySourceError, match="a literal key") as ei:
        load_key(secret.hex())
    assert secret.hex() not in str(ei.value)
    other = tmp_path / "old"
    old = os.urandom(32)
    other.write_text(old.hex())
    kr = load_keyring(str(f), [str(other), str(f)])
    assert kr.ids == (kid, K.SealKey(old).key_id) and kr.write_key.key_id == kid
    assert secret.hex() not in repr(kr) + repr(kr.write_key) + str(kr.keys)
    assert kr.get(K.SealKey(old).key_id).secret == old and kr.get("0" * 16) is None


def test_tag_is_checked_over_the_header_bytes_that_were_parsed():
    """A file whose header is rewritten in place between the header read and the tag check (a writer racing the
    reader): the header parsed names another block (kvf.key edited, checksum recomputed), the bytes on storage are
    then the genuine header again. Checking the tag over a second read of the header would accept the genuine
    file under the new name; the reader checks it over the bytes it parsed."""
    from kvformat.format._read import BytesSource, read_payload_from

    keys, L = ring(), small("authenticate")
    pay = os.urandom(L.payload_bytes)
    hdr, data = K.encode(pay, L, K.BlockKey("11" * 8), keys=keys)
    genuine = hdr + bytes(data)
    edited = bytearray(genuine.replace(("11" * 8).encode(), ("22" * 8).encode()))
    h = edited.index(b'"kvf.hxxh3":"') + 13
    edited[h:h + 16] = b"0" * 16
    edited[h:h + 16] = __import__("xxhash").xxh3_64_hexdigest(bytes(edited[:len(hdr)])).encode()

    class Racing(BytesSource):
        def pread(self, offset: int, n: int) -> memoryview:
            got = super().pread(offset, n)
            self._mv = memoryview(genuine)  # rewritten in place right after the reader's first look
            return got

    out = bytearray(len(pay))
    with pytest.raises(TagMismatchError):
        read_payload_from(Racing(bytes(edited)), out, key=K.BlockKey("22" * 8), keys=keys)
    assert bytes(out) == bytes(len(out))
    read_payload_from(BytesSource(genuine), out, key=K.BlockKey("11" * 8), keys=keys)  # the genuine file opens
    assert bytes(out) == pay
