"""The constants of kvformat v1 (spec §3-§8) and the field validators every spec object uses. No I/O,
no classes: a MUST that is a number or a syntax lives here once (its comment cites the section)."""

from __future__ import annotations

import re
from typing import Any, Mapping

from ..errors import SchemaError

FORMAT_MAJOR = 1  # §7: readers refuse any other major
FORMAT_MINOR = 2  # §7: readers accept any minor of their major
FORMAT_VERSION = f"{FORMAT_MAJOR}.{FORMAT_MINOR}"
# §7: a writer marks a file with the lowest minor whose features it uses, so files readable by 1.0
# readers (pure-MLA layouts, no roles, no pins) keep their exact 1.0 bytes and namespaces.
FORMAT_VERSION_BASE = f"{FORMAT_MAJOR}.0"
FORMAT_VERSION_ROLES = f"{FORMAT_MAJOR}.1"  # §4.3: kvf.roles / kvf.pins
FORMAT_VERSION_SEAL = f"{FORMAT_MAJOR}.2"  # §12: sealed files

ALIGNMENT = 4096  # §3: the data section starts at a multiple of this
LENGTH_BYTES = 8  # §3: u64 little-endian header length (safetensors)
MAX_HEADER_BYTES = 1 << 20  # §8: N (JSON + padding) at most 1 MiB
MAX_LAYERS = 1024  # §8
MAX_NAME_BYTES = 256  # §8: a layer name, model id or revision
MAX_PAYLOAD_BYTES = 1 << 32  # §8: decoded payload at most 4 GiB
MAX_DIMS = 4  # §8: a layer's per-block shape has 1..4 dimensions

# §4.1: the header JSON starts with these exact bytes, then the version string, then
# '","kvf.hxxh3":"' and 16 lowercase hex digits; that fixed position makes the header
# checksum computable without parsing JSON and makes "is this kvformat?" a prefix test.
HEADER_PREFIX = b'{"__metadata__":{"kvformat":"'
HXXH3_FIELD = b'","kvf.hxxh3":"'
HEX64_LEN = 16
HEX64_ZERO = b"0" * HEX64_LEN

CODECS = ("none", "zstd", "planes")
# §6.2 the byte-plane codec: at most MAX_PLANES planes (a 64-bit item), each stored as it is or as one zstd frame.
MAX_PLANES = 8
PLANE_METHODS = ("raw", "zstd")
PLANES_TENSOR = "kvf.planes"  # §6.2: the one U8 tensor of a plane-coded file

# §12 sealed files: AES-256-GCM under a per-file key derived from the deployment key and the file's nonce.
SEAL_LEVELS = ("authenticate", "encrypt")  # payload in clear + tag / payload encrypted (AEAD)
SEALED_TENSOR = "kvf.sealed"  # §12.3: the one U8 tensor of an encrypted file
SEAL_KEY_BYTES = 32  # a deployment key is 256 random bits
SEAL_KEY_ID_HEX = 16  # kvf.key_id: 64 bits of HMAC-SHA256(key, label), never the key
SEAL_NONCE_HEX = 48  # kvf.nonce: 192 random bits per file (input of the per-file key derivation)
SEAL_TAG_HEX = 32  # kvf.tag: the full 128-bit GCM tag; a shorter one is refused, never compared on its prefix
# §12.2: a sealed header continues the fixed prefix (§4.1) with these members in this order, so the three
# digit runs the tag cannot cover (kvf.hxxh3, kvf.dxxh3, kvf.tag) sit at offsets known without parsing.
SEAL_AFTER_HXXH3 = b'","kvf.codec":"none","kvf.dxxh3":"'
SEAL_AFTER_DXXH3 = b'","kvf.tag":"'
SEAL_AFTER_TAG = b'","kvf.seal":"'
ZSTD_TENSOR = "kvf.zstd"  # §6: the one U8 tensor of a compressed file
ROW_LAYOUTS = ("replicated", "per_worker", "canonical", "unknown")

