"""Torch conversions of kvformat payloads (as safetensors keeps its own in ``safetensors/torch.py``).

The format and I/O layers work on bytes-like objects only (``format/`` never imports this module); this
module is where a payload becomes ``{layer name: tensor}`` and back, and where a tensor is seen as bytes.
The public file API that takes or gives tensors (``kvformat.save_file``, ``load_file``, ``read_into``,
``open_block``, ``encode``, ``decode``) is here: thin wrappers over ``kvformat.format``'s byte-level
functions, which ``kvformat`` re-exports on first use (so ``import kvformat`` does not import torch).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch
else:
    class _Torch:
        """torch, imported on first use: the wrappers below given buffers never touch it, so the buffer API
        (``kvformat.read_into(path, bytearray)``) does not pay torch's import, nor its address space."""

        def __getattr__(self, name: str) -> Any:
            import torch as real

            globals()["torch"] = real
            return getattr(real, name)

    torch = _Torch()

from .format import BlockFile as _BlockFile, BlockHeader, BlockKey, CanonicalLayout, Keyring, Provenance
from .format import decode as _decode, encode as _encode, read_header, read_into as _read_into, save_file as _save_file
from .errors import LayoutMismatchError

__all__ = ["TORCH_DTYPES", "torch_dtype", "payload_from_tensors", "tensors_from_payload", "empty_payload",
           "tensor_bytes", "as_buffer", "save_file", "load_file", "read_into", "open_block", "BlockFile", "encode",
           "decode"]

