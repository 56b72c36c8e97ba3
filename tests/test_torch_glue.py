"""kvformat.torch is the one home of the tensor glue: the byte-level modules never import torch themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvformat as K
from kvformat import torch as kt

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_byte_level_modules_does_not_import_torch() -> None:
    code = ("import sys; import kvformat, kvformat.format._block, kvformat.format._io, kvformat.storage, kvformat.staging; "
            "print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"


def test_dtype_names_map_to_torch_dtypes() -> None:
    assert kt.torch_dtype("BF16") is torch.bfloat16 and kt.torch_dtype("F8_E4M3") is torch.float8_e4m3fn
    assert all(isinstance(kt.torch_dtype(n), torch.dtype) for n in kt.TORCH_DTYPES)


def test_tensor_bytes_shares_memory_and_refuses_strided_tensors() -> None:
    t = torch.arange(4, dtype=torch.int16)
    a = kt.tensor_bytes(t)
    a[0] = 9
    assert t[0].item() == 9 and a.shape == (8,)
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        kt.tensor_bytes(torch.zeros(4, 4).t())


def test_payload_round_trip_through_tensors() -> None:
    L = K.CanonicalLayout.uniform("deepseek-ai/DeepSeek-V2-Lite", "bfloat16", ["a", "b"], 4, 8, blocks_per_chunk=2)
    tensors = {l.name: torch.randn(2, 4, 8).to(torch.bfloat16) for l in L.layers}
    flat = kt.payload_from_tensors(tensors, L)
    assert flat.dtype == torch.uint8 and flat.numel() == L.payload_bytes
    back = kt.tensors_from_payload(bytearray(flat.numpy().tobytes()), L)
    assert all(torch.equal(back[n].view(torch.int16), tensors[n].view(torch.int16)) for n in tensors)
    with pytest.raises(K.errors.LayoutMismatchError):
        kt.payload_from_tensors({"a": tensors["a"]}, L)