# §4.3: what a layer's bytes are. "mla": an MLA latent (replicated on every TP rank); "dsa_indexer": a
# DeepSeek sparse-attention indexer k-cache (also replicated); "opaque": one region of the writer's row
# whose inner order is not described (its identity pins every input of those bytes instead).
ROLES = ("mla", "dsa_indexer", "opaque")
DEFAULT_ROLE = "mla"
OPAQUE_LAYER = "kvf.opaque"  # §4.3: the one tensor of an opaque layout (the only allowed kvf.* layer name)
# §4.5: the one byte order per role inside a page of a file ("rows": token t at t x bytes per token; "split":
# every token's 128 indexer key bytes, then every token's 4 scale bytes), and the kvf.pins prefix naming a KV
# dtype's order and encoding ("form.<kv dtype>": "<order>/<encoding>" or "unknown:<platform>").
FORM_ORDERS: Mapping[str, str] = {"mla": "rows", "dsa_indexer": "split"}
FORM_PIN = "form."
FORM_UNKNOWN = "unknown:"

# safetensors dtype names and item sizes (§4.2).
DTYPE_SIZES: Mapping[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}

# vLLM kv_cache_dtype strings -> safetensors dtype; anything else is packed and stored as U8 (§4.2).
KV_DTYPE_TO_ST: Mapping[str, str] = {
    "bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32", "float": "F32",
    "fp8": "F8_E4M3", "fp8_e4m3": "F8_E4M3", "fp8_e5m2": "F8_E5M2",
}

_HEX_RE = re.compile(r"[0-9a-f]+")
_UINT_RE = re.compile(r"0|[1-9][0-9]{0,18}")
_CTRL_RE = re.compile(r"[\x00-\x1f]")


def st_dtype_for(kv_dtype: str) -> str:
    """The safetensors dtype that stores ``kv_dtype`` (U8 for packed formats such as fp8_ds_mla)."""
    return KV_DTYPE_TO_ST.get(kv_dtype, "U8")


def parse_uint(field_name: str, value: Any, *, minimum: int = 0, maximum: int = 1 << 62) -> int:
    """Parse a canonical decimal string (or int) into an int within [minimum, maximum]."""
    if isinstance(value, bool):
        raise SchemaError(field_name, f"expected an integer, got {value!r}")
    if isinstance(value, str):
        if not _UINT_RE.fullmatch(value):
            raise SchemaError(field_name, f"expected a canonical decimal integer, got {value[:40]!r}")  # F-4.5
        value = int(value)
    if not isinstance(value, int):
        raise SchemaError(field_name, f"expected an integer, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise SchemaError(field_name, f"expected {minimum}..{maximum}, got {value}")  # F-4.5
    return value


def parse_name(field_name: str, value: Any, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise SchemaError(field_name, f"expected a string, got {type(value).__name__}")
    try:
        n = len(value.encode())
    except UnicodeEncodeError:  # a lone surrogate ("\\ud800" in the JSON) is not UTF-8
        raise SchemaError(field_name, "not valid Unicode (lone surrogate)") from None
    if (not value and not allow_empty) or n > MAX_NAME_BYTES:
        raise SchemaError(field_name, f"expected 1..{MAX_NAME_BYTES} bytes, got {n}")  # F-8.3
    if _CTRL_RE.search(value):
        raise SchemaError(field_name, "control characters are not allowed")  # F-4.12
    return value


def parse_hex(field_name: str, value: Any, length: int | None = None) -> str:
    if not isinstance(value, str) or not _HEX_RE.fullmatch(value) or (length and len(value) != length):
        want = f"{length} lowercase hex digits" if length else "lowercase hex"
        raise SchemaError(field_name, f"expected {want}, got {str(value)[:80]!r}")  # F-4.12
    return value


def round_up(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return -(-n // a) * a