# safetensors dtype names -> torch dtypes (the names of spec §4.2)
TORCH_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
                "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64",
                "U64": "uint64", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def torch_dtype(st_dtype: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    dt: torch.dtype = getattr(torch, TORCH_DTYPES[st_dtype])
    return dt


def tensor_bytes(t: Any) -> Any:
    """A contiguous CPU tensor as a flat numpy uint8 array over the same memory (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("expected a contiguous CPU tensor")
    return t.reshape(-1).view(torch.uint8).numpy()


def payload_from_tensors(tensors: Mapping[str, Any], layout: CanonicalLayout) -> torch.Tensor:
    """The canonical payload of ``{layer name: tensor}``: each layer checked, then concatenated in layout order.

    Each layer is checked on its own: a matching total can hide fp16 data under a bf16 layout, or one
    layer two pages long next to an empty one. Raises LayoutMismatchError naming the layer.
    """
    names = [l.name for l in layout.layers]
    extra = sorted(set(tensors) - set(names), key=str)
    if extra:
        raise LayoutMismatchError("layers", names, [*names, *extra])
    parts = []
    for l in layout.layers:
        if l.name not in tensors:
            raise LayoutMismatchError(f"layer {l.name}", "a tensor", "missing")
        t = tensors[l.name]
        want = torch_dtype(l.dtype)
        if not isinstance(t, torch.Tensor):
            raise LayoutMismatchError(f"layer {l.name}", "a tensor", type(t).__name__)
        if t.dtype != want:
            raise LayoutMismatchError(f"layer {l.name} dtype", str(want), str(t.dtype))
        shape = [layout.blocks_per_chunk, *l.shape]
        if list(t.shape) != shape:
            raise LayoutMismatchError(f"layer {l.name} shape", shape, list(t.shape))
        parts.append(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))
    return torch.cat(parts)


def empty_payload(nbytes: int) -> torch.Tensor:
    """A CPU uint8 tensor to read a payload into."""
    return torch.empty(nbytes, dtype=torch.uint8)


def tensors_from_payload(buf: Any, layout: CanonicalLayout) -> dict[str, torch.Tensor]:
    """One tensor per layer: a view of ``buf`` where the layer's offset suits its dtype, else a copy.

    Layers of mixed dtypes can start at offsets that are not a multiple of a later layer's element
    size (a U8 layer of odd length before an F32 one); torch cannot view such bytes, so they are copied.
    """
    flat = buf if isinstance(buf, torch.Tensor) else torch.frombuffer(buf, dtype=torch.uint8)
    out = {}
    for l, off, n in zip(layout.layers, layout.layer_offsets, layout.chunk_bytes_per_layer):
        dt = torch_dtype(l.dtype)
        raw = flat[off:off + n]
        if raw.storage_offset() % dt.itemsize:  # the condition torch.Tensor.view(dtype) imposes
            raw = raw.clone()  # a fresh allocation is aligned for every dtype
        out[l.name] = raw.view(dt).reshape(layout.blocks_per_chunk, *l.shape)
    return out


def as_buffer(obj: Any) -> Any:
    """What the byte-level code takes for ``obj``: a tensor's bytes (:func:`tensor_bytes`), anything else as is."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):
        return tensor_bytes(obj)
    return obj


def save_file(payload: Any, path: str | os.PathLike[str], layout: CanonicalLayout, key: BlockKey, *,
              provenance: Provenance | None = None, codec: str = "none", level: int | None = None,
              fsync: bool = False, keys: Keyring | None = None) -> BlockHeader:
    """:func:`kvformat.format.save_file` of a bytes-like payload, a CPU tensor, or ``{layer name: tensor}``
    (each layer checked against ``layout``: LayoutMismatchError naming the layer)."""
    if isinstance(payload, Mapping):
        payload = payload_from_tensors(payload, layout)
    return _save_file(as_buffer(payload), path, layout, key, provenance=provenance, codec=codec, level=level,
                      fsync=fsync, keys=keys)


def read_into(path: str | os.PathLike[str], out: Any, *, expect: CanonicalLayout | None = None,
              key: BlockKey | None = None, verify: bool = True, o_direct: bool = False,
              keys: Keyring | None = None) -> BlockHeader:
    """:func:`kvformat.format.read_into`; ``out`` may also be a contiguous CPU tensor."""
    return _read_into(path, as_buffer(out), expect=expect, key=key, verify=verify, o_direct=o_direct, keys=keys)


def load_file(path: str | os.PathLike[str], *, expect: CanonicalLayout | None = None, key: BlockKey | None = None,
              verify: bool = True, keys: Keyring | None = None) -> dict[str, torch.Tensor]:
    """safetensors-style: ``{layer name: torch.Tensor}`` of shape ``(blocks_per_chunk, *layer.shape)``.

    Packed dtypes come back as uint8 (the header's ``kv_dtype`` says what they hold). A sealed file
    needs ``keys`` (see :func:`kvformat.read_into`).
    """
    hdr = read_header(path, verify=False)
    buf = empty_payload(hdr.raw_bytes)
    hdr = read_into(path, buf, expect=expect, key=key, verify=verify, keys=keys)
    return tensors_from_payload(buf, hdr.layout)


class BlockFile(_BlockFile):
    """An open kvformat file: ``header`` now, payload on demand (into a buffer or tensor, or as tensors)."""

    def read_into(self, out: Any, **kw: Any) -> BlockHeader:
        """See :func:`kvformat.read_into`."""
        return super().read_into(as_buffer(out), **kw)

    def tensors(self) -> dict[str, torch.Tensor]:
        """See :func:`kvformat.load_file`."""
        return load_file(self.path, verify=self._verify, keys=self._keys)


def open_block(path: str | os.PathLike[str], *, verify: bool = True, keys: Keyring | None = None) -> BlockFile:
    """Open a kvformat file and check its header. See :class:`BlockFile`."""
    return BlockFile(path, verify=verify, keys=keys)


def encode(payload: Any, layout: CanonicalLayout, key: BlockKey, *, provenance: Provenance | None = None,
           codec: str = "none", level: int | None = None,
           keys: Keyring | None = None) -> tuple[bytes, memoryview | bytes]:
    """:func:`kvformat.format.encode`; ``payload`` may also be a contiguous CPU tensor."""
    return _encode(as_buffer(payload), layout, key, provenance=provenance, codec=codec, level=level, keys=keys)


def decode(buf: Any, out: Any | None = None, *, expect: CanonicalLayout | None = None, key: BlockKey | None = None,
           verify: bool = True, keys: Keyring | None = None) -> tuple[BlockHeader, memoryview]:
    """:func:`kvformat.format.decode`; ``buf`` and ``out`` may also be contiguous CPU tensors."""
    return _decode(as_buffer(buf), None if out is None else as_buffer(out), expect=expect, key=key,
                   verify=verify, keys=keys)
