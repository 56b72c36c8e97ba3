"""vLLM's MLA layers report ``cache_dtype_str="auto"`` when ``--kv-cache-dtype`` is left at its default: the KV is
the model's dtype. Recorded verbatim, "auto" gave every default deployment's layout a ``roles`` entry
``["mla", "auto"]`` and so a namespace that `kvformat compact` (and every other writer that knows the true dtype)
never computes: a compacted vLLM fs-tier tree was a miss for the tier that should read it (found by tools/e2e.sh on
a real engine). The spec objects are vLLM's own."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM is installed by tools/setup.sh")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: E402

from kvformat.vllm import _facts  # noqa: E402

NAME = "model.layers.0.self_attn.attn"


def _spec(cache_dtype_str: str | None) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.bfloat16,
                            cache_dtype_str=cache_dtype_str)


def test_auto_is_the_model_dtype_not_a_role_of_its_own() -> None:
    auto = _facts._layer_fact(NAME, _spec("auto"), None, 0, 64, "bfloat16", (MLAAttentionSpec,))
    unset = _facts._layer_fact(NAME, _spec(None), None, 0, 64, "bfloat16", (MLAAttentionSpec,))
    assert not isinstance(auto, str) and auto == unset
    assert auto.kv_dtype == "bfloat16" and auto.role == "mla"
