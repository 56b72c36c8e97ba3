"""Legacy vLLM fs-tier trees written by hand, byte for byte as vLLM's FileMapper + fs tier lay them out.

(test_compact_vllm.py checks the naming against vLLM's own FileMapper and writes trees with vLLM's
real fs tier; these hand-built trees keep the CLI tests fast and vLLM-free.)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from kvformat.legacy import ROW_ALIGN, legacy_fields, legacy_paths, write_legacy_row

MODEL = "deepseek-ai/DeepSeek-V2-Lite"
PAD_BYTE = 0xA5


def layer_names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def block_hash(i: int, salt: str = "") -> str:
    return hashlib.sha256(f"{salt}/{i}".encode()).hexdigest()


def payload(seed: int | str, n: int) -> bytes:
    s = int.from_bytes(hashlib.sha256(str(seed).encode()).digest()[:8], "little")
    return np.random.default_rng(s).integers(0, 256, n, dtype=np.uint8).tobytes()


@dataclass
class Tree:
    root: str
    fields: dict
    slot_bytes: int
    row_bytes: int
    copies: int
    payloads: dict[str, bytes] = field(default_factory=dict)  # hash -> canonical slot bytes
    paths: dict[str, str] = field(default_factory=dict)  # hash -> file path

    def row(self, p: bytes, slots: list[bytes] | None = None) -> bytes:
        body = b"".join(slots) if slots is not None else p * self.copies
        return body + bytes([PAD_BYTE]) * (self.row_bytes - len(body))


def build(root: str, *, n_files: int = 6, n_layers: int = 4, tp: int = 4, replicated: bool = False,
          bpf: int = 1, tpb: int = 16, width: int = 576, dtype: str = "bfloat16", itemsize: int = 2,
          salt: str = "", model: str = MODEL, pp: int = 1, group: int = 0) -> Tree:
    names = layer_names(n_layers)
    f = legacy_fields(model, tokens_per_hash=tpb, blocks_per_file=bpf, dtype=dtype,
                      kv_cache_groups=[{"tokens_per_block": tpb, "layer_names": names}] * (group + 1),
                      tp=tp, pp=pp, replicated=replicated)
    slot = n_layers * tpb * width * itemsize * bpf
    copies = 1 if replicated else tp * pp
    row = -(-slot * copies // ROW_ALIGN) * ROW_ALIGN
    t = Tree(root, f, slot, row, copies)
    for i in range(n_files):
        h = block_hash(i, salt)
        p = payload(f"{salt}{i}", slot)
        t.payloads[h] = p
        t.paths[h] = write_legacy_row(root, f, h, t.row(p), group=group)
    return t


def config_dir(t: Tree) -> str:
    import os

    return os.path.dirname(legacy_paths(t.root, t.fields, "00" * 32)[0])
