"""The kvformat file format and its byte-level code; no knowledge of engines (spec/FORMAT.md).

Bytes only (never open files): ``_consts`` (the spec's constants and field validators), ``_spec`` (the
frozen spec objects), ``_paths`` (the on-disk path scheme), ``_header``/``_header_json`` (the header
frame and its JSON), ``_codec`` (zstd), ``_block`` (encode/decode/verify a block), ``_placement`` (a block
path's key and namespace checks), ``_sizes`` (the size syntax), ``_seal`` (sealed files: keys, key ids,
seal/unseal over memoryviews). The I/O edge: ``_keys`` (seal keys from key files and environment
variables), ``_read`` (the one read pipeline), ``_write`` (atomic publication), ``_fused`` (the
one-syscall tier paths), ``_files`` (untrusted trees), ``_io`` (the public file API over buffers; tensors:
``kvformat.torch``), ``_native`` (the C
extension ``_kvfnative`` and its fallbacks).
"""

from ._block import decode, encode
from ._consts import ALIGNMENT, FORMAT_VERSION, MAX_HEADER_BYTES, MAX_LAYERS, MAX_PAYLOAD_BYTES
from ._io import BlockFile, open_block, read_header, read_into, save_file, verify_file
from ._keys import load_keyring
from ._paths import block_relpath
from ._seal import Keyring, SealKey
from ._spec import BlockHeader, BlockKey, CanonicalLayout, LayerSpec, Provenance, SealFields

__all__ = [
    "FORMAT_VERSION", "ALIGNMENT", "MAX_HEADER_BYTES", "MAX_LAYERS", "MAX_PAYLOAD_BYTES", "CanonicalLayout",
    "LayerSpec", "BlockKey", "Provenance", "BlockHeader", "SealFields", "BlockFile", "save_file",
    "read_header", "read_into", "verify_file", "open_block", "encode", "decode", "block_relpath", "Keyring",
    "SealKey", "load_keyring",
]
