"""Torch conversions of kvformat payloads (as safetensors keeps its own in ``safetensors/torch.py``).

The format and I/O layers work on bytes-like objects; this module is where a payload becomes
``{layer name: tensor}`` and back, and where a tensor is seen as bytes. torch is imported here and
nowhere else in the byte-level code (they import this module lazily, only when given a tensor).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .format._spec import CanonicalLayout
from .errors import LayoutMismatchError

__all__ = ["TORCH_DTYPES", "torch_dtype", "payload_from_tensors", "tensors_from_payload", "empty_payload",
           "tensor_bytes"]

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
