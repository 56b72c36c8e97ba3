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

from ._block import as_bytes_view, decode, encode, encode_block
from ._consts import (
    ALIGNMENT, FORMAT_VERSION, FORM_ORDERS, FORM_PIN, FORM_UNKNOWN, MAX_HEADER_BYTES, MAX_LAYERS, MAX_PAYLOAD_BYTES,
    SEAL_LEVELS, round_up,
)
from ._io import BlockFile, open_block, read_header, read_into, save_file, verify_file
from ._keys import ENV_PREFIX, load_key, load_keyring, looks_like_key
from ._paths import (
    BLOCK_PATH_HELP, CONTROL_DIR, FILE_SUFFIX, NAMESPACE_FILE, QUARANTINE_DIR, block_path_parts, block_relpath,
    hash_relpath,
)
from ._seal import Keyring, SealKey, key_for
from ._spec import (
    OPAQUE_LAYER, BlockHeader, BlockKey, CanonicalLayout, LayerSpec, Provenance, SealFields, layout_from_namespace_doc,
    namespace_doc, st_dtype_for,
)
from .._version import __version__
from ._files import is_regular_file, iter_files, read_exact, read_row, read_small_file
from ._fused import read_into_fused, write_block_fused
from ._header import check_layout, encode_header, header_length, xxh3_hex
from ._native import copy_runs, xxh3_64
from ._placement import placement_error
from ._read import (
    FIRST_READ, _O_DIRECT as O_DIRECT, BytesSource, FileId, FileSource, payload_buffer, read_header_from,
    read_payload_from,
)
from ._sizes import format_size, parse_limit, parse_size
from ._template import HeaderEncoder, HeaderTemplates
from ._write import TMP_PREFIX, host_tag, temp_name, temp_writer_gone, write_atomic

__all__ = [
    "FORMAT_VERSION", "ALIGNMENT", "MAX_HEADER_BYTES", "MAX_LAYERS", "MAX_PAYLOAD_BYTES", "CanonicalLayout",
    "LayerSpec", "BlockKey", "Provenance", "BlockHeader", "SealFields", "BlockFile", "save_file",
    "read_header", "read_into", "verify_file", "open_block", "encode", "decode", "block_relpath", "Keyring",
    "SealKey", "load_keyring",
]

# Used by other kvformat packages, which import this face, never its private modules (issue 44).
__all__ += [
    "BLOCK_PATH_HELP", "CONTROL_DIR", "ENV_PREFIX", "FILE_SUFFIX", "FIRST_READ", "FORM_ORDERS", "FORM_PIN",
    "FORM_UNKNOWN", "NAMESPACE_FILE", "OPAQUE_LAYER", "O_DIRECT", "QUARANTINE_DIR", "SEAL_LEVELS", "TMP_PREFIX",
    "BytesSource", "FileId", "FileSource", "HeaderEncoder", "HeaderTemplates", "__version__", "as_bytes_view",
    "block_path_parts", "check_layout", "copy_runs", "encode_block", "encode_header", "format_size", "hash_relpath",
    "header_length", "host_tag", "is_regular_file", "iter_files", "key_for", "layout_from_namespace_doc", "load_key",
    "looks_like_key", "namespace_doc", "parse_limit", "parse_size", "payload_buffer", "placement_error", "read_exact",
    "read_header_from", "read_into_fused", "read_payload_from", "read_row", "read_small_file", "round_up",
    "st_dtype_for", "temp_name", "temp_writer_gone", "write_atomic", "write_block_fused", "xxh3_64", "xxh3_hex",
]
