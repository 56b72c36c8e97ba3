"""kvformat: a compact, checksummed, TP-independent block file for MLA KV cache (spec/FORMAT.md)."""

from .format import (
    ALIGNMENT, FORMAT_VERSION, MAX_HEADER_BYTES, MAX_LAYERS, MAX_PAYLOAD_BYTES, BlockHeader, BlockKey,
    CanonicalLayout, Keyring, LayerSpec, Provenance, SealFields, SealKey, __version__, block_relpath, load_keyring,
    read_header, verify_file,
)
from .errors import KVFormatError

# The file API that takes or gives tensors is kvformat.torch's (format/ takes buffers only), re-exported on first
# use: ``import kvformat`` stays free of torch.
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (type checkers read the name)
if TYPE_CHECKING:
    from .torch import BlockFile, decode, encode, load_file, open_block, read_into, save_file
_FROM_TORCH = frozenset({"BlockFile", "save_file", "load_file", "read_into", "open_block", "encode", "decode"})


def __getattr__(name: str) -> object:
    if name in _FROM_TORCH:
        from . import torch as _torch_api

        return getattr(_torch_api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "__version__", "FORMAT_VERSION", "ALIGNMENT", "MAX_HEADER_BYTES", "MAX_LAYERS", "MAX_PAYLOAD_BYTES",
    "CanonicalLayout", "LayerSpec", "BlockKey", "Provenance", "BlockHeader", "BlockFile", "KVFormatError",
    "save_file", "load_file", "read_header", "read_into", "open_block", "encode", "decode", "block_relpath",
    "SealFields", "Keyring", "SealKey", "load_keyring", "verify_file",
]
