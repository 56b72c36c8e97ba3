#!/usr/bin/env python
"""Generate the conformance vectors of spec/FORMAT.md into spec/vectors/{valid,invalid}/.

Deterministic: fixed seeds, fixed ``created`` time, fixed writer string, so regenerating gives the
same bytes (tests/test_vectors.py checks that; a difference means the format changed).

Valid vectors come from the real writer. Invalid ones are forged from a valid file: the header
JSON is edited, re-padded to the 4096 boundary and (unless the point is a bad checksum) its
kvf.hxxh3 is recomputed, so each vector reaches exactly the check its MUST id names.

Usage: python tools/gen_vectors.py [OUTDIR]   (default: spec/vectors)
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from typing import Any, Callable

import numpy as np
import xxhash

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import kvformat as K  # noqa: E402
from kvformat.format import _codec  # noqa: E402
from kvformat.format._consts import ALIGNMENT, HEX64_LEN, HEX64_ZERO  # noqa: E402

CREATED = 1767225600  # 2026-01-01T00:00:00Z
WRITER = "kvformat-vectors"
HXXH3_KEY = b'"kvf.hxxh3":"'
# §12: the published test keys of the sealed vectors (never use them for anything else) and fixed nonces, so
# the sealed vectors are as reproducible as the others.
SEAL_KEY = hashlib.sha256(b"kvformat vectors: seal key A").hexdigest()
OTHER_KEY = hashlib.sha256(b"kvformat vectors: seal key B").hexdigest()
NONCES = [hashlib.sha256(f"kvformat vectors: nonce {i}".encode()).hexdigest()[:48] for i in range(4)]


def _prov(**kw: Any) -> K.Provenance:
    return K.Provenance(writer=WRITER, created=CREATED, **kw)


def _payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _bf16_payload(n: int, seed: int, itemsize: int = 2) -> bytes:
    """KV-like floats (normal, per-channel scale): their high byte planes compress, their low ones do not (§6.2).
    bf16 by truncating float32 (``itemsize`` 2), or the float32 values themselves (4)."""
    rng = np.random.default_rng(seed)
    words = (rng.standard_normal(n // itemsize) * np.exp(rng.standard_normal(16)).repeat(-(-n // itemsize // 16))
             [:n // itemsize]).astype(np.float32).view(np.uint32)
    return (words >> 16).astype(np.uint16).tobytes() if itemsize == 2 else words.tobytes()


def _names(n: int, prefix: str = "model.layers") -> list[str]:
    return [f"{prefix}.{i}.self_attn.attn" for i in range(n)]


def file_bytes(payload: bytes, layout: K.CanonicalLayout, key: K.BlockKey, prov: K.Provenance, codec: str = "none",
               level: int | None = None) -> bytes:
    if level is None:
        level = 1 if codec == "planes" else 3  # each codec's default (§6)
    hdr, data = K.encode(payload, layout, key, provenance=prov, codec=codec, level=level)
    return hdr + bytes(data)


def keyring(*hex_keys: str) -> K.Keyring:
    return K.Keyring.of(bytes.fromhex(k) for k in hex_keys)


def sealed_bytes(payload: bytes, layout: K.CanonicalLayout, key: K.BlockKey, prov: K.Provenance, nonce: str) -> bytes:
    """A sealed file under SEAL_KEY with a fixed nonce (a real writer draws it at random: W-12.1)."""
    from kvformat.format._block import encode_block

    hdr, data, _ = encode_block(payload, layout, key, provenance=prov, keys=keyring(SEAL_KEY), nonce=nonce)
    return hdr + bytes(data)


# ---------------------------------------------------------------- forging helpers (invalid vectors)

def split(f: bytes) -> tuple[dict[str, Any], bytes]:
    """(header JSON as an ordered dict, data section) of a valid file."""
    (n,) = struct.unpack_from("<Q", f, 0)
    return json.loads(f[8:8 + n].rstrip(b" ")), f[8 + n:]


def dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def forge(body: bytes | dict[str, Any], data: bytes, *, fix_checksum: bool = True, pad: bytes = b" ") -> bytes:
    """Length field + body + padding to the 4096 boundary + data, kvf.hxxh3 recomputed (spec §3, §5.1)."""
    if isinstance(body, dict):
        body = dumps(body)
    total = -(-(8 + len(body)) // ALIGNMENT) * ALIGNMENT
    buf = bytearray(struct.pack("<Q", total - 8) + body + pad * (total - 8 - len(body)))
    i = buf.find(HXXH3_KEY)
    if fix_checksum and i >= 0:
        pos = i + len(HXXH3_KEY)
        buf[pos:pos + HEX64_LEN] = HEX64_ZERO
        buf[pos:pos + HEX64_LEN] = xxhash.xxh3_64_hexdigest(bytes(buf)).encode()
    return bytes(buf) + data


def with_meta(f: bytes, **changes: Any) -> bytes:
    """Edit __metadata__ (None deletes a key) and re-forge."""
    doc, data = split(f)
    meta = doc["__metadata__"]
    for k, v in changes.items():
        k = k.replace("__", ".")
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    return forge(doc, data)


def text_edit(f: bytes, old: bytes, new: bytes, *, fix_checksum: bool = True) -> bytes:
    (n,) = struct.unpack_from("<Q", f, 0)
    body = f[8:8 + n].rstrip(b" ")
    assert body.count(old) == 1, old
    return forge(body.replace(old, new), f[8 + n:], fix_checksum=fix_checksum)


def flip(f: bytes, byte: int, bit: int) -> bytes:
    b = bytearray(f)
    b[byte] ^= 1 << bit
    return bytes(b)


# ---------------------------------------------------------------- the vectors

def base() -> tuple[bytes, K.CanonicalLayout, K.BlockKey, bytes]:
    """The small file most invalid vectors are forged from: 2 bf16 layers x 4 tokens x 32."""
    L = K.CanonicalLayout.uniform("test/tiny-mla", "bfloat16", _names(2), 4, 32)
    key = K.BlockKey("0123456789abcdef" * 2)
    pay = _payload(L.payload_bytes, 100)
    return file_bytes(pay, L, key, _prov(tp=2, row="replicated")), L, key, pay


def dsa_layout(**kw: Any) -> K.CanonicalLayout:
    """2 DSA layers: fp8_ds_mla latents (656 B/token) and indexer caches (132 B/token), 4 tokens each."""
    layers = []
    for i in range(2):
        layers.append(K.LayerSpec(f"model.layers.{i}.self_attn.attn", "U8", (4, 656)))
        layers.append(K.LayerSpec(f"model.layers.{i}.self_attn.indexer.k_cache", "U8", (4, 132), role="dsa_indexer",
                                  kv_dtype="dsa_indexer_fp8"))
    return K.CanonicalLayout(model="deepseek-ai/DeepSeek-V3.2", kv_dtype="fp8_ds_mla", tokens_per_block=4,
                             blocks_per_chunk=1, tokens_per_hash=4, layers=tuple(layers), **kw)


def valid_vectors() -> dict[str, tuple[bytes, bytes, K.CanonicalLayout]]:
    """name -> (file bytes, decoded payload, layout)."""
    out: dict[str, tuple[bytes, bytes, K.CanonicalLayout]] = {}

    def add(name: str, L: K.CanonicalLayout, key: K.BlockKey, prov: K.Provenance, seed: int, codec: str = "none",
            payload: bytes | None = None) -> None:
        pay = payload if payload is not None else _payload(L.payload_bytes, seed)
        out[name] = (file_bytes(pay, L, key, prov, codec), pay, L)

    add("bf16-2layers", K.CanonicalLayout.uniform("test/tiny-mla", "bfloat16", _names(2), 16, 64),
        K.BlockKey("a1" * 16), _prov(tp=1, row="replicated"), 1)
    add("fp8-ds-mla-packed-u8", K.CanonicalLayout.uniform(
        "deepseek-ai/DeepSeek-V3.2-Exp", "fp8_ds_mla", _names(3), 4, 656, tokens_per_hash=8, blocks_per_chunk=2),
        K.BlockKey("b2" * 32), _prov(tp=8, row="per_worker"), 2)
    add("f32-3blocks-revision-group1", K.CanonicalLayout.uniform(
        "org/model-f32", "float32", _names(2), 8, 16, blocks_per_chunk=3, revision="0123abcd", group=1),
        K.BlockKey("c3" * 8, group=1), _prov(tp=4, pp=2, row="canonical"), 3)
    add("f16-mha-3d", K.CanonicalLayout(
        model="org/mha-model", kv_dtype="float16", tokens_per_block=8, blocks_per_chunk=1, tokens_per_hash=8,
        family="mha", layers=tuple(K.LayerSpec(n, "F16", (8, 2, 2, 16)) for n in _names(2))),
        K.BlockKey("d4" * 16), _prov(), 4)
    L61 = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3", "bfloat16", _names(61), 1, 576)
    add("deepseek-v3-61layers-1token", L61, K.BlockKey("e5" * 16), _prov(tp=8, row="replicated"), 5)
    Lz = K.CanonicalLayout.uniform("test/tiny-mla", "bfloat16", _names(4), 16, 128)
    zpay = bytes(np.random.default_rng(6).integers(0, 4, Lz.payload_bytes, dtype=np.uint8))  # compressible
    add("zstd-bf16-4layers", Lz, K.BlockKey("f6" * 16), _prov(tp=2, row="replicated"), 6, codec="zstd", payload=zpay)
    # §6.2 byte planes: bf16 (2 planes: the high one a frame, the low one raw), f32 (4 planes), and a packed U8
    # layout (fp8_ds_mla: one plane, one frame).
    Lp = K.CanonicalLayout.uniform("test/tiny-mla", "bfloat16", _names(2), 16, 64)
    add("planes-bf16-2layers", Lp, K.BlockKey("c1" * 16), _prov(tp=2, row="replicated"), 0, codec="planes",
        payload=_bf16_payload(Lp.payload_bytes, 13))
    Lp4 = K.CanonicalLayout.uniform("org/model-f32", "float32", _names(2), 8, 64, blocks_per_chunk=2)
    add("planes-f32-2blocks", Lp4, K.BlockKey("c2" * 16), _prov(tp=1, row="replicated"), 0, codec="planes",
        payload=_bf16_payload(Lp4.payload_bytes, 14, itemsize=4))
    Lp1 = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3.2-Exp", "fp8_ds_mla", _names(2), 4, 656)
    add("planes-fp8-ds-mla-1plane", Lp1, K.BlockKey("c3" * 16), _prov(tp=8, row="replicated"), 0, codec="planes",
        payload=bytes(np.random.default_rng(15).integers(0, 8, Lp1.payload_bytes, dtype=np.uint8)))
    # §4.3 (1.1): a DSA chunk (DeepSeek-V3.2 / GLM-5): MLA latents and indexer caches interleaved, each
    # layer with its own dtype, shape and role.
    out_dsa = dsa_layout()
    add("dsa-fp8-mla-indexer-1.1", out_dsa, K.BlockKey("a7" * 16), _prov(tp=8, row="replicated"), 7)
    # §4.5: the same DSA chunk as the tier writes it: the indexer's order and encoding named in the identity
    # (CUDA and OCP-fp8 ROCm writers: e4m3fn keys, f32 scales), and an fp8 latent written on gfx942 (e4m3fnuz).
    add("dsa-form-pinned-1.1", dsa_layout(pins={"form.dsa_indexer_fp8": "split/e4m3fn+f32"}), K.BlockKey("b7" * 16),
        _prov(tp=2, dcp=2, row="per_worker", cp_interleave=8), 10)
    add("fp8-fnuz-form-pinned-1.1", K.CanonicalLayout.uniform(
        "deepseek-ai/DeepSeek-V3", "fp8", _names(2), 4, 576, pins={"form.fp8": "rows/e4m3fnuz"}),
        K.BlockKey("b8" * 16), _prov(tp=8, row="replicated"), 11)
    # §4.3 (1.1): an opaque region, its row order pinned in kvf.pins.
    Lo = K.CanonicalLayout(model="test/opaque", kv_dtype="bfloat16", tokens_per_block=4, blocks_per_chunk=2,
                           tokens_per_hash=4, layers=(K.LayerSpec("kvf.opaque", "U8", (96,), role="opaque"),),
                           pins={"opaque": "v1", "row.kv_cache_layout": "BLHNC", "row.worker_bytes_per_block": "96",
                                 "row.layers_sha256": "00" * 32})
    add("opaque-region-1.1", Lo, K.BlockKey("a8" * 16), _prov(row="per_worker"), 8)
    # §4.4: written by a PP=2 x DCP=2 x TP=4 deployment: its partition and interleave are provenance only.
    add("pp2-dcp2-provenance", K.CanonicalLayout.uniform("test/tiny-mla", "bfloat16", _names(2), 8, 64),
        K.BlockKey("a9" * 16), _prov(tp=4, pp=2, dcp=2, row="per_worker", pp_layers=(1, 1), cp_interleave=8), 9)
    # §12 (1.2): sealed files, one per level (the readers get SEAL_KEY), and an encrypted DSA chunk (roles too).
    f, L, key, pay = base()
    for i, level in enumerate(("authenticate", "encrypt")):
        out[f"sealed-{level}"] = (sealed_bytes(pay, L.with_seal(level), key, _prov(tp=2, row="replicated"), NONCES[i]),
                                  pay, L.with_seal(level))
    Ld = dsa_layout().with_seal("encrypt")
    dpay = _payload(Ld.payload_bytes, 10)
    out["sealed-encrypt-dsa-roles"] = (sealed_bytes(dpay, Ld, K.BlockKey("aa" * 16), _prov(tp=8, row="replicated"),
                                                    NONCES[2]), dpay, Ld)
    # §7: a newer minor with keys this reader does not know: accepted, keys kept in BlockHeader.extra.
    doc, data = split(f)
    meta = doc["__metadata__"]
    meta["kvformat"] = "1.9"
    meta["kvf.future_field"] = "kept"
    out["minor-1.9-extra-keys"] = (forge(doc, data), pay, L)
    return out


# What each invalid vector must raise beyond its class: the structured field/region where the error has one,
# and a pattern its message must match (re.search on KVFormatError.message), so a check that starts failing
# for another reason (another field, a later check) is caught.
PINS: dict[str, dict[str, str]] = {
    "roles-wrong-length": {"message": r"^kvf\.roles: expected one \[role, kv_dtype\] per layer \(4\)$"},
    "roles-unknown-role": {"message": r"^kvf\.roles: expected a role in \(.*\), got 'gqa'$"},
    "roles-all-default": {"message": r"^kvf\.roles: present but every layer is a plain MLA latent"},
    "opaque-with-another-layer": {"message": r"^kvf\.roles: an opaque layer is the only layer of its file$"},
    "pins-not-strings": {"message": r"^kvf\.pins: expected an object of strings$"},
    "form-pin-wrong-order": {"message": r"^kvf\.pins: form\.dsa_indexer_fp8: expected 'split/<encoding>' or "
                                        r"'unknown:<platform>', got 'rows/e4m3fn\+f32'$"},
    "form-pin-no-such-dtype": {"message": r"^kvf\.pins: form\.fp8_e5m2: no layer of KV dtype 'fp8_e5m2'$"},
    "form-pin-mismatch": {"message": r"^layout mismatch on pins: expected \{'form\.dsa_indexer_fp8': "
                                     r"'split/e4m3fn\+f32'\}, found \{'form\.dsa_indexer_fp8': "
                                     r"'split/e4m3fnuz\+f32'\}$"},
    "dsa-wrong-layer-table": {"message": r"^layout mismatch on layers\[0\]: expected \[.*'U8', \[4, 394\]\], "
                                         r"found \[.*'U8', \[4, 656\]\]$"},
    "dsa-role-mismatch": {"message": r"^layout mismatch on layers\[1\]\.role: expected \['mla', 'fp8_ds_mla'\], "
                                     r"found \['dsa_indexer', 'dsa_indexer_fp8'\]$"},
    "pp-layers-wrong-count": {"message": r"^kvf\.pp_layers: expected 1 layer counts \(kvf\.pp\), got \[3, 1\]$"},
    "cp-interleave-zero": {"message": r"^kvf\.cp_interleave: expected 1\.\.65536, got 0$"},
    "bad-dxxh3": {"message": r"^kvf\.dxxh3: expected 16 lowercase hex digits, got 'xyz'"},
    "bad-row": {"message": r"^kvf\.row: expected one of \(.*\), got 'sidewa"},
    "bad-version-syntax": {"message": r"^the version string is not MAJOR\.MINOR$"},
    "duplicate-key": {"message": r"^duplicate key 'kvf\.family' in header JSON$"},
    "five-dims": {"message": r"^layer\.shape: expected 1\.\.4 positive ints, got \(4, 2, 2, 2, 4\)"},
    "flip-in-codec": {"message": r"^header checksum mismatch: header says [0-9a-f]{16}, bytes hash to [0-9a-f]{16}$"},
    "hxxh3-not-second": {"message": r"^kvf\.hxxh3 does not follow the version string$"},
    "hxxh3-uppercase": {"message": r"^header checksum mismatch: header says [0-9A-F]{16}, bytes hash to [0-9a-f]{16}$"},
    "invalid-json": {"message": r"^header is not valid UTF-8 JSON: Expecting value"},
    "invalid-utf8": {"message": r"^header is not valid UTF-8 JSON: 'utf-8' codec can't decode byte 0xff"},
    "key-mismatch": {"message": r"^layout mismatch on key: expected 'f{32}:0', found '0123456789ab"},
    "layout-mismatch": {"message": r"^layout mismatch on tokens_per_hash: expected 8, found 4$"},
    "leading-zero-version": {"message": r"^the version string is not MAJOR\.MINOR$"},
    "long-name": {"message": r"^layer\.name: expected 1\.\.256 bytes, got 257$"},
    "major-2": {"message": r"^format version '2\.0' is not supported \(this reader reads major 1\)$"},
    "misaligned-length": {"message": r"^header length 4089 does not put the data section on a 4096-byte boundary$"},
    "missing-key": {"message": r"^kvf\.model: missing from __metadata__$"},
    "non-string-value": {"message": r"^kvf\.tp: __metadata__ values must be strings, got int$"},
    "noncanonical-int": {"message": r"^kvf\.tokens_per_block: expected a canonical decimal integer, got '04'$"},
    "nonspace-padding": {"message": r"^header JSON is not one object followed by space padding$"},
    "offsets-gap": {"field": "tensor model.layers.1.self_attn.attn.data_offsets",
                    "message": r": expected to start at 256, starts at 258$"},
    "offsets-size": {"field": "tensor model.layers.0.self_attn.attn.data_offsets",
                     "message": r": \[0, 200\] does not hold shape \[1, 4, 32\] of BF16$"},
    "oversized-header": {"message": r"^header length is 2097144, over the limit of 1048576$"},
    "padding-bitflip": {"message": r"^header checksum mismatch: header says [0-9a-f]{16}, bytes hash to [0-9a-f]{16}$"},
    "payload-bitflip": {"message": r"^data checksum mismatch: header says [0-9a-f]{16}, bytes hash to [0-9a-f]{16}$"},
    "payload-over-4gib": {"message": r"^payload: 4294967297 bytes is over the limit 4294967296$"},
    "plain-safetensors": {"message": r"^not a kvformat file: the header does not start with the kvformat prefix$"},
    "reserved-name": {"message": r"^layer\.name: reserved name 'kvf\.extra'$"},
    "shape-blocks-per-chunk": {"field": "tensor model.layers.0.self_attn.attn.shape",
                               "message": r": expected \[2, tokens, \.\.\.\], got \[1, 4, 32\]$"},
    "shape-tokens-per-block": {"field": "layer model.layers.0.self_attn.attn.shape",
                               "message": r": expected first dim 8 \(tokens_per_block\), got 4$"},
    "too-many-layers": {"message": r"^tensors: expected 1\.\.1024 tensors, got 1025$"},
    "trailing-bytes": {"message": r"^1 trailing bytes after the data section$"},
    "truncated-data": {"message": r"^truncated data: need 4608 bytes, have 4607$"},
    "truncated-header": {"message": r"^truncated header: need 4096 bytes, have 2000$"},
    "truncated-length": {"message": r"^truncated length field: need 8 bytes, have 5$"},
    "unknown-codec": {"message": r"^kvf\.codec: expected one of \('none', 'zstd', 'planes'\), got 'lz4'$"},
    "unknown-dtype": {"field": "tensor model.layers.0.self_attn.attn.dtype", "message": r": unknown dtype 'BF17'$"},
    "uppercase-key": {"message": r"^key\.hash: expected lowercase hex, got '0123456789ABCDEF"},
    "zero-header": {"message": r"^not a kvformat file: the header does not start with the kvformat prefix$"},
    "zstd-bad-layers": {"message": r"^kvf\.layers: expected a list of \[name, dtype, shape\]"},
    "zstd-raw-mismatch": {"message": r"^raw checksum mismatch: header says [0-9a-f]{16}, bytes hash to [0-9a-f]{16}$"},
    "zstd-truncated-frame": {"message": r"^zstd frame decoded to 0 bytes, expected 512$"},
    "zstd-wrong-size": {"message": r"^zstd frame declares 513 decoded bytes, the layout needs 512$"},
    "sealed-unknown-level": {"message": r"^kvf\.seal: expected one of \('authenticate', 'encrypt'\), got 'obfuscate'$"},
    "sealed-fields-without-seal": {"message": r"^kvf\.key_id: seal fields without kvf\.seal$"},
    "sealed-compressed": {"message": r"^kvf\.codec: a sealed file is not compressed$"},
    "sealed-truncated-tag": {"message": r"^kvf\.tag: expected 32 lowercase hex digits, got '[0-9a-f]{24}'$"},
    "sealed-short-nonce": {"message": r"^kvf\.nonce: expected 48 lowercase hex digits, got '[0-9a-f]{32}'$"},
    "sealed-member-order": {"message": r"^a sealed header must continue kvf\.hxxh3 with kvf\.codec, kvf\.dxxh3, kvf\.tag "
                                       r"and kvf\.seal, in this order$"},
    "sealed-encrypt-layer-tensors": {"message": r"^tensors: an encrypted file holds exactly one U8 tensor named "
                                                r"kvf\.sealed$"},
    "sealed-wrong-key": {"message": r"^sealed under key [0-9a-f]{16}; this reader holds [0-9a-f]{16}$"},
    "sealed-authenticate-no-key": {"message": r"^sealed under key [0-9a-f]{16}; this reader holds no key$"},
    "sealed-planted-payload": {"message": r"^authentication tag does not verify under key [0-9a-f]{16}: the file was "
                                          r"written without the key or altered since$"},
    "sealed-swapped-payload": {"message": r"^authentication tag does not verify under key [0-9a-f]{16}"},
    "sealed-replayed-key-edited": {"message": r"^authentication tag does not verify under key [0-9a-f]{16}"},
    "sealed-replayed-new-name": {"message": r"^layout mismatch on key: expected 'b{32}:0', found '0123456789ab"},
    "sealed-level-relabelled": {"message": r"^authentication tag does not verify under key [0-9a-f]{16}"},
    "sealed-tag-digit-changed": {"message": r"^authentication tag does not verify under key [0-9a-f]{16}"},
    "sealed-clear-file-expected-sealed": {"message": r"^layout mismatch on seal: expected 'encrypt', found None$"},
    "planes-wrong-tensor": {"field": "tensors",
                            "message": r"^tensors: a compressed file holds exactly one U8 tensor named kvf\.planes$"},
    "planes-unknown-method": {"message": r"^kvf\.plane_table: expected a list of 1\.\.8 \[method, stored bytes\] "
                                         r"pairs, method one of \('raw', 'zstd'\)$"},
    "planes-sizes-mismatch": {"message": r"^kvf\.plane_table: the planes store (\d+) bytes, the data section holds "
                                         r"\d+$"},
    "planes-table-on-zstd": {"message": r"^kvf\.plane_table: present in a file that is not plane-coded$"},
    "planes-frame-wrong-size": {"message": r"^plane 1: zstd frame declares 2049 decoded bytes, the layout needs "
                                           r"2048$"},
    "planes-frame-truncated": {"message": r"^plane 1: zstd frame decoded to \d+ bytes, expected 2048$"},
    "planes-raw-mismatch": {"message": r"^raw checksum mismatch: header says [0-9a-f]{16}, bytes hash to "
                                       r"[0-9a-f]{16}$"},
    "zstd-wrong-tensor": {"field": "tensors",
                          "message": r"^tensors: a compressed file holds exactly one U8 tensor named kvf\.zstd$"},
}

InvalidSpec = tuple[bytes, str, str, str, dict[str, Any]]  # bytes, error class, MUST id, what, extra expectations


def invalid_vectors() -> dict[str, InvalidSpec]:
    f, L, key, pay = base()
    doc, data = split(f)
    Lz = K.CanonicalLayout.uniform("test/tiny-mla", "bfloat16", _names(2), 4, 32)
    zpay = bytes(np.random.default_rng(7).integers(0, 4, Lz.payload_bytes, dtype=np.uint8))
    z = file_bytes(zpay, Lz, key, _prov(), "zstd")
    zdoc, zdata = split(z)
    (n,) = struct.unpack_from("<Q", f, 0)
    v: dict[str, InvalidSpec] = {}

    def add(name: str, b: bytes, err: str, must: str, what: str, **extra: Any) -> None:
        v[name] = (b, err, must, what, {**extra, **PINS.get(name, {})})

    # §3 byte layout
    add("truncated-length", f[:5], "TruncatedError", "F-3.1", "5 bytes: no complete length field", region="length field")
    add("misaligned-length", struct.pack("<Q", n + 1) + f[8:], "HeaderError", "F-3.2", "8+N is not a multiple of 4096")
    add("truncated-header", f[:2000], "TruncatedError", "F-3.3", "file ends inside the header region", region="header")
    add("truncated-data", f[:-1], "TruncatedError", "F-3.4", "file ends 1 byte before the data section does",
        region="data")
    add("trailing-bytes", f + b"\0", "HeaderError", "F-3.4", "1 byte after the data section")
    add("nonspace-padding", forge(dumps(doc) + b"\n", data), "InvalidJSONError", "F-3.5",
        "a newline (not a space) in the padding after the JSON")
    # §4 header
    import safetensors.numpy

    add("plain-safetensors", safetensors.numpy.save({"x": np.zeros((4, 4), dtype=np.float32)}), "NotKVFormatError",
        "F-4.1", "a plain safetensors file (no kvformat prefix)")
    add("zero-header", struct.pack("<Q", 4088) + bytes(4088) + data, "NotKVFormatError", "F-4.1",
        "aligned length field, zero bytes instead of JSON")
    add("bad-version-syntax", text_edit(f, b'"kvformat":"1.0"', b'"kvformat":"1.x"'), "HeaderError", "F-4.2",
        "version is not MAJOR.MINOR")
    add("leading-zero-version", text_edit(f, b'"kvformat":"1.0"', b'"kvformat":"01.0"'), "HeaderError", "F-4.2",
        "version 01.0 is not canonical decimal")
    m = doc["__metadata__"]
    swapped = {"kvformat": m["kvformat"], "kvf.codec": m["kvf.codec"], "kvf.hxxh3": m["kvf.hxxh3"]}
    swapped.update({k: x for k, x in m.items() if k not in swapped})
    add("hxxh3-not-second", forge({"__metadata__": swapped, **{k: x for k, x in doc.items() if k != "__metadata__"}},
                                  data), "HeaderError", "F-4.2", "kvf.hxxh3 is not the second metadata key")
    add("invalid-json", text_edit(f, b'"kvf.codec":"none"', b'"kvf.codec":none'), "InvalidJSONError", "F-4.3",
        "a bare word where a string belongs")
    add("duplicate-key", text_edit(f, b'"kvf.family":"mla"', b'"kvf.family":"mla","kvf.family":"mha"'),
        "InvalidJSONError", "F-4.3", "kvf.family twice")
    add("invalid-utf8", text_edit(f, b'"test/tiny-mla"', b'"test/tiny-\xff\xfe"'), "InvalidJSONError", "F-4.3",
        "model id is not UTF-8")
    add("missing-key", with_meta(f, kvf__model=None), "SchemaError", "F-4.4", "kvf.model missing", field="kvf.model")
    add("non-string-value", with_meta(f, kvf__tp=2), "SchemaError", "F-4.4", "kvf.tp is a JSON number",
        field="kvf.tp")
    add("noncanonical-int", with_meta(f, kvf__tokens_per_block="04"), "SchemaError", "F-4.5",
        "tokens_per_block '04' has a leading zero", field="kvf.tokens_per_block")
    add("unknown-codec", with_meta(f, kvf__codec="lz4"), "SchemaError", "F-4.6", "codec lz4", field="kvf.codec")
    d2 = json.loads(json.dumps(doc))
    d2[L.layers[0].name]["dtype"] = "BF17"
    add("unknown-dtype", forge(d2, data), "SchemaError", "F-4.7", "tensor dtype BF17")
    d2 = json.loads(json.dumps(doc))
    d2[L.layers[0].name]["data_offsets"] = [0, 200]
    d2[L.layers[1].name]["data_offsets"] = [200, 456]
    add("offsets-size", forge(d2, data[:456]), "SchemaError", "F-4.7", "data_offsets hold 200 bytes, shape needs 256")
    d2 = json.loads(json.dumps(doc))
    d2[L.layers[1].name]["data_offsets"] = [258, 514]
    add("offsets-gap", forge(d2, data[:256] + b"\0\0" + data[256:]), "SchemaError", "F-4.8",
        "2-byte gap between the tensors")
    add("shape-blocks-per-chunk", with_meta(f, kvf__blocks_per_chunk="2"), "SchemaError", "F-4.9",
        "tensor first dim 1, kvf.blocks_per_chunk 2")
    add("shape-tokens-per-block", with_meta(f, kvf__tokens_per_block="8"), "SchemaError", "F-4.10",
        "tensor tokens dim 4, kvf.tokens_per_block 8")
    d2 = json.loads(json.dumps(doc))
    d2 = {("kvf.extra" if k == L.layers[0].name else k): x for k, x in d2.items()}
    add("reserved-name", forge(d2, data), "SchemaError", "F-4.11", "a layer named kvf.extra", field="layer.name")
    add("uppercase-key", with_meta(f, kvf__key=key.hash.upper()), "SchemaError", "F-4.12", "kvf.key in upper case",
        field="key.hash")
    add("bad-row", with_meta(f, kvf__row="sideways"), "SchemaError", "F-4.12", "kvf.row not a known row layout",
        field="kvf.row")
    add("pp-layers-wrong-count", with_meta(f, kvf__pp_layers="3,1"), "SchemaError", "F-4.16",
        "kvf.pp_layers lists 2 stages, kvf.pp says 1", field="kvf.pp_layers")
    add("cp-interleave-zero", with_meta(f, kvf__cp_interleave="0"), "SchemaError", "F-4.16",
        "kvf.cp_interleave 0", field="kvf.cp_interleave")
    add("bad-dxxh3", with_meta(f, kvf__dxxh3="xyz"), "SchemaError", "F-4.12", "kvf.dxxh3 not 16 hex digits",
        field="kvf.dxxh3")
    # §5 checksums
    add("padding-bitflip", flip(f, n + 7, 0), "ChecksumError", "F-5.1", "one bit of the header padding flipped",
        region="header")
    hx = f.find(HXXH3_KEY) + len(HXXH3_KEY)
    stored = f[hx:hx + 16]
    up = stored.upper()
    assert up != stored, "the seeded header checksum has no a-f digit; change the seed"
    add("hxxh3-uppercase", f[:hx] + up + f[hx + 16:], "ChecksumError", "F-5.1",
        "kvf.hxxh3 digits in upper case (same value, different bytes)", region="header")
    add("flip-in-codec", text_edit(f, b'"kvf.codec":"none"', b'"kvf.codec":"nonE"', fix_checksum=False),
        "ChecksumError", "F-5.4", "a flipped bit that also breaks the schema: the checksum is checked first",
        region="header")
    add("payload-bitflip", flip(f, len(f) - 100, 3), "ChecksumError", "F-5.2", "one payload bit flipped",
        region="data", zero_filled=True, also=["F-5.5"])
    add("zstd-raw-mismatch", with_meta(z, kvf__raw_xxh3=xxhash.xxh3_64_hexdigest(b"other")), "ChecksumError",
        "F-5.3", "kvf.raw_xxh3 does not match the decoded payload", region="raw", zero_filled=True, also=["F-5.5"])
    # §6 compressed variant
    d2 = json.loads(json.dumps(zdoc))
    d2 = {("kvf.zst" if k == "kvf.zstd" else k): x for k, x in d2.items()}
    add("zstd-wrong-tensor", forge(d2, zdata), "SchemaError", "F-6.1", "the compressed tensor is not named kvf.zstd")
    d2 = json.loads(json.dumps(zdoc))
    d2["__metadata__"]["kvf.layers"] = '[["a","BF16"]]'
    add("zstd-bad-layers", forge(d2, zdata), "SchemaError", "F-6.2", "kvf.layers entry without a shape",
        field="kvf.layers")
    frame = _codec.compress(zpay + b"\0", 3)
    d2 = json.loads(json.dumps(zdoc))
    d2["kvf.zstd"] = {"dtype": "U8", "shape": [len(frame)], "data_offsets": [0, len(frame)]}
    d2["__metadata__"]["kvf.dxxh3"] = xxhash.xxh3_64_hexdigest(frame)
    add("zstd-wrong-size", forge(d2, frame), "CodecError", "F-6.3", "frame declares 1 byte more than the layout")
    cut = zdata[:-3]
    d2 = json.loads(json.dumps(zdoc))
    d2["kvf.zstd"] = {"dtype": "U8", "shape": [len(cut)], "data_offsets": [0, len(cut)]}
    d2["__metadata__"]["kvf.dxxh3"] = xxhash.xxh3_64_hexdigest(cut)
    add("zstd-truncated-frame", forge(d2, cut), "CodecError", "F-6.4", "frame cut short (checksum of the cut bytes)",
        zero_filled=True)
    _planes_invalid(add)
    # §7 versioning
    add("major-2", text_edit(f, b'"kvformat":"1.0"', b'"kvformat":"2.0"'), "UnsupportedVersionError", "F-7.1",
        "format major 2")
    # §8 limits
    add("oversized-header", struct.pack("<Q", (2 << 20) - 8) + f[8:], "OversizedHeaderError", "F-8.1",
        "N = 2 MiB - 8", field="header length")
    many = {"__metadata__": dict(doc["__metadata__"], **{"kvf.tokens_per_block": "1", "kvf.tokens_per_hash": "1"})}
    for i in range(K.MAX_LAYERS + 1):
        many[f"l{i}"] = {"dtype": "U8", "shape": [1, 1, 1], "data_offsets": [i, i + 1]}
    add("too-many-layers", forge(many, bytes(K.MAX_LAYERS + 1)), "SchemaError", "F-8.2", "1025 tensors",
        field="tensors")
    d2 = json.loads(json.dumps(doc))
    d2 = {("x" * 257 if k == L.layers[0].name else k): x for k, x in d2.items()}
    add("long-name", forge(d2, data), "SchemaError", "F-8.3", "a 257-byte layer name", field="layer.name")
    big = 1 << 32
    d2 = {"__metadata__": dict(doc["__metadata__"], **{"kvf.tokens_per_block": "1", "kvf.tokens_per_hash": "1"}),
          "l0": {"dtype": "U8", "shape": [1, 1, big + 1], "data_offsets": [0, big + 1]}}
    add("payload-over-4gib", forge(d2, b""), "SchemaError", "F-8.4", "one layer of 4 GiB + 1 byte", field="payload")
    d2 = json.loads(json.dumps(doc))
    for name in (L.layers[0].name, L.layers[1].name):
        d2[name]["shape"] = [1, 4, 2, 2, 2, 4]
    add("five-dims", forge(d2, data), "SchemaError", "F-8.5", "per-block shape with 5 dimensions",
        field="layer.shape")
    # §9 identity: a valid file that is not what the reader asked for
    other = K.CanonicalLayout.uniform("test/tiny-mla", "bfloat16", _names(2), 4, 32, tokens_per_hash=8)
    add("layout-mismatch", f, "LayoutMismatchError", "F-9.1", "valid file; the reader expects tokens_per_hash 8",
        field="tokens_per_hash", expect_layout=other.to_dict())
    add("key-mismatch", f, "LayoutMismatchError", "F-9.2", "valid file; the reader expects another block key",
        field="key", expect_key={"hash": "ff" * 16, "group": 0})
    # §4.3 roles (1.1), forged from a valid DSA file
    Ld = dsa_layout()
    dkey = K.BlockKey("a7" * 16)
    df = file_bytes(_payload(Ld.payload_bytes, 9), Ld, dkey, _prov(tp=8, row="replicated"))
    droles = json.loads(split(df)[0]["__metadata__"]["kvf.roles"])
    add("roles-wrong-length", with_meta(df, kvf__roles=json.dumps(droles[:3])), "SchemaError", "F-4.13",
        "kvf.roles lists 3 roles for 4 tensors", field="kvf.roles")
    bad = [list(r) for r in droles]
    bad[1][0] = "gqa"
    add("roles-unknown-role", with_meta(df, kvf__roles=json.dumps(bad)), "SchemaError", "F-4.13",
        "a role that is not mla, dsa_indexer or opaque", field="kvf.roles")
    fb2, _, L2 = valid_vectors()["bf16-2layers"]
    add("roles-all-default", with_meta(fb2, kvf__roles=json.dumps([["mla", "bfloat16"]] * 2), kvformat="1.1"),
        "SchemaError", "F-4.13", "kvf.roles present but every layer is a plain mla latent of kvf.kv_dtype",
        field="kvf.roles")
    odoc, odata = split(valid_vectors()["opaque-region-1.1"][0])
    odoc["__metadata__"]["kvf.roles"] = json.dumps([["opaque", "bfloat16"], ["mla", "bfloat16"]])
    half = len(odata) // 2
    odoc["kvf.opaque"] = {"dtype": "U8", "shape": [2, half // 2], "data_offsets": [0, half]}
    odoc["model.layers.0.self_attn.attn"] = {"dtype": "U8", "shape": [2, 4, half // 8], "data_offsets": [half, 2 * half]}
    add("opaque-with-another-layer", forge(odoc, odata), "SchemaError", "F-4.14",
        "an opaque region beside another layer", field="kvf.roles")
    add("pins-not-strings", with_meta(valid_vectors()["opaque-region-1.1"][0], kvf__pins='{"opaque": 1}'),
        "SchemaError", "F-4.15", "a kvf.pins value that is not a string", field="kvf.pins")
    # §4.5 form pins, forged from the pinned DSA vector
    pf = valid_vectors()["dsa-form-pinned-1.1"][0]
    add("form-pin-wrong-order", with_meta(pf, kvf__pins=json.dumps({"form.dsa_indexer_fp8": "rows/e4m3fn+f32"})),
        "SchemaError", "F-4.17", "an indexer's form pin that names token rows, not the file's split order",
        field="kvf.pins")
    add("form-pin-no-such-dtype", with_meta(pf, kvf__pins=json.dumps({"form.dsa_indexer_fp8": "split/e4m3fn+f32",
                                                                      "form.fp8_e5m2": "rows/e5m2"})),
        "SchemaError", "F-4.17", "a form pin for a KV dtype no layer has", field="kvf.pins")
    fnuz = dsa_layout(pins={"form.dsa_indexer_fp8": "split/e4m3fnuz+f32"})
    pinned = dsa_layout(pins={"form.dsa_indexer_fp8": "split/e4m3fn+f32"})
    add("form-pin-mismatch", file_bytes(_payload(fnuz.payload_bytes, 12), fnuz, K.BlockKey("b9" * 16),
                                        _prov(tp=8, row="replicated")), "LayoutMismatchError", "F-9.1",
        "valid gfx942 (e4m3fnuz) DSA file; the reader's indexer writes e4m3fn", field="pins",
        expect_layout=pinned.to_dict())
    # F-9.1 on DSA: what dividing the total by the layer count gives (4 equal layers) is not this file
    equal = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V3.2", "fp8_ds_mla", [l.name for l in Ld.layers], 4,
                                      (656 + 132) // 2)
    add("dsa-wrong-layer-table", df, "LayoutMismatchError", "F-9.1",
        "valid DSA file; the reader expects the arithmetic table (4 equal layers)", field="layers[0]",
        expect_layout=equal.to_dict())
    swapped = list(Ld.layers)
    swapped[1] = K.LayerSpec(swapped[1].name, "U8", (4, 132), role="mla", kv_dtype="fp8_ds_mla")
    wrong_role = K.CanonicalLayout(**{**{k: getattr(Ld, k) for k in ("model", "kv_dtype", "tokens_per_block",
                                                                      "blocks_per_chunk", "tokens_per_hash")},
                                      "layers": tuple(swapped)})
    add("dsa-role-mismatch", df, "LayoutMismatchError", "F-9.1",
        "valid DSA file; the reader expects its indexer layer to be an MLA latent", field="layers[1].role",
        expect_layout=wrong_role.to_dict())
    _sealed_invalid(add, f, L, key)
    return v


def _planes_invalid(add: Callable[..., None]) -> None:
    """§6.2: invalid plane-coded files, forged from a valid bf16 one (plane 0 raw, plane 1 a zstd frame)."""
    Lp = K.CanonicalLayout.uniform("test/tiny-mla", "bfloat16", _names(2), 16, 64)
    pay = _bf16_payload(Lp.payload_bytes, 13)
    pf = file_bytes(pay, Lp, K.BlockKey("c1" * 16), _prov(tp=2, row="replicated"), "planes")
    pdoc, pdata = split(pf)
    table = json.loads(pdoc["__metadata__"]["kvf.plane_table"])
    assert [m for m, _ in table] == ["raw", "zstd"], table
    plane = Lp.payload_bytes // 2
    d2 = json.loads(json.dumps(pdoc))
    d2 = {("kvf.zstd" if k == "kvf.planes" else k): x for k, x in d2.items()}
    add("planes-wrong-tensor", forge(d2, pdata), "SchemaError", "F-6.1",
        "a plane-coded file whose one tensor is named kvf.zstd")
    add("planes-unknown-method", with_meta(pf, kvf__plane_table=json.dumps([["raw", plane], ["lz4", table[1][1]]])),
        "SchemaError", "F-6.5", "plane 1 stored with a method the spec does not name", field="kvf.plane_table")
    add("planes-sizes-mismatch", with_meta(pf, kvf__plane_table=json.dumps([["raw", plane], ["zstd",
                                                                                          table[1][1] + 1]])),
        "SchemaError", "F-6.5", "the plane table's sizes sum to one byte more than the data section",
        field="kvf.plane_table")
    zf = valid_vectors()["zstd-bf16-4layers"][0]
    add("planes-table-on-zstd", with_meta(zf, kvf__plane_table=json.dumps([["raw", 1]])), "SchemaError", "F-6.5",
        "a plane table in a zstd file (no reader would apply it)", field="kvf.plane_table")

    def replan(frame: bytes) -> bytes:
        """The file with plane 1 replaced by ``frame``: plane table, tensor size and data checksum follow it."""
        data = pdata[:plane] + frame
        d = json.loads(json.dumps(pdoc))
        d["kvf.planes"] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}
        d["__metadata__"]["kvf.plane_table"] = json.dumps([["raw", plane], ["zstd", len(frame)]])
        d["__metadata__"]["kvf.dxxh3"] = xxhash.xxh3_64_hexdigest(data)
        return forge(d, data)

    high = pay[1::2]
    add("planes-frame-wrong-size", replan(_codec.compress(high + b"\0", 1)), "CodecError", "F-6.6",
        "plane 1's frame declares one byte more than a plane")
    add("planes-frame-truncated", replan(pdata[plane:-3]), "CodecError", "F-6.7",
        "plane 1's frame cut short (table and checksum of the cut bytes)", zero_filled=True)
    add("planes-raw-mismatch", replan(_codec.compress(bytes(reversed(high)), 1)), "ChecksumError", "F-5.3",
        "plane 1 holds other bytes (a valid frame of the right size, checksums recomputed)", region="raw",
        zero_filled=True, also=["F-5.5"])


def _sealed_invalid(add: Callable[..., None], f: bytes, L: K.CanonicalLayout, key: K.BlockKey) -> None:
    """§12: invalid sealed files, each read with SEAL_KEY unless it says otherwise ("keys")."""
    pay = split(f)[1]
    prov = _prov(tp=2, row="replicated")
    La, Le = L.with_seal("authenticate"), L.with_seal("encrypt")
    sa = sealed_bytes(pay, La, key, prov, NONCES[0])
    se = sealed_bytes(pay, Le, key, prov, NONCES[1])
    mine = {"keys": [SEAL_KEY]}
    add("sealed-unknown-level", with_meta(sa, kvf__seal="obfuscate"), "SchemaError", "F-12.1", "kvf.seal is no level",
        field="kvf.seal", **mine)
    add("sealed-fields-without-seal", with_meta(sa, kvf__seal=None), "SchemaError", "F-12.1",
        "kvf.seal removed, the key id, nonce and tag left: a sealed file must not pass as a clear one",
        field="kvf.key_id", **mine)
    add("sealed-compressed", with_meta(sa, kvf__codec="zstd"), "SchemaError", "F-12.1", "a sealed file claims zstd",
        field="kvf.codec", **mine)
    meta = split(sa)[0]["__metadata__"]
    add("sealed-truncated-tag", with_meta(sa, kvf__tag=meta["kvf.tag"][:24]), "SchemaError", "F-12.2",
        "kvf.tag cut to 96 bits (a truncated tag is never compared on its prefix)", field="kvf.tag", **mine)
    add("sealed-short-nonce", with_meta(sa, kvf__nonce=meta["kvf.nonce"][:32]), "SchemaError", "F-12.2",
        "kvf.nonce of 128 bits", field="kvf.nonce", **mine)
    doc, data = split(sa)
    m = doc["__metadata__"]
    order = ["kvformat", "kvf.hxxh3", "kvf.codec", "kvf.dxxh3", "kvf.seal", "kvf.tag"]
    doc["__metadata__"] = {**{k: m[k] for k in order}, **{k: x for k, x in m.items() if k not in order}}
    add("sealed-member-order", forge(doc, data), "HeaderError", "F-12.3",
        "kvf.seal before kvf.tag: the digits the tag cannot cover are not where §12.2 puts them", **mine)
    doc, data = split(se)
    table = {k: x for k, x in split(f)[0].items() if k != "__metadata__"}
    add("sealed-encrypt-layer-tensors", forge({"__metadata__": doc["__metadata__"], **table}, data), "SchemaError",
        "F-12.4", "an encrypted file with one tensor per layer instead of kvf.sealed", field="tensors", **mine)
    add("sealed-wrong-key", se, "UnknownKeyError", "F-12.5", "valid encrypted file; the reader holds another key only",
        keys=[OTHER_KEY], untouched=True)
    add("sealed-authenticate-no-key", sa, "UnknownKeyError", "F-12.5",
        "valid authenticated file (payload in clear); the reader holds no key: nothing is delivered",
        keys=[], untouched=True)
    other = bytes(b ^ 0x5A for b in pay)
    planted = with_meta(sa[:len(sa) - len(pay)] + other, kvf__dxxh3=xxhash.xxh3_64_hexdigest(other))
    add("sealed-planted-payload", planted, "TagMismatchError", "F-12.6",
        "a writer without the key put other bytes under a valid header, xxh3 checksums recomputed",
        zero_filled=True, **mine)
    se2 = sealed_bytes(other, Le, key, prov, NONCES[3])
    swapped = with_meta(se[:len(se) - len(pay)] + se2[len(se2) - len(pay):],
                        kvf__dxxh3=xxhash.xxh3_64_hexdigest(se2[len(se2) - len(pay):]))
    add("sealed-swapped-payload", swapped, "TagMismatchError", "F-12.6",
        "the ciphertext of another file sealed under the same key, checksums recomputed", zero_filled=True, **mine)
    new = K.BlockKey("bb" * 16)
    add("sealed-replayed-new-name", se, "LayoutMismatchError", "F-9.2",
        "a valid sealed file copied under another block's name: its authenticated kvf.key says which block it is",
        field="key", expect_key={"hash": new.hash, "group": 0}, **mine)
    add("sealed-replayed-key-edited", with_meta(se, kvf__key=new.hash), "TagMismatchError", "F-12.6",
        "the same copy with kvf.key edited to the new name (checksum recomputed): the tag covers the header",
        expect_key={"hash": new.hash, "group": 0}, zero_filled=True, **mine)
    doc, data = split(sa)
    m = doc["__metadata__"]
    m["kvf.seal"] = "encrypt"
    m["kvformat"] = "1.2"
    items = list(m.items())
    items.insert(8, ("kvf.layers", L._layers_json))
    relabel = {"__metadata__": dict(items),
               "kvf.sealed": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}
    add("sealed-level-relabelled", forge(relabel, data), "TagMismatchError", "F-12.6",
        "an authenticated file relabelled as encrypted (tensor table and kvf.layers rewritten): the level is bound "
        "into the file key", zero_filled=True, **mine)
    t = meta["kvf.tag"]
    add("sealed-tag-digit-changed", with_meta(sa, kvf__tag=t[:-1] + ("0" if t[-1] != "0" else "1")), "TagMismatchError",
        "F-12.6", "the last tag digit changed, the header checksum recomputed", zero_filled=True, **mine)
    add("sealed-clear-file-expected-sealed", f, "LayoutMismatchError", "F-12.7",
        "a valid clear file where the reader expects an encrypted one (sealed and clear never mix)", field="seal",
        expect_layout=Le.to_dict(), **mine)


def layer_xxh3(payload: bytes, L: K.CanonicalLayout) -> dict[str, str]:
    return {l.name: xxhash.xxh3_64_hexdigest(payload[o:o + n])
            for l, o, n in zip(L.layers, L.layer_offsets, L.chunk_bytes_per_layer)}


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)


def generate(outdir: str) -> list[str]:
    """Write every vector and its expected-result JSON under ``outdir``; return the relative paths written."""
    written = []
    for sub in ("valid", "invalid"):
        os.makedirs(os.path.join(outdir, sub), exist_ok=True)
    for name, (fb, pay, L) in valid_vectors().items():
        keys = [SEAL_KEY] if L.seal else []
        hdr, _ = K.decode(fb, keys=keyring(*keys) if keys else None)
        exp = {"header": hdr.to_dict(), "extra": dict(hdr.extra), "file_xxh3": xxhash.xxh3_64_hexdigest(fb),
               "relpath": K.block_relpath(hdr.layout, hdr.key), "layers_xxh3": layer_xxh3(pay, L)}
        if keys:
            exp["keys"] = keys
        _write(os.path.join(outdir, "valid", name + ".kvf"), fb)
        _write(os.path.join(outdir, "valid", name + ".json"), (json.dumps(exp, indent=1) + "\n").encode())
        written += [f"valid/{name}.kvf", f"valid/{name}.json"]
    for name, (fb, err, must, what, extra) in invalid_vectors().items():
        exp = {"error": err, "must": must, "description": what, **extra}
        _write(os.path.join(outdir, "invalid", name + ".kvf"), fb)
        _write(os.path.join(outdir, "invalid", name + ".json"), (json.dumps(exp, indent=1) + "\n").encode())
        written += [f"invalid/{name}.kvf", f"invalid/{name}.json"]
    return written


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Regenerate the conformance vectors (deterministic).")
    ap.add_argument("out", nargs="?", default=os.path.join(os.path.dirname(HERE), "spec", "vectors"),
                    help="output folder (default spec/vectors)")
    out = ap.parse_args().out
    paths = generate(out)
    total = sum(os.path.getsize(os.path.join(out, p)) for p in paths)
    print(f"wrote {len(paths)} files, {total} bytes, under {out}")
