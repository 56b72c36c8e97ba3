"""kvformat: a compact, checksummed, TP-independent block file for MLA KV cache (spec/FORMAT.md)."""

from .format import (
    ALIGNMENT, FORMAT_VERSION, MAX_HEADER_BYTES, MAX_LAYERS, MAX_PAYLOAD_BYTES, BlockFile, BlockHeader, BlockKey,
    CanonicalLayout, Keyring, LayerSpec, Provenance, SealFields, SealKey, __version__, block_relpath, decode, encode,
    load_file, load_keyring, open_block, read_header, read_into, save_file, verify_file,
)
from .errors import KVFormatError


__all__ = [
    "__version__", "FORMAT_VERSION", "ALIGNMENT", "MAX_HEADER_BYTES", "MAX_LAYERS", "MAX_PAYLOAD_BYTES",
    "CanonicalLayout", "LayerSpec", "BlockKey", "Provenance", "BlockHeader", "BlockFile", "KVFormatError",
    "save_file", "load_file", "read_header", "read_into", "open_block", "encode", "decode", "block_relpath",
    "SealFields", "Keyring", "SealKey", "load_keyring", "verify_file",
]
