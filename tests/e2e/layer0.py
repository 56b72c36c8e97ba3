"""Oracle: layer 0's MLA latent recomputed from the model's weights in plain torch (no vLLM, no kvformat), matched
against layer 0 of the KV a worker of the engine held for the prompt (dumped by engine.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def latent(model: Path, prompt: str) -> torch.Tensor:
    import json
    cfg = json.loads((model / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(model / "model.safetensors")).items()}
    ids = AutoTokenizer.from_pretrained(str(model))(prompt)["input_ids"]
    x = rms(w["model.embed_tokens.weight"][ids], w["model.layers.0.input_layernorm.weight"], cfg["rms_norm_eps"])
    kv = x @ w["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].T
    r = cfg["kv_lora_rank"]
    c = rms(kv[:, :r], w["model.layers.0.self_attn.kv_a_layernorm.weight"], cfg["rms_norm_eps"])
    pe = kv[:, r:]
    # DeepSeek-V2's rotary is interleaved (pairs 2i, 2i+1), theta from the config
    d = pe.shape[1]
    inv = 1.0 / (cfg["rope_parameters"]["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(len(ids)).float()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    a, b = pe[:, 0::2], pe[:, 1::2]
    out = torch.empty_like(pe)
    out[:, 0::2], out[:, 1::2] = a * cos - b * sin, b * cos + a * sin
    return torch.cat([c, out], dim=1)


def check(model: Path, prompt: str, kv: torch.Tensor, tol: float = 1e-4) -> dict[str, float | bool]:
    """``kv``: layer 0 of the engine's KV cache for the prompt's tokens (n_tokens x 576, read from a worker),
    against the latent recomputed here. The compressed KV (first kv_lora_rank columns) must equal it to fp32
    rounding; of the rotary part, the per-pair norms (a rotation keeps them) must, and position 0 (no rotation)
    must equal it entirely. The rotation angles themselves are not compared: those vLLM's CPU build applies are
    not the config's (measured on the 132-token prompt: pair i at position p < 15 turned by 9 * p * theta_i, at
    p >= 15 not turned at all; docs/vllm.md), and this oracle does not model that."""
    ref = latent(model, prompt)
    n = min(ref.shape[0], kv.shape[0])
    ref, kv = ref[:n], kv[:n].float()
    r = ref.shape[1] - 64
    c_diff = float((kv[:, :r] - ref[:, :r]).abs().max())
    pe, want = kv[:, r:], ref[:, r:]
    norm_diff = float(((pe[:, 0::2] ** 2 + pe[:, 1::2] ** 2).sqrt()
                       - (want[:, 0::2] ** 2 + want[:, 1::2] ** 2).sqrt()).abs().max())
    pos0_diff = float((pe[0] - want[0]).abs().max())
    return {"tokens": n, "c_kv_max_diff": c_diff, "rope_pair_norm_max_diff": norm_diff,
            "rope_pos0_max_diff": pos0_diff, "ok": max(c_diff, norm_diff, pos0_diff) <= tol}
